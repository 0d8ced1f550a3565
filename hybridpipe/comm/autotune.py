"""Engine autotuning (``HYBRIDPIPE_AUTOTUNE=1``, Horovod's HOROVOD_AUTOTUNE): during the first steps of
training, try fusion thresholds and cycle times, keep the fastest.

What is measured: the time between two consecutive ``DistributedOptimizer.step()`` calls, i.e. a whole
training step (forward, backward, the reductions that did not hide behind it, the update). A trial runs
one setting for ``autotune_steps_per_sample`` steps after ``autotune_warmup_samples`` unmeasured ones
(the first trial) or one unmeasured step (the step during which the setting changed); its time is the
median of those steps on this rank, then the maximum over every rank (one small allreduce per trial),
so every rank sees the same number and makes the same choice without a broadcast.

The search is a documented coordinate search rather than Bayesian optimisation: with two knobs and a
handful of useful values each, a sweep of one knob at the current value of the other, then of the
other at the best of the first, costs 11 trials and finds what a Gaussian-process search would on
curves this flat; a library (scikit-optimize is unmaintained, optuna is a large dependency for two
knobs) would add nothing measurable. Order:

1. the fusion thresholds 1, 2, 4, 8, 16, 32 and 64 MiB at the configured cycle time;
2. the cycle times 0.25, 0.5, 1, 2 and 5 ms at the best threshold (the pair already timed is reused);
3. the best pair is set for the rest of the run.

A setting changes through the engine (``Engine.submit_tuning``): a call queued on the world group, so
every rank switches between the same two operations of the engine's sequence and buckets are cut
with the same threshold everywhere. ``HYBRIDPIPE_AUTOTUNE_LOG=file.csv`` makes rank 0 write one row per
trial (and a last row with the choice).
"""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path
from typing import Any

from . import context
from ..collectives.allreduce import allreduce_nograd
from ..collectives.common import Max

MIB = 1 << 20
FUSION_THRESHOLDS = [1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 64 * MIB]
CYCLE_TIMES_MS = [0.25, 0.5, 1.0, 2.0, 5.0]
COLUMNS = ["trial", "phase", "fusion_threshold_bytes", "cycle_time_ms", "step_seconds", "best_step_seconds"]


class Autotuner:
    """Drives the search; ``on_step()`` is called after every DistributedOptimizer step (every rank)."""

    def __init__(self, state: Any) -> None:
        config = state.config
        self._state = state
        self.warmup = int(config.autotune_warmup_samples)
        self.steps_per_sample = int(config.autotune_steps_per_sample)
        self.log_path = config.autotune_log
        self.initial = (int(config.fusion_threshold_bytes), float(config.cycle_time_ms))
        self.trials: list[dict[str, Any]] = []
        self.done = False
        self.chosen: tuple[int, float] | None = None
        self._plan = [("fusion", fusion, self.initial[1]) for fusion in FUSION_THRESHOLDS]
        self._phase_two_planned = False
        self._current = self.initial
        self._last: float | None = None
        self._skip = self.warmup
        self._times: list[float] = []
        if self.log_path and state.grid.rank == 0:
            path = Path(self.log_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", newline="") as stream:
                csv.writer(stream).writerow(COLUMNS)
        self._apply(self._plan[0][1], self._plan[0][2])

    def _apply(self, fusion: int, cycle: float) -> None:
        state = self._state
        group_id = state.engine_group("world", "autotune")
        name = f"hybridpipe.autotune.{len(self.trials)}.{fusion}.{cycle}"
        handle = context.queue(state, group_id, name, "autotune",
                               lambda: state.engine.submit_tuning(group_id, name, fusion, cycle), None, lambda: None)
        handle.wait()
        self._current = (fusion, cycle)

    def _log(self, row: dict[str, Any]) -> None:
        if self.log_path and self._state.grid.rank == 0:
            with Path(self.log_path).open("a", newline="") as stream:
                csv.writer(stream).writerow([row[c] for c in COLUMNS])

    def on_step(self) -> None:
        if self.done:
            return
        now = time.monotonic()
        last, self._last = self._last, now
        if last is None:
            return
        if self._skip > 0:
            self._skip -= 1
            return
        self._times.append(now - last)
        if len(self._times) < self.steps_per_sample:
            return
        self._finish_trial()

    def _finish_trial(self) -> None:
        import torch

        mine = statistics.median(self._times)
        self._times = []
        agreed = float(allreduce_nograd(torch.tensor([mine], dtype=torch.float64), op=Max, group="world")[0])
        phase, fusion, cycle = self._plan.pop(0)
        best = min([t["step_seconds"] for t in self.trials] + [agreed])
        row = {"trial": len(self.trials), "phase": phase, "fusion_threshold_bytes": fusion, "cycle_time_ms": cycle,
               "step_seconds": agreed, "best_step_seconds": best}
        self.trials.append(row)
        self._log(row)
        if not self._plan and not self._phase_two_planned:
            self._phase_two_planned = True
            best_fusion = min((t for t in self.trials if t["phase"] == "fusion"),
                              key=lambda t: t["step_seconds"])["fusion_threshold_bytes"]
            self._plan = [("cycle", best_fusion, c) for c in CYCLE_TIMES_MS
                          if not any(t["fusion_threshold_bytes"] == best_fusion and t["cycle_time_ms"] == c
                                     for t in self.trials)]
        if self._plan:
            self._apply(self._plan[0][1], self._plan[0][2])
            self._skip = 1  # the step during which the setting changed is not measured
            return
        winner = min(self.trials, key=lambda t: t["step_seconds"])
        self.chosen = (int(winner["fusion_threshold_bytes"]), float(winner["cycle_time_ms"]))
        self._apply(*self.chosen)
        self._log({"trial": "chosen", "phase": "final", "fusion_threshold_bytes": self.chosen[0],
                   "cycle_time_ms": self.chosen[1], "step_seconds": winner["step_seconds"],
                   "best_step_seconds": winner["step_seconds"]})
        self.done = True


def step() -> None:
    """After a DistributedOptimizer step: drives the engine's autotuning when HYBRIDPIPE_AUTOTUNE is on.
    Every rank calls it once per step."""
    state = context.current_or_none()
    if state is None or not state.config.autotune:
        return
    state.slot(Autotuner, lambda: Autotuner(state)).on_step()

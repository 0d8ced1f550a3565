"""Where a pipeline step's time goes on one rank, per action kind: the executor's own cost, named.

``PipelineModel(...).executor_profile`` (on when ``HYBRIDPIPE_PROFILE_EXECUTOR=1``, or after
``model.profile_executor(True)``) adds up, for every action the executor ran since the last reset:

* ``seconds``: the action's handler, start to end (what the schedule's loop spends on it);
* ``wait``: in it, waiting for a receive (an activation, a gradient, a skip) to arrive;
* ``send``: in it, posting sends (packing the header and the payload, handing them to MPI);
* ``compute``: in it, the chunk's forward (and loss) and autograd's backward, a re-materialized forward
  included;
* ``python``: the rest — the executor's own bookkeeping per action, the number to drive down;
* ``wait_cpu`` and ``compute_cpu``: the calling thread's CPU time (``time.thread_time``) inside the waits and
  the computes. Their ratios to the wall times are the cores a waiting rank burns (its polite wait's spins and
  wake-ups, which take time slices from the ranks computing beside it where ranks outnumber cores) and the share
  of a core a computing rank gets (below 1: it was descheduled, its host's cores were oversubscribed).

Beside the actions: ``progress`` (between actions: polling the posted receives), ``tail`` (after the last
action: the losses shared from the last stage, the sends drained) and ``steps``. Each rank measures its own; a
benchmark gathers them (bench/pipeline.py ``--profile-executor``). The clocks cost two ``perf_counter`` calls per
measured interval and nothing when off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["ActionCost", "ExecutorProfile"]

_PARTS = ("wait", "send", "compute")


@dataclass
class ActionCost:
    """One action kind's totals (seconds) over the profiled steps."""

    count: int = 0
    seconds: float = 0.0
    wait: float = 0.0
    send: float = 0.0
    compute: float = 0.0
    wait_cpu: float = 0.0
    send_cpu: float = 0.0
    compute_cpu: float = 0.0

    @property
    def python(self) -> float:
        """The handler's time that is none of waiting, sending and computing."""
        return max(0.0, self.seconds - self.wait - self.send - self.compute)


@dataclass
class ExecutorProfile:
    """The per-action-kind costs of one rank's executor (see the module docstring)."""

    kinds: dict[str, ActionCost] = field(default_factory=dict)
    progress: float = 0.0
    tail: float = 0.0
    steps: int = 0
    _current: ActionCost | None = field(default=None, repr=False, compare=False)

    def begin(self, kind: str) -> float:
        self._current = self.kinds.setdefault(kind, ActionCost())
        return time.perf_counter()

    def end(self, started: float) -> None:
        current, self._current = self._current, None
        if current is not None:
            current.count += 1
            current.seconds += time.perf_counter() - started

    def add(self, part: str, seconds: float, cpu: float = 0.0) -> None:
        """``seconds`` of ``part`` ("wait", "send" or "compute") inside the running action (outside any: none),
        ``cpu`` of them the thread's own CPU time."""
        if self._current is not None:
            setattr(self._current, part, getattr(self._current, part) + seconds)
            setattr(self._current, part + "_cpu", getattr(self._current, part + "_cpu") + cpu)

    def cores(self, part: str) -> float:
        """The thread's CPU seconds per wall second in ``part`` ("wait", "send" or "compute") over every action
        kind: 0.0 when none was timed."""
        wall = sum(getattr(cost, part) for cost in self.kinds.values())
        return sum(getattr(cost, part + "_cpu") for cost in self.kinds.values()) / wall if wall > 0 else 0.0

    def reset(self) -> None:
        self.kinds, self.progress, self.tail, self.steps, self._current = {}, 0.0, 0.0, 0, None

    def rows(self) -> list[dict[str, float]]:
        """One row per action kind, per step and per action, in milliseconds (what bench/pipeline.py prints)."""
        rows = []
        for kind, cost in sorted(self.kinds.items()):
            per = 1e3 / max(cost.count, 1)
            rows.append({"kind": kind, "actions_per_step": cost.count / max(self.steps, 1),
                         "ms_per_action": cost.seconds * per, "wait_ms": cost.wait * per,
                         "send_ms": cost.send * per, "compute_ms": cost.compute * per,
                         "python_ms": cost.python * per, "wait_cpu_ms": cost.wait_cpu * per,
                         "compute_cpu_ms": cost.compute_cpu * per})
        return rows

    def __str__(self) -> str:
        header = ["action", "per step", "ms each", "wait", "send", "compute", "python", "wait cpu", "compute cpu"]
        body = [[row["kind"], f"{row['actions_per_step']:.1f}", f"{row['ms_per_action']:.3f}", f"{row['wait_ms']:.3f}",
                 f"{row['send_ms']:.3f}", f"{row['compute_ms']:.3f}", f"{row['python_ms']:.3f}",
                 f"{row['wait_cpu_ms']:.3f}", f"{row['compute_cpu_ms']:.3f}"]
                for row in self.rows()]
        steps = max(self.steps, 1)
        body.append(["between actions", "", f"{self.progress * 1e3 / steps:.3f}", "", "", "", "", "", ""])
        body.append(["after the last", "", f"{self.tail * 1e3 / steps:.3f}", "", "", "", "", "", ""])
        widths = [max(len(c) for c in column) for column in zip(header, *body)]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        return "\n".join([f"executor profile over {self.steps} steps (ms; per action but the last two rows: per "
                          f"step; cores while waiting {self.cores('wait'):.2f}, while computing "
                          f"{self.cores('compute'):.2f})", line(header), *(line(row) for row in body)])

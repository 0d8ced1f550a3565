"""``hp.auto(verify=True)``: the predicted best plans measured on the job's own ranks; the fastest measured is kept.

Design reasons:

* A cost model is trusted only as far as it was checked. PipeDream kept the plan its model chose; here the
  best few plans of the search (:func:`hybridpipe.plan.search.plans`: the choice, then the best on other grids)
  each run a handful of real steps, and the one measured fastest is kept, with every prediction set beside its
  measurement. A planted error in the cost model (a slow plan predicted fastest) is caught by it.
* Every trial builds its own model and optimizer from what ``hp.auto`` got: ``hp.LayerSpec`` entries are built
  anew, built modules (and a whole ``nn.Module``) are deep-copied, the optimizer comes from the factory, and the
  CPU random state is restored after each trial, so the model ``hp.auto`` returns starts exactly as without the
  check (same weights, fresh optimizer state).
* Timing is collective: each step's time is the slowest rank's, every rank gets the same list (one allgather per
  step), so every rank keeps the same plan; the time budget is checked on those agreed numbers too.
* The trials feed each replica the profiling sample repeated to its share of the global batch: a step's time
  depends on the shapes, not the values.
* Training goes on measuring (:class:`StepClock`): a gradient sync that registers for no parameter (so no gradient
  hook) hears when each step's first forward begins; the time from one step's start to the next's (the step as
  the training loop runs it, optimizer and ``zero_grad`` included, and whatever the loop does between steps) after
  :data:`VERIFY_WARMUP` steps gives this rank's ``plan.measured_seconds``, without a collective.
"""

from __future__ import annotations

import collections
import gc
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from hybridpipe import runtime
from hybridpipe.comm.agree import agree_on_failure
from hybridpipe.comm.engine import call
from hybridpipe.comm.process_sets import remove_process_set
from hybridpipe.errors import HybridPipeError, UsageError, warn_user
from hybridpipe.gradient_sync import GradientSync, Unit
from hybridpipe.pipeline.microbatch import iter_tensors, map_tensors
from hybridpipe.plan.search import Plan

__all__ = ["StepClock", "measure_plans", "on_grid_of", "report", "accuracy_warning", "tiled", "VERIFY_WARMUP",
           "WARN_ERROR", "RECHECK_MARGIN", "rechecked"]

VERIFY_WARMUP = 2  # untimed steps of each trial (first-touch allocations, the engine's caches)
RECHECK_MARGIN = 0.10  # a runner-up measured this close to the fastest is measured again, as is the fastest
WARN_ERROR = 0.25  # a measured step this far from the prediction (of the measured) is warned about
CLOCK_STEPS = 200  # the training steps whose median is plan.measured_seconds (the latest)
CLOCK_WARN_AFTER = 5  # measured steps before the training's median is compared with the prediction


def tiled(value: Any, size: int) -> Any:
    """``value``'s tensors that carry the batch (first dimension of the first batched tensor) repeated along it to
    ``size`` samples; the others as they are."""
    batch = next((t.shape[0] for t in iter_tensors(value) if t.dim() > 0), 0)
    if batch in (0, size):
        return value

    def grow(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != batch:
            return t
        return t.repeat(-(-size // batch), *([1] * (t.dim() - 1)))[:size]

    return map_tensors(value, grow)


def _replica_samples(plan: Plan) -> int:
    """Samples a rank of ``plan`` is fed per step: its replica's share (own replica counts: the whole batch)."""
    return plan.global_batch if plan.stage_replicas else plan.global_batch // plan.replicas


def _agreed(world: Any, values: tuple[float, float]) -> tuple[float, float]:
    """The largest of every rank's ``values``, element by element (collective)."""
    every = call(None, "hp.auto verify", lambda: world.allgather(values))
    return max(v[0] for v in every), max(v[1] for v in every)


def on_grid_of(plan: Plan) -> None:
    """The job re-made with ``plan``'s grid where it runs another (``runtime.regrid``; collective)."""
    wanted = tuple(plan.stage_replicas) if plan.stage_replicas else (plan.replicas,) * plan.stages
    if runtime.job("auto").grid.stage_replicas != wanted:
        runtime.regrid("auto", **plan.init_arguments())


def _trial(plan: Plan, build: Callable[[Plan], tuple[Any, Any]], sample: tuple[Any, Any], steps: int,
           started: float, budget: float) -> list[float]:
    """One plan's measured steps (each the slowest rank's), on its grid; stops early once the budget is spent
    (after one timed step at least)."""
    on_grid_of(plan)
    job = runtime.job("auto")
    world = job.grid.world_comm
    registered = set(job.process_sets.entries)  # a trial's own sets (tied weights') go with its model
    size = _replica_samples(plan)
    inputs, targets = tiled(sample[0], size), tiled(sample[1], size)
    times: list[float] = []
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = agree_on_failure(world, lambda: build(plan), what="hp.auto verify")

        def step() -> float:
            began = time.perf_counter()
            opt.zero_grad()
            model.train_step(inputs, targets)
            opt.step()
            return time.perf_counter() - began

        try:
            for index in range(VERIFY_WARMUP + steps):
                local = agree_on_failure(world, step, what=f"hp.auto verify ({plan.describe()})")
                seconds, elapsed = _agreed(world, (local, time.perf_counter() - started))
                if index >= VERIFY_WARMUP:
                    times.append(seconds)
                    if elapsed > budget:
                        break
        finally:
            model.close()
            del model, opt
            gc.collect()
            _remove_sets_since(job, registered)
    return times


def _remove_sets_since(job: Any, registered: set[int]) -> None:
    """Unregisters the process sets registered since ``registered`` (their ids; collective: every rank ran the same
    trial), so that the next trial or the kept plan can re-make the grid (``runtime.regrid`` refuses while sets
    made on the old grid are registered)."""
    for set_id in sorted(set(job.process_sets.entries) - registered):
        remove_process_set(job.process_sets.entries[set_id].objects[0])


def measure_plans(plans: list[Plan], build: Callable[[Plan], tuple[Any, Any]], sample: tuple[Any, Any],
                  steps: int, budget_seconds: float) -> tuple[Plan, float]:
    """Runs each of ``plans`` for ``steps`` timed steps (after :data:`VERIFY_WARMUP`), the first always, the others
    while ``budget_seconds`` lasts; then, while it lasts, the fastest and a runner-up measured within
    :data:`RECHECK_MARGIN` of it run ``steps`` more each (the runner-up first: a close call is decided on twice the
    steps, not on one noisy handful). Returns the fastest measured (the median of all its timed steps; its
    ``measured_seconds`` and ``verification`` set: every plan's prediction and measurement) and the seconds the
    check took. Collective over the job."""
    started = time.perf_counter()
    world = runtime.job("auto").grid.world_comm
    sample = call(None, "hp.auto verify", lambda: world.bcast(sample, root=0))  # every stage the same batch
    rows: list[dict[str, Any]] = []
    timed: dict[int, list[float]] = {}

    def spent() -> float:  # on the grid of the latest trial (each re-makes the job's communicators)
        return _agreed(runtime.job("auto").grid.world_comm, (0.0, time.perf_counter() - started))[1]

    def run(index: int) -> None:
        try:
            more = _trial(plans[index], build, sample, steps, started, budget_seconds)
        except HybridPipeError as error:  # raised on every rank alike: a plan the runtime refuses is not kept
            rows[index]["error"] = str(error)
            return
        timed.setdefault(index, []).extend(more)
        rows[index].update(measured_seconds=statistics.median(timed[index]), steps=len(timed[index]))

    for index, plan in enumerate(plans):
        rows.append({"plan": plan.describe(), "predicted_seconds": plan.step_seconds, "measured_seconds": None,
                     "steps": 0, "kept": False})
        if all(row["measured_seconds"] is None for row in rows) or spent() <= budget_seconds:
            run(index)
    for index in rechecked(rows):
        if spent() <= budget_seconds:
            run(index)
    measured = [i for i, row in enumerate(rows) if row["measured_seconds"] is not None]
    if not measured:
        raise UsageError("hp.auto verify: none of the plans measured could be built: " + "; ".join(
            f"{row['plan']}: {row.get('error', 'not measured (time budget spent)')}" for row in rows))
    fastest = min(measured, key=lambda i: rows[i]["measured_seconds"])
    rows[fastest]["kept"] = True
    kept = plans[fastest]
    kept.measured_seconds, kept.verification = rows[fastest]["measured_seconds"], rows
    return kept, time.perf_counter() - started


def rechecked(rows: list[dict[str, Any]]) -> list[int]:
    """The plans measured again after the first pass, in order: the runner-up, then the fastest, when the runner-up
    measured within :data:`RECHECK_MARGIN` of the fastest; none otherwise."""
    measured = sorted((row["measured_seconds"], i) for i, row in enumerate(rows) if row["measured_seconds"] is not None)
    if len(measured) < 2 or measured[1][0] > measured[0][0] * (1 + RECHECK_MARGIN):
        return []
    return [measured[1][1], measured[0][1]]


def report(plan: Plan, seconds: float, budget_seconds: float) -> str:
    """The verification as lines: each plan tried, predicted against measured, and which was kept."""
    lines = [f"hp.auto measured {sum(row['measured_seconds'] is not None for row in plan.verification)} of "
             f"{len(plan.verification)} plans in {seconds:.1f} s (verify_seconds={budget_seconds:g}):"]
    for row in plan.verification:
        predicted = row["predicted_seconds"] * 1e3
        if "error" in row:
            lines.append(f"        {row['plan']}: predicted {predicted:.1f} ms, not built ({row['error']})")
            continue
        if row["measured_seconds"] is None:
            lines.append(f"        {row['plan']}: predicted {predicted:.1f} ms, not measured (time budget spent)")
            continue
        measured = row["measured_seconds"] * 1e3
        lines.append(f"  {'kept' if row['kept'] else '    '}  {row['plan']}: predicted {predicted:.1f} ms, measured "
                     f"{measured:.1f} ms (predicted {(predicted - measured) / measured:+.0%}, {row['steps']} steps)")
    return "\n".join(lines)


def accuracy_warning(plan: Plan) -> str | None:
    """A warning's text when ``plan.measured_seconds`` differs from its prediction by more than :data:`WARN_ERROR`,
    naming the prediction's biggest term; None when within it or not measured."""
    measured, predicted = plan.measured_seconds, plan.step_seconds
    if measured is None or measured <= 0 or abs(predicted - measured) <= WARN_ERROR * measured:
        return None
    terms = {"the pipeline's makespan (the profiled compute, the transfers and the bubble)": 0.0,
             "the reduction and optimizer step after it": 0.0}
    if plan.prediction is not None:
        terms = {"the pipeline's makespan (the profiled compute, the transfers and the bubble)":
                 plan.prediction.pipeline_seconds,
                 "the reduction and optimizer step after it": plan.prediction.exposed_allreduce_seconds}
    name, seconds = max(terms.items(), key=lambda item: item[1])
    error = (predicted - measured) / measured
    return (f"hp.auto: the plan's predicted step, {predicted * 1e3:.1f} ms, is {abs(error):.0%} "
            f"{'below' if error < 0 else 'above'} its measured median, {measured * 1e3:.1f} ms ({plan.describe()}); "
            f"the prediction's biggest term is {name}, {seconds * 1e3:.1f} ms. Calibrate the job's cluster "
            "(hp.auto(..., calibrate=True), or hybridpipe-run ... python -m hybridpipe.plan calibrate --output "
            "cluster.json and hp.auto(..., cluster=load_cluster('cluster.json'))) and profile on a sample of one "
            "micro-batch's size")


class StepClock(GradientSync):
    """Keeps ``plan.measured_seconds`` the median of this rank's latest :data:`CLOCK_STEPS` training steps (start to
    start, after :data:`VERIFY_WARMUP`), and warns once (where ``warn``) when it is more than :data:`WARN_ERROR` from
    the prediction after :data:`CLOCK_WARN_AFTER` of them, unless the verification already did. Register it with a
    synchronous pipeline for no parameters: ``model.register_gradient_sync(StepClock(plan), parameters=[])``."""

    def __init__(self, plan: Plan, warn: bool, warned: bool = False) -> None:
        self.plan, self.warn, self.warned = plan, warn, warned
        self.steps = 0
        self._armed, self._last = True, None
        self._intervals: collections.deque[float] = collections.deque(maxlen=CLOCK_STEPS)

    def forward_begins(self, unit: Unit) -> None:
        if not self._armed:
            return
        self._armed, now = False, time.perf_counter()
        self.steps += 1
        if self._last is not None and self.steps > VERIFY_WARMUP + 1:
            self._intervals.append(now - self._last)
            self.plan.measured_seconds = statistics.median(self._intervals)
            if len(self._intervals) == CLOCK_WARN_AFTER and self.warn and not self.warned:
                text = accuracy_warning(self.plan)
                if text is not None:
                    self.warned = True
                    warn_user(f"{text} (in training: this rank's median of {CLOCK_WARN_AFTER} steps)")
        self._last = now

    def step_ends(self) -> None:
        self._armed = True

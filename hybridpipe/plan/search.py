"""The search: every configuration of a world of ranks, each balanced and costed; the best one is the plan.

Design reasons:

* Candidates are every (stages × replicas) factorization of the ranks, every micro-batch count
  that divides a replica's batch, every schedule (the synchronous ones unless asynchronous ones
  are allowed: those train differently from one process) and every re-materialization mode.
* A candidate's balance is the optimal contiguous partition of the profiled per-layer time
  (forward + backward) into its chunks — the dynamic programme of PipeDream's partitioner,
  :func:`hybridpipe.pipeline.partition.partition_by_weights` — and, with a memory limit, the
  memory-aware variant of it (each chunk's parameters, gradients, optimizer state and one
  micro-batch's activations within the limit).
* Each candidate is costed by :func:`hybridpipe.plan.cost.predict` (the schedule simulated); those
  over the memory limit are dropped with the reason kept for ``--explain``.
* Fast enough for a thousand ranks without giving up exactness (under the cost model): candidates
  are costed in the order of a cheap lower bound of their step time (the busiest rank's work, fill
  and drain)
  and the search stops once that bound passes the fastest few found; a re-materialization mode is
  costed only where the one before it does not fit (recomputing is never faster); a stage count
  whose weights and optimizer state alone exceed the limit is skipped; the partitioner is
  ``O(L² log L)`` per stage count and its balances are shared by all candidates of that count.
* ZeRO levels (``zero`` 1 and 2, where there are replicas and the schedule is synchronous) are
  costed beside ``zero=0`` for every candidate: sharding can be faster as well as smaller (the
  optimizer steps ``1/D`` of the parameters). ``zero=0`` keeps the win unless a sharded plan is
  faster by more than ``ZERO_MARGIN`` (the sharded step's own copies are not modelled), so a plan
  changes only for a real gain or to fit the memory.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from hybridpipe.errors import HybridPipeError, PartitionError, ScheduleError, UsageError
from hybridpipe.pipeline import schedule as sched
from hybridpipe.pipeline.partition import even_out_identical, partition_by_weights
from hybridpipe.plan.cost import (ZERO_LEVELS, Candidate, Cluster, Prediction,
                                  activation_factor, held_micro_batches, memory_per_rank, predict,
                                  profile_precision, step_lower_bound)
from hybridpipe.registry import RECOMPUTE_MODES
from hybridpipe.runtime import describe_stage_replicas, rank_of_place
from hybridpipe.plan.profile import Profile

__all__ = ["Plan", "plan", "plans", "format_bytes", "SYNCHRONOUS_CHOICES", "CHECKPOINT_CHOICES", "ZERO_MARGIN"]

SYNCHRONOUS_CHOICES = sched.SYNCHRONOUS
CHECKPOINT_CHOICES = tuple(RECOMPUTE_MODES)
INTERLEAVED_CHUNKS = 2
ZERO_MARGIN = 0.02  # a sharded plan must be this much faster than the best unsharded one to win
# stages with their own replica counts: every composition of the ranks into P counts while there are at most this many
# (8 ranks: all 63 with up to 4 stages); beyond, those whose counts are all 1 or 2 but one (PipeDream's "15-1",
# "14-2", "12-1-1-1", and the same with the large count elsewhere)
MAX_COMPOSITIONS = 64
# ... and with at most this many stages (PipeDream's published plans have 2-5: "15-1", "12-1-1-1-1"; a deep pipeline
# of single replicas is a uniform grid's job, and each stage count more costs the search a partition per composition)
MAX_REPLICATED_STAGES = 4
GRIDS = ("all", "data-parallel", "uniform", "stage-replicas")  # plan(grids=): the kinds of grid searched


@dataclass
class Plan:
    """The chosen configuration and its prediction.

    Attributes:
        stages, replicas, balance, micro_batches, schedule, checkpoint: what to build
            (``balance`` has one entry per chunk: ``virtual_stages × stages`` entries).
        virtual_stages: chunks per rank (``interleaved-1f1b``), else 1.
        zero: the ZeRO level of the stage's ``hp.DistributedOptimizer(..., zero=)`` (0: unsharded).
        split: for a module (not a layer list): the qualified module names where chunks 1, 2, ... begin
            (``hp.PipelineModel(module, split=...)``), from ``balance`` over its planner layers; else None.
        precision: the pipeline's precision it was planned for (``hp.PipelineModel(precision=)``).
        step_seconds: predicted time of one step (one global batch); also ``predicted_seconds``.
        lower_bound_seconds, measured_seconds, verification: see below.
        samples_per_second: ``global_batch / step_seconds``.
        memory_bytes_per_rank: predicted peak of the busiest rank.
        global_batch: the batch it was planned for.
        alternatives: the next best candidates, each with why it lost (``explain``).
        prediction: the cost model's details (pipeline makespan, allreduce, memory per rank), when searched.
    """

    stages: int
    replicas: int
    balance: list[int]
    micro_batches: int
    schedule: str
    checkpoint: str
    step_seconds: float
    samples_per_second: float
    memory_bytes_per_rank: float
    global_batch: int
    virtual_stages: int = 1
    zero: int = 0
    precision: str = "fp32"
    split: list[str] | None = None
    alternatives: list[tuple[str, str]] = field(default_factory=list)
    prediction: Prediction | None = field(default=None, repr=False, compare=False)
    #: stages with their own replica counts (``hp.init(stage_replicas=...)``), e.g. ``[3, 1]``; None: a uniform
    #: ``stages × replicas`` grid. With counts, ``replicas`` is 1 and every rank is fed the whole global batch.
    stage_replicas: list[int] | None = None
    #: the step no run of this configuration can beat, from the measured parts (``cost.step_lower_bound``);
    #: ``step_seconds`` is never below it. 0: not searched.
    lower_bound_seconds: float = 0.0
    #: the median measured step (``hp.auto``: from its verification, then the steps of the training after warm-up);
    #: None: not measured yet.
    measured_seconds: float | None = field(default=None, compare=False)
    #: ``hp.auto(verify=True)``'s measurements: per plan tried, ``{"plan", "predicted_seconds", "measured_seconds",
    #: "steps", "kept"}`` (``measured_seconds`` None where the time budget ran out before it).
    verification: list[dict] = field(default_factory=list, compare=False)

    @property
    def predicted_seconds(self) -> float:
        """The cost model's step time (``step_seconds``)."""
        return self.step_seconds

    @property
    def config(self) -> str:
        """PipeDream's name of the configuration: ``"3-1"``, ``"straight"``, ``"4"`` (data parallelism), or
        ``"2x2"`` for a uniform grid of several stages with replicas."""
        if self.stage_replicas:
            return describe_stage_replicas(self.stage_replicas)
        if self.stages > 1 and self.replicas > 1:
            return f"{self.stages}x{self.replicas}"
        return describe_stage_replicas([self.replicas] * self.stages)

    @property
    def ranks(self) -> int:
        """The ranks the plan is for."""
        return sum(self.stage_replicas) if self.stage_replicas else self.stages * self.replicas

    def communication(self, profile: Profile) -> list[str]:
        """For a grid with its own replica counts: what each stage holds and allreduces, what crosses each cut, and
        the bytes saved against data parallelism (every rank allreducing every parameter), per step."""
        if not self.stage_replicas:
            return []
        rank_of = rank_of_place(tuple(self.stage_replicas))
        starts = [sum(self.balance[:s]) for s in range(self.stages)]
        lines, reduced = [], 0.0
        for s, (start, count) in enumerate(zip(starts, self.balance)):
            kinds: dict[str, int] = {}
            for layer in profile.layers[start:start + count]:
                kinds[layer.name] = kinds.get(layer.name, 0) + 1
            weights = sum(layer.parameter_bytes for layer in profile.layers[start:start + count])
            replicas = self.stage_replicas[s]
            ranks = [rank_of[(s, r)] for r in range(replicas)]
            # a ring allreduce sends 2 (R - 1) / R of the bytes from each of the R replicas
            sent = 2 * (replicas - 1) * weights if replicas > 1 else 0.0
            reduced += sent
            what = (f"allreduced among its {replicas} replicas ({format_bytes(sent)} sent in all)" if replicas > 1
                    else "never allreduced (one replica)")
            lines.append(f"stage {s}: {replicas} replica(s) on ranks {ranks}, layers {start}..{start + count - 1} "
                         f"({', '.join(f'{n} {k}' for k, n in kinds.items())}): {format_bytes(weights)} of parameters, "
                         f"{what}")
            if s + 1 < self.stages:
                crossing = profile.layers[start + count - 1].output_bytes * self.global_batch
                lines.append(f"  cut after layer {start + count - 1}: {format_bytes(2 * crossing)} per step (activations "
                             "forward, their gradients back)")
        everything = sum(layer.parameter_bytes for layer in profile.layers)
        data_parallel = 2 * (self.ranks - 1) * everything
        lines.append(f"against data parallelism on {self.ranks} ranks ({format_bytes(data_parallel)} sent by its allreduces "
                     f"per step): {format_bytes(reduced)} sent by allreduces, "
                     f"{format_bytes(max(0.0, data_parallel - reduced))} fewer")
        return lines

    def init_arguments(self) -> dict:
        """Keyword arguments of ``hp.init`` that make this plan's grid."""
        if self.stage_replicas:
            return {"stage_replicas": list(self.stage_replicas)}
        return {"pipeline_stages": self.stages}

    def model_arguments(self) -> dict:
        """Keyword arguments of ``hp.PipelineModel`` that build this plan (a module's: ``split=`` for
        ``balance=``; pass ``sample=`` too)."""
        cut = {"split": list(self.split)} if self.split is not None else {"balance": list(self.balance)}
        arguments = {"micro_batches": self.micro_batches, **cut, "schedule": self.schedule,
                     "checkpoint": self.checkpoint}
        if self.virtual_stages > 1:
            arguments["virtual_stages"] = self.virtual_stages
        if self.precision != "fp32":
            arguments["precision"] = self.precision
        return arguments

    def optimizer_arguments(self) -> dict:
        """Keyword arguments of ``hp.DistributedOptimizer`` that this plan assumes (beyond the optimizer and
        ``named_parameters``): ``{"zero": level}`` when it shards, else none."""
        return {"zero": self.zero} if self.zero else {}

    def describe(self) -> str:
        grid = (f"{self.stages} stages with replicas {self.config}" if self.stage_replicas else
                f"{self.stages} stages × {self.replicas} replicas")
        return (f"{grid}, {self.schedule}"
                + (f" (v={self.virtual_stages})" if self.virtual_stages > 1 else "")
                + (f", zero={self.zero}" if self.zero else "")
                + (f", {self.precision}" if self.precision != "fp32" else "")
                + f", M={self.micro_batches}, checkpoint={self.checkpoint}, balance {list(self.balance)}"
                + (f", split {list(self.split)}" if self.split is not None else ""))


def _memory_balance(profile: Profile, cluster: Cluster, candidate: Candidate, per_replica: int,
                    time_per_layer: list[float], optimizer_state_factor: float, scale: float) -> Candidate | None:
    """The fastest balance whose every chunk keeps its parameters, gradients, optimizer state and the
    activations the schedule holds within the memory limit (partition.py's memory-aware partitioner),
    or None when no balance of this candidate fits."""
    micro = per_replica / candidate.micro_batches
    held = max(held_micro_batches(candidate.schedule, candidate.stages, candidate.micro_batches,
                                  candidate.virtual_stages))
    if candidate.checkpoint != "never":
        held = 1  # inputs only, plus one micro-batch being recomputed: bounded by one micro-batch's activations
    d, zero = candidate.replicas, candidate.zero
    memory = []
    for layer in profile.layers:  # per layer, as memory_per_rank counts a rank (ZeRO's buffers: at most its weights)
        weights, acts = layer.parameter_bytes, layer.activation_bytes * micro * held * scale
        if zero == 0:
            memory.append(weights * (2 + optimizer_state_factor) + acts)
        elif zero == 1:
            memory.append(weights * (2 + (2 + optimizer_state_factor) / d) + max(acts, weights))
        else:
            memory.append(weights * (1 + (2 + optimizer_state_factor) / d)
                          + max(acts + (weights if candidate.micro_batches > 1 else 0), weights))
    try:
        balance = partition_by_weights(time_per_layer, len(candidate.balance), memory=memory,
                                       memory_limit=cluster.memory_per_rank)
    except PartitionError:
        return None
    return dataclasses.replace(candidate, balance=tuple(balance))


def format_bytes(count: float) -> str:
    """``count`` bytes in the largest binary unit that keeps it >= 1 (e.g. ``"7.6 MiB"``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def _label(candidate: Candidate) -> str:
    grid = describe_stage_replicas(candidate.stage_replicas) if candidate.stage_replicas else \
        f"{candidate.stages}×{candidate.replicas}"
    return (f"{grid} {candidate.schedule}"
            + (f" v={candidate.virtual_stages}" if candidate.virtual_stages > 1 else "")
            + (f" zero={candidate.zero}" if candidate.zero else "")
            + f" M={candidate.micro_batches} checkpoint={candidate.checkpoint}")


def _divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def _candidates(profile: Profile, cluster: Cluster, global_batch: int, schedules: tuple[str, ...],
                max_micro_batches: int | None, balances: dict[int, tuple[int, ...]],
                time_per_layer: list[float]) -> list[Candidate]:
    """Every (stages, replicas, schedule, micro-batches) the schedules allow, balanced by time, with
    checkpoint="never" (the other modes are tried only where this one does not fit)."""
    layers = len(profile.layers)
    found = []
    for p in _divisors(cluster.ranks):
        d = cluster.ranks // p
        if p > layers or global_batch % d:
            continue
        per_replica = global_batch // d
        for schedule in schedules:
            described = sched.spec(schedule)
            v = INTERLEAVED_CHUNKS if described.chunks_per_rank else 1
            if (p == 1 and schedule != "1f1b") or p * v > layers:
                continue  # one stage: every schedule is the same gradient accumulation
            if p * v not in balances:
                balances[p * v] = tuple(partition_by_weights(time_per_layer, p * v))
            for m in _divisors(per_replica):
                if m > (max_micro_batches or max(64, 4 * p)):
                    break
                if described.chunks_per_rank and m % p:
                    continue  # Megatron's grouping (schedule.interleaved_one_f_one_b)
                if m < described.min_micro_batches(p):
                    continue
                found.append(Candidate(p, d, balances[p * v], m, schedule, "never", v))
    return found


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive counts, in order."""
    if parts == 1:
        return [(total,)]
    return [(first, *rest) for first in range(1, total - parts + 2) for rest in compositions(total - first, parts - 1)]


def _one_large(total: int, parts: int) -> list[tuple[int, ...]]:
    """The compositions of ``total`` into ``parts`` counts that are all 1 or 2 but one."""
    found = set()
    for small in itertools.product((1, 2), repeat=parts - 1):
        large = total - sum(small)
        if large >= 1:
            for where in range(parts):
                found.add((*small[:where], large, *small[where:]))
    return sorted(found)


def replicated_balance(times: list[float], counts: tuple[int, ...]) -> tuple[int, ...]:
    """The contiguous cut of layers (``times``: each layer's forward + backward) into ``len(counts)`` stages that
    minimizes the slowest stage's time per replica, ``sum(times of its layers) / counts[s]`` (PipeDream's
    partitioner with replication, for given counts); ties go to the earlier cut."""
    stages, n = len(counts), len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    # best[s][j]: the smallest bottleneck of layers 0..j-1 cut into stages 0..s-1; cut[s][j] where stage s-1 begins
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], (prefix[j] - prefix[i]) / counts[s - 1])
                if value < best[s][j] * (1 - 1e-12):
                    best[s][j], cut[s][j] = value, i
    bounds, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        bounds.append(j - i)
        j = i
    return tuple(reversed(bounds))


def _replica_candidates(profile: Profile, cluster: Cluster, global_batch: int, schedules: tuple[str, ...],
                        max_micro_batches: int | None, time_per_layer: list[float]) -> list[Candidate]:
    """Stages with their own replica counts: every composition of the ranks into 2..4 stages that is not uniform
    (those are the grids above), each cut by :func:`replicated_balance`, with every micro-batch count of the
    global batch from the largest count up."""
    found = []
    for p in range(2, min(len(profile.layers), cluster.ranks, MAX_REPLICATED_STAGES) + 1):
        if math.comb(cluster.ranks - 1, p - 1) <= MAX_COMPOSITIONS:
            ways = [c for c in compositions(cluster.ranks, p) if len(set(c)) > 1]
        else:
            ways = [c for c in _one_large(cluster.ranks, p) if len(set(c)) > 1]
        for counts in ways:
            balance = replicated_balance(time_per_layer, counts)
            for schedule in schedules:
                if schedule not in sched.REPLICA_SCHEDULES:
                    continue
                for m in _divisors(global_batch):
                    if m < max(counts):
                        continue
                    if m > (max_micro_batches or max(64, 4 * p)):
                        break
                    found.append(Candidate(p, 1, balance, m, schedule, "never", 1, 0, counts))
    return found


def plan(profile: Profile, cluster: Cluster, global_batch: int, *, schedules: tuple[str, ...] = SYNCHRONOUS_CHOICES,
         checkpoints: tuple[str, ...] = CHECKPOINT_CHOICES, max_micro_batches: int | None = None,
         optimizer_state_factor: float = 2.0, explain: int = 5, zero_levels: tuple[int, ...] = ZERO_LEVELS,
         precision: str | None = None, grids: str = "all") -> Plan:
    """The fastest configuration of ``cluster.ranks`` ranks for ``profile`` that fits the memory.

    The search is exact for the cost model but does not cost every candidate: candidates are taken in
    the order of a lower bound of their step time (the busiest rank's compute), and it stops when that
    bound exceeds the ``explain + 1``-th fastest step found; a re-materialization mode is tried only for
    candidates that do not fit without it (it is never faster in the model); and a stage count whose
    parameters and optimizer state alone exceed the memory limit is not tried at all. Every ZeRO level of
    ``zero_levels`` is costed for the candidates with replicas and a synchronous schedule; a sharded one
    wins only when it is faster than the best unsharded one by more than ``ZERO_MARGIN``, or when no
    unsharded one fits.

    Args:
        profile: Per-layer costs (:func:`hybridpipe.plan.profile`, or loaded from JSON).
        cluster: The ranks and their links (and ``memory_per_rank``, 0 for no limit).
        global_batch: Samples per step over all replicas.
        schedules: Schedules to consider (add ``schedule.ASYNCHRONOUS`` to allow the asynchronous ones).
        checkpoints: Re-materialization modes to consider.
        max_micro_batches: Largest micro-batch count tried (default: 64, or 4 per stage for deeper
            pipelines, whose bubble needs more).
        optimizer_state_factor: Optimizer state bytes per parameter byte (SGD 0, momentum 1, Adam 2).
        explain: How many runners-up to keep, with why each lost.
        zero_levels: ZeRO levels of ``hp.DistributedOptimizer(zero=)`` to consider where a stage has replicas
            and the schedule is synchronous (``(0,)``: never shard; ``(1,)``: always ZeRO-1 there). One
            replica is never sharded.
        precision: The pipeline's precision (``hp.PipelineModel(precision=)``; None: the profile's): "bf16" /
            "fp16" halve the activation bytes stored and sent (against an fp32 profile).
        grids: ``"all"`` (default), or only ``"data-parallel"`` (one stage), ``"uniform"`` (stages × replicas)
            or ``"stage-replicas"`` (stages with their own replica counts, ``hp.init(stage_replicas=)``, with
            ``schedule.REPLICA_SCHEDULES``): the best of one kind, to compare. Among all, a plan with its own replica
            counts wins only when faster than the best uniform one by more than ``ZERO_MARGIN`` (its grid is the
            less usual one).

    Raises:
        UsageError: no configuration is possible (the message says why, and what would fit).
    """
    costed, rejected, precision = _ranked_search(profile, cluster, global_batch, schedules, checkpoints,
                                                 max_micro_batches, optimizer_state_factor, explain + 1, zero_levels,
                                                 precision, grids)
    step, best, prediction = costed[0]

    def why(pr: Prediction) -> str:
        return (f"{pr.step_seconds / step:.3f}× the step time"
                + (f", {pr.memory_bytes / prediction.memory_bytes:.2f}× the memory" if prediction.memory_bytes else "")
                + (f" (sharded, faster by less than the {ZERO_MARGIN:.0%} margin)" if pr.step_seconds < step else ""))

    limit = cluster.memory_per_rank
    alternatives = [(_label(c), why(pr)) for _, c, pr in costed[1:1 + explain]]
    alternatives += [(_label(c), f"needs {format_bytes(memory)} per rank, over the "
                                 f"{format_bytes(limit)} limit")
                     for c, memory in sorted(rejected, key=lambda item: item[1])[:max(0, explain - len(alternatives))]]
    return _plan_of(best, prediction, global_batch, precision, alternatives)


def plans(profile: Profile, cluster: Cluster, global_batch: int, count: int = 3, *,
          schedules: tuple[str, ...] = SYNCHRONOUS_CHOICES, checkpoints: tuple[str, ...] = CHECKPOINT_CHOICES,
          max_micro_batches: int | None = None, optimizer_state_factor: float = 2.0,
          zero_levels: tuple[int, ...] = ZERO_LEVELS, precision: str | None = None, grids: str = "all") -> list[Plan]:
    """The ``count`` best configurations to measure (``hp.auto(verify=True)``), :func:`plan`'s choice first, the
    others each on a grid none before it has (stages, replicas, own replica counts) while the runners-up offer one,
    then the next fastest: a measurement learns most from plans that differ in how they cut the ranks. Arguments as
    :func:`plan`'s; each plan's ``alternatives`` is empty."""
    if count < 1:
        raise UsageError(f"plans: count must be >= 1 (got {count})")
    costed, _, precision = _ranked_search(profile, cluster, global_batch, schedules, checkpoints, max_micro_batches,
                                          optimizer_state_factor, max(6, 3 * count), zero_levels, precision, grids,
                                          per_grid=count > 1)
    chosen = [costed[0]]
    rest = costed[1:]
    while rest and len(chosen) < count:
        seen = {_grid_of(c) for _, c, _ in chosen}
        index = next((i for i, (_, c, _) in enumerate(rest) if _grid_of(c) not in seen), 0)
        chosen.append(rest.pop(index))
    return [_plan_of(c, pr, global_batch, precision, []) for _, c, pr in chosen]


def _grid_of(candidate: Candidate) -> tuple:
    return candidate.stages, candidate.replicas, candidate.stage_replicas


def _plan_of(best: Candidate, prediction: Prediction, global_batch: int, precision: str,
             alternatives: list[tuple[str, str]]) -> Plan:
    return Plan(stages=best.stages, replicas=best.replicas, balance=list(best.balance),
                micro_batches=best.micro_batches, schedule=best.schedule, checkpoint=best.checkpoint,
                step_seconds=prediction.step_seconds, samples_per_second=prediction.samples_per_second,
                memory_bytes_per_rank=prediction.memory_bytes, global_batch=global_batch,
                virtual_stages=best.virtual_stages, zero=best.zero, precision=precision, alternatives=alternatives,
                prediction=prediction, stage_replicas=list(best.stage_replicas) or None,
                lower_bound_seconds=prediction.lower_bound_seconds)


def _ranked_search(profile: Profile, cluster: Cluster, global_batch: int, schedules: tuple[str, ...],
                   checkpoints: tuple[str, ...], max_micro_batches: int | None, optimizer_state_factor: float,
                   keep: int, zero_levels: tuple[int, ...], precision: str | None, grids: str,
                   per_grid: bool = False) -> tuple[list[tuple[float, Candidate, Prediction]],
                                                    list[tuple[Candidate, float]], str]:
    """The search of :func:`plan`: the costed candidates ranked (at least the ``keep`` fastest, and with
    ``per_grid`` the fastest of every grid too), those rejected for memory, and the precision planned for."""
    precision = _checked(profile, cluster, global_batch, schedules, checkpoints, zero_levels, precision, grids)
    # identical layers (same class and sizes) weigh the same: their cuts do not follow the profile's noise
    time_per_layer = even_out_identical([layer.forward_ms + layer.backward_ms for layer in profile.layers],
                                        [(layer.name, layer.parameter_bytes, layer.output_bytes,
                                          layer.activation_bytes) for layer in profile.layers])
    sharded = tuple(sorted(z for z in set(zero_levels) if z))
    margin = ZERO_MARGIN if sharded and 0 in zero_levels else 0.0  # prefer zero=0 unless sharding clearly wins
    static = profile.parameter_bytes * (2 + optimizer_state_factor)
    candidates, rejected = _bounded_candidates(profile, cluster, global_batch, schedules, max_micro_batches,
                                               time_per_layer, optimizer_state_factor, bool(sharded), grids,
                                               precision)
    search = _Search(profile, cluster, global_batch, optimizer_state_factor, precision, time_per_layer,
                     tuple(sorted(set(zero_levels))), [c for c in CHECKPOINT_CHOICES if c in checkpoints], rejected)
    costed = search.cost(candidates, keep=keep, margin=margin)
    if per_grid:  # the pruning stops at the fastest; a grid it did not reach gets its own best
        seen = {_grid_of(c) for _, c, _ in costed}
        for grid in dict.fromkeys(_grid_of(c) for _, c in candidates):
            if grid not in seen:
                costed += search.cost([item for item in candidates if _grid_of(item[1]) == grid], keep=1,
                                      margin=0.0)
    if not costed:
        raise _no_fit_error(cluster, rejected, static, checkpoints, zero_levels)
    return _ranked(costed, margin), rejected, precision


def _checked(profile: Profile, cluster: Cluster, global_batch: int, schedules: tuple[str, ...],
             checkpoints: tuple[str, ...], zero_levels: tuple[int, ...], precision: str | None, grids: str) -> str:
    """:func:`plan`'s arguments checked (each bad one named, with the fix); returns the precision planned for."""
    if global_batch < 1:
        raise UsageError(f"global batch must be >= 1 (got {global_batch})")
    unknown = [s for s in schedules if s not in sched.SCHEDULE_NAMES or s == "forward"]
    if unknown:
        raise UsageError(f"unknown schedules {unknown} (use some of {', '.join(SYNCHRONOUS_CHOICES)}, "
                         "pipedream, 2bw)")
    bad_levels = [z for z in zero_levels if isinstance(z, bool) or z not in ZERO_LEVELS]
    if bad_levels or not zero_levels:
        raise UsageError(f"zero levels {list(zero_levels)}: use some of {list(ZERO_LEVELS)} (e.g. (0,) never "
                         "to shard, (1,) to always shard where there are replicas)")
    activation_factor(profile, precision)  # names an unknown precision
    bad_modes = [c for c in checkpoints if c not in CHECKPOINT_CHOICES]
    if bad_modes or not checkpoints:
        raise UsageError(f"checkpoint modes {list(checkpoints)}: use some of {', '.join(CHECKPOINT_CHOICES)}")
    layers = len(profile.layers)
    factorizations = [(p, cluster.ranks // p) for p in _divisors(cluster.ranks) if p <= layers]
    if not any(global_batch % d == 0 for _, d in factorizations):
        replicas = sorted({d for _, d in factorizations})
        fitting = [d for d in replicas if global_batch % d == 0]
        raise UsageError(f"global batch {global_batch} does not split evenly over any possible replica count "
                         f"{replicas} of {cluster.ranks} ranks (a model of {layers} layers has at most "
                         f"{layers} stages): use a multiple of {min(replicas)}" + (
                                  f" or {fitting}" if fitting else ""))
    if grids not in GRIDS:
        raise UsageError(f"grids={grids!r}: use one of {', '.join(map(repr, GRIDS))}")
    return profile_precision(profile) if precision is None else precision


def _bounded_candidates(profile: Profile, cluster: Cluster, global_batch: int, schedules: tuple[str, ...],
                        max_micro_batches: int | None, time_per_layer: list[float], optimizer_state_factor: float,
                        sharded: bool, grids: str,
                        precision: str) -> tuple[list[tuple[float, Candidate]], list[tuple[Candidate, float]]]:
    """The candidates of ``grids`` with a lower bound of each one's step, fastest bound first, and those whose
    weights cannot fit ``memory_per_rank`` however they are cut (with the bytes they need at least)."""
    limit = cluster.memory_per_rank
    static = profile.parameter_bytes * (2 + optimizer_state_factor)
    candidates: list[tuple[float, Candidate]] = []
    rejected: list[tuple[Candidate, float]] = []
    balances: dict[int, tuple[int, ...]] = {}
    uniform = [] if grids == "stage-replicas" else _candidates(profile, cluster, global_batch, schedules,
                                                                 max_micro_batches, balances, time_per_layer)
    for candidate in uniform:
        if grids == "data-parallel" and candidate.stages > 1:
            continue
        shards = sharded and candidate.replicas > 1 and candidate.schedule not in sched.ASYNCHRONOUS
        # the least a rank can hold: parameters and gradients whole, or ZeRO-2's parameters and shard
        least = (profile.parameter_bytes * (1 + (2 + optimizer_state_factor) / candidate.replicas) if shards
                 else static)
        if limit and least / candidate.stages > limit:  # even a perfect split of the weights is too big
            rejected.append((candidate, least / candidate.stages))
            continue
        candidates.append((step_lower_bound(profile, cluster, candidate, global_batch, precision), candidate))
    if grids in ("all", "stage-replicas"):
        for candidate in _replica_candidates(profile, cluster, global_batch, schedules, max_micro_batches,
                                             time_per_layer):
            if limit and static / candidate.stages > limit:
                rejected.append((candidate, static / candidate.stages))
                continue
            candidates.append((step_lower_bound(profile, cluster, candidate, global_batch, precision), candidate))
    if not candidates and not rejected:
        kind = {"all": "", "data-parallel": "data-parallel ", "uniform": "uniform ",
                "stage-replicas": "stages-with-their-own-replica-counts "}[grids]
        raise UsageError(f"no {kind}configuration of {cluster.ranks} ranks for {len(profile.layers)} layers, a "
                         f"global batch of {global_batch} and the schedules {list(schedules)}" +
                         (" (own replica counts need 2 stages and 3 ranks at least, gpipe or 1f1b)"
                               if grids == "stage-replicas" else ""))
    candidates.sort(key=lambda item: (item[0], item[1].stages, item[1].micro_batches))
    return candidates, rejected


@dataclasses.dataclass
class _Search:
    """What costing a candidate needs (:meth:`cost`); ``rejected`` collects those that do not fit."""

    profile: Profile
    cluster: Cluster
    global_batch: int
    optimizer_state_factor: float
    precision: str
    time_per_layer: list[float]
    shard_levels: tuple[int, ...]
    modes: list[str]
    rejected: list[tuple[Candidate, float]]

    def memory(self, trial: Candidate) -> float:
        return max(memory_per_rank(self.profile, trial, self.global_batch, self.optimizer_state_factor,
                                   self.precision))

    def cost(self, candidates: list[tuple[float, Candidate]], keep: int,
             margin: float) -> list[tuple[float, Candidate, Prediction]]:
        """Costs the candidates in the order of their bounds until a bound exceeds the ``keep``-th fastest step
        found (and the fastest by ``margin``); each at its ZeRO levels and the first re-materialization mode
        that fits."""
        costed: list[tuple[float, Candidate, Prediction]] = []
        best_steps: list[float] = []  # the `keep` fastest step times so far, as a max-heap (negated)
        fastest = math.inf
        for bound, candidate in candidates:
            if len(best_steps) >= keep and bound > max(-best_steps[0], fastest * (1 + margin)):
                break  # every remaining candidate is slower than the `keep` fastest found (and than the margin)
            levels = (self.shard_levels if candidate.replicas > 1 and candidate.schedule not in sched.ASYNCHRONOUS
                      else (0,))
            sharded_times: dict[tuple, Prediction] = {}  # zero=1 and zero=2 take the same time: simulate once
            for level in levels:
                for checkpoint in self.modes:
                    result = self._one(dataclasses.replace(candidate, checkpoint=checkpoint, zero=level),
                                       sharded_times)
                    if result is None:  # did not fit: the next (slower, smaller) mode
                        continue
                    if result is not False:
                        costed.append(result)
                        fastest = min(fastest, result[0])
                        heapq.heappush(best_steps, -result[0])
                        if len(best_steps) > keep:
                            heapq.heappop(best_steps)
                    break  # a slower re-materialization mode cannot win where this one fits
        return costed

    def _one(self, trial: Candidate, sharded_times: dict[tuple, Prediction]) -> Any:
        """``(step, trial, prediction)``; None if it does not fit the memory; False if the schedule does not take
        its size."""
        limit = self.cluster.memory_per_rank
        try:
            memory = self.memory(trial)
        except ScheduleError:  # a size the schedule does not take
            return False
        if limit and memory > limit and not trial.stage_replicas:  # cheap to know: simulate what fits
            balanced = _memory_balance(self.profile, self.cluster, trial, self.global_batch // trial.replicas,
                                       self.time_per_layer, self.optimizer_state_factor,
                                       activation_factor(self.profile, self.precision))
            if balanced is not None:
                trial, memory = balanced, self.memory(balanced)
        if limit and memory > limit:
            self.rejected.append((trial, memory))
            return None
        same = sharded_times.get((trial.checkpoint, trial.balance)) if trial.zero else None
        if same is not None:
            prediction = dataclasses.replace(same, memory_bytes_per_rank=memory_per_rank(
                self.profile, trial, self.global_batch, self.optimizer_state_factor, self.precision))
        else:
            prediction = predict(self.profile, self.cluster, trial, self.global_batch, self.optimizer_state_factor,
                                 self.precision)
            if trial.zero:
                sharded_times[(trial.checkpoint, trial.balance)] = prediction
        return prediction.step_seconds, trial, prediction


def _no_fit_error(cluster: Cluster, rejected: list[tuple[Candidate, float]], static: float,
                  checkpoints: tuple[str, ...], zero_levels: tuple[int, ...]) -> HybridPipeError:
    """Why nothing fits ``memory_per_rank``, with the smallest need and the fixes."""
    smallest = min(rejected, key=lambda item: item[1], default=None)
    needs = ""
    if smallest is not None:
        needs = (f": the smallest needs {format_bytes(smallest[1])} per rank ({_label(smallest[0])}; the "
                 f"weights, gradients and optimizer state alone are {format_bytes(static)} over all stages)")
    fixes = ([f"raise the limit to at least {format_bytes(smallest[1])}"] if smallest is not None else []) + [
        "use more ranks"] + (["allow checkpoint='always'"] if "always" not in checkpoints else []) + (
        ["allow zero=2 (shard over the replicas)"] if 2 not in zero_levels else [])
    return UsageError(f"no configuration of {cluster.ranks} ranks fits memory_per_rank "
                      f"{format_bytes(cluster.memory_per_rank)}{needs}: {', '.join(fixes)}")


def _ranked(costed: list[tuple[float, Candidate, Prediction]],
            margin: float) -> list[tuple[float, Candidate, Prediction]]:
    """Fastest first; ties: unsharded, then less memory, then fewer stages. A sharded plan wins only by more than
    ``margin``, and a grid with its own replica count per stage only by more than ``ZERO_MARGIN``, the
    differences the model cannot see."""
    costed = sorted(costed, key=lambda item: (round(item[0], 12), item[1].zero, item[2].memory_bytes, item[1].stages))
    if costed[0][1].zero and margin:
        unsharded = next((i for i, item in enumerate(costed) if not item[1].zero), None)
        if unsharded is not None and costed[unsharded][0] <= costed[0][0] * (1 + margin):
            costed.insert(0, costed.pop(unsharded))
    if costed[0][1].stage_replicas:
        uniform = next((i for i, item in enumerate(costed) if not item[1].stage_replicas), None)
        if uniform is not None and costed[uniform][0] <= costed[0][0] * (1 + ZERO_MARGIN):
            costed.insert(0, costed.pop(uniform))
    return costed

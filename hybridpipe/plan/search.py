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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridpipe.errors import HybridPipeError, PartitionError, ScheduleError
from hybridpipe.pipeline import schedule as sched
from hybridpipe.pipeline.partition import partition_by_weights
from hybridpipe.plan.cost import Candidate, Cluster, Prediction, predict
from hybridpipe.plan.profile import Profile

__all__ = ["Plan", "plan", "SYNCHRONOUS_CHOICES", "CHECKPOINT_CHOICES"]

SYNCHRONOUS_CHOICES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
CHECKPOINT_CHOICES = ("never", "except_last", "always")
INTERLEAVED_CHUNKS = 2


@dataclass
class Plan:
    """The chosen configuration and its prediction.

    Attributes:
        stages, replicas, balance, micro_batches, schedule, checkpoint: what to build
            (``balance`` has one entry per chunk: ``virtual_stages × stages`` entries).
        virtual_stages: chunks per rank (``interleaved-1f1b``), else 1.
        step_seconds: predicted time of one step (one global batch).
        samples_per_second: ``global_batch / step_seconds``.
        memory_bytes_per_rank: predicted peak of the busiest rank.
        global_batch: the batch it was planned for.
        alternatives: the next best candidates, each with why it lost (``explain``).
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
    alternatives: list[tuple[str, str]] = field(default_factory=list)

    def model_arguments(self) -> dict:
        """Keyword arguments of ``hp.PipelineModel`` that build this plan."""
        arguments = {"micro_batches": self.micro_batches, "balance": list(self.balance), "schedule": self.schedule,
                     "checkpoint": self.checkpoint}
        if self.virtual_stages > 1:
            arguments["virtual_stages"] = self.virtual_stages
        return arguments

    def describe(self) -> str:
        return (f"{self.stages} stages × {self.replicas} replicas, {self.schedule}"
                + (f" (v={self.virtual_stages})" if self.virtual_stages > 1 else "")
                + f", M={self.micro_batches}, checkpoint={self.checkpoint}, balance {list(self.balance)}")


def _memory_balance(profile: Profile, cluster: Cluster, candidate: Candidate, per_replica: int,
                    time_per_layer: list[float], optimizer_state_factor: float) -> Candidate | None:
    """The fastest balance whose every chunk keeps its parameters, gradients, optimizer state and the
    activations the schedule holds within the memory limit (partition.py's memory-aware partitioner),
    or None when no balance of this candidate fits."""
    micro = per_replica / candidate.micro_batches
    plan_ = (sched.async_schedule(candidate.schedule, candidate.stages, candidate.micro_batches)
             if candidate.schedule in sched.ASYNCHRONOUS
             else sched.get_schedule(candidate.schedule, candidate.stages, candidate.micro_batches,
                                     candidate.virtual_stages))
    held = max(sched.peak_in_flight(actions) for actions in plan_)
    if candidate.checkpoint != "never":
        held = 1  # inputs only, plus one micro-batch being recomputed: bounded by one micro-batch's activations
    memory = [layer.parameter_bytes * (2 + optimizer_state_factor) + layer.activation_bytes * micro * held
              for layer in profile.layers]
    try:
        balance = partition_by_weights(time_per_layer, len(candidate.balance), memory=memory,
                                       memory_limit=cluster.memory_per_rank)
    except PartitionError:
        return None
    return Candidate(candidate.stages, candidate.replicas, tuple(balance), candidate.micro_batches,
                     candidate.schedule, candidate.checkpoint, candidate.virtual_stages)


def _label(candidate: Candidate) -> str:
    return (f"{candidate.stages}×{candidate.replicas} {candidate.schedule}"
            + (f" v={candidate.virtual_stages}" if candidate.virtual_stages > 1 else "")
            + f" M={candidate.micro_batches} checkpoint={candidate.checkpoint}")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def plan(profile: Profile, cluster: Cluster, global_batch: int, *, schedules: tuple[str, ...] = SYNCHRONOUS_CHOICES,
         checkpoints: tuple[str, ...] = CHECKPOINT_CHOICES, max_micro_batches: int = 64,
         optimizer_state_factor: float = 2.0, explain: int = 5) -> Plan:
    """The fastest configuration of ``cluster.ranks`` ranks for ``profile`` that fits the memory.

    Args:
        profile: Per-layer costs (:func:`hybridpipe.plan.profile`, or loaded from JSON).
        cluster: The ranks and their links (and ``memory_per_rank``, 0 for no limit).
        global_batch: Samples per step over all replicas.
        schedules: Schedules to consider (add ``"pipedream"`` / ``"2bw"`` to allow asynchronous ones).
        checkpoints: Re-materialization modes to consider.
        max_micro_batches: Largest micro-batch count tried.
        optimizer_state_factor: Optimizer state bytes per parameter byte (SGD 0, momentum 1, Adam 2).
        explain: How many runners-up to keep, with why each lost.

    Raises:
        HybridPipeError: no configuration is possible (the message says why, and what would fit).
    """
    layers = len(profile.layers)
    if global_batch < 1:
        raise HybridPipeError(f"global batch must be >= 1 (got {global_batch})")
    unknown = [s for s in schedules if s not in sched.SCHEDULE_NAMES or s == "forward"]
    if unknown:
        raise HybridPipeError(f"unknown schedules {unknown} (use some of {', '.join(SYNCHRONOUS_CHOICES)}, "
                              "pipedream, 2bw)")
    costed: list[tuple[float, Candidate, Prediction]] = []
    rejected: list[tuple[Candidate, str]] = []
    time_per_layer = [layer.forward_ms + layer.backward_ms for layer in profile.layers]
    factorizations = [(p, cluster.ranks // p) for p in _divisors(cluster.ranks) if p <= layers]
    usable = [(p, d) for p, d in factorizations if global_batch % d == 0]
    if not usable:
        replicas = sorted({d for _, d in factorizations})
        raise HybridPipeError(f"global batch {global_batch} does not split evenly over any possible replica count "
                              f"{replicas} of {cluster.ranks} ranks: use a multiple of {min(replicas)}")
    for p, d in usable:
        per_replica = global_batch // d
        for schedule in schedules:
            v = INTERLEAVED_CHUNKS if schedule == "interleaved-1f1b" else 1
            if p == 1 and schedule != "1f1b":
                continue  # one stage: every schedule is the same gradient accumulation
            if p * v > layers:
                continue
            balance = tuple(partition_by_weights(time_per_layer, p * v))
            for m in _divisors(per_replica):
                if m > max_micro_batches:
                    break
                try:
                    if schedule in sched.ASYNCHRONOUS:
                        if schedule == "2bw" and m < p - 1:
                            continue
                    else:
                        sched.get_schedule(schedule, p, m, v)
                except ScheduleError:
                    continue
                for checkpoint in checkpoints:
                    candidate = Candidate(p, d, balance, m, schedule, checkpoint, v)
                    prediction = predict(profile, cluster, candidate, global_batch, optimizer_state_factor)
                    if cluster.memory_per_rank and prediction.memory_bytes > cluster.memory_per_rank:
                        balanced = _memory_balance(profile, cluster, candidate, per_replica, time_per_layer,
                                                   optimizer_state_factor)
                        if balanced is not None:
                            candidate = balanced
                            prediction = predict(profile, cluster, candidate, global_batch, optimizer_state_factor)
                    if cluster.memory_per_rank and prediction.memory_bytes > cluster.memory_per_rank:
                        rejected.append((candidate, prediction.memory_bytes))
                        continue
                    costed.append((prediction.step_seconds, candidate, prediction))
    if not costed:
        smallest = min((memory for _, memory in rejected), default=None)
        fits = f" (the smallest needs {smallest / 2**20:.1f} MiB per rank)" if smallest is not None else ""
        raise HybridPipeError(f"no configuration of {cluster.ranks} ranks fits memory_per_rank "
                              f"{cluster.memory_per_rank / 2**20:.1f} MiB{fits}: raise the limit, use more ranks, or "
                              "allow checkpoint='always'")
    # fastest first; ties: less memory, then fewer stages
    costed.sort(key=lambda item: (round(item[0], 12), item[2].memory_bytes, item[1].stages))
    step, best, prediction = costed[0]
    alternatives = [(_label(c), f"{pr.step_seconds / step:.3f}× the step time"
                     + (f", {pr.memory_bytes / prediction.memory_bytes:.2f}× the memory" if prediction.memory_bytes else ""))
                    for _, c, pr in costed[1:1 + explain]]
    alternatives += [(_label(c), f"needs {memory / 2**20:.1f} MiB per rank, over the "
                                 f"{cluster.memory_per_rank / 2**20:.1f} MiB limit")
                     for c, memory in sorted(rejected, key=lambda item: item[1])[:max(0, explain - len(alternatives))]]
    return Plan(stages=best.stages, replicas=best.replicas, balance=list(best.balance),
                micro_batches=best.micro_batches, schedule=best.schedule, checkpoint=best.checkpoint,
                step_seconds=step, samples_per_second=prediction.samples_per_second,
                memory_bytes_per_rank=prediction.memory_bytes, global_batch=global_batch,
                virtual_stages=best.virtual_stages, alternatives=alternatives)

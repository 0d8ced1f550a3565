"""The cost model: a candidate configuration's step time and memory per rank, from a profile and a cluster.

Design reasons:

* The step time is the schedule itself, simulated: the schedules are data
  (:mod:`hybridpipe.pipeline.schedule`), so the same action lists the executor runs are placed in
  time with each chunk's forward / backward time (from the profile, scaled to the micro-batch) and
  each transfer's time (latency + bytes / bandwidth, inside or between hosts by where the two ranks
  sit). Nothing about a schedule's shape is re-derived by formula.
* The data-parallel allreduce of a rank's gradients starts when its last backward ends (the engine
  overlaps it with the rest of the drain) and costs a ring's ``2(D−1)/D`` of the bytes plus
  ``2(D−1)`` latencies; the step ends when the slowest rank's reduction does, or at the makespan.
* Ranks sharing cores: compute times are multiplied by ranks per host ÷ cores per host when
  there are more ranks than cores (the 2-core machine runs 4 ranks at half speed each).
* Memory per rank: parameters, gradients, optimizer state (``optimizer_state_factor`` × the
  parameter bytes: 0 for plain SGD, 1 with momentum, 2 for Adam), the activations of the most
  micro-batches the schedule holds at once on that rank (``schedule.peak_in_flight``) — or, when
  re-materializing, their inputs plus one micro-batch's activations — and the asynchronous
  schedules' extra weight versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridpipe.errors import HybridPipeError
from hybridpipe.pipeline import schedule as sched
from hybridpipe.plan.profile import Profile

__all__ = ["Cluster", "Candidate", "Prediction", "predict", "allreduce_seconds"]


@dataclass(frozen=True)
class Cluster:
    """The machine the job runs on.

    Attributes:
        ranks: Processes in the job.
        ranks_per_host: Processes per host (consecutive ranks share a host, as ``hybridpipe-run``
            places them).
        cores_per_host: Cores per host that compute (0: as many as ranks, no sharing).
        intra_host_gbps: Point-to-point / allreduce bandwidth inside a host, Gbit/s.
        inter_host_gbps: Between hosts, Gbit/s.
        latency_us: One message's latency, microseconds (a hop of a pipeline, a ring step).
        memory_per_rank: Bytes a rank may use (0: no limit).
    """

    ranks: int
    ranks_per_host: int = 0
    cores_per_host: int = 0
    intra_host_gbps: float = 40.0
    inter_host_gbps: float = 10.0
    latency_us: float = 20.0
    memory_per_rank: float = 0.0

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise HybridPipeError(f"a cluster needs ranks >= 1 (got {self.ranks})")
        for name in ("intra_host_gbps", "inter_host_gbps"):
            if getattr(self, name) <= 0:
                raise HybridPipeError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.latency_us < 0 or self.memory_per_rank < 0 or self.ranks_per_host < 0 or self.cores_per_host < 0:
            raise HybridPipeError("latency_us, memory_per_rank, ranks_per_host and cores_per_host must be >= 0")

    @property
    def per_host(self) -> int:
        return self.ranks_per_host or self.ranks

    def host_of(self, rank: int) -> int:
        return rank // self.per_host

    @property
    def compute_slowdown(self) -> float:
        """How much slower each rank computes because ranks share a host's cores."""
        if not self.cores_per_host:
            return 1.0
        return max(1.0, min(self.per_host, self.ranks) / self.cores_per_host)

    def link_seconds(self, nbytes: float, a: int, b: int) -> float:
        """One message of ``nbytes`` from rank ``a`` to rank ``b``."""
        gbps = self.intra_host_gbps if self.host_of(a) == self.host_of(b) else self.inter_host_gbps
        return self.latency_us * 1e-6 + nbytes * 8 / (gbps * 1e9)


def allreduce_seconds(nbytes: float, ranks: list[int], cluster: Cluster) -> float:
    """A ring allreduce of ``nbytes`` over ``ranks``: ``2(D−1)`` steps of ``nbytes / D`` each, over the
    slowest link the ring crosses (between hosts when the ranks span hosts)."""
    count = len(ranks)
    if count < 2 or nbytes <= 0:
        return 0.0
    spans_hosts = len({cluster.host_of(rank) for rank in ranks}) > 1
    gbps = cluster.inter_host_gbps if spans_hosts else cluster.intra_host_gbps
    steps = 2 * (count - 1)
    return steps * (cluster.latency_us * 1e-6 + (nbytes / count) * 8 / (gbps * 1e9))


@dataclass(frozen=True)
class Candidate:
    """One configuration: ``stages`` × ``replicas`` ranks, a balance (one entry per chunk), the
    micro-batches per replica, the schedule (with ``virtual_stages`` chunks per rank) and the
    re-materialization mode."""

    stages: int
    replicas: int
    balance: tuple[int, ...]
    micro_batches: int
    schedule: str
    checkpoint: str = "never"
    virtual_stages: int = 1


@dataclass
class Prediction:
    """What :func:`predict` found for a candidate."""

    step_seconds: float
    memory_bytes_per_rank: list[float]
    samples_per_second: float
    pipeline_seconds: float          # the schedule's makespan (or steady-state step, asynchronous)
    allreduce_seconds: float         # the slowest rank's gradient allreduce
    exposed_allreduce_seconds: float  # the part of it not hidden behind the drain
    notes: list[str] = field(default_factory=list)

    @property
    def memory_bytes(self) -> float:
        return max(self.memory_bytes_per_rank)


def _chunk_layers(balance: tuple[int, ...]) -> list[range]:
    starts = [sum(balance[:c]) for c in range(len(balance))]
    return [range(start, start + count) for start, count in zip(starts, balance)]


def predict(profile: Profile, cluster: Cluster, candidate: Candidate, global_batch: int,
            optimizer_state_factor: float = 2.0) -> Prediction:
    """Step time and memory per rank of ``candidate`` for a global batch of ``global_batch`` samples.

    Raises:
        HybridPipeError: the candidate does not fit the profile or the cluster (named).
    """
    p, d, m = candidate.stages, candidate.replicas, candidate.micro_batches
    v = candidate.virtual_stages
    chunks = p * v
    if p * d != cluster.ranks:
        raise HybridPipeError(f"{p} stages × {d} replicas is {p * d} ranks, but the cluster has {cluster.ranks}")
    if len(candidate.balance) != chunks or sum(candidate.balance) != len(profile.layers):
        raise HybridPipeError(f"balance {list(candidate.balance)} does not cut {len(profile.layers)} layers into "
                              f"{chunks} chunks")
    if global_batch % d:
        raise HybridPipeError(f"global batch {global_batch} does not split evenly over {d} replicas")
    per_replica = global_batch // d
    micro = per_replica / m
    slow = cluster.compute_slowdown
    layers = _chunk_layers(candidate.balance)
    forward = [sum(profile.layers[i].forward_seconds(micro) for i in chunk) * slow for chunk in layers]
    backward = [sum(profile.layers[i].backward_seconds(micro) for i in chunk) * slow for chunk in layers]
    backward[-1] += profile.loss_ms * micro * slow / 1e3
    recompute = candidate.checkpoint != "never"
    if recompute:  # every backward re-runs its forward first ("except_last": all but one, counted as all)
        backward = [b + f for b, f in zip(backward, forward)]
    output = [profile.layers[chunk[-1]].output_bytes * micro for chunk in layers]

    def rank_of(stage: int) -> int:  # replica 0's pipeline; others are the same shifted by host
        return sched.stage_to_rank(stage, p)

    def transfer(action: sched.Action) -> float:
        if action.kind is sched.ActionKind.FORWARD:
            source = action.stage - 1
            return cluster.link_seconds(output[source], rank_of(source), rank_of(action.stage))
        return cluster.link_seconds(output[action.stage], rank_of(action.stage + 1), rank_of(action.stage))

    duration = dict(forward_time=lambda a: forward[a.stage], backward_time=lambda a: backward[a.stage],
                    transfer_time=transfer)
    asynchronous = candidate.schedule in sched.ASYNCHRONOUS
    if asynchronous:
        plan = sched.async_schedule(candidate.schedule, p, m, steps=4, flush=False)
        one = sched.simulate(sched.async_schedule(candidate.schedule, p, m, steps=1, flush=False), **duration).makespan
        pipeline = (sched.simulate(plan, **duration).makespan - one) / 3  # steady state: steps 2-4
    else:
        plan = sched.get_schedule(candidate.schedule, p, m, v)
        timeline = sched.simulate(plan, **duration)
        pipeline = timeline.makespan
    # gradients: each rank's parameters, reduced over its stage's replicas after its last backward
    parameter_bytes = [sum(profile.layers[i].parameter_bytes for c in range(r, chunks, p) for i in layers[c])
                       for r in range(p)]
    reduce = [allreduce_seconds(parameter_bytes[r], [replica * p + r for replica in range(d)], cluster)
              for r in range(p)]
    if asynchronous:  # an update per micro-batch (pipedream) or per step (2bw), not hidden
        updates = m if candidate.schedule == "pipedream" else 1
        exposed = max(reduce) * updates
        step = pipeline + exposed
    else:
        last_backward = [max((t.end for t in items if t.action.kind in (
            sched.ActionKind.BACKWARD, sched.ActionKind.BACKWARD_WEIGHT)), default=0.0)
            for items in timeline.stages]
        step = max([pipeline] + [end + r for end, r in zip(last_backward, reduce)])
        exposed = step - pipeline
    # memory per rank
    activation = [sum(profile.layers[i].activation_bytes for i in chunk) * micro for chunk in layers]
    inputs = [(profile.input_bytes if c == 0 else profile.layers[layers[c][0] - 1].output_bytes) * micro
              for c in range(chunks)]
    memory = []
    for r in range(p):
        held = sched.peak_in_flight(plan[r])
        own = list(range(r, chunks, p))
        per_micro = max(activation[c] for c in own)
        acts = held * max(inputs[c] for c in own) + per_micro if recompute else held * per_micro
        versions = 0.0
        if candidate.schedule == "pipedream":
            versions = (p - r) * parameter_bytes[r]
        elif candidate.schedule == "2bw":
            versions = 2 * parameter_bytes[r]
        memory.append(parameter_bytes[r] * (2 + optimizer_state_factor) + acts + versions)
    notes = []
    if slow > 1:
        notes.append(f"compute × {slow:g}: {cluster.per_host} ranks share {cluster.cores_per_host} cores per host")
    return Prediction(step_seconds=step, memory_bytes_per_rank=memory,
                      samples_per_second=global_batch / step if step > 0 else math.inf, pipeline_seconds=pipeline,
                      allreduce_seconds=max(reduce), exposed_allreduce_seconds=exposed, notes=notes)

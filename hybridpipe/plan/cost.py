"""The cost model: a candidate configuration's step time and memory per rank, from a profile and a cluster.

Design reasons:

* The step time is the schedule itself, simulated: the schedules are data
  (:mod:`hybridpipe.pipeline.schedule`), so the same action lists the executor runs are placed in
  time with each chunk's forward / backward time (from the profile, scaled to the micro-batch) and
  each transfer's time (latency + bytes / bandwidth, inside or between hosts by where the two ranks
  sit). Nothing about a schedule's shape is re-derived by formula.
* The data-parallel allreduce overlaps the last micro-batch's backward, as the engine does: a
  parameter's gradient is final when its layer's part of that backward is done (the optimizer's
  hook queues it then), gradients are fused into buckets of ``fusion_bytes`` in the order they
  become final, and the buckets are reduced one after another. Inside a host a bucket costs a
  ring's ``2(D−1)`` steps of ``bytes/D``; a group spanning hosts with one rank per host is a flat
  ring over the links between hosts, with several it is hierarchical (reduce-scatter inside each
  host, an allreduce of each rank's share between hosts, allgather inside), and the stages whose
  groups reduce at once share a host's network. The step ends when the slowest rank's last bucket
  does, or at the makespan. Then each rank steps its optimizer (the profile's time per MiB of
  parameters), after one tiny allreduce that agrees on which gradients exist.
* ``action_overhead_us`` is the framework's own time per pipeline action (bookkeeping, autograd),
  added to every F, B, I and W, and ``transfer_overhead_us`` a rank's own time per transfer it
  sends or receives (the hand-offs to and from the communication thread), added to the actions
  that transfer; ``calibrate`` measures both, and the allreduce's fixed cost
  (``allreduce_overhead_us``), on the job's own ranks.
* Ranks sharing cores: compute times are multiplied by ranks per host ÷ cores per host when
  there are more ranks than cores (the 2-core machine runs 4 ranks at half speed each), and by the
  measured contention of cores computing at once (``Cluster.compute_contention``).
* Memory per rank: parameters, gradients, optimizer state (``optimizer_state_factor`` × the
  parameter bytes: 0 for plain SGD, 1 with momentum, 2 for Adam), the activations of the most
  micro-batches the schedule holds at once on that rank (``schedule.peak_in_flight``) — or, when
  re-materializing, their inputs plus one micro-batch's activations — or the optimizer step's
  temporaries if larger (a synchronous step's activations are freed before the optimizer runs),
  and the asynchronous schedules' extra weight versions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridpipe.config import Config
from hybridpipe import registry
from hybridpipe.errors import InternalError, UsageError
from hybridpipe.pipeline import schedule as sched
from hybridpipe.plan.profile import LayerCost, Profile
from hybridpipe.runtime import layout, rank_of_place

__all__ = ["Cluster", "Candidate", "Prediction", "predict", "allreduce_seconds", "reducescatter_seconds",
           "allgather_seconds", "chunk_seconds", "step_lower_bound", "memory_per_rank", "schedule_of",
           "held_micro_batches", "activation_factor", "profile_precision", "check_zero", "ZERO_LEVELS",
           "PRECISION_BYTES"]

ZERO_LEVELS = tuple(level for level, entry in registry.ZERO_LEVELS.items() if entry.planned)  # what it costs
PRECISION_BYTES = {name: entry.activation_bytes for name, entry in registry.PRECISIONS.items()}


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
        action_overhead_us: The framework's own time per pipeline action (F, B, I, W), microseconds.
        fusion_bytes: Gradient bucket size of the data-parallel reduction (``HYBRIDPIPE_FUSION_THRESHOLD``).
        allreduce_overhead_us: A fixed cost per allreduce beyond its ring steps (the engine's negotiation
            and cycle, the hand-offs to the communication thread), microseconds.
        transfer_overhead_us: A rank's own time per pipeline transfer it sends or receives (handing it to
            and taking it from the communication thread), microseconds: added to the action that sends
            or receives, beside the transfer's latency on the way.
        compute_contention: How much slower a rank computes while the other ranks of its host compute too
            (up to one per core), against the one process the profile was made in; ``calibrate`` measures it.
        submit_overhead_us: What ``hp.DistributedOptimizer`` adds to a backward per gradient tensor it hands to the
            engine (its hook), microseconds; ``calibrate`` measures it.
        after_reduction_us_per_mib: How much longer the optimizer's step takes per MiB of parameters right after
            their gradients' reduction than alone (the communication thread and the caches), microseconds;
            ``calibrate`` measures it.
        memory_contention: ``compute_contention`` for ranks that stream more than the host's last cache holds
            (``cache_bytes``): a host whose ranks each step through their weights and gradients, together more
            than the cache, contends for memory (``calibrate`` measures it with a kernel that does; 0: as
            ``compute_contention``).
        cache_bytes: The host's last-level cache, bytes (0: unknown; then ``memory_contention`` is not used).
        zero_step_us_per_mib: How much longer a ZeRO-1, a ZeRO-2 and a ZeRO-3 step take than a plain data-parallel
            one, per MiB of a rank's parameters, microseconds (``calibrate`` measures them on the job's ranks: the
            sharded reductions, ZeRO's copies and the allgather as they run here; ZeRO-3's for one forward and
            backward, whose gathers a step of M micro-batches makes M times). 0: not measured; the reduce-scatter,
            the sharded update and the allgathers are then modelled from the links.
        data_parallel_us_per_mib: How much longer a data-parallel step (the optimizer's hooks, the reductions, the
            agreement, the update after them) takes than the same step without reductions, every rank computing at
            once, per MiB of a rank's parameters, microseconds (``calibrate`` measures it on the job's ranks). Where
            the reductions share the ranks' cores (:meth:`reductions_share_cores`), a rank with replicas ends its step
            no earlier than its last action, its update and this time for its parameters. 0: not measured.
        waiting_load: Where a pipeline's ranks share their host's cores (:meth:`shares_cores`) and outnumber them,
            how much of a core a rank that is not computing still takes (its polite waits, its communication
            thread): the simulation counts it as this share of a computing rank (``calibrate`` measures it). 0: none.
        resume_us: How much longer a rank takes for an action it starts after waiting for another rank (its caches
            cold, its core woken) than the profile's passes back to back, microseconds: the simulation adds it to
            every action that begins after its rank idled (``hp.auto`` with ``verify`` measures it on the model,
            :func:`hybridpipe.plan.calibrate.model_resume`). 0: none.
    """

    ranks: int
    ranks_per_host: int = 0
    cores_per_host: int = 0
    intra_host_gbps: float = 40.0
    inter_host_gbps: float = 10.0
    latency_us: float = 20.0
    memory_per_rank: float = 0.0
    action_overhead_us: float = 0.0
    fusion_bytes: float = 4 * 2**20
    allreduce_overhead_us: float = 0.0
    transfer_overhead_us: float = 0.0
    compute_contention: float = 1.0
    submit_overhead_us: float = 0.0
    after_reduction_us_per_mib: float = 0.0
    memory_contention: float = 0.0
    cache_bytes: float = 0.0
    zero_step_us_per_mib: tuple[float, ...] = (0.0, 0.0, 0.0)
    data_parallel_us_per_mib: float = 0.0
    waiting_load: float = 0.0
    resume_us: float = 0.0

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise UsageError(f"a cluster needs ranks >= 1 (got {self.ranks})")
        for name in ("intra_host_gbps", "inter_host_gbps"):
            if getattr(self, name) <= 0:
                raise UsageError(f"{name} must be > 0 (got {getattr(self, name)})")
        negative = {name: getattr(self, name) for name in ("latency_us", "memory_per_rank", "ranks_per_host",
                                                           "cores_per_host", "action_overhead_us", "fusion_bytes",
                                                           "allreduce_overhead_us", "transfer_overhead_us",
                                                           "submit_overhead_us", "after_reduction_us_per_mib",
                                                           "data_parallel_us_per_mib", "waiting_load", "resume_us")
                    if getattr(self, name) < 0}
        if len(self.zero_step_us_per_mib) < 3:  # (ZeRO-1, ZeRO-2) as before ZeRO-3 was planned: 3 not measured
            object.__setattr__(self, "zero_step_us_per_mib", tuple(self.zero_step_us_per_mib) + (0.0,) * (
                3 - len(self.zero_step_us_per_mib)))
        if any(value < 0 for value in self.zero_step_us_per_mib):
            negative["zero_step_us_per_mib"] = self.zero_step_us_per_mib
        if negative:
            raise UsageError(f"cluster values must be >= 0 (got {negative})")
        if self.compute_contention < 1.0:
            raise UsageError(f"compute_contention must be >= 1 (got {self.compute_contention})")

    @property
    def per_host(self) -> int:
        return self.ranks_per_host or self.ranks

    def host_of(self, rank: int) -> int:
        return rank // self.per_host

    @property
    def compute_slowdown(self) -> float:
        """How much slower each rank computes than the profile's one process: ranks sharing a host's cores
        (more ranks than cores) times the contention of cores computing at once."""
        return self.slowdown_for(0.0)

    def slowdown_for(self, rank_parameter_bytes: float) -> float:
        """:attr:`compute_slowdown` for ranks holding ``rank_parameter_bytes`` of weights each: where the host's
        ranks stream their weights and gradients (2 × the bytes each) through more than ``cache_bytes`` together,
        ``memory_contention`` takes the place of ``compute_contention``."""
        contention = self.contention_for(rank_parameter_bytes)
        if not self.cores_per_host:
            return contention
        return max(1.0, min(self.per_host, self.ranks) / self.cores_per_host) * contention

    def contention_for(self, rank_parameter_bytes: float) -> float:
        """The contention part of :meth:`slowdown_for` (without the sharing of cores): ``compute_contention``, or
        ``memory_contention`` where the host's ranks stream more than its cache."""
        ranks_here = min(self.per_host, self.ranks)
        if self.memory_contention and self.cache_bytes and 2 * rank_parameter_bytes * ranks_here > self.cache_bytes:
            return max(self.compute_contention, self.memory_contention)
        return self.compute_contention

    def shares_cores(self, device: str) -> bool:
        """Whether a pipeline's ranks are simulated sharing their host's cores as they compute: a CPU model on a
        host whose cores are known. Then a rank computes ``compute_contention`` slower than the profile (as the
        slowest rank of a synchronous step does: the measure holds a core's own slow spells, which pace a pipeline
        as they pace data parallelism), and ``k`` times slower still while ``k`` ranks compute per core, ``k``
        counting each rank that waits, in a pipeline's bubble, as ``waiting_load`` of one (its polite wait sleeps,
        leaving most of its core to the others) (:func:`hybridpipe.pipeline.schedule.simulate_shared`). With no
        more ranks than cores this is :meth:`slowdown_for` throughout, as without it."""
        return device.startswith("cpu") and self.cores_per_host > 0

    def reductions_share_cores(self, device: str) -> bool:
        """Whether the gradients' reductions take their time from the ranks' compute: a CPU model on a host
        whose cores are known and number fewer than two per rank, so each rank's communication thread (shared
        memory or the ring: copies and sums on the CPU) runs on the core its backward runs on. Measured here
        (2 ranks on 2 cores, an MLP with 8 MiB of gradients): the reductions overlapped with the backward
        lengthen it by what they cost, the step ends about one whole allreduce after a plain one."""
        return device.startswith("cpu") and 0 < self.cores_per_host < 2 * min(self.per_host, self.ranks)

    def link_seconds(self, nbytes: float, a: int, b: int) -> float:
        """One message of ``nbytes`` from rank ``a`` to rank ``b``."""
        gbps = self.intra_host_gbps if self.host_of(a) == self.host_of(b) else self.inter_host_gbps
        return self.latency_us * 1e-6 + nbytes * 8 / (gbps * 1e9)


def allreduce_seconds(nbytes: float, ranks: list[int], cluster: Cluster, concurrent_groups: int = 1) -> float:
    """An allreduce of ``nbytes`` over ``ranks``.

    Inside one host: a ring, ``2(D−1)`` steps of ``nbytes / D``. Across hosts with one of the ranks
    per host: the same ring over the links between hosts. Across hosts with ``g > 1`` of the ranks
    on a host (the engine's hierarchical path): a ring inside each host (reduce-scatter, then
    allgather: ``2(g−1)`` steps of ``nbytes / g``) around a ring between the ``H`` hosts in which each
    of the ``g`` ranks carries its share (``2(H−1)`` steps of ``nbytes / (g·H)``, the ``g`` shares
    sharing the host's network). ``concurrent_groups`` groups with ranks on the same hosts reduce at
    the same time and share each host's network too. Each allreduce also pays the cluster's
    ``allreduce_overhead_us``.
    """
    count = len(ranks)
    if count < 2 or nbytes <= 0:
        return 0.0
    return cluster.allreduce_overhead_us * 1e-6 + _ring_seconds(nbytes, ranks, cluster, concurrent_groups)


def reducescatter_seconds(nbytes: float, ranks: list[int], cluster: Cluster, concurrent_groups: int = 1) -> float:
    """A reduce-scatter of ``nbytes`` over ``ranks`` (ZeRO's gradients): the first half of
    :func:`allreduce_seconds`' ring (``D−1`` steps of ``nbytes / D`` inside a host, likewise
    hierarchically), plus the allreduce's fixed cost."""
    if len(ranks) < 2 or nbytes <= 0:
        return 0.0
    return cluster.allreduce_overhead_us * 1e-6 + _ring_seconds(nbytes, ranks, cluster, concurrent_groups) / 2


def allgather_seconds(nbytes: float, ranks: list[int], cluster: Cluster, concurrent_groups: int = 1) -> float:
    """An allgather of ``nbytes`` in all (ZeRO's updated parameters): the second half of the ring, as
    :func:`reducescatter_seconds`."""
    return reducescatter_seconds(nbytes, ranks, cluster, concurrent_groups)


def profile_precision(profile: Profile) -> str:
    """The precision the profile's activations were measured (or modelled) in: ``profile.extra["precision"]``,
    else fp32."""
    return str(profile.extra.get("precision", "fp32"))


def activation_factor(profile: Profile, precision: str | None) -> float:
    """Bytes of an activation in ``precision`` per byte of one in the profile's (:func:`profile_precision`):
    0.5 for a bf16 / fp16 pipeline planned from an fp32 profile; 1 for ``None`` (as profiled).

    Raises:
        UsageError: an unknown precision (the valid ones named).
    """
    made = profile_precision(profile)
    precision = made if precision is None else precision
    for value, what in ((precision, "precision"), (made, "the profile's precision")):
        registry.check_precision(value, what)
    return PRECISION_BYTES[precision] / PRECISION_BYTES[made]


ZERO_BUCKET_BYTES = Config().fusion_threshold_bytes  # the sharded optimizer's bucket (HYBRIDPIPE_FUSION_THRESHOLD)


def check_zero(zero: int, replicas: int, schedule: str) -> None:
    """Raises :class:`UsageError` unless ``zero`` is a ZeRO level this candidate can use."""
    registry.check_zero_level(zero)
    if zero not in ZERO_LEVELS:
        raise UsageError(f"zero={zero}: the cost model plans the ZeRO levels {', '.join(map(str, ZERO_LEVELS))} "
                         f"(zero={zero}'s memory and gathers are not modelled yet): plan with one of them, or pass "
                         "your own plan")
    if zero and schedule in sched.ASYNCHRONOUS:
        raise UsageError(f"zero={zero} shards hp.DistributedOptimizer's state; the {schedule} schedule steps "
                         "its own optimizer inside the pipeline: use zero=0 or a synchronous schedule")
    if zero and replicas < 2:
        raise UsageError(f"zero={zero} shards over the data replicas, but there is {replicas}: use zero=0 "
                         "or more replicas")


def _ring_seconds(nbytes: float, ranks: list[int], cluster: Cluster, concurrent_groups: int) -> float:
    count = len(ranks)
    latency = cluster.latency_us * 1e-6
    per_host: dict[int, int] = {}
    for rank in ranks:
        per_host[cluster.host_of(rank)] = per_host.get(cluster.host_of(rank), 0) + 1
    if len(per_host) == 1:
        return 2 * (count - 1) * (latency + (nbytes / count) * 8 / (cluster.intra_host_gbps * 1e9))
    hosts, local = len(per_host), max(per_host.values())
    network = cluster.inter_host_gbps * 1e9 / max(1, concurrent_groups)  # bits/s this group gets of a host's
    if local == 1:
        return 2 * (count - 1) * (latency + (nbytes / count) * 8 / network)
    inside = 2 * (local - 1) * (latency + (nbytes / local) * 8 / (cluster.intra_host_gbps * 1e9))
    between = 2 * (hosts - 1) * (latency + local * (nbytes / (local * hosts)) * 8 / network)
    return inside + between


@dataclass(frozen=True)
class Candidate:
    """One configuration: ``stages`` × ``replicas`` ranks, a balance (one entry per chunk), the
    micro-batches per replica, the schedule (with ``virtual_stages`` chunks per rank) and the
    re-materialization mode, and the ZeRO level of its ``hp.DistributedOptimizer`` (0: none).

    ``stage_replicas`` (e.g. ``(3, 1)``): stages with their own replica counts (``hp.init(stage_replicas=)``);
    ``replicas`` is then 1 and ``micro_batches`` splits the whole global batch, micro-batch m running on
    replica ``m mod stage_replicas[s]`` of stage s."""

    stages: int
    replicas: int
    balance: tuple[int, ...]
    micro_batches: int
    schedule: str
    checkpoint: str = "never"
    virtual_stages: int = 1
    zero: int = 0
    stage_replicas: tuple[int, ...] = ()

    @property
    def ranks(self) -> int:
        return sum(self.stage_replicas) if self.stage_replicas else self.stages * self.replicas


@dataclass
class Prediction:
    """What :func:`predict` found for a candidate."""

    step_seconds: float
    memory_bytes_per_rank: list[float]
    samples_per_second: float
    pipeline_seconds: float          # the schedule's makespan (or steady-state step, asynchronous)
    allreduce_seconds: float         # the slowest rank's gradient allreduce (ZeRO: reduce-scatter + allgather)
    exposed_allreduce_seconds: float  # what the step takes beyond the makespan: unhidden reduction, optimizer
    notes: list[str] = field(default_factory=list)
    lower_bound_seconds: float = 0.0  # step_lower_bound: the step is never predicted below it

    @property
    def memory_bytes(self) -> float:
        return max(self.memory_bytes_per_rank)


def _chunk_layers(balance: tuple[int, ...]) -> list[range]:
    starts = [sum(balance[:c]) for c in range(len(balance))]
    return [range(start, start + count) for start, count in zip(starts, balance)]


@functools.lru_cache(maxsize=512)
def schedule_of(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> sched.Schedule:
    """The schedule's action lists (cached: the search asks for the same ones many times; do not mutate).
    Asynchronous schedules: four steps without the flush (their steady state is costed)."""
    if name in sched.ASYNCHRONOUS:
        return sched.async_schedule(name, stages, micro_batches, steps=4, flush=False)
    return sched.get_schedule(name, stages, micro_batches, virtual_stages)


@functools.lru_cache(maxsize=512)
def held_micro_batches(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Per rank, the most micro-batches whose activations the schedule holds at once."""
    return tuple(sched.peak_in_flight(actions) for actions in schedule_of(name, stages, micro_batches, virtual_stages))


def rank_parameter_bytes(profile: Profile, candidate: Candidate) -> float:
    """The most parameter bytes one rank of ``candidate`` holds (its chunks' layers)."""
    layers = _chunk_layers(candidate.balance)
    ranks = candidate.stages
    return max(sum(profile.layers[i].parameter_bytes for c in range(r, len(layers), ranks) for i in layers[c])
               for r in range(ranks))


def chunk_seconds(profile: Profile, cluster: Cluster, candidate: Candidate, micro: float) -> tuple[list[float], list[float]]:
    """Each chunk's forward and backward time (compute only) for one micro-batch of ``micro`` samples,
    with the loss on the last chunk, re-materialization and ranks sharing cores counted (at their own speed where
    the simulation shares the cores, :meth:`Cluster.shares_cores`)."""
    layers = _chunk_layers(candidate.balance)
    # sharing cores, the simulation slows each action by what computes beside it (Cluster.shares_cores)
    slow = (1.0 if cluster.shares_cores(profile.device)
            else cluster.slowdown_for(rank_parameter_bytes(profile, candidate)))
    forward = [sum(profile.layers[i].forward_seconds(micro) for i in chunk) * slow for chunk in layers]
    backward = [sum(profile.layers[i].backward_seconds(micro) for i in chunk) * slow for chunk in layers]
    backward[-1] += profile.loss_ms * micro * slow / 1e3
    if candidate.checkpoint != "never":  # every backward re-runs its forward first ("except_last": counted as all)
        backward = [b + f for b, f in zip(backward, forward)]
    return forward, backward


def _weight_call_seconds(profile: Profile, layers: list[list[int]], cluster: Cluster) -> list[float]:
    """Per chunk: what a split backward (I, then W per splittable layer call) costs beyond a whole one: the
    profile's measured ``split_call_ms`` per layer, or, in a profile without it, each layer with weights' fixed
    backward call cost (one more autograd call per such layer)."""
    def extra(cost: LayerCost) -> float:
        if cost.split_call_ms is not None:
            return cost.split_call_ms
        return cost.backward_call_ms if cost.parameter_bytes else 0.0

    slow = 1.0 if cluster.shares_cores(profile.device) else cluster.compute_slowdown
    return [sum(extra(profile.layers[i]) for i in chunk) / 1e3 * slow for chunk in layers]


def step_lower_bound(profile: Profile, cluster: Cluster, candidate: Candidate, global_batch: int,
                     precision: str | None = None) -> float:
    """A step time no run of ``candidate`` can beat (cheap: no simulation): the search orders and prunes by it, and
    :func:`predict` never returns less (``Prediction.lower_bound_seconds``, a plan's ``lower_bound_seconds``).

    The largest of three bounds, each from the measured parts alone:

    * compute: per rank, its ``M`` forwards and backwards (with their overheads), after the first micro-batch's
      forwards through the chunks before it, then its optimizer step; with one chunk per rank and whole
      backwards (GPipe, 1F1B), the last micro-batch's backwards through the chunks before it and the first
      rank's step after them (with ``M = 1``: every stage of a replica one after the other); where ranks share a
      host's cores, the host's ranks' compute over its cores;
    * links: the bytes each link between two stages carries per step, one way, at its bandwidth
      (:meth:`Cluster.link_seconds`: activations forward, their gradients back);
    * the gradients' reduction: one allreduce of a rank's parameters over its stage's replicas.

    Stages with their own replica counts: the busiest replica's ``ceil(M / R_s)`` micro-batches of its stage,
    then its step."""
    if candidate.stage_replicas:
        return _replica_lower_bound(profile, cluster, candidate, global_batch)
    p, m = candidate.stages, candidate.micro_batches
    micro = global_batch / candidate.replicas / m
    forward, backward = chunk_seconds(profile, cluster, candidate, micro)
    overhead = cluster.action_overhead_us * 1e-6
    split = sched.spec(candidate.schedule).split_backward
    hand_off = cluster.transfer_overhead_us * 1e-6
    transfers = [(c > 0) + (c < len(forward) - 1) for c in range(len(forward))]
    forward = [f + overhead + hand_off * k for f, k in zip(forward, transfers)]
    backward = [b + (2 if split else 1) * overhead + hand_off * k for b, k in zip(backward, transfers)]
    if split:
        backward = [b + w for b, w in zip(backward, _weight_call_seconds(profile, _chunk_layers(candidate.balance),
                                                                         cluster))]
    asynchronous = candidate.schedule in sched.ASYNCHRONOUS
    chain = candidate.virtual_stages == 1 and not asynchronous
    update = [0.0] * p if asynchronous else _update_seconds(profile, cluster, candidate)
    bound = 0.0
    own = [m * sum(forward[c] + backward[c] for c in range(r, len(forward), p)) for r in range(p)]
    for r in range(p):
        work, tail = own[r], update[r]
        if chain:
            work += sum(forward[:r])
            tail = max(tail, (0.0 if split else sum(backward[:r])) + (update[0] if r else 0.0))
        bound = max(bound, work + tail)
    if cluster.shares_cores(profile.device):  # a host's ranks compute at most as fast as its cores
        bound = max(bound, min(cluster.per_host, cluster.ranks) * min(own) / cluster.cores_per_host)
    return max(bound, _link_lower_bound(profile, cluster, candidate, micro, activation_factor(profile, precision)),
               _reduction_lower_bound(profile, cluster, candidate))


def _update_seconds(profile: Profile, cluster: Cluster, candidate: Candidate) -> list[float]:
    """Each pipeline rank's optimizer step alone (ZeRO: on its ``1/D`` shard), at the speed its compute is costed."""
    layers = _chunk_layers(candidate.balance)
    slow = (1.0 if cluster.shares_cores(profile.device)
            else cluster.slowdown_for(rank_parameter_bytes(profile, candidate)))
    shards = candidate.replicas if candidate.zero else 1
    return [profile.update_ms_per_mb * sum(profile.layers[i].parameter_bytes for c in range(r, len(layers),
                                                                                             candidate.stages)
                                           for i in layers[c]) / shards / 2**20 / 1e3 * slow
            for r in range(candidate.stages)]


def _link_lower_bound(profile: Profile, cluster: Cluster, candidate: Candidate, micro: float, scale: float) -> float:
    """The busiest link's one-way time per step: each cut's ``M`` activations one way, their gradients the other,
    on replica 0's pipeline (the others' are the same shifted)."""
    layers = _chunk_layers(candidate.balance)
    carried: dict[tuple[int, int], float] = {}
    for c in range(len(layers) - 1):
        a, b = sched.stage_to_rank(c % candidate.stages, candidate.stages), \
            sched.stage_to_rank((c + 1) % candidate.stages, candidate.stages)
        if a == b:
            continue
        one = candidate.micro_batches * cluster.link_seconds(
            profile.layers[layers[c][-1]].output_bytes * micro * scale, a, b)
        carried[(a, b)] = carried.get((a, b), 0.0) + one
        carried[(b, a)] = carried.get((b, a), 0.0) + one
    return max(carried.values(), default=0.0)


def _reduction_lower_bound(profile: Profile, cluster: Cluster, candidate: Candidate) -> float:
    """The slowest stage's gradients reduced over its replicas in one allreduce (ZeRO's reduce-scatter and
    allgather carry as much), with nothing else on the links."""
    if candidate.replicas < 2 or candidate.schedule in sched.ASYNCHRONOUS:
        return 0.0
    return allreduce_seconds(rank_parameter_bytes(profile, candidate),
                             [replica * candidate.stages for replica in range(candidate.replicas)], cluster)


def _replica_lower_bound(profile: Profile, cluster: Cluster, candidate: Candidate, global_batch: int) -> float:
    """:func:`step_lower_bound` of stages with their own replica counts."""
    forward, backward = chunk_seconds(profile, cluster, candidate, global_batch / candidate.micro_batches)
    straight = dataclasses.replace(candidate, stage_replicas=(), replicas=1)
    update = _update_seconds(profile, cluster, straight)
    return max(math.ceil(candidate.micro_batches / count) * (f + b) + u
               for count, f, b, u in zip(candidate.stage_replicas, forward, backward, update))


def memory_per_rank(profile: Profile, candidate: Candidate, global_batch: int,
                    optimizer_state_factor: float = 2.0, precision: str | None = None) -> list[float]:
    """Each pipeline rank's peak bytes: parameters, gradients, optimizer state, the asynchronous schedules'
    weight versions, and the larger of the activations of the micro-batches the schedule holds at once
    (re-materializing: their inputs and one micro-batch's activations) and the optimizer step's
    temporaries (the activations are freed by then). With ZeRO (``candidate.zero``): the state, a flat
    shard of the parameters and its gradient ``/D``, and the buffers the sharded optimizer holds (see the
    module docstring). ``precision``: activations in bf16 / fp16 (:func:`activation_factor`)."""
    p, v, d = candidate.stages, candidate.virtual_stages, candidate.replicas
    check_zero(candidate.zero, d, candidate.schedule)
    scale = activation_factor(profile, precision)
    chunks = p * v
    micro = global_batch / candidate.replicas / candidate.micro_batches
    layers = _chunk_layers(candidate.balance)
    parameter_bytes = [sum(profile.layers[i].parameter_bytes for c in range(r, chunks, p) for i in layers[c])
                       for r in range(p)]
    activation = [sum(profile.layers[i].activation_bytes for i in chunk) * micro * scale for chunk in layers]
    inputs = [(profile.input_bytes if c == 0 else profile.layers[layers[c][0] - 1].output_bytes * scale) * micro
              for c in range(chunks)]
    held_per_rank = held_micro_batches(candidate.schedule, p, candidate.micro_batches, v)
    memory = []
    for r in range(p):
        held = held_per_rank[r]
        own = list(range(r, chunks, p))
        per_micro = max(activation[c] for c in own)
        if candidate.checkpoint != "never":
            acts = held * max(inputs[c] for c in own) + per_micro
        else:
            acts = held * per_micro
        described = sched.spec(candidate.schedule)
        versions = described.weight_versions(p, r) * parameter_bytes[r] if described.asynchronous else 0.0
        # a synchronous step's activations are gone when the optimizer steps: the larger of the two is
        # the peak; an asynchronous one updates while micro-batches are in flight
        weights = parameter_bytes[r]
        largest = max((profile.layers[i].parameter_bytes for c in own for i in layers[c]), default=0)
        if candidate.zero == 3:  # the shard, its gradient and state; gathered: a module's buckets and the next's
            shard = weights / d
            gathered = min(weights, 3 * ZERO_BUCKET_BYTES)
            # .grad accumulates whole over the micro-batches before the last backward; with one, bucket by bucket
            grads = weights if candidate.micro_batches > 1 else min(weights, 2 * ZERO_BUCKET_BYTES)
            temporaries = max(shard * profile.update_temporary_factor, shard * profile.update_temporary_per_tensor)
            memory.append(shard * (2 + optimizer_state_factor) + max(acts + grads + gathered, temporaries))
            continue
        if candidate.zero:  # the optimizer steps one flat shard per param group: its largest tensor
            shard = weights / d
            # ... then the allgather's buffers: two buckets' at a time (zero.py gathers with a window of two);
            # during the backward the flat copies of the buckets not yet reduce-scattered, as many at most
            temporaries = max(shard * profile.update_temporary_factor, shard * profile.update_temporary_per_tensor,
                              min(weights, 2 * ZERO_BUCKET_BYTES))
            static = weights + shard * (2 + optimizer_state_factor)  # parameters; shard, its gradient, state
            if candidate.zero == 1:  # .grad kept, and copied into the reduce-scatter's buffers (<= temporaries)
                memory.append(static + weights + max(acts, temporaries))
            else:  # gradients accumulate before the last micro-batch; one: freed as the activations are
                pipeline = acts + weights if candidate.micro_batches > 1 else max(acts, weights)
                memory.append(static + max(pipeline, temporaries))
            continue
        temporaries = max(weights * profile.update_temporary_factor,
                          largest * profile.update_temporary_per_tensor)  # a layer's bytes bound its largest tensor
        held_then = acts + temporaries if candidate.schedule in sched.ASYNCHRONOUS else max(acts, temporaries)
        memory.append(weights * (2 + optimizer_state_factor) + versions + held_then)
    return memory


def _reduction_end(items: list[sched.TimedAction], chunks_here: list[int], layers: list[range], profile: Profile,
                   micro: float, group: list[int], cluster: Cluster, concurrent: int,
                   zero: int = 0) -> tuple[float, float]:
    """When this rank's last gradient bucket is reduced (ZeRO: reduce-scattered), and the reductions' total time.

    A layer's gradient is final when its share of its chunk's last backward (``B``, or ``W`` when split)
    is done; the layers of a chunk finish in reverse order, each after its own backward time. Where the
    reductions run on the cores the backward computes on (:meth:`Cluster.reductions_share_cores`), the
    reductions that overlap the backward delay it as much: the last one ends their total time after the
    rank's last action."""
    ready: list[tuple[float, float]] = []
    for c in chunks_here:
        last = max((t for t in items if t.action.stage == c and t.action.kind in (
            sched.ActionKind.BACKWARD, sched.ActionKind.BACKWARD_WEIGHT)), key=lambda t: t.end, default=None)
        if last is None:
            continue
        order = list(reversed(layers[c]))
        weights = [profile.layers[i].backward_seconds(micro) for i in order]
        total, done = sum(weights), 0.0
        for i, weight in zip(order, weights):
            done += weight
            fraction = done / total if total > 0 else 1.0
            if profile.layers[i].parameter_bytes:
                ready.append((last.start + (last.end - last.start) * fraction, profile.layers[i].parameter_bytes))
    ready.sort()
    end = busy = bucket = 0.0
    for index, (time, nbytes) in enumerate(ready):
        bucket += nbytes
        if bucket >= cluster.fusion_bytes or index == len(ready) - 1:
            cost = (reducescatter_seconds if zero else allreduce_seconds)(bucket, group, cluster, concurrent)
            end, busy, bucket = max(end, time) + cost, busy + cost, 0.0
    if ready and cluster.reductions_share_cores(profile.device):
        end = max(end, max(t.end for t in items) + busy)
    return end, busy


def _bucketed_seconds(collective: Callable[..., float], layer_bytes: list[int], group: list[int], cluster: Cluster,
                      concurrent: int) -> float:
    """``collective`` over a rank's gradient buckets, one after another (layers in the backward's order until one
    reaches ``fusion_bytes``): ZeRO's allgather of the updated parameters after its step, or the gradients'
    allreduce."""
    total = bucket = 0.0
    for index, nbytes in enumerate(layer_bytes):
        bucket += nbytes
        if bucket >= cluster.fusion_bytes or index == len(layer_bytes) - 1:
            total, bucket = total + collective(bucket, group, cluster, concurrent), 0.0
    return total


def _tail_seconds(profile: Profile, cluster: Cluster, parameter_bytes: float, layer_bytes: list[int],
                  group: list[int]) -> float:
    """A rank's work after its last action, at the profile's speed, where the simulation shares the cores: its
    optimizer step and, where the reductions run on the cores too (:meth:`Cluster.reductions_share_cores`), its
    gradients' allreduce over its replicas ``group``."""
    update = profile.update_ms_per_mb * parameter_bytes / 2**20 / 1e3
    if len(group) < 2 or not cluster.reductions_share_cores(profile.device):
        return update
    return update + _bucketed_seconds(allreduce_seconds, layer_bytes, group, cluster, 1)


def _submit_seconds(profile: Profile, layer_indices: list[int], cluster: Cluster) -> float:
    """What ``hp.DistributedOptimizer``'s hooks add to a rank's last backward: a hand-off per gradient tensor."""
    return cluster.submit_overhead_us * 1e-6 * sum(profile.layers[i].gradient_tensors for i in layer_indices)


def _after_reduction_seconds(parameter_bytes: float, cluster: Cluster) -> float:
    """How much longer the optimizer's step over ``parameter_bytes`` takes right after the gradients' reduction."""
    return cluster.after_reduction_us_per_mib * 1e-6 * parameter_bytes / 2**20


def _durations(profile: Profile, cluster: Cluster, layers: list[range], forward: list[float], backward: list[float],
               transfer: Any) -> dict[str, Any]:
    """The simulator's time of each action: its compute, its own overhead, and the hand-off of each transfer it
    receives or sends (a forward of a middle chunk both); of a split backward (the simulator times I as backward −
    W) each half pays the overhead, the I the hand-offs, and the W one backward call per layer with weights (the
    executor asks autograd for each such layer's weight gradient apart, from its recorded output; added to the
    split's whole, as the simulator takes I as the whole minus W)."""
    overhead = cluster.action_overhead_us * 1e-6
    weight_calls = _weight_call_seconds(profile, layers, cluster)
    hand_off = cluster.transfer_overhead_us * 1e-6
    chunks = len(layers)
    transfers = [(c > 0) + (c < chunks - 1) for c in range(chunks)]
    return dict(forward_time=lambda a: forward[a.stage] + overhead + hand_off * transfers[a.stage],
                backward_time=lambda a: (backward[a.stage] + hand_off * transfers[a.stage]
                                         + ((2 * overhead + weight_calls[a.stage])
                                            if a.kind is sched.ActionKind.BACKWARD_INPUT else overhead)),
                weight_time=lambda a: backward[a.stage] / 2 + overhead + weight_calls[a.stage],
                transfer_time=transfer)


def _tails(profile: Profile, cluster: Cluster, parameter_bytes: list[float], layer_bytes: list[list[int]],
           groups: list[list[int]]) -> list[float]:
    """Each pipeline rank's :func:`_tail_seconds` where the simulation shares the cores, else none."""
    if not cluster.shares_cores(profile.device):
        return []
    return [_tail_seconds(profile, cluster, nbytes, weights, group)
            for nbytes, weights, group in zip(parameter_bytes, layer_bytes, groups)]


def _simulate(profile: Profile, cluster: Cluster, lists: sched.Schedule, hosts: list[int], weights: list[int],
              rank_bytes: float, tails: Sequence[float] = (), **times: Any) -> sched.Timeline:
    """The schedule's timeline: where the ranks share their host's cores (:meth:`Cluster.shares_cores`), each
    list computes at the speed that what computes beside it on its host leaves it; ``hosts`` gives each list's
    host and ``weights`` how many ranks it stands for there (a pipeline simulated once for its replicas, which
    compute in step with it); ``tails``, each list's work after its last action, sharing the cores too."""
    if not cluster.shares_cores(profile.device):
        return sched.simulate(lists, resume=cluster.resume_us * 1e-6, **times)
    cores, contention = cluster.cores_per_host, cluster.contention_for(rank_bytes)

    def speed(running: Sequence[int]) -> list[float]:
        load: dict[int, float] = {}  # on the cores: a list not computing still takes waiting_load of one
        for i in range(len(hosts)):
            load[hosts[i]] = load.get(hosts[i], 0.0) + weights[i] * (1.0 if i in running else cluster.waiting_load)
        return [1.0 / (max(1.0, load[hosts[i]] / cores) * contention) for i in running]

    return sched.simulate_shared(lists, speed, tails=tails, resume=cluster.resume_us * 1e-6, **times)


def _predict_stage_replicas(profile: Profile, cluster: Cluster, candidate: Candidate, global_batch: int,
                            optimizer_state_factor: float, precision: str | None) -> Prediction:
    """:func:`predict` for stages with their own replica counts: every replica's own actions (its micro-batches
    of the schedule, in its order) simulated as one list, each message between the replicas that run its
    micro-batch; each stage's gradients allreduced over its replicas as they become final."""
    counts, p, m = candidate.stage_replicas, candidate.stages, candidate.micro_batches
    if len(counts) != p or sum(counts) != cluster.ranks or candidate.replicas != 1:
        raise UsageError(f"stage_replicas {list(counts)} must give one count per stage ({p}) adding up to the "
                         f"cluster's {cluster.ranks} ranks, with replicas=1")
    if candidate.schedule not in sched.REPLICA_SCHEDULES or candidate.virtual_stages != 1 or candidate.zero:
        raise UsageError(f"stages with their own replica counts run {', '.join(sched.REPLICA_SCHEDULES)} with "
                         f"one chunk per rank and zero=0 (got {candidate.schedule!r}, virtual_stages="
                         f"{candidate.virtual_stages}, zero={candidate.zero})")
    if len(candidate.balance) != p or sum(candidate.balance) != len(profile.layers):
        raise UsageError(f"balance {list(candidate.balance)} does not cut {len(profile.layers)} layers into "
                         f"{p} stages")
    places = layout(tuple(counts))
    rank_of = rank_of_place(tuple(counts))

    def placement(stage: int, micro_batch: int) -> int:
        return rank_of[(stage, micro_batch % counts[stage])]

    scale = activation_factor(profile, precision)
    micro = global_batch / m
    layers = _chunk_layers(candidate.balance)
    forward, backward = chunk_seconds(profile, cluster, candidate, micro)
    output = [profile.layers[chunk[-1]].output_bytes * micro * scale for chunk in layers]

    def transfer(action: sched.Action) -> float:
        if action.kind is sched.ActionKind.FORWARD:
            source = action.stage - 1
            return cluster.link_seconds(output[source], placement(source, action.micro_batch),
                                        placement(action.stage, action.micro_batch))
        return cluster.link_seconds(output[action.stage], placement(action.stage + 1, action.micro_batch),
                                    placement(action.stage, action.micro_batch))

    every = sched.replica_schedule(candidate.schedule, counts, m)
    lists = [every[place] for place in places]
    parameter_bytes = [sum(profile.layers[i].parameter_bytes for i in layers[s]) for s in range(p)]
    groups = [[rank_of[(s, r)] for r in range(counts[s])] for s in range(p)]
    weighted = [[profile.layers[i].parameter_bytes for i in reversed(layers[s]) if profile.layers[i].parameter_bytes]
                for s in range(p)]
    tails = _tails(profile, cluster, [parameter_bytes[s] for s, _ in places], [weighted[s] for s, _ in places],
                   [groups[s] for s, _ in places])  # sharing cores: each replica's step and reductions after it
    timeline = _simulate(profile, cluster, lists, [cluster.host_of(rank) for rank in range(len(lists))],
                         [1] * len(lists), max(parameter_bytes), tails,
                         **_durations(profile, cluster, layers, forward, backward, transfer), placement=placement)
    if any(action is not None for action in timeline.blocked):
        raise InternalError(f"stage_replicas {list(counts)} with {candidate.schedule!r} and {m} micro-batches "
                            "deadlocks in the simulation; this is a bug in hybridpipe's planner, please report it")
    slow = cluster.slowdown_for(max(parameter_bytes))
    # after its last action and its gradients' reduction, each stage's replicas agree on which gradients exist and
    # step: the optimizer's hooks and its step right after the reduction as in predict (the step simulated, sharing)
    update = [0.0 if tails else profile.update_ms_per_mb * parameter_bytes[s] / 2**20 / 1e3 * slow
              for s in range(p)]
    after = [update[s] + ((allreduce_seconds(64, groups[s], cluster)
                           + _submit_seconds(profile, list(layers[s]), cluster)
                           + _after_reduction_seconds(parameter_bytes[s], cluster)) if counts[s] > 1 else 0.0)
             for s in range(p)]
    finished, busiest = [], 0.0
    for rank, (stage, _) in enumerate(places):
        items = timeline.stages[rank]
        end, busy = (_reduction_end(items, [stage], layers, profile, micro, groups[stage], cluster, 1)
                     if counts[stage] > 1 else (0.0, 0.0))
        own = timeline.tail_ends[rank] if tails else (items[-1].end if items else 0.0)
        finished.append(max(own, end) + after[stage])
        busiest = max(busiest, busy)
    pipeline = timeline.makespan
    step = max([pipeline] + finished)
    # memory: a replica holds at most what the straight pipeline's stage holds (its micro-batches are fewer)
    straight = dataclasses.replace(candidate, stage_replicas=(), replicas=1)
    per_stage = memory_per_rank(profile, straight, global_batch, optimizer_state_factor, precision)
    memory = [per_stage[stage] for stage, _ in places]
    notes = [f"stages with their own replica counts: {'-'.join(map(str, counts))}"]
    return Prediction(step_seconds=step, memory_bytes_per_rank=memory,
                      samples_per_second=global_batch / step if step > 0 else math.inf, pipeline_seconds=pipeline,
                      allreduce_seconds=busiest, exposed_allreduce_seconds=step - pipeline, notes=notes)


def predict(profile: Profile, cluster: Cluster, candidate: Candidate, global_batch: int,
            optimizer_state_factor: float = 2.0, precision: str | None = None) -> Prediction:
    """Step time and memory per rank of ``candidate`` for a global batch of ``global_batch`` samples.

    ``precision`` is the pipeline's (``hp.PipelineModel(precision=...)``; None: the profile's): in bf16 / fp16
    the activations stored and sent take half the bytes of fp32 (:func:`activation_factor`). The step is never
    below :func:`step_lower_bound` (``lower_bound_seconds``): a simulation that comes out lower is raised to it,
    with a note naming the bound.

    Raises:
        UsageError: the candidate does not fit the profile or the cluster, or its ZeRO level or the
            precision is not one it can use (named).
    """
    prediction = _simulated(profile, cluster, candidate, global_batch, optimizer_state_factor, precision)
    bound = step_lower_bound(profile, cluster, candidate, global_batch, precision)
    prediction.lower_bound_seconds = bound
    if 0 < bound and prediction.step_seconds < bound:
        prediction.notes.append(f"raised from the simulated {prediction.step_seconds * 1e3:.3g} ms to the lower "
                                f"bound {bound * 1e3:.3g} ms")
        prediction.exposed_allreduce_seconds += bound - prediction.step_seconds
        prediction.step_seconds, prediction.samples_per_second = bound, global_batch / bound
    return prediction


def _simulated(profile: Profile, cluster: Cluster, candidate: Candidate, global_batch: int,
               optimizer_state_factor: float, precision: str | None) -> Prediction:
    """:func:`predict` before the lower bound: the schedule simulated."""
    if candidate.stage_replicas:
        return _predict_stage_replicas(profile, cluster, candidate, global_batch, optimizer_state_factor, precision)
    if candidate.zero and cluster.zero_step_us_per_mib[candidate.zero - 1] > 0:
        return _measured_zero(profile, cluster, candidate, global_batch, optimizer_state_factor, precision)
    p, d, m = candidate.stages, candidate.replicas, candidate.micro_batches
    check_zero(candidate.zero, d, candidate.schedule)
    scale = activation_factor(profile, precision)
    v = candidate.virtual_stages
    chunks = p * v
    if p * d != cluster.ranks:
        raise UsageError(f"{p} stages × {d} replicas is {p * d} ranks, but the cluster has {cluster.ranks}")
    if len(candidate.balance) != chunks or sum(candidate.balance) != len(profile.layers):
        raise UsageError(f"balance {list(candidate.balance)} does not cut {len(profile.layers)} layers into "
                         f"{chunks} chunks")
    if global_batch % d:
        raise UsageError(f"global batch {global_batch} does not split evenly over {d} replicas")
    per_replica = global_batch // d
    micro = per_replica / m
    layers = _chunk_layers(candidate.balance)
    forward, backward = chunk_seconds(profile, cluster, candidate, micro)
    output = [profile.layers[chunk[-1]].output_bytes * micro * scale for chunk in layers]
    groups = [[replica * p + r for replica in range(d)] for r in range(p)]
    spans_hosts = d > 1 and cluster.host_of(groups[0][-1]) != cluster.host_of(groups[0][0])
    concurrent = min(p, cluster.per_host) if spans_hosts else 1  # stages of a host reducing at once
    zero = candidate.zero
    if zero == 3 and d > 1:  # each forward and backward of a chunk gathers its parameters (per micro-batch)
        gathers = [_bucketed_seconds(allgather_seconds, [profile.layers[i].parameter_bytes for i in reversed(chunk)
                                                         if profile.layers[i].parameter_bytes],
                                     groups[c % p], cluster, concurrent) for c, chunk in enumerate(layers)]
        forward = [f + g for f, g in zip(forward, gathers)]
        backward = [b + g for b, g in zip(backward, gathers)]

    def rank_of(stage: int) -> int:  # replica 0's pipeline; others are the same shifted by host
        return sched.stage_to_rank(stage, p)

    def transfer(action: sched.Action) -> float:
        if action.kind is sched.ActionKind.FORWARD:
            source = action.stage - 1
            return cluster.link_seconds(output[source], rank_of(source), rank_of(action.stage))
        return cluster.link_seconds(output[action.stage], rank_of(action.stage + 1), rank_of(action.stage))

    duration = _durations(profile, cluster, layers, forward, backward, transfer)
    asynchronous = candidate.schedule in sched.ASYNCHRONOUS
    plan = schedule_of(candidate.schedule, p, m, v)
    parameter_bytes = [sum(profile.layers[i].parameter_bytes for c in range(r, chunks, p) for i in layers[c])
                       for r in range(p)]
    layer_bytes = [[profile.layers[i].parameter_bytes for c in reversed(range(r, chunks, p))
                    for i in reversed(layers[c]) if profile.layers[i].parameter_bytes] for r in range(p)]
    slow = cluster.slowdown_for(max(parameter_bytes))
    hosts = [cluster.host_of(r) for r in range(p)]  # replica 0's ranks, each standing for its stage's replicas there
    simulate = functools.partial(_simulate, profile, cluster, hosts=hosts, rank_bytes=max(parameter_bytes), weights=[
        sum(cluster.host_of(rank) == hosts[r] for rank in groups[r]) for r in range(p)], **duration)
    # the optimizer's step (ZeRO: on 1/D of the parameters, then, but for ZeRO-3, their allgather)
    update = [profile.update_ms_per_mb * parameter_bytes[r] / (d if zero else 1) / 2**20 / 1e3 * slow
              + (_bucketed_seconds(allgather_seconds, layer_bytes[r], groups[r], cluster, concurrent)
                 if zero in (1, 2) else 0.0) for r in range(p)]
    # step(): which gradients exist, agreed (ZeRO's step reduce-scatters every bucket instead)
    flags = allreduce_seconds(64, groups[0], cluster, concurrent) if d > 1 and not zero else 0.0
    if asynchronous:  # steady state: steps 2-4 of the stream; an update per micro-batch (pipedream) or step (2bw)
        one = simulate(sched.async_schedule(candidate.schedule, p, m, steps=1, flush=False)).makespan
        pipeline = (simulate(plan).makespan - one) / 3
        reduce = [allreduce_seconds(parameter_bytes[r], groups[r], cluster, concurrent) for r in range(p)]
        updates = m if sched.spec(candidate.schedule).update_every_micro_batch else 1
        exposed = max(r + u for r, u in zip(reduce, update)) * updates
        step, slowest_reduction = pipeline + exposed, max(reduce)
    else:
        step, pipeline, exposed, slowest_reduction = _synchronous_step(
            profile, cluster, candidate, simulate(plan, tails=[] if zero else _tails(
                profile, cluster, parameter_bytes, layer_bytes, groups)), layers, micro, groups, parameter_bytes,
            layer_bytes, update, flags, concurrent)
    memory = memory_per_rank(profile, candidate, global_batch, optimizer_state_factor, precision)
    return Prediction(step_seconds=step, memory_bytes_per_rank=memory,
                      samples_per_second=global_batch / step if step > 0 else math.inf, pipeline_seconds=pipeline,
                      allreduce_seconds=slowest_reduction, exposed_allreduce_seconds=exposed,
                      notes=_slowdown_notes(cluster))


def _measured_zero(profile: Profile, cluster: Cluster, candidate: Candidate, global_batch: int,
                   optimizer_state_factor: float, precision: str | None) -> Prediction:
    """:func:`predict` for a ZeRO candidate on a cluster whose ZeRO step was measured (``zero_step_us_per_mib``): the
    same candidate without ZeRO, its step longer by the measured time per MiB of the largest rank's parameters; the
    memory is ZeRO's."""
    check_zero(candidate.zero, candidate.replicas, candidate.schedule)
    plain = predict(profile, cluster, dataclasses.replace(candidate, zero=0), global_batch, optimizer_state_factor,
                    precision)
    measured = cluster.zero_step_us_per_mib
    per_mib = measured[candidate.zero - 1]
    if candidate.zero == 3:  # measured for one forward and backward: their gathers come once per micro-batch
        once = measured[1] if measured[1] > 0 else 0.0
        per_mib = once + (measured[2] - once) * candidate.micro_batches
    extra = per_mib * 1e-6 * rank_parameter_bytes(profile, candidate) / 2**20
    step = plain.step_seconds + extra
    return Prediction(step_seconds=step,
                      memory_bytes_per_rank=memory_per_rank(profile, candidate, global_batch, optimizer_state_factor,
                                                            precision),
                      samples_per_second=global_batch / step if step > 0 else math.inf,
                      pipeline_seconds=plain.pipeline_seconds, allreduce_seconds=plain.allreduce_seconds,
                      exposed_allreduce_seconds=plain.exposed_allreduce_seconds + extra,
                      notes=plain.notes + [f"ZeRO-{candidate.zero}: the step as measured here, "
                                           f"{per_mib:.0f} us per MiB beyond a plain data-parallel one"])


def _synchronous_step(profile: Profile, cluster: Cluster, candidate: Candidate, timeline: sched.Timeline,
                      layers: list[range], micro: float, groups: list[list[int]], parameter_bytes: list[float],
                      layer_bytes: list[list[int]], update: list[float], flags: float,
                      concurrent: int) -> tuple[float, float, float, float]:
    """A synchronous schedule's step from its simulated ``timeline``: each rank's optimizer step comes after its
    own actions and its gradients' reduction; with replicas the optimizer's hooks lengthen the last backward by
    a hand-off per gradient tensor, and the step right after the reduction runs slower than alone (both
    calibrated). Returns the step, the pipeline's makespan, the time exposed beyond it and the slowest rank's
    reduction time."""
    p, d, zero = candidate.stages, candidate.replicas, candidate.zero
    chunks = len(layers)
    pipeline = timeline.makespan
    ends = [_reduction_end(timeline.stages[r], list(range(r, chunks, p)), layers, profile, micro, groups[r],
                           cluster, concurrent, zero) if d > 1 else (0.0, 0.0) for r in range(p)]
    submits = [_submit_seconds(profile, [i for c in range(r, chunks, p) for i in layers[c]], cluster)
               if d > 1 else 0.0 for r in range(p)]
    after = [_after_reduction_seconds(parameter_bytes[r], cluster) if d > 1 and not zero else 0.0 for r in range(p)]
    last = [items[-1].end if items else 0.0 for items in timeline.stages]
    # with tail_ends, the simulation ran each rank's step (and, sharing cores, its reductions) after its last action
    own_end, charged = (timeline.tail_ends, [0.0] * p) if timeline.tail_ends else (last, update)
    finished = [max(own, end) + submit + flags + u + late
                for own, (end, _), u, submit, late in zip(own_end, ends, charged, submits, after)]
    if d > 1 and not zero and cluster.reductions_share_cores(profile.device):  # as measured beside plain steps
        finished = [max(done, own + u + cluster.data_parallel_us_per_mib * 1e-6 * nbytes / 2**20)
                    for done, own, u, nbytes in zip(finished, last, update, parameter_bytes)]
    step = max([pipeline] + finished)
    slowest = max(busy + (_bucketed_seconds(allgather_seconds, w, g, cluster, concurrent) if zero in (1, 2) else 0.0)
                  for (_, busy), w, g in zip(ends, layer_bytes, groups))
    return step, pipeline, step - pipeline, slowest


def _slowdown_notes(cluster: Cluster) -> list[str]:
    """Why the prediction's compute is slower than the profile's (ranks sharing cores, contention, resuming)."""
    resumed = ([f"+ {cluster.resume_us:.0f} µs for each action a rank starts after a wait"]
               if cluster.resume_us > 0 else [])
    if cluster.compute_slowdown <= 1:
        return resumed
    reasons = []
    if cluster.cores_per_host and min(cluster.per_host, cluster.ranks) > cluster.cores_per_host:
        reasons.append(f"{cluster.per_host} ranks share {cluster.cores_per_host} cores per host")
    if cluster.compute_contention > 1:
        reasons.append(f"× {cluster.compute_contention:.3g} for synchronous ranks computing at once")
    return [f"compute × {cluster.compute_slowdown:.3g}: {'; '.join(reasons)}", *resumed]

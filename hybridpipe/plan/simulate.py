"""Predicted scaling: the best plan at each cluster size (8 to 1024 ranks by default), its throughput and
its efficiency against linear scaling from the smallest size (``python -m hybridpipe.plan --simulate``).

Design reasons:

* Each size is planned on its own by :func:`hybridpipe.plan.search.plan` with the cluster's
  ``ranks`` changed and everything else (ranks per host, links, memory) kept: the table shows
  what the planner would choose there, not one configuration stretched.
* Weak scaling (the default, as Horovod's paper measures) grows the global batch with the ranks,
  so each rank keeps its share of the work; strong scaling keeps one global batch, which stops
  dividing once there are more replicas than samples.
* Efficiency is samples/s per rank against that of the smallest size that has a plan (the
  "linear" line of a scaling plot); ranks whose plan needs more memory than given are reported,
  with what they would need, instead of a number.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from hybridpipe.errors import BuildError, HybridPipeError, UsageError
from hybridpipe.plan.cost import Cluster
from hybridpipe.plan.profile import Profile
from hybridpipe.plan.search import Plan, plan

__all__ = ["ScalingRow", "parse_sizes", "scaling", "render_scaling", "plot_scaling", "DEFAULT_SIZES", "Engine",
           "DataParallelRow", "ring_allreduce_seconds", "data_parallel_step", "data_parallel_scaling",
           "render_data_parallel", "PipelineRow", "pipeline_scaling", "render_pipeline", "GridRow", "grid_comparison",
           "render_grids"]

DEFAULT_SIZES = "8:1024"


@dataclass
class ScalingRow:
    """One cluster size of :func:`scaling`."""

    ranks: int
    global_batch: int
    plan: Plan | None
    problem: str = ""        # why there is no plan (set when ``plan`` is None)
    efficiency: float = 0.0  # samples/s per rank ÷ that of the first size with a plan
    search_seconds: float = 0.0


def parse_sizes(text: str) -> list[int]:
    """``"8:1024"`` (the powers of two from 8 to 1024) or ``"8,16,48"`` (those sizes), ascending.

    Raises:
        UsageError: anything else, naming the text and the two forms.
    """
    usage = f"--sizes takes FIRST:LAST (powers of two between, e.g. 8:1024) or a list (e.g. 8,16,48); got {text!r}"
    try:
        first, last = (int(part) for part in text.split(":")) if ":" in text else (0, 0)
        listed = None if ":" in text else sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UsageError(usage) from None
    if listed is None:
        if first < 1 or last < first:
            raise UsageError(f"{usage} (need 1 <= FIRST <= LAST)")
        sizes, size = [], first
        while size <= last:
            sizes.append(size)
            size *= 2
    else:
        sizes = listed
    if not sizes or sizes[0] < 1:
        raise UsageError(f"{usage} (sizes must be >= 1)")
    return sizes


def scaling(profile: Profile, cluster: Cluster, sizes: list[int], global_batch: int, weak: bool = True,
            **plan_options) -> list[ScalingRow]:
    """The best plan for each size of ``sizes`` ranks.

    Args:
        profile: The model's per-layer costs.
        cluster: Everything but the rank count (ranks per host, links, memory per rank).
        sizes: Rank counts, ascending.
        global_batch: The global batch at ``sizes[0]`` ranks (weak scaling), or at every size (strong).
        weak: Grow the global batch in proportion to the ranks.
        plan_options: Passed on to :func:`hybridpipe.plan.search.plan`.

    Returns:
        One :class:`ScalingRow` per size.
    """
    rows = []
    for ranks in sizes:
        batch = global_batch * ranks // sizes[0] if weak else global_batch
        started = time.perf_counter()
        try:
            best = plan(profile, dataclasses.replace(cluster, ranks=ranks), batch, **plan_options)
            row = ScalingRow(ranks, batch, best)
        except HybridPipeError as error:
            row = ScalingRow(ranks, batch, None, problem=str(error))
        row.search_seconds = time.perf_counter() - started
        rows.append(row)
    base = next((row for row in rows if row.plan is not None), None)
    for row in rows:
        if row.plan is not None and base is not None and base.plan is not None:
            row.efficiency = (row.plan.samples_per_second / row.ranks) / (base.plan.samples_per_second / base.ranks)
    return rows


@dataclass
class GridRow:
    """One size of :func:`grid_comparison`: the best plan of each kind of grid."""

    ranks: int
    global_batch: int
    plans: dict[str, Plan | None]   # "data-parallel", "uniform", "stage-replicas" -> the best, or None
    problems: dict[str, str]

    def speedup(self, kind: str) -> float | None:
        """Samples/s of the best ``kind`` plan over data parallelism's."""
        best, base = self.plans.get(kind), self.plans.get("data-parallel")
        if best is None or base is None:
            return None
        return best.samples_per_second / base.samples_per_second


def grid_comparison(profile: Profile, cluster: Cluster, sizes: list[int], global_batch: int, weak: bool = True,
                    **plan_options) -> list[GridRow]:
    """At each size, the best data-parallel plan, the best uniform grid (stages × replicas) and the best grid with
    its own replica count per stage (``python -m hybridpipe.plan --simulate --compare-grids``)."""
    rows = []
    for ranks in sizes:
        batch = global_batch * ranks // sizes[0] if weak else global_batch
        plans: dict[str, Plan | None] = {}
        problems: dict[str, str] = {}
        for kind in ("data-parallel", "uniform", "stage-replicas"):
            try:
                plans[kind] = plan(profile, dataclasses.replace(cluster, ranks=ranks), batch, grids=kind,
                                   **plan_options)
            except HybridPipeError as error:
                plans[kind], problems[kind] = None, str(error)
        rows.append(GridRow(ranks, batch, plans, problems))
    return rows


def render_grids(rows: list[GridRow], markdown: bool = False, sample: str = "samples") -> str:
    """The comparison as a table: per size, each kind's best configuration, step time and speed-up over data
    parallelism."""
    header = ["GPUs", "global batch", "data parallelism", "step s", "best uniform", "step s", "speed-up",
              "own replica counts", "step s", "speed-up"]
    table = []
    for row in rows:
        cells = [str(row.ranks), str(row.global_batch)]
        for kind in ("data-parallel", "uniform", "stage-replicas"):
            best = row.plans.get(kind)
            if best is None:
                cells += ["-", "-"] + ([] if kind == "data-parallel" else ["-"])
                continue
            name = f"{best.config} {best.schedule} M={best.micro_batches}" if kind != "data-parallel" else best.config
            cells += [name, f"{best.step_seconds:.3f}"]
            if kind != "data-parallel":
                speedup = row.speedup(kind)
                cells.append(f"{speedup:.2f}×" if speedup is not None else "-")
        table.append(cells)
    return _render(header, table, markdown)


def _short_problem(problem: str) -> str:
    if "fits memory_per_rank" in problem and "the smallest needs" in problem:
        needs = problem.split("the smallest needs ", 1)[1].split(" per rank", 1)[0]
        return f"no plan fits the memory (the smallest needs {needs} per rank)"
    if "does not split evenly" in problem:
        return "the global batch does not split over any replica count"
    return problem.split(":", 1)[0]


def render_scaling(rows: list[ScalingRow], markdown: bool = False, sample: str = "samples") -> str:
    """The table: ranks, grid, micro-batches, schedule, re-materialization, ZeRO level, step time, throughput,
    efficiency, memory."""
    base = next((row for row in rows if row.plan is not None), None)
    base_label = f"vs {base.ranks} × linear" if base is not None else "vs linear"
    header = ["GPUs", "stages", "replicas", "micro-batches", "schedule", "checkpoint", "zero", "global batch", "step s",
              f"{sample}/s", f"efficiency {base_label}", "GiB per GPU"]
    table = []
    for row in rows:
        if row.plan is None:
            table.append([str(row.ranks), "-", "-", "-", _short_problem(row.problem), "", "", str(row.global_batch),
                          "", "", "", ""])
            continue
        best = row.plan
        schedule = best.schedule + (f" v={best.virtual_stages}" if best.virtual_stages > 1 else "")
        table.append([str(row.ranks), str(best.stages), str(best.replicas), str(best.micro_batches), schedule,
                      best.checkpoint, str(best.zero), str(row.global_batch), f"{best.step_seconds:.3f}",
                      f"{best.samples_per_second:,.1f}", f"{row.efficiency:.3f}",
                      f"{best.memory_bytes_per_rank / 2**30:.1f}"])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in table])
    planned = [cells for cells in table if cells[1] != "-"]
    widths = [max(len(cells[i]) for cells in [header] + planned) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(header, widths)),
             "  ".join("-" * width for width in widths)]
    for cells in table:
        if cells[1] == "-":  # no plan: the reason spans the columns
            lines.append(f"{cells[0].rjust(widths[0])}  {cells[4]} (global batch {cells[7]})")
        else:
            lines.append("  ".join(cell.rjust(width) for cell, width in zip(cells, widths)))
    return "\n".join(lines)


def plot_scaling(series: dict[str, list[ScalingRow]], path: str, title: str, sample: str = "samples") -> None:
    """Throughput (log-log, with each series' linear line) and efficiency against GPUs, as a PNG.

    Raises:
        BuildError: matplotlib is not installed (pip install matplotlib).
        UsageError: nothing to plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise BuildError("--plot needs matplotlib (pip install matplotlib)") from None
    figure, (throughput, efficiency) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    plotted, highest = False, 1.0
    for label, rows in series.items():
        planned = [row for row in rows if row.plan is not None]
        if not planned:
            continue
        plotted = True
        ranks = [row.ranks for row in planned]
        rates = [row.plan.samples_per_second for row in planned]
        line, = throughput.plot(ranks, rates, marker="o", label=label)
        throughput.plot(ranks, [rates[0] * r / ranks[0] for r in ranks], linestyle=":", color=line.get_color())
        efficiency.plot(ranks, [row.efficiency for row in planned], marker="o", label=label, color=line.get_color())
        highest = max([highest] + [row.efficiency for row in planned])
    if not plotted:
        raise UsageError("nothing to plot: no size has a plan")
    for axis in (throughput, efficiency):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("GPUs")
        axis.grid(True, which="both", alpha=0.3)
    throughput.set_yscale("log")
    throughput.set_ylabel(f"predicted {sample}/s (dotted: linear)")
    efficiency.set_ylabel("scaling efficiency (per GPU vs the smallest size)")
    efficiency.set_ylim(0, highest + 0.05)
    efficiency.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
    efficiency.annotate("Horovod, ResNet-101, 512 GPUs: ~0.9", (512, 0.9), (10, 0.82), fontsize=8, color="grey",
                        arrowprops={"arrowstyle": "->", "color": "grey"})
    efficiency.legend(fontsize=8, loc="lower left")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


# ---- data parallelism as Horovod ran it (--data-parallel-only) -----------------------------------------------------

@dataclass(frozen=True)
class Engine:
    """How gradients are reduced while the backward runs: Horovod's background loop over NCCL 2's ring.

    Attributes (each from a source, none fitted to a scaling result):
        cycle_ms: The loop's period: each cycle gathers the gradients that became ready since the last one
            and reduces them (HOROVOD_CYCLE_TIME: 5 ms until Horovod 0.21, whose change log says "changed
            default cycle time from 5ms to 1ms").
        fusion_bytes: The fusion buffer: ready gradients are packed into allreduces of at most this much
            (HOROVOD_FUSION_THRESHOLD, 64 MB until 0.21; docs/tensor-fusion); a larger tensor goes alone.
        base_us, intra_hop_us, inter_hop_us, plateau: NCCL's own latency model of a ring allreduce
            (src/graph/tuning.cc, Ring / Simple protocol): ``base + (steps − inter_steps) · intra_hop +
            inter_steps · inter_hop`` with ``steps = 2(n−1)`` and ``inter_steps = 2(hosts−1)``, times 1.9
            for a large allreduce across hosts ("plateau effect of ring"); hops over PCIe 5.7 µs, over the
            network 9.6 µs, base 8.4 µs.
        hierarchical: Reduce-scatter inside each host, a ring between hosts of each GPU's share (all of a
            host's GPUs through its network at once), allgather inside (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE,
            off by default); else one flat ring through every GPU, as NCCL 2 built it in 2018.
        gpu_variation: How far apart GPUs of the same model run in one cluster, as a fraction of the median
            GPU's speed: Sinha et al., "Not All GPUs Are Created Equal" (SC 2022), measured 8 % on average
            (up to 22 %) across the GPUs of four clusters, from manufacturing and power management. A
            synchronous step waits for the slowest of its GPUs: speeds spread evenly over the band around
            the median put the slowest of ``n`` at ``1 − v/2 + v/(n+1)`` of the median (1 for one GPU, the
            baseline); every replica's compute is stretched to its pace.
        wire_efficiency: The payload's share of a link's line rate between hosts: RoCE v2 under a 1500-byte
            Ethernet MTU carries 1024 bytes per packet with 82 of preamble and gap (20), Ethernet header and
            FCS (18), IPv4 (20), UDP (8), InfiniBand's BTH (12) and ICRC (4): 1024/1106 (TCP under the same
            MTU: 1448/1538, nearly the same).
        cycle_phases: The loop's cycles are not aligned with the step: the reduction's end is averaged over
            this many evenly spaced phases of the cycle (1: a tick at the step's start).
    """

    cycle_ms: float = 5.0
    fusion_bytes: float = 64 * 2**20
    base_us: float = 8.4
    intra_hop_us: float = 5.7
    inter_hop_us: float = 9.6
    plateau: float = 1.9
    hierarchical: bool = False
    gpu_variation: float = 0.08
    cycle_phases: int = 5
    wire_efficiency: float = 1024 / 1106

    def slowest_pace(self, gpus: int) -> float:
        """The slowest of ``gpus`` GPUs' speed as a fraction of the median's (see ``gpu_variation``)."""
        return 1 - self.gpu_variation / 2 + self.gpu_variation / (gpus + 1)


@dataclass
class DataParallelRow:
    """One size of :func:`data_parallel_scaling`."""

    gpus: int
    global_batch: int
    step_seconds: float
    samples_per_second: float
    speedup_over_one_gpu: float
    efficiency: float            # speedup ÷ GPUs
    exposed_seconds: float       # the step beyond one GPU's: reduction not hidden behind the backward
    allreduces: int              # fused allreduces per step
    network_seconds: float       # the allreduces' total time (hidden or not)

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "global_batch": self.global_batch, "step_seconds": round(self.step_seconds, 6),
                "samples_per_second": round(self.samples_per_second, 3),
                "speedup_over_one_gpu": round(self.speedup_over_one_gpu, 3), "efficiency": round(self.efficiency, 4),
                "exposed_seconds": round(self.exposed_seconds, 6), "allreduces": self.allreduces,
                "network_seconds": round(self.network_seconds, 6)}


def ring_allreduce_seconds(nbytes: float, gpus: int, cluster: Cluster, engine: Engine) -> float:
    """One NCCL allreduce of ``nbytes`` over ``gpus`` GPUs, ``cluster.per_host`` to a host (NCCL's model, see
    :class:`Engine`): its latency, plus ``2(n−1)/n · bytes`` over the slowest link of the ring (a host's network
    when the ring leaves the host, else the link inside it). Hierarchical: the ring inside each host over
    ``bytes/g`` shares, around a ring between the hosts carrying each host's whole ``2(H−1)/H · bytes``."""
    if gpus < 2 or nbytes <= 0:
        return 0.0
    per_host = min(cluster.per_host, gpus)
    hosts = -(-gpus // per_host)
    intra = cluster.intra_host_gbps * 1e9 / 8  # bytes/s
    inter = cluster.inter_host_gbps * 1e9 / 8 * engine.wire_efficiency
    if engine.hierarchical and hosts > 1 and per_host > 1:
        inside = 2 * (per_host - 1) * engine.intra_hop_us * 1e-6 + 2 * (per_host - 1) / per_host * nbytes / intra
        between = (engine.base_us + 2 * (hosts - 1) * engine.inter_hop_us) * 1e-6 * engine.plateau
        return engine.base_us * 1e-6 + inside + between + 2 * (hosts - 1) / hosts * nbytes / inter
    steps, inter_steps = 2 * (gpus - 1), 2 * (hosts - 1)
    latency = (engine.base_us + (steps - inter_steps) * engine.intra_hop_us + inter_steps * engine.inter_hop_us) * 1e-6
    if hosts > 1 and nbytes >= gpus / 16 * 65536:
        latency *= engine.plateau
    slowest = min(intra, inter) if hosts > 1 else intra
    return latency + steps / gpus * nbytes / slowest


def negotiation_seconds(gpus: int, cluster: Cluster) -> float:
    """Horovod's coordinator each cycle: every rank's list of ready tensors gathered to rank 0, the list to
    reduce broadcast back (two binomial trees of ``log2 n`` messages of ``cluster.latency_us``)."""
    return 2 * math.ceil(math.log2(gpus)) * cluster.latency_us * 1e-6 if gpus > 1 else 0.0


def data_parallel_step(profile: Profile, cluster: Cluster, gpus: int, batch_per_gpu: int,
                       engine: Engine = Engine(), memory_tbps: float = 0.0) -> tuple[float, float, int, float]:
    """One step of ``gpus`` replicas, ``batch_per_gpu`` samples each: (step seconds, its compute-only part,
    fused allreduces, their total seconds).

    The forward, then the backward layer by layer from the last: a layer's gradients are ready when its own
    backward ends. Horovod's loop wakes every ``cycle_ms`` (or when its previous reductions end, if later),
    negotiates, packs the gradients ready by then into fusion buffers (copied in and out at the memory
    bandwidth) and reduces each buffer with :func:`ring_allreduce_seconds`, one after another. The step ends
    when the backward and the last reduction have, then the optimizer's update (the profile's time per MiB).
    Every replica computes at the pace of the slowest GPU (:meth:`Engine.slowest_pace`)."""
    slow = cluster.compute_slowdown / engine.slowest_pace(gpus)
    forward = sum(layer.forward_seconds(batch_per_gpu) for layer in profile.layers) * slow
    ready: list[tuple[float, float]] = []  # (time, bytes), in the order the backward makes them
    now = forward
    for layer in reversed(profile.layers):
        now += layer.backward_seconds(batch_per_gpu) * slow
        if layer.parameter_bytes:
            ready.append((now, float(layer.parameter_bytes)))
    compute = now + profile.loss_ms * batch_per_gpu * slow / 1e3
    update = profile.update_ms_per_mb * profile.parameter_bytes / 2**20 / 1e3 * slow
    if gpus < 2:
        return compute + update, compute + update, 0, 0.0
    copy = 2 / (memory_tbps * 1e12) if memory_tbps > 0 else 0.0  # seconds per byte into and out of the buffer
    runs = [_reduce_during_backward(ready, gpus, cluster, engine, copy, phase / engine.cycle_phases)
            for phase in range(engine.cycle_phases)]
    finished = sum(run[0] for run in runs) / len(runs)
    count = round(sum(run[1] for run in runs) / len(runs))
    busy = sum(run[2] for run in runs) / len(runs)
    return max(compute, finished) + update, compute + update, count, busy


def _reduce_during_backward(ready: list[tuple[float, float]], gpus: int, cluster: Cluster, engine: Engine,
                            copy: float, phase: float) -> tuple[float, int, float]:
    """Horovod's loop over gradients ready at the given times, its cycles ticking at ``(phase + k) · cycle``:
    (when the last reduction ends, the fused allreduces, their total seconds)."""
    cycle, index, finished, count, busy = engine.cycle_ms * 1e-3, 0, 0.0, 0, 0.0
    tick = phase * cycle
    while index < len(ready):
        if ready[index][0] > tick:  # nothing ready: wait for the cycle in which the next one is
            tick += math.ceil((ready[index][0] - tick) / cycle - 1e-9) * cycle
        cost, bucket = negotiation_seconds(gpus, cluster), 0.0
        while index < len(ready) and ready[index][0] <= tick:
            nbytes = ready[index][1]
            if bucket and bucket + nbytes > engine.fusion_bytes:
                cost += ring_allreduce_seconds(bucket, gpus, cluster, engine) + bucket * copy
                count += 1
                bucket = 0.0
            bucket += nbytes
            index += 1
        cost += ring_allreduce_seconds(bucket, gpus, cluster, engine) + bucket * copy
        count += 1
        busy += cost
        finished = tick + cost
        tick = max(tick + cycle, finished)
    return finished, count, busy


def data_parallel_scaling(profile: Profile, cluster: Cluster, sizes: list[int], batch_per_gpu: int,
                          engine: Engine = Engine(), memory_tbps: float = 0.0) -> list[DataParallelRow]:
    """Weak scaling of plain data parallelism (one stage, every GPU a replica of ``batch_per_gpu`` samples)
    against one GPU training alone (no reduction at all): speedup ``= n · t(1) / t(n)``, efficiency = speedup / n."""
    if batch_per_gpu < 1:
        raise UsageError(f"--batch-per-gpu must be >= 1 (got {batch_per_gpu})")
    alone = data_parallel_step(profile, cluster, 1, batch_per_gpu, engine, memory_tbps)[0]
    rows = []
    for gpus in sizes:
        step, compute, count, busy = data_parallel_step(profile, dataclasses.replace(cluster, ranks=gpus), gpus,
                                                        batch_per_gpu, engine, memory_tbps)
        speedup = gpus * alone / step
        rows.append(DataParallelRow(gpus, gpus * batch_per_gpu, step, gpus * batch_per_gpu / step, speedup,
                                    speedup / gpus, step - compute, count, busy))
    return rows


def render_data_parallel(rows: list[DataParallelRow], markdown: bool = False, sample: str = "samples") -> str:
    """The table of :func:`data_parallel_scaling`."""
    header = ["GPUs", "global batch", "step s", f"{sample}/s", "speedup vs 1 GPU", "efficiency", "exposed s",
              "allreduces", "network s"]
    table = [[str(r.gpus), str(r.global_batch), f"{r.step_seconds:.3f}", f"{r.samples_per_second:,.1f}",
              f"{r.speedup_over_one_gpu:.1f}", f"{r.efficiency:.3f}", f"{r.exposed_seconds:.3f}", str(r.allreduces),
              f"{r.network_seconds:.3f}"] for r in rows]
    return _render(header, table, markdown)


# ---- one pipeline per size (--pipeline-only): GPipe's partition counts ---------------------------------------------

@dataclass
class PipelineRow:
    """One partition count of :func:`pipeline_scaling`."""

    gpus: int
    balance: tuple[int, ...]
    step_seconds: float
    samples_per_second: float
    speedup_over_one_gpu: float
    efficiency: float
    normalized_to_first: float   # throughput over the first size's (GPipe's Table 3 normalizes to K = 2)

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "stages": self.gpus, "balance": list(self.balance),
                "step_seconds": round(self.step_seconds, 6), "samples_per_second": round(self.samples_per_second, 3),
                "speedup_over_one_gpu": round(self.speedup_over_one_gpu, 3), "efficiency": round(self.efficiency, 4),
                "normalized_to_first": round(self.normalized_to_first, 3)}


def pipeline_scaling(profile: Profile, cluster: Cluster, sizes: list[int], global_batch: int, micro_batches: int,
                     schedule: str = "gpipe", checkpoint: str = "always") -> list[PipelineRow]:
    """Each size ``K`` as one pipeline of ``K`` stages (no replicas), GPipe's setting: the layers cut by the
    optimal contiguous partition of their time, ``micro_batches`` micro-batches, ``schedule`` with
    re-materialization ``checkpoint`` (GPipe recomputes every stage's forward), costed by
    :func:`hybridpipe.plan.cost.predict` (transfers over the cluster's links). The one-GPU reference is the
    same model on one GPU, its memory not checked."""
    from hybridpipe.pipeline.partition import partition_by_weights
    from hybridpipe.plan.cost import Candidate, predict

    weights = [layer.forward_seconds(1) + layer.backward_seconds(1) for layer in profile.layers]

    def step(gpus: int) -> tuple[tuple[int, ...], float]:
        balance = tuple(partition_by_weights(weights, gpus)) if gpus > 1 else (len(weights),)
        candidate = Candidate(gpus, 1, balance, micro_batches, schedule, checkpoint)
        return balance, predict(profile, dataclasses.replace(cluster, ranks=gpus), candidate, global_batch).step_seconds

    alone = step(1)[1]
    rows = []
    for gpus in sizes:
        balance, seconds = step(gpus)
        speedup = alone / seconds
        rows.append(PipelineRow(gpus, balance, seconds, global_batch / seconds, speedup, speedup / gpus, 0.0))
    for row in rows:
        row.normalized_to_first = rows[0].step_seconds / row.step_seconds
    return rows


def render_pipeline(rows: list[PipelineRow], markdown: bool = False, sample: str = "samples") -> str:
    """The table of :func:`pipeline_scaling`."""
    header = ["GPUs (stages)", "balance", "step s", f"{sample}/s", "speedup vs 1 GPU", "efficiency",
              f"vs {rows[0].gpus} GPUs" if rows else "vs first"]
    table = [[str(r.gpus), "-".join(map(str, r.balance)), f"{r.step_seconds:.3f}", f"{r.samples_per_second:,.2f}",
              f"{r.speedup_over_one_gpu:.2f}", f"{r.efficiency:.3f}", f"{r.normalized_to_first:.2f}"] for r in rows]
    return _render(header, table, markdown)


def _render(header: list[str], table: list[list[str]], markdown: bool) -> str:
    """A right-aligned text table, or a Markdown one."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in table])
    widths = [max(len(cells[i]) for cells in [header] + table) for i in range(len(header))]
    return "\n".join(["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in
                      [header, ["-" * w for w in widths]] + table])

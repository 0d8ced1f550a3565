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
import time
from dataclasses import dataclass

from hybridpipe.errors import HybridPipeError
from hybridpipe.plan.cost import Cluster
from hybridpipe.plan.profile import Profile
from hybridpipe.plan.search import Plan, plan

__all__ = ["ScalingRow", "parse_sizes", "scaling", "render_scaling", "plot_scaling", "DEFAULT_SIZES"]

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
        HybridPipeError: anything else, naming the text and the two forms.
    """
    usage = f"--sizes takes FIRST:LAST (powers of two between, e.g. 8:1024) or a list (e.g. 8,16,48); got {text!r}"
    try:
        if ":" in text:
            first, last = (int(part) for part in text.split(":"))
            if first < 1 or last < first:
                raise HybridPipeError(f"{usage} (need 1 <= FIRST <= LAST)")
            sizes, size = [], first
            while size <= last:
                sizes.append(size)
                size *= 2
        else:
            sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise HybridPipeError(usage) from None
    if not sizes or sizes[0] < 1:
        raise HybridPipeError(f"{usage} (sizes must be >= 1)")
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
        HybridPipeError: matplotlib is not installed (pip install matplotlib), or nothing to plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise HybridPipeError("--plot needs matplotlib (pip install matplotlib)") from None
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
        raise HybridPipeError("nothing to plot: no size has a plan")
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

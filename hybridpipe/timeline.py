"""Timeline: a Chrome-trace / Perfetto JSON of what every rank did, and a schedule diagram from it.

Turn it on with ``HYBRIDPIPE_TIMELINE=trace.json`` (or ``hybridpipe-run --timeline trace.json``).
Every rank records, on its own track (``pid`` = rank):

* ``compute``: forward ``F<m>`` / backward ``B<m>`` of each micro-batch (args: stage, micro_batch),
  re-computation ``R<m>`` inside a backward, and one ``step`` span per train_step / predict;
* ``p2p``: waits for activations / gradients from a neighbour stage, sends posted;
* ``engine <group>``: the background engine's phases: negotiate, gather names, pack, ring, unpack;
* ``optimizer``: DistributedOptimizer synchronize (waiting for reductions) and step.

Recording appends a tuple to a list (nothing when off: one ``is None`` check). A background thread
writes the events of each rank to ``<path>.rank<r>.part`` every half second; ``hp.shutdown()``
merges the parts into ``path`` on rank 0. Times are microseconds since a barrier in ``hp.init``,
so tracks of one host line up.

``python -m hybridpipe.timeline trace.json --png schedule.png`` draws the pipeline schedule as a
time × rank diagram and prints the bubble fraction, per-stage busy %, and how much of the
allreduce time overlapped computation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ._trace import enabled, record, span

__all__ = ["enabled", "span", "record", "analyze", "report", "draw", "main"]


# ---------------------------------------------------------------------------------- analysis


def _load(path: str | os.PathLike) -> tuple[list[dict], dict]:
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"], (data.get("otherData", {}) if isinstance(data, dict) else {})


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _overlap(spans: list[tuple[float, float]], others: list[tuple[float, float]]) -> float:
    """Length of the parts of ``spans`` covered by the union of ``others``."""
    merged: list[list[float]] = []
    for a, b in sorted(others):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = 0.0
    for a, b in spans:
        for c, d in merged:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def analyze(path: str | os.PathLike) -> dict[str, Any]:
    """Numbers of a trace: per rank busy %, bubble fraction, allreduce overlap.

    Within each train step (the union of the ranks' ``step`` spans of that step), a rank is busy
    while it runs a forward, backward or re-computation. Bubble fraction = 1 − mean busy share.
    Allreduce overlap = the share of the engine's ring time that ran while some rank of the trace
    was computing.
    """
    events, meta = _load(path)
    compute = [e for e in events if e.get("cat") in ("forward", "backward", "recompute")]
    steps = [e for e in events if e.get("cat") == "step" and e.get("name") == "train_step"]
    rings = [e for e in events if e.get("cat") == "engine" and e.get("name") == "ring"]
    ranks = sorted({e["pid"] for e in events})
    by_index: dict[int, list[dict]] = {}
    for event in steps:
        by_index.setdefault(event.get("args", {}).get("index", 0), []).append(event)
    busy: dict[int, float] = {r: 0.0 for r in ranks}
    window_total = 0.0
    for group in by_index.values():
        start = min(e["ts"] for e in group)
        end = max(e["ts"] + e["dur"] for e in group)
        window_total += end - start
        for rank in ranks:
            spans = [(max(e["ts"], start), min(e["ts"] + e["dur"], end)) for e in compute if e["pid"] == rank]
            busy[rank] += _union_length([s for s in spans if s[1] > s[0]])
    shares = {r: (busy[r] / window_total if window_total else 0.0) for r in ranks}
    ring_spans = [(e["ts"], e["ts"] + e["dur"]) for e in rings]
    ring_time = sum(b - a for a, b in ring_spans)
    overlapped = _overlap(ring_spans, [(e["ts"], e["ts"] + e["dur"]) for e in compute])
    stage_of = {e["pid"]: e.get("args", {}).get("stage") for e in compute if "args" in e}
    return {
        "ranks": ranks,
        "stage_of_rank": stage_of,
        "steps": len(by_index),
        "step_ms": window_total / 1000 / max(1, len(by_index)),
        "busy": shares,
        "bubble_fraction": 1.0 - (sum(shares.values()) / len(shares) if shares else 0.0),
        "ring_ms": ring_time / 1000,
        "allreduce_overlap": overlapped / ring_time if ring_time else None,
        "pipeline_stages": meta.get("pipeline_stages"),
        "data_replicas": meta.get("data_replicas"),
    }


def report(numbers: dict[str, Any]) -> str:
    lines = [f"{numbers['steps']} train steps, {numbers['step_ms']:.1f} ms per step (mean window); "
             f"grid {numbers['pipeline_stages']} stages × {numbers['data_replicas']} replicas"]
    for rank in numbers["ranks"]:
        stage = numbers["stage_of_rank"].get(rank)
        lines.append(f"  rank {rank} (stage {stage}): busy {100 * numbers['busy'][rank]:.1f} %")
    lines.append(f"bubble fraction: {100 * numbers['bubble_fraction']:.1f} %")
    if numbers["allreduce_overlap"] is None:
        lines.append("allreduce: none recorded")
    else:
        lines.append(f"allreduce: {numbers['ring_ms']:.1f} ms of ring time, "
                     f"{100 * numbers['allreduce_overlap']:.1f} % of it overlapped computation")
    return "\n".join(lines)


COLOURS = {"forward": "#4C78A8", "backward": "#59A14F", "recompute": "#F28E2B", "ring": "#B07AA1",
           "recv": "#D3D3D3"}


def _window(events: list[dict], steps: int) -> tuple[float, float]:
    """The time span of the last ``steps`` train steps (all events if there are none)."""
    spans: dict[int, list[float]] = {}
    for event in events:
        if event.get("cat") == "step" and event.get("name") == "train_step":
            index = event.get("args", {}).get("index", 0)
            window = spans.setdefault(index, [event["ts"], event["ts"] + event["dur"]])
            window[0], window[1] = min(window[0], event["ts"]), max(window[1], event["ts"] + event["dur"])
    if not spans:
        return min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)
    chosen = [spans[i] for i in sorted(spans)[-steps:]]
    return min(w[0] for w in chosen), max(w[1] for w in chosen) + 0.02 * (chosen[-1][1] - chosen[0][0])


def draw(path: str | os.PathLike, png: str | os.PathLike, numbers: dict[str, Any] | None = None,
         steps: int = 2) -> Path:
    """Draws the last ``steps`` train steps of the trace as a time × rank diagram (forward,
    backward, re-computation, waits for neighbours, allreduce rings)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events, _ = _load(path)
    numbers = numbers or analyze(path)
    ranks = numbers["ranks"]
    start, stop = _window(events, steps)
    events = [e for e in events if e["ts"] < stop and e["ts"] + e["dur"] > start]
    figure, axes = plt.subplots(figsize=(12, 1.0 + 0.7 * len(ranks)))
    for row, rank in enumerate(ranks):
        for event in events:
            if event["pid"] != rank:
                continue
            category, name = event.get("cat"), event.get("name")
            x, width = (event["ts"] - start) / 1000, event["dur"] / 1000
            if category in ("forward", "backward"):
                axes.broken_barh([(x, width)], (row - 0.35, 0.5), facecolors=COLOURS[category], edgecolor="white",
                                 linewidth=0.5)
                if width > 0:
                    axes.text(x + width / 2, row - 0.1, name, ha="center", va="center", fontsize=6, color="white")
            elif category == "recompute":
                axes.broken_barh([(x, width)], (row - 0.35, 0.12), facecolors=COLOURS["recompute"])
            elif category == "engine" and name == "ring":
                axes.broken_barh([(x, width)], (row + 0.2, 0.15), facecolors=COLOURS["ring"])
            elif category == "recv":
                axes.broken_barh([(x, width)], (row + 0.2, 0.15), facecolors=COLOURS["recv"])
    labels = [f"rank {r} (stage {numbers['stage_of_rank'].get(r)})" for r in ranks]
    axes.set_yticks(range(len(ranks)), labels)
    axes.invert_yaxis()
    axes.set_xlabel(f"time (ms) — the last {steps} train step(s)")
    overlap = numbers["allreduce_overlap"]
    axes.set_title(f"bubble {100 * numbers['bubble_fraction']:.1f} %, allreduce overlap "
                   + ("n/a" if overlap is None else f"{100 * overlap:.0f} %")
                   + f", {numbers['step_ms']:.1f} ms per step")
    axes.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper center", fontsize=7,
                ncol=5, bbox_to_anchor=(0.5, -0.22), frameon=False)
    figure.tight_layout()
    png = Path(png)
    figure.savefig(png, dpi=120)
    plt.close(figure)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridpipe.timeline",
                                     description="Summarise a hybridpipe timeline and draw its schedule.")
    parser.add_argument("trace", help="the JSON written with HYBRIDPIPE_TIMELINE")
    parser.add_argument("--png", help="write the schedule diagram to this PNG")
    parser.add_argument("--steps", type=int, default=2, help="train steps to draw (the last N; default 2)")
    args = parser.parse_args(argv)
    try:
        numbers = analyze(args.trace)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: cannot read {args.trace}: {error}", file=sys.stderr)
        return 1
    print(report(numbers))
    if args.png:
        print(f"wrote {draw(args.trace, args.png, numbers, steps=args.steps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

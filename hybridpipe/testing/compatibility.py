"""Every feature with every other: the table of options, the combinations hybridpipe refuses (and why), a
generator of test cases that covers every pair (or triple) of values, and docs/compatibility.md.

The table is the contract: a combination not refused here must train like one process on the same
micro-batches (the asynchronous schedules like their one-process replay); a refused one must raise at
construction an error naming both options. ``tests/test_compatibility_mpi.py`` runs the cases;
``tests/test_compatibility_table.py`` checks that docs/compatibility.md is what :func:`markdown` writes
(regenerate it with ``python -m hybridpipe.testing.compatibility --write``).
"""

from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from hybridpipe.pipeline.schedule import ASYNCHRONOUS, SCHEDULES
from hybridpipe.registry import PRECISIONS, ZERO_LEVELS

#: Each option and its values; the first value is the plain one (what a case uses where it does not care).
OPTIONS: dict[str, tuple] = {
    "schedule": tuple(SCHEDULES),
    "grid": ("2x1", "1x2", "2x2", "4x1"),
    "tied": ("no", "yes"),
    "skip": ("no", "yes"),
    "clip": ("no", "yes"),
    "zero": tuple(ZERO_LEVELS),
    "precision": tuple(PRECISIONS),
    "recompute": ("never", "always"),
    "checkpoint": ("none", "resume"),
    "elastic": ("no", "yes"),
    "compile": ("no", "yes"),
}

#: What each option means in a case, for the docs.
MEANING: dict[str, str] = {
    "schedule": "`PipelineModel(schedule=…)` (interleaved-1f1b with `virtual_stages=2`; pipedream and 2bw "
                "with `optimizer=`)",
    "grid": "pipeline stages × data replicas (`hp.init(pipeline_stages=P)` on P × D ranks)",
    "tied": "the embedding's weight is the output head's (a shared `nn.Parameter`, first and last stage)",
    "skip": "a projection stashed on an early stage and added back on a late one (`hp.skippable`)",
    "clip": "`hp.clip_grad_norm_(model, max_norm)` with a `max_norm` that bites, after `synchronize()`",
    "zero": "`DistributedOptimizer(zero=…)`",
    "precision": "`PipelineModel(precision=…)` (fp16 with the model's loss scaler)",
    "recompute": "`PipelineModel(checkpoint=…)` (activation re-materialization)",
    "checkpoint": "`hp.save_checkpoint` after two steps, `hp.load_checkpoint` on the other grid of as many ranks "
                  "(2×1 ↔ 1×2, 2×2 ↔ 4×1), two more steps",
    "elastic": "`hp.elastic.TorchState` + `@hp.elastic.run`, a failure injected at the second step (rolled back)",
    "compile": "a block of the model wrapped in `torch.compile` (zb-h1 does not split the backward of a chunk "
               "holding one, and says so: a warning and `split_backward_report()`)",
}



@dataclass(frozen=True)
class Refusal:
    """A combination hybridpipe refuses at construction: ``when(case)`` holds for it, and the error (of type
    ``error``, its message matching ``match``) names both options. ``options`` are the two options it is
    about (for the docs' matrix); ``why`` says why in a line."""

    options: tuple[str, str]
    when: Callable[[dict], bool]
    error: str
    match: str
    why: str
    reads: tuple[str, ...] = ()  # other options ``when`` looks at


REFUSALS: tuple[Refusal, ...] = (
    Refusal(("schedule", "precision"), lambda c: c["schedule"] in ASYNCHRONOUS and c["precision"] == "fp16",
            "HybridPipeError", r"precision='fp16' needs a synchronous schedule",
            "fp16's loss scaler skips whole steps on overflow; an asynchronous schedule has already applied "
            "the other micro-batches' updates (use bf16)"),
    Refusal(("schedule", "tied"),
            lambda c: c["schedule"] in ASYNCHRONOUS and c["tied"] == "yes" and max(
                grid_shape(g)[0] for g in _grids(c)) > 1,
            "PartitionError", r"shared by layers on different pipeline stages.*updates each stage on its own",
            "on 2 or more stages: an asynchronous schedule updates each stage on its own, at different times, so "
            "the copies of a weight tied across stages would drift apart (on one stage the tie is kept)",
            reads=("grid", "checkpoint")),
    Refusal(("schedule", "elastic"), lambda c: c["schedule"] in ASYNCHRONOUS and c["elastic"] == "yes",
            "HybridPipeError", r"hp.elastic.TorchState: the PipelineModel's schedule '\w+' is asynchronous",
            "an asynchronous schedule keeps micro-batches in flight from one train_step to the next, which a roll "
            "back to the last commit cannot undo on every stage (restart from checkpoints instead: they flush)"),
    Refusal(("schedule", "zero"), lambda c: c["schedule"] in ASYNCHRONOUS and c["zero"] != 0,
            "HybridPipeError", r"DistributedOptimizer\(zero=\d\) wraps parameters of a PipelineModel whose schedule",
            "an asynchronous schedule steps its own `optimizer=` per stage inside train_step; ZeRO shards a "
            "DistributedOptimizer's state"),
    Refusal(("schedule", "clip"), lambda c: c["schedule"] in ASYNCHRONOUS and c["clip"] == "yes",
            "HybridPipeError", r"clip_grad_norm_.*asynchronous",
            "the stages of an asynchronous schedule update at different times, so there is no one global "
            "gradient to clip (clip inside the `optimizer=` you pass, per stage)"),
)


def refusal_for(case: dict) -> Refusal | None:
    """The first refusal that applies to ``case`` (None: it must train like one process)."""
    return next((r for r in REFUSALS if r.when(case)), None)


def refusals_for(case: dict) -> list[Refusal]:
    """Every refusal that applies to ``case`` (hybridpipe raises one of them, whichever it meets first)."""
    return [r for r in REFUSALS if r.when(case)]


def _default_case() -> dict:
    return {name: values[0] for name, values in OPTIONS.items()}


def _pair_refused(a: tuple[str, object], b: tuple[str, object]) -> Refusal | None:
    case = _default_case()
    case[a[0]], case[b[0]] = a[1], b[1]
    refusal = refusal_for(case)
    return refusal if refusal is not None and set(refusal.options) == {a[0], b[0]} else None


def covering_cases(strength: int = 2) -> list[dict]:
    """See :func:`_covering` (cached: the search takes about a second)."""
    return [dict(case) for case in _covering(strength)]


@functools.lru_cache(maxsize=None)
def _covering(strength: int) -> tuple[tuple, ...]:
    """Cases (dicts option → value) in which every combination of ``strength`` values of different options
    that no refusal covers appears at least once, none of them refused; then one case per refused pair of
    values (the others plain), which must raise. Deterministic (a greedy covering array)."""
    names = list(OPTIONS)
    allowed, refused_pairs = set(), []
    for group in itertools.combinations(names, strength):
        for values in itertools.product(*(OPTIONS[n] for n in group)):
            if _extendable(dict(zip(group, values))):
                allowed.add(tuple(zip(group, values)))
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(OPTIONS[a], OPTIONS[b]):
            if _pair_refused((a, va), (b, vb)) is not None:
                refused_pairs.append({**_default_case(), a: va, b: vb})
    cases: list[dict] = []
    uncovered = set(allowed)
    while uncovered:
        seed = min(uncovered, key=_order)
        case = dict(seed)
        for name in names:
            if name in case:
                continue
            best, gain = None, -1
            for value in OPTIONS[name]:
                trial = {**case, name: value}
                if not _extendable(trial):
                    continue
                won = sum(1 for combo in uncovered if all(trial.get(k) == v for k, v in combo)
                          and any(k == name for k, _ in combo))
                if won > gain:
                    best, gain = value, won
            case[name] = best
        full = {name: case[name] for name in names}
        covered = {combo for combo in uncovered if all(full[k] == v for k, v in combo)}
        if not covered:  # cannot happen: the seed is covered
            raise AssertionError(f"covering array stuck at {seed}")
        uncovered -= covered
        cases.append(full)
    return tuple(tuple(case.items()) for case in cases + refused_pairs)


def _order(combo: tuple) -> tuple:
    return tuple((list(OPTIONS).index(k), OPTIONS[k].index(v)) for k, v in combo)


def _extendable(partial: dict) -> bool:
    """Whether ``partial`` (some options set) extends to a case no refusal applies to, with the rest plain or
    any value (a small search: the refusals involve few options)."""
    free = [n for n in OPTIONS if n not in partial]
    for values in itertools.product(*(OPTIONS[n] for n in free if n in _RELEVANT)):
        case = _default_case()
        case.update(partial)
        case.update(zip([n for n in free if n in _RELEVANT], values))
        if refusal_for(case) is None:
            return True
    return False


_RELEVANT = {name for refusal in REFUSALS for name in refusal.options + refusal.reads}


def grid_shape(grid: str) -> tuple[int, int]:
    """'2x1' → (pipeline stages, data replicas)."""
    stages, replicas = grid.split("x")
    return int(stages), int(replicas)


RESUME_GRID = {"2x1": "1x2", "1x2": "2x1", "2x2": "4x1", "4x1": "2x2"}


def _grids(case: dict) -> tuple[str, ...]:
    """The grids a case trains on: its own, and the one it resumes on."""
    return (case["grid"], RESUME_GRID[case["grid"]]) if case["checkpoint"] == "resume" else (case["grid"],)


def case_id(case: dict) -> str:
    """A short, stable name: the options that differ from the plain case."""
    plain = _default_case()
    return "-".join(f"{k}={v}" for k, v in case.items() if v != plain.get(k) or k in ("schedule", "grid"))


def markdown(cases: Iterable[dict] | None = None) -> str:
    """docs/compatibility.md: the options, the matrix of pairs (✓ or refused), the refusals and why."""
    names = list(OPTIONS)
    lines = [
        "# Compatibility: every feature with every other",
        "",
        "Generated by `python -m hybridpipe.testing.compatibility --write` from the table in",
        "`hybridpipe/testing/compatibility.py`; `tests/test_compatibility_table.py` checks it is up to date.",
        "",
        "Every pair of the options below is tested together (`tests/test_compatibility_mpi.py`, in `make test`;",
        "every triple in `make test-long`): each case trains a small transformer-like model (embedding, blocks,",
        "a LayerNorm and a head) for a few steps and must equal one process on the same micro-batches — float64",
        "to 1e-7 relative for fp32; bf16/fp16 against one process under the same autocast (and loss scaling),",
        "to their rounding; pipedream and 2bw against their one-process replay (the weight versions of their",
        "schedule) — or be refused when it is built, by an error that names both options. Never silently",
        "different.",
        "",
        "## The options",
        "",
        "| option | values | what it means in a case |",
        "|---|---|---|",
    ]
    for name in names:
        lines.append(f"| {name} | {', '.join(str(v) for v in OPTIONS[name])} | {MEANING[name]} |")
    lines += ["", "## Pairs", "",
              "✓: every pair of values of the two options trains like one process. \"refusal n\": refusal n below "
              "applies to some of their values (the others train like one process).", ""]
    lines.append("| | " + " | ".join(names) + " |")
    lines.append("|---" * (len(names) + 1) + "|")
    for a in names:
        row = []
        for b in names:
            if a == b:
                row.append("—")
                continue
            numbers = sorted({i + 1 for i, r in enumerate(REFUSALS) if set(r.options) == {a, b}})
            row.append("refusal " + ", ".join(map(str, numbers)) if numbers else "✓")
        lines.append(f"| **{a}** | " + " | ".join(row) + " |")
    lines += ["", "## Refused, and why", ""]
    for number, refusal in enumerate(REFUSALS, 1):
        first, second = refusal.options
        values = sorted({(c[first], c[second]) for c in _all_pairs(first, second) if refusal.when(c)}, key=str)
        shown = ", ".join(f"{first}={a} + {second}={b}" for a, b in values)
        lines += [f"### Refusal {number}", "", f"{shown}: {refusal.why}. The error: `{refusal.error}`, "
                  f"matching `{refusal.match}`.", ""]
    if cases is not None:
        cases = list(cases)
        lines += ["## The cases run", "",
                  f"{len(cases)} cases cover every pair ({sum(refusal_for(c) is None for c in cases)} train, "
                  f"{sum(refusal_for(c) is not None for c in cases)} are refused):", ""]
        lines.append("| " + " | ".join(names) + " |")
        lines.append("|---" * len(names) + "|")
        for case in cases:
            lines.append("| " + " | ".join(str(case[n]) for n in names) + " |")
        lines.append("")
    return "\n".join(lines)


def _all_pairs(a: str, b: str) -> list[dict]:
    return [{**_default_case(), a: va, b: vb} for va, vb in itertools.product(OPTIONS[a], OPTIONS[b])]


DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


def main(argv: list[str]) -> int:
    text = markdown(covering_cases(2))
    if argv[1:] == ["--write"]:
        DOC.write_text(text + "\n")
        print(f"wrote {DOC}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

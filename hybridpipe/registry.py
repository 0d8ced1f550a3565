"""The option values hybridpipe knows, each in one registry that every user of it asks: the model
(``PipelineModel``, ``DistributedOptimizer``), the planner (``hp.plan``, ``hp.auto``), the command line
(``python -m hybridpipe.plan``), the compatibility matrix and the docs' tables.

- :data:`ZERO_LEVELS`: ``DistributedOptimizer(zero=...)``, what each level shards over a stage's replicas.
- :data:`RECOMPUTE_MODES`: ``PipelineModel(checkpoint=...)``, which forwards keep their activations.
- :data:`PRECISIONS`: ``PipelineModel(precision=...)``, the compute dtype and its bytes per activation element.

The pipeline schedules have their own registry, ``hybridpipe.pipeline.schedule.SCHEDULES``. A new value goes
here (with its description, which the docs' table prints), then where it is implemented; the checks below name
the registry's values in their errors, so no message lists them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridpipe.errors import UsageError

__all__ = ["ZeroLevel", "RecomputeMode", "Precision", "ZERO_LEVELS", "RECOMPUTE_MODES", "PRECISIONS",
           "check_zero_level", "check_recompute_mode", "check_precision", "markdown_table"]


@dataclass(frozen=True)
class ZeroLevel:
    """One ZeRO level: what each of a stage's D replicas keeps 1/D of."""

    level: int
    optimizer_state_sharded: bool
    gradients_sharded: bool
    description: str
    parameters_sharded: bool = False
    planned: bool = True  # the planner's cost model knows its memory and its time (hp.auto may choose it)


@dataclass(frozen=True)
class RecomputeMode:
    """One re-materialization mode: which micro-batches' forwards keep their activations for the backward."""

    name: str
    description: str


@dataclass(frozen=True)
class Precision:
    """One compute precision: the autocast dtype (None: none), its bytes per activation element, and whether the
    loss is scaled (fp16's narrow range)."""

    name: str
    autocast_dtype: str | None  # a torch dtype's name ("bfloat16"): this module loads without torch
    activation_bytes: int
    loss_scaling: bool
    description: str


ZERO_LEVELS: dict[int, ZeroLevel] = {level.level: level for level in (
    ZeroLevel(0, False, False, "every replica keeps the stage's full optimizer state and gradients"),
    ZeroLevel(1, True, False, "the optimizer state is sharded over the stage's replicas (each updates 1/D of the "
                              "parameters and allgathers the rest)"),
    ZeroLevel(2, True, True, "the gradients too: reduce-scattered as they are produced, each replica keeping 1/D"),
    ZeroLevel(3, True, True, "the parameters too: each replica keeps 1/D of them, a module's gathered for each of "
                             "its forwards and backwards and freed after", parameters_sharded=True),
)}

RECOMPUTE_MODES: dict[str, RecomputeMode] = {mode.name: mode for mode in (
    RecomputeMode("never", "every forward stores its activations until its backward"),
    RecomputeMode("except_last", "every forward but each chunk's last micro-batch keeps only its inputs and is "
                                 "recomputed in the backward (torchgpipe's default)"),
    RecomputeMode("always", "every forward keeps only its inputs and is recomputed in the backward"),
)}

PRECISIONS: dict[str, Precision] = {precision.name: precision for precision in (
    Precision("fp32", None, 4, False, "float32 throughout"),
    Precision("bf16", "bfloat16", 2, False, "forwards (and recomputations, the loss) under bfloat16 autocast; "
                                            "fp32 weights and optimizer"),
    Precision("fp16", "float16", 2, True, "float16 autocast with a dynamic loss scaler that skips a step on "
                                          "overflow; fp32 weights and optimizer"),
)}


def _listing(values) -> str:
    return ", ".join(map(repr, values))


def check_zero_level(zero: Any, where: str = "") -> int:
    """``zero`` if it is a ZeRO level of :data:`ZERO_LEVELS` (an int, not a bool), else a :class:`UsageError`
    naming the levels and what each shards (``where``: what the message begins with, e.g. ``"hp.auto: "``)."""
    if isinstance(zero, bool) or not isinstance(zero, int) or zero not in ZERO_LEVELS:
        meaning = "; ".join(f"{level}: {entry.description}" for level, entry in ZERO_LEVELS.items())
        raise UsageError(f"{where}zero must be one of {_listing(ZERO_LEVELS)} (got {zero!r}): {meaning}")
    return zero


def check_recompute_mode(mode: Any) -> str:
    """``mode`` if :data:`RECOMPUTE_MODES` has it, else a :class:`UsageError` naming the modes."""
    if not isinstance(mode, str) or mode not in RECOMPUTE_MODES:
        raise UsageError(f"unknown checkpoint mode {mode!r} (use one of {_listing(RECOMPUTE_MODES)})")
    return mode


def check_precision(precision: Any, what: str = "precision") -> str:
    """``precision`` if :data:`PRECISIONS` has it, else a :class:`UsageError` naming the precisions."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise UsageError(f"unknown {what} {precision!r}: use one of {_listing(PRECISIONS)}")
    return precision


def markdown_table(registry: dict) -> str:
    """A registry as the Markdown table the docs show (a test keeps the docs' copy equal to it)."""
    rows = ["| value | meaning |", "|---|---|"]
    rows += [f"| `{key}` | {entry.description} |" for key, entry in registry.items()]
    return "\n".join(rows)

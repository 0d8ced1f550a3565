"""The stages of a pipeline must be given the same batch: a fingerprint of it, checked as it travels.

Every rank of a pipeline receives the batch from the user (stage 0 uses the inputs, the last stage the
targets). A data loader sharded the Horovod way (``DistributedSampler(num_replicas=hp.size(),
rank=hp.rank())``) gives each stage different samples, and the last stage then pairs one batch's
activations with another's targets: the loss stays at chance and nothing says why. So each rank computes a
:func:`fingerprint` of what it was given -- every tensor's shape and dtype, and two sums over at most 64 of
its elements (strided over the whole tensor) -- and the first activation message of each step from chunk
``c`` to ``c + 1`` carries the sender's; the receiver compares it with its own (:func:`compare`). A mismatch
raises on the receiver, and the executor's failure forwarding raises it on every stage. No message is
added; the cost is the sums (microseconds) and a few pickled numbers in a header.

``HYBRIDPIPE_CHECK_BATCHES=0`` (or ``model.check_batches = False``) turns it off.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hybridpipe.errors import MismatchError

__all__ = ["fingerprint", "compare"]

_SAMPLES = 64


def _stand_in(value: float) -> float:
    # NaN != NaN (and inf - inf is NaN): non-finite samples get stand-in values so equal batches compare equal
    if math.isfinite(value):
        return value
    return 0.5 if value != value else (0.25 if value > 0 else -0.25)


def _tensor_print(tensor: torch.Tensor) -> tuple:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0 or tensor.is_complex():
        return (tuple(tensor.shape), str(tensor.dtype))
    step = max(flat.numel() // _SAMPLES, 1)
    # at most 64 numbers: summed in Python, one tolist() instead of a handful of small torch operations (each
    # of those costs microseconds of dispatch, which made the check's cost a visible part of a short step)
    picked = [_stand_in(float(value)) for value in flat[::step][:_SAMPLES].tolist()]
    return (tuple(tensor.shape), str(tensor.dtype), sum(picked),
            sum(weight * value for weight, value in enumerate(picked, 1)))


def fingerprint(inputs: Any, targets: Any = None) -> tuple:
    """Shapes, dtypes and two sampled sums of every tensor of ``inputs`` and ``targets`` (other leaves as
    their repr), as a small tuple of numbers and strings, and the call (``predict``: no targets)."""
    def walk(value: Any) -> tuple:
        return tuple(_tensor_print(leaf) if isinstance(leaf, torch.Tensor) else repr(leaf)[:40]
                     for leaf in pytree.tree_leaves(value))

    return (walk(inputs), walk(targets), "predict" if targets is None else "train_step")


def _describe(part: tuple) -> str:
    return ", ".join(f"{leaf[0]} {leaf[1].replace('torch.', '')}" if isinstance(leaf, tuple) else leaf
                     for leaf in part) or "nothing"


def compare(mine: tuple, theirs: tuple, stage: int, sender: int) -> None:
    """Raises MismatchError when ``theirs`` (chunk ``sender``'s fingerprint) differs from ``mine``."""
    if mine == theirs:
        return
    if mine[2:] != theirs[2:]:
        raise MismatchError(f"stage {stage} called {mine[2]} while stage {sender} of its pipeline called {theirs[2]} "
                            "(the same step): every stage of a pipeline must make the same train_step / predict calls "
                            "in the same order (e.g. evaluate on every rank, not on rank 0 only)")
    which = []
    for name, a, b in (("inputs", mine[0], theirs[0]), ("targets", mine[1], theirs[1])):
        if a != b:
            shapes_a = _describe(a)
            shapes_b = _describe(b)
            detail = f"shapes {shapes_b} on stage {sender}, {shapes_a} here" if shapes_a != shapes_b else \
                "same shapes, different values"
            which.append(f"{name}: {detail}")
    raise MismatchError(
        f"stage {stage} was given a different batch than stage {sender} of its pipeline ({'; '.join(which)}): "
        "every stage of a pipeline must get the same batch (stage 0 uses its inputs, the last stage its "
        "targets). Shard the data by replica, not by rank: DistributedSampler(dataset, "
        "num_replicas=grid.data_replicas, rank=grid.replica), as README shows "
        "(HYBRIDPIPE_CHECK_BATCHES=0 or model.check_batches = False turns this check off)")

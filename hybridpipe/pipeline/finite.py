"""HYBRIDPIPE_CHECK_FINITE=1: the stage, micro-batch and layer where NaN or inf first appears are named.

A NaN in one sample becomes a NaN loss and NaN weights a few steps later, far from its cause. With the
check on, each stage looks at what it computes, in the order it computes it: the batch's inputs (first
stage), every layer's output (forward hooks, so the first layer whose output is not finite is named while
its input still was), and the loss (last stage). The stage that finds it raises :class:`NonFiniteError`;
the executor's failure forwarding raises it on every stage of the pipeline, and since a stage checks before
it sends, the stages after it never see the values. A debugging aid: it syncs on every layer's output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hybridpipe.errors import NonFiniteError

__all__ = ["first_non_finite", "watching", "check_inputs", "check_output", "check_loss"]

_OFF = "HYBRIDPIPE_CHECK_FINITE=0 turns this check off"


def first_non_finite(value: Any) -> str | None:
    """Where ``value`` (a tensor or a tree of them) first holds NaN or inf, e.g. ``NaN at [3, 2] of a (8, 8)
    float32 tensor``; None when every floating point element is finite."""
    leaves, _ = pytree.tree_flatten_with_path(value)
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
            continue
        bad = ~torch.isfinite(leaf.detach())
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            kind = "NaN" if bool(torch.isnan(leaf.detach()[index])) else "inf"
            where = pytree.keystr(path)
            return (f"{kind} at {where}[{', '.join(map(str, index))}] of a {tuple(leaf.shape)} "
                    f"{str(leaf.dtype).replace('torch.', '')} tensor")
    return None


@contextlib.contextmanager
def watching(module: nn.Module) -> Iterator[list[str]]:
    """While inside, records the first module of ``module`` (in the order their forwards finish, so an
    inner layer before the block that holds it) whose output is not finite, as ``"name (Type): where"``."""
    found: list[str] = []

    def hook(name: str, layer: nn.Module, args: Any, output: Any) -> None:
        if not found:
            where = first_non_finite(output)
            if where is not None:
                found.append(f"{name or 'the stage'} ({type(layer).__name__}): {where}")

    handles = [layer.register_forward_hook(lambda layer, args, output, name=name: hook(name, layer, args, output))
               for name, layer in module.named_modules()]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def check_inputs(x: Any, stage: int, micro_batch: int) -> None:
    """The first stage's micro-batch of the user's inputs."""
    where = first_non_finite(x)
    if where is not None:
        raise NonFiniteError(f"the batch's inputs hold non-finite values ({where}; micro-batch {micro_batch}, seen "
                             f"by stage {stage}, before any layer): clean the data (drop or repair such samples, "
                             f"e.g. torch.nan_to_num) or find where the data loader makes them; {_OFF}")


def check_output(found: list[str], y: Any, stage: int, micro_batch: int) -> None:
    """A stage's output, with what :func:`watching` found while it was computed."""
    if not found:
        where = first_non_finite(y)
        if where is None:
            return
        found = [f"the stage's output: {where}"]
    raise NonFiniteError(f"stage {stage}: non-finite values first appear in the output of layer {found[0]} "
                         f"(micro-batch {micro_batch}; its input was finite): a layer overflowed or divided by zero "
                         "(lower the learning rate, clip gradients, use bf16 instead of fp16, or guard the layer, "
                         f"e.g. log(x + eps)); {_OFF}")


def check_loss(loss: torch.Tensor, stage: int, micro_batch: int) -> None:
    """The last stage's loss of a micro-batch whose output was finite."""
    if not bool(torch.isfinite(loss.detach()).all()):
        raise NonFiniteError(f"stage {stage}: the loss of micro-batch {micro_batch} is {float(loss.detach())} while "
                             "the model's output is finite: check the targets (out of range, NaN) and the loss "
                             f"function (e.g. a log of 0); {_OFF}")

"""What every collective family shares: the reduction ops, the argument checks every public collective makes
(as one rank-local step whose error still takes this rank's place in the collective), the group a one-shot call
means, compression's protocol, and the row helpers of the first-dimension collectives.

The families (:mod:`~hybridpipe.collectives.allreduce`, ``.broadcast``, ``.allgather``, ``.alltoall``,
``.reducescatter``, ``.sparse``, ``.barrier``) each hold their blocking, in-place, ``*_async`` and differentiable
forms side by side; this module is below all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..comm import buffers, context
from ..comm.buffers import is_tensor
from ..comm.context import check_name, refusing, resolve_group, resolved
from ..comm.reduction import (CORE_OPS, Adasum, Average, Max, Min, Product, ReduceOp, Sum, agree, check_tensors,
                              digest, named, reduce_op, resolve_op, scale_factor)

__all__ = ["ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum", "CORE_OPS", "agree", "digest",
           "named", "reduce_op", "resolve_op", "scale_factor", "check_tensors", "check_root", "needs_grad",
           "check_compression", "Checked", "checking", "checked_group", "Uncompressed", "UNCOMPRESSED",
           "compressor", "compressed", "rank_in", "DEFAULT_GROUP", "group_name", "spelling", "target",
           "root_index", "agreed_kind", "contiguous", "to_device_of", "empty_like_rows"]


def needs_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def check_compression(compression: Any, function: str) -> None:
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"hp.{function}: compression must be hp.Compression.none / fp16 / bf16 (or an object with "
                        f"compress() and decompress()), got {compression!r}")


@dataclass
class Checked:
    """A collective's arguments, checked: its group resolved once (what the layers below take as it is)."""

    function: str
    group: Any
    prescale: float = 1.0
    postscale: float = 1.0

    def scales(self, prescale_factor: Any, postscale_factor: Any) -> None:
        self.prescale = scale_factor(prescale_factor, "prescale_factor", self.function)
        self.postscale = scale_factor(postscale_factor, "postscale_factor", self.function)


@contextlib.contextmanager
def checking(function: str, tensors: Sequence[Any], name: Any, group: Any, process_set: Any,
              compression: Any = None, then: Callable[[Any], None] | None = None) -> Iterator[Checked]:
    """The checks every public collective makes, run as one rank-local step with the ``with`` body's own:
    its name and compression, the body (op, scale factors, root: they need no hp.init), then its group
    (resolved once) and tensors, then ``then(group)``. An error in any of them still takes this rank's place
    in the collective (context.refusing), so the other ranks fail too instead of waiting."""
    with refusing(function, function, group, process_set):
        check_name(name, function)
        if compression is not None:
            check_compression(compression, function)
        checked = Checked(function, None)
        yield checked
        checked.group = resolved(resolve_group(group, process_set, function), function)
        check_tensors(tensors, checked.group, function)
        if then is not None:
            then(checked.group)


def checked_group(function: str, tensors: Sequence[Any], name: Any, group: Any, process_set: Any,
                   then: Callable[[Any], None] | None = None) -> Any:
    """:func:`checking` for a collective without arguments of its own: the resolved group."""
    with checking(function, tensors, name, group, process_set, then=then) as checked:
        pass
    return checked.group


class Uncompressed:
    """The compressor of a collective given ``compression=None`` (hp.Compression.none does the same)."""

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return tensor


UNCOMPRESSED = Uncompressed()


def compressor(compression: Any) -> Any:
    """``compression``, or :data:`UNCOMPRESSED` for None."""
    return UNCOMPRESSED if compression is None else compression


def compressed(compression: Any, tensors: Sequence[Any], op: Any) -> tuple[list, Any]:
    """What travels, ``[(tensor, ctx)]``, and the wire format of the ring. A compressor with a ``wire_for(tensor,
    op)`` (hp.Compression.fp16 / bf16 and their ``.forced``: hybridpipe.data_parallel.compression) names the format
    a tensor travels in inside the ring (float32 tensors in host memory: the ring converts each segment), and those
    tensors travel as they are; the others go through ``compression.compress``."""
    wire_for = getattr(compression, "wire_for", None)
    formats = [wire_for(t, op) if callable(wire_for) else None for t in tensors]
    compressed = [(t, None) if wire is not None else compression.compress(t) for t, wire in zip(tensors, formats)]
    return compressed, next((wire for wire in formats if wire is not None), None)


def rank_in(group: Any, function: str) -> int:
    """This rank's number in ``group`` (call on the communication thread, inside a collective's work)."""
    return int(context.communicator(group, function).Get_rank())


def check_root(root_rank: Any, function: str) -> int:
    """``root_rank`` as an int; TypeError naming it otherwise."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"hp.{function}: root_rank must be an int (a rank), got {root_rank!r}")
    return int(root_rank)


#: The group of the data-parallel helpers when none is given: the replicas of this rank's pipeline stage.
DEFAULT_GROUP = "data"


def group_name(group: Any) -> str:
    """How an error message names ``group``."""
    if isinstance(group, context.Group):
        return group.label
    return group if isinstance(group, str) else "a user communicator" if group is not None else "world"


def spelling(group: Any, process_set: Any, function: str) -> Any:
    """The group a data-parallel helper means, as the user spelled it: ``process_set`` (Horovod's keyword) or
    ``group`` (default "data"). What a long-lived object keeps (a DistributedOptimizer resolves it at each step:
    elastic training re-makes the job under it)."""
    if process_set is None:
        return DEFAULT_GROUP if group is None else group
    return context.resolve_group(group, process_set, function)


def target(group: Any, process_set: Any, function: str) -> context.Group:
    """The group of a one-shot call (an object collective, a parameter broadcast), resolved once
    (:class:`~hybridpipe.comm.context.Group`): raises what using it would raise; no communication."""
    return context.resolved(spelling(group, process_set, function), function)


def root_index(group: Any, root_rank: Any, function: str) -> int:
    """The rank in ``group``'s communicator of ``root_rank`` (a global rank for a process set)."""
    root = check_root(root_rank, function)
    state = context.current(function)
    set_ranks = state.set_ranks(group, function)
    if set_ranks is not None:
        if root not in set_ranks:
            raise ValueError(f"{function}: root_rank {root} is not in the process set (ranks {set_ranks}); with a "
                             "process set, root_rank is a global rank (hp.rank()), as in Horovod")
        return set_ranks.index(root)
    size = state.group_size(group, function)
    if not 0 <= root < size:
        raise ValueError(f"{function}: root_rank {root} is outside the {group_name(group)} group of {size} ranks")
    return root


def agreed_kind(function: str, name: Any) -> str:
    """The kind the ranks agree on for an object collective: its name is part of it (checked across ranks)."""
    return function if name is None else f"{function}|{name}"


def contiguous(x: Any) -> bool:
    return x.is_contiguous() if is_tensor(x) else bool(x.flags["C_CONTIGUOUS"])


def to_device_of(result: Any, original: Any) -> Any:
    return result.to(original.device) if is_tensor(original) and original.device.type != "cpu" else result


def empty_like_rows(work: Any, rows: int) -> Any:
    shape = (rows, *work.shape[1:])
    return buffers.torch_module().empty(shape, dtype=work.dtype) if is_tensor(work) else np.empty(shape, work.dtype)

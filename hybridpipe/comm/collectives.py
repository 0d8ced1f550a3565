"""Collectives on torch tensors and numpy arrays: allreduce (ring, fused), broadcast, allgather, barrier.

Before moving data, the ranks of a collective agree on a small header (count, dtype, op, shape
digest) with one tiny MPI_Allreduce (max of the values and of their negatives). A disagreement —
different shapes, dtypes, ops, tensor lists, or a rank passing something unsupported — raises
MismatchError on every rank with every rank's values, instead of a hang or a truncation. The
data then moves through the C++ core (allreduce) or through the MPI library (broadcast, allgather).
Tensors on a GPU are staged through host memory for now.
"""

from __future__ import annotations

import enum
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from .._ext import core
from ..errors import MismatchError
from . import buffers, context
from .buffers import check_array, copy_into, describe, host, is_tensor

__all__ = ["ReduceOp", "Sum", "Average", "Min", "Max", "allreduce", "allreduce_", "grouped_allreduce",
           "grouped_allreduce_", "broadcast", "broadcast_", "allgather", "barrier"]


class ReduceOp(enum.IntEnum):
    """Reduction of an allreduce. Average divides the sum by the group size (integers: truncating)."""

    Sum = 0
    Average = 1
    Min = 2
    Max = 3


Sum, Average, Min, Max = ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max

_SAME_TENSOR = "every rank must pass the same shape, dtype and op"


def wait_policy(config: Any = None) -> Any:
    """The polite wait of ``config`` (default: the one in force; ``HYBRIDPIPE_WAIT_SPIN_US`` /
    ``HYBRIDPIPE_WAIT_SLEEP_US``) for the background engine and direct collectives while tensors are
    in flight on the engine."""
    return context.wait_policy(context.current("wait_policy").config if config is None else config)


def _digest(text: str) -> int:
    return zlib.crc32(text.encode())


def _list_ranks(descriptions: list) -> str:
    return "; ".join(f"rank {r}: {d}" for r, d in enumerate(descriptions))


def _agree(comm: Any, function: str, fields: Sequence[int], description: Callable[[], Any], fix: str,
           explain: Callable[[list], str] = _list_ranks) -> None:
    """Raises MismatchError on every rank unless all ranks of ``comm`` passed the same ``fields``.

    The common case costs one MPI_Allreduce of 2·len(fields) integers (in C++); only on a mismatch
    are the ranks' ``description()`` values gathered and turned into a message by ``explain``.
    """
    if not core().headers_agree(comm.py2f(), list(fields), context.current(function).allreduce_options().wait):
        _mismatch(comm, function, description, fix, explain)


def _mismatch(comm: Any, function: str, description: Callable[[], Any], fix: str,
              explain: Callable[[list], str] = _list_ranks) -> None:
    raise MismatchError(f"hp.{function}: ranks disagree ({explain(comm.allgather(description()))}); {fix}")


def reduce_op(op: Any, function: str) -> ReduceOp:
    """``op`` as a ReduceOp; TypeError naming it otherwise."""
    try:
        return ReduceOp(op)
    except ValueError:
        raise TypeError(f"hp.{function}: op must be hp.Sum, hp.Average, hp.Min or hp.Max, got {op!r}") from None


def _allreduce_into(source: Any, target: Any, op: ReduceOp, comm: Any, function: str) -> None:
    code = buffers.dtype_code(source)
    count = buffers.count(source)
    header = [1, count, code, int(op), _digest(str(tuple(source.shape)))]
    if code == buffers.UNSUPPORTED:  # still agree first: a bad dtype on one rank must not hang the others
        _agree(comm, function, header, lambda: f"{describe(source)} op={op.name}", _SAME_TENSOR)
        buffers.check_reducible([code], [source], function)
    if not core().allreduce(buffers.address(source), buffers.address(target), count, code, int(op), comm.py2f(),
                            context.current(function).allreduce_options(), header):
        _mismatch(comm, function, lambda: f"{describe(source)} op={op.name}", _SAME_TENSOR)


def allreduce(tensor: Any, op: ReduceOp = Average, group: Any = None) -> Any:
    """Reduces ``tensor`` over the ranks of ``group`` and returns the result as a new tensor/array.

    Args:
        tensor: torch.Tensor (any device, contiguous or not) or numpy.ndarray of dtype float32,
            float64, float16, bfloat16, int32 or int64; the same shape and dtype on every rank.
        op: hp.Sum, hp.Average (default, like Horovod), hp.Min or hp.Max.
        group: None or "world" (all ranks), "data" (my stage's replicas), "pipe" (my pipeline), or an
            mpi4py communicator.

    Returns:
        A new tensor (same device) or array with the reduced values.

    Raises:
        MismatchError: ranks passed different shapes, dtypes or ops (on every rank).
        TypeError: not a tensor/array, or a dtype that cannot be reduced.
    """
    return _on_engine(group, "allreduce", lambda: _allreduce_here(tensor, op, group))


def _allreduce_here(tensor: Any, op: Any, group: Any) -> Any:
    check_array(tensor, "allreduce")
    source = host(tensor)
    target = buffers.clone(source)
    _allreduce_into(source, target, reduce_op(op, "allreduce"), context.communicator(group, "allreduce"), "allreduce")
    return target.to(tensor.device) if is_tensor(tensor) and tensor.device.type != "cpu" else target


def allreduce_(tensor: Any, op: ReduceOp = Average, group: Any = None) -> Any:
    """In-place :func:`allreduce`: ``tensor`` holds the result afterwards and is returned."""
    return _on_engine(group, "allreduce_", lambda: _allreduce_in_place_here(tensor, op, group))


def _allreduce_in_place_here(tensor: Any, op: Any, group: Any) -> Any:
    check_array(tensor, "allreduce_")
    work = host(tensor)
    _allreduce_into(work, work, reduce_op(op, "allreduce_"), context.communicator(group, "allreduce_"), "allreduce_")
    copy_into(tensor, work)
    return tensor


def _on_engine(group: Any, function: str, work: Callable[[], Any]) -> Any:
    """Runs a blocking collective on the engine's communication thread (see context.call)."""
    return context.call(group, function, work)


def _grouped(tensors: Sequence[Any], op: Any, group: Any, function: str, in_place: bool) -> list:
    return _on_engine(group, function, lambda: _grouped_here(tensors, op, group, function, in_place))


def _grouped_here(tensors: Sequence[Any], op: Any, group: Any, function: str, in_place: bool) -> list:
    tensors = list(tensors)
    for t in tensors:
        check_array(t, function)
    op = reduce_op(op, function)
    ctx = context.current(function)
    comm = ctx.communicator(group, function)
    works = [host(t) for t in tensors]
    targets = works if in_place else [buffers.clone(w) for w in works]
    codes = [buffers.dtype_code(w) for w in works]
    entries = [describe(w) for w in works]
    _agree(comm, function, [2, len(tensors), _digest("|".join(entries)), int(op)], lambda: (op.name, entries),
           "every rank must pass the same list of tensors (same order, shapes and dtypes) and the same op",
           _explain_lists)
    buffers.check_reducible(codes, works, function)
    order = sorted(range(len(works)), key=lambda i: codes[i])  # stable: one dtype's buckets in list order
    counts = [buffers.count(works[i]) for i in order]
    core().grouped_allreduce([buffers.address(works[i]) for i in order], [buffers.address(targets[i]) for i in order],
                             counts, [codes[i] for i in order], int(op), comm.py2f(),
                             ctx.config.fusion_threshold_bytes, ctx.allreduce_options())
    results = []
    for original, target in zip(tensors, targets):
        if in_place:
            copy_into(original, target)
            results.append(original)
        elif is_tensor(original) and original.device.type != "cpu":
            results.append(target.to(original.device))
        else:
            results.append(target)
    return results


def _explain_lists(everyone: list) -> str:
    """Names the op or the first list position where ranks' (op, [tensor descriptions]) differ."""
    ops = [op for op, _ in everyone]
    if len(set(ops)) > 1:
        return _list_ranks([f"op={op}" for op in ops])
    lengths = [len(entries) for _, entries in everyone]
    for index in range(max(lengths)):
        at = [entries[index] if index < len(entries) else "(no tensor)" for _, entries in everyone]
        if len(set(at)) > 1:
            return f"tensor {index}: " + _list_ranks(at) + " | list lengths: " + _list_ranks(lengths)
    return _list_ranks(lengths)


def grouped_allreduce(tensors: Sequence[Any], op: ReduceOp = Average, group: Any = None) -> list:
    """Allreduces many tensors at once through the fusion buffer; returns new tensors/arrays.

    Tensors are packed into buckets of ``fusion_threshold_bytes`` (HYBRIDPIPE_FUSION_THRESHOLD) and
    each bucket is one ring allreduce, so many small gradients cost a few large messages.

    Args:
        tensors: a list of torch tensors / numpy arrays; every rank passes the same shapes and dtypes
            in the same order (dtypes may be mixed).
        op: hp.Sum, hp.Average, hp.Min or hp.Max.
        group: as in :func:`allreduce`.

    Returns:
        A list of new tensors/arrays, in the order given.

    Raises:
        MismatchError: the lists differ between ranks (on every rank).
    """
    return _grouped(tensors, op, group, "grouped_allreduce", in_place=False)


def grouped_allreduce_(tensors: Sequence[Any], op: ReduceOp = Average, group: Any = None) -> list:
    """In-place :func:`grouped_allreduce`; returns the same tensors."""
    return _grouped(tensors, op, group, "grouped_allreduce_", in_place=True)


def broadcast_(tensor: Any, root_rank: int, group: Any = None) -> Any:
    """Overwrites ``tensor`` on every rank of ``group`` with root_rank's values; returns it.

    Any dtype is accepted (the bytes are moved). ``root_rank`` is a rank of ``group``.

    Raises:
        MismatchError: ranks passed different shapes, dtypes or roots (on every rank).
        ValueError: root_rank is outside the group.
    """
    return _on_engine(group, "broadcast_", lambda: _broadcast_here(tensor, root_rank, group))


def _broadcast_here(tensor: Any, root_rank: int, group: Any) -> Any:
    check_array(tensor, "broadcast_")
    comm = context.communicator(group, "broadcast_")
    work = host(tensor)
    _agree(comm, "broadcast_", [3, int(root_rank), _digest(describe(work))],
           lambda: f"root_rank={root_rank} {describe(work)}",
           "every rank must pass the same root_rank, shape and dtype")
    if not 0 <= root_rank < comm.Get_size():
        raise ValueError(f"hp.broadcast: root_rank {root_rank} is not a rank of a group of {comm.Get_size()} "
                         f"(use 0..{comm.Get_size() - 1})")
    from mpi4py import MPI

    comm.Bcast([buffers.byte_view(work), MPI.BYTE], root=int(root_rank))
    copy_into(tensor, work)
    return tensor


def broadcast(tensor: Any, root_rank: int, group: Any = None) -> Any:
    """Returns a new tensor/array holding root_rank's ``tensor`` (see :func:`broadcast_`)."""
    check_array(tensor, "broadcast")
    copy = buffers.clone(tensor)
    return broadcast_(copy, root_rank, group)


def allgather(tensor: Any, group: Any = None) -> Any:
    """Concatenates every rank's ``tensor`` along dimension 0, in rank order, on every rank.

    The first dimension may differ between ranks; the other dimensions and the dtype must agree.

    Returns:
        A new tensor (on the input's device) or array of shape ``(sum of first dims, *rest)``.

    Raises:
        MismatchError: dtypes or trailing dimensions differ (on every rank).
        ValueError: a 0-dimensional input (allgather needs a dimension to concatenate along).
    """
    return _on_engine(group, "allgather", lambda: _allgather_here(tensor, group))


def _allgather_here(tensor: Any, group: Any) -> Any:
    check_array(tensor, "allgather")
    comm = context.communicator(group, "allgather")
    work = host(tensor)
    ndim = len(work.shape)
    rows = int(work.shape[0]) if ndim else 0
    trailing = f"{tuple(work.shape[1:])} {str(work.dtype).replace('torch.', '')} ndim={ndim}"
    headers = np.empty((comm.Get_size(), 2), dtype=np.int64)
    comm.Allgather(np.array([_digest(trailing), rows], dtype=np.int64), headers)
    if len(set(headers[:, 0].tolist())) > 1:
        everyone = comm.allgather(f"first dim {rows}, then {trailing}")
        raise MismatchError(f"hp.allgather: ranks disagree ({_list_ranks(everyone)}); every rank must pass the "
                            f"same dtype and the same dimensions after the first")
    if ndim == 0:
        raise ValueError("hp.allgather needs a tensor with at least one dimension (got a 0-d scalar; "
                         "use tensor.reshape(1))")
    row_bytes = work.dtype.itemsize * int(np.prod(work.shape[1:], dtype=np.int64)) if isinstance(
        work, np.ndarray) else work.element_size() * int(np.prod(tuple(work.shape[1:]), dtype=np.int64))
    counts = (headers[:, 1] * row_bytes).tolist()
    total_rows = int(headers[:, 1].sum())
    shape = (total_rows, *work.shape[1:])
    if is_tensor(work):
        result = buffers.torch_module().empty(shape, dtype=work.dtype)
    else:
        result = np.empty(shape, dtype=work.dtype)
    from mpi4py import MPI

    comm.Allgatherv([buffers.byte_view(work), MPI.BYTE], [buffers.byte_view(result), counts, MPI.BYTE])
    return result.to(tensor.device) if is_tensor(tensor) and tensor.device.type != "cpu" else result


def barrier(group: Any = None) -> None:
    """Blocks until every rank of ``group`` has called barrier."""
    _on_engine(group, "barrier", lambda: context.communicator(group, "barrier").Barrier())

"""The alltoall family (Horovod's ``alltoall`` and ``alltoall_async``): ``splits[r]`` consecutive rows of
this rank's tensor to each rank ``r`` of the group, and what every rank sent here, in rank order (MPI_Alltoallv).

:func:`alltoall` is differentiable (the gradient goes back with an alltoall whose splits are the received splits);
:func:`alltoall_nograd` is the same without autograd.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..comm import buffers, context
from ..comm.buffers import check_array, host, is_tensor
from ..comm.context import check_name, refusing, resolve_group, resolved
from .common import (agree, check_tensors, checked_group, digest, empty_like_rows, named, needs_grad, to_device_of)

__all__ = ["alltoall", "alltoall_async", "alltoall_nograd", "alltoall_here", "check_splits"]


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, group: Any) -> Any:
        output, received = context.call(group, "alltoall", lambda: alltoall_here(tensor, splits, name, group,
                                                                                   "alltoall"), "alltoall")
        ctx.received, ctx.group = received, group
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple:
        back, _ = alltoall(grad, splits=ctx.received, group=ctx.group)
        return back, None, None, None


def alltoall(tensor: Any, splits: Any = None, name: str | None = None, process_set: Any = None,
             group: Any = None) -> Any:
    """Sends ``splits[r]`` consecutive rows of ``tensor`` to each rank ``r`` of the group and returns what
    every rank sent here, concatenated in rank order; differentiable (the gradient goes back with an
    alltoall whose splits are the received splits).

    Args:
        tensor: a torch tensor or numpy array; every rank passes the same dtype and dimensions after the first.
        splits: rows to send to each rank (ints summing to ``tensor.shape[0]``); default: the first
            dimension split evenly (it must divide by the group size).
        name: optional; checked to be the same on every rank.
        process_set, group: as in :func:`allreduce` (rank order: the set's).

    Returns:
        The received rows; with ``splits`` given, ``(received rows, received_splits)`` as in Horovod
        (``received_splits``: int32, the rows that came from each rank).

    Raises:
        MismatchError: dtypes, trailing dimensions or names differ, or a rank's splits do not fit (every rank).
    """
    if not needs_grad(tensor):  # the plain collective (which checks its arguments itself)
        return alltoall_nograd(tensor, splits=splits, name=name, process_set=process_set, group=group)
    group = checked_group("alltoall", [tensor], name, group, process_set,
                           then=lambda checked: check_splits(tensor, splits, checked, "alltoall"))
    return _Alltoall.apply(tensor, splits, name, group)


def alltoall_nograd(tensor: Any, splits: Any = None, name: str | None = None, process_set: Any = None,
                    group: Any = None) -> Any:
    """Sends ``splits[r]`` consecutive rows (first-dimension slices) of ``tensor`` to each rank ``r`` of the
    group and returns what every rank sent here, concatenated in rank order.

    Args:
        tensor: a torch tensor or numpy array; every rank passes the same dtype and dimensions after the first.
        splits: rows to send to each rank (a list, numpy array or tensor of ints summing to ``tensor.shape[0]``);
            default: the first dimension split evenly (it must divide by the group size).
        name: optional; checked to be the same on every rank.
        process_set, group: as in :func:`~hybridpipe.allreduce` (rank order: the set's).

    Returns:
        The received rows; with ``splits`` given, ``(received rows, received_splits)`` as in Horovod, where
        ``received_splits`` (int32, a tensor for tensors) counts the rows that came from each rank.

    Raises:
        MismatchError: dtypes, trailing dimensions or names differ, or a rank's splits do not fit (every rank).
        ValueError: the splits do not fit the tensor (on every rank, when every rank got them wrong alike).
    """
    with refusing("alltoall", "alltoall", group, process_set):
        check_name(name, "alltoall")
        group = resolve_group(group, process_set, "alltoall")
        check_tensors([tensor], group, "alltoall")
        group = resolved(group, "alltoall")
        check_splits(tensor, splits, group, "alltoall")
    output, received = context.call(group, "alltoall", lambda: alltoall_here(tensor, splits, name, group, "alltoall"),
                                    "alltoall")
    return output if splits is None else (output, received)


def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None, process_set: Any = None,
                   group: Any = None) -> context.Handle:
    """Queues :func:`alltoall`; ``handle.wait()`` returns ``(received rows, received_splits)`` (always the
    pair, as Horovod's ``synchronize`` does)."""
    with refusing("alltoall_async", "alltoall", group, process_set, name, asynchronous=True):
        check_name(name, "alltoall_async")
        group = resolve_group(group, process_set, "alltoall_async")
        check_tensors([tensor], group, "alltoall_async")
        group = resolved(group, "alltoall_async")
        check_splits(tensor, splits, group, "alltoall_async")
    return context.submit(group, "alltoall_async", name,
                          lambda: alltoall_here(tensor, splits, name, group, "alltoall_async"), "alltoall")


def alltoall_here(tensor: Any, splits: Any, name: str | None, group: Any, function: str) -> tuple[Any, Any]:
    """One alltoall on the communication thread; returns the received rows and the received splits."""
    check_array(tensor, function)
    comm = context.communicator(group, function)
    work = host(tensor)
    size = comm.Get_size()
    rows = int(work.shape[0]) if len(work.shape) else 0
    send_rows, problem = _split_problem(splits, rows, size) if len(work.shape) else (
        [], "alltoall needs a tensor with at least one dimension (got a 0-d scalar; use tensor.reshape(1))")
    agree(comm, function, [9, digest(buffers.trailing(tensor) + named(name)), digest(problem)],
           lambda: (f"first dim {rows}, then {buffers.trailing(tensor)}{named(name)}"
                    f"{f' ({problem})' if problem else ''}"),
           "every rank must pass the same dtype, the same dimensions after the first, the same name, and splits "
           "that fit its tensor")
    if problem:
        raise ValueError(f"hp.{function}: {problem}")
    from mpi4py import MPI

    received_rows = np.empty(size, dtype=np.int64)
    comm.Alltoall(np.array(send_rows, dtype=np.int64), received_rows)
    row_bytes = buffers.row_bytes(work)
    send_counts = [r * row_bytes for r in send_rows]
    receive_counts = [int(r) * row_bytes for r in received_rows]
    result = empty_like_rows(work, int(received_rows.sum()))
    comm.Alltoallv([buffers.byte_view(work), (send_counts, _displacements(send_counts)), MPI.BYTE],
                   [buffers.byte_view(result), (receive_counts, _displacements(receive_counts)), MPI.BYTE])
    received = received_rows.astype(np.int32)
    if is_tensor(work):
        received = buffers.torch_module().from_numpy(received)
    return to_device_of(result, tensor), received


def check_splits(tensor: Any, splits: Any, group: Any, function: str) -> None:
    """ValueError when ``splits`` (or the even split) does not fit ``tensor`` over ``group``: a rank-local check."""
    size = context.current(function).group_size(group, function)
    rows = int(tensor.shape[0]) if len(tensor.shape) else 0
    _, problem = _split_problem(splits, rows, size) if len(tensor.shape) else (
        [], "alltoall needs a tensor with at least one dimension (got a 0-d scalar; use tensor.reshape(1))")
    if problem:
        raise ValueError(f"hp.{function}: {problem}")


def _split_problem(splits: Any, rows: int, size: int) -> tuple[list[int], str]:
    """(rows to send to each rank, "" or what is wrong with ``splits``)."""
    if splits is None:
        if rows % size:
            return [], (f"the first dimension ({rows}) does not split evenly over {size} ranks; pass splits=[...] "
                        f"(rows to send to each rank, summing to {rows})")
        return [rows // size] * size, ""
    values = splits.tolist() if hasattr(splits, "tolist") else list(splits)
    if len(values) != size or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0
                                  for v in values):
        return [], f"splits {values} must be {size} non-negative ints (rows to send to each rank of the group)"
    if sum(values) != rows:
        return [], f"splits {values} sum to {sum(values)}, not to the first dimension ({rows})"
    return [int(v) for v in values], ""


def _displacements(counts: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist() if counts else []

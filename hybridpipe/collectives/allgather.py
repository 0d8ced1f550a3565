"""The allgather family (Horovod's ``allgather``, ``grouped_allgather``, their ``*_async`` forms and
``allgather_object``): every rank's rows, concatenated along the first dimension in rank order, on every rank.

The first dimension may differ between ranks; the ranks agree on a header first (dtype, trailing dimensions, name)
so that ranks passing different things raise MismatchError on every rank. :func:`allgather` and
:func:`grouped_allgather` are differentiable (the gradient is this rank's rows of the **average** over ranks of the
gradient, as Horovod has since 0.21.3); the ``*_nograd`` forms are the same without autograd.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..errors import MismatchError
from .._ext import core
from ..comm import buffers, context
from ..comm.buffers import check_array, host
from ..comm.context import check_name, refusing, resolve_group, resolved
from ..comm.reduction import list_ranks
from .allreduce import allreduce, grouped_allreduce
from .common import (Average, agree, agreed_kind, check_tensors, checked_group, contiguous, digest, empty_like_rows,
                     named, needs_grad, rank_in, target, to_device_of)

__all__ = ["allgather", "grouped_allgather", "allgather_async", "grouped_allgather_async",
           "allgather_nograd", "grouped_allgather_nograd", "allgather_here", "grouped_allgather_here",
           "allgather_object"]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, group: Any) -> torch.Tensor:
        def work() -> tuple:
            result, rows = allgather_here(tensor, name, group, "allgather")
            return result, rows, rank_in(group, "allgather")

        result, ctx.rows, ctx.index = context.call(group, "allgather", work, "allgather")
        ctx.group = group
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = allreduce(grad, op=Average, group=ctx.group)
        return averaged.narrow(0, sum(ctx.rows[:ctx.index]), ctx.rows[ctx.index]), None, None


def allgather(tensor: Any, name: str | None = None, process_set: Any = None, group: Any = None) -> Any:
    """Concatenates every rank's ``tensor`` along dimension 0, in rank order, on every rank; differentiable
    (the gradient is this rank's rows of the average over ranks of the gradient, as in Horovod).

    The first dimension may differ between ranks; the other dimensions and the dtype must agree.

    Args:
        tensor: a torch tensor or numpy array with at least one dimension.
        name: optional; checked to be the same on every rank.
        process_set, group: as in :func:`allreduce` (rank order: the set's).

    Returns:
        A new tensor (on the input's device) or array of shape ``(sum of first dims, *rest)``.

    Raises:
        MismatchError: dtypes or trailing dimensions differ (on every rank).
        ValueError: a 0-dimensional input (allgather needs a dimension to concatenate along).
    """
    if not needs_grad(tensor):  # the plain collective (which checks its arguments itself)
        return allgather_nograd(tensor, name=name, process_set=process_set, group=group)
    return _Allgather.apply(tensor, name, checked_group("allgather", [tensor], name, group, process_set))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, group: Any, *tensors: torch.Tensor) -> tuple:
        def work() -> tuple:
            results, rows = grouped_allgather_here(tensors, name, group, "grouped_allgather")
            return results, rows, rank_in(group, "grouped_allgather")

        results, ctx.rows, ctx.index = context.call(group, "grouped_allgather", work, "grouped_allgather")
        ctx.group = group
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        averaged = grouped_allreduce(list(grads), op=Average, group=ctx.group)
        mine = []
        for i, grad in enumerate(averaged):
            rows = [rank_rows[i] for rank_rows in ctx.rows]
            mine.append(grad.narrow(0, sum(rows[:ctx.index]), rows[ctx.index]))
        return (None, None, *mine)


def grouped_allgather(tensors: Sequence[Any], name: str | None = None, process_set: Any = None,
                      group: Any = None) -> list:
    """:func:`allgather` of each tensor of a list, in one exchange; differentiable like :func:`allgather`.

    Raises:
        MismatchError: the lists differ between ranks (length, dtypes, trailing dimensions; on every rank).
    """
    group = checked_group("grouped_allgather", tensors, name, group, process_set)
    tensors = list(tensors)
    if needs_grad(*tensors):
        return list(_GroupedAllgather.apply(name, group, *tensors))
    return grouped_allgather_nograd(tensors, name=name, group=group)


def allgather_nograd(tensor: Any, name: str | None = None, process_set: Any = None, group: Any = None) -> Any:
    """Concatenates every rank's ``tensor`` along dimension 0, in rank order, on every rank.

    The first dimension may differ between ranks; the other dimensions and the dtype must agree.

    Args:
        tensor: a torch tensor or numpy array with at least one dimension.
        name: optional; checked to be the same on every rank.
        process_set, group: as in :func:`allreduce` (rank order: the set's).

    Returns:
        A new tensor (on the input's device) or array of shape ``(sum of first dims, *rest)``.

    Raises:
        MismatchError: dtypes or trailing dimensions differ (on every rank).
        ValueError: a 0-dimensional input (allgather needs a dimension to concatenate along).
    """
    with refusing("allgather", "allgather", group, process_set):
        check_name(name, "allgather")
        group = resolve_group(group, process_set, "allgather")
        check_tensors([tensor], group, "allgather")
        group = resolved(group, "allgather")
    return context.call(group, "allgather", lambda: allgather_here(tensor, name, group, "allgather")[0], "allgather")


def allgather_async(tensor: Any, name: str | None = None, process_set: Any = None,
                    group: Any = None) -> context.Handle:
    """Queues :func:`allgather`; ``handle.wait()`` returns the concatenation."""
    with refusing("allgather_async", "allgather", group, process_set, name, asynchronous=True):
        check_name(name, "allgather_async")
        group = resolve_group(group, process_set, "allgather_async")
        check_tensors([tensor], group, "allgather_async")
        group = resolved(group, "allgather_async")
    return context.submit(group, "allgather_async", name,
                          lambda: allgather_here(tensor, name, group, "allgather_async")[0], "allgather")


def grouped_allgather_nograd(tensors: Sequence[Any], name: str | None = None, process_set: Any = None,
                             group: Any = None) -> list:
    """:func:`allgather` of each tensor of a list, in one exchange; returns a list in the order given.

    Raises:
        MismatchError: the lists differ between ranks (length, dtypes, trailing dimensions; on every rank).
    """
    with refusing("grouped_allgather", "grouped_allgather", group, process_set):
        check_name(name, "grouped_allgather")
        group = resolve_group(group, process_set, "grouped_allgather")
        tensors = check_tensors(tensors, group, "grouped_allgather")
        group = resolved(group, "grouped_allgather")
    return context.call(group, "grouped_allgather",
                      lambda: grouped_allgather_here(tensors, name, group, "grouped_allgather")[0], "grouped_allgather")


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None, process_set: Any = None,
                            group: Any = None) -> context.Handle:
    """Queues :func:`grouped_allgather`; ``handle.wait()`` returns the list."""
    with refusing("grouped_allgather_async", "grouped_allgather", group, process_set, name, asynchronous=True):
        check_name(name, "grouped_allgather_async")
        group = resolve_group(group, process_set, "grouped_allgather_async")
        tensors = check_tensors(tensors, group, "grouped_allgather_async")
        group = resolved(group, "grouped_allgather_async")
    return context.submit(group, "grouped_allgather_async", name,
                          lambda: grouped_allgather_here(tensors, name, group, "grouped_allgather_async")[0],
                          "grouped_allgather")


def allgather_here(tensor: Any, name: str | None, group: Any, function: str) -> tuple[Any, list[int]]:
    """One allgather on the communication thread; returns the result and each rank's first dimension."""
    check_array(tensor, function)
    comm = context.communicator(group, function)
    work = host(tensor)
    ndim = len(work.shape)
    rows = int(work.shape[0]) if ndim else 0
    headers = np.empty((comm.Get_size(), 2), dtype=np.int64)
    comm.Allgather(np.array([digest(buffers.trailing(tensor) + named(name)), rows], dtype=np.int64), headers)
    if len(set(headers[:, 0].tolist())) > 1:
        everyone = comm.allgather(f"first dim {rows}, then {buffers.trailing(tensor)}{named(name)}")
        raise MismatchError(f"hp.{function}: ranks disagree ({list_ranks(everyone)}); every rank must pass the "
                            f"same dtype, the same dimensions after the first and the same name")
    if ndim == 0:
        raise ValueError(f"hp.{function} needs a tensor with at least one dimension (got a 0-d scalar; "
                         "use tensor.reshape(1))")
    counts = (headers[:, 1] * buffers.row_bytes(work)).tolist()
    result = empty_like_rows(work, int(headers[:, 1].sum()))
    code = buffers.dtype_code(work)
    if code != buffers.UNSUPPORTED and contiguous(work):  # the C++ fast path: shared memory, ring or library
        per_row = int(np.prod(tuple(work.shape[1:]), dtype=np.int64))
        core().allgather(buffers.address(work), buffers.address(result), [int(r) * per_row for r in headers[:, 1]],
                         code, comm.py2f(), context.current("allgather").allreduce_options())
        return to_device_of(result, tensor), headers[:, 1].tolist()
    from mpi4py import MPI

    comm.Allgatherv([buffers.byte_view(work), MPI.BYTE], [buffers.byte_view(result), counts, MPI.BYTE])
    return to_device_of(result, tensor), headers[:, 1].tolist()


def grouped_allgather_here(tensors: Sequence[Any], name: str | None, group: Any,
                           function: str) -> tuple[list, list[list[int]]]:
    """Allgathers each tensor along dimension 0 (one MPI_Allgatherv for the whole list), on the
    communication thread; returns the results and each rank's first dimensions (``rows[rank][i]``)."""
    tensors = list(tensors)
    for t in tensors:
        check_array(t, function)
    comm = context.communicator(group, function)
    works = [host(t) for t in tensors]
    entries = [buffers.trailing(t) for t in tensors]
    agree(comm, function, [8, len(works), digest("|".join(entries) + named(name))],
           lambda: [f"first dim {w.shape[0] if len(w.shape) else 0}, then {e}" for w, e in zip(works, entries)]
           + ([f"name={name!r}"] if name is not None else []),
           "every rank must pass the same dtypes, the same dimensions after the first and the same name")
    if any(len(w.shape) == 0 for w in works):
        raise ValueError(f"hp.{function} needs tensors with at least one dimension (got a 0-d scalar; "
                         "use tensor.reshape(1))")
    size = comm.Get_size()
    mine = np.array([int(w.shape[0]) for w in works], dtype=np.int64)
    rows = np.empty((size, len(works)), dtype=np.int64)
    from mpi4py import MPI

    comm.Allgather(mine, rows)
    row_bytes = [buffers.row_bytes(w) for w in works]
    send = np.concatenate([buffers.byte_view(w) for w in works]) if len(works) > 1 else (
        buffers.byte_view(works[0]) if works else np.empty(0, np.uint8))
    counts = [int(sum(rows[r, i] * row_bytes[i] for i in range(len(works)))) for r in range(size)]
    received = np.empty(sum(counts), dtype=np.uint8)
    comm.Allgatherv([send, MPI.BYTE], [received, counts, MPI.BYTE])
    results = []
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    offsets = starts.copy()
    for i, work in enumerate(works):
        result = empty_like_rows(work, int(rows[:, i].sum()))
        target, at = buffers.byte_view(result), 0
        for r in range(size):
            length = int(rows[r, i] * row_bytes[i])
            target[at:at + length] = received[offsets[r]:offsets[r] + length]
            offsets[r] += length
            at += length
        results.append(to_device_of(result, tensors[i]))
    return results, rows.tolist()


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None, group: Any = None) -> list:
    """Every rank's ``obj`` (pickled), as a list in rank order of the group (default ``"data"``)."""
    with context.refusing("allgather_object", "allgather_object", group, process_set):
        context.check_name(name, "allgather_object")
        resolved = target(group, process_set, "allgather_object")
    return context.call(resolved, "allgather_object",
                        lambda: context.communicator(resolved, "allgather_object").allgather(obj),
                        agreed_kind("allgather_object", name))

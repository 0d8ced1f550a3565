"""Collectives along the first dimension, rows from or to every rank: allgather, alltoall and
reducescatter (Horovod's), with their grouped and ``*_async`` forms.

Like the other collectives they run on the communication thread, agree on a header first (dtype,
trailing dimensions, op, name; for reducescatter the whole shape) so that ranks passing different
things raise MismatchError on every rank, and move the data through the MPI library
(``MPI_Allgatherv``, ``MPI_Alltoallv``, ``MPI_Reduce_scatter``). Reducescatter splits the first
dimension as Horovod does: with ``d`` rows over ``n`` ranks, the first ``d % n`` ranks get
``d // n + 1`` rows, the others ``d // n``; float16 / bfloat16 are summed in float32 and rounded
once; Average divides once at the end (integers: truncating toward zero, like hp.allreduce).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import MismatchError, NotSupportedError
from .._ext import core
from . import buffers, context
from .buffers import check_array, describe, host, is_tensor
from .reduction import Average, Sum, agree, check_tensors, digest, list_ranks, named, reduce_op, scale_factor
from .context import check_name, refusing, resolve_group, resolved

__all__ = ["allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "alltoall",
           "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "reducescatter_rows", "sparse_allreduce_async", "SparseHandle"]


_FLOAT_CODES = (0, 1, 2, 3)  # float32, float64, float16, bfloat16: what the C++ reduce-scatter averages as torch does


def _contiguous(x: Any) -> bool:
    return x.is_contiguous() if is_tensor(x) else bool(x.flags["C_CONTIGUOUS"])


def _on_device(result: Any, original: Any) -> Any:
    return result.to(original.device) if is_tensor(original) and original.device.type != "cpu" else result


# ------------------------------------------------------------------ allgather


def _empty_like_rows(work: Any, rows: int) -> Any:
    shape = (rows, *work.shape[1:])
    return buffers.torch_module().empty(shape, dtype=work.dtype) if is_tensor(work) else np.empty(shape, work.dtype)


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
        result = _empty_like_rows(work, int(rows[:, i].sum()))
        target, at = buffers.byte_view(result), 0
        for r in range(size):
            length = int(rows[r, i] * row_bytes[i])
            target[at:at + length] = received[offsets[r]:offsets[r] + length]
            offsets[r] += length
            at += length
        results.append(_on_device(result, tensors[i]))
    return results, rows.tolist()


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
    result = _empty_like_rows(work, int(headers[:, 1].sum()))
    code = buffers.dtype_code(work)
    if code != buffers.UNSUPPORTED and _contiguous(work):  # the C++ fast path: shared memory, ring or library
        per_row = int(np.prod(tuple(work.shape[1:]), dtype=np.int64))
        core().allgather(buffers.address(work), buffers.address(result), [int(r) * per_row for r in headers[:, 1]],
                         code, comm.py2f(), context.current("allgather").allreduce_options())
        return _on_device(result, tensor), headers[:, 1].tolist()
    from mpi4py import MPI

    comm.Allgatherv([buffers.byte_view(work), MPI.BYTE], [buffers.byte_view(result), counts, MPI.BYTE])
    return _on_device(result, tensor), headers[:, 1].tolist()


def allgather(tensor: Any, name: str | None = None, process_set: Any = None, group: Any = None) -> Any:
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


def grouped_allgather(tensors: Sequence[Any], name: str | None = None, process_set: Any = None,
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


# ------------------------------------------------------------------ alltoall


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
           lambda: f"first dim {rows}, then {buffers.trailing(tensor)}{named(name)}{f' ({problem})' if problem else ''}",
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
    result = _empty_like_rows(work, int(received_rows.sum()))
    comm.Alltoallv([buffers.byte_view(work), (send_counts, _displacements(send_counts)), MPI.BYTE],
                   [buffers.byte_view(result), (receive_counts, _displacements(receive_counts)), MPI.BYTE])
    received = received_rows.astype(np.int32)
    if is_tensor(work):
        received = buffers.torch_module().from_numpy(received)
    return _on_device(result, tensor), received


def check_splits(tensor: Any, splits: Any, group: Any, function: str) -> None:
    """ValueError when ``splits`` (or the even split) does not fit ``tensor`` over ``group``: a rank-local check."""
    size = context.current(function).group_size(group, function)
    rows = int(tensor.shape[0]) if len(tensor.shape) else 0
    _, problem = _split_problem(splits, rows, size) if len(tensor.shape) else (
        [], "alltoall needs a tensor with at least one dimension (got a 0-d scalar; use tensor.reshape(1))")
    if problem:
        raise ValueError(f"hp.{function}: {problem}")


def _displacements(counts: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist() if counts else []


def alltoall(tensor: Any, splits: Any = None, name: str | None = None, process_set: Any = None,
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


# ------------------------------------------------------------------ reducescatter


def reducescatter_rows(rows: int, size: int) -> list[int]:
    """How reducescatter splits ``rows`` over ``size`` ranks: the first ``rows % size`` get one more."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def reducescatter_op(op: Any, function: str) -> Any:
    """``op`` (None: Average) if reducescatter can reduce with it; NotSupportedError naming the fix otherwise."""
    op = Average if op is None else reduce_op(op, function)
    if op not in (Sum, Average):
        raise NotSupportedError(f"hp.{function}: reducescatter reduces with op=hp.Sum or op=hp.Average (got "
                                f"hp.{op.name}); for Min, Max or Product use hp.allreduce and keep your rows")
    return op


def _reduce_scatter_one(work: Any, op: Any, comm: Any) -> Any:
    """This rank's rows of the reduction of ``work`` (a contiguous host tensor/array)."""
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    rows = reducescatter_rows(int(work.shape[0]), size)
    per_row = int(np.prod(tuple(work.shape[1:]), dtype=np.int64))
    code = buffers.dtype_code(work)
    if code in _FLOAT_CODES and _contiguous(work):  # the C++ fast path: shared memory, ring or library
        mine = _empty_like_rows(work, rows[rank])
        core().reducescatter(buffers.address(work), buffers.address(mine), [r * per_row for r in rows], code,
                             int(op), comm.py2f(), context.current("reducescatter").allreduce_options())
        return mine
    half = code in (2, 3)  # float16 / bfloat16: summed in float32, rounded once
    if half:
        send = work.float() if is_tensor(work) else work.astype(np.float32)
    else:
        send = work
    mine = (buffers.torch_module().empty((rows[rank], *work.shape[1:]), dtype=send.dtype) if is_tensor(send)
            else np.empty((rows[rank], *work.shape[1:]), dtype=send.dtype))
    comm.Reduce_scatter(buffers.numpy_view(send).reshape(-1), buffers.numpy_view(mine).reshape(-1),
                        [r * per_row for r in rows], op=MPI.SUM)
    if op == Average:
        if is_tensor(mine):
            if mine.is_floating_point():
                mine.div_(size)
            else:
                mine = buffers.torch_module().div(mine, size, rounding_mode="trunc")
        elif np.issubdtype(mine.dtype, np.floating):
            mine /= mine.dtype.type(size)
        else:
            mine = (np.sign(mine) * (np.abs(mine) // size)).astype(mine.dtype)
    if half:
        mine = mine.to(work.dtype) if is_tensor(mine) else mine.astype(work.dtype)
    return mine


def grouped_reducescatter_here(tensors: Sequence[Any], op: Any, name: str | None, prescale: float, postscale: float,
                               group: Any, function: str) -> list:
    """Reduce-scatters each tensor of a list, on the communication thread (sync and async forms)."""
    tensors = list(tensors)
    for t in tensors:
        check_array(t, function)
    comm = context.communicator(group, function)
    works = [host(t) for t in tensors]
    if prescale != 1.0:
        works = [buffers.clone(w) for w in works]
        for work in works:
            buffers.scale_(work, prescale)
    codes = [buffers.dtype_code(w) for w in works]
    entries = [describe(t) for t in tensors]
    agree(comm, function, [10, len(works), digest("|".join(entries) + named(name)), int(op)],
           lambda: f"op={op.name}{named(name)} {entries}",
           "every rank must pass the same tensors (shapes, dtypes, order), op and name")
    buffers.check_reducible(codes, works, function)
    if any(len(w.shape) == 0 for w in works):
        raise ValueError(f"hp.{function} needs tensors with at least one dimension (got a 0-d scalar; "
                         "use tensor.reshape(1))")
    results = []
    for original, work in zip(tensors, works):
        mine = _reduce_scatter_one(work, op, comm)
        buffers.scale_(mine, postscale)
        results.append(_on_device(mine, original))
    return results


def _prepare(tensors: Any, op: Any, name: Any, prescale: Any, postscale: Any, process_set: Any, group: Any,
             function: str, asynchronous: bool = False) -> tuple[Any, float, float, Any]:
    with refusing(function, "reducescatter", group, process_set, name, asynchronous):
        op = reducescatter_op(op, function)
        check_name(name, function)
        prepared = (op, scale_factor(prescale, "prescale_factor", function),
                    scale_factor(postscale, "postscale_factor", function), resolve_group(group, process_set, function))
        check_tensors(tensors, prepared[3], function)
        prepared = (*prepared[:3], resolved(prepared[3], function))
        for tensor in tensors:
            if len(tensor.shape) == 0:
                raise ValueError(f"hp.{function} needs tensors with at least one dimension (got a 0-d scalar; "
                                 "use tensor.reshape(1))")
    return prepared


def reducescatter(tensor: Any, name: str | None = None, op: Any = Average, process_set: Any = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0, group: Any = None) -> Any:
    """Reduces ``tensor`` over the group and returns this rank's rows of the result.

    With ``d = tensor.shape[0]`` rows over ``n`` ranks, rank ``r`` gets rows ``[start_r, start_r + rows_r)``
    where the first ``d % n`` ranks get ``d // n + 1`` rows and the others ``d // n`` (Horovod's split).

    Args:
        tensor: torch tensor or numpy array (float32/64, float16, bfloat16, int32, int64), the same shape
            and dtype on every rank.
        name: optional; checked to be the same on every rank.
        op: hp.Average (default, as in Horovod) or hp.Sum.
        process_set: a hp.ProcessSet (Horovod's spelling of ``group``).
        prescale_factor: multiplies the input before the reduction (on a copy).
        postscale_factor: multiplies the result.
        group: as in :func:`~hybridpipe.allreduce`.

    Returns:
        A new tensor (same device) or array of shape ``(rows_r, *tensor.shape[1:])``.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops or names (on every rank).
        NotSupportedError: an op other than Sum and Average.
    """
    op, prescale, postscale, group = _prepare([tensor], op, name, prescale_factor, postscale_factor, process_set,
                                              group, "reducescatter")
    return context.call(group, "reducescatter", lambda: grouped_reducescatter_here(
        [tensor], op, name, prescale, postscale, group, "reducescatter")[0], "reducescatter")


def reducescatter_async(tensor: Any, name: str | None = None, op: Any = Average, process_set: Any = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        group: Any = None) -> context.Handle:
    """Queues :func:`reducescatter`; ``handle.wait()`` returns this rank's rows."""
    op, prescale, postscale, group = _prepare([tensor], op, name, prescale_factor, postscale_factor, process_set,
                                              group, "reducescatter_async", asynchronous=True)
    return context.submit(group, "reducescatter_async", name, lambda: grouped_reducescatter_here(
        [tensor], op, name, prescale, postscale, group, "reducescatter_async")[0], "reducescatter")


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None, op: Any = Average, process_set: Any = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0, group: Any = None) -> list:
    """:func:`reducescatter` of each tensor of a list, in one collective; returns a list in the order given."""
    tensors = list(tensors) if isinstance(tensors, (list, tuple)) else tensors
    op, prescale, postscale, group = _prepare(tensors, op, name, prescale_factor, postscale_factor, process_set,
                                              group, "grouped_reducescatter")
    return context.call(group, "grouped_reducescatter", lambda: grouped_reducescatter_here(
        tensors, op, name, prescale, postscale, group, "grouped_reducescatter"), "grouped_reducescatter")


def grouped_reducescatter_async(tensors: Sequence[Any], name: str | None = None, op: Any = Average,
                                process_set: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                group: Any = None) -> context.Handle:
    """Queues :func:`grouped_reducescatter`; ``handle.wait()`` returns the list."""
    tensors = list(tensors) if isinstance(tensors, (list, tuple)) else tensors
    op, prescale, postscale, group = _prepare(tensors, op, name, prescale_factor, postscale_factor, process_set,
                                              group, "grouped_reducescatter_async", asynchronous=True)
    return context.submit(group, "grouped_reducescatter_async", name, lambda: grouped_reducescatter_here(
        tensors, op, name, prescale, postscale, group, "grouped_reducescatter_async"), "grouped_reducescatter")


# ------------------------------------------------------------------ sparse allreduce


class SparseHandle:
    """The handle of :func:`sparse_allreduce_async`: two allgathers (indices, values) finished into one sparse
    tensor. ``wait()``, ``hp.synchronize(handle)`` and calling it, ``handle()`` (Horovod's sparse handle is a
    function), return it; ``poll()`` never blocks."""

    def __init__(self, indices: context.Handle, values: context.Handle, finish: Any, name: str) -> None:
        self._indices, self._values, self._finish, self.name = indices, values, finish, name
        self._result: Any = None
        self._done = False

    def poll(self) -> bool:
        return self._done or (self._indices.poll() and self._values.poll())

    def wait(self) -> Any:
        if not self._done:
            values = self._values.wait()
            indices = self._indices.wait()
            self._result, self._done = self._finish(indices, values), True
        return self._result

    def __call__(self) -> Any:
        """``wait()``: Horovod's ``sparse_allreduce_async`` returns a function that gives the result."""
        return self.wait()

    def __repr__(self) -> str:
        return f"<hp.SparseHandle {self.name!r} {'done' if self._done else 'in flight'}>"


def sparse_allreduce_async(tensor: Any, name: str | None = None, op: Any = Average, process_set: Any = None,
                           group: Any = None) -> SparseHandle:
    """Horovod's allreduce of a sparse COO tensor: every rank's indices and values are allgathered (two queued
    allgathers), so the result holds every rank's entries (duplicates summed when the tensor is coalesced)
    and, for ``op=hp.Average``, values divided by the group size.

    Args:
        tensor: a sparse COO torch tensor, the same dense shape on every rank (the number of entries may differ).
        name: matches the call across ranks (default: the next unnamed name, as for the other async calls).
        op: hp.Average (default) or hp.Sum.
        process_set, group: as in :func:`~hybridpipe.allreduce`.

    Returns:
        A handle; ``hp.synchronize(handle)``, ``handle.wait()`` or ``handle()`` return the sparse result.
    """
    function = "sparse_allreduce_async"
    with refusing(function, "allgather", group, process_set, name, asynchronous=True):
        check_name(name, function)
        op = reduce_op(op, function) if op is not None else Average
        if op not in (Sum, Average):
            raise NotSupportedError(f"hp.{function} reduces with op=hp.Sum or op=hp.Average (got hp.{op.name})")
        if not (is_tensor(tensor) and tensor.is_sparse):
            raise TypeError(f"hp.{function} takes a sparse COO torch tensor, got "
                            f"{type(tensor).__name__ if not is_tensor(tensor) else tensor.layout}")
        group = resolved(resolve_group(group, process_set, function), function)
        size = group.size
    if name is None:
        name = context.unnamed(function)
    indices = tensor._indices().transpose(0, 1).contiguous()  # gathered along the entries
    values = tensor._values().contiguous()
    indices_handle = allgather_async(indices, name=f"{name}.indices", group=group)
    values_handle = allgather_async(values, name=f"{name}.values", group=group)
    shape = tensor.shape

    def finish(all_indices: Any, all_values: Any) -> Any:
        if op == Average:
            all_values = all_values / size if all_values.is_floating_point() else all_values // size
        return buffers.torch_module().sparse_coo_tensor(all_indices.transpose(0, 1), all_values, shape,
                                                        check_invariants=False)

    return SparseHandle(indices_handle, values_handle, finish, name)

"""The reducescatter family (Horovod's ``reducescatter``, ``grouped_reducescatter`` and their
``*_async`` forms): the reduction over the group, of which each rank keeps its rows.

Rows are split as Horovod does: with ``d`` rows over ``n`` ranks, the first ``d % n`` ranks get ``d // n + 1``
rows, the others ``d // n``; float16 / bfloat16 are summed in float32 and rounded once; Average divides once at
the end (integers: truncating toward zero, like hp.allreduce). :func:`reducescatter` and
:func:`grouped_reducescatter` are differentiable (the gradient is the allgather of the gradient, times the group
size for op=Sum and times the factors, as in Horovod); the ``*_nograd`` forms are the same without autograd.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..errors import NotSupportedError
from .._ext import core
from ..comm import buffers, context
from ..comm.buffers import check_array, describe, host, is_tensor
from ..comm.context import check_name, refusing, resolve_group, resolved
from .allgather import allgather, grouped_allgather
from .common import (Average, Sum, agree, check_tensors, checking, compressor, contiguous, digest, empty_like_rows,
                     named, needs_grad, reduce_op, scale_factor, to_device_of)

__all__ = ["reducescatter", "grouped_reducescatter", "reducescatter_async", "grouped_reducescatter_async",
           "reducescatter_nograd", "grouped_reducescatter_nograd", "reducescatter_rows", "reducescatter_op",
           "grouped_reducescatter_here"]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, function: str, op: Any, name: Any, prescale: float, postscale: float, group: Any,
                *tensors: torch.Tensor) -> tuple:
        def work() -> tuple:
            results = grouped_reducescatter_here(tensors, op, name, prescale, postscale, group, function)
            return results, int(context.communicator(group, function).Get_size())

        results, size = context.call(group, function, work, function)
        ctx.factor = (size if op == Sum else 1) * prescale * postscale
        ctx.group, ctx.grouped = group, function == "grouped_reducescatter"
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        scaled = [grad * ctx.factor if ctx.factor != 1 else grad for grad in grads]
        if ctx.grouped:
            gathered = grouped_allgather(scaled, group=ctx.group)
        else:
            gathered = [allgather(scaled[0], group=ctx.group)]
        return (None, None, None, None, None, None, *gathered)


def _reducescatter(tensors: list, name: Any, compression: Any, op: Any, process_set: Any, prescale_factor: Any,
                   postscale_factor: Any, group: Any, function: str) -> list:
    with checking(function, tensors, name, group, process_set, compression) as checked:
        op = reducescatter_op(op, function)
        checked.scales(prescale_factor, postscale_factor)
    group, prescale, postscale = checked.group, checked.prescale, checked.postscale
    compression = compressor(compression)
    compressed = [compression.compress(t) for t in tensors]
    wires = [wire for wire, _ in compressed]
    if needs_grad(*wires):
        results = list(_Reducescatter.apply(function, op, name, prescale, postscale, group, *wires))
    elif len(wires) == 1 and function == "reducescatter":
        results = [reducescatter_nograd(wires[0], name=name, op=op, prescale_factor=prescale,
                                        postscale_factor=postscale, group=group)]
    else:
        results = grouped_reducescatter_nograd(wires, name=name, op=op, prescale_factor=prescale,
                                               postscale_factor=postscale, group=group)
    return [compression.decompress(t, c) for t, (_, c) in zip(results, compressed)]


def reducescatter(tensor: Any, name: str | None = None, compression: Any = None, op: Any = Average,
                  process_set: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  group: Any = None) -> Any:
    """Reduces ``tensor`` over the group and returns this rank's rows of the result; differentiable (the
    gradient is the allgather of the gradient, times the group size for op=Sum and times the factors,
    as in Horovod).

    With ``d = tensor.shape[0]`` rows over ``n`` ranks, the first ``d % n`` ranks get ``d // n + 1`` rows
    and the others ``d // n`` (Horovod's split), in rank order.

    Args:
        tensor: torch tensor or numpy array (float32/64, float16, bfloat16, int32, int64), the same shape
            and dtype on every rank.
        name: optional; checked to be the same on every rank.
        compression: None (default, as hp.Compression.none), hp.Compression.fp16 or bf16: the dtype on the wire.
        op: hp.Average (default, as in Horovod) or hp.Sum.
        process_set: a hp.ProcessSet (Horovod's spelling of ``group``).
        prescale_factor: multiplies the input before the reduction (on a copy).
        postscale_factor: multiplies the result.
        group: as in :func:`allreduce`.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops or names (on every rank).
        NotSupportedError: an op other than Sum and Average.
    """
    return _reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor, group,
                          "reducescatter")[0]


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None, compression: Any = None,
                          op: Any = Average, process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, group: Any = None) -> list:
    """:func:`reducescatter` of each tensor of a list, in one collective; differentiable likewise."""
    return _reducescatter(list(tensors), name, compression, op, process_set, prescale_factor, postscale_factor, group,
                          "grouped_reducescatter")


def reducescatter_nograd(tensor: Any, name: str | None = None, op: Any = Average, process_set: Any = None,
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


def grouped_reducescatter_nograd(tensors: Sequence[Any], name: str | None = None, op: Any = Average,
                                 process_set: Any = None, prescale_factor: float = 1.0,
                                 postscale_factor: float = 1.0, group: Any = None) -> list:
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


_FLOAT_CODES = (0, 1, 2, 3)  # float32, float64, float16, bfloat16: what the C++ reduce-scatter averages as torch does


def _reduce_scatter_one(work: Any, op: Any, comm: Any) -> Any:
    """This rank's rows of the reduction of ``work`` (a contiguous host tensor/array)."""
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    rows = reducescatter_rows(int(work.shape[0]), size)
    per_row = int(np.prod(tuple(work.shape[1:]), dtype=np.int64))
    code = buffers.dtype_code(work)
    if code in _FLOAT_CODES and contiguous(work):  # the C++ fast path: shared memory, ring or library
        mine = empty_like_rows(work, rows[rank])
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
        results.append(to_device_of(mine, original))
    return results

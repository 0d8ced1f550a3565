"""Horovod's out-of-place collectives as the package exports them: differentiable, with ``compression=``.

``hp.allreduce``, ``hp.grouped_allreduce``, ``hp.allgather``, ``hp.grouped_allgather``, ``hp.broadcast``,
``hp.alltoall``, ``hp.reducescatter`` and ``hp.grouped_reducescatter`` take Horovod's arguments (in
Horovod's order) and, for tensors that require gradients, are ``torch.autograd.Function``\\ s whose
backward is itself a collective. The gradients follow Horovod 0.28's torch definitions exactly,
scaling included:

* allreduce: the allreduce of the gradient with the same op, prescale and postscale factors;
* allgather: this rank's rows of the **average** over ranks of the gradient (Horovod averages here
  since 0.21.3);
* broadcast: the **average** over ranks of the gradient on the root, zero on the other ranks;
* alltoall: the gradient sent back with an alltoall whose splits are the received splits;
* reducescatter: the allgather of the gradient, multiplied by the group size for op=Sum and by the
  prescale and postscale factors.

Every rank must run the backward pass (the gradient's collective is a collective too). numpy arrays
and tensors that need no gradient go straight to :mod:`hybridpipe.comm`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..comm import collectives, context, exchange
from ..comm.collectives import Average, Sum, resolve_op, scale_factor
from ..comm.collectives import check_tensors
from ..comm.context import check_name, refusing, resolve_group, resolved
from .compression import Compression, wire_for

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter"]


def _needs_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _check_compression(compression: Any, function: str) -> None:
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"hp.{function}: compression must be hp.Compression.none / fp16 / bf16 (or an object with "
                        f"compress() and decompress()), got {compression!r}")


@dataclass
class _Checked:
    """A collective's arguments, checked: its group resolved once (what the layers below take as it is)."""

    function: str
    group: Any
    prescale: float = 1.0
    postscale: float = 1.0

    def scales(self, prescale_factor: Any, postscale_factor: Any) -> None:
        self.prescale = scale_factor(prescale_factor, "prescale_factor", self.function)
        self.postscale = scale_factor(postscale_factor, "postscale_factor", self.function)


@contextlib.contextmanager
def _checking(function: str, tensors: Sequence[Any], name: Any, group: Any, process_set: Any,
              compression: Any = None, then: Callable[[Any], None] | None = None) -> Iterator[_Checked]:
    """The checks every public collective makes, run as one rank-local step with the ``with`` body's own:
    its name and compression, the body (op, scale factors, root: they need no hp.init), then its group
    (resolved once) and tensors, then ``then(group)``. An error in any of them still takes this rank's place
    in the collective (context.refusing), so the other ranks fail too instead of waiting."""
    with refusing(function, function, group, process_set):
        check_name(name, function)
        if compression is not None:
            _check_compression(compression, function)
        checked = _Checked(function, None)
        yield checked
        checked.group = resolved(resolve_group(group, process_set, function), function)
        check_tensors(tensors, checked.group, function)
        if then is not None:
            then(checked.group)


def _checked_group(function: str, tensors: Sequence[Any], name: Any, group: Any, process_set: Any,
                   then: Callable[[Any], None] | None = None) -> Any:
    """:func:`_checking` for a collective without arguments of its own: the resolved group."""
    with _checking(function, tensors, name, group, process_set, then=then) as checked:
        pass
    return checked.group


def _compressed(compression: Any, tensors: Sequence[Any], op: Any) -> tuple[list, Any]:
    """What travels, ``[(tensor, ctx)]``, and the wire format of the ring: float32 tensors in host memory as they
    are (the ring converts each segment, compression.wire_for), the others through ``compression.compress``."""
    formats = [wire_for(compression, t, op) for t in tensors]
    compressed = [(t, None) if wire is not None else compression.compress(t) for t, wire in zip(tensors, formats)]
    return compressed, next((wire for wire in formats if wire is not None), None)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: Any, name: Any, prescale: float, postscale: float,
                group: Any, wire: Any) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale, ctx.group = op, prescale, postscale, group
        return collectives.allreduce(tensor, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                     group=group, wire=wire)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (allreduce(grad, op=ctx.op, prescale_factor=ctx.prescale, postscale_factor=ctx.postscale,
                          group=ctx.group), None, None, None, None, None, None)


def allreduce(tensor: Any, average: Any = None, name: str | None = None, compression: Any = Compression.none,
              op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
              group: Any = None) -> Any:
    """Reduces ``tensor`` over the ranks of the group and returns the result as a new tensor/array;
    differentiable (the gradient is the allreduce of the gradient with the same op and factors).

    Args:
        tensor: torch.Tensor (any device, contiguous or not) or numpy.ndarray of dtype float32,
            float64, float16, bfloat16, int32 or int64; the same shape and dtype on every rank.
        average: deprecated (Horovod's): True is op=hp.Average, False op=hp.Sum; warns. Giving it with
            ``op`` is a ValueError.
        name: optional; every rank must pass the same name (checked with the shape).
        compression: hp.Compression.none (default), fp16 or bf16: the dtype on the wire between hosts (their
            ``.forced``: between the ranks of one host too; see hp.Compression), or a Horovod-style compressor.
        op: hp.Average (default, like Horovod), hp.Sum, hp.Min, hp.Max, hp.Product or hp.Adasum (a power-of-two
            group).
        prescale_factor: multiplies the input before the reduction (on a copy).
        postscale_factor: multiplies the result.
        process_set: a hp.ProcessSet (Horovod's spelling of ``group``; default: every rank).
        group: None or "world" (all ranks), "data" (my stage's replicas), "pipe" (my pipeline), a
            hp.ProcessSet, or an mpi4py communicator.

    Returns:
        A new tensor (same device) or array with the reduced values.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops or names (on every rank).
        TypeError: not a tensor/array, or a dtype that cannot be reduced.
        ValueError: both ``average`` and ``op``, or both ``group`` and ``process_set``.
    """
    with _checking("allreduce", [tensor], name, group, process_set, compression) as checked:
        op = resolve_op(op, average, "allreduce")
        checked.scales(prescale_factor, postscale_factor)
    group, prescale, postscale = checked.group, checked.prescale, checked.postscale
    [(wire, compression_ctx)], wire_format = _compressed(compression, [tensor], op)
    if _needs_grad(wire):
        reduced = _Allreduce.apply(wire, op, name, prescale, postscale, group, wire_format)
    else:
        reduced = collectives.allreduce(wire, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                        group=group, wire=wire_format)
    return compression.decompress(reduced, compression_ctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: Any, name: Any, prescale: float, postscale: float, group: Any, wire: Any,
                *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.prescale, ctx.postscale, ctx.group = op, prescale, postscale, group
        return tuple(collectives.grouped_allreduce(list(tensors), name=name, op=op, prescale_factor=prescale,
                                                   postscale_factor=postscale, group=group, wire=wire))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.prescale,
                                    postscale_factor=ctx.postscale, group=ctx.group)
        return (None, None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[Any], average: Any = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None, group: Any = None) -> list:
    """Allreduces many tensors at once through the fusion buffer; returns new tensors/arrays, in order.
    Differentiable, like :func:`allreduce`.

    Tensors are packed into buckets of ``fusion_threshold_bytes`` (HYBRIDPIPE_FUSION_THRESHOLD) and
    each bucket is one ring allreduce, so many small gradients cost a few large messages.

    Args:
        tensors: a list of torch tensors / numpy arrays; every rank passes the same shapes and dtypes
            in the same order (dtypes may be mixed).
        average, name, compression, op, prescale_factor, postscale_factor, process_set, group: as in
            :func:`allreduce`.

    Raises:
        MismatchError: the lists differ between ranks (on every rank).
    """
    with _checking("grouped_allreduce", tensors, name, group, process_set, compression) as checked:
        op = resolve_op(op, average, "grouped_allreduce")
        checked.scales(prescale_factor, postscale_factor)
    group, prescale, postscale = checked.group, checked.prescale, checked.postscale
    compressed, wire_format = _compressed(compression, tensors, op)
    wires = [wire for wire, _ in compressed]
    if _needs_grad(*wires):
        reduced = list(_GroupedAllreduce.apply(op, name, prescale, postscale, group, wire_format, *wires))
    else:
        reduced = collectives.grouped_allreduce(wires, name=name, op=op, prescale_factor=prescale,
                                                postscale_factor=postscale, group=group, wire=wire_format)
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, compressed)]


def _call(group: Any, function: str, work: Any, collective: str) -> Any:
    return context.call(group, function, work, collective)


def _rank_in(group: Any, function: str) -> int:
    """This rank's number in ``group`` (call on the communication thread, inside a collective's work)."""
    return int(context.communicator(group, function).Get_rank())


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, group: Any) -> torch.Tensor:
        def work() -> tuple:
            result, rows = exchange.allgather_here(tensor, name, group, "allgather")
            return result, rows, _rank_in(group, "allgather")

        result, ctx.rows, ctx.index = _call(group, "allgather", work, "allgather")
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
    if not _needs_grad(tensor):  # the plain collective (which checks its arguments itself)
        return exchange.allgather(tensor, name=name, process_set=process_set, group=group)
    return _Allgather.apply(tensor, name, _checked_group("allgather", [tensor], name, group, process_set))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, group: Any, *tensors: torch.Tensor) -> tuple:
        def work() -> tuple:
            results, rows = exchange.grouped_allgather_here(tensors, name, group, "grouped_allgather")
            return results, rows, _rank_in(group, "grouped_allgather")

        results, ctx.rows, ctx.index = _call(group, "grouped_allgather", work, "grouped_allgather")
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
    group = _checked_group("grouped_allgather", tensors, name, group, process_set)
    tensors = list(tensors)
    if _needs_grad(*tensors):
        return list(_GroupedAllgather.apply(name, group, *tensors))
    return exchange.grouped_allgather(tensors, name=name, group=group)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, group: Any) -> torch.Tensor:
        def work() -> tuple:
            result = collectives.broadcast_here(tensor, root_rank, name, group, "broadcast", in_place=False)
            ranks = context.current("broadcast").set_ranks(group, "broadcast")
            me = _rank_in(group, "broadcast")
            return result, (ranks[me] if ranks is not None else me) == root_rank

        result, ctx.is_root = _call(group, "broadcast", work, "broadcast")
        ctx.group = group
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = allreduce(grad, op=Average, group=ctx.group)
        return (averaged if ctx.is_root else averaged * 0), None, None, None


def broadcast(tensor: Any, root_rank: int, name: str | None = None, process_set: Any = None, group: Any = None) -> Any:
    """Returns a new tensor/array holding root_rank's ``tensor``; differentiable (the gradient is the
    average over ranks of the gradient on the root, zero elsewhere, as in Horovod).

    Args:
        tensor: a torch tensor or numpy array (any dtype), the same shape and dtype on every rank.
        root_rank: the rank whose values everyone gets: a rank of ``group`` (its own numbering), or, with a
            hp.ProcessSet, a global rank (``hp.rank()``), as in Horovod.
        name: optional; checked to be the same on every rank.
        process_set, group: as in :func:`allreduce`.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, roots or names (on every rank).
        ValueError: root_rank is outside the group.
    """
    if not _needs_grad(tensor):  # the plain collective (which checks its arguments itself)
        return collectives.broadcast(tensor, root_rank, name=name, process_set=process_set, group=group)
    with _checking("broadcast", [tensor], name, group, process_set) as checked:
        collectives.check_root(root_rank, "broadcast")
    return _Broadcast.apply(tensor, root_rank, name, checked.group)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, group: Any) -> Any:
        output, received = _call(group, "alltoall", lambda: exchange.alltoall_here(tensor, splits, name, group,
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
    if not _needs_grad(tensor):  # the plain collective (which checks its arguments itself)
        return exchange.alltoall(tensor, splits=splits, name=name, process_set=process_set, group=group)
    group = _checked_group("alltoall", [tensor], name, group, process_set,
                           then=lambda checked: exchange.check_splits(tensor, splits, checked, "alltoall"))
    return _Alltoall.apply(tensor, splits, name, group)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, function: str, op: Any, name: Any, prescale: float, postscale: float, group: Any,
                *tensors: torch.Tensor) -> tuple:
        def work() -> tuple:
            results = exchange.grouped_reducescatter_here(tensors, op, name, prescale, postscale, group, function)
            return results, int(context.communicator(group, function).Get_size())

        results, size = _call(group, function, work, function)
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
    with _checking(function, tensors, name, group, process_set, compression) as checked:
        op = exchange.reducescatter_op(op, function)
        checked.scales(prescale_factor, postscale_factor)
    group, prescale, postscale = checked.group, checked.prescale, checked.postscale
    compressed = [compression.compress(t) for t in tensors]
    wires = [wire for wire, _ in compressed]
    if _needs_grad(*wires):
        results = list(_Reducescatter.apply(function, op, name, prescale, postscale, group, *wires))
    elif len(wires) == 1 and function == "reducescatter":
        results = [exchange.reducescatter(wires[0], name=name, op=op, prescale_factor=prescale,
                                          postscale_factor=postscale, group=group)]
    else:
        results = exchange.grouped_reducescatter(wires, name=name, op=op, prescale_factor=prescale,
                                                 postscale_factor=postscale, group=group)
    return [compression.decompress(t, c) for t, (_, c) in zip(results, compressed)]


def reducescatter(tensor: Any, name: str | None = None, compression: Any = Compression.none, op: Any = Average,
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
        compression: hp.Compression.none (default), fp16 or bf16: the dtype on the wire.
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


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None, compression: Any = Compression.none,
                          op: Any = Average, process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, group: Any = None) -> list:
    """:func:`reducescatter` of each tensor of a list, in one collective; differentiable likewise."""
    return _reducescatter(list(tensors), name, compression, op, process_set, prescale_factor, postscale_factor, group,
                          "grouped_reducescatter")

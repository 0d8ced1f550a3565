"""Collectives on torch tensors and numpy arrays: allreduce (ring, fused), broadcast, barrier, with
Horovod's keywords (``name``, ``average``, ``op``, ``prescale_factor``, ``postscale_factor``,
``process_set``) and the ``*_async`` forms of broadcast; the header agreement every collective starts
with. (Allgather, alltoall and reducescatter live in hybridpipe.comm.exchange.)

Before moving data, the ranks of a collective agree on a small header (count, dtype, op, shape and
name digest) with one tiny MPI_Allreduce (max of the values and of their negatives). A disagreement —
different shapes, dtypes, ops, names, tensor lists, or a rank passing something unsupported — raises
MismatchError on every rank with every rank's values, instead of a hang or a truncation. The data
then moves through the C++ core (allreduce with Sum, Average, Min, Max) or through the MPI library
(Product, broadcast). Tensors on a GPU are staged through host memory for now.

Every call runs on the communication thread (``context.call``; the ``*_async`` forms through
``context.submit``, which returns a Handle at once). These functions are not differentiable; the
package's top-level ``hp.allreduce`` & co. (hybridpipe.differentiable) wrap them for autograd.
"""

from __future__ import annotations

import enum
import sys
import warnings
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from .._ext import core
from ..errors import MismatchError, NotSupportedError
from . import buffers, context
from .buffers import check_array, copy_into, describe, host, is_tensor
from .context import check_name, refusing, resolve_group

__all__ = ["ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum", "allreduce", "allreduce_",
           "grouped_allreduce", "grouped_allreduce_", "broadcast", "broadcast_", "broadcast_async",
           "broadcast_async_", "barrier", "agree", "digest", "named", "reduce_op", "resolve_op", "scale_factor",
           "check_tensors", "check_root"]


class ReduceOp(enum.IntEnum):
    """Reduction of an allreduce. Average divides the sum by the group size (integers: truncating).

    Sum, Average, Min and Max run in hybridpipe's C++ core (ring, shared memory, hierarchical); Product
    runs in the MPI library (``MPI_PROD``; float16 / bfloat16 multiplied in float32 and rounded once).
    Adasum is Horovod's adaptive summation (hybridpipe.comm.adasum; CPU, power-of-two groups), run on
    the communication thread outside the C++ core.
    """

    Sum = 0
    Average = 1
    Min = 2
    Max = 3
    Product = 4
    Adasum = 5


Sum, Average, Min, Max, Product, Adasum = (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max,
                                           ReduceOp.Product, ReduceOp.Adasum)
CORE_OPS = (Sum, Average, Min, Max)  # what the C++ core and the engine reduce with

_SAME_TENSOR = "every rank must pass the same shape, dtype and op"


def wait_policy(config: Any = None) -> Any:
    """The polite wait of ``config`` (default: the one in force; ``HYBRIDPIPE_WAIT_SPIN_US`` /
    ``HYBRIDPIPE_WAIT_SLEEP_US``) for the background engine and direct collectives while tensors are
    in flight on the engine."""
    return context.wait_policy(context.current("wait_policy").config if config is None else config)


def digest(text: str) -> int:
    """A 31-bit digest of ``text`` for a header field (names, shape and dtype descriptions)."""
    return zlib.crc32(text.encode())


def list_ranks(descriptions: list) -> str:
    """``rank 0: …; rank 1: …`` for a mismatch message."""
    return "; ".join(f"rank {r}: {d}" for r, d in enumerate(descriptions))


def named(name: str | None) -> str:
    """`` name='...'`` for a description, or nothing when there is no name."""
    return "" if name is None else f" name={name!r}"


def agree(comm: Any, function: str, fields: Sequence[int], description: Callable[[], Any], fix: str,
          explain: Callable[[list], str] = list_ranks) -> None:
    """Raises MismatchError on every rank unless all ranks of ``comm`` passed the same ``fields``.

    The common case costs one MPI_Allreduce of 2·len(fields) integers (in C++); only on a mismatch
    are the ranks' ``description()`` values gathered and turned into a message by ``explain``.
    """
    if not core().headers_agree(comm.py2f(), list(fields), context.current(function).allreduce_options().wait):
        _mismatch(comm, function, description, fix, explain)


def _mismatch(comm: Any, function: str, description: Callable[[], Any], fix: str,
              explain: Callable[[list], str] = list_ranks) -> None:
    raise MismatchError(f"hp.{function}: ranks disagree ({explain(comm.allgather(description()))}); {fix}")


def reduce_op(op: Any, function: str) -> ReduceOp:
    """``op`` as a ReduceOp; TypeError naming it otherwise."""
    try:
        return ReduceOp(op)
    except ValueError:
        raise TypeError(f"hp.{function}: op must be hp.Sum, hp.Average, hp.Min or hp.Max, got {op!r} (or hp.Product; "
                        "see hp.ReduceOp)") from None


def _caller_level() -> int:
    """The warnings stacklevel of the first frame outside hybridpipe (the user's call), so that Python's
    default filters show a DeprecationWarning raised for code in ``__main__``."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("hybridpipe"):
        frame, level = frame.f_back, level + 1
    return level


def resolve_op(op: Any, average: Any, function: str) -> ReduceOp:
    """The op of a call from Horovod's ``op=`` and deprecated ``average=`` (None/None: Average).

    A ReduceOp in ``average``'s place is taken as ``op``: hybridpipe's earlier signature had ``op`` second.
    """
    if isinstance(average, ReduceOp) and op is None:
        return average
    if average is not None:
        if op is not None:
            raise ValueError(f"hp.{function}: op= supersedes the deprecated average=; pass only one of them "
                             f"(got average={average!r}, op={op!r})")
        warnings.warn(f"hp.{function}: average= is deprecated (as in Horovod); pass op=hp.Average or op=hp.Sum",
                      DeprecationWarning, stacklevel=_caller_level())
        return Average if average else Sum
    return Average if op is None else reduce_op(op, function)


def scale_factor(value: Any, keyword: str, function: str) -> float:
    """``prescale_factor`` / ``postscale_factor`` as a float; TypeError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"hp.{function}: {keyword} must be a number, got {value!r}")
    return float(value)


def check_tensors(tensors: Any, group: Any, function: str) -> list:
    """The rank-local checks of a collective's tensors and group (run inside :func:`context.refusing`):
    each is a torch tensor or numpy array, and this rank can use ``group``; returns the tensors as a list."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"hp.{function} takes a list or tuple of tensors, got {type(tensors).__name__}")
    for t in tensors:
        check_array(t, function)
    context.current(function).check_group(group, function)
    return list(tensors)


def _unsupported_op(op: ReduceOp, function: str) -> NotSupportedError:
    return NotSupportedError(f"hp.{function}: op=hp.{op.name} cannot be reduced here; use op=hp.Average, hp.Sum, "
                             "hp.Min, hp.Max, hp.Product or hp.Adasum")


def _library_reduce(source: Any, target: Any, op: ReduceOp, comm: Any, function: str) -> None:
    """Reduces through the MPI library (ops the C++ core has not: Product); halves in float32."""
    from mpi4py import MPI

    if op == Adasum:
        from .adasum import adasum_into

        adasum_into(source, target, comm, function)
        return
    if op != Product:
        raise _unsupported_op(op, function)
    if buffers.dtype_code(source) in (2, 3):  # float16, bfloat16: no MPI type; one rounding at the end
        wide = source.float() if is_tensor(source) else source.astype(np.float32)
        comm.Allreduce(MPI.IN_PLACE, buffers.numpy_view(wide), op=MPI.PROD)
        copy_into(target, wide.to(target.dtype) if is_tensor(wide) else wide.astype(target.dtype))
    elif source is target:
        comm.Allreduce(MPI.IN_PLACE, buffers.numpy_view(target), op=MPI.PROD)
    else:
        comm.Allreduce(buffers.numpy_view(source), buffers.numpy_view(target), op=MPI.PROD)


def _allreduce_into(source: Any, target: Any, op: ReduceOp, comm: Any, function: str, name: str | None = None,
                    device: str = "") -> None:
    code = buffers.dtype_code(source)
    count = buffers.count(source)
    header = [1, count, code, int(op),
              digest(str(tuple(source.shape)) + device + ("" if name is None else f"|{name}"))]

    def description() -> str:
        return f"{describe(source)}{device} op={op.name}{named(name)}"

    if code == buffers.UNSUPPORTED or op not in CORE_OPS:  # agree first: a bad value on one rank must not hang
        agree(comm, function, header, description, _SAME_TENSOR)
        buffers.check_reducible([code], [source], function)
        _library_reduce(source, target, op, comm, function)
        return
    if not core().allreduce(buffers.address(source), buffers.address(target), count, code, int(op), comm.py2f(),
                            context.current(function).allreduce_options(), header):
        _mismatch(comm, function, description, _SAME_TENSOR)


def _on_engine(group: Any, function: str, work: Callable[[], Any], collective: str) -> Any:
    """Runs a blocking collective on the engine's communication thread (see context.call)."""
    return context.call(group, function, work, collective)


def allreduce_here(tensor: Any, op: ReduceOp, name: str | None, prescale: float, postscale: float, group: Any,
                   function: str, in_place: bool) -> Any:
    """One allreduce, run on the communication thread: the body of allreduce / allreduce_ and of the
    asynchronous ones the engine cannot run itself (Product)."""
    check_array(tensor, function)
    comm = context.communicator(group, function)
    source = host(tensor)
    target = source if in_place else buffers.clone(source)
    if prescale != 1.0:
        source = target  # scale a copy (or the in-place work), never the caller's input
        buffers.scale_(target, prescale)
    _allreduce_into(source, target, op, comm, function, name, buffers.device_tag(tensor))
    buffers.scale_(target, postscale)
    if in_place:
        copy_into(tensor, target)
        return tensor
    return target.to(tensor.device) if is_tensor(tensor) and tensor.device.type != "cpu" else target


def allreduce(tensor: Any, average: Any = None, name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None, group: Any = None) -> Any:
    """Reduces ``tensor`` over the ranks of ``group`` and returns the result as a new tensor/array.

    Args:
        tensor: torch.Tensor (any device, contiguous or not) or numpy.ndarray of dtype float32,
            float64, float16, bfloat16, int32 or int64; the same shape and dtype on every rank.
        average: deprecated (Horovod's): True is op=hp.Average, False op=hp.Sum; warns.
        name: optional; every rank must pass the same name (it is checked with the shape).
        op: hp.Average (default, like Horovod), hp.Sum, hp.Min, hp.Max or hp.Product.
        prescale_factor: multiplies the input before the reduction (on a copy).
        postscale_factor: multiplies the result.
        process_set: a hp.ProcessSet (Horovod's spelling of ``group``).
        group: None or "world" (all ranks), "data" (my stage's replicas), "pipe" (my pipeline), a
            hp.ProcessSet, or an mpi4py communicator.

    Returns:
        A new tensor (same device) or array with the reduced values.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops or names (on every rank).
        TypeError: not a tensor/array, or a dtype that cannot be reduced.
        ValueError: both ``average`` and ``op``, or both ``group`` and ``process_set``.
        ValueError: op=hp.Adasum over a group whose size is not a power of two.
    """
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group, "allreduce",
                      False)


def allreduce_(tensor: Any, average: Any = None, name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = None, group: Any = None) -> Any:
    """In-place :func:`allreduce`: ``tensor`` holds the result afterwards and is returned."""
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group, "allreduce_",
                      True)


def _allreduce(tensor: Any, average: Any, name: str | None, op: Any, prescale: Any, postscale: Any, process_set: Any,
               group: Any, function: str, in_place: bool) -> Any:
    with refusing(function, "allreduce", group, process_set):
        op = resolve_op(op, average, function)
        check_name(name, function)
        prescale = scale_factor(prescale, "prescale_factor", function)
        postscale = scale_factor(postscale, "postscale_factor", function)
        group = resolve_group(group, process_set, function)
        check_tensors([tensor], group, function)
        buffers.check_reducible([buffers.dtype_code(tensor)], [tensor], function)
    try:
        return _on_engine(group, function, lambda: allreduce_here(tensor, op, name, prescale, postscale, group,
                                                                  function, in_place), "allreduce")
    except context.RanksJoined:
        if op not in CORE_OPS:
            raise
        from .engine import allreduce_while_joined

        return allreduce_while_joined([tensor], in_place, op, prescale, postscale, group, function)[0]


def grouped_allreduce_here(tensors: Sequence[Any], op: ReduceOp, name: str | None, prescale: float, postscale: float,
                           group: Any, function: str, in_place: bool) -> list:
    """A grouped allreduce, run on the communication thread (sync and async forms)."""
    tensors = list(tensors)
    for t in tensors:
        check_array(t, function)
    ctx = context.current(function)
    comm = ctx.communicator(group, function)
    works = [host(t) for t in tensors]
    targets = works if in_place else [buffers.clone(w) for w in works]
    if prescale != 1.0:
        works = targets
        for target in targets:
            buffers.scale_(target, prescale)
    codes = [buffers.dtype_code(w) for w in works]
    entries = [describe(t) for t in tensors]
    agree(comm, function, [2, len(tensors), digest("|".join(entries) + named(name)), int(op)],
           lambda: (op.name + named(name), entries),
           "every rank must pass the same list of tensors (same order, shapes and dtypes), op and name", _explain_lists)
    buffers.check_reducible(codes, works, function)
    if op in CORE_OPS:
        order = sorted(range(len(works)), key=lambda i: codes[i])  # stable: one dtype's buckets in list order
        counts = [buffers.count(works[i]) for i in order]
        core().grouped_allreduce([buffers.address(works[i]) for i in order],
                                 [buffers.address(targets[i]) for i in order], counts, [codes[i] for i in order],
                                 int(op), comm.py2f(), ctx.config.fusion_threshold_bytes, ctx.allreduce_options())
    else:
        for work, target in zip(works, targets):
            _library_reduce(work, target, op, comm, function)
    results = []
    for original, target in zip(tensors, targets):
        buffers.scale_(target, postscale)
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
        return list_ranks([f"op={op}" for op in ops])
    lengths = [len(entries) for _, entries in everyone]
    for index in range(max(lengths)):
        at = [entries[index] if index < len(entries) else "(no tensor)" for _, entries in everyone]
        if len(set(at)) > 1:
            return f"tensor {index}: " + list_ranks(at) + " | list lengths: " + list_ranks(lengths)
    return list_ranks(lengths)


def _grouped(tensors: Sequence[Any], average: Any, name: str | None, op: Any, prescale: Any, postscale: Any,
             process_set: Any, group: Any, function: str, in_place: bool) -> list:
    with refusing(function, "grouped_allreduce", group, process_set):
        op = resolve_op(op, average, function)
        check_name(name, function)
        prescale = scale_factor(prescale, "prescale_factor", function)
        postscale = scale_factor(postscale, "postscale_factor", function)
        group = resolve_group(group, process_set, function)
        tensors = check_tensors(tensors, group, function)
        buffers.check_reducible([buffers.dtype_code(t) for t in tensors], tensors, function)
    try:
        return _on_engine(group, function, lambda: grouped_allreduce_here(tensors, op, name, prescale, postscale,
                                                                          group, function, in_place), "grouped_allreduce")
    except context.RanksJoined:
        if op not in CORE_OPS:
            raise
        from .engine import allreduce_while_joined

        return allreduce_while_joined(tensors, in_place, op, prescale, postscale, group, function)


def grouped_allreduce(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                      group: Any = None) -> list:
    """Allreduces many tensors at once through the fusion buffer; returns new tensors/arrays.

    Tensors are packed into buckets of ``fusion_threshold_bytes`` (HYBRIDPIPE_FUSION_THRESHOLD) and
    each bucket is one ring allreduce, so many small gradients cost a few large messages.

    Args:
        tensors: a list of torch tensors / numpy arrays; every rank passes the same shapes and dtypes
            in the same order (dtypes may be mixed).
        average, name, op, prescale_factor, postscale_factor, process_set, group: as in :func:`allreduce`.

    Returns:
        A list of new tensors/arrays, in the order given.

    Raises:
        MismatchError: the lists differ between ranks (on every rank).
    """
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                    "grouped_allreduce", in_place=False)


def grouped_allreduce_(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                       group: Any = None) -> list:
    """In-place :func:`grouped_allreduce`; returns the same tensors."""
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                    "grouped_allreduce_", in_place=True)


# ------------------------------------------------------------------ broadcast


def broadcast_here(tensor: Any, root_rank: int, name: str | None, group: Any, function: str, in_place: bool) -> Any:
    """One broadcast on the communication thread (sync and async forms)."""
    check_array(tensor, function)
    ctx = context.current(function)
    comm = ctx.communicator(group, function)
    set_ranks = ctx.set_ranks(group, function)
    work = host(tensor) if in_place else buffers.clone(host(tensor))
    agree(comm, function, [3, int(root_rank), digest(describe(tensor) + named(name))],
           lambda: f"root_rank={root_rank} {describe(tensor)}{named(name)}",
           "every rank must pass the same root_rank, shape, dtype and name")
    if set_ranks is not None:
        if root_rank not in set_ranks:
            raise ValueError(f"hp.{function}: root_rank {root_rank} is not in the process set (ranks {set_ranks}); "
                             "with a process set, root_rank is a global rank (hp.rank()), as in Horovod")
        root = set_ranks.index(root_rank)
    else:
        root = int(root_rank)
        if not 0 <= root < comm.Get_size():
            raise ValueError(f"hp.broadcast: root_rank {root_rank} is not a rank of a group of {comm.Get_size()} "
                             f"(use 0..{comm.Get_size() - 1})")
    from mpi4py import MPI

    comm.Bcast([buffers.byte_view(work), MPI.BYTE], root=root)
    if in_place:
        copy_into(tensor, work)
        return tensor
    return work.to(tensor.device) if is_tensor(tensor) and tensor.device.type != "cpu" else work


def _broadcast_call(tensor: Any, root_rank: int, name: str | None, process_set: Any, group: Any, function: str,
                    in_place: bool, asynchronous: bool) -> Any:
    with refusing(function, "broadcast", group, process_set, name, asynchronous):
        check_name(name, function)
        group = resolve_group(group, process_set, function)
        check_tensors([tensor], group, function)
        root_rank = check_root(root_rank, function)

    def work() -> Any:
        return broadcast_here(tensor, root_rank, name, group, function, in_place)

    if asynchronous:
        return context.submit(group, function, name, work, "broadcast")
    return _on_engine(group, function, work, "broadcast")


def broadcast_(tensor: Any, root_rank: int, name: str | None = None, process_set: Any = None,
               group: Any = None) -> Any:
    """Overwrites ``tensor`` on every rank of ``group`` with root_rank's values; returns it.

    Any dtype is accepted (the bytes are moved).

    Args:
        tensor: a torch tensor or numpy array, the same shape and dtype on every rank.
        root_rank: the rank whose values everyone gets: a rank of ``group`` (its own numbering), or, with a
            hp.ProcessSet, a global rank (``hp.rank()``), as in Horovod.
        name: optional; checked to be the same on every rank.
        process_set: a hp.ProcessSet (Horovod's spelling of ``group``).
        group: as in :func:`allreduce`.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, roots or names (on every rank).
        ValueError: root_rank is outside the group.
    """
    return _broadcast_call(tensor, root_rank, name, process_set, group, "broadcast_", True, False)


def broadcast(tensor: Any, root_rank: int, name: str | None = None, process_set: Any = None, group: Any = None) -> Any:
    """Returns a new tensor/array holding root_rank's ``tensor`` (see :func:`broadcast_`)."""
    return _broadcast_call(tensor, root_rank, name, process_set, group, "broadcast", False, False)


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None, process_set: Any = None,
                    group: Any = None) -> context.Handle:
    """Queues :func:`broadcast`; ``handle.wait()`` returns the new tensor. Ranks match it by ``name``
    (default: a per-process counter, as for :func:`allreduce_async`)."""
    return _broadcast_call(tensor, root_rank, name, process_set, group, "broadcast_async", False, True)


def broadcast_async_(tensor: Any, root_rank: int, name: str | None = None, process_set: Any = None,
                     group: Any = None) -> context.Handle:
    """Queues :func:`broadcast_`; ``handle.wait()`` returns ``tensor``, overwritten. Leave ``tensor``
    alone until then."""
    return _broadcast_call(tensor, root_rank, name, process_set, group, "broadcast_async_", True, True)


def check_root(root_rank: Any, function: str) -> int:
    """``root_rank`` as an int; TypeError naming it otherwise."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"hp.{function}: root_rank must be an int (a rank), got {root_rank!r}")
    return int(root_rank)


def barrier(process_set: Any = None, group: Any = None) -> None:
    """Blocks until every rank of the group (or process set) has called barrier."""
    with refusing("barrier", "barrier", group, process_set):
        group = resolve_group(group, process_set, "barrier")
        context.current("barrier").check_group(group, "barrier")
    _on_engine(group, "barrier", lambda: context.communicator(group, "barrier").Barrier(), "barrier")

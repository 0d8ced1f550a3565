"""Asynchronous allreduce through the background engine (Horovod's ``allreduce_async``).

``hp.allreduce_async_(tensor, name=…)`` queues the tensor and returns a :class:`Handle` at once;
a background C++ thread (``csrc/engine.cpp``) agrees with the other ranks of the group on which
named tensors are ready everywhere, packs them into fusion buckets and reduces them with the ring
allreduce, while Python goes on computing. ``handle.wait()`` (or ``hp.synchronize(handle)``)
returns the reduced tensor; ``hp.poll(handle)`` tells whether it is done.

Tensors may become ready in different orders on different ranks: names, not call order, match
them. Every rank must eventually submit every name; a name some ranks never submit is reported
after ``stall_check_seconds`` on stderr, naming the ranks that did and did not submit it.

The engine starts in ``hp.init`` and serves the groups "world", "data" and "pipe"; an mpi4py
communicator or process set passed as ``group`` is registered on first use (collectively: every rank
of it must make its first async call with it). An op the engine does not reduce with (Product) and
the grouped calls run as one queued collective on the same thread instead of fused buckets.
"""

from __future__ import annotations

from typing import Any, Sequence

from . import buffers, context
from .collectives import CORE_OPS, allreduce_here, grouped_allreduce_here, resolve_op, scale_factor
from .context import Handle, call, check_name, resolve_group, unnamed

__all__ = ["Handle", "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "synchronize", "poll", "engine_stats", "call"]


def _submit(tensor: Any, average: Any, name: str | None, op: Any, prescale: Any, postscale: Any, process_set: Any,
            group: Any, function: str, in_place: bool) -> Handle:
    buffers.check_array(tensor, function)
    state = context.current(function)
    op = resolve_op(op, average, function)
    check_name(name, function)
    prescale = scale_factor(prescale, "prescale_factor", function)
    postscale = scale_factor(postscale, "postscale_factor", function)
    group = resolve_group(group, process_set, function)
    if op not in CORE_OPS:  # Product (MPI library) and Adasum (refused after the ranks agreed): one queued call
        return context.submit(group, function, name, lambda: allreduce_here(tensor, op, name, prescale, postscale,
                                                                            group, function, in_place), "allreduce")
    group_id = state.engine_group(group, function)
    if name is None:
        name = unnamed(function)
    result = tensor if in_place else buffers.clone(tensor)
    work = buffers.host(result)
    code = buffers.dtype_code(work)
    buffers.check_reducible([code], [work], function)
    buffers.scale_(work, prescale)

    def finish() -> Any:
        buffers.scale_(work, postscale)
        buffers.copy_into(result, work)
        return result

    return context.queue(state, group_id, name, function,
                         lambda: state.engine.submit(group_id, name, buffers.address(work), buffers.count(work), code,
                                                     int(op)), (result, work), finish)


def allreduce_async_(tensor: Any, average: Any = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                     group: Any = None) -> Handle:
    """Queues an in-place allreduce of ``tensor``; ``handle.wait()`` returns ``tensor`` reduced.

    Do not read or write ``tensor`` until the handle is done.

    Args:
        tensor: torch.Tensor or numpy.ndarray (float32/64, float16, bfloat16, int32, int64).
        average: deprecated (Horovod's): True is op=hp.Average, False op=hp.Sum; warns.
        name: identifies the tensor across ranks (default: ``"allreduce_async_.noname.<n>"``, the n-th
            unnamed call of this process — deterministic when every rank makes the same calls).
        op: hp.Average (default), hp.Sum, hp.Min, hp.Max, hp.Product.
        prescale_factor: multiplies the tensor before the reduction.
        postscale_factor: multiplies the result.
        process_set: a hp.ProcessSet (Horovod's spelling of ``group``).
        group: None/"world", "data", "pipe", a hp.ProcessSet or an mpi4py communicator.
    """
    return _submit(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group,
                   "allreduce_async_", in_place=True)


def allreduce_async(tensor: Any, average: Any = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                    group: Any = None) -> Handle:
    """Like :func:`allreduce_async_` but reduces a copy: ``tensor`` is left as it is."""
    return _submit(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group,
                   "allreduce_async", in_place=False)


def _grouped_submit(tensors: Sequence[Any], average: Any, name: str | None, op: Any, prescale: Any, postscale: Any,
                    process_set: Any, group: Any, function: str, in_place: bool) -> Handle:
    op = resolve_op(op, average, function)
    check_name(name, function)
    prescale = scale_factor(prescale, "prescale_factor", function)
    postscale = scale_factor(postscale, "postscale_factor", function)
    group = resolve_group(group, process_set, function)
    tensors = list(tensors)
    return context.submit(group, function, name, lambda: grouped_allreduce_here(
        tensors, op, name, prescale, postscale, group, function, in_place), "grouped_allreduce")


def grouped_allreduce_async(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                            group: Any = None) -> Handle:
    """Queues :func:`~hybridpipe.grouped_allreduce` (fused, as one collective); ``handle.wait()`` returns
    the list of new tensors. Ranks match it by ``name`` and must pass the same list."""
    return _grouped_submit(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                           "grouped_allreduce_async", in_place=False)


def grouped_allreduce_async_(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                             group: Any = None) -> Handle:
    """In-place :func:`grouped_allreduce_async`: ``handle.wait()`` returns the same tensors, reduced."""
    return _grouped_submit(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                           "grouped_allreduce_async_", in_place=True)


def synchronize(handle: Handle) -> Any:
    """``handle.wait()``, Horovod's spelling: the result of any ``*_async`` call."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """``handle.poll()``, Horovod's spelling."""
    return handle.poll()


def engine_stats(group: Any = "data") -> dict[str, int]:
    """Counters of the engine for ``group``: cycles (negotiations), slow_rounds (name gathers),
    tensors, buckets (allreduce calls), shared_memory (of those, buckets reduced through the group's
    shared-memory segment, when its ranks share a host), helped (buckets run by a thread blocked in
    wait(), not the engine thread), bytes, stall_warnings."""
    state = context.current("engine_stats")
    stats = state.engine.stats(state.engine_group(group, "engine_stats"))
    return {name: getattr(stats, name) for name in
            ("cycles", "slow_rounds", "tensors", "buckets", "shared_memory", "helped", "bytes", "stall_warnings")}

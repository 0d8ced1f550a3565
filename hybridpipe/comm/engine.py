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

import os
from typing import Any, Callable, Sequence

from .. import _trace
from .._ext import core
from . import buffers, context, staging
from .reduction import (CORE_OPS, Average, allreduce_here, check_tensors, grouped_allreduce_here, resolve_op,
                        scale_factor)
from .context import Handle, call, check_name, refusing, resolve_group, resolved, unnamed

__all__ = ["Handle", "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "synchronize", "poll", "engine_stats", "call", "join", "allreduce_while_joined", "start_timeline",
           "stop_timeline", "world_barrier"]


def _submit(tensor: Any, average: Any, name: str | None, op: Any, prescale: Any, postscale: Any, process_set: Any,
            group: Any, function: str, in_place: bool, wire: Any = None) -> Handle:
    state = context.current(function)
    with refusing(function, "allreduce", group, process_set, name, asynchronous=True):
        op = resolve_op(op, average, function)
        check_name(name, function)
        prescale = scale_factor(prescale, "prescale_factor", function)
        postscale = scale_factor(postscale, "postscale_factor", function)
        group = resolve_group(group, process_set, function)
        check_tensors([tensor], group, function)
        group = resolved(group, function)
        if op in CORE_OPS:
            buffers.check_reducible([buffers.dtype_code(tensor)], [tensor], function)
    if op not in CORE_OPS:  # Product (MPI library) and Adasum (hybridpipe.comm.adasum): one queued call
        return context.submit(group, function, name, lambda: allreduce_here(tensor, op, name, prescale, postscale,
                                                                            group, function, in_place, None, wire),
                              "allreduce")
    group_id = state.engine_group(group, function)
    if name is None:
        name = unnamed(function)
    source: Any = None  # out of place: the engine reads `source` and writes `work`, a fresh output
    ready: Any = None  # a CUDA tensor's producer (or copy to the host), still running: the engine waits for it
    back: Any = None  # a CUDA tensor reduced in a contiguous copy of itself: copied back into it at the end
    on_device = buffers.device_code(tensor) == 1 and _device_fusion()
    if on_device:
        result, work, source, back, ready = _on_device(tensor, in_place, prescale)
    elif buffers.device_code(tensor) == 1:
        result, work, ready = _stage_down(tensor, in_place, prescale)
    elif not in_place and prescale == 1.0 and buffers.is_host_contiguous(tensor):
        source = tensor.detach() if buffers.is_tensor(tensor) else tensor
        result = work = state.outputs.take(source)
    else:
        result = tensor if in_place else buffers.clone(tensor)
        work = buffers.host(result)
        buffers.scale_(work, prescale)
    code = buffers.dtype_code(work)
    wire_format = core().WireFormat() if wire is None else wire.format()

    submitted: list[Handle] = []

    def finish() -> Any:
        contributors = submitted[0].contributors
        if contributors and op == Average:  # ranks had joined (zeros from them): the engine summed
            buffers.divide_(work, contributors if state.config.join_average == "contributors"
                            else state.group_size(group, function))
        buffers.scale_(work, postscale)
        if on_device:  # the engine wrote `work` on the GPU and synchronized before it completed the handle
            if back is not None:
                import torch

                back.copy_(work)
                work.record_stream(torch.cuda.current_stream(work.device))  # freed only after that copy
            return result
        if ready is not None:  # back up on the waiting thread's stream; the pinned block stays ours until then
            result.detach().copy_(work, non_blocking=True)
        else:
            buffers.copy_into(result, work)
        if source is not None:
            state.outputs.offer(result)
        return result

    def submit() -> int:
        if source is None:
            return state.engine.submit(group_id, name, buffers.address(work), buffers.count(work), code, int(op),
                                       buffers.device_code(tensor), 0, 0 if ready is None else ready.cuda_event,
                                       wire_format)
        return state.engine.submit(group_id, name, buffers.address(source), buffers.count(work), code, int(op),
                                   buffers.device_code(tensor), buffers.address(work),
                                   0 if ready is None else ready.cuda_event, wire_format)

    submitted.append(context.queue(state, group_id, name, function, submit, (result, work, source, ready), finish))
    return submitted[0]


def _device_fusion() -> bool:
    """Whether the engine packs CUDA tensors on the GPU: the extension was built with its CUDA kernels
    (csrc/cuda/fusion.cu). Without them each CUDA tensor is copied to pinned host memory on its own."""
    from .. import _ext

    return bool(_ext.cuda_compiled())


def _on_device(tensor: Any, in_place: bool, prescale: float) -> tuple[Any, Any, Any, Any, Any]:
    """A CUDA tensor's engine allreduce where the engine packs on the GPU: ``(result, work, source, back,
    ready)``. The engine reads ``source`` (None: ``work``) and writes ``work``, device memory both; the bucket
    it joins is gathered into one fusion buffer by one kernel, reduced through pinned host memory and scattered
    back by one kernel (csrc/cuda/fusion.cu), with no copy of its own per tensor. ``ready`` is an event recorded
    on the caller's stream after the work queued so far (and the prescaling): the engine announces the tensor
    once it has completed. ``back``: the caller's tensor when it is reduced in place through a contiguous copy
    (non-contiguous, or prescaled), which finish() copies back."""
    import torch

    from . import device

    device.note_staged(tensor)
    value = tensor.detach()
    source = back = None
    if prescale != 1.0 or not value.is_contiguous():
        work = value.clone(memory_format=torch.contiguous_format)  # never scale the caller's input
        buffers.scale_(work, prescale)
        if in_place:
            back = value
        result = tensor if in_place else work
    elif in_place:
        result, work = tensor, value  # the caller's own tensor object back, as on every other route
    else:
        source, work = value, torch.empty_like(value)
        result = work
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensor.device))
    return result, work, source, back, ready


def _stage_down(tensor: Any, in_place: bool, prescale: float) -> tuple[Any, Any, Any]:
    """A CUDA tensor's engine allreduce: ``(result, work, ready)``. ``work`` is pinned host memory that a copy on
    the device's side stream fills after the work queued so far on the caller's stream (prescaled there);
    ``ready`` is the event recorded after that copy, which the engine polls before announcing the tensor, so
    that neither this thread nor the engine's waits for the copy (Horovod's ready events). The result goes back
    up on the stream of the thread that waits for the handle."""
    import torch

    from . import device

    device.note_staged(tensor)
    caller = torch.cuda.current_stream(tensor.device)
    value = tensor.detach()
    result = tensor if in_place else torch.empty_like(value)
    if prescale != 1.0:
        value = value.clone()
        buffers.scale_(value, prescale)
    work = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    down, _ = staging.copy_streams(tensor.device)
    with torch.cuda.stream(down):
        down.wait_stream(caller)
        work.copy_(value, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(down)
    value.record_stream(down)  # the caching allocator keeps its memory until the copy has read it
    return result, work, ready


def allreduce_async_(tensor: Any, average: Any = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                     group: Any = None, *, wire: Any = None) -> Handle:
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
        wire: None, or what a float32 tensor in host memory travels as (a reduction.Wire, which
            hp.Compression.fp16 / bf16 make); every rank must pass the same under one name.
    """
    return _submit(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group,
                   "allreduce_async_", in_place=True, wire=wire)


def allreduce_async(tensor: Any, average: Any = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                    group: Any = None, *, wire: Any = None) -> Handle:
    """Like :func:`allreduce_async_` but reduces a copy: ``tensor`` is left as it is."""
    return _submit(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group,
                   "allreduce_async", in_place=False, wire=wire)


def _grouped_submit(tensors: Sequence[Any], average: Any, name: str | None, op: Any, prescale: Any, postscale: Any,
                    process_set: Any, group: Any, function: str, in_place: bool, wire: Any = None) -> Handle:
    with refusing(function, "grouped_allreduce", group, process_set, name, asynchronous=True):
        op = resolve_op(op, average, function)
        check_name(name, function)
        prescale = scale_factor(prescale, "prescale_factor", function)
        postscale = scale_factor(postscale, "postscale_factor", function)
        group = resolve_group(group, process_set, function)
        tensors = check_tensors(tensors, group, function)
        group = resolved(group, function)
    ready = staging.ready_event(tensors[0]) if tensors else None
    return context.submit(group, function, name, lambda: grouped_allreduce_here(
        tensors, op, name, prescale, postscale, group, function, in_place, ready, wire), "grouped_allreduce")


def grouped_allreduce_async(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                            group: Any = None, *, wire: Any = None) -> Handle:
    """Queues :func:`~hybridpipe.grouped_allreduce` (fused, as one collective); ``handle.wait()`` returns
    the list of new tensors. Ranks match it by ``name`` and must pass the same list (and ``wire``, as in
    :func:`allreduce_async_`)."""
    return _grouped_submit(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                           "grouped_allreduce_async", in_place=False, wire=wire)


def grouped_allreduce_async_(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                             group: Any = None, *, wire: Any = None) -> Handle:
    """In-place :func:`grouped_allreduce_async`: ``handle.wait()`` returns the same tensors, reduced."""
    return _grouped_submit(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                           "grouped_allreduce_async_", in_place=True, wire=wire)


def join(device: int = -1, process_set: Any = None, group: Any = None) -> int:
    """Horovod's join: this rank has run out of data. Blocks until every rank of the group has joined; until
    then this rank takes part in the others' allreduces (``hp.allreduce``, ``hp.allreduce_async`` & co.,
    ``hp.DistributedOptimizer``'s) with zeros, and an ``hp.Average`` among them divides by the group's size, as
    Horovod does (with ``HYBRIDPIPE_JOIN_AVERAGE=contributors``: by the ranks that contributed). Other
    collectives raise on the ranks that did not join meanwhile.

    Args:
        device: accepted for Horovod's signature (-1: any); tensors are reduced in host memory.
        process_set, group: the ranks that join (default: every rank, in the whole job's group and in the grid's
            "data" and "pipe" groups, where hp.DistributedOptimizer reduces by default).

    Returns:
        The rank that joined last (a global rank for a process set, else a rank of the group).
    """
    function = "join"
    with refusing(function, "join", group, process_set, asynchronous=True, name="hybridpipe.join"):
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"hp.join: device must be an int (-1: any), got {device!r}")
        group = resolve_group(group, process_set, function)
        context.current(function).check_group(group, function)
    state = context.current(function)
    group_id = state.engine_group(group, function)
    # the whole job joins its grid groups too: hp.DistributedOptimizer reduces over "data" by default
    ids = [group_id] + ([state.engine_group(label, function) for label in ("data", "pipe")] if group is None else [])
    handles = [context.queue(state, gid, "hybridpipe.join", function,
                             lambda gid=gid: state.engine.submit_join(gid), None, lambda: None)
               for gid in dict.fromkeys(ids)]
    for handle in handles:
        handle.wait()
    last = state.engine.last_joined(group_id)
    set_ranks = state.set_ranks(group, function)
    if last < 0:  # a group of one rank: it joined last
        last = state.communicator(group, function).Get_rank()
    return set_ranks[last] if set_ranks is not None else last


def allreduce_while_joined(tensors: list, in_place: bool, op: Any, prescale: float, postscale: float,
                           group: Any, function: str) -> list:
    """A synchronous allreduce that met ranks in hp.join: run on the engine, where they contribute zeros.
    Every rank that did not join gets here at the same point, so a per-group counter names it alike."""
    state = context.current(function)
    group_id = state.engine_group(group, function)
    index = state.joined_calls.get(group_id, 0)
    state.joined_calls[group_id] = index + 1
    submit = allreduce_async_ if in_place else allreduce_async
    handles = [submit(t, name=f"hybridpipe.joined.{index}.{i}", op=op, prescale_factor=prescale,
                      postscale_factor=postscale, group=group) for i, t in enumerate(tensors)]
    return [handle.wait() for handle in handles]


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
    wait(), not the engine thread), bytes, stall_warnings, cuda_buckets (buckets holding CUDA tensors, packed
    on the GPU), cuda_launches (the kernels and copies those took: at most two each way per bucket and GPU) and
    cuda_aware_buckets (of the CUDA buckets, those reduced in device memory: a CUDA-aware MPI)."""
    state = context.current("engine_stats")
    stats = state.engine.stats(state.engine_group(group, "engine_stats"))
    return {name: getattr(stats, name) for name in
            ("cycles", "slow_rounds", "tensors", "buckets", "shared_memory", "helped", "bytes", "stall_warnings",
             "cuda_buckets", "cuda_launches", "cuda_aware_buckets")}


def world_barrier(grid: Any) -> Callable[[], None]:
    """A barrier of every rank of ``grid``, run on the engine's communication thread (the timeline's common
    points in time)."""
    return lambda: call(None, "timeline", grid.world_comm.Barrier)


def start_timeline(file_path: str | os.PathLike, mark_cycles: bool = False) -> None:
    """Starts recording this job's Chrome trace into ``file_path`` (Horovod's ``hvd.start_timeline``).

    Collective: every rank calls it with the same path. The trace is the one ``HYBRIDPIPE_TIMELINE``
    writes (docs/timeline.md): pipeline actions, optimizer steps, every collective's run on the
    communication thread, and the engine's phases when ``HYBRIDPIPE_TIMELINE`` was set at ``hp.init``
    (the engine records them only then). A timeline already recording is stopped (written) first.

    Args:
        file_path: where rank 0 writes the merged trace at :func:`stop_timeline` (or ``hp.shutdown``).
        mark_cycles: accepted for Horovod's signature; the engine's "negotiate" events already mark its
            cycles when it records.

    Raises:
        NotInitializedError: before ``hp.init()``.
    """
    state = context.current("start_timeline")
    if _trace.enabled():
        stop_timeline()
    _trace.start(state, os.fspath(file_path), world_barrier(state.grid))


def stop_timeline() -> None:
    """Stops the timeline and writes it (collective; nothing happens when none is recording)."""
    state = context.current("stop_timeline")
    if _trace.enabled():
        _trace.stop(state, state.events(), world_barrier(state.grid))

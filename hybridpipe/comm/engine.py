"""What runs on the background engine beside the collectives (hybridpipe.collectives): Horovod's ``join``,
``synchronize`` and ``poll`` of any ``*_async`` call's :class:`Handle`, the engine's counters, blocking calls on
its thread (:func:`call`) and the timeline.

The engine (``csrc/engine.h``) starts in ``hp.init`` and serves the groups "world", "data" and "pipe"; an mpi4py
communicator or process set passed as ``group`` is registered on first use (collectively: every rank of it must
make its first async call with it).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from .. import _trace
from . import context
from .context import Handle, call, refusing, resolve_group

__all__ = ["Handle", "synchronize", "poll", "engine_stats", "call", "join", "start_timeline", "stop_timeline",
           "world_barrier"]


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

"""Collectives on torch tensors and numpy arrays: allreduce (ring, fused), broadcast, barrier, with
Horovod's keywords (``name``, ``average``, ``op``, ``prescale_factor``, ``postscale_factor``,
``process_set``) and the ``*_async`` forms of broadcast; the header agreement every collective starts
with. (Allgather, alltoall and reducescatter live in hybridpipe.comm.exchange.)

Before moving data, the ranks of a collective agree on a small header (hybridpipe.comm.reduction, where the
reductions themselves and the ops live: this module and the engine both run them). A broadcast moves its bytes
through the MPI library.

While ranks have joined (hp.join), a blocking allreduce runs through the engine instead, where they contribute
zeros (engine.allreduce_while_joined).

Every call runs on the communication thread (``context.call``; the ``*_async`` forms through
``context.submit``, which returns a Handle at once). These functions are not differentiable; the
package's top-level ``hp.allreduce`` & co. (hybridpipe.data_parallel.differentiable) wrap them for autograd.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from . import buffers, context, device, staging
from .buffers import check_array, copy_into, describe, host, is_tensor
from .context import check_name, refusing, resolve_group, resolved
from .engine import allreduce_while_joined
from .reduction import (CORE_OPS, Adasum, Average, Max, Min, Product, ReduceOp, Sum, agree, allreduce_here,
                        check_tensors, device_buffer, digest, grouped_allreduce_here, named,
                        reduce_op, resolve_op, scale_factor)

__all__ = ["ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum", "allreduce", "allreduce_",
           "grouped_allreduce", "grouped_allreduce_", "broadcast", "broadcast_", "broadcast_async",
           "broadcast_async_", "barrier", "agree", "digest", "named", "reduce_op", "resolve_op", "scale_factor",
           "check_tensors", "check_root", "CORE_OPS"]


def _cuda_broadcast(tensor: Any, root: int, comm: Any, in_place: bool, ready: Any, segment_bytes: int) -> Any:
    """Broadcast of a CUDA tensor: MPI_Bcast of its device memory on the cuda-aware route; on the staged route
    the root copies its segments down (and nothing back), the others copy theirs up (and nothing down),
    double-buffered as in reduction._cuda_allreduce."""
    import torch
    from mpi4py import MPI

    stream = torch.cuda.current_stream(tensor.device)
    if ready is not None:
        stream.wait_event(ready)
    source = tensor.detach().resolve_conj().resolve_neg()
    dense = source if source.is_contiguous() else source.contiguous()
    am_root = comm.Get_rank() == root
    if am_root:
        target = None
        result = tensor if in_place else dense.clone()
    else:
        target = dense if in_place else torch.empty_like(dense)
        result = tensor if in_place else target

    def transfer(_: int, segment: Any) -> None:
        comm.Bcast([buffers.byte_view(segment), MPI.BYTE], root=root)

    mark = torch.cuda.Event()
    mark.record(stream)
    if device.route(dense) == "cuda-aware":
        mark.synchronize()  # MPI knows no streams
        comm.Bcast(device_buffer(dense if am_root else target), root=root)
    else:
        staging.run(dense, target, transfer, ready=mark, segment_bytes=segment_bytes, fetch=am_root)
    if in_place and not am_root and dense.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(dense)  # a non-contiguous tensor: the received values go back into its layout
    stream.synchronize()
    return result


def _on_engine(group: Any, function: str, work: Callable[[], Any], collective: str) -> Any:
    """Runs a blocking collective on the engine's communication thread (see context.call)."""
    return context.call(group, function, work, collective)


def allreduce(tensor: Any, average: Any = None, name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None, group: Any = None, *, wire: Any = None) -> Any:
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
        wire: None, or what a float32 tensor in host memory travels as (a reduction.Wire, which hp.Compression.fp16
            / bf16 make); every rank must pass the same.

    Returns:
        A new tensor (same device) or array with the reduced values.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops, names or wires (on every rank).
        TypeError: not a tensor/array, or a dtype that cannot be reduced.
        ValueError: both ``average`` and ``op``, or both ``group`` and ``process_set``.
        ValueError: op=hp.Adasum over a group whose size is not a power of two.
    """
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group, "allreduce",
                      False, wire)


def allreduce_(tensor: Any, average: Any = None, name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = None, group: Any = None) -> Any:
    """In-place :func:`allreduce`: ``tensor`` holds the result afterwards and is returned."""
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group, "allreduce_",
                      True)


def _allreduce(tensor: Any, average: Any, name: str | None, op: Any, prescale: Any, postscale: Any, process_set: Any,
               group: Any, function: str, in_place: bool, wire: Any = None) -> Any:
    with refusing(function, "allreduce", group, process_set):
        op = resolve_op(op, average, function)
        check_name(name, function)
        prescale = scale_factor(prescale, "prescale_factor", function)
        postscale = scale_factor(postscale, "postscale_factor", function)
        group = resolve_group(group, process_set, function)
        check_tensors([tensor], group, function)
        group = resolved(group, function)
        buffers.check_reducible([buffers.dtype_code(tensor)], [tensor], function)
    ready = staging.ready_event(tensor)  # a CUDA tensor is read once what this thread queued has written it
    # out of place in host memory: an output the caller let go of, whose pages are mapped already (a fresh one's
    # first touch costs the ring time between its MPI calls)
    outputs = context.current(function).outputs
    reuse = not in_place and prescale == 1.0 and buffers.is_host_contiguous(tensor)
    output = outputs.take(tensor.detach() if buffers.is_tensor(tensor) else tensor) if reuse else None
    try:
        result = _on_engine(group, function, lambda: allreduce_here(tensor, op, name, prescale, postscale, group,
                                                                    function, in_place, ready, wire, output),
                            "allreduce")
    except context.RanksJoined:
        if op not in CORE_OPS:
            raise
        return allreduce_while_joined([tensor], in_place, op, prescale, postscale, group, function)[0]
    if output is not None and result is output:
        outputs.offer(result)
    return result


def _grouped(tensors: Sequence[Any], average: Any, name: str | None, op: Any, prescale: Any, postscale: Any,
             process_set: Any, group: Any, function: str, in_place: bool, wire: Any = None) -> list:
    with refusing(function, "grouped_allreduce", group, process_set):
        op = resolve_op(op, average, function)
        check_name(name, function)
        prescale = scale_factor(prescale, "prescale_factor", function)
        postscale = scale_factor(postscale, "postscale_factor", function)
        group = resolve_group(group, process_set, function)
        tensors = check_tensors(tensors, group, function)
        group = resolved(group, function)
        buffers.check_reducible([buffers.dtype_code(t) for t in tensors], tensors, function)
    ready = staging.ready_event(tensors[0]) if tensors else None
    try:
        return _on_engine(group, function, lambda: grouped_allreduce_here(tensors, op, name, prescale, postscale,
                                                                          group, function, in_place, ready, wire),
                          "grouped_allreduce")
    except context.RanksJoined:
        if op not in CORE_OPS:
            raise
        return allreduce_while_joined(tensors, in_place, op, prescale, postscale, group, function)


def grouped_allreduce(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                      group: Any = None, *, wire: Any = None) -> list:
    """Allreduces many tensors at once through the fusion buffer; returns new tensors/arrays.

    Tensors are packed into buckets of ``fusion_threshold_bytes`` (HYBRIDPIPE_FUSION_THRESHOLD) and
    each bucket is one ring allreduce, so many small gradients cost a few large messages.

    Args:
        tensors: a list of torch tensors / numpy arrays; every rank passes the same shapes and dtypes
            in the same order (dtypes may be mixed).
        average, name, op, prescale_factor, postscale_factor, process_set, group, wire: as in :func:`allreduce`
            (``wire`` applies to the float32 tensors in host memory).

    Returns:
        A list of new tensors/arrays, in the order given.

    Raises:
        MismatchError: the lists differ between ranks (on every rank).
    """
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                    "grouped_allreduce", in_place=False, wire=wire)


def grouped_allreduce_(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                       group: Any = None) -> list:
    """In-place :func:`grouped_allreduce`; returns the same tensors."""
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                    "grouped_allreduce_", in_place=True)


# ------------------------------------------------------------------ broadcast


def broadcast_here(tensor: Any, root_rank: int, name: str | None, group: Any, function: str, in_place: bool,
                   ready: Any = None) -> Any:
    """One broadcast on the communication thread (sync and async forms). ``ready``: see allreduce_here."""
    check_array(tensor, function)
    ctx = context.current(function)
    comm = ctx.communicator(group, function)
    set_ranks = ctx.set_ranks(group, function)
    staged = device.route(tensor) != "host"
    work = None if staged else host(tensor) if in_place else buffers.clone(host(tensor))
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

    if staged:
        return _cuda_broadcast(tensor, root, comm, in_place, ready, ctx.config.staging_segment_bytes)
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
        group = resolved(group, function)
        root_rank = check_root(root_rank, function)

    ready = staging.ready_event(tensor)

    def work() -> Any:
        return broadcast_here(tensor, root_rank, name, group, function, in_place, ready)

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
        group = resolved(group, "barrier")
    _on_engine(group, "barrier", lambda: context.communicator(group, "barrier").Barrier(), "barrier")

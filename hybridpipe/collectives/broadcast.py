"""The broadcast family (Horovod's ``broadcast``, ``broadcast_``, ``broadcast_async``, ``broadcast_async_``,
``broadcast_object``): root_rank's tensor (or picklable object) on every rank of the group.

:func:`broadcast` is differentiable (the gradient is the average over ranks of the gradient on the root, zero on
the other ranks, as in Horovod); :func:`broadcast_nograd` is the same without autograd. The bytes move through the
MPI library (CUDA tensors: in device memory on a CUDA-aware MPI, else staged through pinned host memory).
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import buffers, context, device, staging
from ..comm.buffers import check_array, copy_into, describe, host, is_tensor
from ..comm.context import check_name, refusing, resolve_group, resolved
from ..comm.reduction import device_buffer
from .allreduce import allreduce
from .common import (Average, agree, agreed_kind, check_root, check_tensors, checking, digest, named, needs_grad,
                     rank_in, root_index, target)

__all__ = ["broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_nograd",
           "broadcast_here", "broadcast_object"]


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, group: Any) -> torch.Tensor:
        def work() -> tuple:
            result = broadcast_here(tensor, root_rank, name, group, "broadcast", in_place=False)
            ranks = context.current("broadcast").set_ranks(group, "broadcast")
            me = rank_in(group, "broadcast")
            return result, (ranks[me] if ranks is not None else me) == root_rank

        result, ctx.is_root = context.call(group, "broadcast", work, "broadcast")
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
    if not needs_grad(tensor):  # the plain collective (which checks its arguments itself)
        return broadcast_nograd(tensor, root_rank, name=name, process_set=process_set, group=group)
    with checking("broadcast", [tensor], name, group, process_set) as checked:
        check_root(root_rank, "broadcast")
    return _Broadcast.apply(tensor, root_rank, name, checked.group)


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


def broadcast_nograd(tensor: Any, root_rank: int, name: str | None = None, process_set: Any = None,
                     group: Any = None) -> Any:
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
    return context.call(group, function, work, "broadcast")


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


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None,
                     group: Any = None) -> Any:
    """Returns ``root_rank``'s ``obj`` (pickled) on every rank of the group (default ``"data"``; with
    ``process_set``, ``root_rank`` is a global rank, as in Horovod). ``name`` is checked across ranks."""
    with context.refusing("broadcast_object", "broadcast_object", group, process_set):
        context.check_name(name, "broadcast_object")
        resolved = target(group, process_set, "broadcast_object")
        root = root_index(resolved, root_rank, "broadcast_object")
    return context.call(resolved, "broadcast_object",
                        lambda: context.communicator(resolved, "broadcast_object").bcast(obj, root=root),
                        agreed_kind("broadcast_object", name))

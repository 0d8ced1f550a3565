"""Horovod's ``sparse_allreduce_async``: the allreduce of a sparse COO tensor, made of two allgathers
(its indices and its values), so that the result holds every rank's entries.
"""

from __future__ import annotations

from typing import Any

from ..errors import NotSupportedError
from ..comm import buffers, context
from ..comm.buffers import is_tensor
from ..comm.context import check_name, refusing, resolve_group, resolved
from .allgather import allgather_async
from .common import Average, Sum, reduce_op

__all__ = ["SparseHandle", "sparse_allreduce_async"]


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

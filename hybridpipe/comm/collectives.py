"""Collectives on torch tensors and numpy arrays: allreduce (ring, fused), broadcast, allgather, barrier.

Before moving data, the ranks of a collective agree on a small header (count, dtype, op, shape
digest) with one tiny MPI_Allreduce (max of the values and of their negatives). A disagreement —
different shapes, dtypes, ops, tensor lists, or a rank passing something unsupported — raises
MismatchError on every rank with every rank's values, instead of a hang or a truncation. The
data then moves through the C++ core (allreduce) or through the MPI library (broadcast, allgather).
Tensors on a GPU are staged through host memory for now.
"""

from __future__ import annotations

import enum
import functools
import sys
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from .. import runtime
from .._ext import core
from ..errors import MismatchError

__all__ = ["ReduceOp", "Sum", "Average", "Min", "Max", "allreduce", "allreduce_", "grouped_allreduce",
           "grouped_allreduce_", "broadcast", "broadcast_", "allgather", "barrier"]


class ReduceOp(enum.IntEnum):
    """Reduction of an allreduce. Average divides the sum by the group size (integers: truncating)."""

    Sum = 0
    Average = 1
    Min = 2
    Max = 3


Sum, Average, Min, Max = ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max

_NUMPY_CODES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2,
                np.dtype(np.int32): 4, np.dtype(np.int64): 5}
_REDUCIBLE = "float32, float64, float16, bfloat16, int32, int64"
_UNSUPPORTED = -1
_SAME_TENSOR = "every rank must pass the same shape, dtype and op"
_user_groups: dict[int, tuple[Any, Any]] = {}
_options: Any = None
_polite_options: Any = None


def _torch() -> Any:
    import torch

    return torch


@functools.lru_cache(maxsize=None)
def _torch_codes() -> dict:
    torch = _torch()
    return {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.int32: 4,
            torch.int64: 5}


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # torch is imported by whoever made a tensor; never import it here
    return torch is not None and isinstance(x, torch.Tensor)


def _check_array(x: Any, function: str) -> None:
    if not (_is_tensor(x) or isinstance(x, np.ndarray)):
        raise TypeError(f"hp.{function} takes a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def _host(x: Any) -> Any:
    """A contiguous host-memory view of x, or a copy when x is on a GPU or not contiguous."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    x = x.detach()
    return x.cpu().contiguous() if x.device.type != "cpu" else x.contiguous()


def _address(x: Any) -> int:
    return x.data_ptr() if _is_tensor(x) else x.ctypes.data


def _dtype_code(x: Any) -> int:
    codes = _torch_codes() if _is_tensor(x) else _NUMPY_CODES
    return codes.get(x.dtype, _UNSUPPORTED)


def _byte_view(x: Any) -> np.ndarray:
    """The raw bytes of a contiguous host tensor/array as a uint8 numpy array (no copy)."""
    if _is_tensor(x):
        return x.reshape(-1).view(_torch().uint8).numpy()
    return x.reshape(-1).view(np.uint8)


def _copy_into(destination: Any, source: Any) -> None:
    if destination is source:
        return
    if _is_tensor(destination):
        if destination.device == source.device and destination.data_ptr() == source.data_ptr() \
                and destination.is_contiguous():
            return  # the in-place work was the tensor itself (a detached view of the same memory)
        destination.copy_(source)
    else:
        destination[...] = source


def _describe(x: Any) -> str:
    return f"shape={tuple(x.shape)} dtype={str(x.dtype).replace('torch.', '')}"


def _digest(text: str) -> int:
    return zlib.crc32(text.encode())


def _communicator(group: Any, function: str) -> Any:
    """The hybridpipe-private communicator for ``group``: None/"world", "data", "pipe" or an mpi4py comm."""
    state = runtime._require(function)
    if group is None or (isinstance(group, str) and group == "world"):
        return state.grid.world_comm
    if isinstance(group, str):
        if group == "data":
            return state.grid.data_comm
        if group == "pipe":
            return state.grid.pipe_comm
        raise ValueError(f"hp.{function}: unknown group {group!r} (use None/'world', 'data', 'pipe' or an "
                         f"mpi4py communicator)")
    from mpi4py import MPI

    if not isinstance(group, MPI.Intracomm):
        raise TypeError(f"hp.{function}: group must be None, 'world', 'data', 'pipe' or an mpi4py "
                        f"intracommunicator, got {type(group).__name__}")
    key = id(group)
    if key not in _user_groups or _user_groups[key][0] is not group:
        private = group.Dup()  # collective on `group`; our tags never meet the user's messages
        private.Set_errhandler(MPI.ERRORS_RETURN)
        _user_groups[key] = (group, private)
    return _user_groups[key][1]


def _forget_groups() -> None:
    """Called by hp.shutdown(): frees duplicates of user communicators."""
    global _options, _polite_options
    for _, private in _user_groups.values():
        private.Free()
    _user_groups.clear()
    _options = _polite_options = None


def _new_allreduce_options(config: Any, wait: Any = None) -> Any:
    """The C++ AllreduceOptions for ``config``; ``wait``: a WaitPolicy (default: MPI's own wait)."""
    options = core().AllreduceOptions()
    options.segment_bytes = config.segment_bytes
    options.receive_window = config.receive_window
    options.small_message_bytes = config.small_message_bytes
    options.unfused_bytes = config.unfused_bytes
    options.shared_memory = config.shared_memory
    options.shared_memory_chunk_bytes = config.shared_memory_chunk_bytes
    options.hierarchical = {"auto": -1, "1": 1, "0": 0}[config.hierarchical]
    if wait is not None:
        options.wait = wait
    return options


def _allreduce_options() -> Any:
    """Options of direct collectives: spinning waits, or polite ones while this process has
    tensors in flight on the background engine, so that a blocking call made beside the (niced)
    engine threads does not spin them off the cores (docs/sharp_bits.md).

    Both make the same MPI calls (nonblocking ones, tested), because whether a rank has tensors in
    flight is its own state: a blocking MPI_Allreduce on one rank does not match an MPI_Iallreduce
    on another. Only with HYBRIDPIPE_WAIT_SPIN_US=-1 (MPI's own waits everywhere) are they blocking.
    """
    global _options, _polite_options
    if _options is None:
        config = runtime.config()
        polite = wait_policy(config)
        _options = _new_allreduce_options(config, core().spinning_wait(polite))
        _polite_options = _new_allreduce_options(config, polite)
    from . import engine  # imports this module

    return _polite_options if engine._busy() else _options


def wait_policy(config: Any = None) -> Any:
    """The polite wait of ``config`` (default: the one in force; ``HYBRIDPIPE_WAIT_SPIN_US`` /
    ``HYBRIDPIPE_WAIT_SLEEP_US``) for pipeline transfers, the background engine, and direct
    collectives while tensors are in flight on the engine."""
    config = runtime.config() if config is None else config
    return core().WaitPolicy(config.wait_spin_us, config.wait_sleep_us)


def _list_ranks(descriptions: list) -> str:
    return "; ".join(f"rank {r}: {d}" for r, d in enumerate(descriptions))


def _agree(comm: Any, function: str, fields: Sequence[int], description: Callable[[], Any], fix: str,
           explain: Callable[[list], str] = _list_ranks) -> None:
    """Raises MismatchError on every rank unless all ranks of ``comm`` passed the same ``fields``.

    The common case costs one MPI_Allreduce of 2·len(fields) integers (in C++); only on a mismatch
    are the ranks' ``description()`` values gathered and turned into a message by ``explain``.
    """
    if not core().headers_agree(comm.py2f(), list(fields), _allreduce_options().wait):
        _mismatch(comm, function, description, fix, explain)


def _mismatch(comm: Any, function: str, description: Callable[[], Any], fix: str,
              explain: Callable[[list], str] = _list_ranks) -> None:
    raise MismatchError(f"hp.{function}: ranks disagree ({explain(comm.allgather(description()))}); {fix}")


def _reduce_op(op: Any, function: str) -> ReduceOp:
    try:
        return ReduceOp(op)
    except ValueError:
        raise TypeError(f"hp.{function}: op must be hp.Sum, hp.Average, hp.Min or hp.Max, got {op!r}") from None


def _check_reducible(codes: Sequence[int], arrays: Sequence[Any], function: str) -> None:
    for code, x in zip(codes, arrays):
        if code == _UNSUPPORTED:
            raise TypeError(f"hp.{function}: dtype {x.dtype} cannot be reduced (use one of {_REDUCIBLE})")


def _allreduce_into(source: Any, target: Any, op: ReduceOp, comm: Any, function: str) -> None:
    code = _dtype_code(source)
    count = source.size if isinstance(source, np.ndarray) else source.numel()
    header = [1, count, code, int(op), _digest(str(tuple(source.shape)))]
    if code == _UNSUPPORTED:  # still agree first: a bad dtype on one rank must not hang the others
        _agree(comm, function, header, lambda: f"{_describe(source)} op={op.name}", _SAME_TENSOR)
        _check_reducible([code], [source], function)
    if not core().allreduce(_address(source), _address(target), count, code, int(op), comm.py2f(),
                            _allreduce_options(), header):
        _mismatch(comm, function, lambda: f"{_describe(source)} op={op.name}", _SAME_TENSOR)


def allreduce(tensor: Any, op: ReduceOp = Average, group: Any = None) -> Any:
    """Reduces ``tensor`` over the ranks of ``group`` and returns the result as a new tensor/array.

    Args:
        tensor: torch.Tensor (any device, contiguous or not) or numpy.ndarray of dtype float32,
            float64, float16, bfloat16, int32 or int64; the same shape and dtype on every rank.
        op: hp.Sum, hp.Average (default, like Horovod), hp.Min or hp.Max.
        group: None or "world" (all ranks), "data" (my stage's replicas), "pipe" (my pipeline), or an
            mpi4py communicator.

    Returns:
        A new tensor (same device) or array with the reduced values.

    Raises:
        MismatchError: ranks passed different shapes, dtypes or ops (on every rank).
        TypeError: not a tensor/array, or a dtype that cannot be reduced.
    """
    return _on_engine(group, "allreduce", lambda: _allreduce_here(tensor, op, group))


def _allreduce_here(tensor: Any, op: Any, group: Any) -> Any:
    _check_array(tensor, "allreduce")
    source = _host(tensor)
    target = source.clone() if _is_tensor(source) else source.copy()
    _allreduce_into(source, target, _reduce_op(op, "allreduce"), _communicator(group, "allreduce"), "allreduce")
    return target.to(tensor.device) if _is_tensor(tensor) and tensor.device.type != "cpu" else target


def allreduce_(tensor: Any, op: ReduceOp = Average, group: Any = None) -> Any:
    """In-place :func:`allreduce`: ``tensor`` holds the result afterwards and is returned."""
    return _on_engine(group, "allreduce_", lambda: _allreduce_in_place_here(tensor, op, group))


def _allreduce_in_place_here(tensor: Any, op: Any, group: Any) -> Any:
    _check_array(tensor, "allreduce_")
    work = _host(tensor)
    _allreduce_into(work, work, _reduce_op(op, "allreduce_"), _communicator(group, "allreduce_"), "allreduce_")
    _copy_into(tensor, work)
    return tensor


def _on_engine(group: Any, function: str, work: Callable[[], Any]) -> Any:
    """Runs a blocking collective on the engine's communication thread (see engine.call)."""
    from . import engine  # imports this module

    return engine.call(group, function, work)


def _grouped(tensors: Sequence[Any], op: Any, group: Any, function: str, in_place: bool) -> list:
    return _on_engine(group, function, lambda: _grouped_here(tensors, op, group, function, in_place))


def _grouped_here(tensors: Sequence[Any], op: Any, group: Any, function: str, in_place: bool) -> list:
    tensors = list(tensors)
    for t in tensors:
        _check_array(t, function)
    op = _reduce_op(op, function)
    comm = _communicator(group, function)
    works = [_host(t) for t in tensors]
    targets = works if in_place else [w.clone() if _is_tensor(w) else w.copy() for w in works]
    codes = [_dtype_code(w) for w in works]
    entries = [_describe(w) for w in works]
    _agree(comm, function, [2, len(tensors), _digest("|".join(entries)), int(op)], lambda: (op.name, entries),
           "every rank must pass the same list of tensors (same order, shapes and dtypes) and the same op",
           _explain_lists)
    _check_reducible(codes, works, function)
    order = sorted(range(len(works)), key=lambda i: codes[i])  # stable: one dtype's buckets in list order
    counts = [works[i].size if isinstance(works[i], np.ndarray) else works[i].numel() for i in order]
    core().grouped_allreduce([_address(works[i]) for i in order], [_address(targets[i]) for i in order],
                             counts, [codes[i] for i in order], int(op), comm.py2f(),
                             runtime.config().fusion_threshold_bytes, _allreduce_options())
    results = []
    for original, target in zip(tensors, targets):
        if in_place:
            _copy_into(original, target)
            results.append(original)
        elif _is_tensor(original) and original.device.type != "cpu":
            results.append(target.to(original.device))
        else:
            results.append(target)
    return results


def _explain_lists(everyone: list) -> str:
    """Names the op or the first list position where ranks' (op, [tensor descriptions]) differ."""
    ops = [op for op, _ in everyone]
    if len(set(ops)) > 1:
        return _list_ranks([f"op={op}" for op in ops])
    lengths = [len(entries) for _, entries in everyone]
    for index in range(max(lengths)):
        at = [entries[index] if index < len(entries) else "(no tensor)" for _, entries in everyone]
        if len(set(at)) > 1:
            return f"tensor {index}: " + _list_ranks(at) + " | list lengths: " + _list_ranks(lengths)
    return _list_ranks(lengths)


def grouped_allreduce(tensors: Sequence[Any], op: ReduceOp = Average, group: Any = None) -> list:
    """Allreduces many tensors at once through the fusion buffer; returns new tensors/arrays.

    Tensors are packed into buckets of ``fusion_threshold_bytes`` (HYBRIDPIPE_FUSION_THRESHOLD) and
    each bucket is one ring allreduce, so many small gradients cost a few large messages.

    Args:
        tensors: a list of torch tensors / numpy arrays; every rank passes the same shapes and dtypes
            in the same order (dtypes may be mixed).
        op: hp.Sum, hp.Average, hp.Min or hp.Max.
        group: as in :func:`allreduce`.

    Returns:
        A list of new tensors/arrays, in the order given.

    Raises:
        MismatchError: the lists differ between ranks (on every rank).
    """
    return _grouped(tensors, op, group, "grouped_allreduce", in_place=False)


def grouped_allreduce_(tensors: Sequence[Any], op: ReduceOp = Average, group: Any = None) -> list:
    """In-place :func:`grouped_allreduce`; returns the same tensors."""
    return _grouped(tensors, op, group, "grouped_allreduce_", in_place=True)


def broadcast_(tensor: Any, root_rank: int, group: Any = None) -> Any:
    """Overwrites ``tensor`` on every rank of ``group`` with root_rank's values; returns it.

    Any dtype is accepted (the bytes are moved). ``root_rank`` is a rank of ``group``.

    Raises:
        MismatchError: ranks passed different shapes, dtypes or roots (on every rank).
        ValueError: root_rank is outside the group.
    """
    return _on_engine(group, "broadcast_", lambda: _broadcast_here(tensor, root_rank, group))


def _broadcast_here(tensor: Any, root_rank: int, group: Any) -> Any:
    _check_array(tensor, "broadcast_")
    comm = _communicator(group, "broadcast_")
    work = _host(tensor)
    _agree(comm, "broadcast_", [3, int(root_rank), _digest(_describe(work))],
           lambda: f"root_rank={root_rank} {_describe(work)}",
           "every rank must pass the same root_rank, shape and dtype")
    if not 0 <= root_rank < comm.Get_size():
        raise ValueError(f"hp.broadcast: root_rank {root_rank} is not a rank of a group of {comm.Get_size()} "
                         f"(use 0..{comm.Get_size() - 1})")
    from mpi4py import MPI

    comm.Bcast([_byte_view(work), MPI.BYTE], root=int(root_rank))
    _copy_into(tensor, work)
    return tensor


def broadcast(tensor: Any, root_rank: int, group: Any = None) -> Any:
    """Returns a new tensor/array holding root_rank's ``tensor`` (see :func:`broadcast_`)."""
    _check_array(tensor, "broadcast")
    copy = tensor.detach().clone() if _is_tensor(tensor) else np.array(tensor, copy=True)
    return broadcast_(copy, root_rank, group)


def allgather(tensor: Any, group: Any = None) -> Any:
    """Concatenates every rank's ``tensor`` along dimension 0, in rank order, on every rank.

    The first dimension may differ between ranks; the other dimensions and the dtype must agree.

    Returns:
        A new tensor (on the input's device) or array of shape ``(sum of first dims, *rest)``.

    Raises:
        MismatchError: dtypes or trailing dimensions differ (on every rank).
        ValueError: a 0-dimensional input (allgather needs a dimension to concatenate along).
    """
    return _on_engine(group, "allgather", lambda: _allgather_here(tensor, group))


def _allgather_here(tensor: Any, group: Any) -> Any:
    _check_array(tensor, "allgather")
    comm = _communicator(group, "allgather")
    work = _host(tensor)
    ndim = len(work.shape)
    rows = int(work.shape[0]) if ndim else 0
    trailing = f"{tuple(work.shape[1:])} {str(work.dtype).replace('torch.', '')} ndim={ndim}"
    headers = np.empty((comm.Get_size(), 2), dtype=np.int64)
    comm.Allgather(np.array([_digest(trailing), rows], dtype=np.int64), headers)
    if len(set(headers[:, 0].tolist())) > 1:
        everyone = comm.allgather(f"first dim {rows}, then {trailing}")
        raise MismatchError(f"hp.allgather: ranks disagree ({_list_ranks(everyone)}); every rank must pass the "
                            f"same dtype and the same dimensions after the first")
    if ndim == 0:
        raise ValueError("hp.allgather needs a tensor with at least one dimension (got a 0-d scalar; "
                         "use tensor.reshape(1))")
    row_bytes = work.dtype.itemsize * int(np.prod(work.shape[1:], dtype=np.int64)) if isinstance(
        work, np.ndarray) else work.element_size() * int(np.prod(tuple(work.shape[1:]), dtype=np.int64))
    counts = (headers[:, 1] * row_bytes).tolist()
    total_rows = int(headers[:, 1].sum())
    shape = (total_rows, *work.shape[1:])
    if _is_tensor(work):
        result = _torch().empty(shape, dtype=work.dtype)
    else:
        result = np.empty(shape, dtype=work.dtype)
    from mpi4py import MPI

    comm.Allgatherv([_byte_view(work), MPI.BYTE], [_byte_view(result), counts, MPI.BYTE])
    return result.to(tensor.device) if _is_tensor(tensor) and tensor.device.type != "cpu" else result


def barrier(group: Any = None) -> None:
    """Blocks until every rank of ``group`` has called barrier."""
    _on_engine(group, "barrier", lambda: _communicator(group, "barrier").Barrier())

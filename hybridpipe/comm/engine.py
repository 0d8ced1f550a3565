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
communicator passed as ``group`` is registered on first use (collectively: every rank of it must
make its first async call with it).
"""

from __future__ import annotations

import itertools
from typing import Any

from .._ext import core
from ..errors import HybridPipeError, MismatchError
from . import buffers, context
from .collectives import Average, ReduceOp, reduce_op
from .context import call

__all__ = ["Handle", "allreduce_async", "allreduce_async_", "synchronize", "poll", "engine_stats", "call"]

_unnamed = itertools.count()


def _require(function: str) -> context.CommContext:
    return context.current(function)


class Handle:
    """A queued allreduce; :meth:`wait` returns its result."""

    def __init__(self, state: context.CommContext, handle: int, key: tuple[int, str], result: Any, work: Any) -> None:
        self._state, self._handle, self._key = state, handle, key
        self._result, self._work = result, work
        self._outcome: Any = None
        self._finished = False
        self.started_at = 0.0   #: time.monotonic() when its allreduce began (after wait(); 0 if never ran)
        self.finished_at = 0.0  #: time.monotonic() when its allreduce ended

    @property
    def name(self) -> str:
        return self._key[1]

    def poll(self) -> bool:
        """True once the reduction finished (or failed); never blocks."""
        return self._finished or self._state.engine.poll(self._handle)

    def wait(self) -> Any:
        """Blocks until the reduction finished; returns the reduced tensor / array.

        Raises:
            MismatchError: ranks submitted this name with different count, dtype or op (on every rank).
            HybridPipeError: the engine stopped or failed.
        """
        if not self._finished:
            error, self.started_at, self.finished_at, kind = self._state.engine.wait(self._handle)
            self._state.in_flight.discard(self._key)
            self._finished = True
            if error:
                self._outcome = (MismatchError if kind == core().ErrorKind.Mismatch else HybridPipeError)(error)
            elif self._work is not self._result:
                buffers.copy_into(self._result, self._work)
        if self._outcome is not None:
            raise self._outcome
        return self._result

    def __repr__(self) -> str:
        return f"<hp.Handle {self.name!r} {'done' if self._finished else 'in flight'}>"


def _submit(tensor: Any, name: str | None, op: Any, group: Any, function: str, in_place: bool) -> Handle:
    buffers.check_array(tensor, function)
    state = _require(function)
    op = reduce_op(op, function)
    group_id = state.engine_group(group, function)
    if name is None:
        name = f"{function}.noname.{next(_unnamed)}"
    elif not isinstance(name, str) or not name:
        raise TypeError(f"hp.{function}: name must be a non-empty str, got {name!r}")
    key = (group_id, name)
    if key in state.in_flight:
        raise HybridPipeError(f"hp.{function}: a tensor named {name!r} is already in flight on this group; "
                              "wait for its handle first or use another name")
    result = tensor if in_place else buffers.clone(tensor)
    work = buffers.host(result)
    code = buffers.dtype_code(work)
    buffers.check_reducible([code], [work], function)
    try:
        handle = state.engine.submit(group_id, name, buffers.address(work), buffers.count(work), code, int(op))
    except RuntimeError as error:  # the engine stopped (stall shutdown, MPI failure, shutting down)
        raise HybridPipeError(f"hp.{function}: {error}") from None
    state.in_flight.add(key)
    return Handle(state, handle, key, result, work)


def allreduce_async_(tensor: Any, name: str | None = None, op: ReduceOp = Average, group: Any = None) -> Handle:
    """Queues an in-place allreduce of ``tensor``; ``handle.wait()`` returns ``tensor`` reduced.

    Do not read or write ``tensor`` until the handle is done.

    Args:
        tensor: torch.Tensor or numpy.ndarray (float32/64, float16, bfloat16, int32, int64).
        name: identifies the tensor across ranks (default: ``"allreduce_async_.noname.<n>"``, the n-th
            unnamed call of this process — deterministic when every rank makes the same calls).
        op: hp.Average (default), hp.Sum, hp.Min, hp.Max.
        group: None/"world", "data", "pipe" or an mpi4py communicator.
    """
    return _submit(tensor, name, op, group, "allreduce_async_", in_place=True)


def allreduce_async(tensor: Any, name: str | None = None, op: ReduceOp = Average, group: Any = None) -> Handle:
    """Like :func:`allreduce_async_` but reduces a copy: ``tensor`` is left as it is."""
    return _submit(tensor, name, op, group, "allreduce_async", in_place=False)


def synchronize(handle: Handle) -> Any:
    """``handle.wait()``, Horovod's spelling."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """``handle.poll()``, Horovod's spelling."""
    return handle.poll()


def engine_stats(group: Any = "data") -> dict[str, int]:
    """Counters of the engine for ``group``: cycles (negotiations), slow_rounds (name gathers),
    tensors, buckets (allreduce calls), shared_memory (of those, buckets reduced through the group's
    shared-memory segment, when its ranks share a host), helped (buckets run by a thread blocked in
    wait(), not the engine thread), bytes, stall_warnings."""
    state = _require("engine_stats")
    stats = state.engine.stats(state.engine_group(group, "engine_stats"))
    return {name: getattr(stats, name) for name in
            ("cycles", "slow_rounds", "tensors", "buckets", "shared_memory", "helped", "bytes", "stall_warnings")}

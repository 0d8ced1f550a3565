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
import threading
import zlib
from typing import Any, Callable, TypeVar

import numpy as np

from .. import runtime
from .._ext import core
from ..errors import HybridPipeError, MismatchError
from . import collectives
from .collectives import Average, ReduceOp

__all__ = ["Handle", "allreduce_async", "allreduce_async_", "synchronize", "poll", "engine_stats", "call"]

_BUILTIN = ("world", "data", "pipe")
_unnamed = itertools.count()


class _EngineState:
    """The engine of the current hp.init and its group ids."""

    def __init__(self, config: Any, grid: Any) -> None:
        options = core().EngineOptions()
        options.cycle_time_ms = config.cycle_time_ms
        options.stall_check_seconds = config.stall_check_seconds
        options.stall_shutdown_seconds = config.stall_shutdown_seconds
        options.timeout_seconds = config.timeout_seconds
        options.fusion_threshold_bytes = config.fusion_threshold_bytes
        # polite waits: leave the cores to the backward pass
        options.allreduce = collectives._new_allreduce_options(config, collectives.wait_policy())
        options.thread_nice = config.engine_nice
        options.waiters_help = config.waiters_help
        options.record_events = bool(config.timeline)
        self.engine = core().Engine(options)
        self.groups: dict[Any, int] = {}
        # the grid's groups are active from the first cycle of the one communication thread; world
        # first: it holds every rank, and later groups join at a cycle it agrees on (csrc/engine.h)
        for label, comm in zip(_BUILTIN, (grid.world_comm, grid.data_comm, grid.pipe_comm)):
            self.groups[label] = self.engine.add_group(comm.py2f(), label)
        # the pipeline's sends and receives (comm/p2p.py) go through the same thread
        self.engine.drive_transfers()
        self.engine.start()
        self.user_groups: dict[int, tuple[Any, int]] = {}
        self.in_flight: set[tuple[int, str]] = set()

    def group_id(self, group: Any, function: str) -> int:
        if group is None:
            return self.groups["world"]
        if isinstance(group, str):
            if group not in self.groups:
                raise ValueError(f"hp.{function}: unknown group {group!r} (use None/'world', 'data', 'pipe' or "
                                 "an mpi4py communicator)")
            return self.groups[group]
        comm = collectives._communicator(group, function)  # validates the type; a private duplicate
        key = id(group)
        if key not in self.user_groups or self.user_groups[key][0] is not group:
            self.user_groups[key] = (group, self.engine.add_group(comm.py2f(), f"user communicator {key:#x}"))
        return self.user_groups[key][1]

    def shutdown(self) -> dict[str, list]:
        """Stops the engine; returns its recorded events by group label (timeline)."""
        self.engine.shutdown()
        labels = {**{gid: label for label, gid in self.groups.items()},
                  **{gid: f"user {i}" for i, (_, gid) in enumerate(self.user_groups.values())}}
        return {labels[gid]: self.engine.take_events(gid) for gid in sorted(labels)}


_state: _EngineState | None = None


def _busy() -> bool:
    """Whether this process has tensors queued or running on the background engine."""
    return _state is not None and bool(_state.in_flight)


def _start(config: Any, grid: Any) -> None:
    """Called by hp.init."""
    global _state
    _state = _EngineState(config, grid)


def _stop() -> dict[str, list]:
    """Called by hp.shutdown (collective: the engines agree to stop together); returns the
    engine's recorded events by group (empty lists unless the timeline is on)."""
    global _state
    if _state is None:
        return {}
    state, _state = _state, None
    return state.shutdown()


_on_engine_thread = threading.local()
_Result = TypeVar("_Result")
_CALL_NAME = "hybridpipe.collective"  # one at a time per group and process: the name can repeat


def call(group: Any, function: str, work: Callable[[], _Result]) -> _Result:
    """Runs ``work()`` (a blocking collective over ``group``) on the engine's communication thread, at
    a point of its sequence that every rank of ``group`` agrees on, and returns its result (or raises
    its exception) here.

    Why: one thread per process makes hybridpipe's MPI calls. With Open MPI, MPI calls from a second
    thread beside the engine's stalled cross-host jobs for minutes (docs/sharp_bits.md), and a
    collective made outside the engine's agreed order could wait for a rank whose engine waits for
    it. Without a running engine (before hp.init's engine starts, after shutdown), or when already on
    the engine thread, ``work()`` simply runs here.

    Raises:
        MismatchError: ranks of the group called different collectives at this point (every rank).
    """
    state = _state
    if state is None or getattr(_on_engine_thread, "inside", False):
        return work()
    group_id = state.group_id(group, function)
    outcome: dict[str, Any] = {}

    def job() -> None:
        _on_engine_thread.inside = True
        try:
            outcome["value"] = work()
        except BaseException as error:  # handed to the calling thread
            outcome["error"] = error
        finally:
            _on_engine_thread.inside = False

    kind = zlib.crc32(function.encode()) & 0x7FFFFFFF
    try:
        handle = state.engine.submit_call(group_id, _CALL_NAME, kind, job)
    except (RuntimeError, ValueError) as error:
        raise HybridPipeError(f"hp.{function}: {error}") from None
    error, _, _, error_kind = state.engine.wait(handle)  # `job` stays referenced here until done
    if error:
        if error_kind == core().ErrorKind.Mismatch:
            raise MismatchError(f"hp.{function}: ranks of the group called different collectives at this point "
                                f"(each rank's kind is crc32 of the function name; hp.{function} is {kind}): "
                                f"{error}")
        raise HybridPipeError(f"hp.{function}: {error}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _require(function: str) -> _EngineState:
    runtime._require(function)
    if _state is None:
        raise HybridPipeError(f"hp.{function}: the background engine is not running (call hp.init first)")
    return _state


class Handle:
    """A queued allreduce; :meth:`wait` returns its result."""

    def __init__(self, state: _EngineState, handle: int, key: tuple[int, str], result: Any, work: Any) -> None:
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
                collectives._copy_into(self._result, self._work)
        if self._outcome is not None:
            raise self._outcome
        return self._result

    def __repr__(self) -> str:
        return f"<hp.Handle {self.name!r} {'done' if self._finished else 'in flight'}>"


def _submit(tensor: Any, name: str | None, op: Any, group: Any, function: str, in_place: bool) -> Handle:
    collectives._check_array(tensor, function)
    state = _require(function)
    op = collectives._reduce_op(op, function)
    group_id = state.group_id(group, function)
    if name is None:
        name = f"{function}.noname.{next(_unnamed)}"
    elif not isinstance(name, str) or not name:
        raise TypeError(f"hp.{function}: name must be a non-empty str, got {name!r}")
    key = (group_id, name)
    if key in state.in_flight:
        raise HybridPipeError(f"hp.{function}: a tensor named {name!r} is already in flight on this group; "
                              "wait for its handle first or use another name")
    if in_place:
        result = tensor
        work = collectives._host(tensor)
    else:
        result = tensor.detach().clone() if collectives._is_tensor(tensor) else np.array(tensor, copy=True)
        work = collectives._host(result)
    code = collectives._dtype_code(work)
    collectives._check_reducible([code], [work], function)
    count = work.size if isinstance(work, np.ndarray) else work.numel()
    try:
        handle = state.engine.submit(group_id, name, collectives._address(work), count, code, int(op))
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
    stats = state.engine.stats(state.group_id(group, "engine_stats"))
    return {name: getattr(stats, name) for name in
            ("cycles", "slow_rounds", "tensors", "buckets", "shared_memory", "helped", "bytes", "stall_warnings")}

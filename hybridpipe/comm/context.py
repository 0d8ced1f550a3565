"""The communication context: everything hybridpipe's communication owns between hp.init and hp.shutdown.

``hp.init`` calls :func:`hybridpipe.comm.start` with the settings and the grid; that makes one
:class:`CommContext`, which owns

* the communicators: the grid's world / data / pipe (made by the runtime, used here), and the private
  duplicate of every user communicator passed as ``group=`` (one cache, for direct collectives and the
  engine alike);
* the allreduce options and wait policies of the settings;
* the engine: the one communication thread (``csrc/engine.h``), its group ids, and the names this
  process has in flight on it.

``hp.shutdown`` calls :func:`hybridpipe.comm.stop`. Every module of ``hybridpipe.comm`` reaches the
context through :func:`current`; none of them imports the runtime (imports run runtime → comm).
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from .._ext import core
from ..config import Config
from ..errors import HybridPipeError, MismatchError, NotInitializedError

__all__ = ["CommContext", "start", "stop", "current", "current_or_none", "communicator", "call", "wait_policy",
           "allreduce_options_for"]

BUILTIN_GROUPS = ("world", "data", "pipe")


def wait_policy(config: Config) -> Any:
    """The polite wait of ``config`` (``HYBRIDPIPE_WAIT_SPIN_US`` / ``HYBRIDPIPE_WAIT_SLEEP_US``)."""
    return core().WaitPolicy(config.wait_spin_us, config.wait_sleep_us)


def allreduce_options_for(config: Config, wait: Any = None) -> Any:
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


@dataclass
class _UserGroup:
    """A user communicator passed as ``group=``: our private duplicate, and its engine group once used there."""

    user: Any
    comm: Any
    engine_id: int | None = None


class CommContext:
    """What communication owns for one hp.init (see the module's docstring)."""

    def __init__(self, config: Config, grid: Any) -> None:
        self.config, self.grid = config, grid
        self.wait = wait_policy(config)
        # direct collectives spin, or wait politely while this process has tensors on the engine, so
        # that a blocking call does not take the cores from the (niced) engine thread; both make the
        # same MPI calls (docs/sharp_bits.md)
        self._spinning = allreduce_options_for(config, core().spinning_wait(self.wait))
        self._polite = allreduce_options_for(config, self.wait)
        self._users: dict[int, _UserGroup] = {}
        self.in_flight: set[tuple[int, str]] = set()  # (engine group, name) submitted and not waited for
        options = core().EngineOptions()
        options.cycle_time_ms = config.cycle_time_ms
        options.stall_check_seconds = config.stall_check_seconds
        options.stall_shutdown_seconds = config.stall_shutdown_seconds
        options.timeout_seconds = config.timeout_seconds
        options.fusion_threshold_bytes = config.fusion_threshold_bytes
        options.allreduce = allreduce_options_for(config, self.wait)  # polite: leave the cores to compute
        options.thread_nice = config.engine_nice
        options.waiters_help = config.waiters_help
        options.record_events = bool(config.timeline)
        self.engine = core().Engine(options)
        # the grid's groups are active from the first cycle; world first: it holds every rank, and later
        # groups join at a cycle it agrees on (csrc/engine.h)
        self._engine_ids: dict[str, int] = {}
        for label in BUILTIN_GROUPS:
            self._engine_ids[label] = self.engine.add_group(self._builtin(label).py2f(), label)
        self.engine.drive_transfers()  # the pipeline's sends and receives go through the same thread
        self.engine.start()

    def _builtin(self, label: str) -> Any:
        return {"world": self.grid.world_comm, "data": self.grid.data_comm, "pipe": self.grid.pipe_comm}[label]

    def _user(self, group: Any, function: str) -> _UserGroup:
        from mpi4py import MPI

        if not isinstance(group, MPI.Intracomm):
            raise TypeError(f"hp.{function}: group must be None, 'world', 'data', 'pipe' or an mpi4py "
                            f"intracommunicator, got {type(group).__name__}")
        entry = self._users.get(id(group))
        if entry is None or entry.user is not group:
            private = group.Dup()  # collective on `group`; our tags never meet the user's messages
            private.Set_errhandler(MPI.ERRORS_RETURN)
            entry = self._users[id(group)] = _UserGroup(group, private)
        return entry

    def communicator(self, group: Any, function: str) -> Any:
        """hybridpipe's communicator for ``group``: None/"world", "data", "pipe" or an mpi4py comm (whose
        private duplicate is made, collectively, the first time)."""
        if group is None:
            return self.grid.world_comm
        if isinstance(group, str):
            if group not in BUILTIN_GROUPS:
                raise ValueError(f"hp.{function}: unknown group {group!r} (use None/'world', 'data', 'pipe' or "
                                 "an mpi4py communicator)")
            return self._builtin(group)
        return self._user(group, function).comm

    def engine_group(self, group: Any, function: str) -> int:
        """The engine's id of ``group`` (a user communicator joins the engine the first time)."""
        if group is None:
            return self._engine_ids["world"]
        if isinstance(group, str):
            if group not in BUILTIN_GROUPS:
                raise ValueError(f"hp.{function}: unknown group {group!r} (use None/'world', 'data', 'pipe' or "
                                 "an mpi4py communicator)")
            return self._engine_ids[group]
        entry = self._user(group, function)
        if entry.engine_id is None:
            entry.engine_id = self.engine.add_group(entry.comm.py2f(), f"user communicator {id(group):#x}")
        return entry.engine_id

    def allreduce_options(self) -> Any:
        """Options of a direct collective now: polite while tensors are in flight on the engine."""
        return self._polite if self.in_flight else self._spinning

    def close(self) -> dict[str, list]:
        """Stops the engine (collective: every rank's engine agrees to stop), frees the user duplicates;
        returns the engine's recorded events by group label (timeline)."""
        self.engine.shutdown()
        labels = {gid: label for label, gid in self._engine_ids.items()}
        users = [entry for entry in self._users.values() if entry.engine_id is not None]
        labels.update({entry.engine_id: f"user {i}" for i, entry in enumerate(users)})
        events = {labels[gid]: self.engine.take_events(gid) for gid in sorted(labels)}
        for entry in self._users.values():
            entry.comm.Free()
        self._users.clear()
        return events


_current: CommContext | None = None


def start(config: Config, grid: Any) -> CommContext:
    """Called by hp.init: makes the context (and starts the communication thread)."""
    global _current
    if _current is not None:
        raise RuntimeError("hybridpipe.comm.start: a communication context is already running (stop it first)")
    _current = CommContext(config, grid)
    return _current


def stop() -> dict[str, list]:
    """Called by hp.shutdown: stops the context; returns the engine's events by group (timeline)."""
    global _current
    if _current is None:
        return {}
    context, _current = _current, None
    return context.close()


def current(function: str) -> CommContext:
    """The running context; NotInitializedError (naming ``hp.<function>``) before hp.init."""
    if _current is None:
        raise NotInitializedError(f"hp.{function}() was called before hp.init(); call hp.init() first")
    return _current


def current_or_none() -> CommContext | None:
    return _current


def communicator(group: Any, function: str) -> Any:
    """hybridpipe's communicator for ``group`` in the running context (see CommContext.communicator)."""
    return current(function).communicator(group, function)


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
    state = _current
    if state is None or getattr(_on_engine_thread, "inside", False):
        return work()
    group_id = state.engine_group(group, function)
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

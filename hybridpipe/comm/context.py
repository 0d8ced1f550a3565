"""The communication context: everything hybridpipe's communication owns between hp.init and hp.shutdown.

``hp.init`` calls :func:`hybridpipe.comm.start` with the settings and the grid; that makes one
:class:`CommContext`, which owns

* the communicators: the grid's world / data / pipe (made by the runtime, used here), the private
  duplicate of every user communicator passed as ``group=`` (one cache, for direct collectives and the
  engine alike), and the process sets (:mod:`hybridpipe.comm.process_sets`);
* the allreduce options and wait policies of the settings;
* the engine: the one communication thread (``csrc/engine.h``), its group ids, the names this
  process has in flight on it, and what their operations need kept alive until they ran.

A blocking collective runs on the communication thread through :func:`call`; an asynchronous one
through :func:`submit`, which returns a :class:`Handle` at once.

``hp.shutdown`` calls :func:`hybridpipe.comm.stop`. Every module of ``hybridpipe.comm`` reaches the
context through :func:`current` (kept in :mod:`hybridpipe.running`, so that the modules this one is built
from can ask for it too); none of them imports the runtime (imports run runtime → comm).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from .. import _trace
from .._ext import core
from ..config import Config
from ..errors import (
    DuplicateNameError,
    HorovodInternalError,
    HybridPipeError,
    MismatchError,
    PeerShutDownError,
    RanksJoined,
    RanksLostError,
    UsageError,
)
from .. import running
from . import buffers
from .departures import Departures
from .process_sets import ProcessSet, Registry
from ..running import current, current_or_none

__all__ = ["CommContext", "Group", "Handle", "start", "stop", "current", "current_or_none", "communicator", "call", "submit",
           "wait_policy", "allreduce_options_for", "resolve_group", "resolved", "unnamed", "check_name", "refusing",
           "ARGUMENT_ERRORS", "RanksJoined"]

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
    options.hierarchical_chunk_bytes = config.hierarchical_chunk_bytes
    if wait is not None:
        options.wait = wait
    return options


@dataclass
class _UserGroup:
    """A user communicator passed as ``group=``: our private duplicate, and its engine group once used there."""

    user: Any
    comm: Any
    engine_id: int | None = None


@dataclass(frozen=True, eq=False)
class Group:
    """``group=`` / ``process_set=`` resolved once (:meth:`CommContext.group`): what the layers below the API
    take as it is. ``builtin``: "world" / "data" / "pipe" (the grid's own communicator and engine group), else
    ``entry``: the registered process set's :class:`~hybridpipe.comm.process_sets.SetEntry` or the user
    communicator's duplicate (both made the first time they are used). ``set_ranks``: a process set's global
    ranks (a process set's ``root_rank`` is global, as in Horovod), else None."""

    label: str
    size: int
    builtin: str | None = None
    entry: Any = None
    set_ranks: list[int] | None = None


if TYPE_CHECKING:
    from .._trace import Recorder

T = TypeVar("T")  # a slot's class (CommContext.slot)

#: Makes the engine's device allreduce of a group over an mpi4py communicator: ``reduce(address, count, dtype
#: code, op code, gpu) -> bool`` (hybridpipe.comm.reduction.engine_device_allreduce).
DeviceAllreduce = Callable[[Any], Callable[[int, int, int, int, int], bool]]


class CommContext:
    """What communication owns for one hp.init (see the module's docstring)."""

    def __init__(self, config: Config, grid: Any, device_allreduce: DeviceAllreduce | None = None,
                 base_comm: Any = None, local_comm: Any = None) -> None:
        self.config, self.grid = config, grid
        # the communicator hp.init was given (default COMM_WORLD) and the ranks of this host (hp.local_rank)
        self.base_comm, self.local_comm = base_comm, local_comm
        self.timeline: Recorder | None = None  # the timeline's recorder while one records
        self.nccl_groups: dict[tuple[int, int], Any] = {}  # (communicator handle, GPU) -> NCCL communicator or None
        self.copy_streams: dict[Any, tuple[Any, Any]] = {}  # per CUDA device: staging's two side streams
        self.warned_staging = False  # device.note_staged warns once per job
        self.on_engine_thread = threading.local()  # .inside: this thread runs a call of the engine's (see call)
        # p2p receives posted and not opened yet, per (communicator handle, source, tag), in posting order (p2p.py)
        self.unopened_receives: dict[tuple[int, int, int], list[Any]] = {}
        self._device_allreduce = device_allreduce
        self.wait = wait_policy(config)
        # direct collectives spin, or wait politely while this process has tensors on the engine, so
        # that a blocking call does not take the cores from the (niced) engine thread; both make the
        # same MPI calls (docs/sharp_bits.md)
        self._spinning = allreduce_options_for(config, core().spinning_wait(self.wait))
        self._polite = allreduce_options_for(config, self.wait)
        self._users: dict[int, _UserGroup] = {}
        self.process_sets = Registry(grid)
        self.in_flight: set[tuple[int, str]] = set()  # (engine group, name) submitted and not waited for
        # numbers that name things every rank makes in the same order (unnamed calls, optimizers, tied
        # models): counted from hp.init, so a process that shuts down and inits again (elastic, a test
        # session) agrees with one that just started, whatever the earlier session did
        self._sequences: dict[str, Iterator[int]] = {}
        self.joined_calls: dict[int, int] = {}  # per engine group: synchronous allreduces run while ranks joined
        self.outputs = buffers.OutputPool()  # outputs of out-of-place allreduce_async, reused once released
        # per engine handle: what its operation needs alive until it ran (a call's job, an allreduce's
        # buffers), released by Handle.wait() or, for handles never waited for, by close()
        self.keep: dict[int, Any] = {}
        # the upper layers' per-job objects, by their class (see slot): their state is theirs, not fields here
        self._slots: dict[type, Any] = {}
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
        self._device_allreduces: list[Any] = []  # the engine borrows them (set_device_allreduce)
        for label in BUILTIN_GROUPS:
            self._engine_ids[label] = self.add_engine_group(self._builtin(label), label)
        self._builtin_groups = {label: Group(label, self._builtin(label).Get_size(), builtin=label)
                                for label in BUILTIN_GROUPS}
        self.departures = Departures(grid)  # hp.shutdown tells the pipeline's other stages (departures.py)
        self.engine.drive_transfers()  # the pipeline's sends and receives go through the same thread
        self.departures.start()
        self.engine.start()

    def add_engine_group(self, comm: Any, label: str) -> int:
        """Adds the group over mpi4py communicator ``comm`` to the engine; returns its id. With the CUDA kernels
        built, its buckets of CUDA tensors can stay in device memory on a CUDA-aware MPI, reduced by the
        context's ``device_allreduce(comm)`` (reduction.engine_device_allreduce, given by comm.start)."""
        from .._ext import cuda_compiled

        group_id = self.engine.add_group(comm.py2f(), label)
        if cuda_compiled() and self._device_allreduce is not None:
            reduce = self._device_allreduce(comm)
            self._device_allreduces.append(reduce)
            self.engine.set_device_allreduce(group_id, reduce)
        return group_id

    def _builtin(self, label: str) -> Any:
        return {"world": self.grid.world_comm, "data": self.grid.data_comm, "pipe": self.grid.pipe_comm}[label]

    def _user(self, group: Any, function: str) -> _UserGroup:
        from mpi4py import MPI

        if not isinstance(group, MPI.Intracomm):
            raise TypeError(f"hp.{function}: group must be None, 'world', 'data', 'pipe' or an mpi4py "
                            f"intracommunicator (or a hp.ProcessSet), got {type(group).__name__}")
        entry = self._users.get(id(group))
        if entry is None or entry.user is not group:
            entry = self._users[id(group)] = _UserGroup(group, None)
        return entry

    def _private(self, entry: _UserGroup, function: str) -> Any:
        """The private duplicate of a user communicator, made the first time on the communication thread
        (a collective over it, at a point of the thread's sequence its ranks agree on: one thread in MPI)."""
        if entry.comm is None:
            def duplicate() -> Any:
                from mpi4py import MPI

                if entry.comm is None:  # our tags never meet the user's messages
                    private = entry.user.Dup()
                    private.Set_errhandler(MPI.ERRORS_RETURN)
                    entry.comm = private
                return entry.comm

            call(entry.user, function, duplicate, "duplicate communicator")
        return entry.comm

    def group(self, group: Any, function: str) -> Group:
        """``group`` resolved: None/"world", "data", "pipe", a registered :class:`ProcessSet` this rank belongs to,
        an mpi4py intracommunicator, or a :class:`Group` already resolved (returned as it is). Raises the
        TypeError / ValueError using it would raise; no communication."""
        if isinstance(group, Group):
            return group
        if group is None or isinstance(group, str):
            resolved = self._builtin_groups.get("world" if group is None else group)
            if resolved is None:
                raise ValueError(f"hp.{function}: unknown group {group!r} (use None/'world', 'data', 'pipe', a "
                                 "hp.ProcessSet or an mpi4py communicator)")
            return resolved
        if isinstance(group, ProcessSet):
            entry = self.process_sets.member_entry(group, function)
            return Group(entry.label, len(entry.ranks), entry.builtin, None if entry.builtin else entry, entry.ranks)
        user = self._user(group, function)
        return Group(f"user communicator {id(group):#x}", group.Get_size(), entry=user)

    def check_group(self, group: Any, function: str) -> None:
        """Raises the TypeError / ValueError that using ``group`` here would raise; no communication."""
        self.group(group, function)

    def group_size(self, group: Any, function: str) -> int:
        """The number of ranks of ``group`` (checked as :meth:`check_group` does); no communication."""
        return self.group(group, function).size

    def communicator(self, group: Any, function: str) -> Any:
        """hybridpipe's communicator for ``group`` (see :meth:`group`); a user communicator's private duplicate is
        made, collectively and on the communication thread, the first time."""
        resolved = self.group(group, function)
        if resolved.builtin is not None:
            return self._builtin(resolved.builtin)
        if isinstance(resolved.entry, _UserGroup):
            return self._private(resolved.entry, function)
        return resolved.entry.comm

    def set_ranks(self, group: Any, function: str) -> list[int] | None:
        """The global ranks of ``group`` in its rank order when it is a process set (whose ``root_rank``
        arguments are global ranks, as in Horovod), else None (a group's ``root_rank`` is its own rank)."""
        return self.group(group, function).set_ranks

    def engine_group(self, group: Any, function: str) -> int:
        """The engine's id of ``group`` (a user communicator or process set joins the engine the first time)."""
        resolved = self.group(group, function)
        if resolved.builtin is not None:
            return self._engine_ids[resolved.builtin]
        entry = resolved.entry
        if entry.engine_id is None:
            user = isinstance(entry, _UserGroup)
            entry.engine_id = self.add_engine_group(entry.user if user else entry.comm, resolved.label)
        return entry.engine_id

    def allreduce_options(self) -> Any:
        """Options of a direct collective now: polite while tensors are in flight on the engine."""
        return self._polite if self.in_flight else self._spinning

    def register_process_sets(self, sets: list[ProcessSet], function: str) -> None:
        """Registers ``sets`` (hp.init's ``process_sets``, hp.add_process_set): one collective over world."""
        for process_set in sets:
            if not isinstance(process_set, ProcessSet):
                raise TypeError(f"hp.{function}: process_sets must hold hp.ProcessSet objects, got "
                                f"{type(process_set).__name__}")
        call(None, function, lambda: self.process_sets.register_here(sets, function))

    def remove_process_set(self, process_set: ProcessSet) -> bool:
        """Unregisters ``process_set`` (collective over world); see hp.remove_process_set."""
        return call(None, "remove_process_set", lambda: self.process_sets.remove_here(process_set,
                                                                                      "remove_process_set"))

    def made_on_grid(self) -> list[str]:
        """What the user made on this job's grid that ends with it: registered process sets, and communicators of
        their own used as ``group=`` (empty when there is none)."""
        made = [f"process set {set_id} (ranks {entry.ranks})"
                for set_id, entry in sorted(self.process_sets.entries.items()) if set_id > 0]
        if self._users:
            made.append(f"{len(self._users)} communicator(s) of your own used as group=")
        return made

    def events(self) -> dict[str, list]:
        """The engine's recorded events since the last call, by group label (timeline)."""
        labels = {gid: label for label, gid in self._engine_ids.items()}
        users = [entry for entry in self._users.values() if entry.engine_id is not None]
        labels.update({entry.engine_id: f"user {i}" for i, entry in enumerate(users)})
        labels.update({gid: f"process set {'/'.join(map(str, members))}"
                       for members, gid in self.process_sets.engine_ids.items()})
        labels.update({entry.engine_id: entry.label for entry in self.process_sets.entries.values()
                       if entry.engine_id is not None})
        return {labels[gid]: self.engine.take_events(gid) for gid in sorted(labels)}

    def ranks_lost(self, text: str) -> RanksLostError | None:
        """The :class:`RanksLostError` of an operation that failed with ``text`` when the engine stopped because
        ranks were lost (it survives failures inside hp.elastic.run), else None."""
        if not self.engine.ranks_were_lost():
            return None
        ranks = list(self.engine.lost_ranks())
        every_host = list(self.engine.hosts())
        hosts = [every_host[r] if 0 <= r < len(every_host) else "?" for r in ranks]
        named = ", ".join(f"{rank} (host {host})" for rank, host in zip(ranks, hosts)) or "not known yet on this rank"
        return RanksLostError(f"{text} [lost ranks: {named}]", ranks=ranks, hosts=hosts)

    def slot(self, kind: type[T], make: Callable[[], T]) -> T:
        """This job's object of class ``kind``, which a layer above keeps its per-job state in (the asynchronous
        pipelines' step guard, the autotuner): made by ``make()`` on first use, the same object after. At
        hp.shutdown each slot's ``close()``, where it has one, runs (the latest made first) and the slots go."""
        made = self._slots.get(kind)
        if made is None:
            made = self._slots[kind] = make()
            if not isinstance(made, kind):
                raise TypeError(f"slot({kind.__name__}): make() returned a {type(made).__name__}")
        return made

    def slot_or_none(self, kind: type[T]) -> T | None:
        """This job's object of class ``kind`` if one was made (:meth:`slot`), else None."""
        return self._slots.get(kind)

    def sequence(self, kind: str) -> int:
        """The next number of ``kind`` (0, 1, 2, … since hp.init): the same on every rank that makes the same
        calls in the same order."""
        return next(self._sequences.setdefault(kind, itertools.count()))

    def close(self, failed: bool = False, lost: bool = False) -> dict[str, list]:
        """Stops the engine (collective: every rank's engine agrees to stop), frees the user duplicates and
        the process sets' communicators; returns the engine's recorded events by group label (timeline).

        First it tells the pipeline's other stages that this rank leaves, so that one still waiting for it
        raises PeerShutDownError instead of waiting for ever (departures.py); ``failed``: because of an uncaught
        exception, which the ranks waiting for it (in the pipeline or a collective) are told. ``lost``: ranks of the
        job died (hp.elastic.run goes on without them): the engine is abandoned, nothing is agreed with the others
        (their communicators are revoked)."""
        if lost:
            self.departures.withdraw()
            self.engine.abandon()
            self.departures.close(lost=True)
        else:
            self.departures.announce(failed)
            if failed:
                self.engine.leave_failed()
            self.departures.withdraw()
            self.engine.shutdown()
            self.departures.close()
        events = self.events()
        self.keep.clear()  # the thread has stopped: nothing it ran can still use these
        self.outputs.clear()
        core().release_dropped_owners()  # buffers of transfers the thread retired without the GIL
        from . import device

        device.forget_nccl(self.nccl_groups)  # NCCL communicators of the groups about to be freed
        for entry in self._users.values():
            if entry.comm is not None:
                entry.comm.Free()
        self._users.clear()
        self.process_sets.close()
        for made in reversed(list(self._slots.values())):
            close = getattr(made, "close", None)
            if callable(close):
                close()
        self._slots.clear()
        return events


def start(config: Config, grid: Any, device_allreduce: DeviceAllreduce | None = None, base_comm: Any = None,
          local_comm: Any = None) -> CommContext:
    """Called by hp.init (through :func:`hybridpipe.comm.start`): makes the context, the running job (and starts
    the communication thread). ``device_allreduce``, ``base_comm``, ``local_comm``: see :class:`CommContext`."""
    if running.current_or_none() is not None:
        raise RuntimeError("hybridpipe.comm.start: a communication context is already running (stop it first)")
    context = CommContext(config, grid, device_allreduce, base_comm, local_comm)
    running.replace(context)
    return context


def stop(failed: bool = False, lost: bool = False) -> dict[str, list]:
    """Called by hp.shutdown: stops the context; returns the engine's events by group (timeline). ``failed``:
    at interpreter exit after an uncaught exception; ``lost``: after ranks died (see CommContext.close)."""
    context = running.replace(None)
    if context is None:
        return {}
    return context.close(failed, lost)


def communicator(group: Any, function: str) -> Any:
    """hybridpipe's communicator for ``group`` in the running context (see CommContext.communicator)."""
    return current(function).communicator(group, function)


_Result = TypeVar("_Result")
_CALL_NAME = "hybridpipe.collective"  # one at a time per group and process: the name can repeat


def unnamed(function: str) -> str:
    """The name of the next unnamed asynchronous call since hp.init (the n-th unnamed call: the same on
    every rank that makes the same calls in the same order, as in Horovod)."""
    return f"{function}.noname.{current(function).sequence('unnamed')}"


def check_name(name: Any, function: str) -> None:
    """TypeError unless ``name`` is None or a non-empty str."""
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"hp.{function}: name must be a non-empty str, got {name!r}")


def resolve_group(group: Any, process_set: Any, function: str) -> Any:
    """The group a collective runs over, from hybridpipe's ``group=`` or Horovod's ``process_set=``
    (two spellings of one argument; None/None is the whole job)."""
    if process_set is None:
        return group
    if group is not None:
        raise ValueError(f"hp.{function}: pass the ranks as group= or as process_set=, not both (got group={group!r} "
                         f"and process_set={process_set!r})")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"hp.{function}: process_set must be a hp.ProcessSet (e.g. hp.global_process_set), got "
                        f"{type(process_set).__name__}; for 'data', 'pipe' or a communicator use group=")
    return process_set


def resolved(group: Any, function: str) -> Group:
    """A collective's group (after :func:`resolve_group`) as the :class:`Group` the layers below take as it is:
    resolved once, at the API (raises what using it would raise; no communication)."""
    return current(function).group(group, function)


class Handle:
    """An operation queued on the communication thread: an asynchronous allreduce (``hp.allreduce_async_``)
    or any other ``*_async`` collective. :meth:`wait` (``hp.synchronize``) returns its result.

    Example:
        >>> handle = hp.allgather_async(torch.ones(2, 3), name="rows")
        >>> hp.poll(handle)                       # True once done; never blocks
        >>> rows = hp.synchronize(handle)         # the same as handle.wait()
    """

    def __init__(self, state: CommContext, handle: int, key: tuple[int, str], function: str,
                 finish: Callable[[], Any], mismatch: Callable[[str], str] = lambda error: error) -> None:
        self._state, self._handle, self._key, self._function = state, handle, key, function
        self._finish, self._mismatch = finish, mismatch
        self._result: Any = None
        self._outcome: BaseException | None = None
        self._finished = False
        self.contributors = 0   #: after wait(): 0, or how many ranks contributed while some had joined (hp.join)
        self.started_at = 0.0   #: time.monotonic() when its allreduce began (after wait(); 0 if never ran)
        self.finished_at = 0.0  #: time.monotonic() when its allreduce ended

    @property
    def name(self) -> str:
        """The name that matched this operation across ranks."""
        return self._key[1]

    def poll(self) -> bool:
        """True once the operation finished (or failed); never blocks."""
        return self._finished or self._state.engine.poll(self._handle)

    def wait(self) -> Any:
        """Blocks until the operation finished; returns its result (the reduced tensor / array, the
        gathered one, ``(output, received_splits)`` of an alltoall, a list for grouped calls).

        Raises:
            MismatchError: ranks submitted this name with different shapes, dtypes, ops or collectives
                (on every rank).
            HorovodInternalError: the communication thread stopped or failed.
        """
        if not self._finished:
            error, self.started_at, self.finished_at, kind, self.contributors = self._state.engine.wait(self._handle)
            self._state.in_flight.discard(self._key)
            self._state.keep.pop(self._handle, None)
            self._finished = True
            try:
                if error:
                    if kind == core().ErrorKind.Mismatch:
                        raise MismatchError(self._mismatch(error))
                    if kind == core().ErrorKind.Refused:
                        raise MismatchError(f"hp.{self._function}: {error}")
                    if kind == core().ErrorKind.Joined:
                        raise RanksJoined(f"hp.{self._function}: {error}")
                    if kind == core().ErrorKind.Departed:
                        raise PeerShutDownError(f"hp.{self._function}: {error}")
                    if kind == core().ErrorKind.RanksLost:
                        raise self._state.ranks_lost(f"hp.{self._function}: {error}") or \
                            HorovodInternalError(f"hp.{self._function}: {error}")
                    raise HorovodInternalError(f"hp.{self._function}: {error}")
                self._result = self._finish()
            except BaseException as failure:  # raised again by every later wait()
                self._outcome = failure
            finally:
                self._finish = lambda: None
        if self._outcome is not None:
            raise self._outcome
        return self._result

    def __repr__(self) -> str:
        return f"<hp.Handle {self.name!r} {'done' if self._finished else 'in flight'}>"


def queue(state: CommContext, group_id: int, name: str, function: str, submit: Callable[[], int], keep: Any,
          finish: Callable[[], Any], mismatch: Callable[[str], str] = lambda error: error,
          track: bool = True) -> Handle:
    """Submits one operation to the engine (``submit()`` returns the engine's handle) and wraps it."""
    key = (group_id, name)
    if track and key in state.in_flight:  # a ValueError, as Horovod's duplicate-name error
        raise DuplicateNameError(f"hp.{function}: a tensor named {name!r} is already in flight on this group; "
                                 "wait for its handle first or use another name")
    try:
        handle = submit()
    except ValueError as error:  # a name already pending on the engine, an unknown group
        raise ValueError(f"hp.{function}: {error}") from None
    except RuntimeError as error:  # the engine stopped (stall shutdown, MPI failure, lost ranks, shutting down)
        raise state.ranks_lost(f"hp.{function}: {error}") or HorovodInternalError(f"hp.{function}: {error}") from None
    state.keep[handle] = keep
    if track:
        state.in_flight.add(key)
    return Handle(state, handle, key, function, finish, mismatch)


def _call_handle(state: CommContext, group: Any, function: str, name: str, collective: str,
                 work: Callable[[], Any], track: bool) -> Handle:
    group_id = state.engine_group(group, function)
    outcome: dict[str, Any] = {}
    recording = _trace.enabled()

    def job() -> None:
        state.on_engine_thread.inside = True
        start = time.monotonic()
        try:
            outcome["value"] = work()
        except BaseException as error:  # handed to the thread that waits
            outcome["error"] = error
        finally:
            state.on_engine_thread.inside = False
            if recording:
                _trace.record(function, "collective", "collectives", start, time.monotonic(),
                              {"name": name} if track else None)

    def finish() -> Any:
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    kind = zlib.crc32(collective.encode()) & 0x7FFFFFFF

    def mismatch(error: str) -> str:
        return (f"hp.{function}: ranks of the group called different collectives at this point (each rank's kind is "
                f"crc32 of the collective's name; {collective} is {kind}): {error}")

    return queue(state, group_id, name, function, lambda: state.engine.submit_call(group_id, name, kind, job), job,
                 finish, mismatch, track)


def call(group: Any, function: str, work: Callable[[], _Result], collective: str | None = None) -> _Result:
    """Runs ``work()`` (a blocking collective over ``group``) on the engine's communication thread, at
    a point of its sequence that every rank of ``group`` agrees on, and returns its result (or raises
    its exception) here.

    Why: one thread per process makes hybridpipe's MPI calls. With Open MPI, MPI calls from a second
    thread beside the engine's stalled cross-host jobs for minutes (docs/sharp_bits.md), and a
    collective made outside the engine's agreed order could wait for a rank whose engine waits for
    it. Without a running engine (before hp.init's engine starts, after shutdown), or when already on
    the engine thread, ``work()`` simply runs here.

    Args:
        collective: what the ranks must agree they are calling (default: ``function``).

    Raises:
        MismatchError: ranks of the group called different collectives at this point (every rank).
    """
    state = running.current_or_none()
    if state is None or getattr(state.on_engine_thread, "inside", False):
        return work()
    return _call_handle(state, group, function, _CALL_NAME, collective or function, work, track=False).wait()


def submit(group: Any, function: str, name: str | None, work: Callable[[], Any], collective: str) -> Handle:
    """Queues ``work()`` (a blocking collective over ``group``) on the communication thread and returns a
    :class:`Handle` at once; ranks match it by ``name`` (default: the next unnamed name) and must agree on
    ``collective``. ``work`` stays referenced until the handle is waited for (or hp.shutdown)."""
    state = current(function)
    if getattr(state.on_engine_thread, "inside", False):
        raise UsageError(f"hp.{function} cannot be queued from inside a collective running on the "
                         "communication thread")
    check_name(name, function)
    return _call_handle(state, group, function, name if name is not None else unnamed(function), collective, work,
                        track=True)


#: what a collective's local argument checks raise (NotImplementedError: hp.NotSupportedError)
ARGUMENT_ERRORS = (TypeError, ValueError, NotImplementedError)


@contextlib.contextmanager
def refusing(function: str, collective: str, group: Any = None, process_set: Any = None, name: Any = None,
             asynchronous: bool = False) -> Iterator[None]:
    """Runs a collective's rank-local argument checks (the ``with`` body). When one raises a TypeError,
    ValueError or NotSupportedError, this rank still takes its place in the collective: it queues a
    stand-in (``Engine.submit_refusal``) under the name the call would have had, so the other ranks' calls
    fail with a MismatchError naming this rank and its error instead of waiting for it; then the error
    propagates here. A synchronous call waits until the others arrived (so its name is free again); an
    asynchronous one raises at once, as Horovod does.

    ``collective`` is unused by the engine (a refusal mismatches any call) but documents the call site.
    The stand-in goes to ``group`` / ``process_set`` when they are valid here, else to the whole job
    (the ranks of a group this rank cannot even name cannot be reached: they report a stall).
    """
    try:
        yield
    except ARGUMENT_ERRORS as error:
        _refuse(function, group, process_set, name, asynchronous, error)
        raise


def _refuse(function: str, group: Any, process_set: Any, name: Any, asynchronous: bool, error: BaseException) -> None:
    state = running.current_or_none()
    if state is None or getattr(state.on_engine_thread, "inside", False):
        return  # no engine (or a collective nested in one): nobody is waiting through it
    try:
        group_id = state.engine_group(resolve_group(group, process_set, function), function)
    except (HybridPipeError, *ARGUMENT_ERRORS):
        group_id = state.engine_group(None, function)
    if asynchronous:
        key = name if isinstance(name, str) and name else unnamed(function)
        if (group_id, key) in state.in_flight:
            return  # the name is busy here: the error is this rank's own (it reused a name in flight)
    else:
        key = _CALL_NAME
    refusal = f"{type(error).__name__}: {error}"
    try:
        handle = state.engine.submit_refusal(group_id, key, refusal, asynchronous)
    except (ValueError, RuntimeError):  # the name is pending on the engine already, or the engine stopped
        return
    if handle:
        state.engine.wait(handle)  # fails (Refused) once every rank of the group arrived: the name is free

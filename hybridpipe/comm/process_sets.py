"""Horovod's process sets: subsets of the ranks that run collectives together, as hybridpipe groups.

A :class:`ProcessSet` is a list of global ranks (``hp.rank()`` numbers) or an mpi4py communicator.
Registering it — ``hp.init(process_sets=[...])`` or :func:`add_process_set`, collectively on every
rank — gives it an id, the same on every rank, and a private communicator split from hybridpipe's
world, which the communication thread serves like any other group. A process set goes wherever a
``group=`` does: ``hp.allreduce(t, process_set=even)`` and ``hp.allreduce(t, group=even)`` are one call.

Ids: 0 is :data:`global_process_set` (every rank); the sets a program registers are numbered 1, 2, …
in the order they were registered, as in Horovod. The grid's groups are process sets too:
:func:`data_process_set` (id -1: the replicas of my pipeline stage) and :func:`pipe_process_set`
(id -2: the stages of my pipeline); like a set made from a split communicator, their ranks differ
from rank to rank.

Design reasons: the registry lives in the communication context (it owns every communicator), and
registration is one world collective on the communication thread (an allgather of every rank's
member lists, checked, then one ``MPI_Comm_split`` per set), so a set that ranks describe differently
raises :class:`~hybridpipe.errors.MismatchError` on every rank instead of hanging.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

from .. import running
from ..errors import MismatchError

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "find_process_set",
           "data_process_set", "pipe_process_set", "Registry", "SetEntry", "init_argument", "is_communicator"]

GLOBAL_ID, DATA_ID, PIPE_ID = 0, -1, -2
_BUILTIN = {GLOBAL_ID: "world", DATA_ID: "data", PIPE_ID: "pipe"}


def is_communicator(value: Any) -> bool:
    """Whether ``value`` is an mpi4py communicator (without importing mpi4py)."""
    mpi = sys.modules.get("mpi4py.MPI")  # a communicator means its maker imported mpi4py already
    return mpi is not None and isinstance(value, mpi.Comm)


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Args:
        ranks_or_comm: global ranks (``hp.rank()`` numbers; kept sorted), or an mpi4py communicator
            whose ranks belong to hybridpipe's world (each rank passes its own, e.g. the result of a
            ``Split``: then the set's ranks differ from rank to rank).

    Attributes:
        process_set_id: the id once registered (the same on every rank), None before and after
            :func:`remove_process_set` or ``hp.shutdown()``.
        ranks: the global ranks of the set, in the order of its own ranks (for a communicator:
            filled in when registered).
        mpi_comm: the communicator it was made from, or None.

    Example:
        >>> even, odd = hp.ProcessSet([0, 2]), hp.ProcessSet([1, 3])
        >>> hp.init(process_sets=[even, odd])               # mpirun -n 4
        >>> mine = even if even.included() else odd
        >>> hp.allreduce(torch.ones(3), op=hp.Sum, process_set=mine)   # tensor([2., 2., 2.])
    """

    def __init__(self, ranks_or_comm: Iterable[int] | Any) -> None:
        self.process_set_id: int | None = None
        self.ranks: list[int] | None = None
        self.mpi_comm: Any = None
        if is_communicator(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise ValueError(f"hp.ProcessSet takes a list of ranks or an mpi4py communicator, got "
                             f"{type(ranks_or_comm).__name__}") from None
        bad = [r for r in ranks if isinstance(r, bool) or not hasattr(r, "__index__")]
        if bad:
            raise ValueError(f"hp.ProcessSet: ranks must be ints, got {bad[:3]} in {ranks[:8]}")
        ranks = sorted(int(r) for r in ranks)
        duplicates = sorted({r for r in ranks if ranks.count(r) > 1})
        if duplicates:
            raise ValueError(f"hp.ProcessSet: rank(s) {duplicates} appear more than once in {ranks}")
        self.ranks = ranks

    def size(self) -> int | None:
        """Number of ranks in the set; None while it is not registered."""
        if self.process_set_id is None:
            return None
        return len(_registry("ProcessSet.size").entry_of(self, "ProcessSet.size").ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (its position in :attr:`ranks`); None while not registered.

        Collectives over a set still take ``root_rank`` as a global rank, as in Horovod.

        Raises:
            ValueError: this process is not in the set.
        """
        if self.process_set_id is None:
            return None
        registry = _registry("ProcessSet.rank")
        entry = registry.entry_of(self, "ProcessSet.rank")
        if registry.rank not in entry.ranks:
            raise ValueError(f"rank {registry.rank} is not in process set {self.process_set_id} (ranks {entry.ranks}); "
                             f"check process_set.included() first")
        return entry.ranks.index(registry.rank)

    def included(self) -> bool | None:
        """Whether this process belongs to the set; None while its ranks are unknown (a communicator's
        set before registration)."""
        if self.ranks is None:
            return None
        return running.current("ProcessSet.included").grid.rank in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


#: Every rank of the job (id 0); the default of every collective, like Horovod's.
global_process_set = ProcessSet([])
global_process_set.process_set_id = GLOBAL_ID


@dataclass
class SetEntry:
    """A registered set on this rank: its ranks, and its private communicator (None outside the set)."""

    ranks: list[int]
    comm: Any
    label: str
    builtin: str | None = None      # "world", "data" or "pipe": served by the grid's own communicator
    engine_id: int | None = None    # the communication thread's group, once used there
    objects: list[ProcessSet] = field(default_factory=list)
    given_as_ranks: bool = False    # False: made from communicators (its ranks may differ from rank to rank)


class Registry:
    """The process sets of one ``hp.init`` (owned by the communication context)."""

    def __init__(self, grid: Any) -> None:
        self.grid, self.rank = grid, grid.rank
        data = [grid.rank_of(grid.stage, r) for r in range(grid.data_replicas)]
        # a non-uniform grid (stage_replicas) has one pipeline, the whole job
        pipe = [grid.rank_of(s, grid.replica) for s in range(grid.pipeline_stages)] if grid.uniform else \
            list(range(grid.size))
        self.entries: dict[int, SetEntry] = {
            GLOBAL_ID: SetEntry(list(range(grid.size)), grid.world_comm, "world", "world"),
            DATA_ID: SetEntry(data, grid.data_comm, "data", "data"),
            PIPE_ID: SetEntry(pipe, grid.pipe_comm, "pipe", "pipe")}
        global_process_set.ranks = list(range(grid.size))
        self.data, self.pipe = ProcessSet(data), ProcessSet(pipe)
        self.data.process_set_id, self.pipe.process_set_id = DATA_ID, PIPE_ID
        self.entries[DATA_ID].objects.append(self.data)
        self.entries[PIPE_ID].objects.append(self.pipe)
        self.next_id = 1
        self.engine_ids: dict[tuple[int, ...], int] = {}  # members -> engine group, kept for re-added sets

    def entry_of(self, process_set: ProcessSet, function: str) -> SetEntry:
        """The entry of a registered set; ValueError naming the fix otherwise."""
        entry = self.entries.get(process_set.process_set_id) if process_set.process_set_id is not None else None
        if entry is None or (entry.builtin is None and process_set not in entry.objects):
            raise ValueError(f"hp.{function}: {process_set} is not registered: pass it to hp.init(process_sets=[...]) "
                             f"or hp.add_process_set(...) on every rank first")
        return entry

    def member_entry(self, process_set: ProcessSet, function: str) -> SetEntry:
        """The entry of a registered set this rank belongs to (what a collective over it needs)."""
        entry = self.entry_of(process_set, function)
        if entry.comm is None:
            raise ValueError(f"hp.{function}: rank {self.rank} is not in process set {process_set.process_set_id} "
                             f"(ranks {entry.ranks}); only its ranks may call collectives over it "
                             f"(check process_set.included())")
        return entry

    # ------------------------------------------------------------ registration (world collectives)

    def _describe(self, process_set: ProcessSet, function: str) -> tuple[str, list[int], str]:
        """("ranks" | "comm", members in set order, problem or "") for one set on this rank."""
        if process_set.process_set_id is not None:
            return "ranks", [], f"already registered as process set {process_set.process_set_id}"
        if process_set.ranks is not None:
            if not process_set.ranks:
                return "ranks", [], "a process set needs at least one rank"
            outside = [r for r in process_set.ranks if not 0 <= r < self.grid.size]
            if outside:
                return "ranks", process_set.ranks, (f"ranks {outside} are outside the job's {self.grid.size} ranks "
                                                    f"(use 0..{self.grid.size - 1})")
            return "ranks", list(process_set.ranks), ""
        from mpi4py import MPI

        comm = process_set.mpi_comm
        if comm == MPI.COMM_NULL:
            return "comm", [], ""
        theirs, ours = comm.Get_group(), self.grid.world_comm.Get_group()
        translated = MPI.Group.Translate_ranks(theirs, list(range(comm.Get_size())), ours)
        theirs.Free()
        ours.Free()
        if any(r == MPI.UNDEFINED for r in translated):
            return "comm", [], "its communicator has ranks outside hybridpipe's world (build it from hp.init's comm)"
        return "comm", [int(r) for r in translated], ""

    def register_here(self, sets: list[ProcessSet], function: str) -> None:
        """Registers ``sets`` (runs on the communication thread, at a point of world every rank reaches)."""
        from mpi4py import MPI

        world = self.grid.world_comm
        mine = [self._describe(s, function) for s in sets]
        everyone = world.allgather(mine)
        kinds = [[kind for kind, _, _ in described] for described in everyone]
        if len({tuple(k) for k in kinds}) > 1:
            listing = "; ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
            raise MismatchError(f"hp.{function}: ranks passed different process sets ({listing}); every rank must "
                                f"register the same sets in the same order")
        for index, kind in enumerate(kinds[0]):
            lists = [described[index][1] for described in everyone]
            if kind == "ranks" and len({tuple(members) for members in lists}) > 1:
                listing = "; ".join(f"rank {r}: {members}" for r, members in enumerate(lists))
                raise MismatchError(f"hp.{function}: ranks passed different ranks for process set {index} of the "
                                    f"list ({listing}); every rank must pass the same ranks")
            if kind == "comm":
                for r, members in enumerate(lists):
                    if members and (r not in members or any(lists[m] != members for m in members)):
                        listing = "; ".join(f"rank {q}: {m}" for q, m in enumerate(lists))
                        raise MismatchError(f"hp.{function}: the communicators of process set {index} do not agree "
                                            f"on their members ({listing}); pass each rank's own communicator of "
                                            "one split (or MPI.COMM_NULL outside it)")
        problems = [(r, index, problem) for r, described in enumerate(everyone)
                    for index, (_, _, problem) in enumerate(described) if problem]
        if problems:
            r, index, problem = problems[0]
            raise ValueError(f"hp.{function}: process set {index} of the list (on rank {r}): {problem}")
        # sets given as ranks (and the global one) are the same on every rank, so every rank decides alike
        taken = {tuple(e.ranks): pid for pid, e in self.entries.items() if pid == GLOBAL_ID or e.given_as_ranks}
        for index, (kind, members, _) in enumerate(mine):
            if kind == "ranks":
                if tuple(members) in taken:
                    existing = taken[tuple(members)]
                    hint = "that is hp.global_process_set" if existing == GLOBAL_ID else f"use process set {existing}"
                    raise ValueError(f"hp.{function}: a process set with ranks {members} is already registered "
                                     f"(id {existing}; {hint}); Horovod refuses duplicates too")
                taken[tuple(members)] = -100 - index
        for index, (process_set, (kind, members, _)) in enumerate(zip(sets, mine)):
            if kind == "ranks":
                inside = self.rank in members
                color = 0 if inside else MPI.UNDEFINED
            else:
                inside = bool(members)
                color = members[0] if inside else MPI.UNDEFINED
            comm = world.Split(color, members.index(self.rank) if inside else 0)
            if comm == MPI.COMM_NULL:
                comm = None
            else:
                comm.Set_errhandler(MPI.ERRORS_RETURN)
            set_id, self.next_id = self.next_id, self.next_id + 1
            entry = SetEntry(list(members), comm, f"process set {set_id}", None,
                             self.engine_ids.get(tuple(members)) if comm is not None else None, [process_set],
                             kind == "ranks")
            self.entries[set_id] = entry
            process_set.process_set_id = set_id
            if kind == "comm":
                process_set.ranks = list(members)

    def remove_here(self, process_set: ProcessSet, function: str) -> bool:
        """Unregisters ``process_set`` (communication thread, world point); False for the grid's sets or an
        unregistered one."""
        from .._ext import core
        set_id = process_set.process_set_id
        known = set_id is not None and set_id in self.entries and process_set in self.entries[set_id].objects
        fields = [7, set_id if known else -1000]
        if not core().headers_agree(self.grid.world_comm.py2f(), fields,
                                    running.current(function).allreduce_options().wait):
            listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(self.grid.world_comm.allgather(
                set_id if known else None)))
            raise MismatchError(f"hp.{function}: ranks removed different process sets ({listing}); every rank must "
                                "remove the same set at the same point")
        if not known or set_id <= 0:
            return False
        entry = self.entries.pop(set_id)
        if entry.engine_id is not None:
            self.engine_ids[tuple(entry.ranks)] = entry.engine_id  # the thread keeps its group: reuse it
        if entry.comm is not None:
            entry.comm.Free()
        for obj in entry.objects:
            obj.process_set_id = None
        return True

    def close(self) -> None:
        """Frees the sets' communicators and unregisters every set object (hp.shutdown)."""
        for set_id, entry in self.entries.items():
            if entry.builtin is None and entry.comm is not None:
                entry.comm.Free()
            if set_id != GLOBAL_ID:
                for obj in entry.objects:
                    obj.process_set_id = None
        self.entries.clear()


def init_argument(process_sets: Any) -> list[ProcessSet]:
    """hp.init's ``process_sets`` as a list (None and ``"dynamic"``: none); TypeError naming a bad value."""
    if process_sets is None or (isinstance(process_sets, str) and process_sets.lower() == "dynamic"):
        return []
    if isinstance(process_sets, (str, bytes, ProcessSet)) or not hasattr(process_sets, "__iter__"):
        raise TypeError(f"hp.init: process_sets must be a list of hp.ProcessSet or 'dynamic', got {process_sets!r}")
    sets = list(process_sets)
    bad = [s for s in sets if not isinstance(s, ProcessSet)]
    if bad:
        raise TypeError(f"hp.init: process_sets must hold hp.ProcessSet objects, got {bad[0]!r} "
                        f"(make them with hp.ProcessSet([ranks]))")
    return sets


def _registry(function: str) -> Registry:
    return running.current(function).process_sets


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Registers a process set after ``hp.init`` and returns it (Horovod's ``hvd.add_process_set``).

    Collective over every rank of the job: each calls it with the same ranks (or its own communicator
    of one split, or ``MPI.COMM_NULL`` outside it), in the same order relative to other registrations.
    Unlike Horovod, no ``process_sets="dynamic"`` is needed at ``hp.init``.

    Args:
        process_set: a :class:`ProcessSet`, or the global ranks to make one from.

    Returns:
        The registered set (``process_set_id`` set).

    Raises:
        MismatchError: ranks passed different sets (on every rank).
        ValueError: a set with the same ranks is registered already, or ranks are out of range.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    running.current("add_process_set").register_process_sets([process_set], "add_process_set")
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a set added before (collective over every rank, like :func:`add_process_set`).

    Returns:
        True if it was removed; False for the global and the grid's sets or an unregistered one.
    """
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"hp.remove_process_set takes a hp.ProcessSet, got {type(process_set).__name__}")
    return running.current("remove_process_set").remove_process_set(process_set)


def find_process_set(ranks: Iterable[int]) -> ProcessSet | None:
    """The registered process set made of exactly these global ranks (:data:`global_process_set` for every
    rank), or None. Only sets given as ranks count, so every rank gets the same answer.
    """
    registry = _registry("find_process_set")
    wanted = sorted(int(r) for r in ranks)
    for set_id, entry in registry.entries.items():
        if (set_id == GLOBAL_ID or entry.given_as_ranks) and entry.ranks == wanted:
            return global_process_set if set_id == GLOBAL_ID else entry.objects[0]
    return None


def data_process_set() -> ProcessSet:
    """The replicas of this rank's pipeline stage as a process set (id -1; the group ``"data"``)."""
    return _registry("data_process_set").data


def pipe_process_set() -> ProcessSet:
    """The stages of this rank's pipeline as a process set (id -2; the group ``"pipe"``)."""
    return _registry("pipe_process_set").pipe

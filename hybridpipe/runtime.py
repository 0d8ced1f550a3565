"""The MPI runtime: init / shutdown, the rank grid of pipeline stages × data replicas.

Rank mapping: ``stage = rank % pipeline_stages`` and ``replica = rank // pipeline_stages``. The P
stages of one pipeline are consecutive ranks, so when mpirun packs ranks by node (its default,
and what `hybridpipe-run` asks for) a pipeline's neighbours share a node and activations move
through shared memory, while the data-parallel allreduce of a stage crosses nodes.

A grid whose stages have their own replica counts (``hp.init(stage_replicas=[3, 1])``, PipeDream's
"3-1") numbers its ranks the same way: replica 0 of every stage, then replica 1 of every stage that
has one, and so on ([3, 1]: stage 0 on ranks 0, 2, 3 and stage 1 on rank 1), so that a uniform
``stage_replicas`` gives exactly the grid of ``pipeline_stages``.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import sys
import warnings
from typing import Any

import numpy as np

from . import running
from .config import Config
from .errors import GridError

__all__ = ["Grid", "layout", "rank_of_place", "describe_stage_replicas", "parse_stage_replicas", "init", "shutdown",
           "is_initialized", "abandon", "Survivors", "go_on_without_lost", "job", "grid", "rank", "size", "local_rank", "local_size", "config"]


@dataclasses.dataclass(frozen=True)
class Grid:
    """This rank's place in the pipeline_stages × data_replicas grid.

    Attributes:
        pipeline_stages: P, stages per pipeline.
        data_replicas: D, copies of my stage (world size = P × D on a uniform grid).
        stage: this rank's stage, 0 ≤ stage < P.
        replica: this rank's replica (which pipeline it belongs to), 0 ≤ replica < D.
        rank: rank in the communicator given to ``hp.init`` (default COMM_WORLD).
        size: P × D (on a non-uniform grid, the sum of ``stage_replicas``).
        world_comm: hybridpipe's private duplicate of that communicator.
        pipe_comm: the P ranks of my replica, ranked by stage (rank in it == stage); on a non-uniform
            grid, every rank (one pipeline spans the job), ranked as in ``world_comm``.
        data_comm: the D ranks of my stage, ranked by replica (rank in it == replica).
        stage_replicas: every stage's replica count, e.g. ``(3, 1)``; ``(D,) * P`` on a uniform grid.

    Example:
        >>> g = hp.init(pipeline_stages=2)     # mpirun -np 4 → 2 stages × 2 replicas
        >>> g.stage, g.replica, g.rank_of(stage=1, replica=0)
        (0, 1, 1)
    """

    pipeline_stages: int
    data_replicas: int
    stage: int
    replica: int
    rank: int
    size: int
    world_comm: Any = dataclasses.field(repr=False, compare=False)
    pipe_comm: Any = dataclasses.field(repr=False, compare=False)
    data_comm: Any = dataclasses.field(repr=False, compare=False)
    stage_replicas: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.stage_replicas:
            object.__setattr__(self, "stage_replicas", (self.data_replicas,) * self.pipeline_stages)

    @property
    def uniform(self) -> bool:
        """Whether every stage has the same number of replicas (a P × D grid)."""
        return len(set(self.stage_replicas)) == 1

    @property
    def config(self) -> str:
        """The grid as PipeDream writes it: ``"3-1"`` (replicas per stage), ``"straight"`` (one rank per
        stage), or ``"4"`` (one stage: data parallelism)."""
        return describe_stage_replicas(self.stage_replicas)

    def rank_of(self, stage: int, replica: int) -> int:
        """The rank that holds ``stage`` of pipeline ``replica``."""
        if not (0 <= stage < self.pipeline_stages and 0 <= replica < self.stage_replicas[stage]):
            shape = f"{self.pipeline_stages} × {self.data_replicas}" if self.uniform else self.config
            raise GridError(f"(stage={stage}, replica={replica}) is outside the {shape} grid")
        if self.uniform:
            return replica * self.pipeline_stages + stage
        return rank_of_place(self.stage_replicas)[(stage, replica)]

    def place_of(self, rank: int) -> tuple[int, int]:
        """``(stage, replica)`` of ``rank``."""
        if not 0 <= rank < self.size:
            raise GridError(f"rank {rank} is outside 0..{self.size - 1}")
        return layout(self.stage_replicas)[rank]

    def ranks_of_stage(self, stage: int) -> list[int]:
        """The ranks holding ``stage``, by replica."""
        return [self.rank_of(stage, replica) for replica in range(self.stage_replicas[stage])]

    def pipeline_peers(self) -> list[int]:
        """The ranks this rank may exchange pipeline messages with: my replica's other stages, or on a
        non-uniform grid (micro-batches go round-robin over each stage's replicas) every rank of another stage."""
        if self.uniform:
            return [self.rank_of(stage, self.replica) for stage in range(self.pipeline_stages) if stage != self.stage]
        return [rank for stage in range(self.pipeline_stages) if stage != self.stage
                for rank in self.ranks_of_stage(stage)]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline_stages - 1

    def table(self) -> str:
        """The grid as text: one row per stage, one column per replica, cells are ranks."""
        widest = max(self.stage_replicas)
        header = "stage \\ replica " + " ".join(f"{r:>5}" for r in range(widest))
        rows = [f"{s:>15} " + " ".join(f"{self.rank_of(s, r):>5}" if r < self.stage_replicas[s] else f"{'-':>5}"
                                       for r in range(widest)).rstrip(" -")
                for s in range(self.pipeline_stages)]
        return "\n".join([header, *rows])


@functools.lru_cache(maxsize=16)
def layout(stage_replicas: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(stage, replica)`` of each rank: replica 0 of every stage, then replica 1 of the stages that have one,
    and so on (for equal counts, ``rank = replica × P + stage``)."""
    return [(stage, replica) for replica in range(max(stage_replicas)) for stage, count in enumerate(stage_replicas)
            if replica < count]


@functools.lru_cache(maxsize=16)
def rank_of_place(stage_replicas: tuple[int, ...]) -> dict[tuple[int, int], int]:
    """The rank of each ``(stage, replica)`` of :func:`layout` (do not mutate: cached)."""
    return {place: rank for rank, place in enumerate(layout(stage_replicas))}


def describe_stage_replicas(stage_replicas: Any) -> str:
    """PipeDream's name of a configuration: ``"15-1"``, ``"straight"`` (every count 1), ``"16"`` (one stage)."""
    counts = list(stage_replicas)
    if len(counts) == 1:
        return str(counts[0])
    if all(count == 1 for count in counts):
        return "straight"
    return "-".join(str(count) for count in counts)


def parse_stage_replicas(value: Any, size: int | None = None, where: str = "stage_replicas") -> tuple[int, ...]:
    """``[3, 1]``, ``(3, 1)`` or ``"3,1"`` / ``"3-1"`` → ``(3, 1)``; checked (positive ints, summing to ``size``)."""
    if isinstance(value, str):
        parts = [part.strip() for part in value.replace("-", ",").split(",") if part.strip()]
        try:
            counts = [int(part) for part in parts]
        except ValueError:
            raise GridError(f"{where}={value!r} is not a list of replica counts; write e.g. 3,1 (stage 0 on 3 ranks, "
                            "stage 1 on 1)") from None
    elif isinstance(value, (list, tuple)):
        counts = list(value)
    else:
        raise GridError(f"{where} must be a list of replica counts per stage, e.g. [3, 1], got {value!r}")
    if not counts or any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1 for c in counts):
        raise GridError(f"{where}={value!r}: every stage needs a replica count >= 1 (e.g. [3, 1])")
    counts = [int(c) for c in counts]
    if size is not None and sum(counts) != size:
        raise GridError(f"{where}={value!r} sums to {sum(counts)} ranks but the job has {size}: the counts must add "
                        f"up to the world size (launch with -np {sum(counts)}, or change the counts)")
    return tuple(counts)


def _agree_on_stages(comm: Any, pipeline_stages: int) -> None:
    """Every rank must ask for the same grid; otherwise raise on every rank (no hang)."""
    from mpi4py import MPI

    mine = np.array([pipeline_stages, -pipeline_stages], dtype=np.int64)
    both = np.empty_like(mine)
    comm.Allreduce(mine, both, op=MPI.MAX)
    if both[0] != -both[1]:
        values = comm.allgather(pipeline_stages)
        listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise GridError(f"ranks passed different pipeline_stages to hp.init ({listing}); "
                        f"every rank must call hp.init with the same pipeline_stages")


def _agree_on_replicas(comm: Any, stage_replicas: tuple[int, ...]) -> None:
    """Every rank must ask for the same replica counts; otherwise raise on every rank (no hang)."""
    values = comm.allgather(stage_replicas)
    if len(set(values)) > 1:
        listing = ", ".join(f"rank {r}: {list(v) if v else None}" for r, v in enumerate(values))
        raise GridError(f"ranks passed different stage_replicas to hp.init ({listing}); every rank must call "
                        "hp.init with the same stage_replicas")


def init(pipeline_stages: int | None = None, comm: Any = None, config: Config | None = None,
         process_sets: Any = None, stage_replicas: Any = None) -> Grid:
    """Starts hybridpipe on ``comm`` (default ``MPI.COMM_WORLD``) and builds the rank grid.

    Collective: every rank of ``comm`` must call it with the same ``pipeline_stages``. Calling it
    again with the same grid returns the existing grid (like ``hvd.init()``).

    Args:
        pipeline_stages: P, the number of pipeline stages; the world size must be a multiple of P,
            and data_replicas = size // P. Default: $HYBRIDPIPE_PIPELINE_STAGES (what
            ``hybridpipe-run --stages`` sets), else 1. An mpi4py communicator here is taken as
            ``comm`` (Horovod's ``hvd.init(comm)``).
        comm: an mpi4py communicator to build the grid from.
        config: settings; default ``Config.from_env()`` (the HYBRIDPIPE_* variables).
        process_sets: hp.ProcessSet objects to register (Horovod's ``hvd.init(process_sets=...)``;
            ids 1, 2, … in list order), or ``"dynamic"`` (accepted; hp.add_process_set always works).
        stage_replicas: each stage's own replica count, e.g. ``[3, 1]`` (PipeDream's "3-1"): the counts sum
            to the world size, and ``pipeline_stages`` (if given) is their number. Every rank then passes the
            whole mini-batch to ``train_step``; micro-batch m runs on replica ``m mod stage_replicas[s]`` of
            stage s. Default: $HYBRIDPIPE_STAGE_REPLICAS (``hybridpipe-run --stage-replicas 3,1``), else a
            uniform grid.

    Returns:
        This rank's Grid.

    Raises:
        GridError: stages < 1, size not divisible by stages, ranks disagreeing, or an earlier
            init with another grid.
        BuildError: the extension is missing or built against another MPI.
    """
    from . import comm as communication
    from .comm import engine

    if communication.process_sets.is_communicator(pipeline_stages) and comm is None:  # Horovod's hvd.init(comm)
        pipeline_stages, comm = None, pipeline_stages
    sets = communication.process_sets.init_argument(process_sets)
    request = _GridRequest.of(pipeline_stages, stage_replicas)
    pipeline_stages, stage_replicas = request.stages, request.replicas
    from mpi4py import MPI

    from . import _ext

    _ext.core()  # refuse a missing or mismatched extension before anything else
    base = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(base, MPI.Intracomm):
        raise TypeError(f"hp.init(comm=...) needs an mpi4py intracommunicator, got {type(base).__name__}")
    if running.current_or_none() is not None:
        return _existing_grid(base, pipeline_stages, stage_replicas, sets)
    if base.Get_rank() == 0:
        request.warn_overrides(base.Get_size())
    stage_replicas = _agreed_layout(base, pipeline_stages, stage_replicas)
    the_grid, local_comm = _build_grid(base, pipeline_stages, stage_replicas)
    settings = (config or Config.from_env()).validated()
    communication.device.set_device(local_comm.Get_rank(), settings.set_device)
    the_job = communication.start(settings, the_grid, base, local_comm)  # the running job from here on
    from . import _trace as timeline

    try:
        if settings.timeline:
            timeline.start(the_job, settings.timeline, engine.world_barrier(the_grid))
        if sets:  # a failure here is the same on every rank (the sets are checked together), so all shut down
            the_job.register_process_sets(sets, "init")
    except BaseException:
        shutdown()
        raise
    # hp.shutdown at exit, before mpi4py's MPI_Finalize (atexit is last-in, first-out); hp.shutdown unregisters it
    atexit.register(_shutdown_at_exit)
    _report_outcome(the_grid.size)
    return the_grid


#: where ``hybridpipe-run --elastic`` reads how its ranks ended (see :func:`_report_outcome`)
OUTCOME_DIR_ENV = "HYBRIDPIPE_OUTCOME_DIR"


def _report_outcome(size: int) -> None:
    """Under ``hybridpipe-run --elastic`` (``$HYBRIDPIPE_OUTCOME_DIR``): this process's file there says ``running
    SIZE`` from each hp.init on (SIZE: that job's size), and ``exit CODE SIZE`` once the program ended (CODE 1
    after an uncaught exception, else 0). Under ``mpirun --with-ft ulfm`` a rank killed or an ``MPI_Abort`` leaves
    mpirun's exit code 0, so the launcher judges the job by these files: it succeeded when every rank of the last
    job ended with 0 (the survivors of hp.elastic.run's recovery, say), and failed when one did not end (aborted,
    killed, still in the old job)."""
    directory = os.environ.get(OUTCOME_DIR_ENV)
    if not directory:
        return
    path = os.path.join(directory, f"rank-{os.getpid()}")
    with open(path, "w") as out:
        out.write(f"running {size}\n")

    def ended() -> None:
        code = 1 if getattr(sys, "last_value", None) is not None else 0
        try:
            with open(path) as written:
                words = written.read().split()
            if words[:1] == ["running"]:  # (each hp.init registers this: the first at exit writes)
                with open(path, "w") as out:
                    out.write(f"exit {code} {words[1]}\n")
        except OSError:
            pass

    atexit.register(ended)


def _existing_grid(base: Any, pipeline_stages: int, stage_replicas: tuple[int, ...] | None, sets: list) -> Grid:
    """:func:`init` again: the running grid if it is the one asked for (registering ``sets``), else a GridError."""
    from mpi4py import MPI

    the_job = running.current("init")
    current = the_job.grid
    same_comm = MPI.Comm.Compare(the_job.base_comm, base) in (MPI.IDENT, MPI.CONGRUENT)
    same_replicas = stage_replicas is None or tuple(stage_replicas) == current.stage_replicas
    if current.pipeline_stages == pipeline_stages and same_replicas and same_comm:
        unregistered = [s for s in sets if s.process_set_id is None]
        if unregistered:
            the_job.register_process_sets(unregistered, "init")
        return current
    raise GridError(
        f"hybridpipe is already initialized with pipeline_stages={current.pipeline_stages} on "
        f"{current.size} ranks; hp.init(pipeline_stages={pipeline_stages}) asks for another grid "
        f"(call hp.shutdown() first)")


@dataclasses.dataclass(frozen=True)
class _GridRequest:
    """What :func:`init` was asked for, the launcher's variables (``hybridpipe-run --stages`` / ``--stage-replicas``)
    filling in what the call left out: ``stages`` and ``replicas`` (own counts per stage, or None)."""

    stages: int
    replicas: tuple[int, ...] | None
    launcher_stages: str
    launcher_replicas: str
    overrides_stages: bool    # hp.init(pipeline_stages=...) given while the launcher set --stages
    ignores_replicas: bool    # hp.init(pipeline_stages=...) given while the launcher set --stage-replicas

    @classmethod
    def of(cls, pipeline_stages: Any, stage_replicas: Any) -> _GridRequest:
        launcher_replicas = os.environ.get("HYBRIDPIPE_STAGE_REPLICAS", "").strip()
        if stage_replicas is None and pipeline_stages is None and launcher_replicas:
            stage_replicas = parse_stage_replicas(launcher_replicas, where="HYBRIDPIPE_STAGE_REPLICAS")
        ignores_replicas = stage_replicas is None and launcher_replicas != ""  # hp.init(pipeline_stages=...) given
        if stage_replicas is not None:
            stage_replicas = parse_stage_replicas(stage_replicas)
            if pipeline_stages is not None and pipeline_stages != len(stage_replicas):
                raise GridError(f"hp.init(pipeline_stages={pipeline_stages}, stage_replicas={list(stage_replicas)}): "
                                f"{len(stage_replicas)} replica counts for {pipeline_stages} stages; pass one count "
                                "per stage, or stage_replicas alone")
        launcher_stages = os.environ.get("HYBRIDPIPE_PIPELINE_STAGES", "").strip()
        overrides = pipeline_stages is not None and launcher_stages != ""
        if pipeline_stages is None:
            text = launcher_stages or "1"
            try:
                pipeline_stages = int(text)
            except ValueError:
                raise GridError(f"HYBRIDPIPE_PIPELINE_STAGES={text!r} is not an integer (set it to the number of "
                                "pipeline stages, e.g. 2, or pass hp.init(pipeline_stages=...))") from None
        if isinstance(pipeline_stages, bool) or not isinstance(pipeline_stages, (int, np.integer)):
            raise GridError(f"pipeline_stages must be an int, got {pipeline_stages!r} "
                            f"({type(pipeline_stages).__name__})")
        stages = len(stage_replicas) if stage_replicas is not None else int(pipeline_stages)
        return cls(stages, None if stage_replicas is None else tuple(stage_replicas), launcher_stages,
                   launcher_replicas, overrides, ignores_replicas)

    def warn_overrides(self, size: int) -> None:
        """Warns (world rank 0) where the call overrides what the launcher set."""
        stages = self.stages
        if self.overrides_stages and self.launcher_stages != str(stages):
            replicas = f"{size // stages}" if stages > 0 and size % stages == 0 else "?"
            warnings.warn(f"hp.init(pipeline_stages={stages}) overrides HYBRIDPIPE_PIPELINE_STAGES="
                          f"{self.launcher_stages} (what `hybridpipe-run --stages {self.launcher_stages}` sets): the "
                          f"job runs {stages} stage(s) × {replicas} replica(s) of {size} ranks; call hp.init() without "
                          f"pipeline_stages to follow --stages, or launch with --stages {stages}", stacklevel=3)
        if self.ignores_replicas:
            warnings.warn(f"hp.init(pipeline_stages={stages}) overrides HYBRIDPIPE_STAGE_REPLICAS="
                          f"{self.launcher_replicas} (what `hybridpipe-run --stage-replicas {self.launcher_replicas}` "
                          "sets): the job runs a uniform grid; call hp.init() without pipeline_stages to follow "
                          "--stage-replicas", stacklevel=3)


def _agreed_layout(base: Any, pipeline_stages: int, stage_replicas: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """Checks the grid on every rank of ``base`` (the same everywhere, and fitting the world size); returns the
    own replica counts, or None for a uniform grid (also when every count is the same)."""
    size = base.Get_size()
    if pipeline_stages < 1:
        raise GridError(f"pipeline_stages must be >= 1, got {pipeline_stages} (use 1 for pure data parallelism)")
    _agree_on_stages(base, pipeline_stages)
    if stage_replicas is not None:
        _agree_on_replicas(base, stage_replicas)
        parse_stage_replicas(list(stage_replicas), size)  # the counts must add up to the world size
        if len(set(stage_replicas)) == 1:
            stage_replicas = None  # a uniform grid: exactly the grid of pipeline_stages
    if stage_replicas is None and size % pipeline_stages:
        smaller = max(d for d in range(1, pipeline_stages + 1) if size % d == 0)
        bigger = (size // pipeline_stages + 1) * pipeline_stages
        raise GridError(f"world size {size} is not divisible by pipeline_stages {pipeline_stages} "
                        f"(pass -np {bigger} or --stages {smaller})")
    return stage_replicas


def _build_grid(base: Any, pipeline_stages: int, stage_replicas: tuple[int, ...] | None) -> tuple[Grid, Any]:
    """This rank's :class:`Grid` over a duplicate of ``base`` (its world, pipe and data communicators), and the
    communicator of its host's ranks."""
    from mpi4py import MPI

    size = base.Get_size()
    world = base.Dup()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    rank = world.Get_rank()
    if stage_replicas is None:
        stage, replica = rank % pipeline_stages, rank // pipeline_stages
        pipe_comm = world.Split(color=replica, key=stage)
        counts = (size // pipeline_stages,) * pipeline_stages
    else:  # one pipeline spans the job: micro-batches go round-robin over each stage's replicas
        stage, replica = layout(stage_replicas)[rank]
        pipe_comm = world.Dup()
        counts = tuple(stage_replicas)
    data_comm = world.Split(color=stage, key=replica)
    local_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    grid = Grid(pipeline_stages=pipeline_stages, data_replicas=counts[stage], stage=stage, replica=replica, rank=rank,
                size=size, world_comm=world, pipe_comm=pipe_comm, data_comm=data_comm, stage_replicas=counts)
    return grid, local_comm


def shutdown() -> None:
    """Frees hybridpipe's communicators. MPI itself stays up (mpi4py finalizes it at exit)."""
    _shutdown(failed=False)


def _shutdown_at_exit() -> None:
    """hp.shutdown at interpreter exit; after an uncaught exception (``sys.last_value``, set before atexit
    handlers run) the ranks waiting for this one are told that it failed, not that it shut down."""
    _shutdown(failed=getattr(sys, "last_value", None) is not None)


def _shutdown(failed: bool) -> None:
    the_job = running.current_or_none()
    if the_job is None:
        return
    from . import _trace as timeline
    from . import comm
    from .comm import engine

    atexit.unregister(_shutdown_at_exit)
    events = comm.stop(failed)  # collective: every rank's engine agrees to stop; frees user duplicates
    timeline.stop(the_job, events, engine.world_barrier(the_job.grid))
    _free_communicators(the_job)


def _free_communicators(the_job: Any, revoke: bool = False) -> None:
    """Frees the job's own communicators (``revoke``: revoked first, after ranks died: nothing is agreed with them)."""
    g = the_job.grid
    for c in (g.data_comm, g.pipe_comm, the_job.local_comm, g.world_comm):
        if revoke:
            c.Revoke()
        c.Free()


def abandon() -> tuple[Any, Config]:
    """Ends the running job after ranks of it died (hp.elastic.run, surviving failures), without a collective: its
    engine is abandoned and its communicators revoked and freed; the timeline is dropped. Returns the communicator
    hp.init was given and the settings, for the survivors' next hp.init over the shrunk communicator."""
    the_job = running.current("elastic.run")
    from . import comm

    atexit.unregister(_shutdown_at_exit)
    comm.stop(lost=True)
    _free_communicators(the_job, revoke=True)
    return the_job.base_comm, the_job.config


@dataclasses.dataclass(frozen=True)
class Survivors:
    """What :func:`go_on_without_lost` did: the job's size before and after, the ranks that died (ranks of the old
    job) and their hosts, and the new grid."""

    old_size: int
    new_size: int
    lost: tuple[int, ...]
    lost_hosts: tuple[str, ...]
    grid: Grid


def go_on_without_lost(function: str = "elastic.run") -> Survivors:
    """After the engine lost ranks (it survives failures inside hp.elastic.run): ends the broken job without a
    collective over the dead (:func:`abandon`), shrinks the communicator hp.init was given to the survivors
    (ULFM's ``MPI_Comm_shrink``, fault tolerant itself) and calls hp.init over it with the same settings.
    Collective over the survivors. A pipeline's survivors keep their stages: the new grid has, for each stage, the
    replicas that are left (2 × 2 less a rank of stage 1: ``stage_replicas=[2, 1]``), numbered in their old order,
    and the shrunk communicator is re-ranked to that grid's layout. A stage with no replica left, or any other
    failure while this runs, ends the job with a message (``MPI_Abort``), never a hang."""
    from mpi4py import MPI

    the_job = job(function)
    old = the_job.grid
    hosts = list(the_job.engine.hosts())
    try:
        base, settings = abandon()
        _bound_finalize_after_lost()
        shrunk = base.Shrink()
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        kept = MPI.Group.Translate_ranks(shrunk.Get_group(), list(range(shrunk.Get_size())), base.Get_group())
        lost = tuple(sorted(set(range(base.Get_size())) - set(kept)))
        if old.pipeline_stages == 1:
            new_grid = init(comm=shrunk, config=settings, pipeline_stages=1)
        else:
            # (a grid rank is the rank in the communicator hp.init was given)
            counts, key = _surviving_grid(old, list(kept), base.Get_rank(), function)
            placed = shrunk.Split(0, key)
            placed.Set_errhandler(MPI.ERRORS_RETURN)
            shrunk.Free()
            new_grid = init(comm=placed, config=settings, stage_replicas=list(counts))
    except Exception as error:  # noqa: BLE001 - a second failure during recovery: end the job, never hang
        sys.stderr.write(f"hybridpipe ERROR: rank {old.rank}: hp.{function} could not go on without the lost ranks "
                         f"({type(error).__name__}: {error}): aborting the job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        raise
    return Survivors(old.size, new_grid.size, lost, tuple(hosts[r] if r < len(hosts) else "?" for r in lost),
                     new_grid)


def _surviving_grid(old: Grid, survivors: list[int], me: int, function: str) -> tuple[tuple[int, ...], int]:
    """The grid a pipeline's ``survivors`` (old grid ranks) go on as: each stage's replica count, and ``me``'s rank in
    it (its place ``(stage, replica)`` in the layout, the replicas of a stage numbered in their old order)."""
    places = [old.place_of(rank) for rank in sorted(survivors)]
    counts = tuple(sum(1 for stage, _ in places if stage == s) for s in range(old.pipeline_stages))
    if 0 in counts:
        gone = [s for s, count in enumerate(counts) if count == 0]
        raise GridError(f"hp.{function}: no replica of pipeline stage(s) {gone} is left (grid {old.config}, "
                        f"survivors {sorted(survivors)}): their layers are gone; restart the job from its last "
                        "checkpoint (hybridpipe-run --restarts N --checkpoint-dir DIR)")
    stage, replica = old.place_of(me)
    new_replica = sorted(r for s, r in places if s == stage).index(replica)
    return counts, rank_of_place(counts)[(stage, new_replica)]


FINALIZE_GRACE_SECONDS = 15.0  # from interpreter exit, after ranks died, to the end of MPI_Finalize at the latest


def _bound_finalize_after_lost() -> None:
    """Arms the survivors' bound on their exit: at interpreter exit a native thread ends the
    process :data:`FINALIZE_GRACE_SECONDS` later if it still runs. Open MPI 5's MPI_Finalize (mpi4py's, after
    every atexit handler) runs a PMIx fence over every process the job started, and once a process died that fence
    at times never completes (1 run in 10-30 of tests/test_elastic_inprocess.py: both survivors asleep in
    ``ompi_mpi_finalize`` after they had written and printed everything; open-mpi/ompi#11404). The exit status is
    the one the program would have had: 1 after an uncaught exception, else 0. Armed again at each recovery: the
    first bound to pass ends the process, the others with it."""

    def arm() -> None:
        from . import _ext

        code = 1 if getattr(sys, "last_value", None) is not None else 0
        _ext.core().exit_if_alive_after(
            FINALIZE_GRACE_SECONDS, f"hybridpipe: process {os.getpid()}: MPI_Finalize had not returned "
            f"{FINALIZE_GRACE_SECONDS:g} s after the program ended (after ranks of the job died, Open MPI's "
            f"finalize can wait for the dead for ever: open-mpi/ompi#11404); exiting with status {code}", code)

    atexit.register(arm)


def regrid(function: str, **arguments: Any) -> Grid:
    """Re-makes the running job with another grid (``arguments`` as :func:`init` takes them: ``pipeline_stages``
    or ``stage_replicas``), on the same communicator and with the same settings; collective. ``hp.auto`` does
    this when its plan's grid is not the one running.

    Whatever was made on the old grid ends with it, so it is refused (GridError on every rank, naming
    ``hp.<function>`` and the fix) while the job holds what a user made on it: registered process sets or
    communicators of their own."""
    the_job = job(function)
    made = the_job.made_on_grid()
    if made:
        raise GridError(f"hp.{function}: the plan needs the grid {arguments}, not the running "
                        f"{the_job.grid.pipeline_stages} stage(s) × {the_job.grid.data_replicas} replica(s), and "
                        f"re-making it would end what was made on this one ({'; '.join(made)}): call hp.{function} "
                        "before making them, or start the job with the plan's grid (hp.init(**plan.init_arguments()))")
    base, config = the_job.base_comm, the_job.config
    shutdown()
    return init(comm=base, config=config, **arguments)


def is_initialized() -> bool:
    """Whether hp.init() has run (and hp.shutdown() has not)."""
    return running.current_or_none() is not None


def job(function: str) -> Any:
    """The running job: the one object that holds everything hp.init made (``grid``, ``config``,
    ``local_comm``, the engine, ...: a :class:`hybridpipe.comm.CommContext`); NotInitializedError naming
    ``hp.<function>`` before hp.init."""
    return running.current(function)


def grid() -> Grid:
    """This rank's Grid (see :class:`Grid`)."""
    return job("grid").grid


def rank() -> int:
    """Rank in the communicator hybridpipe was initialized on."""
    return job("rank").grid.rank


def size() -> int:
    """Number of ranks (pipeline_stages × data_replicas)."""
    return job("size").grid.size


def local_rank() -> int:
    """Rank among the ranks on this node (MPI_COMM_TYPE_SHARED); use it to pick a GPU."""
    return job("local_rank").local_comm.Get_rank()


def local_size() -> int:
    """Number of ranks on this node."""
    return job("local_size").local_comm.Get_size()


def config() -> Config:
    """The settings in force (from hp.init(config=...) or the HYBRIDPIPE_* variables)."""
    return job("config").config


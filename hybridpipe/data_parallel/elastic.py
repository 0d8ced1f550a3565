"""Horovod's elastic API (``hvd.elastic.run``, ``TorchState``, ``ObjectState``, ``HostsUpdatedInterrupt``): in-process
recovery from a dead rank under ULFM for data parallelism, restarts from checkpoints otherwise.

What it does here, and what differs from Horovod's in-process elastic training:

* ``state.commit()`` keeps an in-memory copy of the model, the optimizer and the extra attributes, and,
  when the job runs with a checkpoint directory (``hybridpipe-run --checkpoint-dir DIR``, i.e.
  ``$HYBRIDPIPE_CHECKPOINT_DIR``), also writes them as a checkpoint (:func:`hybridpipe.save_checkpoint`).
* ``@hvd.elastic.run`` first resumes from the latest such checkpoint (after a restart), then syncs the
  state from rank 0 and calls the training function. A collective that fails inside it with
  ``HorovodInternalError`` (ranks that disagreed, a group stopped for a stall) rolls every rank back to
  the last commit and calls the function again, in the same processes, as Horovod does.
* A rank that dies, inside ``run`` under Open MPI with ULFM launched with ``mpirun --with-ft ulfm``
  (:func:`survives_failures`): the survivors go on in the same processes, as in Horovod; a pipeline's keep their
  stages and go on as the grid that is left (``runtime.go_on_without_lost``), each PipelineModel rebinding to it
  before the optimizers do. Their communication threads fail the pending and later operations with
  :class:`~hybridpipe.errors.RanksLostError` and revoke their communicators instead of aborting; ``run`` ends the
  broken job without collectives, shrinks the world to the survivors, calls ``hp.init`` over it, rebinds the
  ``DistributedOptimizer`` objects, restores the last commit, runs the reset callbacks, syncs from the new rank 0 and
  calls the function again, logging on rank 0 the old and new size, who died and the seconds it took.
* Everything else a dead rank ends: a stage with no replica left, ``zero=``
  (a ``NotSupportedError`` after the survivors re-formed), MPICH, or a launch without
  ``--with-ft ulfm`` (``hybridpipe-run``'s ``--mca mpi_ft_enable 1`` alone lets its launcher end every rank): the
  communication thread aborts the job naming it, and ``hybridpipe-run --restarts N`` starts it again — on the
  hosts that are left, with a grid that fits — where ``run`` resumes from the last committed checkpoint (seconds
  instead of Horovod's in-process reset). Hosts are not added while the job runs: ``HostsUpdatedInterrupt``
  exists for Horovod's scripts and is raised only by your own code (``check_host_updates`` never sees a change).
* ``ElasticSampler`` (sampler.py), a keyword of the state, cuts the epoch for the grid the job runs on after a reset.
* Around a ``PipelineModel``, ``sync`` broadcasts the model and optimizer within each stage's replicas
  (``group="data"``, each stage from its own replica 0): the stages hold different layers. The fp16
  loss scaler (``model.scaler``) is committed, restored and synced with them.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import time
from typing import Any, Callable

import torch

from .. import checkpoint, runtime
from .._ext import core
from ..errors import HorovodInternalError, HostsUpdatedInterrupt, NotInitializedError, RanksLostError, UsageError
from ..gradient_sync import drivers_of
from ..collectives.allgather import allgather_object
from ..collectives.broadcast import broadcast_object
from .optimizer import broadcast_optimizer_state, broadcast_parameters
from .sampler import ElasticSampler

__all__ = ["run", "survives_failures", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"]


class State:
    """The state ``run`` rolls back and syncs: ``commit()``, ``restore()``, ``sync()``, reset callbacks.

    The last :data:`KEPT_COMMITS` commits are kept in memory, numbered: when ranks die, the survivors may stand one
    commit apart (one had committed a step whose collectives another did not see end), and they roll back to the
    newest commit every one of them holds (:meth:`restore_commit`)."""

    KEPT_COMMITS = 2

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._commits = 0
        self._kept: list[tuple[int, Any]] = []  # (commit number, snapshot), oldest first

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions called after a roll back (``on_reset``), e.g. to rebuild a learning-rate schedule."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state (in memory; as a checkpoint too with ``$HYBRIDPIPE_CHECKPOINT_DIR``), then checks
        for host updates. Collective: every rank commits together."""
        self.save()
        self._commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises HostsUpdatedInterrupt here when hosts changed; a hybridpipe job's hosts do not."""

    def _snapshot(self) -> Any:
        raise NotImplementedError

    def _apply(self, snapshot: Any) -> None:
        raise NotImplementedError

    def _keep(self, number: int) -> None:
        self._kept = self._kept[-(self.KEPT_COMMITS - 1):] + [(number, self._snapshot())]

    def save(self) -> None:
        """Keeps the state as the next commit (in memory)."""
        self._keep(self._commits + 1)

    def restore(self) -> None:
        """Back to the last commit."""
        self._apply(self._kept[-1][1])

    def kept_commits(self) -> list[int]:
        """The numbers of the commits held in memory (oldest first)."""
        return [number for number, _ in self._kept]

    def restore_commit(self, number: int) -> None:
        """Back to commit ``number`` (one of :meth:`kept_commits`), which becomes the last. A state of your own that
        keeps its commits itself (it overrides ``save`` and ``restore``) goes back to its last one."""
        if not self._kept:
            self.restore()
            return
        for index in range(len(self._kept) - 1, -1, -1):
            if self._kept[index][0] == number:
                self._kept = self._kept[:index + 1]
                self._apply(self._kept[-1][1])
                self._commits = number
                return
        raise HorovodInternalError(f"hp.elastic.run: commit {number} is no longer held here (kept: "
                                   f"{self.kept_commits()}): the ranks stood more than {self.KEPT_COMMITS - 1} "
                                   "commit(s) apart when ranks were lost")

    def sync(self) -> None:
        raise NotImplementedError

    def resume(self) -> bool:
        """Loads the latest committed checkpoint after a restart; True when there was one."""
        return False


class ObjectState(State):
    """Extra attributes (``epoch=0, batch=0``: any picklable values) committed, restored and synced. An
    :class:`ElasticSampler` among them is kept as the same object (the DataLoader holds it): its state is committed,
    loaded back into it on a roll back, and synced as the union of what every rank processed, re-cut for the grid."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._samplers = {name: value for name, value in kwargs.items() if isinstance(value, ElasticSampler)}
        self._names = [name for name in kwargs if name not in self._samplers]
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._keep(0)

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def _sampler_states(self) -> dict[str, dict[str, Any]]:
        return {name: sampler.state_dict() for name, sampler in self._samplers.items()}

    def _snapshot(self) -> Any:
        return {"values": copy.deepcopy(self._values()), "samplers": self._sampler_states()}

    def _apply(self, snapshot: Any) -> None:
        for name, value in copy.deepcopy(snapshot["values"]).items():
            setattr(self, name, value)
        for name, saved in snapshot["samplers"].items():
            self._samplers[name].load_state_dict(saved)

    def _merged_sampler_states(self) -> dict[str, dict[str, Any]]:
        """Every sampler's state as the job goes on from it (collective over the world when there are samplers)."""
        if not self._samplers:
            return {}
        everyone = allgather_object(self._sampler_states(), name="elastic.samplers", group="world")
        return {name: sampler.merged_state([states[name] for states in everyone])
                for name, sampler in self._samplers.items()}

    def sync(self) -> None:
        for name, value in broadcast_object(self._values(), root_rank=0, name="elastic.state",
                                            group="world").items():
            setattr(self, name, value)
        for name, merged in self._merged_sampler_states().items():
            self._samplers[name].load_state_dict(merged)


class TorchState(ObjectState):
    """Horovod's ``hvd.elastic.TorchState(model, optimizer, **kwargs)``: the model's and optimizer's state
    dicts and the extra attributes.

    Example:
        >>> state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
        >>> @hvd.elastic.run
        ... def train(state):
        ...     for state.epoch in range(state.epoch, epochs):
        ...         ...                     # train one epoch
        ...         state.commit()
        >>> train(state)
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        if getattr(model, "asynchronous", False):
            raise UsageError(
                f"hp.elastic.TorchState: the PipelineModel's schedule {model.schedule_name!r} is asynchronous: it "
                "keeps micro-batches in flight from one train_step to the next, which a roll back to the last "
                "commit cannot undo on every stage. Use a synchronous schedule ('gpipe', '1f1b', "
                "'interleaved-1f1b', 'zb-h1') with elastic, or restart from checkpoints (hp.save_checkpoint "
                "flushes the pipeline; hybridpipe-run --restarts)")
        self.model, self.optimizer = model, optimizer
        super().__init__(**kwargs)

    def _shards(self) -> list[torch.Tensor] | None:
        """A ZeRO-3 optimizer's shards of the parameters, copied: the only copy of the weights between uses (the
        model's state holds freed parameters then)."""
        if getattr(self.optimizer, "zero", 0) != 3:
            return None
        return [shard.detach().clone() for shard in self.optimizer.shard_parameters()]

    @staticmethod
    def _copy(state: dict) -> dict:
        return copy.deepcopy(state)

    def _snapshot(self) -> Any:
        snapshot = super()._snapshot()
        scaler = self._scaler()
        snapshot.update(model=self._copy(self.model.state_dict()) if self.model is not None else None,
                        optimizer=self._copy(self.optimizer.state_dict()) if self.optimizer is not None else None,
                        shards=self._shards(), scaler=scaler.state_dict() if scaler is not None else None)
        return snapshot

    def _apply(self, snapshot: Any) -> None:
        super()._apply(snapshot)
        if self.model is not None and snapshot["model"] is not None:
            self.model.load_state_dict(snapshot["model"])
        if self.optimizer is not None and snapshot["optimizer"] is not None:
            self.optimizer.load_state_dict(snapshot["optimizer"])
        if snapshot["shards"] is not None:
            with torch.no_grad():
                for shard, saved in zip(self.optimizer.shard_parameters(), snapshot["shards"]):
                    shard.copy_(saved)
        scaler = self._scaler()
        if scaler is not None and snapshot["scaler"] is not None:
            scaler.load_state_dict(snapshot["scaler"])

    def save(self) -> None:
        super().save()
        directory = os.environ.get(checkpoint.CHECKPOINT_DIR_ENV)
        if directory and self.model is not None:
            samplers = {name: {"epoch": merged["epoch"], "processed_indices": sorted(merged["processed_indices"])}
                        for name, merged in self._merged_sampler_states().items()}  # lists: weights_only loads
            checkpoint.save_checkpoint(directory, self.model, self.optimizer, step=self._commits + 1,
                                       extra={"elastic": self._values(), "commits": self._commits + 1,
                                              "samplers": samplers})

    def _replicas(self) -> str:
        """The ranks that hold the same model: a pipeline stage's replicas ("data", each stage from its own
        replica 0), or every rank for a plain module."""
        return "data" if checkpoint.is_pipeline(self.model) else "world"

    def _scaler(self) -> Any:
        """The model's fp16 loss scaler (``precision="fp16"``), or None: its scale is state to roll back."""
        return getattr(self.model, "scaler", None)

    def sync(self) -> None:
        if self.model is not None:
            group = self._replicas()
            broadcast_parameters(self.model.state_dict(), root_rank=0, group=group)
            if self.optimizer is not None:
                broadcast_optimizer_state(self.optimizer, root_rank=0, group=group)
            scaler = self._scaler()
            if scaler is not None:  # agreed by every rank of the job: rank 0's
                scaler.load_state_dict(broadcast_object(scaler.state_dict(), root_rank=0,
                                                        name="elastic.scaler", group="world"))
        elif self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0, group="world")
        super().sync()

    def resume(self) -> bool:
        directory = os.environ.get(checkpoint.CHECKPOINT_DIR_ENV)
        if not directory or self.model is None:
            return False
        info = checkpoint.resume(directory, self.model, self.optimizer)
        if not info.resumed:
            return False
        for name, value in info.extra.get("elastic", {}).items():
            setattr(self, name, value)
        for name, saved in info.extra.get("samplers", {}).items():
            if name in self._samplers:
                self._samplers[name].load_state_dict(saved)
        self._commits = int(info.extra.get("commits", info.step))
        self.save_in_memory_only()
        return True

    def save_in_memory_only(self) -> None:
        """The in-memory commit alone (what was just loaded is on disk already)."""
        self._keep(self._commits)


def survives_failures() -> bool:
    """Whether ``run`` goes on in the same processes when ranks die: the MPI has ULFM (Open MPI 5) and the job was
    started fault tolerant (``mpirun --with-ft ulfm``, which ``hybridpipe-run`` passes; it sets
    ``OMPI_MCA_mpi_ft_enable``). Otherwise a dead rank ends the job as before (``hybridpipe-run --restarts``)."""
    enabled = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes", "enabled")
    return enabled and bool(core().ulfm_compiled())


def _go_on_without_lost(state: State, lost: RanksLostError, failed: float) -> None:
    """The survivors' recovery: the broken job ends without collectives, the world shrinks to the survivors, hp.init
    runs over it, the gradient syncs (DistributedOptimizer) rebind to the new engine, the state rolls back to the
    last commit and the reset callbacks run; ``run``'s loop then syncs the state from the new rank 0."""
    drivers = drivers_of(runtime.job("elastic.run"))  # before the old job ends: its registrations say who
    syncs, pipelines, old_grid = drivers.syncs(), [d for d in drivers.live() if d.drives_units], runtime.grid()
    survivors = runtime.go_on_without_lost("elastic.run")
    for driver in pipelines:  # the pipelines first: the optimizers register with them again
        driver.rebind()
    for sync in syncs:
        sync.rebind()
    # the newest commit every survivor holds (they may stand one apart: see State)
    state.restore_commit(min(allgather_object(state._commits, name="elastic.commits", group="world")))
    state.on_reset()
    if survivors.grid.rank == 0:
        named = ", ".join(f"{rank} (host {host})" for rank, host in zip(survivors.lost, survivors.lost_hosts))
        sys.stderr.write(f"hybridpipe elastic: rank(s) {named or lost.ranks or '?'} lost; going on with {survivors.new_size} of "
                         f"{survivors.old_size} ranks (old size {survivors.old_size}, new size {survivors.new_size}); "
                         f"recovered in {time.monotonic() - failed:.2f} s from the failure reaching hp.elastic.run "
                         f"to the restart of the training function; grid {old_grid.config} -> {survivors.grid.config}\n")
        sys.stderr.flush()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``@hvd.elastic.run``: ``func(state, *args, **kwargs)`` with roll back and retry.

    Before the first call: the state is resumed from the latest committed checkpoint (after a restart by
    ``hybridpipe-run --restarts``) and synced from rank 0. A ``HorovodInternalError`` inside ``func`` rolls
    the state back to the last commit (``restore``, the reset callbacks), syncs it, and calls ``func``
    again — unless it failed the same way before without committing since, then it propagates; a
    ``HostsUpdatedInterrupt`` syncs (unless ``skip_sync``) and calls it again.

    While ``func`` runs under a fault-tolerant MPI (:func:`survives_failures`), a rank that dies raises
    :class:`~hybridpipe.errors.RanksLostError` on the survivors instead of ending the job: they shrink the job to
    themselves (``hp.size()`` / ``hp.rank()`` change), rebind their DistributedOptimizers, roll back to the last
    commit, sync from the new rank 0 and call ``func`` again; a pipeline goes on as the grid its survivors form.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not runtime.is_initialized():
            raise NotInitializedError("hp.elastic.run: the training function was called before hp.init(); call "
                                      "hp.init() first")
        surviving = survives_failures()
        before = bool(core().survive_process_failures())
        if surviving:
            core().set_survive_process_failures(True)
        try:
            return _run(func, state, surviving, args, kwargs)
        finally:
            if surviving:
                core().set_survive_process_failures(before)

    return wrapper


def _run(func: Callable[..., Any], state: State, surviving: bool, args: Any, kwargs: Any) -> Any:
    state.resume()
    skip_sync = False
    failed_at = -1  # the commit count at the last failure: failing again without progress re-raises
    while True:
        try:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except RanksLostError:
                raise
            except HorovodInternalError as error:
                lost = runtime.job("elastic.run").ranks_lost(str(error)) if surviving else None
                if lost is not None:  # an error of a call that the lost ranks broke, raised as another kind
                    raise lost from error
                if failed_at == state._commits:
                    raise  # the same failure again, with no commit in between: retrying would loop
                failed_at = state._commits
                state.restore()
                state.on_reset()
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                state.on_reset()
                skip_sync = interrupt.skip_sync
        except RanksLostError as lost:
            if not surviving:
                raise
            _go_on_without_lost(state, lost, time.monotonic())
            skip_sync = False

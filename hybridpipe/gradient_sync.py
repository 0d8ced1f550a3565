"""The contract between what runs a model's forwards and backwards and what keeps its gradients in sync.

Who is who:

* A **unit** (:class:`Unit`) is a set of parameters that runs forward and backward together: one pipeline chunk
  (virtual stage) held by this rank, or, without a pipeline, the parameters of one hp.DistributedOptimizer.
* A **sync** (:class:`GradientSync`) keeps the gradients of the parameters it was registered for consistent over
  the data-parallel replicas: hp.DistributedOptimizer (zero=0, 1, 2) is one. It overrides what it needs of the
  methods below (each is a no-op here).
* A **driver** (:class:`SyncDriver`) holds units and the syncs registered with their parameters, and tells those
  syncs what happens, in order. A pipeline's StageExecutor owns one for its chunks and drives every event
  (``PipelineModel.register_gradient_sync``); a DistributedOptimizer over parameters that no pipeline holds owns
  an :class:`AutogradDriver`, which plain autograd drives through the gradient hooks alone (no unit events: every
  accumulation is a last backward's). The running job keeps every driver, weakly (:class:`SyncDrivers`,
  the job's slot, :func:`drivers_of`): that is how a DistributedOptimizer, given parameters only, finds the pipeline that
  runs them, and how ``hp.clip_grad_norm_`` finds the ZeRO optimizers of a model's parameters.

The calls a pipeline's executor makes, for each action of a rank's schedule:

* ``F`` of a unit: ``forward_begins(unit)`` ... ``forward_ends(unit)`` around the unit's forward (``predict``'s
  too);
* ``B``, ``I`` or ``W`` of a unit: ``backward_begins(unit, last)`` ... ``backward_ends(unit, last)``, with
  ``last=True`` for the unit's last backward of the step (a ``B``, or in a split backward the last ``W``; never
  an ``I``). A re-materialized forward runs inside its backward's pair, bracketed by its own forward pair;
* while autograd accumulates into a parameter during a unit's ``last`` backward: ``gradient_final(parameter)``
  for every sync registered for it (the gradient of this step is complete: its reduction may start, overlapping
  the rest of the backward). A parameter whose gradient is completed after the run (a weight tied across stages,
  summed by the pipeline after the schedule ran; :meth:`Unit.defer`) is never final in a backward; neither is
  one accumulated in a backward that is not the unit's last;
* ``step_ends()`` once the step's gradients are complete on this rank (after the tied weights' sums).

Outside any unit's backward (plain autograd) every accumulation into a parameter is final. What a sync does with
the calls is its business: DistributedOptimizer starts a reduction at ``gradient_final`` and waits at ``step()``;
ZeRO-3 gathers a module's parameters around its calls by torch's module hooks, and a chunk's around the halves of a
split backward (``unit.split_backward``), which do not go through the modules' calls.

Lifetimes: a driver holds the syncs registered with it (strongly: every rank drops them at the same time, when the
registration is removed or the parameters go), its units hold their parameters, and a parameter's gradient hook
holds the driver; the job's :class:`SyncDrivers` holds drivers weakly and ends with the job. Nothing is set on a
``Parameter`` but torch's own hooks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .errors import UsageError

__all__ = ["AutogradDriver", "GradientSync", "Registration", "SyncDriver", "SyncDrivers", "Unit", "drivers_of"]


class GradientSync:
    """What data parallelism is told about a run (see the module's docstring for who calls what, when)."""

    def forward_begins(self, unit: Unit) -> None:
        """``unit``'s forward is about to run."""

    def forward_ends(self, unit: Unit) -> None:
        """``unit``'s forward has run."""

    def backward_begins(self, unit: Unit, last: bool) -> None:
        """A backward of ``unit`` is about to run (``last``: its last of the step)."""

    def gradient_final(self, parameter: Any) -> None:
        """``parameter``'s gradient of this step was just accumulated and is complete."""

    def backward_ends(self, unit: Unit, last: bool) -> None:
        """A backward of ``unit`` has run (``last``: its last of the step; its gradients are complete now, but for
        the deferred ones)."""

    def step_ends(self) -> None:
        """The step's gradients are complete on this rank (the deferred ones too)."""

    def rebind(self) -> None:
        """The job it was registered with ended after ranks were lost and the survivors started a new one (hp.elastic.run):
        register with the running job again and forget what was in flight on the old one."""


class Unit:
    """Parameters that run forward and backward together (a pipeline chunk); ``index``: the chunk's number."""

    def __init__(self, index: int, parameters: Iterable[Any], module: Any = None) -> None:
        self.index = index
        self.module = module  # the nn.Module that runs the unit, where its driver knows it (a pipeline chunk)
        self.parameters = tuple(parameters)
        self._ids = {id(p) for p in self.parameters}  # (the unit holds them: the ids stay theirs)
        self.deferred: set[int] = set()  # ids of held parameters whose gradient is completed after the run
        self.in_backward: bool | None = None  # while a backward of the unit runs: whether it is its last
        self.split_backward = False  # while a backward half (I or W of a split backward) of the unit runs

    def holds(self, parameter: Any) -> bool:
        return id(parameter) in self._ids

    def defer(self, parameters: Iterable[Any]) -> None:
        """These parameters' gradients are completed after each run (summed across stages by the caller): never
        final in a backward; their syncs see them complete at ``step_ends``."""
        self.deferred.update(id(p) for p in parameters if self.holds(p))

    def __repr__(self) -> str:
        return f"Unit({self.index}, {len(self.parameters)} parameters)"


class Registration:
    """One sync registered with a driver for some parameters; :meth:`remove` ends it."""

    def __init__(self, driver: SyncDriver, sync: GradientSync, parameters: list[Any]) -> None:
        self.driver, self.sync, self.parameters = driver, sync, parameters
        self._ids = {id(p) for p in parameters}  # (held in parameters: the ids stay theirs)

    def covers(self, parameter: Any) -> bool:
        return id(parameter) in self._ids

    def remove(self) -> None:
        self.driver.unregister(self)


class SyncDriver:
    """The units of one run and the syncs registered for their parameters (see the module's docstring).

    The owner of the units calls :meth:`forward`, :meth:`backward` and :meth:`step_ends`; a sync is registered
    with :meth:`register`. A pipeline whose schedule steps its own optimizer sets :attr:`updates_itself` (its
    schedule's name): no sync may then register, and :attr:`updating` says which optimizer steps as its update.
    """

    drives_units = True  # a pipeline's: its owner brackets the units' forwards and backwards

    def __init__(self, units: Iterable[Unit] = ()) -> None:
        self.units = list(units)
        self._held = {id(p) for unit in self.units for p in unit.parameters}
        self.registrations: list[Registration] = []
        self._hooked: dict[int, list[GradientSync]] = {}  # id(parameter) -> the syncs its gradient hook tells
        self._hooks: list[Any] = []
        self.updates_itself: str | None = None
        self.updating: Any = None
        #: set by the units' owner (a pipeline): re-makes its side in the survivors' new job (see :meth:`rebind`)
        self.rebinder: Callable[[], None] | None = None

    def holds(self, parameter: Any) -> bool:
        """Whether ``parameter`` is in one of this driver's units."""
        return id(parameter) in self._held

    def rebind(self) -> None:
        """The job ended after ranks were lost and the survivors started a new one (hp.elastic.run), before its syncs
        rebind: the units' owner (a pipeline) goes on in the new job, which holds this driver from then on. A driver
        without one (an :class:`AutogradDriver`) is left with the old job: its syncs register anew."""
        if self.rebinder is not None:
            self.rebinder()

    def register(self, sync: GradientSync, parameters: Iterable[Any]) -> Registration:
        """Makes ``sync`` hear about ``parameters`` (those of them this driver holds; the events of their units,
        their gradients' ``gradient_final``) until the registration is removed."""
        if self.updates_itself is not None:
            raise UsageError(f"the pipeline's schedule {self.updates_itself!r} averages and applies its gradients "
                             "itself: no gradient sync may register with it")
        mine = [p for p in parameters if self.holds(p)]
        registration = Registration(self, sync, mine)
        self.registrations.append(registration)
        for parameter in mine:
            if not getattr(parameter, "requires_grad", False):
                continue
            syncs = self._hooked.get(id(parameter))
            if syncs is None:
                syncs = self._hooked[id(parameter)] = []
                units = [unit for unit in self.units if unit.holds(parameter)]
                self._hooks.append(parameter.register_post_accumulate_grad_hook(self._hook(units, syncs)))
            syncs.append(sync)
        return registration

    def unregister(self, registration: Registration) -> None:
        if registration not in self.registrations:
            return
        self.registrations.remove(registration)
        for parameter in registration.parameters:
            syncs = self._hooked.get(id(parameter), [])
            if any(sync is registration.sync for sync in syncs):
                del syncs[next(i for i, sync in enumerate(syncs) if sync is registration.sync)]

    def _hook(self, units: list[Unit], syncs: list[GradientSync]) -> Any:
        driver = self  # the hook keeps the driver alive as long as the parameter (see the module's docstring)

        def hook(parameter: Any) -> None:
            if driver.final(parameter, units):
                for sync in list(syncs):
                    sync.gradient_final(parameter)

        return hook

    @staticmethod
    def final(parameter: Any, units: list[Unit]) -> bool:
        """Whether a gradient just accumulated into ``parameter`` (held by ``units``) is complete: the first of them
        running a backward says (its last, and ``parameter`` not deferred); none running one: yes (plain autograd)."""
        for unit in units:
            if unit.in_backward is not None:
                return unit.in_backward and id(parameter) not in unit.deferred
        return True

    def syncs(self) -> list[GradientSync]:
        """The registered syncs, in registration order (one per registration)."""
        return [registration.sync for registration in self.registrations]

    def syncs_of(self, parameter: Any) -> list[GradientSync]:
        """The syncs registered for ``parameter``, in registration order."""
        return [r.sync for r in self.registrations if r.covers(parameter)]

    # ------------------------------------------------------------------ driving

    @contextlib.contextmanager
    def forward(self, unit: Unit) -> Iterator[None]:
        """Around a forward of ``unit``."""
        syncs = self.syncs()
        for sync in syncs:
            sync.forward_begins(unit)
        try:
            yield
        finally:
            for sync in syncs:
                sync.forward_ends(unit)

    @contextlib.contextmanager
    def backward(self, unit: Unit, last: bool, split: bool = False) -> Iterator[None]:
        """Around a backward of ``unit`` (``last``: its last of the step; ``split``: a half of a split backward,
        ``I`` or ``W``, which autograd runs from recorded outputs rather than through the modules' calls)."""
        syncs = self.syncs()
        unit.split_backward = bool(split)
        for sync in syncs:
            sync.backward_begins(unit, last)
        unit.in_backward = bool(last)
        try:
            yield
        finally:
            unit.in_backward = None
            for sync in syncs:
                sync.backward_ends(unit, last)
            unit.split_backward = False

    def step_ends(self) -> None:
        """The step's gradients are complete."""
        for sync in self.syncs():
            sync.step_ends()


class AutogradDriver(SyncDriver):
    """The driver of parameters that no pipeline runs: one unit, which plain autograd drives through the gradient
    hooks only (every accumulation is final; no forward, backward or step events)."""

    drives_units = False

    def __init__(self, parameters: Iterable[Any]) -> None:
        super().__init__([Unit(0, parameters)])


class SyncDrivers:
    """The running job's drivers (:func:`drivers_of`: the job's slot), held weakly, in the order they were added."""

    def __init__(self) -> None:
        self._drivers: list[weakref.ref[SyncDriver]] = []

    def add(self, driver: SyncDriver) -> SyncDriver:
        self._drivers = [ref for ref in self._drivers if ref() is not None] + [weakref.ref(driver)]
        return driver

    def live(self) -> list[SyncDriver]:
        return [driver for driver in (ref() for ref in self._drivers) if driver is not None]

    def runner_of(self, parameter: Any, drivers: list[SyncDriver] | None = None) -> SyncDriver | None:
        """The (live) driver whose owner runs ``parameter``'s unit: a pipeline's; None for other parameters.
        ``drivers``: :meth:`live`'s list, when the caller asks for many parameters."""
        return next((d for d in (self.live() if drivers is None else drivers) if d.drives_units and d.holds(parameter)),
                    None)

    def register(self, sync: GradientSync, parameters: Iterable[Any]) -> list[Registration]:
        """Registers ``sync`` for ``parameters``: with the driver of the pipeline that runs them, and the rest
        with a new :class:`AutogradDriver` (added here). Returns the registrations."""
        drivers = self.live()
        by_driver: dict[int, tuple[SyncDriver, list[Any]]] = {}
        free = []
        for parameter in parameters:
            driver = self.runner_of(parameter, drivers)
            if driver is None:
                free.append(parameter)
            else:
                by_driver.setdefault(id(driver), (driver, []))[1].append(parameter)
        registrations = [driver.register(sync, held) for driver, held in by_driver.values()]
        if free:
            registrations.append(self.add(AutogradDriver(free)).register(sync, free))
        return registrations

    def syncs(self) -> list[GradientSync]:
        """Every sync registered on a live driver, once each, in the drivers' order, then registration order (the
        same order on every rank that made the same objects in the same order)."""
        found: dict[int, GradientSync] = {}
        for driver in self.live():
            for sync in driver.syncs():
                found.setdefault(id(sync), sync)
        return list(found.values())

    def syncs_of(self, parameter: Any) -> list[GradientSync]:
        """Every sync registered for ``parameter`` on any live driver, in the drivers' order, then registration
        order."""
        return [sync for driver in self.live() if driver.holds(parameter) for sync in driver.syncs_of(parameter)]


def drivers_of(job: Any) -> SyncDrivers:
    """The job's :class:`SyncDrivers` (``job``: the running CommContext; the layer keeps them in the job's slot)."""
    return job.slot(SyncDrivers, SyncDrivers)

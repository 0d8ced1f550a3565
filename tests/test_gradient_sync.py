"""hybridpipe/gradient_sync.py in one process: when a driver calls gradient_final, registrations, the job's
registry of drivers (weak), and which driver a sync lands on. Under mpirun with real pipelines:
tests/pipeline/test_gradient_sync_mpi.py."""

from __future__ import annotations

import gc

import torch
from torch import nn

from hybridpipe.gradient_sync import AutogradDriver, GradientSync, SyncDriver, SyncDrivers, Unit


class Finals(GradientSync):
    def __init__(self) -> None:
        self.seen: list = []

    def gradient_final(self, parameter):
        self.seen.append(parameter)


def backward(module: nn.Module) -> None:
    module(torch.ones(1, 2)).sum().backward()


def test_a_gradient_is_final_only_in_the_units_last_backward_and_never_when_deferred():
    layer = nn.Linear(2, 1)
    unit = Unit(0, layer.parameters())
    unit.defer([layer.bias])
    driver = SyncDriver([unit])
    sync = Finals()
    driver.register(sync, layer.parameters())
    with driver.backward(unit, last=False):
        backward(layer)
    assert sync.seen == []
    with driver.backward(unit, last=True):
        backward(layer)
    assert list(map(id, sync.seen)) == [id(layer.weight)]  # the deferred bias is completed later, by the caller
    backward(layer)  # outside a backward of its unit: plain autograd, every accumulation is final
    assert sorted(map(id, sync.seen[1:])) == sorted([id(layer.weight), id(layer.bias)])


def test_a_removed_registration_hears_nothing_and_events_go_in_registration_order():
    layer = nn.Linear(2, 1)
    unit = Unit(3, layer.parameters())
    driver = SyncDriver([unit])
    calls = []

    class Named(GradientSync):
        def __init__(self, name):
            self.name = name

        def forward_begins(self, unit):
            calls.append((self.name, "forward", unit.index))

        def step_ends(self):
            calls.append((self.name, "step"))

    first, second = Named("a"), Named("b")
    registration = driver.register(first, layer.parameters())
    driver.register(second, [layer.weight])
    assert driver.syncs_of(layer.bias) == [first]
    assert driver.syncs_of(layer.weight) == [first, second]
    with driver.forward(unit):
        pass
    driver.step_ends()
    registration.remove()
    driver.step_ends()
    assert calls == [("a", "forward", 3), ("b", "forward", 3), ("a", "step"), ("b", "step"), ("b", "step")]


def test_the_registry_finds_the_runner_and_holds_drivers_weakly():
    drivers = SyncDrivers()
    run, free = nn.Linear(2, 1), nn.Linear(2, 1)
    pipeline = drivers.add(SyncDriver([Unit(0, run.parameters())]))
    sync = Finals()
    registrations = drivers.register(sync, [*run.parameters(), *free.parameters()])
    assert [r.driver for r in registrations][0] is pipeline
    assert isinstance(registrations[1].driver, AutogradDriver)
    assert drivers.runner_of(run.weight) is pipeline and drivers.runner_of(free.weight) is None
    assert drivers.syncs_of(free.weight) == [sync]
    backward(free)
    assert sorted(map(id, sync.seen)) == sorted(map(id, free.parameters()))
    del registrations
    unused = drivers.add(SyncDriver([Unit(0, nn.Linear(2, 1).parameters())]))
    assert unused in drivers.live()
    del unused
    gc.collect()
    assert len(drivers.live()) == 2  # the pipeline's and the autograd driver its parameters' hooks keep

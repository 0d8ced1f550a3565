"""Test helper: a module holding gradients and statistics of its own, and the check that a measurement (a profile,
hp.auto's timings on the model) put every one of them back as it was, added into nothing."""

from __future__ import annotations

from typing import Any

import torch

HELD = 0.5  # every gradient the caller holds, before the measurement


def holding(modules: Any) -> dict[str, torch.Tensor]:
    """Gives every parameter of ``modules`` (a module or a list of them) a gradient of :data:`HELD`; returns the
    state (weights, buffers) to compare with after."""
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    for module in modules:
        for parameter in module.parameters():
            parameter.grad = torch.full_like(parameter, HELD)
    return {f"{i}.{name}": value.clone() for i, module in enumerate(modules)
            for name, value in module.state_dict().items()}


def assert_as_held(modules: Any, before: dict[str, torch.Tensor]) -> None:
    """The state is ``before`` (batch norm's statistics, the weights) and every gradient still :data:`HELD`."""
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    now = {f"{i}.{name}": value for i, module in enumerate(modules) for name, value in module.state_dict().items()}
    for name, saved in before.items():
        assert torch.equal(now[name], saved), name
    for module in modules:
        for parameter in module.parameters():  # not added into: the caller's gradients as they were
            assert torch.equal(parameter.grad, torch.full_like(parameter, HELD))

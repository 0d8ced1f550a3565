"""Layers that modify their input in place (``nn.ReLU(inplace=True)``) at the start of a stage.

A stage's received activation is a leaf that requires grad (its gradient goes back to the previous
stage), and autograd refuses an in-place operation on such a leaf ("a leaf Variable that requires
grad is being used in an in-place operation"); on the first stage the input is a view of the user's
batch, which an in-place layer would overwrite. So when the first layer a chunk runs works in place,
it gets a copy of its input; the gradient still reaches the original leaf (a copy's backward is the
identity). Other chunks pay nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridpipe.pipeline.microbatch import map_tensors

__all__ = ["first_layer_works_in_place", "writable_input"]


def _first_layer(module: nn.Module) -> nn.Module | None:
    """The layer a container runs first: ``nn.Sequential`` / ``nn.ModuleList`` / ``nn.ModuleDict`` in order, or a
    module holding its layers as ``layers`` (run in ``order`` when it has one, as a stage does); else None."""
    if isinstance(module, (nn.Sequential, nn.ModuleList)):
        return module[0] if len(module) else None
    if isinstance(module, nn.ModuleDict):
        return next(iter(module.values()), None)
    layers, order = getattr(module, "layers", None), getattr(module, "order", None)
    if isinstance(layers, nn.ModuleDict) and order:
        return layers[order[0]]
    if isinstance(layers, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return layers
    return None


def first_layer_works_in_place(module: nn.Module) -> bool:
    """Whether the first layer ``module`` runs (descending into containers, see :func:`_first_layer`) was built
    with ``inplace=True`` (torch's activations and dropouts)."""
    current: nn.Module | None = module
    while current is not None:
        if getattr(current, "inplace", False) is True:
            return True
        current = _first_layer(current)
    return False


def writable_input(value: Any, module: nn.Module) -> Any:
    """``value`` for ``module(value)``: its tensors copied when ``module``'s first layer works in place
    (:func:`first_layer_works_in_place`), else ``value`` itself.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> layer = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(2, 1))
        >>> layer(writable_input(x, layer)).sum().backward()   # x.grad is set; x itself untouched
    """
    if not first_layer_works_in_place(module):
        return value
    return map_tensors(value, torch.clone)

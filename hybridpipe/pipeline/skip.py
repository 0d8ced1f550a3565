"""Skip connections across pipeline stages: a layer stashes a named tensor, a later layer pops it.

torchgpipe's idea (``skippable``), in hybridpipe's own API::

    @hp.skippable(stash=["residual"])
    class Save(nn.Module):
        def forward(self, x):
            hp.stash("residual", x)
            return x

    @hp.skippable(pop=["residual"])
    class AddBack(nn.Module):
        def forward(self, x):
            return x + hp.pop("residual")

    layers = [Save(), *blocks, AddBack()]          # any number of stages apart

In one process (a plain ``nn.Sequential``) ``stash`` keeps the tensor until ``pop`` takes it. Inside a
``PipelineModel`` the stashing and popping layers may sit on different, non-adjacent stages: the
tensor travels straight from the stashing stage's rank to the popping stage's (not through the stages
between), its gradient travels straight back during the backward pass, and each side drops its
reference as soon as the micro-batch's backward is done on it.

Declaring the names (the decorator) lets ``PipelineModel`` route them before any forward runs: every
name must be stashed by exactly one layer and popped by exactly one later layer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UsageError

__all__ = ["skippable", "stash", "pop", "SkipRoute", "skip_routes", "SkipContext", "skip_context"]


def skippable(stash: Sequence[str] = (), pop: Sequence[str] = ()) -> Any:
    """Class decorator: the module's ``forward`` calls ``hp.stash(name, tensor)`` for each name of
    ``stash`` and ``hp.pop(name)`` for each name of ``pop`` (every call, once per name)."""
    stash, pop = tuple(stash), tuple(pop)
    for name in (*stash, *pop):
        if not isinstance(name, str) or not name:
            raise TypeError(f"hp.skippable: skip names are non-empty strings (got {name!r})")

    def decorate(cls: type) -> type:
        # a subclass keeps what its base class declared; a name declared again counts once
        cls._hp_stash = tuple(dict.fromkeys((*getattr(cls, "_hp_stash", ()), *stash)))
        cls._hp_pop = tuple(dict.fromkeys((*getattr(cls, "_hp_pop", ()), *pop)))
        return cls

    return decorate


@dataclass
class SkipContext:
    """Where ``stash`` / ``pop`` put and find tensors during one forward (one chunk, one micro-batch)."""

    routes: dict[str, SkipRoute] = field(default_factory=dict)
    chunk: int | None = None                                   # None: one process, no routing
    local: dict[str, Any] = field(default_factory=dict)        # stashed and popped in this chunk
    incoming: dict[str, Any] = field(default_factory=dict)     # received from the stashing chunk
    outgoing: dict[str, Any] = field(default_factory=dict)     # to send to the popping chunk


_state = threading.local()


def _current() -> SkipContext:
    context = getattr(_state, "context", None)
    if context is None:
        context = _state.context = SkipContext()  # one process: a plain dict, kept per thread
    return context


class skip_context:  # noqa: N801 — used as a context manager, like torch.no_grad
    """Makes ``context`` the one ``stash`` / ``pop`` use inside the block (the executor's, per forward)."""

    def __init__(self, context: SkipContext) -> None:
        self.context = context

    def __enter__(self) -> SkipContext:
        self.previous = getattr(_state, "context", None)
        _state.context = self.context
        return self.context

    def __exit__(self, *exc: Any) -> None:
        _state.context = self.previous


def stash(name: str, tensor: Any) -> None:
    """Keeps ``tensor`` under ``name`` for the layer that pops it (see the module docstring)."""
    context = _current()
    route = context.routes.get(name)
    if context.chunk is not None and route is None:
        raise UsageError(f"hp.stash({name!r}): no layer of this model declares it; decorate the stashing "
                         f"module with @hp.skippable(stash=[{name!r}]) and the popping one with "
                         f"@hp.skippable(pop=[{name!r}])")
    if route is not None and route.pop_chunk != context.chunk:
        context.outgoing[name] = tensor  # the executor sends it to the popping chunk's rank
    else:
        if name in context.local:
            raise UsageError(f"hp.stash({name!r}) twice before it was popped")
        context.local[name] = tensor


def pop(name: str) -> Any:
    """Takes the tensor stashed under ``name``."""
    context = _current()
    if name in context.local:
        return context.local.pop(name)
    if name in context.incoming:
        return context.incoming[name]
    raise UsageError(f"hp.pop({name!r}): nothing was stashed under this name (stash it in an earlier "
                     "layer with hp.stash, and declare both with @hp.skippable)")


@dataclass(frozen=True)
class SkipRoute:
    name: str
    stash_layer: int
    pop_layer: int
    stash_chunk: int
    pop_chunk: int
    index: int  # the name's position among the model's skip names (part of the tag)


def _declared(layer: Any, attribute: str) -> tuple[str, ...]:
    cls = getattr(layer, "cls", None) if not isinstance(layer, torch.nn.Module) else type(layer)
    return tuple(getattr(cls, attribute, ()) or ()) if cls is not None else ()


def skip_routes(layers: Sequence[Any], chunk_of_layer: Sequence[int]) -> dict[str, SkipRoute]:
    """The routes of every skip name of ``layers`` (modules or LayerSpecs), with the chunk holding each
    layer; checks that each name is stashed once and popped once, later."""
    stashed: dict[str, int] = {}
    popped: dict[str, int] = {}
    for index, layer in enumerate(layers):
        for name in _declared(layer, "_hp_stash"):
            if name in stashed:
                raise UsageError(f"skip {name!r} is stashed by layers {stashed[name]} and {index}: each name is "
                                 "stashed by one layer (rename one)")
            stashed[name] = index
        for name in _declared(layer, "_hp_pop"):
            if name in popped:
                raise UsageError(f"skip {name!r} is popped by layers {popped[name]} and {index}: each name is "
                                 "popped by one layer (stash it twice under two names)")
            popped[name] = index
    routes = {}
    for position, name in enumerate(sorted(set(stashed) | set(popped))):
        if name not in popped or name not in stashed:
            missing = "popped" if name not in popped else "stashed"
            raise UsageError(f"skip {name!r} is never {missing}: declare the other end with "
                             f"@hp.skippable({'pop' if missing == 'popped' else 'stash'}=[{name!r}])")
        if popped[name] <= stashed[name]:
            raise UsageError(f"skip {name!r} is popped by layer {popped[name]}, not after layer {stashed[name]} "
                             "that stashes it")
        routes[name] = SkipRoute(name, stashed[name], popped[name], chunk_of_layer[stashed[name]],
                                 chunk_of_layer[popped[name]], position)
    return routes

"""Layers to build later: ``LayerSpec`` and ``TiedLayerSpec``, and the helpers that build them (for real, seeded,
or on PyTorch's meta device, without memory).

Design reasons:

* A :class:`TiedLayerSpec` names a weight by a key: every spec with the same key holds the same weight. On one
  rank the layers of a key share one ``nn.Parameter`` object (the first built one's); on different pipeline
  stages each holds a copy, which ``PipelineModel`` keeps identical (``hybridpipe.pipeline.tied``).
* ``forward_fn`` lets a layer use the tied module differently (an output head multiplying by the embedding's
  matrix). The wrapper it needs shares the module's parameter, buffer and submodule tables instead of holding
  the module as a child, so parameter names (``layers.7.weight``) are the module's own and checkpoints and
  one-process state dicts keep their keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["LayerSpec", "TiedLayerSpec", "shapes_only", "build_layer", "LazyLayers", "tied_attributes",
           "share_parameter"]


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 1024, 1024, bias=False)``.

    Only the rank that owns the layer's stage calls :meth:`build`.
    """

    def __init__(self, cls: type[nn.Module] | Any, *args: Any, **kwargs: Any) -> None:
        if not callable(cls):
            raise TypeError(f"LayerSpec needs a module class or factory as first argument, got {cls!r}")
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def build(self) -> nn.Module:
        """Constructs the layer."""
        layer = self.cls(*self.args, **self.kwargs)
        if not isinstance(layer, nn.Module):
            raise TypeError(f"{type(self).__name__}({getattr(self.cls, '__name__', self.cls)!r}) built a "
                            f"{type(layer).__name__}, not an nn.Module")
        return layer

    def _arguments(self) -> list[str]:
        return [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]

    def __repr__(self) -> str:
        return f"LayerSpec({getattr(self.cls, '__name__', self.cls)}, {', '.join(self._arguments())})"


class TiedLayerSpec(LayerSpec):
    """A :class:`LayerSpec` whose weight is shared with every other ``TiedLayerSpec`` of the same ``key``.

    The classic use is a language model whose output head is its token embedding: put a ``TiedLayerSpec``
    with one key at both ends. Specs of one key on one pipeline stage share one ``nn.Parameter``; on
    different stages each stage holds a copy, broadcast from the lowest such stage when the
    ``PipelineModel`` is built, and the copies' gradients are summed across those stages at the end of
    every ``train_step``, so they stay identical and train like one weight (docs/pipeline.md, "Tied weights").

    Args:
        key: names the weight; every spec with this key holds it.
        module_cls: the module class (or factory) to build, as in :class:`LayerSpec`.
        *args: its positional arguments.
        forward_fn: optional ``forward_fn(module, x)`` used instead of ``module(x)``, e.g.
            ``lambda embedding, x: x @ embedding.weight.t()`` to use an embedding as the output head. Its
            parameters keep their names (``layers.7.weight``).
        tied_weight_attr: the tied parameter's name in the built module (``"weight"``, or dotted:
            ``"tokens.weight"``), or a list of names to tie several.
        **kwargs: the module's keyword arguments.

    Example:
        >>> layers = [hp.TiedLayerSpec("tokens", nn.Embedding, 256, 64),
        ...           *[hp.LayerSpec(Block, 64) for _ in range(6)],
        ...           hp.TiedLayerSpec("tokens", nn.Embedding, 256, 64,
        ...                            forward_fn=lambda embedding, x: x @ embedding.weight.t())]
        >>> model = hp.PipelineModel(layers, loss_fn=lm_loss, micro_batches=4, seed_layers=0)
    """

    def __init__(self, key: str, module_cls: type[nn.Module] | Any, *args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = "weight", **kwargs: Any) -> None:
        if not isinstance(key, str) or not key:
            raise TypeError(f"TiedLayerSpec: key must be a non-empty str naming the shared weight, got {key!r}")
        super().__init__(module_cls, *args, **kwargs)
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"TiedLayerSpec({key!r}): forward_fn must be None or a callable forward_fn(module, x), "
                            f"got {forward_fn!r}")
        attributes = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attributes or any(not isinstance(a, str) or not a for a in attributes):
            raise TypeError(f"TiedLayerSpec({key!r}): tied_weight_attr must be a parameter name such as 'weight' "
                            f"(or a list of them), got {tied_weight_attr!r}")
        self.key, self.forward_fn, self.tied_weight_attr = key, forward_fn, attributes

    def build(self) -> nn.Module:
        """Constructs the layer (wrapped so that ``forward_fn`` is its forward, when given)."""
        module = super().build()
        return module if self.forward_fn is None else _TiedForward(module, self.forward_fn)

    def __repr__(self) -> str:
        attributes = self.tied_weight_attr if len(self.tied_weight_attr) > 1 else self.tied_weight_attr[0]
        extra = [f"tied_weight_attr={attributes!r}"]
        if self.forward_fn is not None:
            extra.append(f"forward_fn={getattr(self.forward_fn, '__name__', self.forward_fn)}")
        return (f"TiedLayerSpec({self.key!r}, {getattr(self.cls, '__name__', self.cls)}, "
                f"{', '.join(self._arguments() + extra)})")


class _TiedForward(nn.Module):
    """A built ``TiedLayerSpec`` with ``forward_fn``: ``forward_fn(module, x)``, with the module's own parameters,
    buffers and submodules under their own names (the tables are shared, not copied)."""

    def __init__(self, module: nn.Module, forward_fn: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self._modules = module._modules
        object.__setattr__(self, "tied_module", module)  # not a child: its entries are ours already
        object.__setattr__(self, "forward_fn", forward_fn)

    def forward(self, x: Any) -> Any:
        return self.forward_fn(self.tied_module, x)

    def extra_repr(self) -> str:
        return f"{type(self.tied_module).__name__}, forward_fn={getattr(self.forward_fn, '__name__', self.forward_fn)}"


def tied_attributes(layer: nn.Module | LayerSpec) -> tuple[str, list[str]] | None:
    """``(key, parameter names)`` of a :class:`TiedLayerSpec`, None for anything else."""
    if isinstance(layer, TiedLayerSpec):
        return layer.key, list(layer.tied_weight_attr)
    return None


def share_parameter(module: nn.Module, name: str, parameter: nn.Parameter) -> None:
    """Makes ``module``'s parameter ``name`` (dotted for a submodule's) the given ``parameter`` object."""
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, parameter)


def shapes_only(layers: Sequence[nn.Module | LayerSpec]) -> Iterable[nn.Module]:
    """Each layer as it is, or a LayerSpec built on PyTorch's meta device (no memory, no RNG),
    one at a time. A Parameter the spec's factory reuses keeps its identity."""
    for layer in layers:
        if isinstance(layer, LayerSpec):
            with torch.device("meta"):
                yield layer.build()
        else:
            yield layer


def build_layer(layer: nn.Module | LayerSpec, index: int, seed_layers: int | None) -> nn.Module:
    """A layer as given, or a LayerSpec built (under seed ``seed_layers + index`` when seeded)."""
    if isinstance(layer, nn.Module):
        return layer
    if seed_layers is None:
        return layer.build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_layers + index)
        return layer.build()


class LazyLayers(Sequence):
    """The layer list as a sequence whose LayerSpecs are built on access (one at a time)."""

    def __init__(self, layers: list[nn.Module | LayerSpec], seed_layers: int | None) -> None:
        self._layers, self._seed = layers, seed_layers

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            raise TypeError("LazyLayers does not slice")
        return build_layer(self._layers[index], index, self._seed)

    def __iter__(self) -> Iterator[nn.Module]:
        for index in range(len(self._layers)):
            yield self[index]

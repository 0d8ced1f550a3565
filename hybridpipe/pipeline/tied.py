"""Tied weights across pipeline stages: one weight held by layers on several stages, a copy on each, the
copies' gradients summed across those stages every step so that they stay identical.

Design reasons:

* Finding ties needs no communication: every rank sees the same layers and balance. A tie is a
  ``nn.Parameter`` object that layers on different pipeline ranks share (found by identity on layers
  built on the meta device, :func:`~hybridpipe.pipeline.partition.find_shared_parameters`), or the
  weight named by one key's ``TiedLayerSpec`` layers. ``PipelineModel`` makes all ranks agree on the
  ties before anything is built, so ranks given different models raise instead of waiting.
* Where the sum happens: at the end of ``PipelineModel.train_step``, once the schedule has run and
  every send has completed, so no stage is waiting for a neighbour any more. Then each holder's
  gradient holds its own layers' contributions, and one grouped allreduce (Sum) over exactly the
  ranks of this pipeline that hold the weight (a process set, or ``"pipe"`` when every stage holds
  it) makes it the whole model's. It is a collective like any other, run on the communication
  thread (``context.call``) in the same order on every holder, so it never meets the engine's other
  traffic out of order.
* The data-parallel average comes afterwards: the executor defers a tied parameter's gradient
  (:meth:`~hybridpipe.gradient_sync.Unit.defer`: never final in a backward), so ``hp.DistributedOptimizer``
  does not start its allreduce during the backward, before the sum, but in ``step()``. Both
  reductions are linear; summing first means that after ``train_step`` the gradient is what one
  process would hold, for any optimizer (clipping, ZeRO, a hand-written update).
* Accumulation: only this step's contributions are summed. The gradient accumulated before
  ``train_step`` is set aside and added back afterwards; it is the same on every holder (it was
  summed before).
* The copies start identical (broadcast from the lowest holding stage when the model is built) and
  receive the same gradient bits: a sum of two values is the same whatever the order, and the
  allreduce gives every member the same result. So every holder applies the same optimizer step.
  (With three or more replicas the holding stages' data-parallel allreduces must also add in the same
  order, which they do for a tied gradient reduced on its own; docs/pipeline.md says when.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridpipe.comm import context, process_sets
from hybridpipe.collectives.allreduce import grouped_allreduce_
from hybridpipe.collectives.broadcast import broadcast_
from hybridpipe.collectives.common import Sum
from hybridpipe.errors import UsageError
from hybridpipe.pipeline.layers import LayerSpec, share_parameter, shapes_only, tied_attributes
from hybridpipe.pipeline.partition import SharedParameter, find_shared_parameters, shared_parameters_error

__all__ = ["Tie", "find_ties", "check_schedule", "share_within_rank", "TiedWeights"]


@dataclass(frozen=True)
class Tie:
    """One weight held by several layers.

    Attributes:
        key: the ``TiedLayerSpec`` key, or None for an ``nn.Parameter`` the layers share.
        places: ``(layer index, parameter name in that layer)`` of each holder, in layer order.
        chunks: the chunk (stage, or virtual stage) of each place.
        holders: the pipeline rank of each place (its chunk mod the pipeline's ranks).
        labels: each place as text, e.g. ``"layer 0 (Embedding).weight"``.
    """

    key: str | None
    places: tuple[tuple[int, str], ...]
    chunks: tuple[int, ...]
    holders: tuple[int, ...]
    labels: tuple[str, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        """The pipeline ranks holding it, ascending."""
        return tuple(sorted(set(self.holders)))

    @property
    def across_ranks(self) -> bool:
        """Whether more than one pipeline rank holds it (then the copies are tied by communication)."""
        return len(self.ranks) > 1

    @property
    def names(self) -> tuple[str, ...]:
        """The places as ``PipelineModel`` parameter names (``layers.7.weight``)."""
        return tuple(f"layers.{index}.{name}" for index, name in self.places)

    def shared(self) -> SharedParameter:
        """As :class:`~hybridpipe.pipeline.partition.SharedParameter` (for its messages)."""
        return SharedParameter(tuple((index, label, chunk) for (index, _), label, chunk
                                     in zip(self.places, self.labels, self.chunks)),
                               tuple(name for _, name in self.places))

    def __str__(self) -> str:
        return ", ".join(f"{label} on stage {rank}" for label, rank in zip(self.labels, self.holders))


def _type_name(module: nn.Module) -> str:
    return type(getattr(module, "tied_module", module)).__name__


def find_ties(layers: Sequence[nn.Module | LayerSpec], balance: Sequence[int], ranks: int) -> list[Tie]:
    """The ties of a layer list cut by ``balance`` (layer counts per chunk; chunk ``c`` runs on pipeline
    rank ``c mod ranks``): every ``TiedLayerSpec`` key, and every ``nn.Parameter`` shared by layers on
    different ranks. No communication; LayerSpecs are built on the meta device, one at a time.

    Raises:
        UsageError: a ``TiedLayerSpec``'s ``tied_weight_attr`` names no parameter of its module, or
            the layers of one key tie different numbers or shapes of parameters.
    """
    chunk_of = [chunk for chunk, count in enumerate(balance) for _ in range(count)]
    keyed = {index: found for index, layer in enumerate(layers) if (found := tied_attributes(layer)) is not None}
    identity = len(balance) > 1
    indices = list(range(len(layers))) if identity else sorted(keyed)
    seen: dict[int, tuple[str, list[tuple[int, ...]]]] = {}  # keyed layer -> (type name, shapes of its tied names)

    def inspected() -> Any:
        for index, module in zip(indices, shapes_only([layers[i] for i in indices])):
            if index in keyed:
                key, attributes = keyed[index]
                shapes = []
                for attribute in attributes:
                    try:
                        shapes.append(tuple(module.get_parameter(attribute).shape))
                    except AttributeError:
                        names = [name for name, _ in module.named_parameters()]
                        raise UsageError(
                            f"TiedLayerSpec({key!r}, {_type_name(module)}) at layer {index}: the built module has no "
                            f"parameter {attribute!r} (tied_weight_attr); its parameters are {names[:8]}: pass "
                            f"tied_weight_attr= one of them") from None
                seen[index] = (_type_name(module), shapes)
            yield module

    shared = find_shared_parameters(inspected(), balance) if identity else []
    if not identity:
        for _ in inspected():
            pass
    ties: list[Tie] = []
    for item in shared:
        holders = tuple(chunk % ranks for _, _, chunk in item.places)
        if len(set(holders)) > 1:
            ties.append(Tie(None, tuple(zip(item.layers, item.names)), tuple(c for _, _, c in item.places), holders,
                            tuple(label for _, label, _ in item.places)))
    by_key: dict[str, list[int]] = {}
    for index, (key, _) in keyed.items():
        by_key.setdefault(key, []).append(index)
    for key, members in by_key.items():
        counts = {len(keyed[i][1]) for i in members}
        if len(counts) > 1:
            listing = ", ".join(f"layer {i}: {keyed[i][1]}" for i in members)
            raise UsageError(f"TiedLayerSpec key {key!r} ties different numbers of parameters ({listing}): give "
                             "every layer of one key the same number of tied_weight_attr names")
        for position in range(counts.pop()):
            shapes = [seen[i][1][position] for i in members]
            if len(set(shapes)) > 1:
                listing = ", ".join(f"layer {i} ({seen[i][0]}).{keyed[i][1][position]}: {shape}"
                                    for i, shape in zip(members, shapes))
                raise UsageError(f"TiedLayerSpec key {key!r} ties parameters of different shapes ({listing}): "
                                 "tied layers must hold the same shape (use forward_fn to use the weight "
                                 "differently, e.g. transposed)")
            if len(members) == 1:
                continue  # a key used once: nothing to tie
            places = tuple((i, keyed[i][1][position]) for i in members)
            chunks = tuple(chunk_of[i] for i in members)
            ties.append(Tie(key, places, chunks, tuple(c % ranks for c in chunks),
                            tuple(f"layer {i} ({seen[i][0]}).{name}" for i, name in places)))
    return ties


def share_within_rank(ties: Sequence[Tie], built: nn.ModuleDict) -> None:
    """Makes the layers this rank built for one ``TiedLayerSpec`` key hold one ``nn.Parameter`` object (the
    first layer's)."""
    for tie in ties:
        if tie.key is None:
            continue  # an nn.Parameter the layers share already
        here = [(index, name) for index, name in tie.places if str(index) in built]
        if len(here) > 1:
            first = built[str(here[0][0])].get_parameter(here[0][1])
            for index, name in here[1:]:
                share_parameter(built[str(index)], name, first)


@dataclass
class _Group:
    """The ties held by one set of pipeline ranks, and this pipeline's group of those ranks."""

    ranks: tuple[int, ...]
    ties: list[Tie]
    parameters: list[nn.Parameter]  # on this rank, one per tie (tie order)
    group: Any = None               # "pipe" or a hp.ProcessSet
    root: int = 0                   # the lowest holder, as the group's broadcasts name it
    name: str = ""


class TiedWeights:
    """This rank's side of a PipelineModel's ties across ranks: builds the groups (collective over every rank
    of the grid), broadcasts the copies from the lowest holding stage, and sums the gradients each step.

    Args:
        ties: every tie of the model (:func:`find_ties`); those within one rank are left alone.
        built: this rank's layers, keyed by original index.
        grid: the grid.
    """

    def __init__(self, ties: Sequence[Tie], built: nn.ModuleDict, grid: Any) -> None:
        self.grid = grid
        serial = context.current("PipelineModel").sequence("tied")  # every rank builds its models in the same order
        by_ranks: dict[tuple[int, ...], list[Tie]] = {}
        for tie in ties:
            if tie.across_ranks:
                by_ranks.setdefault(tie.ranks, []).append(tie)
        self.groups: list[_Group] = []  # the ones holding this rank
        missing: list[process_sets.ProcessSet] = []
        chosen: dict[tuple[tuple[int, ...], int], Any] = {}
        for ranks in sorted(by_ranks):  # every rank registers the same sets in the same order
            for replica in range(grid.data_replicas):
                if len(ranks) == grid.pipeline_stages:
                    chosen[(ranks, replica)] = "pipe"
                    continue
                members = [grid.rank_of(stage, replica) for stage in ranks]
                found = process_sets.find_process_set(members)
                if found is None:
                    found = process_sets.ProcessSet(members)
                    missing.append(found)
                chosen[(ranks, replica)] = found
        if missing:
            context.current("PipelineModel").register_process_sets(missing, "PipelineModel")
        for number, ranks in enumerate(sorted(by_ranks)):
            if grid.stage not in ranks:
                continue
            group_ties = by_ranks[ranks]
            parameters = []
            for tie in group_ties:
                objects = {id(p): p for p in (built[str(i)].get_parameter(n) for i, n in tie.places
                                               if str(i) in built)}
                if len(objects) != 1:  # share_within_rank left one object per tie and rank
                    raise UsageError(f"stage {grid.stage} holds {len(objects)} different parameters for the tie "
                                     f"{tie} (expected one): is a layer's parameter replaced after it was built?")
                parameters.extend(objects.values())
            group = chosen[(ranks, grid.replica)]
            root = ranks[0] if group == "pipe" else grid.rank_of(ranks[0], grid.replica)
            self.groups.append(_Group(ranks, group_ties, parameters, group, root,
                                      f"hybridpipe.tied.{serial}.{number}"))
        for group in self.groups:
            with torch.no_grad():
                for position, parameter in enumerate(group.parameters):
                    broadcast_(parameter.detach(), root_rank=group.root, name=f"{group.name}.init.{position}",
                               group=group.group)

    @property
    def parameters(self) -> list[nn.Parameter]:
        """This rank's tied parameters (its copies)."""
        return [p for group in self.groups for p in group.parameters]

    def set_aside(self) -> list[torch.Tensor | None]:
        """Takes the gradients accumulated so far off the tied parameters (before a step's backwards)."""
        saved = []
        for parameter in self.parameters:
            saved.append(parameter.grad)
            parameter.grad = None
        return saved

    def put_back(self, saved: list[torch.Tensor | None]) -> None:
        """Undoes :meth:`set_aside` (a step that failed)."""
        for parameter, grad in zip(self.parameters, saved):
            parameter.grad = grad

    def sum_gradients(self, saved: list[torch.Tensor | None]) -> None:
        """Sums this step's gradients of every tied parameter over its holders in this pipeline, then adds
        back what :meth:`set_aside` took. A parameter that got no gradient on any holder keeps what it had."""
        earlier = iter(saved)
        for group in self.groups:  # in the same (sorted) order on every rank
            parameters = group.parameters
            if not parameters:
                continue
            grads = []
            for parameter in parameters:
                grad = parameter.grad
                if grad is None:
                    grad = torch.zeros_like(parameter)
                elif grad.is_sparse:
                    grad = grad.to_dense()
                grads.append(grad)
            present = torch.tensor([float(p.grad is not None) for p in parameters], device=parameters[0].device)
            grouped_allreduce_(grads + [present], op=Sum, name=group.name, group=group.group)
            for parameter, grad, found in zip(parameters, grads, present.tolist()):
                before = next(earlier)
                if not found:
                    parameter.grad = before
                elif before is None:
                    parameter.grad = grad
                else:
                    parameter.grad = before.add_(grad)


def check_schedule(ties: Sequence[Tie], balance: Sequence[int], asynchronous: bool, schedule: str) -> None:
    """Refuses ties across ranks under an asynchronous schedule (each stage updates on its own there).

    Raises:
        PartitionError: naming the tied layers and the fixes.
    """
    across = [tie for tie in ties if tie.across_ranks]
    if asynchronous and across:
        raise shared_parameters_error([tie.shared() for tie in across], balance, schedule)

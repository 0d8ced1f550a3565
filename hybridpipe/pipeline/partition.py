"""Partition a layer sequence into contiguous pipeline stages: uniform, by parameters, by measured time.

Design reasons:

* A balance is a list of layer counts per stage, e.g. ``[3, 5, 4, 4]``: stage ``s`` owns the
  next ``balance[s]`` layers. Contiguity is what a pipeline needs; it makes the optimal
  partition cheap to find exactly.
* :func:`partition_by_weights` minimises the heaviest stage exactly: the optimum is one of
  the ``L(L+1)/2`` contiguous-range sums, and for a candidate bound a greedy pass decides
  feasibility exactly (weights are non-negative, so packing each stage as full as possible
  uses the fewest stages). Binary search over the sorted candidates then finds the smallest
  feasible bound in ``O(L^2 log L)``, with no floating-point tolerance: the greedy pass
  compares the same prefix-sum differences that form the candidates.
* Ties go to lighter early stages: the greedy pass packs from the last stage backwards, and
  :func:`partition_uniform` gives the extra layers to the last stages. Under 1F1B stage 0
  holds ``P`` micro-batches of activations and the last stage one, so early stages should
  be the lighter ones.
* A parameter shared by layers on different stages (a tied embedding and output head) becomes
  one copy per stage, which ``PipelineModel`` ties (``hybridpipe.pipeline.tied``: gradients summed
  across the holding stages every step). :func:`find_shared_parameters` finds such parameters by
  object identity before anything is built; sharing within one stage needs nothing.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch
from torch import nn

from hybridpipe.errors import PartitionError
from hybridpipe.pipeline.microbatch import as_leaf, iter_tensors, map_tensors

__all__ = [
    "BALANCE_METHODS",
    "LayerProfile",
    "BalanceReport",
    "partition_uniform",
    "partition_by_weights",
    "even_out_identical",
    "validate_balance",
    "check_stage_count",
    "SharedParameter",
    "find_shared_parameters",
    "shared_parameters_error",
    "profile_layers",
    "balance_by",
]

BALANCE_METHODS = ("uniform", "parameters", "time")
"""Names accepted by :func:`balance_by`."""


def check_stage_count(num_layers: int, stages: int) -> None:
    if stages < 1:
        raise PartitionError(f"pipeline_stages must be >= 1 (got {stages})")
    if stages > num_layers:
        raise PartitionError(
            f"pipeline_stages {stages} > {num_layers} layers "
            f"(use at most {num_layers} stages or split layers)"
        )


def validate_balance(balance: Sequence[int], num_layers: int, stages: int) -> list[int]:
    """Check an explicit balance and return it as a list of ints.

    Raises:
        PartitionError: more stages than layers, wrong length, a non-integer or empty stage,
            or counts that do not sum to ``num_layers`` — each naming the values and the fix.
    """
    check_stage_count(num_layers, stages)
    counts = list(balance)
    if any(isinstance(count, bool) or not isinstance(count, (int, np.integer)) for count in counts):
        raise PartitionError(f"balance must be a list of ints (got {counts})")
    counts = [int(count) for count in counts]
    if len(counts) != stages:
        raise PartitionError(
            f"balance {counts} has {len(counts)} entries but pipeline_stages is {stages} "
            f"(give one layer count per stage, e.g. {partition_uniform(num_layers, stages)})"
        )
    if min(counts) < 1:
        raise PartitionError(
            f"balance {counts} has a stage with {min(counts)} layers "
            f"(every stage needs at least 1 layer)"
        )
    if sum(counts) != num_layers:
        raise PartitionError(
            f"balance {counts} sums to {sum(counts)} but the model has {num_layers} layers "
            f"(make the counts sum to {num_layers}, e.g. {partition_uniform(num_layers, stages)})"
        )
    return counts


def partition_uniform(num_layers: int, stages: int) -> list[int]:
    """Layer counts differing by at most one; the last ``num_layers % stages`` stages get one more.

    Example:
        >>> partition_uniform(10, 4)
        [2, 2, 3, 3]
    """
    check_stage_count(num_layers, stages)
    base, extra = divmod(num_layers, stages)
    return [base + 1 if s >= stages - extra else base for s in range(stages)]


def _prefix(values: Sequence[float], name: str) -> list[float]:
    floats = [float(value) for value in values]
    if any(not math.isfinite(value) or value < 0 for value in floats):
        raise PartitionError(f"{name} must be finite and >= 0 (got {floats})")
    return [0.0, *accumulate(floats)]


def _greedy_segments(bounds: list[tuple[list[float], float]], num_layers: int) -> list[int] | None:
    """Fewest contiguous segments, packed from the back, whose sums stay within every bound.

    ``bounds`` pairs a prefix-sum list with its limit. Returns the segment lengths in stage
    order, or ``None`` if a single layer already exceeds a limit.
    """

    def fits(start: int, end: int) -> bool:
        return all(prefix[end] - prefix[start] <= limit for prefix, limit in bounds)

    lengths: list[int] = []
    end = num_layers
    while end > 0:
        start = end - 1
        if not fits(start, end):
            return None
        while start > 0 and fits(start - 1, end):
            start -= 1
        lengths.append(end - start)
        end = start
    return lengths[::-1]


def _smallest_bound(prefix: list[float], stages: int, other: list[tuple[list[float], float]]) -> float | None:
    """Smallest limit on ``prefix``'s segment sums that still allows ``stages`` segments."""
    num_layers = len(prefix) - 1
    sums = np.asarray(prefix)
    differences = np.subtract.outer(sums, sums)[np.triu_indices(num_layers + 1, k=1)[::-1]]
    candidates = np.unique(differences)

    def feasible(bound: float) -> bool:
        lengths = _greedy_segments([(prefix, bound), *other], num_layers)
        return lengths is not None and len(lengths) <= stages

    if not feasible(float(candidates[-1])):
        return None
    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        if feasible(float(candidates[middle])):
            high = middle
        else:
            low = middle + 1
    return float(candidates[low])


def even_out_identical(weights: Sequence[float], keys: Sequence[Any]) -> list[float]:
    """``weights`` with every group of layers that share a key (identical layers: the same class, parameter and
    activation sizes) given the group's median: a noisy profile does not make equal layers unequal, so cuts
    between them are decided by position (the partition's own rule), the same on every run."""
    if len(keys) != len(weights):
        raise PartitionError(f"{len(keys)} keys for {len(weights)} weights: give one key per layer")
    groups: dict[Any, list[float]] = {}
    for key, weight in zip(keys, weights):
        groups.setdefault(key, []).append(float(weight))
    medians = {key: statistics.median(values) for key, values in groups.items()}
    return [medians[key] for key in keys]


def partition_by_weights(
    weights: Sequence[float],
    stages: int,
    *,
    memory: Sequence[float] | None = None,
    memory_limit: float | None = None,
) -> list[int]:
    """Optimal contiguous partition: minimise the largest per-stage sum of ``weights``.

    Args:
        weights: Per-layer cost (ms, parameter count, ...), finite and ``>= 0``.
        stages: Number of pipeline stages; every stage gets at least one layer.
        memory: Optional per-layer memory (bytes); needs ``memory_limit``.
        memory_limit: Optional bound on every stage's sum of ``memory``.

    Returns:
        The balance (layer counts per stage).

    Raises:
        PartitionError: bad weights, more stages than layers, only one of ``memory`` /
            ``memory_limit`` given, or a memory limit no partition meets (the message gives
            the smallest feasible limit).

    Example:
        >>> partition_by_weights([1, 1, 1, 5, 1, 1], 3)
        [3, 1, 2]
    """
    num_layers = len(weights)
    check_stage_count(num_layers, stages)
    prefix = _prefix(weights, "weights")
    other: list[tuple[list[float], float]] = []
    if (memory is None) != (memory_limit is None):
        raise PartitionError(
            f"pass both memory and memory_limit or neither (got memory "
            f"{'set' if memory is not None else None}, memory_limit {memory_limit})"
        )
    if memory is not None and memory_limit is not None:
        if len(memory) != num_layers:
            raise PartitionError(
                f"memory has {len(memory)} entries but weights has {num_layers} (give one per layer)"
            )
        memory_prefix = _prefix(memory, "memory")
        other = [(memory_prefix, float(memory_limit))]
        fewest = _greedy_segments(other, num_layers)
        if fewest is None or len(fewest) > stages:
            smallest = _smallest_bound(memory_prefix, stages, [])
            raise PartitionError(
                f"memory_limit {memory_limit} cannot be met with {stages} stages "
                f"(smallest feasible memory_limit is {smallest}; raise it or use more stages)"
            )
    # Feasible: the memory check above passed, and the largest candidate bounds every stage.
    bound = _smallest_bound(prefix, stages, other)
    lengths = _greedy_segments([(prefix, float("inf") if bound is None else bound), *other], num_layers) or []
    while len(lengths) < stages:
        # Splitting a segment never raises a stage sum; peel single layers off the front.
        index = next(i for i, length in enumerate(lengths) if length > 1)
        lengths[index : index + 1] = [1, lengths[index] - 1]
    return lengths


@dataclass(frozen=True)
class SharedParameter:
    """One ``nn.Parameter`` object held by layers on two or more pipeline stages.

    Attributes:
        places: ``(layer index, name, stage)`` for each layer that holds it, in layer order; the
            name is qualified as seen in that layer, e.g. ``"layer 0 (Embedding).weight"``.
        names: the parameter's name inside each of those layers (``"weight"``, ``"out.weight"``),
            in the same order.
    """

    places: tuple[tuple[int, str, int], ...]
    names: tuple[str, ...] = ()

    @property
    def layers(self) -> tuple[int, ...]:
        """Indices of the layers that hold the parameter."""
        return tuple(layer for layer, _, _ in self.places)

    def __str__(self) -> str:
        return ", ".join(f"{name} on stage {stage}" for _, name, stage in self.places)


def find_shared_parameters(layers: Iterable[nn.Module], balance: Sequence[int]) -> list[SharedParameter]:
    """Parameters (the same object, by identity) that layers on different stages hold.

    Buffers are not checked. Layers are visited one at a time, so ``layers`` may be a generator
    that builds each layer on the meta device and drops it.

    Args:
        layers: The layers, in pipeline order.
        balance: Layer counts per stage (already validated), summing to the number of layers.

    Returns:
        One :class:`SharedParameter` per parameter found on more than one stage, in the order of
        first appearance; empty when every shared parameter stays within one stage.

    Raises:
        PartitionError: ``layers`` and ``balance`` disagree on the number of layers.

    Example:
        >>> embedding, head = nn.Embedding(11, 8), nn.Linear(8, 11)
        >>> head.weight = embedding.weight
        >>> [str(s) for s in find_shared_parameters([embedding, nn.Tanh(), head], [2, 1])]
        ['layer 0 (Embedding).weight on stage 0, layer 2 (Linear).weight on stage 1']
    """
    stage_of = [stage for stage, count in enumerate(balance) for _ in range(count)]
    # keyed by id(); the parameter itself is kept so that no id is reused by a later object
    holders: dict[int, tuple[nn.Parameter, list[tuple[int, str, int]], list[str]]] = {}
    count = 0
    for index, layer in enumerate(layers):
        count = index + 1
        if index >= len(stage_of):
            continue
        for name, parameter in layer.named_parameters():
            _, places, names = holders.setdefault(id(parameter), (parameter, [], []))
            places.append((index, f"layer {index} ({type(layer).__name__}).{name}", stage_of[index]))
            names.append(name)
    if count != len(stage_of):
        raise PartitionError(f"balance {list(balance)} sums to {len(stage_of)} but there are {count} layers "
                             f"(pass one count per stage summing to {count})")
    return [SharedParameter(tuple(places), tuple(names)) for _, places, names in holders.values()
            if len({stage for _, _, stage in places}) > 1]


def _balance_keeping_together(spans: list[tuple[int, int]], num_layers: int, stages: int) -> list[int] | None:
    """A balance that keeps each span of layers on one stage (fewest layers on the fullest
    stage), or None when the spans leave fewer than ``stages`` pieces to hand out."""
    unit_sizes: list[int] = []
    index = 0
    for first, last in spans:
        unit_sizes += [1] * (first - index) + [last - first + 1]
        index = last + 1
    unit_sizes += [1] * (num_layers - index)
    if len(unit_sizes) < stages:
        return None
    balance, start = [], 0
    for units in partition_by_weights(unit_sizes, stages):
        balance.append(sum(unit_sizes[start : start + units]))
        start += units
    return balance


def shared_parameters_error(shared: Sequence[SharedParameter], balance: Sequence[int],
                            schedule: str) -> PartitionError:
    """The error for parameters shared across stages under an asynchronous schedule, which cannot tie
    them: each one's places, and the three fixes (a synchronous schedule, one stage, or untying).

    Args:
        shared: the parameters held on more than one stage (not empty).
        balance: the balance they were found under.
        schedule: the asynchronous schedule's name.

    Example:
        >>> embedding, head = nn.Embedding(11, 8), nn.Linear(8, 11)
        >>> head.weight = embedding.weight
        >>> shared = find_shared_parameters([embedding, nn.Tanh(), head], [2, 1])
        >>> print(shared_parameters_error(shared, [2, 1], "pipedream"))  # doctest: +ELLIPSIS
        a parameter is shared by layers on different pipeline stages (layer 0 (Embedding).weight on stage 0, ...
    """
    shown = 4
    listing = "; ".join(str(s) for s in shared[:shown])
    if len(shared) > shown:
        listing += f"; and {len(shared) - shown} more"
    spans: list[tuple[int, int]] = []
    for first, last in sorted((min(s.layers), max(s.layers)) for s in shared):
        if spans and first <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], last))
        else:
            spans.append((first, last))
    num_layers, stages = sum(balance), len(balance)
    together = " and ".join(f"layers {first}-{last}" for first, last in spans)
    suggestion = _balance_keeping_together(spans, num_layers, stages)
    if suggestion is not None:
        keep = f"keep {together} on one stage with balance= (e.g. balance={suggestion})"
    else:
        most = num_layers - sum(last - first for first, last in spans)  # pieces left to hand out
        limit = "only pipeline_stages=1 can" if most == 1 else f"at most pipeline_stages={most} can"
        keep = f"keep {together} on one stage (no balance of {stages} stages can; {limit})"
    noun = "a parameter is" if len(shared) == 1 else f"{len(shared)} parameters are"
    return PartitionError(
        f"{noun} shared by layers on different pipeline stages ({listing}; balance {list(balance)}), and "
        f"schedule {schedule!r} updates each stage on its own, at different times, so the copies on those "
        f"stages would drift apart: use a synchronous schedule ('1f1b', 'gpipe', 'interleaved-1f1b' or "
        f"'zb-h1'), which ties them (their gradients summed across the stages every step), or {keep}, or "
        f"untie them (give each layer its own nn.Parameter: copy.deepcopy the layer, or assign "
        f"nn.Parameter(weight.detach().clone()))"
    )


@dataclass(frozen=True)
class LayerProfile:
    """Measured cost of one layer on a sample micro-batch (medians over the repeats).

    Attributes:
        index: Position of the layer in the sequence.
        forward_ms: Median forward time.
        backward_ms: Median backward time (0 when the output needs no gradient).
        parameters: Number of parameter elements.
        parameter_bytes: Bytes of the parameters.
        activation_bytes: Bytes autograd saves for backward plus the output, parameters excluded.
    """

    index: int
    forward_ms: float
    backward_ms: float
    parameters: int
    parameter_bytes: int
    activation_bytes: int

    @property
    def time_ms(self) -> float:
        """Forward plus backward time."""
        return self.forward_ms + self.backward_ms

    @property
    def memory_bytes(self) -> int:
        """Parameter plus activation bytes."""
        return self.parameter_bytes + self.activation_bytes


def _synchronize(value: Any) -> None:
    if any(tensor.is_cuda for tensor in iter_tensors(value)):
        torch.cuda.synchronize()


def _saved_tensor_recorder(
    parameters: list[nn.Parameter], record: dict[int, int]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``saved_tensors_hooks`` pack hook that records storage bytes of non-parameter tensors."""
    parameter_storages = {parameter.untyped_storage().data_ptr() for parameter in parameters}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            record[storage.data_ptr()] = storage.nbytes()
        return tensor

    return pack


def profile_layers(
    layers: Sequence[nn.Module], sample_input: Any, *, repeats: int = 3, warmup: int = 1
) -> list[LayerProfile]:
    """Time forward and backward of each layer in turn, feeding each output to the next layer.

    Each layer is called like ``nn.Sequential`` does, with one argument (a tensor or a
    tuple/list/dict of tensors). Floating-point inputs require grad, as on a middle stage,
    so backward includes the input gradient; outputs that need no grad are skipped in
    backward. Backward uses gradients of ones; parameters' ``.grad`` are restored afterwards.
    Each layer gets a copy of those inputs (made outside the timing), so a layer that modifies
    its input in place (``nn.ReLU(inplace=True)``) works as it does in a stage.

    Args:
        layers: The layers, in pipeline order.
        sample_input: One micro-batch of model input.
        repeats: Timed runs per layer (the median is reported).
        warmup: Untimed runs per layer first.

    Returns:
        One :class:`LayerProfile` per layer.

    Raises:
        PartitionError: a layer failed on the sample (the message names the layer and its error).
    """
    if repeats < 1 or warmup < 0:
        raise PartitionError(f"need repeats >= 1 and warmup >= 0 (got repeats {repeats}, warmup {warmup})")
    profiles: list[LayerProfile] = []
    value = sample_input
    with torch.enable_grad():
        for index, layer in enumerate(layers):
            parameters = list(layer.parameters())
            saved_grads = [parameter.grad for parameter in parameters]
            for parameter in parameters:  # backward would accumulate into them in place
                parameter.grad = None
            activations: dict[int, int] = {}
            pack = _saved_tensor_recorder(parameters, activations)
            forward_times: list[float] = []
            backward_times: list[float] = []
            for run in range(warmup + repeats):
                # a copy of the leaves, as a stage's input: a layer may modify it in place
                inputs = map_tensors(map_tensors(value, as_leaf), torch.clone)
                activations.clear()
                _synchronize(inputs)
                try:
                    started = time.perf_counter()
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                        output = layer(inputs)
                    _synchronize(output)
                    forwarded = time.perf_counter()
                    roots = [tensor for tensor in iter_tensors(output) if tensor.requires_grad]
                    if roots:
                        torch.autograd.backward(roots, [torch.ones_like(root) for root in roots])
                except (RuntimeError, TypeError, ValueError, IndexError) as error:
                    raise PartitionError(f"profiling layer {index} ({type(layer).__name__}) on the sample failed: "
                                         f"{type(error).__name__}: {error} (check that the layers, called in "
                                         "order, accept the sample input and each other's outputs)") from error
                _synchronize(output)
                finished = time.perf_counter()
                if run >= warmup:
                    forward_times.append((forwarded - started) * 1e3)
                    backward_times.append((finished - forwarded) * 1e3 if roots else 0.0)
            for parameter, grad in zip(parameters, saved_grads):
                parameter.grad = grad
            for tensor in iter_tensors(output):
                storage = tensor.untyped_storage()
                activations.setdefault(storage.data_ptr(), storage.nbytes())
            profiles.append(
                LayerProfile(
                    index=index,
                    forward_ms=statistics.median(forward_times),
                    backward_ms=statistics.median(backward_times),
                    parameters=sum(parameter.numel() for parameter in parameters),
                    parameter_bytes=sum(p.numel() * p.element_size() for p in parameters),
                    activation_bytes=sum(activations.values()),
                )
            )
            value = map_tensors(output, torch.Tensor.detach)
    return profiles


@dataclass
class BalanceReport:
    """Per-stage summary of a balance: layer range, parameters, measured time.

    Example:
        >>> print(BalanceReport([1, 2], [10, 20, 30], [1.0, 2.0, 3.0], "time"))  # doctest: +SKIP
        balance [1, 2] (method "time")
        stage  layers  params    ms  % of slowest
            0  0            10  1.00          20.0
            1  1-2          50  5.00         100.0
    """

    balance: list[int]
    layer_parameters: list[int]
    layer_ms: list[float] | None = None
    method: str = "explicit"

    @property
    def stage_layers(self) -> list[range]:
        """Original layer indices of each stage."""
        ends = list(accumulate(self.balance))
        return [range(end - count, end) for count, end in zip(self.balance, ends)]

    @property
    def stage_parameters(self) -> list[int]:
        """Parameter count of each stage."""
        return [sum(self.layer_parameters[i] for i in layers) for layers in self.stage_layers]

    @property
    def stage_ms(self) -> list[float] | None:
        """Measured forward+backward ms of each stage, if measured."""
        if self.layer_ms is None:
            return None
        return [sum(self.layer_ms[i] for i in layers) for layers in self.stage_layers]

    def __str__(self) -> str:
        stage_ms = self.stage_ms
        basis = stage_ms if stage_ms is not None else [float(p) for p in self.stage_parameters]
        heaviest = max(basis)
        header = "% of slowest" if stage_ms is not None else "% of largest"
        rows = [["stage", "layers", "params", "ms", header]]
        for stage, layers in enumerate(self.stage_layers):
            span = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
            rows.append([
                str(stage),
                span,
                f"{self.stage_parameters[stage]:,}",
                "-" if stage_ms is None else f"{stage_ms[stage]:.2f}",
                f"{100.0 * basis[stage] / heaviest:.1f}" if heaviest > 0 else "-",
            ])
        widths = [max(len(row[column]) for row in rows) for column in range(5)]
        lines = [f'balance {self.balance} (method "{self.method}")']
        for row in rows:
            cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1])]
            cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:])]
            lines.append("  ".join(cells))
        return "\n".join(lines)


def balance_by(
    method: str, layers: Sequence[nn.Module], stages: int, sample_input: Any = None
) -> tuple[list[int], BalanceReport]:
    """Choose a balance by ``"uniform"``, ``"parameters"`` or ``"time"``, with its report.

    ``"time"`` profiles the layers (:func:`profile_layers`) on ``sample_input`` and minimises
    the slowest stage's forward+backward time. With ``"uniform"`` / ``"parameters"``, a given
    ``sample_input`` is profiled only to fill the report's ms column.

    Raises:
        PartitionError: unknown method (lists the valid ones), ``"time"`` without
            ``sample_input``, or more stages than layers.
    """
    if method not in BALANCE_METHODS:
        raise PartitionError(f"unknown balance method {method!r} (use one of {', '.join(BALANCE_METHODS)})")
    if method == "time" and sample_input is None:
        raise PartitionError('balance "time" needs a sample_input micro-batch to profile (pass one)')
    check_stage_count(len(layers), stages)
    parameters = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    layer_ms = None
    if sample_input is not None:
        layer_ms = [profile.time_ms for profile in profile_layers(layers, sample_input)]
    if method == "uniform":
        balance = partition_uniform(len(layers), stages)
    elif method == "parameters":
        balance = partition_by_weights(parameters, stages)
    else:
        balance = partition_by_weights(layer_ms or [], stages)
    return balance, BalanceReport(balance, parameters, layer_ms, method)

"""Profile an ordinary ``nn.Module`` as the planner's layers: its unit calls (hybridpipe/pipeline/split.py).

Design reasons:

* The planner's search works on a list of layers; a module split by ``hp.PipelineModel(module, split=...)``
  is cut between *unit calls* (split.py's trace). So each place a stage may begin becomes the start of a
  planner "layer", and the search's balance (layers per chunk) maps back to the qualified module names
  ``split=`` takes. A cut is offered only where ``split=`` can say it (the first call of a unit: a block
  applied again later cannot be named as a start) and where ``SplitPlan`` accepts it (not after a value
  the glue reads in Python); calls between offered cuts are one planner layer.
* What crosses a cut is what a ``SplitPlan`` with that one boundary would send (every earlier unit output
  a later call or the module's output still needs), not only the previous call's output: a U-Net's skips
  and T5's encoder output count. Bytes are per sample (the sample's bytes over its batch size).
* Times: one whole forward (with autograd, as training runs it), timed at each unit call's end; a call's
  forward is the time since the previous call ended, so the glue before it (masks, position ids) counts
  with it, as every stage replays it. Each call's backward is timed by a hook on the gradient of its
  input: from the next call's input gradient (or the backward's start) to its own (a call whose input
  needs no gradient, such as token ids, runs to the backward's end); only when no hook fires is the whole
  backward shared in proportion to the forward times. Measured at the sample
  micro-batch and at a quarter of it and fitted as a fixed cost per call plus a cost per sample, as
  ``hybridpipe.plan.profile`` does for layers.
* The bytes autograd keeps are counted per call (``saved_tensors_hooks``, parameters and buffers left out),
  glue with the call that follows it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridpipe.errors import UsageError
from hybridpipe.pipeline import split as split_module
from hybridpipe.pipeline.microbatch import iter_tensors, map_tensors
from hybridpipe.plan.profile import LayerCost, Profile, restored, update_costs

__all__ = ["ModuleLayers", "is_module", "module_layers", "profile_module", "split_of"]

#: ``Profile.extra`` key: the qualified name of the unit call each planner layer begins with
CUTS_KEY = "module_cuts"


def is_module(model: Any) -> bool:
    """Whether ``model`` is an ordinary module to be split by tracing (not an ``nn.Sequential`` or a layer list)."""
    return isinstance(model, nn.Module) and not isinstance(model, nn.Sequential)


def _tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(value))


@dataclass
class ModuleLayers:
    """A module's unit calls grouped into the planner's layers.

    Attributes:
        module: the module.
        units: its units (split.py).
        trace: the sample forward's trace.
        starts: per planner layer, the index of the unit call it begins with (a stage may begin there).
        crossing_bytes: per planner layer, the bytes on the sample of what crosses a cut right after it (the
            last layer: the module's output).
    """

    module: nn.Module
    units: list[nn.Module]
    trace: Any
    starts: list[int]
    crossing_bytes: list[int]

    @property
    def names(self) -> list[str]:
        """The qualified name of each planner layer's first unit call."""
        return [self.trace.calls[start].name for start in self.starts]

    def boundaries(self, balance: Sequence[int]) -> list[int]:
        """Unit-call indices where the chunks of ``balance`` (planner layers per chunk) begin, and the end."""
        ends = [0]
        for count in balance:
            ends.append(ends[-1] + count)
        return [self.starts[end] for end in ends[:-1]] + [len(self.trace.calls)]

    def report(self, balance: Sequence[int], stages: int, costs: Sequence[float] | None = None) -> str:
        """``split_report()`` of the split ``balance`` makes, without building it (split.py's report)."""
        boundaries = self.boundaries(balance)
        plan = split_module.SplitPlan(self.module, self.units, self.trace, boundaries, stages)
        calls = [boundaries[c + 1] - boundaries[c] for c in range(len(boundaries) - 1)]
        return split_module.report(plan, calls, costs, stages)


def split_of(names: Sequence[str], balance: Sequence[int]) -> list[str]:
    """``split=`` for ``hp.PipelineModel``: the names where chunks 1, 2, ... of ``balance`` begin.

    Raises:
        UsageError: the balance does not cover the layers the names describe (named, with the fix).
    """
    if sum(balance) != len(names) or any(count < 1 for count in balance):
        raise UsageError(f"balance {list(balance)} does not cut the module's {len(names)} planner layers "
                         f"(it must be positive counts summing to {len(names)}): is the plan for another model?")
    starts, position = [], 0
    for count in balance[:-1]:
        position += count
        starts.append(names[position])
    return starts


def module_layers(module: nn.Module, inputs: Any) -> ModuleLayers:
    """Traces ``module`` on ``inputs`` (one micro-batch, as ``train_step`` gets it) and finds where a stage may
    begin, with what would cross each such cut.

    Raises:
        UsageError: the module is on the meta device (nothing to time), or cannot be traced (split.py's
            SplitError, naming why).
    """
    if split_module.is_meta(module):
        raise UsageError(f"the {type(module).__name__} is on the meta device: there is nothing to time. Build "
                         "it on the CPU (or load its weights) to plan it, or hand the meta module to "
                         "hp.PipelineModel(module, sample=..., split='auto'), which cuts it by parameter counts")
    units, trace = split_module.trace_module(module, inputs)
    calls = trace.calls
    count = len(calls)
    starts, crossing = [0], []
    for index in range(1, count):
        name = calls[index].name
        first = next(c.index for c in calls if c.name == name or c.name.startswith(name + "."))
        if first != index:  # a unit called again: split= names its first call
            continue
        try:
            plan = split_module.SplitPlan(module, units, trace, [0, index, count], 2)
        except split_module.SplitError:  # e.g. a later Python read of an earlier activation's value
            continue
        starts.append(index)
        crossing.append(sum(_tensor_bytes(shape, dtype) for _, shape, dtype in plan.crossing(1)))
    crossing.append(_bytes(trace.output))
    return ModuleLayers(module, units, trace, starts, crossing)


class _CallTimer:
    """Hooks on a module's unit calls (the traced ones, at depth 0) that time each call's forward and the backward
    of its input, and count the bytes autograd keeps during each call (parameters and buffers excluded)."""

    def __init__(self, module: nn.Module, layers: ModuleLayers) -> None:
        self.count = len(layers.trace.calls)
        self.index = self.depth = 0
        self.ends: list[float] = [0.0] * self.count
        self.kept: list[dict[int, int]] = [{} for _ in range(self.count)]
        self.backward_ends: list[float | None] = [None] * self.count  # when each call's input gradient was complete
        self.held = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
        unit_ids = {id(m) for m in layers.units}
        self.handles = [handle for unit in module.modules() if id(unit) in unit_ids
                        for handle in (unit.register_forward_pre_hook(self.pre), unit.register_forward_hook(self.post))]

    def pre(self, _module: nn.Module, args: Any) -> None:
        if self.depth == 0 and self.index < self.count and torch.is_grad_enabled():
            first = next((t for t in iter_tensors(args) if t.requires_grad), None)
            if first is not None:
                index = self.index
                first.register_hook(lambda grad: self.backward_ends.__setitem__(index, time.perf_counter()))
        self.depth += 1

    def post(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            if self.index < self.count:
                self.ends[self.index] = time.perf_counter()
            self.index += 1

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.held:
            self.kept[min(self.index, self.count - 1)][storage.data_ptr()] = storage.nbytes()
        return tensor

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def run(self, module: nn.Module, args: Any, kwargs: Any, loss_fn: Callable[[Any, Any], Any],
            targets: Any) -> tuple[list[float], float, list[float], float]:
        """One forward and backward: each call's forward ms, the backward's ms, each call's share of it (ms) and
        the loss's own forward + backward ms."""
        count = self.count
        self.index, self.depth = 0, 0
        self.backward_ends[:] = [None] * count
        for record in self.kept:
            record.clear()
        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
            output = module(*args, **kwargs)
        finished = time.perf_counter()
        if self.index != count:
            raise UsageError(f"the {type(module).__name__} made {self.index} unit calls on the sample while "
                             f"profiling, {count} while tracing: its forward must call the same modules on the "
                             "same inputs")
        loss = loss_fn(output, targets)
        backward_started = time.perf_counter()
        loss.backward()
        backward_finished = time.perf_counter()
        detached = map_tensors(output, lambda t: t.detach().requires_grad_(t.is_floating_point()))
        loss_started = time.perf_counter()
        loss_fn(detached, targets).backward()
        loss_ms = (time.perf_counter() - loss_started) * 1e3
        forward, previous = [], started
        for index in range(count):
            finish = finished if index == count - 1 else self.ends[index]  # the tail's glue: the last call's
            forward.append((finish - previous) * 1e3)
            previous = self.ends[index]
        # each call's backward: from the gradient of the next call's input (or the backward's start) to that of
        # its own input; a call whose input needs no gradient (the first: token ids) ends when the backward
        # does, one without such an event gives its time to the call before it
        per_call, since = [0.0] * count, backward_started
        for index in reversed(range(count)):
            end = self.backward_ends[index] if index else (self.backward_ends[0] or backward_finished)
            if end is not None:
                per_call[index] = max(0.0, (end - since) * 1e3)
                since = end
        return forward, (backward_finished - backward_started) * 1e3, per_call, loss_ms


def _time_calls(module: nn.Module, layers: ModuleLayers, inputs: Any, loss_fn: Callable[[Any, Any], Any],
                targets: Any, repeats: int, warmup: int) -> tuple[list[float], list[float], list[int], float]:
    """Per unit call: forward ms, backward ms, bytes autograd keeps; and the loss's forward + backward ms (medians
    of ``repeats`` runs after ``warmup``; the module's gradients and buffers are put back afterwards)."""
    count = len(layers.trace.calls)
    args, kwargs = split_module.as_call(inputs)
    runs = []
    timer = _CallTimer(module, layers)
    try:
        with restored([module]) as parameters, torch.enable_grad():  # (batch norm's statistics put back too)
            for run in range(warmup + repeats):
                measured = timer.run(module, args, kwargs, loss_fn, targets)
                for p in parameters:
                    p.grad = None
                if run >= warmup:
                    runs.append(measured)
    finally:
        timer.remove()
    forward_ms = [max(0.0, statistics.median(run[0][i] for run in runs)) for i in range(count)]
    total = sum(forward_ms) or 1.0
    backward_total = statistics.median(run[1] for run in runs)
    measured_ms = [statistics.median(run[2][i] for run in runs) for i in range(count)]
    if sum(measured_ms) > 0:  # per call, scaled to the median total (the medians of the parts need not add up)
        backward_ms = [backward_total * ms / sum(measured_ms) for ms in measured_ms]
    else:  # nothing took a gradient hook: shared in proportion to the forward times
        backward_ms = [backward_total * ms / total for ms in forward_ms]
    return forward_ms, backward_ms, [sum(record.values()) for record in timer.kept], statistics.median(
        run[3] for run in runs)


def profile_module(module: nn.Module, inputs: Any, loss_fn: Callable[[Any, Any], Any], targets: Any,
                   repeats: int = 5, warmup: int = 2,
                   optimizer: Callable[[list[nn.Parameter]], Any] | None = None) -> tuple[Profile, ModuleLayers]:
    """Profiles ``module``'s unit calls as the planner's layers (one process).

    Args:
        module: Any ``nn.Module`` whose forward takes ``inputs`` (a tensor, a tuple: positional arguments, a
            dict: keyword arguments).
        inputs: One micro-batch of inputs; every tensor whose first dimension is the batch is the batch.
        loss_fn: ``loss_fn(output, targets)`` on the module's own output.
        targets: The micro-batch's targets.
        repeats: Timed runs (medians are kept).
        warmup: Untimed runs first.
        optimizer: ``optimizer(params)`` → the torch optimizer training will use (its step is timed on copies of
            the parameters, as :func:`hybridpipe.plan.profile` does).

    Returns:
        ``(profile, layers)``: the :class:`Profile` (one ``LayerCost`` per planner layer, per sample; its
        ``extra["module_cuts"]`` names each layer's first unit call, so a saved profile still gives ``split=``)
        and the :class:`ModuleLayers` (for :meth:`ModuleLayers.report`).

    Raises:
        UsageError: the module cannot be traced or profiled on ``inputs`` (the message says why).
    """
    batch = next((t.shape[0] for t in iter_tensors(inputs) if t.dim() > 0), 0)
    if batch < 1:
        raise UsageError(f"the sample's inputs ({type(inputs).__name__}) need a tensor with a batch dimension "
                         "(dim 0) of at least 1")
    inputs = map_tensors(inputs, lambda t: t.clone(memory_format=torch.contiguous_format))
    layers = module_layers(module, inputs)

    def sliced(value: Any, size: int) -> Any:
        return map_tensors(value, lambda t: t[:size] if t.dim() > 0 and t.shape[0] == batch else t)

    large = _time_calls(module, layers, inputs, loss_fn, targets, repeats, warmup)
    small_batch = max(1, batch // 4)
    small = (_time_calls(module, layers, sliced(inputs, small_batch), loss_fn, sliced(targets, small_batch),
                         repeats, warmup) if small_batch < batch else large)

    def fit(large_ms: float, small_ms: float) -> tuple[float, float]:
        """(per call, per sample) of a + b·n through both measurements, both >= 0 (else proportional)."""
        if small_batch == batch:
            return 0.0, large_ms / batch
        per_sample = (large_ms - small_ms) / (batch - small_batch)
        per_call = large_ms - per_sample * batch
        if per_sample <= 0 or per_call < 0:
            return 0.0, large_ms / batch
        return per_call, per_sample

    count = len(layers.trace.calls)
    costs = []
    for position, start in enumerate(layers.starts):
        end = layers.starts[position + 1] if position + 1 < len(layers.starts) else count
        span = range(start, end)
        forward_call, forward = fit(sum(large[0][i] for i in span), sum(small[0][i] for i in span))
        backward_call, backward = fit(sum(large[1][i] for i in span), sum(small[1][i] for i in span))
        parameters = {id(p): p for i in span for p in layers.trace.calls[i].module.parameters()}
        names = [layers.trace.calls[i].name for i in span]
        costs.append(LayerCost(
            name=names[0] + (f" (+{len(names) - 1} calls)" if len(names) > 1 else ""),
            forward_ms=forward, backward_ms=backward, forward_call_ms=forward_call, backward_call_ms=backward_call,
            output_bytes=layers.crossing_bytes[position] / batch,
            activation_bytes=(sum(large[2][i] for i in span) + layers.crossing_bytes[position]) / batch,
            parameter_bytes=sum(p.numel() * p.element_size() for p in parameters.values()),
            parameter_tensors=sum(1 for p in parameters.values() if p.requires_grad)))
    update, together, per_tensor = 0.0, 0.0, 0.0
    if optimizer is not None:
        update, together, per_tensor = update_costs([p.detach() for p in module.parameters()], optimizer, repeats,
                                                    warmup)
    device = next((str(t.device) for t in iter_tensors(inputs)), "cpu")
    profile = Profile(layers=costs, sample_batch=batch, input_bytes=_bytes(inputs) / batch,
                      loss_ms=large[3] / batch, device=device, update_ms_per_mb=update,
                      update_temporary_factor=together, update_temporary_per_tensor=per_tensor,
                      extra={CUTS_KEY: layers.names, "module": type(module).__name__},
                      note=f"{type(module).__name__}'s {count} unit calls as {len(costs)} layers, measured by "
                           f"hybridpipe.plan.module_profile on {batch} and {small_batch} samples, {repeats} repeats "
                           f"after {warmup} warm-up runs, {torch.get_num_threads()} torch threads")
    return profile, layers

"""Profile a model once, layer by layer, and keep the numbers as JSON (the planner's input).

Design reasons:

* The layer timings come from :func:`hybridpipe.pipeline.partition.profile_layers` (the same
  measurement ``balance="time"`` uses: forward and backward of each layer, medians of warm
  repeats). This module adds what the planner needs besides: the bytes each layer's output has
  per sample (what crosses a stage boundary), the bytes autograd keeps per sample (what a stored
  micro-batch costs), the parameter bytes, and the loss's own time.
* Times are affine in the micro-batch size: a fixed cost per call (Python, kernel launches,
  small-matrix inefficiency) plus a cost per sample, fitted from two measurements (the sample
  micro-batch and a quarter of it). A model priced per sample alone would always prefer the most
  micro-batches; real layers are slower per sample on small ones.
* A split backward (ZB-H1's ``I`` and ``W``) is timed per layer against a whole one, as the
  executor runs it: its extra autograd calls cost more than the fixed part of a layer's backward
  that the affine fit sees (the model charged that fixed part again per layer, and over-predicted
  ZB-H1 by 10–75 % on this machine).
* Plain JSON (``Profile.save`` / ``Profile.load``), so it can be made once on one device and
  reused, or written by hand from published per-layer costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpipe.errors import UsageError
from hybridpipe.pipeline.microbatch import as_leaf, iter_tensors, map_tensors
from hybridpipe.pipeline.partition import profile_layers

__all__ = ["LayerCost", "Profile", "profile", "update_costs", "FORMAT"]

FORMAT = "hybridpipe-profile-1"


@dataclass(frozen=True)
class LayerCost:
    """One layer's cost for one sample (the profiled micro-batch's numbers divided by its size).

    Attributes:
        name: The layer's class name (for reports).
        forward_ms: Forward time per sample.
        backward_ms: Backward time per sample (input and weight gradients).
        forward_call_ms: Fixed forward time per call, whatever the micro-batch size.
        backward_call_ms: Fixed backward time per call.
        output_bytes: Bytes of the layer's output per sample (sent to the next stage when a cut
            follows this layer).
        activation_bytes: Bytes autograd keeps for the backward per sample, output included.
        parameter_bytes: Bytes of the layer's parameters (not per sample).
        parameter_tensors: How many parameter tensors it has (a ``hp.DistributedOptimizer`` hands each one's
            gradient to the engine apart); 0 in a profile that did not count them (then 2 per layer with
            parameters is assumed, a weight and a bias).
        split_call_ms: What a split backward (the zero-bubble schedules' ``I`` then ``W``, as the executor
            runs them: autograd into the inputs and the splittable sublayers' outputs, then per such
            sublayer into its own parameters) costs per call beyond a whole backward. None: not measured
            (the cost model then takes ``backward_call_ms`` for each layer with parameters).
    """

    name: str
    forward_ms: float
    backward_ms: float
    output_bytes: float
    activation_bytes: float
    parameter_bytes: int
    forward_call_ms: float = 0.0
    backward_call_ms: float = 0.0
    split_call_ms: float | None = None
    parameter_tensors: int = 0

    @property
    def gradient_tensors(self) -> int:
        """The parameter tensors whose gradients a data-parallel step reduces (counted, or estimated)."""
        return self.parameter_tensors or (2 if self.parameter_bytes else 0)

    def forward_seconds(self, micro_batch: float) -> float:
        return (self.forward_call_ms + self.forward_ms * micro_batch) / 1e3

    def backward_seconds(self, micro_batch: float) -> float:
        return (self.backward_call_ms + self.backward_ms * micro_batch) / 1e3


@dataclass
class Profile:
    """A model's per-layer costs, per sample.

    Attributes:
        layers: One :class:`LayerCost` per layer, in order.
        sample_batch: The micro-batch size the profile was measured with.
        input_bytes: Bytes of the model's input per sample.
        loss_ms: The loss function's forward + backward per sample.
        device: Where it was measured (e.g. ``"cpu"``).
        note: Free text (how it was made).
        update_ms_per_mb: The optimizer's step per MiB of parameters (0: not measured).
        update_temporary_factor: Bytes of temporaries the optimizer's step allocates per byte of all the
            parameters it steps (an optimizer that steps them together, e.g. torch's foreach Adam: 1).
        update_temporary_per_tensor: The same per byte of one tensor stepped alone (one that steps tensor
            by tensor needs this times its largest tensor, e.g. torch's single-tensor Adam: 0.75).
            Both 0: not measured (plain SGD: 0).
    """

    layers: list[LayerCost]
    sample_batch: int
    input_bytes: float = 0.0
    loss_ms: float = 0.0
    device: str = "cpu"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    update_ms_per_mb: float = 0.0
    update_temporary_factor: float = 0.0
    update_temporary_per_tensor: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Reads :meth:`to_json`'s output (or a hand-written file of the same shape).

        Raises:
            UsageError: not a profile, or fields missing (named).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise UsageError(f"not a JSON profile: {error}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UsageError(f"not a hybridpipe profile (expected \"format\": \"{FORMAT}\")")
        try:
            layers = [LayerCost(**layer) for layer in data["layers"]]
            return cls(layers=layers, sample_batch=int(data["sample_batch"]),
                       input_bytes=float(data.get("input_bytes", 0.0)), loss_ms=float(data.get("loss_ms", 0.0)),
                       device=str(data.get("device", "cpu")), note=str(data.get("note", "")),
                       extra=dict(data.get("extra", {})), update_ms_per_mb=float(data.get("update_ms_per_mb", 0.0)),
                       update_temporary_factor=float(data.get("update_temporary_factor", 0.0)),
                       update_temporary_per_tensor=float(data.get("update_temporary_per_tensor", 0.0)))
        except (KeyError, TypeError) as error:
            raise UsageError(f"profile is missing or has a bad field: {error}") from None

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as file:
            file.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        with open(path) as file:
            return cls.from_json(file.read())

    @property
    def parameter_bytes(self) -> int:
        return sum(layer.parameter_bytes for layer in self.layers)


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(value))


class _TemporaryBytes(TorchDispatchMode):
    """Counts the bytes of the tensors that torch operations create while it is active, and their peak
    (a tensor's bytes count until its last reference goes; outputs that alias an input are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in iter_tensors((args, kwargs or {}))}
        for tensor in iter_tensors(result):
            storage = tensor.untyped_storage()
            if storage.data_ptr() in inputs or not storage.nbytes():
                continue
            inputs.add(storage.data_ptr())
            self.live += storage.nbytes()
            weakref.finalize(tensor, self._release, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return result


def _temporary_bytes(copies: list[nn.Parameter], optimizer: Callable[[list[nn.Parameter]], Any]) -> int:
    """Peak bytes of the tensors one step of ``optimizer`` over ``copies`` creates, after a first step
    has made its state."""
    for copy in copies:
        copy.grad = torch.full_like(copy, 1e-3)
    stepper = optimizer(copies)
    stepper.step()
    counter = _TemporaryBytes()
    with counter:
        stepper.step()
    return counter.peak


def update_costs(parameters: list[torch.Tensor], optimizer: Callable[[list[nn.Parameter]], Any],
                  repeats: int, warmup: int) -> tuple[float, float, float]:
    """The optimizer's step on copies of the parameters (the model's are not touched): its time per MiB,
    and its temporaries per parameter byte over all of them and for the largest tensor alone (an
    optimizer that steps tensor by tensor needs the latter, one that steps them together the former)."""
    copies = [nn.Parameter(torch.zeros_like(p)) for p in parameters if p.is_floating_point()]
    total = sum(p.numel() * p.element_size() for p in copies)
    if not copies or not total:
        return 0.0, 0.0, 0.0
    largest = max(copies, key=lambda p: p.numel() * p.element_size())
    largest_bytes = largest.numel() * largest.element_size()
    per_tensor = _temporary_bytes([nn.Parameter(torch.zeros_like(largest))], optimizer) / largest_bytes
    together = _temporary_bytes(copies, optimizer) / total
    for copy in copies:
        copy.grad = torch.full_like(copy, 1e-3)
    stepper = optimizer(copies)
    runs = []
    for run in range(warmup + repeats + 1):
        started = time.perf_counter()
        stepper.step()
        if run > warmup:  # the first made the state
            runs.append((time.perf_counter() - started) * 1e3)
    return statistics.median(runs) / (total / 2**20), together, per_tensor


def _split_costs(layers: list[nn.Module], sample_input: Any, repeats: int, warmup: int) -> list[float]:
    """Per layer, the ms per call a split backward costs beyond a whole one (median of repeats, >= 0): ``I``
    into the layer's input, the outputs of its splittable sublayers and the other parameters, keeping the
    graph, then ``W`` per recorded sublayer call from that output's gradient into its own parameters — the
    executor's split (hybridpipe.pipeline.stage). 0 for a layer with nothing to split."""
    from hybridpipe.pipeline.stage import input_gradient_targets, splittable, weight_gradients

    costs = []
    value = sample_input
    for layer in layers:
        parts = [module for module in layer.modules() if splittable(module)]
        parameters = [p for p in layer.parameters() if p.requires_grad]
        if not parts or not parameters:
            costs.append(0.0)
            with torch.no_grad():
                value = layer(map_tensors(value, torch.clone))  # an in-place layer leaves the sample alone
            continue
        saved = [p.grad for p in parameters]
        for parameter in parameters:  # (a backward adds to a gradient there: the caller's stays as it was)
            parameter.grad = None
        records: list[tuple[nn.Module, list[torch.Tensor]]] = []

        def record(module: nn.Module, args: Any, output: Any) -> None:
            outputs = [t for t in iter_tensors(output) if t.requires_grad]
            if outputs:
                records.append((module, outputs))

        hooks = [module.register_forward_hook(record) for module in parts]
        extras = []
        try:
            with torch.enable_grad():
                for run in range(warmup + repeats):
                    times = []
                    for split in (False, True):
                        leaves = map_tensors(value, as_leaf)
                        inputs = map_tensors(leaves, torch.clone)  # a layer may modify its input in place
                        records.clear()
                        output = layer(inputs)
                        roots = [t for t in iter_tensors(output) if t.requires_grad]
                        if not roots:
                            break
                        grads = [torch.ones_like(t) for t in roots]
                        started = time.perf_counter()
                        if not split:
                            torch.autograd.backward(roots, grads)
                        else:
                            _, targets = input_gradient_targets(
                                [t for t in iter_tensors(leaves) if t.requires_grad], parameters, records)
                            torch.autograd.backward(roots, grads, inputs=targets, retain_graph=True)
                            weight_gradients(records)
                        times.append((time.perf_counter() - started) * 1e3)
                    if run >= warmup and len(times) == 2:
                        extras.append(times[1] - times[0])
        finally:
            for hook in hooks:
                hook.remove()
            for parameter, grad in zip(parameters, saved):
                parameter.grad = grad
        costs.append(max(0.0, statistics.median(extras)) if extras else 0.0)
        with torch.no_grad():
            value = layer(map_tensors(value, torch.clone))
    return costs


def profile(layers: nn.Sequential | Sequence[nn.Module], sample_input: Any, loss_fn: Callable[[Any, Any], Any],
            sample_target: Any = None, repeats: int = 5, warmup: int = 2,
            optimizer: Callable[[list[nn.Parameter]], Any] | None = None) -> Profile:
    """Measures every layer on ``sample_input`` (one micro-batch) and the loss on its output.

    Args:
        layers: The model as a sequence of layers (as ``hp.PipelineModel`` takes it; built modules).
        sample_input: One micro-batch of model input; its first dimension is the batch.
        loss_fn: ``loss_fn(output, target)``.
        sample_target: The micro-batch's targets (default: the loss is not timed).
        repeats: Timed runs per layer (medians are kept).
        warmup: Untimed runs per layer first.
        optimizer: ``optimizer(params)`` → the torch optimizer training will use; its step is timed, and
            its temporaries measured, on copies of the parameters (``Profile.update_ms_per_mb``,
            ``Profile.update_temporary_factor``). None: neither.

    Returns:
        The :class:`Profile`, per sample. Its layers' times are scaled to add up, at the profiled batch, to the
        median of timed passes through all the layers (forward, loss, backward), in the proportions each layer's
        own timing gave (the factor is in its ``note``).
    """
    layer_list = list(layers)
    batch = next(iter_tensors(sample_input)).shape[0] if any(True for _ in iter_tensors(sample_input)) else 0
    if batch < 1:
        raise UsageError("sample_input needs a tensor with a batch dimension (dim 0) of at least 1")
    # own copies: a slice of a larger tensor (x[:32]) would be counted with its whole storage
    sample_input = map_tensors(sample_input, lambda t: t.clone(memory_format=torch.contiguous_format))
    timings = profile_layers(layer_list, sample_input, repeats=repeats, warmup=warmup)
    small = max(1, batch // 4)
    if small < batch:  # a second size for the fixed cost per call
        small_input = map_tensors(sample_input, lambda t: t[:small] if t.dim() > 0 and t.shape[0] == batch else t)
        small_timings = profile_layers(layer_list, small_input, repeats=repeats, warmup=warmup)
    else:
        small_timings = timings

    def fit(large_ms: float, small_ms: float) -> tuple[float, float]:
        """(per call, per sample) of a + b·n through (batch, large_ms) and (small, small_ms), both >= 0."""
        if small == batch:
            return 0.0, large_ms / batch
        per_sample = (large_ms - small_ms) / (batch - small)
        per_call = large_ms - per_sample * batch
        if per_sample <= 0 or per_call < 0:  # noise: fall back to proportional
            return 0.0, large_ms / batch
        return per_call, per_sample

    splits = _split_costs(layer_list, sample_input, repeats, warmup)
    costs = []
    value = sample_input
    with torch.no_grad():
        for layer, timing, small_timing, split in zip(layer_list, timings, small_timings, splits):
            value = layer(map_tensors(value, torch.clone))  # an in-place layer leaves the sample alone
            forward_call, forward = fit(timing.forward_ms, small_timing.forward_ms)
            backward_call, backward = fit(timing.backward_ms, small_timing.backward_ms)
            costs.append(LayerCost(name=type(layer).__name__, forward_ms=forward, backward_ms=backward,
                                   output_bytes=_bytes(value) / batch,
                                   activation_bytes=timing.activation_bytes / batch,
                                   parameter_bytes=timing.parameter_bytes, forward_call_ms=forward_call,
                                   backward_call_ms=backward_call, split_call_ms=split,
                                   parameter_tensors=sum(1 for p in layer.parameters() if p.requires_grad)))
    loss_ms = 0.0 if sample_target is None else _loss_ms(value, loss_fn, sample_target, repeats, warmup) / batch
    device = next((str(t.device) for t in iter_tensors(sample_input)), "cpu")
    whole = _whole_pass_ms(layer_list, sample_input, loss_fn, sample_target, max(repeats, WHOLE_PASS_RUNS), warmup)
    costs, loss_ms, factor = _scaled_to_whole(costs, loss_ms, batch, whole)
    update, together, per_tensor = 0.0, 0.0, 0.0
    if optimizer is not None:
        update, together, per_tensor = update_costs(
            [p.detach() for layer in layer_list for p in layer.parameters()], optimizer, repeats, warmup)
    return Profile(layers=costs, sample_batch=batch, input_bytes=_bytes(sample_input) / batch, loss_ms=loss_ms,
                   update_ms_per_mb=update, update_temporary_factor=together,
                   update_temporary_per_tensor=per_tensor,
                   device=device, note=f"measured by hybridpipe.plan.profile on {batch} samples, "
                                       f"and {small}, {repeats} repeats after {warmup} warm-up runs, "
                                       f"{torch.get_num_threads()} torch threads; layer times scaled by "
                                       f"{factor:.3f} to the whole pass ({whole:.3f} ms)")


def _loss_ms(value: Any, loss_fn: Callable[[Any, Any], Any], target: Any, repeats: int, warmup: int) -> float:
    """Median ms of the loss and its backward on the last layer's output ``value``."""
    output = map_tensors(value, lambda t: t.detach().requires_grad_(t.is_floating_point()))
    runs = []
    for run in range(warmup + repeats):
        started = time.perf_counter()
        loss_fn(output, target).backward()
        if run >= warmup:
            runs.append((time.perf_counter() - started) * 1e3)
    return statistics.median(runs)


def forward_backward(model: Any, value: Any, loss_fn: Callable[[Any, Any], Any], target: Any,
                     layered: bool = True) -> None:
    """One forward and backward as training computes it: ``value`` through ``model``'s layers one after another
    (``layered``) or ``model`` called on it as ``train_step`` gets a batch; then the loss's backward where
    ``target`` is given, else the backward of the output's gradients all ones (a slice before the last stage).
    Gradients are added into the parameters (:func:`restored` around it leaves the caller's alone)."""
    if layered:
        for layer in model:
            value = layer(value)
    else:
        from hybridpipe.pipeline.split import as_call

        args, kwargs = as_call(value)
        value = model(*args, **kwargs)
    if target is not None:
        loss_fn(value, target).backward()
        return
    roots = [t for t in iter_tensors(value) if t.requires_grad]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])


@contextlib.contextmanager
def restored(modules: Sequence[nn.Module]) -> Iterator[list[nn.Parameter]]:
    """Passes run inside change nothing the caller sees: the parameters' ``.grad`` are set to None on entry (a
    backward adds into a gradient that is there) and put back on exit, with the buffers' values (batch norm's
    running statistics). Yields the parameters."""
    parameters = [p for module in modules for p in module.parameters()]
    grads = [p.grad for p in parameters]
    buffers = [(b, b.clone()) for module in modules for b in module.buffers()]
    for parameter in parameters:
        parameter.grad = None
    try:
        yield parameters
    finally:
        for parameter, grad in zip(parameters, grads):
            parameter.grad = grad
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


#: Timed runs of the whole pass that :func:`profile` scales the layers' times to (at least its ``repeats``).
WHOLE_PASS_RUNS = 11


def _whole_pass_ms(layers: list[nn.Module], sample_input: Any, loss_fn: Callable[[Any, Any], Any],
                   sample_target: Any, repeats: int, warmup: int) -> float:
    """Median ms of the forward through all the layers one after another (then the loss, with a target), and the
    backward through them all: what a stage holding them computes. Each layer timed alone runs with its own
    weights and input hot in the caches and pays a hook's bookkeeping, and ten-odd small timings vary more
    than one large one, so their sum misses the whole pass, by tens of per cent on this VM (an MLP of 8 MiB:
    the sums of three profiles made seconds apart were 19-27 ms around a pass of 24). The parameters'
    ``.grad`` are restored afterwards."""
    parameters = [p for layer in layers for p in layer.parameters()]
    saved = [p.grad for p in parameters]
    cuda = any(t.is_cuda for t in iter_tensors(sample_input))
    runs = []
    try:
        with torch.enable_grad():
            for run in range(warmup + repeats):
                for parameter in parameters:  # (a backward adds to a gradient there: the caller's stays as it was)
                    parameter.grad = None
                value = map_tensors(sample_input, torch.clone)  # an in-place first layer leaves the sample alone
                if cuda:
                    torch.cuda.synchronize()
                started = time.perf_counter()
                forward_backward(layers, value, loss_fn, sample_target)
                if cuda:
                    torch.cuda.synchronize()
                if run >= warmup:
                    runs.append((time.perf_counter() - started) * 1e3)
    finally:
        for parameter, grad in zip(parameters, saved):
            parameter.grad = grad
    return statistics.median(runs)


def _scaled_to_whole(costs: list[LayerCost], loss_ms: float, batch: int,
                     whole_ms: float) -> tuple[list[LayerCost], float, float]:
    """The layers' costs (and the loss's, per sample) scaled so that, at the profiled batch, they add up to
    the whole pass's ``whole_ms``; their proportions are the per-layer measurements'. Returns them and the factor."""
    parts = sum(c.forward_call_ms + c.forward_ms * batch + c.backward_call_ms + c.backward_ms * batch
                for c in costs) + loss_ms * batch
    if parts <= 0 or whole_ms <= 0:
        return costs, loss_ms, 1.0
    factor = whole_ms / parts
    scaled = [dataclasses.replace(
        c, forward_ms=c.forward_ms * factor, backward_ms=c.backward_ms * factor,
        forward_call_ms=c.forward_call_ms * factor, backward_call_ms=c.backward_call_ms * factor,
        split_call_ms=None if c.split_call_ms is None else c.split_call_ms * factor) for c in costs]
    return scaled, loss_ms * factor, factor

"""Models and data shared by the variants of bench/pipeline.py.

Every variant (one process, hybridpipe, torch.distributed.pipelining) builds layer ``i`` with
:func:`build_layer` under ``torch.manual_seed(seed + i)``, which is what
``hp.PipelineModel(..., seed_layers=seed)`` does for an ``hp.LayerSpec``; so all variants start
from the same weights whatever the stage count, and each rank builds only its own layers (its
peak RSS holds its share of the model, not the whole model).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

MODELS = ("mlp", "sleep")


class Block(nn.Module):
    """One layer of the MLP: Linear(width, width) followed by Tanh."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class SleepClock:
    """Per-process totals of the time the sleep layers actually slept (time.sleep overshoots), and,
    while ``events`` is a list, every sleep as ``(kind, micro_batch, start, end)`` with
    ``time.perf_counter`` times (CLOCK_MONOTONIC on Linux: comparable between processes).

    The micro-batch of a forward is its position among this step's forwards on this rank divided
    by ``layers`` (this stage's layer count): every schedule here runs forwards in micro-batch
    order. A backward inherits its forward's micro-batch.
    """

    forward_s = 0.0
    forward_calls = 0
    backward_s = 0.0
    backward_calls = 0
    events: list | None = None
    layers = 1
    _step_forwards = 0

    @classmethod
    def reset(cls) -> None:
        cls.forward_s = cls.backward_s = 0.0
        cls.forward_calls = cls.backward_calls = 0

    @classmethod
    def new_step(cls) -> None:
        cls._step_forwards = 0
        if cls.events is not None:
            cls.events.append(("step", -1, 0.0, 0.0))

    @classmethod
    def snapshot(cls) -> dict[str, float]:
        return {"forward_s": cls.forward_s, "forward_calls": cls.forward_calls,
                "backward_s": cls.backward_s, "backward_calls": cls.backward_calls}


def _sleep(seconds: float) -> tuple[float, float]:
    start = time.perf_counter()
    if seconds > 0:  # time.sleep(0) is still a syscall plus the kernel's timer slack (~50 µs)
        time.sleep(seconds)
    return start, time.perf_counter()


class _SleepFunction(torch.autograd.Function):
    """Identity on the layer's input whose forward sleeps ``forward_s`` and whose backward sleeps
    ``backward_s`` (the input-gradient half of the layer's backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        ctx.micro_batch = SleepClock._step_forwards // SleepClock.layers
        SleepClock._step_forwards += 1
        start, end = _sleep(forward_s)
        SleepClock.forward_s += end - start
        SleepClock.forward_calls += 1
        if SleepClock.events is not None:
            SleepClock.events.append(("F", ctx.micro_batch, start, end))
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _backward_sleep(ctx.backward_s, ctx.micro_batch)
        return grad, None, None


class _WeightSleepFunction(torch.autograd.Function):
    """Identity on the layer's weight whose backward sleeps ``backward_s`` (the weight-gradient half)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        ctx.micro_batch = max(SleepClock._step_forwards - 1, 0) // SleepClock.layers
        return weight.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _backward_sleep(ctx.backward_s, ctx.micro_batch)
        return grad, None


def _backward_sleep(seconds: float, micro_batch: int) -> None:
    start, end = _sleep(seconds)
    SleepClock.backward_s += end - start
    SleepClock.backward_calls += 0.5
    if SleepClock.events is not None:
        SleepClock.events.append(("B", micro_batch, start, end))


class SleepLayer(nn.Module):
    """A layer whose cost is a fixed sleep: forward ``forward_ms``, backward ``backward_ms``, half of it
    on the input-gradient path and half on the weight-gradient path, so that a zero-bubble schedule,
    which asks autograd for the two separately, sleeps half in each of its I and W passes.

    It has a weight (one scale per feature) so that every stage, the first one included, has
    parameters and runs a backward; the arithmetic on the tiny tensors is negligible. Its weight is
    used only in its forward (``hybridpipe_split_backward``).
    """

    hybridpipe_split_backward = True

    def __init__(self, width: int, forward_ms: float, backward_ms: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.forward_s, self.backward_s = forward_ms / 1e3, backward_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _SleepFunction.apply(x, self.forward_s, self.backward_s / 2)
        return h * _WeightSleepFunction.apply(self.weight, self.backward_s / 2)


def layer_class_and_args(model: str, width: int, forward_ms: float = 0.0,
                         backward_ms: float = 0.0) -> tuple[type[nn.Module], tuple]:
    """The class and constructor arguments of every layer of ``model``."""
    if model == "mlp":
        return Block, (width,)
    if model == "sleep":
        return SleepLayer, (width, forward_ms, backward_ms)
    raise ValueError(f"unknown model {model!r} (use one of {', '.join(MODELS)})")


def build_layer(index: int, seed: int, cls: type[nn.Module], args: tuple) -> nn.Module:
    """Layer ``index`` built under ``torch.manual_seed(seed + index)``; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + index)
        return cls(*args)


def uniform_balance(layers: int, stages: int) -> list[int]:
    """Layer counts per stage, as equal as possible, the first stages one larger when uneven."""
    if stages > layers:
        raise ValueError(f"{stages} stages need at least {stages} layers (got {layers})")
    base, extra = divmod(layers, stages)
    return [base + 1 if s < extra else base for s in range(stages)]


def stage_range(balance: list[int], stage: int) -> range:
    start = sum(balance[:stage])
    return range(start, start + balance[stage])


def make_batch(batch: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and regression targets, the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, width, generator=generator)
    targets = torch.randn(batch, width, generator=generator).clamp_(-0.9, 0.9)
    return inputs, targets


def _steps(events: list) -> list[dict[tuple[str, int], tuple[float, float]]]:
    """One rank's event list cut at the step markers; per step, action -> (first start, last end)."""
    steps: list[dict[tuple[str, int], tuple[float, float]]] = []
    for kind, micro_batch, start, end in events:
        if kind == "step":
            steps.append({})
            continue
        key = (kind, micro_batch)
        if key in steps[-1]:  # the stage's other layers: one action spans them all
            first, last = steps[-1][key]
            start, end = min(first, start), max(last, end)
        steps[-1][key] = (start, end)
    return steps


def action_gaps(events_per_rank: list[list]) -> dict[str, list[float]]:
    """Framework time between the sleeps, from every rank's sleep events (stage = rank).

    For each action (one micro-batch's forward or backward on one stage), the time from the moment
    it could start to the moment its first sleep started:
      * "local": its input was already there, so it waited for the previous action of its own
        rank: the time between is what the framework spends per action (bookkeeping, sends,
        receives, autograd);
      * "hop": the input came last, from the neighbouring stage: that time also holds the
        transfer and the wake-up of the waiting rank.
    """
    stages = len(events_per_rank)
    per_rank = [_steps(events) for events in events_per_rank]
    gaps: dict[str, list[float]] = {"local": [], "hop": []}
    for step in range(min(len(steps) for steps in per_rank)):
        times = [per_rank[r][step] for r in range(stages)]
        for r in range(stages):
            order = sorted(times[r].items(), key=lambda item: item[1][0])
            previous_end = None
            for (kind, micro_batch), (start, end) in order:
                dependency = None
                if kind == "F" and r > 0:
                    dependency = times[r - 1].get(("F", micro_batch), (0.0, None))[1]
                elif kind == "B" and r < stages - 1:
                    dependency = times[r + 1].get(("B", micro_batch), (0.0, None))[1]
                if dependency is not None and (previous_end is None or dependency >= previous_end):
                    gaps["hop"].append(start - dependency)
                elif previous_end is not None:
                    gaps["local"].append(start - previous_end)
                previous_end = end
    return gaps

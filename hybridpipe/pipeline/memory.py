"""Memory per rank: ``model.memory_report()``.

Per rank of the grid: the bytes of this stage's parameters, of the gradients it holds now (the
parameters' ``.grad``, plus a ZeRO optimizer's shard gradient), of the optimizer's state (the tensors in
``optimizer.state``: with ZeRO, this replica's shard only), the peak of the activations autograd kept
for backward during ``train_step`` (measured while ``model.measure_activations`` is True; the peak
stays after it is switched off), the peak
resident set size of the process, and on a GPU ``torch.cuda.max_memory_allocated``.

How activations are measured: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd
saves for backward; each is counted once per storage while some saved reference to it lives (the
parameters themselves are not activations and are skipped), and the peak of that live total is kept.
Tensors the executor stores itself for re-computation (``checkpoint=``: a stage's inputs) are not
autograd's and are not counted; what re-computation saves again is, while it lives. Tensors sharing a parameter's storage (a Linear's weight, saved as
a transposed view) are parameters and are skipped. The hooks cost a
Python call per saved tensor, hence the switch (off by default).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

import torch

from ..collectives.allgather import allgather_object

__all__ = ["ActivationMeter", "MemoryReport", "RankMemory", "report"]


class _Saved:
    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: int, meter: ActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Live and peak bytes of the tensors autograd saves while :meth:`hooks` is active."""

    def __init__(self, parameters: Any = ()) -> None:
        self.live = 0
        self.peak = 0
        self._references: dict[int, list[int]] = {}  # storage pointer -> [saved references, bytes]
        # weights autograd saves (a Linear's weight, as a transposed view) are parameters, not activations
        self._parameters = {p.untyped_storage().data_ptr() for p in parameters}

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, torch.nn.Parameter) or tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._parameters:
            return tensor
        entry = self._references.get(key)
        if entry is None:
            entry = self._references[key] = [0, storage.nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._references.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._references[key]


@dataclass
class RankMemory:
    rank: int
    stage: int
    replica: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations_peak: int | None  # None: not measured
    stored_micro_batches: int     # the schedule's peak of micro-batches held (last train_step)
    peak_rss: int
    cuda_peak: int | None
    gathered_peak: int | None = None  # ZeRO-3: the most gathered parameter bytes held at once


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2 ** 20:.2f}"


@dataclass
class MemoryReport:
    """Every rank's :class:`RankMemory` (the same list on every rank); ``str()`` is a table in MiB."""

    ranks: list[RankMemory]

    def __str__(self) -> str:
        header = ["rank", "stage", "replica", "params", "gathered peak", "grads", "optimizer", "activations peak",
                  "stored mb", "peak RSS", "CUDA peak"]
        rows = [[str(r.rank), str(r.stage), str(r.replica), _mib(r.parameters), _mib(r.gathered_peak),
                 _mib(r.gradients), _mib(r.optimizer_state), _mib(r.activations_peak), str(r.stored_micro_batches),
                 _mib(r.peak_rss), _mib(r.cuda_peak)] for r in self.ranks]
        widths = [max(len(c) for c in column) for column in zip(header, *rows)]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        return "\n".join(["memory per rank (MiB)", line(header), *(line(row) for row in rows)])

    def __getitem__(self, rank: int) -> RankMemory:
        return self.ranks[rank]


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def report(model: Any, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Collective over the world: every rank's memory (see the module docstring)."""
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    parameters = list(model.parameters())
    gradients = _tensor_bytes(p.grad for p in parameters)
    held = _tensor_bytes(parameters)  # zero=3: the freed parameters hold nothing, their shard does
    state, gathered = 0, None
    if optimizer is not None:
        if getattr(optimizer, "zero", 0):
            gradients += _tensor_bytes(optimizer.shard_gradients())
        if getattr(optimizer, "zero", 0) == 3:
            held += _tensor_bytes(optimizer.shard_parameters())
            gathered = optimizer.gathered_peak_bytes
        state = sum(v.numel() * v.element_size() for entry in optimizer.state.values() for v in entry.values()
                    if torch.is_tensor(v) and v.dim() > 0)
    device = getattr(model, "device", torch.device("cpu"))
    cuda = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    meter = getattr(model, "_activation_meter", None)
    last = getattr(model, "last_step", None)
    grid = model.grid
    mine = RankMemory(grid.rank, grid.stage, grid.replica, held, gradients, state,
                      meter.peak if meter is not None else None, int(getattr(last, "peak_stored", 0) or 0),
                      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, cuda, gathered)
    return MemoryReport(sorted(allgather_object(mine, group="world"), key=lambda r: r.rank))

"""PipelineModel: a layer sequence cut into stages, one stage per process of a pipeline.

Design reasons:

* Every rank of the grid constructs the same ``PipelineModel`` (a collective call, like
  ``hp.init``); each keeps only its own stage's layers, in ``self.layers``, a ``ModuleDict`` keyed
  by the ORIGINAL layer index. So ``named_parameters()`` and ``state_dict()`` say
  ``layers.7.weight`` whatever the stage count, and an optimizer over ``model.parameters()``
  sees this stage's parameters only.
* Layers may be given as :class:`LayerSpec` (class + arguments): then a rank builds only the
  layers of its stage, so a model too big for one process can be built. ``seed_layers=S``
  builds layer ``i`` under ``torch.manual_seed(S + i)`` (RNG state restored afterwards), so its
  initial weights do not depend on the stage count.
* Balance "time" profiles forward+backward of every layer on world rank 0 (building
  LayerSpec layers one at a time and dropping each after use) on ``sample_input`` and
  broadcasts the resulting optimal balance, so every pipeline of the grid uses the same one.
  Without ``sample_input`` the default balance falls back to "parameters" and the report says so.
* All ranks of the grid check that they agree on the configuration (layer count, balance,
  micro-batches, schedule, checkpoint); a difference raises on every rank.
* A parameter shared by layers on different stages (``head.weight = embedding.weight``) is
  refused with ``PartitionError`` once the balance is known and before any layer is built, moved
  or communicated with: each stage would otherwise train its own copy. The check needs no
  communication (every rank finds the same from the same model); its result is part of the
  agreement above, so ranks given different models raise ``MismatchError`` rather than some of
  them waiting in a collective that the others left. LayerSpec layers are built on the meta
  device for it, which keeps any Parameter their factory reuses.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hybridpipe import runtime
from hybridpipe.comm.engine import call
from hybridpipe.errors import HybridPipeError, MismatchError, PartitionError
from hybridpipe.pipeline import microbatch
from hybridpipe.pipeline.partition import (
    BALANCE_METHODS,
    BalanceReport,
    _check_stage_count,
    find_shared_parameters,
    partition_by_weights,
    partition_uniform,
    profile_layers,
    shared_parameters_error,
    validate_balance,
)
from hybridpipe.pipeline.schedule import get_schedule, validate
from hybridpipe.pipeline.stage import CHECKPOINT_MODES, StageExecutor, StepResult

__all__ = ["LayerSpec", "PipelineModel"]


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
            raise TypeError(f"LayerSpec({getattr(self.cls, '__name__', self.cls)!r}) built a "
                            f"{type(layer).__name__}, not an nn.Module")
        return layer

    def __repr__(self) -> str:
        arguments = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"LayerSpec({getattr(self.cls, '__name__', self.cls)}, {', '.join(arguments)})"


def _shapes_only(layers: Sequence[nn.Module | LayerSpec]) -> Iterable[nn.Module]:
    """Each layer as it is, or a LayerSpec built on PyTorch's meta device (no memory, no RNG),
    one at a time. A Parameter the spec's factory reuses keeps its identity."""
    for layer in layers:
        if isinstance(layer, LayerSpec):
            with torch.device("meta"):
                yield layer.build()
        else:
            yield layer


def _build(layer: nn.Module | LayerSpec, index: int, seed_layers: int | None) -> nn.Module:
    if isinstance(layer, nn.Module):
        return layer
    if seed_layers is None:
        return layer.build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_layers + index)
        return layer.build()


class _LazyLayers(Sequence):
    """The layer list as a sequence whose LayerSpecs are built on access (one at a time)."""

    def __init__(self, layers: list[nn.Module | LayerSpec], seed_layers: int | None) -> None:
        self._layers, self._seed = layers, seed_layers

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            raise TypeError("_LazyLayers does not slice")
        return _build(self._layers[index], index, self._seed)

    def __iter__(self) -> Iterator[nn.Module]:
        for index in range(len(self._layers)):
            yield self[index]


class _Stage(nn.Module):
    """This stage's layers, applied in order like nn.Sequential."""

    def __init__(self, layers: nn.ModuleDict) -> None:
        super().__init__()
        self.order = list(layers.keys())
        self.layers = layers

    def forward(self, x: Any) -> Any:
        for key in self.order:
            x = self.layers[key](x)
        return x


class PipelineModel(nn.Module):
    """A model cut into ``P`` stages run by the ``P`` ranks of each pipeline of the grid.

    Args:
        layers: ``nn.Sequential``, or a list of ``nn.Module`` / :class:`LayerSpec`. Each layer is
            called with one argument, the previous layer's output (a tensor, or a tuple/list/dict
            of tensors and other values).
        loss_fn: ``loss_fn(output, target)`` → scalar, a mean over the micro-batch (e.g.
            ``nn.CrossEntropyLoss()``). Needed by :meth:`train_step`.
        micro_batches: ``M``, micro-batches per mini-batch.
        balance: layer counts per stage (``[3, 5, 4, 4]``), or "uniform", "parameters", "time";
            None means "time" when ``sample_input`` is given, else "parameters".
        schedule: "1f1b" (PipeDream-Flush; memory bounded by ``P``) or "gpipe".
        checkpoint: re-materialization: "never" (store activations), "except_last" (recompute all
            micro-batches but the last, GPipe's default) or "always".
        sample_input: one micro-batch of model input, for balance "time".
        seed_layers: build LayerSpec layer ``i`` under seed ``seed_layers + i``.
        device: where this stage computes (default: where its first parameter is, else CPU).

    Raises:
        NotInitializedError: ``hp.init`` was not called.
        PartitionError: bad balance (values named), more stages than layers, or a parameter shared
            by layers on different stages (weight tying across stages is not supported yet).
        ScheduleError: unknown schedule.
        MismatchError: ranks constructed it with different settings (on every rank).
    """

    def __init__(
        self,
        layers: nn.Sequential | Sequence[nn.Module | LayerSpec],
        loss_fn: Any = None,
        micro_batches: int = 1,
        balance: Sequence[int] | str | None = None,
        schedule: str = "1f1b",
        checkpoint: str = "never",
        sample_input: Any = None,
        seed_layers: int | None = None,
        device: Any = None,
    ) -> None:
        super().__init__()
        grid = runtime._require("PipelineModel").grid
        if isinstance(layers, nn.Sequential):
            layer_list: list[nn.Module | LayerSpec] = list(layers)
        elif isinstance(layers, (list, tuple)):
            layer_list = list(layers)
        else:
            raise TypeError(f"layers must be an nn.Sequential or a list of nn.Module / hp.LayerSpec, "
                            f"got {type(layers).__name__}")
        for index, layer in enumerate(layer_list):
            if not isinstance(layer, (nn.Module, LayerSpec)):
                raise TypeError(f"layers[{index}] is a {type(layer).__name__}; pass nn.Module or hp.LayerSpec")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise HybridPipeError(f"micro_batches must be a positive int (got {micro_batches!r})")
        if checkpoint not in CHECKPOINT_MODES:
            raise HybridPipeError(f"unknown checkpoint mode {checkpoint!r} (use one of "
                                  f"{', '.join(map(repr, CHECKPOINT_MODES))})")
        stages = grid.pipeline_stages
        get_schedule(schedule, stages, micro_batches)  # unknown name → ScheduleError on every rank
        object.__setattr__(self, "loss_fn", loss_fn)  # not a submodule: no keys in state_dict
        self.micro_batches = micro_batches
        self.schedule_name = schedule.strip().lower()
        self.checkpoint = checkpoint
        self.grid = grid
        self.stage = grid.stage
        self.stages = stages
        self._schedule_cache: dict[tuple[str, int, int], list] = {}  # see _schedule

        balance_list, report = self._choose_balance(layer_list, balance, sample_input, seed_layers, grid)
        # before any layer is built or moved, and before the pipeline communicator exists
        shared = find_shared_parameters(_shapes_only(layer_list), balance_list) if stages > 1 else []
        self._agree(grid, len(layer_list), balance_list, tuple(s.layers for s in shared))
        if shared:
            raise shared_parameters_error(shared, balance_list)
        self.balance = balance_list
        self.balance_report = report
        own = self.layers_of_stage(self.stage)
        built = nn.ModuleDict({str(i): _build(layer_list[i], i, seed_layers) for i in own})
        self.layers = built
        object.__setattr__(self, "_stage_module", _Stage(built))  # same layers; not registered twice
        if device is None:
            first = next(iter(built.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.to(self.device)
        # private: our tags never meet anyone else's messages
        self._comm = call("pipe", "PipelineModel", grid.pipe_comm.Dup)
        self._executor = StageExecutor(self._stage_module, self.stage, stages, self._comm, self.device)
        self.last_step: StepResult | None = None

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _choose_balance(layers: list, balance: Any, sample_input: Any, seed_layers: int | None,
                        grid: runtime.Grid) -> tuple[list[int], BalanceReport]:
        stages = grid.pipeline_stages
        count = len(layers)
        if balance is not None and not isinstance(balance, str):
            balance_list = validate_balance(list(balance), count, stages)
            return balance_list, BalanceReport(balance_list, PipelineModel._parameter_counts(layers, seed_layers),
                                               None, "explicit")
        method = balance if balance is not None else ("time" if sample_input is not None else "parameters")
        if method not in BALANCE_METHODS:
            raise PartitionError(f"unknown balance {method!r}: pass a list of layer counts or one of "
                                 f"{', '.join(map(repr, BALANCE_METHODS))}")
        _check_stage_count(count, stages)
        if method == "time" and sample_input is None:
            raise PartitionError('balance="time" profiles the layers on a sample micro-batch: pass '
                                 'sample_input=<one micro-batch of inputs>, or use balance="parameters"')
        if method == "uniform":
            balance_list = partition_uniform(count, stages)
            return balance_list, BalanceReport(balance_list, PipelineModel._parameter_counts(layers, seed_layers),
                                               None, "uniform")
        if method == "parameters":
            parameters = PipelineModel._parameter_counts(layers, seed_layers)
            balance_list = partition_by_weights(parameters, stages)
            label = "parameters" if balance is not None else "parameters (default: no sample_input to time)"
            return balance_list, BalanceReport(balance_list, parameters, None, label)
        # "time": world rank 0 profiles, everyone gets its numbers (one pickled broadcast)
        profiled = None
        if grid.rank == 0:
            try:
                profiles = profile_layers(_LazyLayers(layers, seed_layers), copy.deepcopy(sample_input))
                profiled = ([p.time_ms for p in profiles], PipelineModel._parameter_counts(layers, seed_layers))
            except Exception as error:  # every rank must raise, not only rank 0
                profiled = f"{type(error).__name__}: {error}"
        profiled = call(None, "PipelineModel", lambda: grid.world_comm.bcast(profiled, root=0))
        if isinstance(profiled, str):
            raise PartitionError(f'balance="time": profiling the layers on world rank 0 failed ({profiled})')
        layer_ms, parameters = profiled
        balance_list = partition_by_weights(layer_ms, stages)
        return balance_list, BalanceReport(balance_list, parameters, layer_ms, "time")

    @staticmethod
    def _parameter_counts(layers: list, seed_layers: int | None) -> list[int]:
        return [sum(p.numel() for p in module.parameters()) for module in _shapes_only(layers)]

    def _agree(self, grid: runtime.Grid, count: int, balance: list[int],
               shared_across_stages: tuple[tuple[int, ...], ...]) -> None:
        mine = (count, tuple(balance), self.micro_batches, self.schedule_name, self.checkpoint,
                shared_across_stages)
        everyone = call(None, "PipelineModel", lambda: grid.world_comm.allgather(mine))
        if len(set(everyone)) > 1:
            names = ("layers", "balance", "micro_batches", "schedule", "checkpoint",
                     "layers_sharing_parameters_across_stages")
            differ = [name for i, name in enumerate(names) if len({e[i] for e in everyone}) > 1]
            listing = "; ".join(f"rank {r}: " + ", ".join(f"{n}={e[names.index(n)]!r}" for n in differ)
                                for r, e in enumerate(everyone))
            raise MismatchError(f"PipelineModel: ranks disagree on {', '.join(differ)} ({listing}); every rank "
                                "must build it with the same layers and settings")

    # ------------------------------------------------------------------ introspection

    def layers_of_stage(self, stage: int) -> range:
        """Original indices of the layers that ``stage`` holds."""
        if not 0 <= stage < self.stages:
            raise HybridPipeError(f"stage {stage} is outside 0..{self.stages - 1}")
        start = sum(self.balance[:stage])
        return range(start, start + self.balance[stage])

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.stages - 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise HybridPipeError("a PipelineModel has no differentiable forward across processes: train with "
                              "model.train_step(inputs, targets), get outputs with model.predict(inputs)")

    # ------------------------------------------------------------------ running

    def _schedule(self, name: str) -> list:
        """This stage's validated action list, built once per (schedule, P, M) and then reused."""
        key = (name, self.stages, self.micro_batches)
        if key not in self._schedule_cache:
            schedule = get_schedule(name, self.stages, self.micro_batches)
            validate(schedule, self.stages, self.micro_batches, require_backward=name != "forward")
            self._schedule_cache[key] = schedule[self.stage]
        return self._schedule_cache[key]

    def train_step(self, inputs: Any, targets: Any) -> float:
        """One forward+backward of a mini-batch through the pipeline; gradients accumulate into
        this stage's parameters' ``.grad`` (call ``optimizer.step()`` / ``zero_grad()`` as usual).

        Every rank of a pipeline passes the same ``inputs`` and ``targets`` (stage 0 uses the inputs,
        the last stage the targets). Returns the mini-batch mean loss (the micro-batch losses
        weighted by micro-batch size) on every rank of the pipeline.
        """
        if self.loss_fn is None:
            raise HybridPipeError("train_step needs a loss: build the PipelineModel with loss_fn=...")
        chunks = microbatch.split(inputs, self.micro_batches)
        target_chunks = microbatch.split(targets, self.micro_batches)
        sizes = [next(microbatch.iter_tensors(c)).shape[0] for c in target_chunks]
        total = sum(sizes)
        weights = [size / total for size in sizes]
        result = self._executor.run(self._schedule(self.schedule_name), self.micro_batches, chunks,
                                    target_chunks, self.loss_fn, weights, self.checkpoint, train=True)
        self.last_step = result
        return result.loss

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """Forward-only pipeline run; returns the full output (merged micro-batches) on every rank
        of the pipeline."""
        chunks = microbatch.split(inputs, self.micro_batches)
        result = self._executor.run(self._schedule("forward"), self.micro_batches, chunks, train=False)
        self.last_step = result
        return microbatch.merge(result.outputs)

    def close(self) -> None:
        """Releases the pipeline's communicator (also done when the model is garbage collected)."""
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.close()
            self._executor = None
            if runtime.is_initialized():
                self._comm.Free()

    def __repr__(self) -> str:
        return (f"PipelineModel(stage {self.stage} of {self.stages}, layers {list(self.layers_of_stage(self.stage))}, "
                f"micro_batches={self.micro_batches}, schedule={self.schedule_name!r}, "
                f"checkpoint={self.checkpoint!r})")

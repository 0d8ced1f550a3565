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
* Tied weights (``hybridpipe.pipeline.tied``): a parameter shared by layers on different ranks
  (``head.weight = embedding.weight``), or the weight of one key's ``TiedLayerSpec`` layers, is
  found once the balance is known and before any layer is built, moved or communicated with
  (LayerSpec layers are built on the meta device for it, which keeps any Parameter their factory
  reuses). Finding them needs no communication; the result is part of the agreement above, so
  ranks given different models raise ``MismatchError`` rather than some of them waiting in a
  collective that the others left. Each holding rank keeps a copy; ``train_step`` sums the
  copies' gradients across them after the schedule ran. Asynchronous schedules refuse them.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hybridpipe import runtime
from hybridpipe.data_parallel.amp import LossScaler
from hybridpipe.pipeline.memory import ActivationMeter, MemoryReport
from hybridpipe.pipeline.memory import report as memory_report
from hybridpipe.comm.agree import agree_on_failure
from hybridpipe.collectives.allreduce import grouped_allreduce_
from hybridpipe.collectives.common import Average
from hybridpipe.comm.device import compute_device
from hybridpipe.comm.engine import call
from hybridpipe.errors import MismatchError, NotInitializedError, NotSupportedError, PartitionError, UsageError
from hybridpipe.pipeline import microbatch
from hybridpipe.pipeline.batch_check import fingerprint
from hybridpipe.pipeline.executor_profile import ExecutorProfile
from hybridpipe.pipeline.layers import LayerSpec, LazyLayers, TiedLayerSpec, build_layer, shapes_only
from hybridpipe.pipeline.partition import (
    BALANCE_METHODS,
    BalanceReport,
    check_stage_count,
    even_out_identical,
    partition_by_weights,
    partition_uniform,
    profile_layers,
    validate_balance,
)
from hybridpipe.pipeline import split as split_module
from hybridpipe.pipeline.skip import skip_routes
from hybridpipe.pipeline.tied import TiedWeights, check_schedule, find_ties, share_within_rank
from hybridpipe.config import parse_bytes
from hybridpipe.pipeline.schedule import (
    ASYNCHRONOUS,
    AsyncStream,
    async_schedule,
    SCHEDULES,
    replica_schedule,
    replica_streams,
    spec as schedule_spec,
    canonical_name,
    get_schedule,
    peak_in_flight,
    validate,
)
from hybridpipe.gradient_sync import GradientSync, Registration, drivers_of
from hybridpipe.pipeline.asynchronous import install_step_guard
from hybridpipe.pipeline.stage import StageExecutor, StepResult, split_summary
from hybridpipe.registry import PRECISIONS, check_precision, check_recompute_mode

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModel"]


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
        layers: ``nn.Sequential``, or a list of ``nn.Module`` / :class:`LayerSpec` /
            :class:`TiedLayerSpec`. Each layer is called with one argument, the previous layer's
            output (a tensor, or a tuple/list/dict of tensors and other values). Layers on different
            stages that share an ``nn.Parameter`` (a tied embedding and output head), or
            ``TiedLayerSpec`` layers of one key, hold one weight: a copy per stage, kept identical.
        loss_fn: ``loss_fn(output, target)`` → scalar, a mean over the micro-batch (e.g.
            ``nn.CrossEntropyLoss()``). Needed by :meth:`train_step`.
        micro_batches: ``M``, micro-batches per mini-batch.
        balance: layer counts per stage (``[3, 5, 4, 4]``), or "uniform", "parameters", "time",
            "memory" (with ``memory_limit``); None means "time" when ``sample_input`` is given, else
            "parameters".
        schedule: "1f1b" (PipeDream-Flush; memory bounded by ``P``), "gpipe", "interleaved-1f1b"
            (with ``virtual_stages``), "zb-h1" (zero-bubble), or the asynchronous "pipedream" and
            "2bw" (with ``optimizer``); see docs/pipeline.md.
        checkpoint: re-materialization: "never" (store activations), "except_last" (recompute all
            micro-batches but the last, GPipe's default) or "always".
        sample_input: one micro-batch of model input, for balance "time".
        seed_layers: build LayerSpec layer ``i`` under seed ``seed_layers + i``.
        device: where this stage computes (default: the GPU its first parameter is on, else this rank's GPU
            where CUDA is available and HYBRIDPIPE_SET_DEVICE is not 0 (``local_rank`` mod visible GPUs), else
            the CPU).
        virtual_stages: ``v`` chunks of layers per rank for "interleaved-1f1b" (rank ``r`` holds
            chunks ``r, r + P, …``; ``balance`` then has ``v·P`` entries, one per chunk).
        optimizer: asynchronous schedules: a callable that gets this rank's parameters and returns
            its torch optimizer (``lambda params: torch.optim.AdamW(params, lr=3e-4)``); the
            pipeline applies it (averaged over the stage's replicas) as the schedule says.
        vertical_sync: "pipedream" only: every stage uses, for a micro-batch, the weight version
            the first stage used for it.
        precision: "fp32", "bf16" or "fp16": every stage's forward (and re-computation, and the loss)
            runs under ``torch.autocast`` in that dtype, float32 activations cross stages in it, the
            weights (and their gradients and the optimizer) stay float32. "fp16" also scales the losses
            by ``model.scaler`` (hp.LossScaler): step with ``model.scaler.step(opt)`` and
            ``model.scaler.update()`` (every rank skips the same overflowing steps; hybridpipe/data_parallel/amp.py).
        memory_limit: ``balance="memory"``: bytes (or ``"2GiB"``) each stage may hold in parameters,
            gradients and the activations of as many micro-batches as the schedule keeps at once;
            the fastest balance (by profiled time) within it is chosen.

    Raises:
        NotInitializedError: ``hp.init`` was not called.
        PartitionError: bad balance (values named), more stages than layers, or weights tied across
            stages under an asynchronous schedule (which updates each stage on its own).
        ScheduleError: unknown schedule, or sizes the schedule cannot run (named with the fix).
        UsageError: ``optimizer`` given to a synchronous schedule or missing for an
            asynchronous one.
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
        virtual_stages: int = 1,
        optimizer: Any = None,
        vertical_sync: bool = False,
        memory_limit: int | str | None = None,
        precision: str = "fp32",
        sample: Any = None,
        split: str | Sequence[str] = "auto",
        verify: bool | None = None,
        weights: Any = None,
    ) -> None:
        super().__init__()
        grid = runtime.job("PipelineModel").grid
        root, layer_list = _layer_list(layers, sample, balance=balance, sample_input=sample_input,
                                       seed_layers=seed_layers, memory_limit=memory_limit)
        object.__setattr__(self, "module", root)  # the module being split (not registered: names stay its own)
        self._split: split_module.PreparedSplit | None = None
        stages = grid.pipeline_stages
        name = _checked_options(micro_batches, checkpoint, schedule, precision, virtual_stages)
        self.asynchronous = name in ASYNCHRONOUS
        self._check_schedule_options(name, stages, micro_batches, virtual_stages, optimizer, vertical_sync)
        if not grid.uniform:
            self._check_stage_replicas(grid, name, virtual_stages, micro_batches, vertical_sync)
        if not self.asynchronous:
            get_schedule(name, stages, micro_batches, virtual_stages)  # size conditions → ScheduleError
        object.__setattr__(self, "loss_fn", loss_fn)  # not a submodule: no keys in state_dict
        self.micro_batches = micro_batches
        self.schedule_name = name
        self.checkpoint = checkpoint
        self.virtual_stages = virtual_stages
        self.vertical_sync = bool(vertical_sync)
        self.precision = precision
        #: check at each train_step / predict that the stages were given the same batch (HYBRIDPIPE_CHECK_BATCHES)
        self.check_batches = runtime.config().check_batches
        #: NaN / inf raise NonFiniteError naming the stage and layer where they first appear (HYBRIDPIPE_CHECK_FINITE)
        self.check_finite = runtime.config().check_finite
        self.grid = grid
        self.stage = grid.stage
        self.stages = stages
        self.chunks = stages * virtual_stages
        self._schedule_cache: dict[tuple[str, int, int], list] = {}  # see _schedule

        if root is not None:
            meta = split_module.is_meta(root)
            if verify and meta:
                raise UsageError("verify=True needs the module's weights (it compares the split forward with the "
                                 "unsplit one); a module built on the meta device is verified by nothing: pass "
                                 "verify=None or False, or build it on the CPU")
            chunk_modules, ties, built = self._split_module(root, sample, split, grid, name, device, weights)
        else:
            chunk_modules, ties, built = self._build_layers(layer_list, balance, sample_input, seed_layers, grid,
                                                            name, micro_batches, memory_limit, device)
        object.__setattr__(self, "_chunk_modules", chunk_modules)  # same layers; not registered twice
        object.__setattr__(self, "_stage_module", chunk_modules[self.stage])
        self._start_executor(grid, chunk_modules, ties, built, name, precision, optimizer)
        self.last_step: StepResult | None = None
        if root is not None:
            if verify or (verify is None and not meta):
                self._verify(sample)
            self._split.plan.trace.unit_outputs.clear()

    @staticmethod
    def _check_stage_replicas(grid: runtime.Grid, name: str, virtual_stages: int, micro_batches: int,
                              vertical_sync: bool) -> None:
        """What a grid with its own replica count per stage (``hp.init(stage_replicas=...)``) runs."""
        where = f"stage_replicas {list(grid.stage_replicas)} ({grid.config})"
        if not schedule_spec(name).stage_replicas:
            runs = ", ".join(repr(n) for n, s in SCHEDULES.items() if s.stage_replicas)
            raise UsageError(f"schedule {name!r} does not run on a grid with {where}: use one of {runs}, or a "
                             "uniform grid (hp.init(pipeline_stages=...))")
        if schedule_spec(name).asynchronous:
            if vertical_sync:
                raise UsageError(f"vertical_sync=True does not run on a grid with {where} (a stage's replicas "
                                 "update together, round by round); leave it out, or use a uniform grid")
            replica_streams(name, grid.stage_replicas, micro_batches)  # micro_batches a multiple of every count
        if virtual_stages != 1:
            raise UsageError(f"virtual_stages={virtual_stages} does not run on a grid with {where}: use "
                             "virtual_stages=1, or a uniform grid")

    def _build_layers(self, layer_list: list, balance: Any, sample_input: Any, seed_layers: int | None,
                      grid: runtime.Grid, name: str, micro_batches: int, memory_limit: Any,
                      device: Any) -> tuple[dict[int, nn.Module], list, Any]:
        """A layer list: chooses the balance, agrees on it, builds this rank's layers (``self.layers``)."""
        stages, virtual_stages = self.stages, self.virtual_stages
        held = 1
        if isinstance(balance, str) and balance == "memory":  # activations held at once, by the schedule data
            plan = (async_schedule(name, stages, micro_batches) if self.asynchronous
                    else get_schedule(name, stages, micro_batches, virtual_stages))
            held = max(peak_in_flight(actions) for actions in plan)
        balance_list, report = self._choose_balance(layer_list, balance, sample_input, seed_layers, grid,
                                                    self.chunks, virtual_stages, memory_limit, held)
        # before any layer is built or moved, and before the pipeline communicator exists
        ties = find_ties(layer_list, balance_list, stages)
        self._agree(grid, len(layer_list), balance_list,
                    tuple(tuple(i for i, _ in tie.places) for tie in ties if tie.across_ranks))
        check_schedule(ties, balance_list, self.asynchronous, name)
        self.balance = balance_list
        #: skip connections (``hp.skippable``): name -> SkipRoute (stashing and popping layer and chunk)
        self.skip_routes = skip_routes(layer_list, [chunk for chunk in range(self.chunks)
                                                    for _ in self.layers_of_chunk(chunk)])
        self.balance_report = report
        #: every tie's parameter names (``layers.0.weight``, ``layers.7.weight``): one weight, a copy per rank
        self.tied_parameter_names: list[tuple[str, ...]] = [tie.names for tie in ties]
        #: the pipeline ranks (stages) holding a copy of each of those ties
        self.tied_parameter_ranks: list[tuple[int, ...]] = [tie.ranks for tie in ties]
        own_chunks = list(range(self.stage, self.chunks, stages))
        built = nn.ModuleDict({str(i): build_layer(layer_list[i], i, seed_layers)
                               for chunk in own_chunks for i in self.layers_of_chunk(chunk)})
        share_within_rank(ties, built)
        self.layers = built
        chunk_modules = {chunk: _Stage(nn.ModuleDict({str(i): built[str(i)] for i in self.layers_of_chunk(chunk)}))
                         for chunk in own_chunks}
        if device is None:  # the layers' own GPU, else this rank's (hp.init's placement), else the CPU
            first = next(iter(built.parameters()), None)
            device = first.device if first is not None and first.device.type != "cpu" else \
                compute_device(runtime.local_rank(), runtime.config().set_device)
        self.device = torch.device(device)
        self.to(self.device)
        return chunk_modules, ties, built

    def _split_module(self, root: nn.Module, sample: Any, split: Any, grid: runtime.Grid, name: str,
                      device: Any, weights: Any) -> tuple[dict[int, nn.Module], list, Any]:
        """Any nn.Module: traced on ``sample`` and cut at unit boundaries (hybridpipe/pipeline/split.py); on the
        meta device, this rank's units are materialized (and ``weights`` loaded into them)."""
        meta = split_module.is_meta(root)
        if device is None and meta:
            device = compute_device(runtime.local_rank(), runtime.config().set_device)
        if self.asynchronous:
            raise NotSupportedError(f"schedule {name!r} is not yet supported for a module split by hp.PipelineModel; "
                                    "use 'gpipe', '1f1b', 'interleaved-1f1b' or 'zb-h1' (or hand in a layer list)")
        def from_rank_zero(function: Any) -> Any:
            return agree_on_failure(grid.world_comm, function, root=0, what="PipelineModel")

        prepared = split_module.prepare(root, sample, split, self.chunks, self.stages, self.stage, from_rank_zero,
                                        torch.device(device) if device is not None else None)
        plan = prepared.plan
        self._agree(grid, len(plan.trace.calls), prepared.balance,
                    tuple(tuple(i for i, _ in tie.places) for tie in prepared.ties),
                    tuple(call.name for call in plan.trace.calls))
        self._split = prepared
        self.balance = prepared.balance
        self.skip_routes = {}
        self.balance_report = BalanceReport(prepared.balance, prepared.call_parameters, prepared.costs,
                                            "time" if prepared.costs is not None else "explicit")
        self.tied_parameter_names = prepared.tied_names
        self.tied_parameter_ranks = [tie.ranks for tie in prepared.ties]
        if device is None:
            first = next(iter(p for m in prepared.local for p in m.parameters()), None)
            device = first.device if first is not None and first.device.type != "cpu" else \
                compute_device(runtime.local_rank(), runtime.config().set_device)
        self.device = torch.device(device)
        split_module.move_local(root, self.device)
        if weights is not None:
            missing = split_module.load_weights(self.state_dict(), weights)
            if missing:
                raise UsageError(f"weights= holds no {missing[:6]} ({len(missing)} of stage {self.stage}'s "
                                 "tensors): is it another model's? (names are the module's own, as its "
                                 "state_dict() says)")
        own_chunks = range(self.stage, self.chunks, self.stages)
        return ({chunk: split_module.SplitChunk(plan, chunk, self.device) for chunk in own_chunks},
                prepared.ties, prepared.built)

    def _start_executor(self, grid: Any, chunk_modules: Any, ties: Any, built: Any, name: str, precision: str,
                        optimizer: Any) -> None:
        """This rank's executor of its chunks on a private communicator, the weights tied across ranks, the
        precision's autocast and loss scaler, and (asynchronous schedules) the stream that applies ``optimizer``."""
        stages, virtual_stages = self.stages, self.virtual_stages
        self._comm = self._private_comm(grid)
        self._executor = StageExecutor(chunk_modules, self.stage, stages, self._comm, self.device, virtual_stages,
                                       self._replica_ranks(grid))
        # the job finds the pipeline that runs a parameter here (a DistributedOptimizer registers with it)
        drivers_of(runtime.job("PipelineModel")).add(self._executor.gradient_syncs)
        rebind = weakref.WeakMethod(self._rebind)  # the driver (held by the parameters' hooks) keeps no model alive
        self._executor.gradient_syncs.rebinder = lambda: (rebind() or (lambda: None))()
        self._executor.use_skips(self.skip_routes)
        if runtime.config().profile_executor:
            self._executor.profile = ExecutorProfile()
        if schedule_spec(name).split_backward:
            self._executor.split_backward()
        # ties across ranks: sets of the holding ranks (collective over the grid), copies broadcast from the lowest
        self._tied: TiedWeights | None = None
        if any(tie.across_ranks for tie in ties):
            if not grid.uniform:
                raise UsageError(f"weights tied across stages ({', '.join(ties[0].names)}) are not supported on a "
                                 f"grid with its own replica count per stage (stage_replicas "
                                 f"{list(grid.stage_replicas)}): use a uniform grid (pipeline_stages=...), or "
                                 "untie them")
            self._tied = TiedWeights(ties, built, grid)
            self._executor.defer_gradients(self._tied.parameters)
        if PRECISIONS[precision].autocast_dtype:
            self._executor.autocast = getattr(torch, PRECISIONS[precision].autocast_dtype)
        # fp16: the dynamic loss scaler every rank agrees on (hybridpipe/data_parallel/amp.py); None otherwise
        self.scaler: LossScaler | None = LossScaler() if PRECISIONS[precision].loss_scaling else None
        self._scale_for(grid)
        self.optimizer: torch.optim.Optimizer | None = None
        self._stream: AsyncStream | None = None
        self._next_micro_batch = 0
        if self.asynchronous:
            self._start_asynchronous(name, optimizer)

    @staticmethod
    def _check_schedule_options(name: str, stages: int, micro_batches: int, virtual_stages: int, optimizer: Any,
                                vertical_sync: bool) -> None:
        described = schedule_spec(name)
        if described.chunks_per_rank and virtual_stages < 2:
            raise UsageError(f"schedule={name!r} needs virtual_stages >= 2 (chunks of layers per "
                             "rank, e.g. virtual_stages=2); with one chunk per rank use schedule='1f1b'")
        if not described.chunks_per_rank and virtual_stages != 1:
            chunked = [n for n, s in SCHEDULES.items() if s.chunks_per_rank]
            raise UsageError(f"virtual_stages={virtual_stages} needs schedule={chunked[0]!r} (schedule "
                             f"{name!r} runs one chunk of layers per rank)")
        if described.asynchronous:
            if optimizer is None or not callable(optimizer):
                raise UsageError(
                    f"schedule {name!r} updates the weights inside the pipeline, so it needs the optimizer: pass "
                    "optimizer=lambda params: torch.optim.SGD(params, lr=0.1) (a callable that gets this rank's "
                    f"parameters and returns a torch optimizer; got {optimizer!r})")
            if vertical_sync and not described.vertical_sync:
                raise UsageError(f"vertical_sync is PipeDream's option (schedule='pipedream'); {name!r} already "
                                 "uses one weight version per mini-batch on every stage")
            least = described.min_micro_batches(stages)
            if micro_batches < least:
                raise UsageError(
                    f"schedule {name!r} keeps two weight versions, which needs micro_batches >= pipeline stages - 1 "
                    f"(got micro_batches={micro_batches} with {stages} stages): use micro_batches >= {least}")
        else:
            if optimizer is not None:
                raise UsageError(
                    f"schedule {name!r} is synchronous: it does not use optimizer= (the weights change only when "
                    "you call step()). Build the optimizer yourself, e.g. hp.DistributedOptimizer(torch.optim.SGD("
                    "model.parameters(), lr=0.1), named_parameters=model.named_parameters()), and call step() "
                    "after train_step; optimizer= is for schedule='pipedream' or '2bw'")
            if vertical_sync:
                raise UsageError(f"vertical_sync is an option of schedule='pipedream', not of {name!r}")

    def _start_asynchronous(self, name: str, factory: Any) -> None:
        parameters = list(self.parameters())
        optimizer = factory(parameters)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(f"optimizer= must return a torch.optim.Optimizer for the parameters it is given "
                             f"(it returned {type(optimizer).__name__})")
        in_groups = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [n for n, p in self.named_parameters() if p.requires_grad and id(p) not in in_groups]
        if missing:
            raise UsageError(f"the optimizer built by optimizer= leaves out parameters {missing[:5]} of this "
                             "stage: build it over every parameter it is given")
        self.optimizer = optimizer
        validate(async_schedule(name, self.stages, self.micro_batches, steps=2), self.stages,
                 2 * self.micro_batches)
        self._stream = AsyncStream(name, self.stages, self.stage, self.micro_batches) if self.grid.uniform else \
            replica_streams(name, self.grid.stage_replicas, self.micro_batches)[(self.stage, self.grid.replica)]
        self._executor.use_weight_stash(name, self.vertical_sync, self.micro_batches)
        self._executor.on_update = self._apply_update
        self._executor.gradient_syncs.updates_itself = name  # no DistributedOptimizer registers with it
        install_step_guard()

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _choose_balance(layers: list, balance: Any, sample_input: Any, seed_layers: int | None,
                        grid: runtime.Grid, stages: int, virtual_stages: int, memory_limit: Any = None,
                        held: int = 1) -> tuple[list[int], BalanceReport]:
        count = len(layers)
        if memory_limit is not None and balance != "memory":
            raise PartitionError(f'memory_limit is for balance="memory" (got balance={balance!r}); pass '
                                 'balance="memory" with a sample_input, or leave memory_limit out')
        if virtual_stages > 1:
            ranks = stages // virtual_stages
            if count < stages:
                raise PartitionError(
                    f"virtual_stages={virtual_stages} on {ranks} pipeline ranks cuts the model into {stages} chunks, "
                    f"but it has {count} layers: use virtual_stages <= {max(count // ranks, 1)} or split the model "
                    "into more layers")
            if balance is not None and not isinstance(balance, str) and len(list(balance)) != stages:
                raise PartitionError(
                    f"balance {list(balance)} has {len(list(balance))} entries, but with virtual_stages="
                    f"{virtual_stages} on {ranks} ranks the model has {stages} chunks (chunk c runs on rank c mod "
                    f"{ranks}): give one layer count per chunk, e.g. {partition_uniform(count, stages)}")
        if balance is not None and not isinstance(balance, str):
            balance_list = validate_balance(list(balance), count, stages)
            return balance_list, BalanceReport(balance_list, PipelineModel._parameter_counts(layers, seed_layers),
                                               None, "explicit")
        method = balance if balance is not None else ("time" if sample_input is not None else "parameters")
        if method not in BALANCE_METHODS + ("memory",):
            raise PartitionError(f"unknown balance {method!r}: pass a list of layer counts or one of "
                                 f"{', '.join(map(repr, BALANCE_METHODS + ('memory',)))}")
        check_stage_count(count, stages)
        if method in ("time", "memory") and sample_input is None:
            raise PartitionError(f'balance="{method}" profiles the layers on a sample micro-batch: pass '
                                 'sample_input=<one micro-batch of inputs>, or use balance="parameters"')
        limit = None
        if method == "memory":
            if memory_limit is None:
                raise PartitionError('balance="memory" needs memory_limit= (bytes, or a size such as "2GiB", '
                                     "that each stage may hold)")
            limit = parse_bytes(memory_limit, "memory_limit") if isinstance(memory_limit, str) else memory_limit
            if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
                raise PartitionError(f"memory_limit must be a positive number of bytes or a size like '2GiB' "
                                     f"(got {memory_limit!r})")
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
        def measured() -> tuple[list[float], list[int], list[float]]:
            profiles = profile_layers(LazyLayers(layers, seed_layers), copy.deepcopy(sample_input))
            # what a layer costs a stage: parameters and gradients, and the activations of `held` micro-batches
            # (the schedule's most in flight at once)
            memory = [2 * p.parameter_bytes + held * p.activation_bytes for p in profiles]
            return [p.time_ms for p in profiles], PipelineModel._parameter_counts(layers, seed_layers), memory

        try:
            layer_ms, parameters, memory = agree_on_failure(grid.world_comm, measured, root=0, what="PipelineModel")
        except Exception as error:  # the same on every rank; its own type stays the cause
            raise PartitionError(f'balance="{method}": profiling the layers on world rank 0 failed '
                                 f"({type(error).__name__}: {error})") from error
        # identical layers (same class, parameter count and memory) weigh the same: noise does not move cuts
        layer_ms = even_out_identical(layer_ms, [(getattr(layer, "cls", type(layer)).__name__, count, held_bytes)
                                                 for layer, count, held_bytes in zip(layers, parameters, memory)])
        if method == "memory":
            balance_list = partition_by_weights(layer_ms, stages, memory=memory, memory_limit=limit)
        else:
            balance_list = partition_by_weights(layer_ms, stages)
        return balance_list, BalanceReport(balance_list, parameters, layer_ms, method)

    @staticmethod
    def _parameter_counts(layers: list, seed_layers: int | None) -> list[int]:
        return [sum(p.numel() for p in module.parameters()) for module in shapes_only(layers)]

    def _agree(self, grid: runtime.Grid, count: int, balance: list[int],
               tied_across_stages: tuple[tuple[int, ...], ...], units: tuple[str, ...] = ()) -> None:
        mine = (count, tuple(balance), self.micro_batches, self.schedule_name, self.checkpoint,
                self.virtual_stages, self.vertical_sync, self.precision, tied_across_stages, units)
        everyone = call(None, "PipelineModel", lambda: grid.world_comm.allgather(mine))
        if len(set(everyone)) > 1:
            names = ("layers", "balance", "micro_batches", "schedule", "checkpoint", "virtual_stages",
                     "vertical_sync", "precision", "layers_tied_across_stages", "unit_calls")
            differ = [name for i, name in enumerate(names) if len({e[i] for e in everyone}) > 1]
            listing = "; ".join(f"rank {r}: " + ", ".join(f"{n}={e[names.index(n)]!r}" for n in differ)
                                for r, e in enumerate(everyone))
            raise MismatchError(f"PipelineModel: ranks disagree on {', '.join(differ)} ({listing}); every rank "
                                "must build it with the same layers and settings")

    def _verify(self, sample: Any) -> None:
        """A split module's forward on ``sample`` (in eval mode) against the unsplit module's, on every rank: a
        difference raises SplitError naming the first unit call whose output differs."""
        plan = self._split.plan
        chunks = self._chunk_modules.values()
        actions = get_schedule("forward", self.stages, 1, self.virtual_stages)[self.stage]
        if not self.grid.uniform:  # the one micro-batch runs on replica 0 of each stage; the others wait for its output
            actions = [a for a in actions if a.micro_batch % self.grid.stage_replicas[self.stage] == self.grid.replica]
        for chunk in chunks:
            chunk.keep_values = True
        try:
            with split_module.eval_mode(plan.root):
                result = self._executor.run(actions, 1, [sample], train=False)
        finally:
            for chunk in chunks:
                chunk.keep_values = False
        first = None
        for chunk in (chunks if actions else ()):
            for index in plan.calls_of(chunk.chunk):
                problem = split_module.first_difference(plan.trace.unit_outputs[index],
                                                        chunk.unit_output(index), 1e-4, 1e-6)
                if problem is not None and (first is None or index < first[0]):
                    first = (index, problem)
            chunk.last_values = {}
        output = split_module.first_difference(plan.trace.output, result.outputs[0], 1e-4, 1e-6)
        found = call(None, "PipelineModel", lambda: self.grid.world_comm.allgather((first, output)))
        firsts = [f for f, _ in found if f is not None]
        if firsts:
            index, problem = min(firsts)
            raise split_module.SplitError(
                f"verify: the split module's unit call {index} ({plan.trace.calls[index].name}) computes a different "
                f"output than in the unsplit module ({problem}): a value it reads was not routed across a cut; "
                "please report it, and split elsewhere meanwhile (split=[...])")
        outputs = [o for _, o in found if o is not None]
        if outputs:
            raise split_module.SplitError(f"verify: the split module's output differs from the unsplit module's "
                                          f"({outputs[0]}) although every unit call agreed: the glue after the "
                                          "last unit reads something that was not routed")

    def split_report(self) -> str:
        """A split module: each stage's units (qualified names), parameters, profiled time, and the values
        crossing each cut (name, shape on the sample, dtype, bytes); a layer list: its balance report."""
        if self._split is None:
            return str(self.balance_report)
        return split_module.report(self._split.plan, self.balance, self._split.costs, self.stages)

    # A split module keeps its own names: parameters, buffers and state_dict keys are the module's, for the
    # tensors this rank holds (the other ranks' units are on the meta device).

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        if self.module is None:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        for name, parameter in self.module.named_parameters(prefix, recurse, remove_duplicate):
            if parameter.device.type != "meta":
                yield name, parameter

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        if self.module is None:
            yield from super().named_buffers(prefix, recurse, remove_duplicate)
            return
        for name, buffer in self.module.named_buffers(prefix, recurse, remove_duplicate):
            if buffer.device.type != "meta":
                yield name, buffer

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.module is None:
            return super().state_dict(*args, **kwargs)
        full = self.module.state_dict(*args, **kwargs)
        return type(full)((k, v) for k, v in full.items() if not (isinstance(v, torch.Tensor) and v.is_meta))

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """A split module takes its own keys from ``state_dict`` (a full state_dict of the unsplit module, a
        consolidated checkpoint, or this rank's own); with ``strict``, keys the module does not have at all, or
        keys of this rank that are missing, raise."""
        if self.module is None:
            return super().load_state_dict(state_dict, strict, assign)
        own = self.state_dict()
        every = set(self.module.state_dict().keys())
        unexpected = [k for k in state_dict if k not in every]
        missing = [k for k in own if k not in state_dict]
        if strict and (unexpected or missing):
            raise UsageError(f"load_state_dict into stage {self.stage} of {type(self.module).__name__}: "
                             f"missing keys {missing[:8]}, unexpected keys {unexpected[:8]} (is it another "
                             "model's state_dict?); pass strict=False to load what matches")
        split_module.load_weights(own, state_dict)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def train(self, mode: bool = True) -> "PipelineModel":
        super().train(mode)
        if self.module is not None:
            self.module.train(mode)
        return self

    # ------------------------------------------------------------------ introspection

    def layers_of_chunk(self, chunk: int) -> range:
        """Original indices of the layers of chunk (virtual stage) ``chunk``; with one chunk per rank,
        chunk and stage are the same number."""
        if not 0 <= chunk < self.chunks:
            raise UsageError(f"chunk {chunk} is outside 0..{self.chunks - 1}")
        start = sum(self.balance[:chunk])
        return range(start, start + self.balance[chunk])

    def layers_of_stage(self, stage: int) -> range | list[int]:
        """Original indices of the layers that ``stage`` (a pipeline rank) holds: a range, or with
        ``virtual_stages > 1`` the sorted indices of its chunks ``stage, stage + P, …``."""
        if not 0 <= stage < self.stages:
            raise UsageError(f"stage {stage} is outside 0..{self.stages - 1}")
        if self.virtual_stages == 1:
            return self.layers_of_chunk(stage)
        return [i for chunk in range(stage, self.chunks, self.stages) for i in self.layers_of_chunk(chunk)]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.stages - 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError("a PipelineModel has no differentiable forward across processes: train with "
                         "model.train_step(inputs, targets), get outputs with model.predict(inputs)")

    # ------------------------------------------------------------------ running

    def _schedule(self, name: str) -> list:
        """This rank's validated action list, built once per (schedule, P, M) and then reused."""
        key = (name, self.stages, self.micro_batches)
        if key not in self._schedule_cache:
            schedule = get_schedule(name, self.stages, self.micro_batches, self.virtual_stages)
            validate(schedule, self.stages, self.micro_batches, virtual_stages=self.virtual_stages,
                     require_backward=name != "forward")
            actions = schedule[self.stage]
            if not self.grid.uniform:  # PipeDream's round-robin: my micro-batches (replica m mod R_s runs m)
                if name == "forward":
                    replicas = self.grid.stage_replicas[self.stage]
                    actions = [a for a in actions if a.micro_batch % replicas == self.grid.replica]
                else:
                    actions = replica_schedule(name, self.grid.stage_replicas,
                                               self.micro_batches)[(self.stage, self.grid.replica)]
            self._schedule_cache[key] = actions
        return self._schedule_cache[key]

    def train_step(self, inputs: Any, targets: Any) -> float | None:
        """One mini-batch through the pipeline.

        Synchronous schedules: forward and backward of all ``M`` micro-batches; gradients accumulate
        into this stage's parameters' ``.grad`` (call ``optimizer.step()`` / ``zero_grad()`` as
        usual); a weight tied across stages gets the sum of every holder's gradient at the end (one
        allreduce between the holders). Returns the mini-batch mean loss (the micro-batch losses
        weighted by micro-batch size) on every rank of the pipeline.

        Asynchronous schedules ("pipedream", "2bw"): admits the ``M`` micro-batches into the
        pipeline and runs until the next forward would need a micro-batch not given yet; updates
        happen inside, and no rank waits for another at the end of the call. Returns the mean loss
        of the micro-batches whose backward finished on this stage in this call (each loss travels
        back with its micro-batch's gradients), or None when none did: on the last stage the ``M``
        just given, on stage ``s`` those given up to ``P - s - 1`` micro-batches earlier.

        Every rank of a pipeline passes the same ``inputs`` and ``targets`` (stage 0 uses the inputs,
        the last stage the targets).
        """
        self._check_runtime("train_step")
        if self.loss_fn is None:
            raise UsageError("train_step needs a loss: build the PipelineModel with loss_fn=...")
        self._executor.check_finite = self.check_finite
        chunks = microbatch.split(inputs, self.micro_batches)
        target_chunks = microbatch.split(targets, self.micro_batches)
        self._executor.batch_print = fingerprint(inputs, targets) if self.check_batches and not self.asynchronous \
            else None
        sizes = [next(microbatch.iter_tensors(c)).shape[0] for c in target_chunks]
        total = sum(sizes)
        weights = [size / total for size in sizes]
        if not self.asynchronous:
            self._executor.loss_scale = self.scaler.loss_multiplier if self.scaler is not None else 1.0
            earlier = self._tied.set_aside() if self._tied is not None else None
            try:
                result = self._executor.run(self._schedule(self.schedule_name), self.micro_batches, chunks,
                                            target_chunks, self.loss_fn, weights, self.checkpoint, train=True)
            except BaseException:
                if self._tied is not None:
                    self._tied.put_back(earlier)
                raise
            if self._tied is not None:  # every send is done: no stage waits for a neighbour any more
                self._tied.sum_gradients(earlier)
            self._executor.gradient_syncs.step_ends()
            self.last_step = result
            return result.loss
        first = self._next_micro_batch
        self._next_micro_batch += self.micro_batches
        ids = range(first, first + self.micro_batches)
        if schedule_spec(self.schedule_name).update_every_micro_batch:  # every micro-batch an update: its own mean
            weights = [1.0] * self.micro_batches
        actions = self._stream.segment(first + self.micro_batches)
        result = self._executor.run(actions, self.micro_batches, dict(zip(ids, chunks)), dict(zip(ids, target_chunks)),
                                    self.loss_fn, dict(zip(ids, weights)), self.checkpoint, train=True)
        self._executor.gradient_syncs.step_ends()
        self.last_step = result
        return sum(result.losses.values()) / len(result.losses) if result.losses else None

    def _rebind(self) -> None:
        """The survivors of lost ranks started a new job (hp.elastic.run) whose grid keeps this rank's stage: the
        stage goes on in it with the same layers and parameters (the optimizer's state untouched), talking to the
        replicas of the other stages that are left (micro-batches round-robin over them on a grid with per-stage
        replica counts). The schedule must run on that grid; weights tied across stages do not go on yet."""
        the_job = runtime.job("elastic.run")
        grid = the_job.grid
        if grid.pipeline_stages != self.stages or grid.stage != self.stage:
            raise NotSupportedError(f"hp.elastic.run: the survivors' grid ({grid.config}) does not keep stage "
                                    f"{self.stage} of the {self.stages}-stage PipelineModel on this rank")
        if self._tied is not None:
            raise NotSupportedError("hp.elastic.run: a PipelineModel with weights tied across stages cannot go on "
                                    "after ranks were lost yet; restart the job from a checkpoint "
                                    "(hybridpipe-run --restarts N --checkpoint-dir DIR)")
        if not grid.uniform:
            self._check_stage_replicas(grid, self.schedule_name, self.virtual_stages, self.micro_batches,
                                       self.vertical_sync)
        old = self._comm  # the old job's engine is gone (its thread made our MPI calls): revoked and freed here
        old.Revoke()
        old.Free()
        self.grid, self._schedule_cache = grid, {}
        self._comm = self._private_comm(grid)
        self._executor.rebind(self._comm, self._replica_ranks(grid))
        drivers_of(the_job).add(self._executor.gradient_syncs)
        self._scale_for(grid)

    @staticmethod
    def _private_comm(grid: runtime.Grid) -> Any:
        """The pipeline's own duplicate of the grid's pipeline communicator: our tags never meet anyone else's."""
        return call("pipe", "PipelineModel", grid.pipe_comm.Dup)

    def _replica_ranks(self, grid: runtime.Grid) -> list[list[int]] | None:
        """For the executor: on a non-uniform grid (pipe_comm is the world) the ranks of each stage's replicas,
        micro-batch m of stage s running on its replica m mod R_s; None on a uniform grid."""
        return None if grid.uniform else [grid.ranks_of_stage(s) for s in range(self.stages)]

    def _scale_for(self, grid: runtime.Grid) -> None:
        """The fp16 loss scaler's replica count (a non-uniform grid sums its replicas' gradients: nothing to
        divide)."""
        if self.scaler is not None:
            self.scaler.replicas = grid.data_replicas if grid.uniform else 1

    def _check_runtime(self, function: str) -> None:
        """The model's stage talks over the communicators of the hp.init it was built under: refuse once they are
        gone (a raw MPI error or a silent run on freed communicators otherwise)."""
        if not runtime.is_initialized() or runtime.grid() is not self.grid:
            raise NotInitializedError(f"PipelineModel.{function}: the hp.init() this model was built under has ended "
                                      "(hp.shutdown() was called); call hp.shutdown() only after the last train_step "
                                      "/ predict, or build the model again after a new hp.init()")

    def flush(self) -> None:
        """Asynchronous schedules: runs the backwards and updates of every micro-batch in flight, so
        the weights include every given micro-batch. Call it before evaluation, checkpointing (which
        calls it) or a change of schedule. Synchronous schedules never have anything in flight."""
        if not self.asynchronous:
            return
        actions = self._stream.drain()
        self.last_step = self._executor.run(actions, 0, {}, {}, self.loss_fn, {}, self.checkpoint, train=True)
        self._executor.drain()

    def restart_weight_versions(self) -> None:
        """After the live weights were replaced (``hp.load_checkpoint``): asynchronous schedules start
        their weight versions again from them."""
        if self.asynchronous:
            for chunk in self._executor.chunks.values():
                chunk.stash.restart(self._next_micro_batch)

    def weight_versions(self) -> list[tuple[int, int, int]]:
        """For the last ``train_step`` (or ``flush``): ``(micro_batch, forward_version,
        backward_version)`` of every micro-batch whose backward ran on this stage, micro-batches
        numbered from 0 since the model was built and a version being the number of updates this
        stage had applied. Synchronous schedules do not version weights: empty."""
        return sorted(self.last_step.versions) if self.last_step is not None else []

    def split_backward_report(self) -> str:
        """"zb-h1": which layers' weight gradients are deferred to ``W`` passes and which are computed
        with the input gradients (fused) because they cannot be split; otherwise a one-line note."""
        if not schedule_spec(self.schedule_name).split_backward:
            return f"schedule {self.schedule_name!r} does not split backwards"
        lines = []
        for stage, chunk in self._executor.chunks.items():
            deferred, fused = split_summary(chunk)
            lines.append(f"stage {stage}: W deferred for {', '.join(deferred) or 'no layer'}; fused into I: "
                         f"{', '.join(fused) or 'nothing'}")
        return "\n".join(lines)

    def updates_with(self, optimizer: Any) -> bool:
        """Whether ``optimizer.step()`` runs now as this pipeline's own scheduled update (a ``U`` action of an
        asynchronous schedule; any other step of its optimizer is refused, see pipeline/asynchronous.py)."""
        return optimizer is self.optimizer and self._executor.gradient_syncs.updating is optimizer

    def register_gradient_sync(self, sync: GradientSync, parameters: Any = None) -> Registration:
        """Makes ``sync`` (a :class:`hybridpipe.gradient_sync.GradientSync`) hear of this rank's forwards, backwards
        and final gradients of ``parameters`` (default: all of this rank's) until the returned registration's
        ``remove()``; see hybridpipe/gradient_sync.py for who calls what, when. hp.DistributedOptimizer registers
        itself with the pipeline that runs its parameters; call this for a sync of your own."""
        return self._executor.gradient_syncs.register(sync, self.parameters() if parameters is None else parameters)

    def _apply_update(self, stage: int, micro_batch: int) -> None:
        """A ``U`` action: average the gradients over the stage's replicas, step, start a new version."""
        parameters = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        if self.grid.data_replicas > 1:
            grouped_allreduce_([p.grad for p in parameters], op=Average, group="data")
        syncs = self._executor.gradient_syncs
        syncs.updating = self.optimizer  # the step guard lets this step through (pipeline/asynchronous.py)
        try:
            self.optimizer.step()
        finally:
            syncs.updating = None
        self.optimizer.zero_grad(set_to_none=True)
        self._executor.chunks[stage].stash.updated(self._stream.next_forward_id)

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """Forward-only pipeline run; returns the full output (merged micro-batches) on every rank
        of the pipeline. Asynchronous schedules use the current weights (``flush()`` first to
        include every micro-batch given so far)."""
        self._check_runtime("predict")
        chunks = microbatch.split(inputs, self.micro_batches)
        self._executor.check_finite = self.check_finite
        self._executor.batch_print = fingerprint(inputs) if self.check_batches else None
        result = self._executor.run(self._schedule("forward"), self.micro_batches, chunks, train=False)
        self.last_step = result
        return microbatch.merge(result.outputs)

    @property
    def measure_activations(self) -> bool:
        """Whether ``train_step`` counts the bytes autograd saves for backward (for ``memory_report()``'s
        activation peak; a Python call per saved tensor, so off by default). Switching it off keeps the
        peak measured so far; switching it on again continues from it."""
        return self._executor.around_run is not None

    @measure_activations.setter
    def measure_activations(self, on: bool) -> None:
        if not on:
            self._executor.around_run = None
            return
        meter = self.__dict__.get("_activation_meter")
        if meter is None:
            meter = self.__dict__["_activation_meter"] = ActivationMeter(self.parameters())
        self._executor.around_run = meter.hooks

    @property
    def executor_profile(self) -> ExecutorProfile | None:
        """Where this rank's actions spent their time since profiling began or was reset (waiting, sending,
        computing, the executor's own Python: hybridpipe/pipeline/executor_profile.py); None when off. On with
        ``HYBRIDPIPE_PROFILE_EXECUTOR=1`` or :meth:`profile_executor`; ``print()`` it for a table."""
        return self._executor.profile

    def profile_executor(self, on: bool = True) -> ExecutorProfile | None:
        """Starts (a fresh :attr:`executor_profile`) or stops profiling this rank's executor; returns the profile."""
        self._executor.profile = ExecutorProfile() if on else None
        return self._executor.profile

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
        """Every rank's memory: parameters, gradients, optimizer state (``optimizer``, default
        ``model.optimizer``; ZeRO: the shard), peak activations kept for backward (while
        ``measure_activations`` is on), peak RSS, CUDA peak. Collective over the world; ``print()`` it
        for a table (hybridpipe/pipeline/memory.py)."""
        return memory_report(self, optimizer)

    def close(self) -> None:
        """Releases the pipeline's communicator (also done when the model is garbage collected)."""
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.close()
            self._executor = None
            if runtime.is_initialized():  # on the communication thread, which may still be withdrawing receives on it
                call("pipe", "PipelineModel.close", self._comm.Free)

    def __repr__(self) -> str:
        return (f"PipelineModel(stage {self.stage} of {self.stages}, layers {list(self.layers_of_stage(self.stage))}, "
                f"micro_batches={self.micro_batches}, schedule={self.schedule_name!r}, "
                + (f"virtual_stages={self.virtual_stages}, " if self.virtual_stages > 1 else "") +
                f"checkpoint={self.checkpoint!r})")


def _layer_list(layers: Any, sample: Any, **layer_list_options: Any) -> tuple[nn.Module | None, list[Any]]:
    """``(the module to split, None)`` or ``(None, the layers)`` of what :class:`PipelineModel` was given, checked:
    a module needs ``sample=`` and takes none of the layer lists' options."""
    root = layers if isinstance(layers, nn.Module) and not isinstance(layers, nn.Sequential) else None
    if root is not None:
        if sample is None:
            raise UsageError(
                f"hp.PipelineModel got a {type(root).__name__} (an nn.Module that is not an nn.Sequential): pass "
                "sample=<one micro-batch of its inputs, exactly as train_step will get them> (a tensor, a "
                "tuple, or a dict of keyword arguments) so that it can be traced and split")
        for option, value in layer_list_options.items():
            if value is not None:
                raise UsageError(f"{option}= is for layer lists; a module is cut with split= ('auto' or a "
                                 f"list of module names where stages begin), got {option}={value!r}")
        return root, []
    if isinstance(layers, (nn.Sequential, list, tuple)):
        layer_list = list(layers)
    else:
        raise TypeError(f"layers must be an nn.Module (with sample=), an nn.Sequential or a list of nn.Module / "
                        f"hp.LayerSpec, got {type(layers).__name__}")
    for index, layer in enumerate(layer_list):
        if not isinstance(layer, (nn.Module, LayerSpec)):
            raise TypeError(f"layers[{index}] is a {type(layer).__name__}; pass nn.Module or hp.LayerSpec")
    return None, layer_list


def _checked_options(micro_batches: Any, checkpoint: str, schedule: str, precision: str, virtual_stages: Any) -> str:
    """:class:`PipelineModel`'s scalar options checked (each bad value named with the fix); the schedule's name."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise UsageError(f"micro_batches must be a positive int (got {micro_batches!r})")
    check_recompute_mode(checkpoint)
    name = canonical_name(schedule)  # unknown name → ScheduleError on every rank
    check_precision(precision)
    if PRECISIONS[precision].loss_scaling and name in ASYNCHRONOUS:
        raise UsageError(f"precision='fp16' needs a synchronous schedule (got {schedule!r}): its loss "
                         "scaler skips whole steps on every rank, which per-micro-batch updates cannot; "
                         "use precision='bf16' (no scaler needed) or a synchronous schedule")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise UsageError(f"virtual_stages must be a positive int (got {virtual_stages!r})")
    return name

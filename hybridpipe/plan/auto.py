"""``hp.auto``: plan for the running job and return a ready model and optimizer.

Design reasons:

* Write the one-process model and the optimizer; the framework decides how to cut and replicate
  it (the TF-Replicator idea). The layers are profiled on the sample a slice per rank, in turn (rank r
  builds and measures only its slice on the activation rank r - 1 passes it, while the others sleep: no
  rank builds the whole model), every rank receives the profile, and every rank runs the same
  deterministic search for the running world: the same plan everywhere, with no second
  communication.
* The grid follows the plan: when the running grid is not the plan's, ``runtime.regrid`` re-makes the job
  with the plan's grid on the same communicator and settings; it refuses (on every rank, naming them)
  while process sets or communicators of the user's own live on the old grid, so call ``hp.auto`` before
  making them.
* Only the synchronous schedules are chosen unless ``asynchronous=True``: they train exactly like
  one process on the same global batch; PipeDream and 2BW train differently.
* The plan's ZeRO level goes to the ``hp.DistributedOptimizer`` it builds; ``precision`` (passed on
  to ``hp.PipelineModel``) goes to the search too, which halves the activation bytes for bf16 / fp16.
  ZeRO shards parameters on any device (a GPU shard's buckets are reduced through host buffers).
* An ordinary ``nn.Module`` (not an ``nn.Sequential`` or a layer list) is profiled by its unit calls
  (hybridpipe/plan/module_profile.py): the search balances them as layers, and the chosen balance becomes
  the ``split=`` names of ``hp.PipelineModel(module, sample=..., split=...)``. Its asynchronous schedules
  are not supported yet, so they are never searched for a module.
* Weights tied across layers (a ``TiedLayerSpec`` key used twice, a parameter two layers share, a
  transformers model's tied head) are kept in step on uniform grids only, and never under an asynchronous
  schedule: for such a model the search offers neither stages with their own replica counts nor PipeDream /
  2BW (:func:`search_options`), rather than plans the runtime would refuse.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hybridpipe import runtime
from hybridpipe.comm.agree import Failure, agree_on_failure
from hybridpipe.comm.engine import call
from hybridpipe.data_parallel.optimizer import DistributedOptimizer
from hybridpipe.errors import NotSupportedError, UsageError, warn_user
from hybridpipe.pipeline import schedule as sched
from hybridpipe.pipeline.microbatch import iter_tensors, map_tensors
from hybridpipe.pipeline.model import LayerSpec, PipelineModel
from hybridpipe.pipeline.tied import find_ties
from hybridpipe.plan.calibrate import calibrate as measure, cluster_of, host_cores, model_contention, \
    model_resume
from hybridpipe.plan.cost import ZERO_LEVELS, Cluster
from hybridpipe.registry import check_zero_level
from hybridpipe.plan.module_profile import CUTS_KEY, is_module, module_layers, profile_module, split_of
from hybridpipe.plan.profile import Profile, forward_backward, profile, restored
from hybridpipe.plan.search import CHECKPOINT_CHOICES, SYNCHRONOUS_CHOICES, Plan, plan as search, plans
from hybridpipe.plan.verify import StepClock, accuracy_warning, measure_plans, on_grid_of, report

__all__ = ["auto", "cluster_of_this_job", "host_cores"]


def cluster_of_this_job(memory_per_rank: float = 0.0, **links: float) -> Cluster:
    """The running job as a :class:`Cluster` (collective over the job): its ranks, ranks per host (the
    grid's local size), the cores the host's ranks may use (ranks beyond them share), and ``links``
    (e.g. ``intra_host_gbps``, ``inter_host_gbps``, ``latency_us``, ``action_overhead_us``) or the
    defaults."""
    state = runtime.job("auto")
    return Cluster(ranks=state.grid.size, ranks_per_host=runtime.local_size(), cores_per_host=host_cores(),
                   memory_per_rank=memory_per_rank, **links)


class _PipelineDriven:
    """The optimizer of an asynchronous plan: the pipeline steps it; ``step()`` here does nothing."""

    def __init__(self, optimizer: torch.optim.Optimizer, warn: bool = True) -> None:
        self._optimizer, self._warned = optimizer, not warn

    def step(self, closure: Any = None) -> None:
        if not self._warned:
            warnings.warn("hp.auto chose an asynchronous schedule: the pipeline applies the optimizer itself, "
                          "so opt.step() does nothing", stacklevel=2)
            self._warned = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the pipeline clears the gradients it applied

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def built_layers(layers: Sequence[Any]) -> list[nn.Module]:
    """The layers as modules to profile: ``hp.LayerSpec`` entries built (their weights do not matter here)."""
    with torch.random.fork_rng(devices=[]):
        return [layer.build() if isinstance(layer, LayerSpec) else layer for layer in layers]


def profile_in_turns(layers: list[Any], sample: tuple[Any, Any], loss_fn: Any, optimizer: Any, comm: Any,
                     with_pass: bool = False) -> Any:
    """Profiles a layer list without building it whole on one rank: the world's ranks take contiguous slices
    of the layers in turn, rank r building (``hp.LayerSpec``) and profiling only its slice on the activation
    the slices before produced, then broadcasting its slice's output for the next; the others wait in that
    broadcast (asleep after a short spin), so each rank measures alone. Collective over ``comm``. Returns the
    whole profile's JSON on every rank; a slice that fails raises its exception on every rank (its type kept,
    with a note naming the layers and the rank). ``with_pass``: returns ``(json, kept)``, ``kept`` the slice
    this rank profiled (built), the input it profiled it on and the targets where it is the last (None for a rank
    that had no layers), for :func:`one_pass`."""
    ranks, rank = comm.Get_size(), comm.Get_rank()
    bounds = [round(i * len(layers) / ranks) for i in range(ranks + 1)]
    value: Any = sample[0]
    result: Any = None
    kept: tuple[list[nn.Module], Any, Any] | None = None
    original: Exception | None = None
    for turn in range(ranks):
        if turn == rank and not isinstance(value, Failure) and bounds[rank] < bounds[rank + 1]:
            try:
                built = built_layers(layers[bounds[rank]:bounds[rank + 1]])
                last = bounds[rank + 1] == len(layers)
                result = profile(built, value, loss_fn, sample[1] if last else None, optimizer=optimizer)
                if with_pass:
                    kept = (built, value, sample[1] if last else None)
                with torch.no_grad():
                    for layer in built:
                        value = layer(map_tensors(value, torch.clone))
                del built
            except Exception as error:  # noqa: BLE001 - every rank raises it below, with its type
                error.add_note(f"hp.auto: profiling layers {bounds[rank]}-{bounds[rank + 1] - 1} (profiled on "
                               f"world rank {rank})")
                original, value = error, Failure.of(error, rank)
        value = call(None, "auto", lambda: comm.bcast(value, root=turn))
    if isinstance(value, Failure):
        if original is not None:
            raise original
        raise value.exception("hp.auto")
    pieces = call(None, "auto", lambda: comm.gather(result, root=0))
    merged = agree_on_failure(comm, lambda: merge_profiles([piece for piece in pieces if piece is not None]).to_json(),
                              root=0, what="hp.auto")
    if not with_pass:
        return merged
    return merged, kept


def one_pass(modules: Any, inputs: Any, loss_fn: Any, targets: Any, layered: bool) -> Callable[[], None]:
    """:func:`hybridpipe.plan.profile.forward_backward` of ``modules`` (a slice of layers, ``layered``: on a copy of
    ``inputs``, so that an in-place first layer leaves the sample alone; or a module) as a function of no arguments."""
    return lambda: forward_backward(modules, map_tensors(inputs, torch.clone) if layered else inputs, loss_fn, targets,
                                    layered)


def measured_contention(comm: Any, modules: Sequence[nn.Module], run: Callable[[], None] | None,
                        measurement: Callable[..., tuple[float, int]] = model_contention) -> float | None:
    """:func:`hybridpipe.plan.calibrate.model_contention` (or ``measurement``, e.g.
    :func:`~hybridpipe.plan.calibrate.model_resume`) of ``run`` (this rank's pass; None: none), the
    parameters' gradients, the buffers (batch norm's statistics) and the random state put back afterwards. A pass
    that raises stops computing on its rank (the windows go on, so no rank waits forever) and every rank gets
    None: the cluster's own contention stays. Collective over ``comm``."""
    failed: list[BaseException] = []
    with restored(modules) as parameters, torch.random.fork_rng(devices=[]), torch.enable_grad():
        def guarded() -> None:
            if failed or run is None:
                return
            try:
                run()
            except Exception as error:  # noqa: BLE001 - a measurement, not the job: the cluster's value is kept
                failed.append(error)
            for parameter in parameters:  # as zero_grad leaves them for the next step
                parameter.grad = None

        value, _ = measurement(comm, None if run is None else guarded)
    if any(call(None, "auto", lambda: comm.allgather(bool(failed)))):
        return None
    return value


def merge_profiles(pieces: list[Profile]) -> Profile:
    """One profile from those of consecutive slices of the layers (each measured on its own input)."""
    first, last = pieces[0], pieces[-1]
    heaviest = max(pieces, key=lambda piece: sum(layer.parameter_bytes for layer in piece.layers))
    return dataclasses.replace(first, layers=[layer for piece in pieces for layer in piece.layers],
                               loss_ms=last.loss_ms, update_ms_per_mb=heaviest.update_ms_per_mb,
                               update_temporary_factor=heaviest.update_temporary_factor,
                               update_temporary_per_tensor=heaviest.update_temporary_per_tensor,
                               note=f"{first.note}; in {len(pieces)} slices, one per rank in turn")


def _micro_batch(inputs: Any, size: int) -> Any:
    """The first ``size`` samples of ``inputs`` (tensors whose first dimension is the batch), when it has more."""
    batch = next((t.shape[0] for t in iter_tensors(inputs) if t.dim() > 0), 0)
    if batch <= size:
        return inputs
    return map_tensors(inputs, lambda t: t[:size] if t.dim() > 0 and t.shape[0] == batch else t)


def auto(layers: nn.Module | Sequence[Any], loss_fn: Any, sample: tuple[Any, Any], global_batch: int,
         optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None, plan: Plan | None = None,
         asynchronous: bool = False, memory_per_rank: float = 0.0, optimizer_state_factor: float = 2.0,
         cluster: Cluster | None = None, zero: int | None = None, verify: bool = True, verify_plans: int = 3,
         verify_seconds: float = 60.0, verify_steps: int = 5, calibrate: bool = False,
         **model_options: Any) -> tuple[Any, Any]:
    """Plans for this job, then builds ``hp.PipelineModel`` and its optimizer; every rank calls it.

    Args:
        layers: The model as layers, as ``hp.PipelineModel`` takes them (built modules, or ``hp.LayerSpec``
            entries: then each rank builds only its stage's layers, and to profile them the world's ranks
            build and measure a slice each, in turn, passing the activation on); or any ``nn.Module`` (e.g. a
            transformers model): its unit calls are profiled as the layers, the plan's balance becomes ``split=`` (qualified module names) and the plan and the
            model's ``split_report()`` are printed on world rank 0.
        loss_fn: ``loss_fn(output, target)`` (a module's own output: a ``ModelOutput``, a tuple, a tensor).
        sample: ``(inputs, targets)`` of one micro-batch to profile (on world rank 0); a module's inputs as
            ``train_step`` gets them (a tensor, a tuple, or a dict of keyword arguments).
        global_batch: Samples per step over all replicas (each replica gets ``global_batch / replicas``).
        optimizer: ``optimizer(params)`` → a torch optimizer over a stage's parameters; ``None`` returns no
            optimizer (wrap your own in ``hp.DistributedOptimizer``, as for a hand-built model; synchronous
            plans only).
        plan: Use this plan instead of searching (e.g. one printed by ``python -m hybridpipe.plan``).
        asynchronous: Also consider "pipedream" and "2bw" (they do not train like one process; layer lists
            without tied weights only).
        memory_per_rank: Bytes a rank may use (0: no limit).
        optimizer_state_factor: Optimizer state bytes per parameter byte (SGD 0, momentum 1, Adam 2).
        cluster: The cluster to plan for (default: :func:`cluster_of_this_job`, its links at the defaults).
        calibrate: Without ``cluster``: measure this job's links and framework costs first (``python -m
            hybridpipe.plan calibrate``'s measurements, in the job: some 30 s on 2-4 ranks) and plan on them.
        zero: The ZeRO level to use (0, 1 or 2); None (default) lets the planner choose among them (0 unless
            sharding is faster or needed to fit ``memory_per_rank``).
        verify: Measure before keeping (default): the ``verify_plans`` best plans (the choice, then the best on
            other grids) each run ``verify_steps`` steps (after two untimed) on the sample tiled to a replica's
            batch, from the same weights; the fastest *measured* is kept and rank 0 prints predicted against
            measured. No plan starts once ``verify_seconds`` are spent (the first always runs). Modules are
            deep-copied per trial (``verify=False`` where a copy does not fit); not done for a ``plan=`` given.
            Before the search it also measures, on the model's own passes, how much slower the ranks compute at
            once than alone (``calibrate.model_contention``, some 2 s) and plans on that instead of the cluster's
            ``compute_contention``, where every rank has a core of its own.
        model_options: Passed on to ``hp.PipelineModel`` (e.g. ``seed_layers``, ``device``, ``precision``:
            planned for too).

    Feed each replica its own ``global_batch / model.plan.replicas`` samples per step (``hp.grid().replica``
    says which), as with a hand-built hybrid model.

    ``model.plan.predicted_seconds`` is the cost model's step, ``model.plan.measured_seconds`` the verification's
    median step, and a warning says when they differ by more than 25 %, naming the prediction's biggest term.

    Returns:
        ``(model, opt)``: the ``PipelineModel`` (its ``.plan`` is the :class:`Plan`) and a
        ``hp.DistributedOptimizer(..., zero=plan.zero)`` over the stage's parameters, averaged over its
        replicas — used as a hand-built pair (``opt`` is None when ``optimizer`` is: then pass
        ``**model.plan.optimizer_arguments()`` to your own ``hp.DistributedOptimizer``). For an
        asynchronous plan, ``opt`` is the pipeline's own optimizer, whose ``step()`` does nothing (the
        pipeline steps it; it warns once).
    """
    module = is_module(layers)
    zero_levels = _checked(layers, module, asynchronous, zero, verify, verify_plans, verify_steps, verify_seconds)
    if plan is None:
        found = _planned(layers, loss_fn, sample, global_batch, optimizer, module, asynchronous, zero_levels,
                         cluster or _job_cluster(memory_per_rank, calibrate), optimizer_state_factor,
                         model_options.get("precision"), verify_plans if verify else 1, contention=verify)
        plan = found[0]
        if verify:
            plan = _verified(found, layers, loss_fn, sample, global_batch, optimizer, module, model_options,
                             verify_steps, verify_seconds)
    elif module and plan.split is None:  # a plan made by hand: its balance counts the module's planner layers
        plan = dataclasses.replace(plan, split=split_of(module_layers(layers, sample[0]).names, plan.balance))
    size = runtime.job("auto").grid.size
    if plan.ranks != size:
        raise UsageError(f"hp.auto: the plan is for {plan.ranks} ranks, this job has {size}")
    on_grid_of(plan)  # (the verification's trials ran on their own grids)
    arguments = _model_arguments(plan, model_options, module, sample, global_batch)
    if optimizer is None and plan.schedule in sched.ASYNCHRONOUS:
        raise UsageError(f"hp.auto: the plan's {plan.schedule} schedule applies the optimizer inside the "
                         "pipeline: pass optimizer=<factory of a torch optimizer>")
    model, opt = _built(layers, loss_fn, optimizer, plan, arguments)
    _planned_model(model, plan, module)
    return model, opt


def _checked(layers: Any, module: bool, asynchronous: bool, zero: int | None, verify: bool, verify_plans: int,
             verify_steps: int, verify_seconds: float) -> tuple[int, ...]:
    """:func:`auto`'s arguments checked (a clear error naming the value); returns the ZeRO levels to search."""
    if zero is not None:
        check_zero_level(zero, "hp.auto: ")  # (None: the planner chooses)
    if module and asynchronous:
        raise NotSupportedError(f"hp.auto: asynchronous=True: the asynchronous schedules (pipedream, 2bw) are not yet "
                                f"supported for a module split by hp.PipelineModel (got a {type(layers).__name__}); "
                                "leave asynchronous out, or hand in a layer list")
    if verify and (verify_plans < 1 or verify_steps < 1 or verify_seconds < 0):
        raise UsageError(f"hp.auto: verify_plans and verify_steps must be >= 1 and verify_seconds >= 0 (got "
                         f"verify_plans={verify_plans}, verify_steps={verify_steps}, verify_seconds="
                         f"{verify_seconds}); or pass verify=False")
    return ZERO_LEVELS if zero is None else (zero,)


def _planned(layers: Any, loss_fn: Any, sample: tuple[Any, Any], global_batch: int, optimizer: Any, module: bool,
             asynchronous: bool, zero_levels: tuple[int, ...], cluster: Cluster, optimizer_state_factor: float,
             precision: str | None, count: int, contention: bool = False) -> list[Plan]:
    """:func:`auto`'s plans: the model profiled (a module on world rank 0; a layer list a slice per rank, in turn),
    then searched on every rank alike (collective); the search's choice first, then (``count`` > 1) the next best
    plans to measure (:func:`hybridpipe.plan.search.plans`)."""
    grid = runtime.job("auto").grid
    comm = grid.world_comm
    try:
        if module:
            measured = agree_on_failure(comm, lambda: profile_module(
                layers, sample[0], loss_fn, sample[1], optimizer=optimizer)[0].to_json(), root=0, what="hp.auto")
            kept = (layers, *call(None, "auto", lambda: comm.bcast(sample, root=0))) if contention else None
        else:
            measured, kept = profile_in_turns(list(layers), sample, loss_fn, optimizer, comm, with_pass=True)
    except Exception as error:  # the same on every rank; its own type stays the cause
        raise UsageError(f"hp.auto: profiling the {'module' if module else 'layers'} failed "
                         f"({type(error).__name__}: {error})") from error
    if contention and grid.size > 1:
        cluster = _with_model_measurements(cluster, comm, kept, loss_fn, module)
    del kept
    measured_profile = Profile.from_json(measured)
    options = dict(**search_options(layers, module, asynchronous), checkpoints=CHECKPOINT_CHOICES,
                   optimizer_state_factor=optimizer_state_factor, zero_levels=zero_levels, precision=precision)
    found = [search(measured_profile, cluster, global_batch, **options)]
    if count > 1:
        found += plans(measured_profile, cluster, global_batch, count, **options)[1:]
    if module:
        found = [dataclasses.replace(plan, split=split_of(measured_profile.extra[CUTS_KEY], plan.balance))
                 for plan in found]
    return found


def _with_model_measurements(cluster: Cluster, comm: Any, kept: tuple[Any, Any, Any] | None, loss_fn: Any,
                           module: bool) -> Cluster:
    """``cluster`` with how much slower a pass right after a wait runs (``resume_us``,
    :func:`~hybridpipe.plan.calibrate.model_resume`) and the contention of its ranks computing at once, both measured
    on the model (every rank's pass: the whole module, or the slice of layers it profiled); rank 0 says so, the
    contention beside the cluster's own value. The contention not where
    a host's ranks outnumber its cores: there a synchronous step is paced by the time slices of ranks waiting at
    the exchange while others compute, which ``calibrate``'s fixed-work windows hold and the model's (every rank
    computing to a common end) do not (4 ranks on 2 cores: the model's read x 1.0 where the kernel's read 1.13-1.31
    and the steps ran 20-45 % above the prediction made on 1.0)."""
    modules = [] if kept is None else ([kept[0]] if module else list(kept[0]))
    run = None if kept is None else one_pass(kept[0], kept[1], loss_fn, kept[2], layered=not module)
    started = time.perf_counter()
    resume = measured_contention(comm, modules, run, measurement=model_resume)
    if comm.Get_rank() == 0:
        print(f"hp.auto measured a pass right after a wait on the model in {time.perf_counter() - started:.1f} s: "
              + (f"+ {resume:.0f} µs" if resume is not None else "a pass failed, none counted"), flush=True)
    if resume is not None:
        cluster = dataclasses.replace(cluster, resume_us=resume)
    shared = runtime.local_size() > host_cores()
    if any(call(None, "auto", lambda: comm.allgather(shared))):  # (every rank decides alike)
        if comm.Get_rank() == 0:
            print("hp.auto: a host's ranks outnumber its cores, so the ranks' contention stays the cluster's "
                  f"(x {cluster.compute_contention:.3g}): waiting ranks' time slices, which the model's windows "
                  "do not show, pace such a step", flush=True)
        return cluster
    started = time.perf_counter()
    value = measured_contention(comm, modules, run)
    if comm.Get_rank() == 0:
        print(f"hp.auto measured the ranks computing at once on the model in {time.perf_counter() - started:.1f} s: "
              + (f"x {value:.3g}" if value is not None else "a pass failed")
              + f" (the cluster's own: x {cluster.compute_contention:.3g}"
              + ("" if value is not None else ", kept") + ")", flush=True)
    if value is None:
        return cluster
    return dataclasses.replace(cluster, compute_contention=value,
                               memory_contention=value if cluster.memory_contention else 0.0)


def has_tied_weights(layers: Any, module: bool) -> bool:
    """Whether two layers of the model share weights: a parameter two modules of ``layers`` (a module) hold, or for a
    layer list a ``TiedLayerSpec`` key used twice or one ``nn.Parameter`` in two layers (LayerSpecs are built on
    the meta device to see it)."""
    if module:
        named = list(layers.named_parameters(remove_duplicate=False))
        return len({id(parameter) for _, parameter in named}) < len(named)
    layers = list(layers)
    return bool(find_ties(layers, [1] * len(layers), len(layers)))


def search_options(layers: Any, module: bool, asynchronous: bool) -> dict[str, Any]:
    """The schedules and grids :func:`auto` searches: the synchronous schedules (and with ``asynchronous``, a
    layer list's PipeDream and 2BW) on every kind of grid; for a model with tied weights
    (:func:`has_tied_weights`) only uniform grids and synchronous schedules, the ones that keep ties in step."""
    tied = has_tied_weights(layers, module)
    schedules = SYNCHRONOUS_CHOICES + (sched.ASYNCHRONOUS if asynchronous and not tied else ())
    return {"schedules": schedules, "grids": "uniform" if tied else "all"}


def _verified(found: list[Plan], layers: Any, loss_fn: Any, sample: tuple[Any, Any], global_batch: int,
              optimizer: Any, module: bool, model_options: dict[str, Any], steps: int, budget: float) -> Plan:
    """The fastest measured of ``found`` (:func:`hybridpipe.plan.verify.measure_plans`), its measurement printed on
    world rank 0 and warned about when it is far from the prediction. Without an optimizer factory the trials step
    a plain SGD (the step you will wrap is not known here)."""
    def build(trial: Plan) -> tuple[Any, Any]:
        arguments = _model_arguments(trial, model_options, module, sample, global_batch)
        shared: dict[int, Any] = {}  # one memo for all the layers: a parameter two layers share stays one (a tie)
        copies = copy.deepcopy(layers) if module else [copy.deepcopy(layer, shared) if isinstance(layer, nn.Module)
                                                       else layer for layer in layers]
        factory = optimizer or (lambda params: torch.optim.SGD(params, lr=0.0))
        return _built(copies, loss_fn, factory, trial, arguments)

    kept, seconds = measure_plans(found, build, sample, steps, budget)
    if runtime.job("auto").grid.rank == 0:
        print(report(kept, seconds, budget), flush=True)
        text = accuracy_warning(kept)
        if text is not None:
            warn_user(text)
    return kept


def _model_arguments(plan: Plan, model_options: dict[str, Any], module: bool, sample: tuple[Any, Any],
                     global_batch: int) -> dict[str, Any]:
    """``hp.PipelineModel``'s arguments for ``plan``: its own, the caller's ``model_options`` over them (precision,
    device, ...), and a module's sample of one micro-batch."""
    arguments = {**plan.model_arguments(), **model_options}
    if module:
        arguments["sample"] = _micro_batch(sample[0], max(1, global_batch // plan.replicas // plan.micro_batches))
    return arguments


def _job_cluster(memory_per_rank: float, calibrate: bool) -> Cluster:
    """The running job as a :class:`Cluster`: calibrated in the job (``calibrate``: collective; rank 0 says how long
    it took), or :func:`cluster_of_this_job` with the default links."""
    if not calibrate:
        return cluster_of_this_job(memory_per_rank)
    if runtime.job("auto").grid.stage_replicas != (runtime.job("auto").grid.size,):
        runtime.regrid("auto", pipeline_stages=1)  # calibrate measures the framework's costs on one stage
    state = runtime.job("auto")
    started = time.perf_counter()
    measured = measure(repeats=5)  # complete on rank 0
    data = call(None, "hp.auto calibrate", lambda: state.grid.world_comm.bcast(measured, root=0))
    if state.grid.rank == 0:
        print(f"hp.auto calibrated the job's {data['ranks']} ranks in {time.perf_counter() - started:.1f} s",
              flush=True)
    return cluster_of(data, memory_per_rank, state.grid.size)


def _built(layers: Any, loss_fn: Any, optimizer: Any, plan: Plan, arguments: dict[str, Any]) -> tuple[Any, Any]:
    """The ``PipelineModel`` of ``plan`` and its optimizer (see :func:`auto`'s Returns)."""
    if optimizer is None:
        return PipelineModel(layers, loss_fn, **arguments), None
    if plan.schedule in sched.ASYNCHRONOUS:
        model = PipelineModel(layers, loss_fn, optimizer=optimizer, **arguments)
        return model, _PipelineDriven(model.optimizer)
    model = PipelineModel(layers, loss_fn, **arguments)
    parameters = list(model.parameters())
    if parameters:
        return model, DistributedOptimizer(optimizer(parameters), named_parameters=model.named_parameters(),
                                              **plan.optimizer_arguments())
    # a stage of parameter-free layers: nothing to step (its replicas agree: same layers)
    return model, _PipelineDriven(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0), warn=False)


def _planned_model(model: Any, plan: Plan, module: bool) -> None:
    """``model.plan`` set, its step clocked as training runs (synchronous plans: :class:`StepClock`), and a module's
    plan and ``split_report()`` printed on world rank 0 (what was cut where, and what crosses)."""
    model.plan = plan
    rank = runtime.job("auto").grid.rank
    if plan.schedule not in sched.ASYNCHRONOUS:
        warned = plan.verification and accuracy_warning(plan) is not None
        model.register_gradient_sync(StepClock(plan, warn=rank == 0, warned=bool(warned)), parameters=[])
    if module and rank == 0:
        print(f"hp.auto plan for {plan.ranks} ranks, global batch {plan.global_batch}: "
              f"{plan.describe()}; predicted {plan.step_seconds * 1e3:.1f} ms per step\n{model.split_report()}",
              flush=True)

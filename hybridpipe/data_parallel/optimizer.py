"""Horovod-style data parallelism: DistributedOptimizer, broadcasts of parameters / optimizer state, global
gradient-norm clipping (the object broadcasts are in collectives/broadcast.py, the compressors in compression.py).

Design reasons:

* ``DistributedOptimizer(opt)`` returns an object of a subclass of ``type(opt)`` that shares
  ``opt``'s state and param groups (Horovod's approach), so ``isinstance(…, torch.optim.AdamW)``
  and learning-rate schedulers keep working.
* Gradients are averaged over ``group`` (default ``"data"``: the replicas of this rank's
  pipeline stage; with ``pipeline_stages=1`` that is every rank), matched across ranks by
  parameter name. At ``step()`` one tiny allreduce of "has a gradient" flags makes every rank
  treat the same set: a parameter with no gradient on this rank but one elsewhere is reduced as
  zeros; one with no gradient anywhere keeps ``grad = None`` everywhere.
* The optimizer is a gradient sync (``hybridpipe/gradient_sync.py``): it registers with the pipeline that
  runs its parameters (found by ``gradient_sync.drivers_of(job)``), or, for parameters no pipeline runs, with an
  autograd driver of its own. Each ``gradient_final`` (a gradient hook, ``register_post_accumulate_grad_hook``,
  of the driver's) queues the parameter's reduction on the background engine (``collectives/allreduce.py``) the moment
  its gradient is final: in a pipeline, during the stage's LAST micro-batch backward of the step (earlier
  micro-batches only accumulate), so the reduction overlaps the rest of that backward and the other stages'
  drain; with a plain module, after the ``backward_passes_per_step``-th backward. ``step()`` waits for
  them (and starts those of parameters whose hook did not fire on this rank), then steps.
* ``backward_passes_per_step=N``: gradients of N backward passes (or ``train_step`` calls) are
  accumulated locally, then averaged over ranks and divided by N, so N passes over batches of
  size b equal one pass over a batch of N·b (with mean-reduced losses).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import _trace as timeline
from ..collectives import allreduce as allreduce_ops, broadcast as broadcast_ops, common
from ..collectives.sparse import sparse_allreduce_async
from ..comm import autotune, buffers, context
from .. import runtime
from . import zero as zero_module
from .compression import Compression, wire_for
from ..gradient_sync import GradientSync, drivers_of
from ..collectives.common import Average, ReduceOp, Sum
from ..comm.process_sets import ProcessSet
from ..errors import NotSupportedError, UsageError

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "clip_grad_norm_"]

_SPARSE = object()  # the ctx of a sparse gradient: reduced by sparse_allreduce_async, not compressed


def _outside_process_set(group: Any, function: str) -> bool:
    """Whether ``group`` is a registered process set that this rank is not in (an unregistered one raises)."""
    if not isinstance(group, ProcessSet) or group.included() is not False:
        return False
    context.current(function).process_sets.entry_of(group, function)
    return True


def _check_compression(compression: Any) -> None:
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression must be hp.Compression.none / fp16 / bf16 or an object with compress() and "
                        f"decompress() (as Horovod's compressors), got {compression!r}")


def _cuda_buckets(named: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int) -> list[list[str]]:
    """Buckets of CUDA parameters for their gradients' allreduce, as DDP makes them: consecutive in reverse
    model order (the order backward finishes them), each up to ``bucket_bytes`` (HYBRIDPIPE_FUSION_THRESHOLD)
    or one larger parameter. A bucket is one grouped allreduce once its gradients are final: packed on the
    device by one kernel and reduced as one buffer (the device ring with a CUDA-aware MPI, else staged), not
    a device-to-host copy per gradient."""
    buckets = buffers.size_buckets(list(reversed(named)), lambda item: item[1].numel() * item[1].element_size(),
                                   bucket_bytes)
    return [[name for name, _ in bucket] for bucket in buckets]


def _split_groups(names: list[str], by_id: dict[int, str], groups: Any, num_groups: Any) -> list[list[str]]:
    """Horovod's ``groups`` / ``num_groups`` as lists of parameter names (each list: one grouped allreduce)."""
    if groups is None and num_groups:
        groups = num_groups
    if groups is None or groups == 0:
        return []
    if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
        raise ValueError(f"groups must be an int (how many groups to split the parameters into) or a list of lists of "
                         f"parameters, got {groups!r}")
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups / num_groups must be >= 0 (got {groups})")
        count = min(groups, len(names)) or 1
        size, extra = divmod(len(names), count)
        result, at = [], 0
        for index in range(count):  # consecutive slices, the first `extra` one longer (as Horovod splits)
            length = size + (1 if index < extra else 0)
            result.append(names[at:at + length])
            at += length
        return [group for group in result if group]
    result, seen = [], set()
    for index, members in enumerate(groups):
        if not isinstance(members, (list, tuple)):
            raise ValueError(f"groups[{index}] must be a list of parameters, got {type(members).__name__}")
        group_names = []
        for parameter in members:
            name = by_id.get(id(parameter))
            if name is None:
                raise ValueError(f"groups[{index}] holds a tensor that is not a parameter of the optimizer "
                                 f"(shape {tuple(getattr(parameter, 'shape', ()))})")
            if name in seen:
                raise ValueError(f"parameter {name!r} is in more than one of groups")
            seen.add(name)
            group_names.append(name)
        if group_names:
            result.append(group_names)
    return result


class _OptimizerSync(GradientSync):
    """A DistributedOptimizer's side of the contract with what runs its parameters (hybridpipe/gradient_sync.py): a
    final gradient starts its reduction (ZeRO: its bucket's, once the bucket is final). A separate object, so that
    the protocol's names stay off the optimizer the user holds."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def gradient_final(self, parameter: Any) -> None:
        self.optimizer._hp_gradient_final(parameter)

    def rebind(self) -> None:
        self.optimizer._hp_rebind()


class _DistributedOptimizerMixin:
    """Methods layered over the wrapped optimizer's class (see DistributedOptimizer)."""

    _hp_parameters: list[tuple[str, torch.nn.Parameter]]

    def _hp_setup(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None, op: ReduceOp,
                  compression: Any, backward_passes_per_step: int, gradient_predivide_factor: float, groups: Any,
                  num_groups: Any, sparse_as_dense: bool, group: Any, auto_buckets: bool = True,
                  requested_op: Any = None) -> None:
        in_groups = [p for group_ in self.param_groups for p in group_["params"]]  # type: ignore[attr-defined]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(in_groups)]
        else:
            named = list(named_parameters)
            if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
                raise TypeError("named_parameters must yield (name, parameter) pairs, e.g. "
                                "model.named_parameters()")
            names = [name for name, _ in named]
            duplicates = sorted({name for name in names if names.count(name) > 1})
            if duplicates:
                raise ValueError(f"named_parameters has duplicate names {duplicates[:5]}: names identify "
                                 "gradients across ranks and must be unique")
            known = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(in_groups) if id(p) not in known]
            if missing:
                raise ValueError(f"named_parameters misses {len(missing)} parameters of the optimizer "
                                 f"(positions {missing[:5]} in its param groups): pass "
                                 "model.named_parameters() of the model the optimizer trains")
            in_optimizer = {id(p) for p in in_groups}
            named = [(name, p) for name, p in named if id(p) in in_optimizer]
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int (got {backward_passes_per_step!r})")
        _check_compression(compression)
        factor = common.scale_factor(gradient_predivide_factor, "gradient_predivide_factor", "DistributedOptimizer")
        if factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be > 0 (got {gradient_predivide_factor!r})")
        if factor != 1.0 and op != Average:
            raise ValueError(f"gradient_predivide_factor is only supported with op=hp.Average, as in Horovod (got "
                             f"op=hp.{ReduceOp(op).name}, gradient_predivide_factor={gradient_predivide_factor})")
        self._hp_parameters = sorted(named, key=lambda item: item[0])
        self._hp_op = ReduceOp(op)
        # what the user asked for: the grid's reading of it (_op_for_grid) is made again on another grid (_hp_rebind)
        self._hp_requested_op = ReduceOp(requested_op if requested_op is not None else op)
        # Horovod's split of the average: gradients divided by the factor before the sum, multiplied after
        self._hp_prescale, self._hp_postscale = 1.0 / factor, factor
        self._hp_compression = compression
        self._hp_passes = backward_passes_per_step
        self._hp_sparse_as_dense = bool(sparse_as_dense)
        self._hp_group = group
        self._hp_synchronized = False
        self._hp_skip = False
        # submitted reductions: key (a parameter name, or a group's name) -> (handle, [(parameter, wire, ctx)])
        self._hp_handles: dict[str, tuple[Any, list[tuple[torch.nn.Parameter, Any, Any]]]] = {}
        # per gradient's name, its allreduce checked once (the hooks hand the same tensors over every step)
        self._hp_prepared: dict[str, allreduce_ops.PreparedAllreduce] = {}
        self._hp_submitted: set[str] = set()
        self._hp_counts: dict[str, int] = {}
        self._hp_alone_now: bool | None = None  # _hp_alone() for this step, once its first gradient asked
        by_id = {id(p): name for name, p in self._hp_parameters}
        self._hp_groups = _split_groups([name for name, _ in self._hp_parameters], by_id, groups, num_groups)
        trained = [(name, p) for name, p in named if p.requires_grad]
        # CUDA gradients left ungrouped go in buckets (see _cuda_buckets); groups=0 keeps them one by one
        self._hp_auto = auto_buckets and groups is None and not num_groups and bool(trained) \
            and all(p.is_cuda for _, p in trained)
        if self._hp_auto:
            threshold = context.current("DistributedOptimizer").config.fusion_threshold_bytes
            self._hp_groups = _cuda_buckets(trained, threshold)
        self._hp_group_of = {name: index for index, members in enumerate(self._hp_groups) for name in members}
        self._hp_ready: dict[int, set[str]] = {}
        self._hp_by_name = dict(self._hp_parameters)
        # the contract with what runs the parameters (gradient_sync.py): gradient_final starts their reductions
        self._hp_sync = _OptimizerSync(self)
        self._hp_name_of = {parameter: name for name, parameter in self._hp_parameters}  # (by identity)
        self._hp_join(group)

    def _hp_join(self, group: Any) -> None:
        """Joins the running job: its name on the engine, and its registration with what runs the parameters (at
        construction, and again after lost ranks: :meth:`_hp_rebind`)."""
        running = context.current("DistributedOptimizer")
        # a rank outside the process set builds and steps it as Horovod's does: a local optimizer that reduces
        # nothing (its gradients stay its own); the set must still be registered
        self._hp_outside = _outside_process_set(group, "DistributedOptimizer")
        if not self._hp_outside:
            running.check_group(group, "DistributedOptimizer")
        # names its has-gradient agreement on the engine: every rank creates its optimizers in the same order
        # (an outside rank counts its optimizer too, so that the later ones keep the same names everywhere)
        self._hp_prefix = f"hybridpipe.DistributedOptimizer{running.sequence('optimizer') + 1}"
        self._hp_flags_name = f"{self._hp_prefix}.has_grad"
        self._hp_flags = allreduce_ops.PreparedAllreduce(self._hp_flags_name)  # checked once, as the gradients
        self._hp_registrations = [] if self._hp_outside else \
            drivers_of(running).register(self._hp_sync, [p for _, p in self._hp_parameters])

    def _hp_rebind(self) -> None:
        """After the survivors of lost ranks started a new job (hp.elastic.run): the old job's registrations end,
        nothing of it is in flight any more, and the optimizer registers with the new job under a name numbered in
        it (every survivor rebinds its optimizers in the order they were made). ZeRO's shards are sized by the old
        group: refused."""
        if isinstance(self, zero_module.ZeroMixin):
            raise NotSupportedError("hp.elastic.run: a DistributedOptimizer(zero=...) cannot go on after ranks were "
                                    "lost (its shards are sized by the old group); restart the job from a checkpoint "
                                    "(hybridpipe-run --restarts N) or train without zero=")
        for registration in self._hp_registrations:
            registration.remove()
        self._hp_handles, self._hp_prepared, self._hp_submitted, self._hp_counts = {}, {}, set(), {}
        self._hp_ready, self._hp_synchronized, self._hp_alone_now = {}, False, None
        self._hp_join(self._hp_group)
        self._hp_op = _op_for_grid(self._hp_requested_op, self._hp_group)  # e.g. 2 x 2 -> 2-1: Average -> Sum

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[dict[str, torch.nn.Parameter]]:
        """Every parameter whole for the ``with`` body, by name (``zero=3`` gathers them and frees them after;
        the other levels hold them whole already). ``writeback=True``: what the body wrote into them is kept
        (ZeRO: copied into the shards)."""
        yield dict(self._hp_parameters)

    @property
    def synchronized(self) -> bool:
        """Whether this step's gradients are reduced already (``synchronize()`` ran since the last step); set it
        to False to have the next ``step()`` reduce again (hp.LossScaler does, after skipping a step)."""
        return self._hp_synchronized

    @synchronized.setter
    def synchronized(self, value: bool) -> None:
        self._hp_synchronized = bool(value)

    @property
    def _parameter_names(self) -> dict[torch.nn.Parameter, str]:
        """Horovod's map from each parameter to the name its gradient is reduced under (``named_parameters``'
        names, or ``param.<i>`` in the optimizer's parameter order when none were given)."""
        return {parameter: name for name, parameter in self._hp_parameters}

    def _hp_gradient_final(self, parameter: torch.nn.Parameter) -> None:
        """A gradient of ``parameter`` was just accumulated and is final for this backward pass (its driver said):
        after ``backward_passes_per_step`` of them its reduction starts."""
        alone = self._hp_alone_now
        if alone is None:  # once per step: the group's size is the job's, which changes only between steps
            alone = self._hp_alone_now = self._hp_alone()
        if alone:
            return  # nothing to reduce: synchronize() divides by the passes
        name = self._hp_name_of[parameter]
        count = self._hp_counts.get(name, 0) + 1
        self._hp_counts[name] = count
        if count == self._hp_passes and name not in self._hp_submitted:
            self._hp_ready_now(name)

    def _hp_alone(self) -> bool:
        """Whether this step's reduction is over this rank alone (a pipeline stage without replicas, a job of one
        process): a sum or an average over one rank is the gradient itself, so the engine is left out — no hand-off
        per gradient, no has-gradient agreement, no engine cycle to wait for in ``step()`` (on 4 ranks sharing 2
        cores those cycles took a third of a waiting stage's CPU). Not with a compressor (its round trip stays, as
        in Horovod) nor ZeRO (its shards go through its own path). Resolved at each step, as the group is (elastic
        training re-makes the job under it)."""
        if self._hp_outside or self._hp_compression is not Compression.none or \
                isinstance(self, zero_module.ZeroMixin):
            return False
        return context.current("DistributedOptimizer").group_size(self._hp_group, "DistributedOptimizer") == 1

    def _hp_ready_now(self, name: str) -> None:
        """``name``'s gradient is final here: reduce it, or its group once the whole group is final."""
        index = self._hp_group_of.get(name)
        if index is None:
            self._hp_submit(name, [name])
            return
        ready = self._hp_ready.setdefault(index, set())
        ready.add(name)
        if len(ready) == len(self._hp_groups[index]):
            self._hp_submit(f"{self._hp_prefix}.group{index}", self._hp_groups[index])

    def _hp_wire(self, parameter: torch.nn.Parameter) -> tuple[Any, Any]:
        grad = parameter.grad
        if grad.is_sparse:
            if not self._hp_sparse_as_dense:
                return grad, _SPARSE  # reduced by hp.sparse_allreduce_async (allgather of indices and values)
            grad = grad.to_dense()
        grad = grad.detach() if grad.is_contiguous() else grad.detach().contiguous()
        if wire_for(self._hp_compression, grad, self._hp_op) is not None:
            return grad, None  # float32 in host memory: the ring converts each segment as it sends it
        return self._hp_compression.compress(grad)

    def _hp_submit(self, key: str, names: list[str]) -> None:
        """Queues the gradients of ``names`` (one parameter, or a group: one fused call) on the engine."""
        if self._hp_compression is Compression.none and len(names) == 1 and key == names[0]:
            prepared = self._hp_prepared.get(key)
            if prepared is not None:  # this gradient's allreduce was checked at an earlier step: the quick path
                parameter = self._hp_by_name[key]
                grad = parameter.grad
                handle = prepared.repeat(grad)
                if handle is not None:
                    self._hp_handles[key] = (handle, [(parameter, grad, None)])
                    self._hp_submitted.add(key)
                    return
        members = [(self._hp_by_name[name], *self._hp_wire(self._hp_by_name[name])) for name in names]
        wires = (wire_for(self._hp_compression, wire, self._hp_op) for _, wire, ctx in members if ctx is not _SPARSE)
        options = dict(op=self._hp_op, prescale_factor=self._hp_prescale, postscale_factor=self._hp_postscale,
                       group=self._hp_group, wire=next((wire for wire in wires if wire is not None), None))
        if len(names) == 1 and key == names[0] and members[0][2] is _SPARSE:
            handle = sparse_allreduce_async(members[0][1], name=key, op=self._hp_op, group=self._hp_group)
        elif self._hp_auto and key != names[0] and any(ctx is _SPARSE for _, _, ctx in members):
            for name in names:  # a bucket of our own making: its members go one by one, sparse ones as such
                self._hp_submit(name, [name])
            return
        elif any(ctx is _SPARSE for _, _, ctx in members):
            raise NotSupportedError("DistributedOptimizer: a group (groups= / num_groups=) holds a parameter with a "
                                    "sparse gradient; pass sparse_as_dense=True or leave it out of the groups")
        elif len(names) == 1 and key == names[0]:
            prepared = self._hp_prepared.get(key)
            if prepared is None:
                prepared = self._hp_prepared[key] = allreduce_ops.PreparedAllreduce(key)
            handle = prepared(members[0][1], **options)
        else:
            handle = allreduce_ops.grouped_allreduce_async_([wire for _, wire, _ in members], name=key, **options)
        self._hp_handles[key] = (handle, members)
        self._hp_submitted.update(names)

    # -------------------------------------------------------------- Horovod's interface

    def synchronize(self) -> None:
        """Waits for every gradient's reduction (starting those the hooks did not); ``step()`` then
        does not do it again.

        Use it to look at or clip the averaged gradients before ``step()``::

            opt.synchronize()
            hp.clip_grad_norm_(model, 1.0)
            with opt.skip_synchronize():
                opt.step()
        """
        if self._hp_outside:  # this rank is not in the process set: its own gradients, as in Horovod
            self._hp_synchronized = True
            return
        if self._hp_alone() and not self._hp_handles:
            self._hp_alone_synchronize()
            return
        parameters = self._hp_parameters
        if parameters:  # which parameters have a gradient anywhere: the same answer on every rank
            flags = torch.tensor([name in self._hp_submitted or p.grad is not None for name, p in parameters],
                                 dtype=torch.int32)
            # through the engine, not a direct collective: a main thread spinning in MPI beside the
            # (niced) engine thread that is still reducing early buckets can starve it for tens of ms
            self._hp_flags(flags, op=common.Max, group=self._hp_group).wait()
            anywhere = {name for (name, _), flag in zip(parameters, flags.tolist()) if flag}
            for name, parameter in parameters:
                if name in anywhere and name not in self._hp_submitted and name not in self._hp_group_of:
                    if parameter.grad is None:
                        parameter.grad = torch.zeros_like(parameter)
                    self._hp_submit(name, [name])
            for index, members in enumerate(self._hp_groups):  # groups whose hooks did not all fire here
                if any(name in self._hp_submitted for name in members):
                    continue
                present = [name for name in members if name in anywhere]
                for name in present:
                    if self._hp_by_name[name].grad is None:
                        self._hp_by_name[name].grad = torch.zeros_like(self._hp_by_name[name])
                if present:
                    self._hp_submit(f"{self._hp_prefix}.group{index}", present)
        handles, self._hp_handles, self._hp_counts = self._hp_handles, {}, {}
        self._hp_submitted, self._hp_ready, self._hp_alone_now = set(), {}, None
        wait_start = time.monotonic()
        for handle, members in handles.values():
            reduced = handle.wait()
            for parameter, wire, ctx in members:
                if ctx is _SPARSE:  # the sparse result replaces the gradient
                    parameter.grad = grad = reduced.coalesce()
                    if self._hp_passes > 1 and grad.is_floating_point():
                        grad.mul_(1.0 / self._hp_passes)
                    continue
                result = self._hp_compression.decompress(wire, ctx)
                grad = parameter.grad
                if grad.is_sparse:  # sparse_as_dense: the dense sum goes back into the gradient's sparse layout,
                    if self._hp_passes > 1 and result.is_floating_point():  # as Horovod (SparseAdam needs it)
                        result = result / self._hp_passes
                    parameter.grad = result.to_sparse(grad.sparse_dim())
                    continue
                if result.data_ptr() != grad.data_ptr():
                    grad.copy_(result)
                if self._hp_passes > 1 and grad.is_floating_point():
                    grad.div_(self._hp_passes)
        timeline.record("synchronize", "optimizer", "optimizer", wait_start, time.monotonic(),
                        {"tensors": sum(len(members) for _, members in handles.values())})
        self._hp_synchronized = True

    def _hp_alone_synchronize(self) -> None:
        """:meth:`synchronize` over one rank: each gradient as the reduction would leave it (a sparse one coalesced,
        divided by ``backward_passes_per_step`` as the engine's path divides)."""
        self._hp_submitted, self._hp_ready, self._hp_counts, self._hp_alone_now = set(), {}, {}, None
        for _, parameter in self._hp_parameters:
            grad = parameter.grad
            if grad is None:
                continue
            if grad.is_sparse:
                parameter.grad = grad = grad.coalesce()
            if self._hp_passes > 1 and grad.is_floating_point():
                grad.div_(self._hp_passes)
        self._hp_synchronized = True

    def in_flight(self) -> list[str]:
        """Names of the gradients whose reduction is queued or running (started by the hooks)."""
        return sorted(self._hp_submitted)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not reduce (you called :meth:`synchronize` already)."""
        self._hp_skip = True
        try:
            yield
        finally:
            self._hp_skip = False

    def step(self, closure: Any = None) -> Any:  # noqa: D102 — torch's docstring applies
        zero_module.refuse_closure(closure)
        if not self._hp_skip and not self._hp_synchronized:
            self.synchronize()
        elif not self._hp_skip:
            warnings.warn("hp.DistributedOptimizer: optimizer.step() called without optimizer.skip_synchronize() "
                          "after optimizer.synchronize(): the gradients were reduced already and are not reduced "
                          "again; step inside `with optimizer.skip_synchronize():` to say so", UserWarning,
                          stacklevel=2)
        elif self._hp_skip and not self._hp_synchronized:
            raise UsageError("step() inside skip_synchronize() but synchronize() was not called this "
                             "step: call opt.synchronize() first")
        self._hp_synchronized = False
        with timeline.span("step", "optimizer", "optimizer"):
            result = self._hp_inner_step()
        autotune.step()
        return result

    def _hp_inner_step(self) -> Any:
        """The wrapped optimizer's own step (also ZeroMixin's, which comes before this class in the MRO)."""
        return super().step()  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        if self._hp_handles:
            raise UsageError(f"zero_grad() while {len(self._hp_handles)} gradient allreduces are in flight "
                             f"(e.g. {next(iter(self._hp_handles))!r}): call step() or synchronize() first")
        self._hp_counts = {}
        self._hp_ready = {}
        self._hp_synchronized = False
        self._hp_alone_now = None
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]


def _wrapper_of(optimizer: torch.optim.Optimizer, sharded: bool) -> Any:
    """The user's optimizer seen through a subclass (ZeRO's mixin first when ``sharded``): one attribute dictionary
    for both names, so whatever rebinds an attribute on either (load_state_dict rebinds param_groups and state; an
    LR scheduler made before wrapping changes the groups) is seen by both. A copy or a new instance built from the
    param_groups (Horovod's way) would part the two at the first load_state_dict."""
    bases = (_DistributedOptimizerMixin, optimizer.__class__)
    if sharded:
        bases = (zero_module.ZeroMixin, *bases)
    cls = type(optimizer.__class__.__name__, bases, {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__
    return wrapped


def _op_for_grid(op: ReduceOp, group: Any) -> ReduceOp:
    """hp.init(stage_replicas=...): micro-batches go round-robin over a stage's replicas and each one's loss is
    already weighted for the whole mini-batch, so the replicas' gradients add up to the mini-batch's: Average over
    the default group is Sum there."""
    if op == Average and group == common.DEFAULT_GROUP and runtime.is_initialized() and not runtime.grid().uniform:
        return Sum
    return op


def _refuse_pipeline_driven(optimizer: torch.optim.Optimizer, zero: int) -> None:
    """Parameters of a PipelineModel whose asynchronous schedule steps its own optimizer are not wrapped again."""
    job = context.current_or_none()
    if job is None:
        return  # (DistributedOptimizer raises NotInitializedError)
    drivers = drivers_of(job).live()
    for group_ in optimizer.param_groups:
        owner = next((driver.updates_itself for p in group_["params"]
                      if (driver := drivers_of(job).runner_of(p, drivers)) is not None and driver.updates_itself),
                     None)
        if owner is not None:
            raise UsageError(
                f"hp.DistributedOptimizer(zero={zero}) wraps parameters of a PipelineModel whose schedule "
                f"{owner!r} steps its own optimizer (optimizer=) inside train_step, averaging the "
                "gradients over the replicas itself: do not wrap them (a second optimizer would update them "
                "again); ZeRO needs a synchronous schedule ('gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1')")


def _refuse_zero_outside(group: Any, zero: int, level: int) -> None:
    """ZeRO on a rank outside the process set ``group``: a ValueError (only the set's ranks build it)."""
    if level and _outside_process_set(group, "DistributedOptimizer"):
        rank = context.current("DistributedOptimizer").grid.rank
        raise ValueError(f"hp.DistributedOptimizer(zero={zero}): rank {rank} is not in the process set (ranks "
                         f"{group.ranks}): ZeRO shards the optimizer state over the "
                         "set's ranks, so only they build it; pass zero=0 here (a rank outside the set then steps "
                         "with its own gradients, as Horovod's optimizer does)")


def DistributedOptimizer(  # noqa: N802 — Horovod's spelling, a factory that returns an optimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    group: Any = None,
    zero: int = 0,
    zero3_keep_gathered: bool = False,
) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so that ``step()`` first averages gradients over the ranks of ``group``.

    The arguments are Horovod's, in Horovod's order, then hybridpipe's ``group``.

    Args:
        optimizer: any torch optimizer (its param groups, state and hooks are shared, not copied).
        named_parameters: ``model.named_parameters()``; names match gradients across ranks (default: the
            optimizer's parameter order).
        compression: ``hp.Compression.none / fp16 / bf16`` (between hosts; ``.forced``: on one host too) or an
            object with Horovod's ``compress(tensor) -> (tensor, ctx)`` / ``decompress`` (docs/compression.md).
        backward_passes_per_step: local accumulation passes per ``step()`` (see the module's docstring).
        op: ``hp.Average`` (default), ``hp.Sum`` or ``hp.Adasum`` (the gradients combined by Adasum over a
            power-of-two group; Horovod combines the optimizer's updates instead, see docs/horovod.md).
        gradient_predivide_factor: with ``hp.Average``, gradients are divided by this factor before the
            sum and the sum multiplied by ``factor / size`` after it (Horovod's split of the average).
        num_groups: split the parameters into this many groups, each reduced as one grouped allreduce once
            all its gradients are final (Horovod's older spelling of ``groups=int``).
        groups: an int (as ``num_groups``) or a list of lists of parameters, each list one grouped allreduce;
            parameters in no list are reduced one by one. Left unset for a model on the GPU, the gradients go
            in buckets of HYBRIDPIPE_FUSION_THRESHOLD bytes in reverse model order, each packed on the device
            and reduced as one buffer (``groups=0``: one by one through the engine, as on the CPU).
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense tensors.
        process_set: a hp.ProcessSet to average over (Horovod's keyword; default: ``group``).
        group: ``"data"`` (default: the replicas of my pipeline stage), ``"world"``, ``"pipe"``, a
            hp.ProcessSet or an mpi4py communicator.
        zero: 0 (default) every replica holds the whole optimizer state; 1 (ZeRO-1) each replica of the
            group owns 1/D of the flattened parameters' optimizer state, gradients are reduce-scattered
            and the updated parameters allgathered; 2 (ZeRO-2) also frees the parameters' gradients once
            they are sent, keeping only the shard's (hybridpipe/data_parallel/zero.py, docs/data_parallel.md);
            3 (ZeRO-3) also shards the parameters: each replica keeps 1/D of them, and a module's own are
            gathered for each of its forwards and backwards and freed after, in any ``nn.Module``, inside a
            ``hp.PipelineModel`` or not (``opt.full_parameters()`` gathers them all for a while).
        zero3_keep_gathered: with ``zero=3``, parameters once gathered stay so until ``step()`` (one gather per
            bucket and step instead of one per use; the memory of zero=2 during the step).

    Returns:
        An optimizer of a subclass of ``type(optimizer)``.

    Raises:
        ValueError: another op, ``gradient_predivide_factor`` with ``op=hp.Sum``, malformed ``groups``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    op = common.reduce_op(op, "DistributedOptimizer")
    if op not in (Average, Sum, common.Adasum):
        raise ValueError(f"DistributedOptimizer op must be hp.Average, hp.Sum or hp.Adasum (got {op.name})")
    group = common.spelling(group, process_set, "DistributedOptimizer")
    requested, op = op, _op_for_grid(op, group)
    level = zero_module.check_level(zero, zero3_keep_gathered)
    _refuse_zero_outside(group, zero, level)
    _refuse_pipeline_driven(optimizer, zero)
    meta = zero_module.realize_meta(optimizer) if level == 3 else {}
    wrapped = _wrapper_of(optimizer, sharded=bool(level))
    wrapped._hp_setup(named_parameters, op, compression, backward_passes_per_step, gradient_predivide_factor, groups,
                      num_groups, sparse_as_dense, group, auto_buckets=not level, requested_op=requested)
    if level:
        wrapped._hp_zero_setup(level, keep_gathered=bool(zero3_keep_gathered), meta=meta)
    return wrapped


# ------------------------------------------------------------------ broadcasts


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int = 0,
                         prefix: str = "Parameter.", process_set: Any = None, group: Any = None) -> None:
    """Copies ``root_rank``'s parameters / buffers to every rank of the group, in place.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.
        root_rank: with ``group`` (default ``"data"``), a rank of the group: the replica index of my stage, so
            each pipeline stage broadcasts from its own replica ``root_rank``; with ``process_set``, a
            global rank (``hp.rank()``), as in Horovod.
        prefix: put before each name (the broadcasts are named, and the names checked across ranks).
        process_set: a hp.ProcessSet (Horovod's keyword) instead of ``group``.
        group: ``"data"`` (default), ``"world"``, ``"pipe"``, a hp.ProcessSet or an mpi4py communicator.
    """
    with context.refusing("broadcast_parameters", "broadcast", group, process_set):
        target = common.target(group, process_set, "broadcast_parameters")
    items = sorted(params.items() if isinstance(params, Mapping) else params, key=lambda item: item[0])
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor")
        with torch.no_grad():
            broadcast_ops.broadcast_(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor, root_rank,
                                   name=f"{prefix}{name}", group=target)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, model: Any = None,
                              prefix: str = "Parameter.", process_set: Any = None, group: Any = None) -> None:
    """Makes every rank's optimizer state (moments, step counts, hyper-parameters — numbers or tensors, such
    as a tensor ``lr``) ``root_rank``'s.

    The state dict is broadcast as one pickled object, then loaded; tensors keep their dtype and move to
    each parameter's device. ``prefix`` is accepted for Horovod's signature and not needed (the state dict
    carries everything). ``root_rank``: as in :func:`broadcast_parameters`.

    When root's optimizer has no state yet (it has not stepped), every trainable parameter without a gradient
    gets a zero one, as Horovod leaves them (sparse for ``torch.optim.SparseAdam`` and for the
    ``nn.Embedding(sparse=True)`` modules of ``model``); unlike Horovod, the optimizer is not stepped to create
    its state, so the parameters and the step counts do not move.

    A ZeRO optimizer (``zero=1|2``) keeps each replica's own shard of the moments (the shards together are
    the state): only its hyper-parameters are made root's.
    """
    with context.refusing("broadcast_optimizer_state", "broadcast_object", group, process_set):
        target = common.target(group, process_set, "broadcast_optimizer_state")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
        root = common.root_index(target, root_rank, "broadcast_optimizer_state")
    me = context.communicator(target, "broadcast_optimizer_state").Get_rank()
    source = root_rank if target.set_ranks is not None else root  # a process set's root is global (as broadcast_object)
    if getattr(optimizer, "zero", 0):
        # ZeRO: each replica holds its own shard of the moments, so root's would be the wrong piece; the
        # shards together are the one state. Only the hyper-parameters (lr, betas, ...) are made root's.
        groups = broadcast_ops.broadcast_object([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
                                  if me == root else None, source, group=target)
        for group_, values in zip(optimizer.param_groups, groups):
            group_.update(values)
        return
    state = broadcast_ops.broadcast_object(optimizer.state_dict() if me == root else None, source, group=target)
    optimizer.load_state_dict(state)
    if not state["state"]:
        _zero_missing_gradients(optimizer, model)


def _zero_missing_gradients(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Horovod's broadcast_optimizer_state leaves every trainable parameter of a fresh optimizer with a gradient
    (zeros; sparse ones for SparseAdam and for the sparse embeddings of ``model``), so code that reads or
    broadcasts ``p.grad`` right after it finds tensors. Gradients already there are kept. Horovod also steps the
    optimizer once at these zero gradients to create its state; here the state dict travels whole, so nothing
    is stepped (weight decay does not move the parameters, Adam's step count stays 0)."""
    sparse = {id(p) for module in (model.modules() if isinstance(model, torch.nn.Module) else ())
              if isinstance(module, torch.nn.Embedding) and module.sparse for p in module.parameters()}
    for group_ in optimizer.param_groups:
        for parameter in group_["params"]:
            if parameter.requires_grad and parameter.grad is None:
                zeros = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(parameter) in sparse:
                    zeros = zeros.to_sparse(1) if zeros.dim() else zeros
                parameter.grad = zeros


# ------------------------------------------------------------------ clipping


def _zero_owner_of(parameter: torch.Tensor) -> Any:
    """The ZeRO optimizer that steps ``parameter`` (the last made of those registered for it), or None."""
    syncs = drivers_of(context.current("clip_grad_norm_")).syncs_of(parameter)
    owners = [sync.optimizer for sync in syncs
              if isinstance(sync, _OptimizerSync) and getattr(sync.optimizer, "zero", 0)]
    return owners[-1] if owners else None


def _copies_counted_elsewhere(model: Any) -> set[int]:
    """The ids of this rank's copies of weights tied across stages that a lower stage also holds.

    A sum over the pipeline's parameters (a gradient norm) counts a tied weight once by counting it on
    its lowest holding stage only. Reads the model's public layout: ``tied_parameter_names`` (names
    ``layers.<index>.<name>``), ``tied_parameter_ranks`` or ``layers_of_stage``; anything else (a plain module)
    has no such copies.
    """
    ties = getattr(model, "tied_parameter_names", None)
    if not ties or not callable(getattr(model, "layers_of_stage", None)):
        return set()
    own = dict(model.named_parameters(remove_duplicate=False))
    holders = getattr(model, "tied_parameter_ranks", None)
    if holders is not None:  # the pipeline ranks holding each tie, as PipelineModel lists them
        return {id(own[name]) for names, ranks in zip(ties, holders) if model.stage != min(ranks)
                for name in names if name in own}
    stage_of_layer = {index: stage for stage in range(model.stages) for index in model.layers_of_stage(stage)}
    elsewhere: set[int] = set()
    for names in ties:
        try:
            lowest = min(stage_of_layer[int(name.split(".")[1])] for name in names)
        except (IndexError, ValueError, KeyError):
            raise UsageError(f"tied_parameter_names {names} are not 'layers.<index>.<name>' of layers this "
                             "model's layers_of_stage() lists: PipelineModel and "
                             "clip_grad_norm_'s _copies_counted_elsewhere disagree on names; update the "
                             "latter") from None
        if model.stage != lowest:
            elsewhere.update(id(own[name]) for name in names if name in own)
    return elsewhere


def clip_grad_norm_(model: Any, max_norm: float, norm_type: float = 2.0) -> float:
    """Clips the gradients of ``model`` (all pipeline stages together) to a GLOBAL norm ``max_norm``.

    The norm is over every stage's parameters of my pipeline (one allreduce over ``"pipe"``), so it
    is the same on every rank; call it after the data-parallel average (``opt.synchronize()``),
    then every replica clips identically. A weight tied across stages (``tied_parameter_names``)
    counts once, as in one process: on its lowest holding stage (pass the PipelineModel itself for
    that, not its ``parameters()``, which do not say which copies are tied).

    Args:
        model: a PipelineModel, an nn.Module, or an iterable of parameters (this rank's).

    Returns:
        The total norm before clipping.
    """
    if getattr(model, "asynchronous", False):
        raise UsageError(
            f"hp.clip_grad_norm_: schedule {model.schedule_name!r} is asynchronous: its stages update at different "
            "times inside train_step, each with its own optimizer=, so there is no one global gradient to clip. "
            "Clip per stage inside the optimizer you pass (e.g. a torch.optim.Optimizer subclass whose step() calls "
            "torch.nn.utils.clip_grad_norm_ on its params first), or use a synchronous schedule")
    parameters = list(model.parameters()) if hasattr(model, "parameters") else list(model)
    elsewhere = _copies_counted_elsewhere(model)  # tied copies whose norm a lower stage adds
    # ZeRO: the averaged gradient exists only as each replica's shard: its norm is summed over the data group
    sharded = list(dict.fromkeys(o for o in map(_zero_owner_of, parameters) if o is not None))
    managed = {id(p) for o in sharded for _, p in o._hp_parameters}
    grads = [p.grad for p in parameters if p.grad is not None and id(p) not in managed]
    counted = [p.grad for p in parameters
               if p.grad is not None and id(p) not in managed and id(p) not in elsewhere]
    shard_grads = [g for o in sharded for g in o.shard_gradients()]

    def counted_shards(owner: Any) -> list[torch.Tensor]:
        return owner.shard_gradient_pieces(elsewhere) if elsewhere else owner.shard_gradients()

    norm_type = float(norm_type)
    if norm_type == float("inf"):
        local_max = 0.0
        for o in sharded:
            mine = max((g.detach().abs().max().item() for g in counted_shards(o) if g.numel()),
                       default=0.0)
            reduced = allreduce_ops.allreduce_nograd(torch.tensor([mine], dtype=torch.float64), op=common.Max,
                                                     group=o._hp_group)
            local_max = max(local_max, float(reduced[0]))
        local = torch.tensor([max([local_max] + [g.detach().abs().max().item() for g in counted])],
                             dtype=torch.float64)
        total = float(allreduce_ops.allreduce_nograd(local, op=common.Max, group="pipe")[0])
    else:
        shard_sum = 0.0
        for o in sharded:
            mine = sum(float(g.detach().double().norm(norm_type) ** norm_type)
                       for g in counted_shards(o))
            shard_sum += float(allreduce_ops.allreduce_nograd(torch.tensor([mine], dtype=torch.float64), op=Sum,
                                                              group=o._hp_group)[0])
        local = torch.tensor([shard_sum + sum(float(g.detach().double().norm(norm_type) ** norm_type)
                                              for g in counted)], dtype=torch.float64)
        total = float(allreduce_ops.allreduce_nograd(local, op=Sum, group="pipe")[0]) ** (1.0 / norm_type)
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for grad in grads + shard_grads:
            grad.detach().mul_(scale)
    return total

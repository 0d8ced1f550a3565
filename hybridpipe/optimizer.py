"""Horovod-style data parallelism: DistributedOptimizer, broadcasts of parameters / optimizer state /
objects, global gradient-norm clipping.

Design reasons:

* ``DistributedOptimizer(opt)`` returns an object of a subclass of ``type(opt)`` that shares
  ``opt``'s state and param groups (Horovod's approach), so ``isinstance(…, torch.optim.AdamW)``
  and learning-rate schedulers keep working.
* Gradients are averaged over ``group`` (default ``"data"``: the replicas of this rank's
  pipeline stage; with ``pipeline_stages=1`` that is every rank), matched across ranks by
  parameter name. At ``step()`` one tiny allreduce of "has a gradient" flags makes every rank
  treat the same set: a parameter with no gradient on this rank but one elsewhere is reduced as
  zeros; one with no gradient anywhere keeps ``grad = None`` everywhere.
* A gradient hook (``register_post_accumulate_grad_hook``) queues each parameter's reduction on
  the background engine (``comm/engine.py``) the moment its gradient is final: in a pipeline,
  during the stage's LAST micro-batch backward of the step (earlier micro-batches only
  accumulate), so the reduction overlaps the rest of that backward and the other stages' drain;
  with a plain module, after the ``backward_passes_per_step``-th backward. ``step()`` waits for
  them (and starts those of parameters whose hook did not fire on this rank), then steps.
* ``backward_passes_per_step=N``: gradients of N backward passes (or ``train_step`` calls) are
  accumulated locally, then averaged over ranks and divided by N, so N passes over batches of
  size b equal one pass over a batch of N·b (with mean-reduced losses).
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from . import _trace as timeline
from .comm import collectives, context, engine
from .pipeline import stage
from .comm.collectives import Average, ReduceOp, Sum
from .errors import HybridPipeError

__all__ = ["Compression", "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
           "broadcast_object", "allgather_object", "clip_grad_norm_"]

_DEFAULT_GROUP = "data"
_optimizers_created = 0  # names the per-optimizer has-gradient agreement on the engine


class Compression(enum.Enum):
    """Wire format of gradients: ``none`` (their dtype), ``fp16`` or ``bf16`` (halves the bytes).

    With fp16/bf16 the reduction still accumulates in float32 (see the ring allreduce), and the
    result is cast back to the gradient's dtype. As Horovod's compressors, each has
    ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``: floating-point tensors (and
    numpy arrays, for fp16) travel in the wire dtype, others as they are.

    Example:
        >>> wire, ctx = hp.Compression.fp16.compress(torch.ones(3, dtype=torch.float64))
        >>> wire.dtype, hp.Compression.fp16.decompress(wire, ctx).dtype
        (torch.float16, torch.float64)
    """

    none = None
    fp16 = torch.float16
    bf16 = torch.bfloat16

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """``(tensor in the wire dtype, ctx)``; ``ctx`` (the original dtype, or None) is for decompress."""
        if self.value is None:
            return tensor, None
        if isinstance(tensor, torch.Tensor):
            return (tensor.to(self.value), tensor.dtype) if tensor.is_floating_point() else (tensor, None)
        import numpy as np

        if self is Compression.fp16 and isinstance(tensor, np.ndarray) and np.issubdtype(tensor.dtype, np.floating):
            return tensor.astype(np.float16), tensor.dtype
        return tensor, None  # numpy has no bfloat16; integers are not compressed

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """The tensor back in the dtype ``compress`` saw."""
        if ctx is None or tensor.dtype == ctx:
            return tensor
        return tensor.to(ctx) if isinstance(tensor, torch.Tensor) else tensor.astype(ctx)


def _group_name(group: Any) -> str:
    return group if isinstance(group, str) else "a user communicator" if group is not None else "world"


class _DistributedOptimizerMixin:
    """Methods layered over the wrapped optimizer's class (see DistributedOptimizer)."""

    _hp_parameters: list[tuple[str, torch.nn.Parameter]]

    def _hp_setup(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None, op: ReduceOp,
                  compression: Compression, backward_passes_per_step: int, group: Any) -> None:
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
        if not isinstance(compression, Compression):
            raise TypeError(f"compression must be hp.Compression.none / fp16 / bf16, got {compression!r}")
        self._hp_parameters = sorted(named, key=lambda item: item[0])
        self._hp_op = ReduceOp(op)
        self._hp_compression = compression
        self._hp_passes = backward_passes_per_step
        self._hp_group = group
        self._hp_synchronized = False
        self._hp_skip = False
        self._hp_handles: dict[str, tuple[Any, torch.nn.Parameter, torch.Tensor]] = {}
        self._hp_counts: dict[str, int] = {}
        global _optimizers_created
        _optimizers_created += 1  # every rank creates its optimizers in the same order
        self._hp_flags_name = f"hybridpipe.DistributedOptimizer{_optimizers_created}.has_grad"
        context.communicator(group, "DistributedOptimizer")  # validates the group now
        self._hp_hooks = [parameter.register_post_accumulate_grad_hook(self._hp_hook(name))
                          for name, parameter in self._hp_parameters if parameter.requires_grad]

    def _hp_hook(self, name: str) -> Any:
        def hook(parameter: torch.nn.Parameter) -> None:
            if stage.gradient_phase(parameter) == "partial":  # more micro-batches of this step add to it
                return
            count = self._hp_counts.get(name, 0) + 1
            self._hp_counts[name] = count
            if count == self._hp_passes and name not in self._hp_handles:
                self._hp_submit(name, parameter)

        return hook

    def _hp_submit(self, name: str, parameter: torch.nn.Parameter) -> None:
        """Queues the parameter's gradient on the background engine (returns at once)."""
        grad = parameter.grad
        wire = self._hp_compression.value
        if wire is not None and grad.is_floating_point() and grad.dtype != wire:
            buffer = grad.detach().to(wire)
        else:
            buffer = grad.detach() if grad.is_contiguous() else grad.detach().contiguous()
        handle = engine.allreduce_async_(buffer, name=name, op=self._hp_op, group=self._hp_group)
        self._hp_handles[name] = (handle, parameter, buffer)

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
        parameters = self._hp_parameters
        if parameters:  # which parameters have a gradient anywhere: the same answer on every rank
            flags = torch.tensor([name in self._hp_handles or p.grad is not None for name, p in parameters],
                                 dtype=torch.int32)
            # through the engine, not a direct collective: a main thread spinning in MPI beside the
            # (niced) engine thread that is still reducing early buckets can starve it for tens of ms
            engine.allreduce_async_(flags, name=self._hp_flags_name, op=collectives.Max,
                                    group=self._hp_group).wait()
            for (name, parameter), anywhere in zip(parameters, flags.tolist()):
                if anywhere and name not in self._hp_handles:
                    if parameter.grad is None:
                        parameter.grad = torch.zeros_like(parameter)
                    self._hp_submit(name, parameter)
        handles, self._hp_handles, self._hp_counts = self._hp_handles, {}, {}
        wait_start = time.monotonic()
        for name, (handle, parameter, buffer) in handles.items():
            handle.wait()
            grad = parameter.grad
            if buffer.data_ptr() != grad.data_ptr():
                grad.copy_(buffer)
            if self._hp_passes > 1 and grad.is_floating_point():
                grad.div_(self._hp_passes)
        timeline.record("synchronize", "optimizer", "optimizer", wait_start, time.monotonic(),
                        {"tensors": len(handles)})
        self._hp_synchronized = True

    def in_flight(self) -> list[str]:
        """Names of the gradients whose reduction is queued or running (started by the hooks)."""
        return sorted(self._hp_handles)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not reduce (you called :meth:`synchronize` already)."""
        self._hp_skip = True
        try:
            yield
        finally:
            self._hp_skip = False

    def step(self, closure: Any = None) -> Any:  # noqa: D102 — torch's docstring applies
        if closure is not None:
            raise HybridPipeError("DistributedOptimizer.step(closure) is not supported: the closure's "
                                  "gradients would not be averaged over ranks; call backward, then step()")
        if not self._hp_skip and not self._hp_synchronized:
            self.synchronize()
        elif self._hp_skip and not self._hp_synchronized:
            raise HybridPipeError("step() inside skip_synchronize() but synchronize() was not called this "
                                  "step: call opt.synchronize() first")
        self._hp_synchronized = False
        with timeline.span("step", "optimizer", "optimizer"):
            return super().step()  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        if self._hp_handles:
            raise HybridPipeError(f"zero_grad() while {len(self._hp_handles)} gradient allreduces are in flight "
                                  f"(e.g. {next(iter(self._hp_handles))!r}): call step() or synchronize() first")
        self._hp_counts = {}
        self._hp_synchronized = False
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]


def DistributedOptimizer(  # noqa: N802 — Horovod's spelling, a factory that returns an optimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    op: ReduceOp = Average,
    compression: Compression = Compression.none,
    backward_passes_per_step: int = 1,
    group: Any = _DEFAULT_GROUP,
) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so that ``step()`` first averages gradients over the ranks of ``group``.

    Args:
        optimizer: any torch optimizer (its param groups, state and hooks are shared, not copied).
        named_parameters: ``model.named_parameters()``; names order the reduction identically on
            every rank (default: the optimizer's parameter order).
        op: ``hp.Average`` (default) or ``hp.Sum``.
        compression: ``hp.Compression.none / fp16 / bf16`` wire format.
        backward_passes_per_step: local accumulation passes per ``step()`` (see module docs).
        group: ``"data"`` (default: the replicas of my pipeline stage), ``"world"``, ``"pipe"`` or an
            mpi4py communicator.

    Returns:
        An optimizer of a subclass of ``type(optimizer)``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if ReduceOp(op) not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer op must be hp.Average or hp.Sum (got {ReduceOp(op).name})")
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizerMixin, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__  # shares param_groups, state, defaults and hooks
    wrapped._hp_setup(named_parameters, op, compression, backward_passes_per_step, group)
    return wrapped


# ------------------------------------------------------------------ broadcasts


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int = 0,
                         group: Any = _DEFAULT_GROUP) -> None:
    """Copies ``root_rank``'s parameters / buffers to every rank of ``group``, in place.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.
        root_rank: rank in ``group`` (default group ``"data"``: the replica index of my stage,
            so each pipeline stage broadcasts from its own replica ``root_rank``).
    """
    items = sorted(params.items() if isinstance(params, Mapping) else params, key=lambda item: item[0])
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor")
        with torch.no_grad():
            collectives.broadcast_(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor, root_rank,
                                   group=group)


def broadcast_object(obj: Any, root_rank: int = 0, group: Any = _DEFAULT_GROUP) -> Any:
    """Returns ``root_rank``'s ``obj`` (pickled) on every rank of ``group``."""
    comm = context.communicator(group, "broadcast_object")
    if not 0 <= root_rank < comm.size:
        raise ValueError(f"broadcast_object: root_rank {root_rank} is outside the {_group_name(group)} group "
                         f"of {comm.size} ranks")
    return engine.call(group, "broadcast_object", lambda: comm.bcast(obj, root=root_rank))


def allgather_object(obj: Any, group: Any = _DEFAULT_GROUP) -> list:
    """Every rank's ``obj`` (pickled), as a list in rank order of ``group``."""
    comm = context.communicator(group, "allgather_object")
    return engine.call(group, "allgather_object", lambda: comm.allgather(obj))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              group: Any = _DEFAULT_GROUP) -> None:
    """Makes every rank's optimizer state (moments, step counts, hyper-parameters) ``root_rank``'s.

    The state dict is broadcast as one pickled object, then loaded; tensors keep their dtype and
    move to each parameter's device.
    """
    state = broadcast_object(optimizer.state_dict() if context.communicator(
        group, "broadcast_optimizer_state").rank == root_rank else None, root_rank, group)
    optimizer.load_state_dict(state)


# ------------------------------------------------------------------ clipping


def clip_grad_norm_(model: Any, max_norm: float, norm_type: float = 2.0) -> float:
    """Clips the gradients of ``model`` (all pipeline stages together) to a GLOBAL norm ``max_norm``.

    The norm is over every stage's parameters of my pipeline (one allreduce over ``"pipe"``), so it
    is the same on every rank; call it after the data-parallel average (``opt.synchronize()``),
    then every replica clips identically.

    Args:
        model: a PipelineModel, an nn.Module, or an iterable of parameters (this rank's).

    Returns:
        The total norm before clipping.
    """
    parameters = list(model.parameters()) if hasattr(model, "parameters") else list(model)
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        local = torch.tensor([max((g.detach().abs().max().item() for g in grads), default=0.0)], dtype=torch.float64)
        total = float(collectives.allreduce(local, op=collectives.Max, group="pipe")[0])
    else:
        local = torch.tensor([sum(float(g.detach().double().norm(norm_type) ** norm_type) for g in grads)],
                             dtype=torch.float64)
        total = float(collectives.allreduce(local, op=Sum, group="pipe")[0]) ** (1.0 / norm_type)
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for grad in grads:
            grad.detach().mul_(scale)
    return total

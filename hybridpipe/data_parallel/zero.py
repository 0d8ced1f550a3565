"""ZeRO stages 1, 2 and 3 inside a data group: ``hp.DistributedOptimizer(opt, ..., zero=1|2|3)``.

Layout. The parameters of each of the optimizer's param groups are cut into buckets of at most
``fusion_threshold_bytes`` (in reverse order: the order their gradients become final in the backward
pass). A bucket is one flat buffer, padded to a multiple of the group size D; replica r owns the r-th
D-th of every bucket. Its shard of a param group is the concatenation of those pieces: one flat
tensor, which replaces the group's parameters inside the wrapped optimizer, so the optimizer's state
(momentum, Adam's moments) exists for 1/D of the parameters on each replica.

A step.

1. As soon as every gradient of a bucket is final (the same ``gradient_final`` of hybridpipe/gradient_sync.py as
   zero=0), the
   bucket's gradients are copied into a fresh flat buffer and reduce-scattered on the background
   engine (C++: shared memory on one host, the ring's reduce-scatter half across hosts): the average
   of this replica's piece lands in the shard's gradient, overlapping the rest of the backward.
   zero=2 frees the parameters' gradients right after the copy (only the shard's gradient stays);
   zero=1 leaves them (this rank's local, unaveraged gradients).
2. ``step()`` waits for the reduce-scatters, copies this replica's pieces of the current parameter
   values into the shard (so a broadcast or a load between steps is seen), steps the wrapped
   optimizer on the shard, and allgathers every bucket's updated pieces back into the parameters.

An elementwise optimizer (SGD, momentum, Adam, AdamW, RMSprop, Adagrad, ...) then computes what it
computes unsharded, to float rounding. An optimizer that looks at a whole parameter (LAMB, LARS:
per-tensor norms) would see the shard instead; do not shard those. A parameter without a gradient on
any rank is stepped with a zero gradient (a flat shard cannot skip part of itself): weight decay and
momentum still move it, unlike zero=0, where it is skipped.

ZeRO-3. The shard is then the only copy of the parameters between uses: each parameter's ``.data`` is an empty
tensor (its shape kept in the layout) except while a module that owns it runs (:class:`_ModuleGathers`): torch's
global module hooks allgather the buckets holding a module's own parameters as its forward begins (one flat
buffer per bucket, whose views become the parameters' data) and free them as it ends; the backward of that call
gathers them again when the gradient of its output arrives and frees them once each of them has its gradient of
that backward. So any ``nn.Module`` works, inside a pipeline or not, and a rank holds whole only the buckets of
the modules running (a count per bucket: a module called twice, a re-materialized forward inside its backward,
and ``zero3_keep_gathered=True``, which keeps them until the step). A split backward's ``I`` and ``W`` (zb-h1),
which autograd runs from recorded outputs, gather their whole chunk, through the pipeline's unit events
(hybridpipe/gradient_sync.py). Autograd saved the parameters themselves, so a backward sees the data gathered
again for it. A bucket's flat buffer lives as long as the bucket; a release resizes its storage to nothing, so what
autograd saved of a parameter (a view: a linear layer on 3-D inputs keeps ``weight.t()``) holds no memory between
the forward and the backward either, and the backward's gather fills the same storage again. (A view of a
gathered parameter kept past its module's call is freed with it; ``full_parameters()`` gathers into buffers of
its own, which the caller may keep.) Each gather starts the next bucket's behind it (prefetch: the one before in
a forward, after in a backward). Gradients go as zero=2's. ``step()`` steps the shard and gathers nothing: the
next forward does. A weight tied across stages (a deferred parameter, whose gradient the pipeline sums after the
run) stays whole on its holders and is refreshed after each step. ``full_parameters()`` gathers everything for a
while (checkpoints, evaluation, export). A parameter used outside the forward of the module that owns it (a
parent reading a child's ``weight`` in its own forward) is not whole there: own it in the module that uses it.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import _trace as timeline
from ..comm import autotune, buffers, context
from ..collectives.allgather import allgather_object
from ..collectives.common import Average, Sum
from ..errors import MismatchError, NotSupportedError, UsageError
from ..gradient_sync import GradientSync, Unit, drivers_of
from ..registry import ZERO_LEVELS, check_zero_level
from .compression import Compression

LEVELS = tuple(ZERO_LEVELS)


@dataclass
class _Item:
    name: str
    parameter: torch.nn.Parameter
    offset: int  # in its bucket's flat buffer
    numel: int
    shape: tuple[int, ...] = ()


@dataclass
class _Bucket:
    index: int
    group: int           # index of the param group
    items: list[_Item]
    numel: int           # the parameters' elements
    padded: int          # a multiple of D
    piece: int           # padded // D: each replica's part
    shard_offset: int    # where this replica's piece sits in its group's shard
    names: set[str] = field(default_factory=set)


def check_level(zero: Any, keep_gathered: Any = False) -> int:
    level = check_zero_level(zero, "DistributedOptimizer: ")
    if keep_gathered and level != 3:
        raise UsageError(f"DistributedOptimizer: zero3_keep_gathered=True needs zero=3 (got zero={zero}): only "
                         "ZeRO-3 frees the parameters between uses")
    return level


class _Gathers(GradientSync):
    """ZeRO-3's side of the contract with the pipeline (hybridpipe/gradient_sync.py): the backward halves of a
    split backward (``I``, ``W``: autograd from recorded outputs, not through the modules' calls) need their
    chunk's parameters whole; they are gathered as each begins and freed as it ends. Forwards and whole backwards
    are gathered module by module (:class:`_ModuleGathers`)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def backward_begins(self, unit: Unit, last: bool) -> None:
        if unit.split_backward:
            self.optimizer._hp_unit_begins(unit)

    def backward_ends(self, unit: Unit, last: bool) -> None:
        if unit.split_backward:
            self.optimizer._hp_unit_ends(unit)


class _Backward:
    """One call of a module whose backward has begun: the gradients of its parameters still to come."""

    __slots__ = ("buckets", "waiting", "fired")

    def __init__(self, buckets: list[int]) -> None:
        self.buckets, self.waiting, self.fired = buckets, set(), False


class _ModuleGathers:
    """ZeRO-3's gathers module by module (the module docstring's "ZeRO-3"). A pipeline's units name their modules:
    those owning this optimizer's parameters get hooks of their own. DistributedOptimizer is given parameters, not
    modules, so for parameters no pipeline runs torch's global module hooks find the modules (a module owning
    none of them costs a lookup). The hooks hold the optimizer weakly and go with it (the global ones as soon as
    they run after it); torch.compile runs them eagerly, between its graphs."""

    def __init__(self, optimizer: Any, modules: list[torch.nn.Module], free: bool) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.buckets_of: dict[int, set[int]] = {}
        for bucket in optimizer._hp_buckets:
            for item in bucket.items:
                self.buckets_of.setdefault(id(item.parameter), set()).add(bucket.index)
        self.modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (buckets, grad ids) | None
        self.waiting: dict[int, list[_Backward]] = {}  # id(parameter) -> backwards waiting for its gradient
        begins, ends = torch.compiler.disable(self.forward_begins), torch.compiler.disable(self.forward_ends)
        self.handles: list[Any] = []
        if free:
            self.handles += [torch.nn.modules.module.register_module_forward_pre_hook(begins),
                             torch.nn.modules.module.register_module_forward_hook(ends)]
        for module in {id(m): m for root in modules for m in root.modules()}.values():
            if self.entry(module) is not None:
                self.handles += [module.register_forward_pre_hook(begins), module.register_forward_hook(ends)]
        self.handles += [item.parameter.register_post_accumulate_grad_hook(self.accumulated)
                         for bucket in optimizer._hp_buckets for item in bucket.items]
        weakref.finalize(optimizer, _remove_hooks, self.handles)

    def entry(self, module: torch.nn.Module) -> tuple[list[int], frozenset[int]] | None:
        try:
            return self.modules[module]
        except KeyError:
            own = [p for p in module.parameters(recurse=False) if id(p) in self.buckets_of]
            found = (sorted({i for p in own for i in self.buckets_of[id(p)]}),
                     frozenset(id(p) for p in own if p.requires_grad)) if own else None
            self.modules[module] = found
            return found

    def forward_begins(self, module: torch.nn.Module, args: Any) -> None:
        optimizer = self.optimizer()
        if optimizer is None:
            _remove_hooks(self.handles)
            return
        entry = self.entry(module)
        if entry is not None:
            optimizer._hp_use(entry[0], prefetch=-1)  # (the buckets hold the parameters in reverse)

    def forward_ends(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        entry = self.entry(module)
        optimizer = self.optimizer()
        if entry is None or optimizer is None:
            return
        optimizer._hp_unuse(entry[0])
        if not entry[1] or not torch.is_grad_enabled():
            return
        tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            call = _Backward(entry[0])
            for tensor in tensors:
                tensor.register_hook(lambda grad, call=call, ids=entry[1]: self.backward_begins(call, ids))

    def backward_begins(self, call: _Backward, ids: frozenset[int]) -> None:
        """The gradient of one of the call's outputs arrived: its backward needs the parameters (once per call)."""
        optimizer = self.optimizer()
        if call.fired or optimizer is None:
            return
        call.fired = True
        optimizer._hp_use(call.buckets, prefetch=1)
        call.waiting = set(ids)
        for pid in ids:
            self.waiting.setdefault(pid, []).append(call)

    def accumulated(self, parameter: torch.Tensor) -> None:
        """``parameter``'s gradient of a backward is in: calls waiting for nothing else free their buckets."""
        calls = self.waiting.pop(id(parameter), None)
        optimizer = self.optimizer()
        if not calls or optimizer is None:
            return
        for call in calls:
            call.waiting.discard(id(parameter))
            if not call.waiting:
                optimizer._hp_unuse(call.buckets)

    def settle(self) -> None:
        """The backwards are over (the step): calls still waiting (a parameter that got no gradient) let go."""
        optimizer = self.optimizer()
        calls = {id(call): call for waiting in self.waiting.values() for call in waiting}
        self.waiting.clear()
        if optimizer is not None:
            for call in calls.values():
                call.waiting.clear()
                optimizer._hp_unuse(call.buckets)


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def refuse_closure(closure: Any) -> None:
    """``step(closure)`` of a DistributedOptimizer (sharded or not) is refused: the closure's gradients would not be
    averaged over the ranks."""
    if closure is not None:
        raise UsageError("DistributedOptimizer.step(closure) is not supported: the closure's "
                         "gradients would not be averaged over ranks; call backward, then step()")


class ZeroMixin:
    """The sharded step, layered over _DistributedOptimizerMixin (see DistributedOptimizer(zero=)), whose
    ``_hp_inner_step`` is the wrapped optimizer's own step."""

    def _hp_zero_setup(self, level: int, keep_gathered: bool = False,
                       meta: dict[int, tuple[int, ...]] | None = None) -> None:
        self._hp_meta = meta or {}  # zero=3: the shapes of parameters built on the meta device (realize_meta)
        if self._hp_op not in (Average, Sum):
            raise NotSupportedError(f"DistributedOptimizer(zero={level}) reduces with op=hp.Average or hp.Sum (got "
                                    f"hp.{self._hp_op.name}): Adasum needs whole gradients; use zero=0")
        if self._hp_compression is not Compression.none:
            raise NotSupportedError(f"DistributedOptimizer(zero={level}) sends gradients uncompressed (got "
                                    f"compression={self._hp_compression!r}): use compression=hp.Compression.none")
        if any(self._hp_groups):
            raise NotSupportedError(f"DistributedOptimizer(zero={level}) makes its own buckets: leave groups= and "
                                    "num_groups= unset")
        if self.state:  # type: ignore[attr-defined]
            raise UsageError(f"DistributedOptimizer(zero={level}) must wrap an optimizer that has not stepped "
                             "yet (its state would be lost): wrap it first, then load state with "
                             "hp.load_checkpoint")
        self._hp_zero = level
        ctx = context.current("DistributedOptimizer")
        comm = context.communicator(self._hp_group, "DistributedOptimizer")
        self._hp_zsize, self._hp_zrank = comm.Get_size(), comm.Get_rank()
        threshold = max(int(ctx.config.fusion_threshold_bytes), 1)
        names = {id(p): name for name, p in self._hp_parameters}
        D = self._hp_zsize
        self._hp_buckets: list[_Bucket] = []
        self._hp_shards: list[torch.nn.Parameter] = []
        layout = []
        for gi, group in enumerate(self.param_groups):  # type: ignore[attr-defined]
            params = [p for p in group["params"] if p.requires_grad]
            dtypes = {p.dtype for p in params}
            devices = {p.device for p in params}
            if len(dtypes) > 1 or len(devices) > 1:
                raise NotSupportedError(f"DistributedOptimizer(zero={level}): param group {gi} mixes dtypes "
                                        f"{sorted(map(str, dtypes))} or devices ({sorted(map(str, devices))}): put "
                                        "each dtype and device in its own param group")
            if buffers.dtype_code(params[0] if params else torch.empty(0)) not in (0, 1, 2, 3):
                raise NotSupportedError(f"DistributedOptimizer(zero={level}): param group {gi} has dtype "
                                        f"{params[0].dtype}; sharding needs floating-point parameters")
            dtype = params[0].dtype if params else torch.float32
            shape = lambda p: self._hp_meta.get(id(p), tuple(p.shape))  # noqa: E731
            buckets = buffers.size_buckets(list(reversed(params)),  # the backward's order
                                           lambda p: math.prod(shape(p)) * p.element_size(), threshold)
            shard_numel = 0
            for members in buckets:
                items, offset = [], 0
                for p in members:
                    items.append(_Item(names[id(p)], p, offset, math.prod(shape(p)), shape(p)))
                    offset += items[-1].numel
                padded = -(-offset // D) * D
                bucket = _Bucket(len(self._hp_buckets), gi, items, offset, padded, padded // D, shard_numel,
                                 {item.name for item in items})
                shard_numel += bucket.piece
                self._hp_buckets.append(bucket)
                layout.append(f"{gi}:" + ",".join(f"{item.name}={item.numel}" for item in items))
            device = params[0].device if params else torch.device("cpu")
            shard = torch.nn.Parameter(torch.zeros(shard_numel, dtype=dtype, device=device))  # on the params' device
            shard.grad = torch.zeros_like(shard)
            self._hp_shards.append(shard)
            group["params"] = [shard]
        self._hp_bucket_of = {item.name: bucket.index for bucket in self._hp_buckets for item in bucket.items}
        self._hp_zready: dict[int, set[str]] = {}
        self._hp_zhandles: dict[int, Any] = {}
        self._hp_zstaged: dict[int, torch.Tensor] = {}  # bucket -> its reduced piece in host memory (a GPU shard)
        self._hp_layout_digest = zlib.crc32("|".join(layout).encode()) & 0x3FFFFFFF
        digests = allgather_object((self._hp_layout_digest, len(self._hp_buckets)), group=self._hp_group)
        if len(set(digests)) > 1:
            raise MismatchError(f"DistributedOptimizer(zero={level}): the replicas' parameters differ (layout "
                                f"digests and bucket counts {digests}): every replica of a stage must wrap the same "
                                "parameters, in the same order and param groups")
        if level == 3:
            self._hp_zero3_setup(keep_gathered)

    # ------------------------------------------------------------------ gradients

    def _hp_ready_now(self, name: str) -> None:
        index = self._hp_bucket_of.get(name)
        if index is None:  # does not require grad
            return
        ready = self._hp_zready.setdefault(index, set())
        ready.add(name)
        if len(ready) == len(self._hp_buckets[index].items):
            self._hp_zero_submit(index)

    def _hp_zero_submit(self, index: int) -> None:
        for done, handle in list(self._hp_zhandles.items()):  # buckets already reduced: their flat copies go now
            if handle.poll():
                self._hp_zero_finish(done, handle)
        bucket = self._hp_buckets[index]
        shard = self._hp_shards[bucket.group]
        staged = staged_through_host(shard)
        flat = _host_buffer(bucket.padded, shard, zeros=True)
        for item in bucket.items:
            grad = item.parameter.grad
            if grad is not None:
                flat[item.offset:item.offset + item.numel].copy_(
                    (grad.to_dense() if grad.is_sparse else grad).reshape(-1))
                if self._hp_zero >= 2:
                    item.parameter.grad = None
        if self._hp_prescale != 1.0:
            flat.mul_(self._hp_prescale)
        out = shard.grad[bucket.shard_offset:bucket.shard_offset + bucket.piece]
        if staged:  # the engine reduces host memory: a GPU shard's piece lands here, then goes to the device
            out = self._hp_zstaged[index] = _host_buffer(bucket.piece, shard)
        state = context.current("DistributedOptimizer")
        group_id = state.engine_group(self._hp_group, "DistributedOptimizer")
        name = f"{self._hp_prefix}.zero.rs{index}"
        code = buffers.dtype_code(flat)
        counts = [bucket.piece] * self._hp_zsize
        kind = (self._hp_layout_digest + index) & 0x3FFFFFFF
        handle = context.queue(
            state, group_id, name, "DistributedOptimizer",
            lambda: state.engine.submit_reducescatter(group_id, name, kind, flat.data_ptr(), out.data_ptr(), counts,
                                                      code, int(self._hp_op), True),
            (flat, out), lambda: None)
        self._hp_zhandles[index] = handle
        self._hp_submitted.update(bucket.names)

    def synchronize(self) -> None:
        """Waits for every bucket's reduce-scatter (starting those whose gradients the hooks did not all
        see final on this rank); afterwards each replica's shard holds its piece of the average."""
        if self._hp_zero == 3:
            self._hp_modules.settle()
            self._hp_drop_prefetched()
        for index in range(len(self._hp_buckets)):  # buckets whose gradients were not all final here:
            if index not in self._hp_zhandles:    # what this rank has (zeros for the missing ones)
                self._hp_zero_submit(index)
        wait_start = time.monotonic()
        handles, self._hp_zhandles = self._hp_zhandles, {}
        for index, handle in handles.items():
            self._hp_zero_finish(index, handle)
        self._hp_submitted, self._hp_zready, self._hp_counts = set(), {}, {}
        for shard in self._hp_shards:
            if self._hp_postscale != 1.0:
                shard.grad.mul_(self._hp_postscale)
            if self._hp_passes > 1:
                shard.grad.div_(self._hp_passes)
        timeline.record("synchronize", "optimizer", "optimizer", wait_start, time.monotonic(),
                        {"buckets": len(handles)})
        self._hp_synchronized = True

    def _hp_zero_finish(self, index: int, handle: Any) -> None:
        """Waits for bucket ``index``'s reduce-scatter; a staged piece then goes to the shard's gradient."""
        handle.wait()  # (waited again by synchronize: the bucket stays in _hp_zhandles, so it is not submitted twice)
        staged = self._hp_zstaged.pop(index, None)
        if staged is not None:
            bucket = self._hp_buckets[index]
            grad = self._hp_shards[bucket.group].grad
            grad[bucket.shard_offset:bucket.shard_offset + bucket.piece].copy_(staged)

    # ------------------------------------------------------------------ the step

    def _hp_zero_load_pieces(self) -> None:
        """This replica's pieces of the current parameter values into the shards."""
        if self._hp_zero == 3:
            self._hp_drop_prefetched()  # (gathered from the values these replace)
        with torch.no_grad():
            for bucket in self._hp_buckets:
                for item in bucket.items:
                    self._hp_keep_piece(bucket, item)

    def _hp_zero_gather(self) -> None:
        """Allgathers every bucket's updated pieces into the parameters: two buckets in flight at a time
        (one gathering while the previous is copied out), so the full-size buffers held at once are two
        buckets', not the whole stage's."""
        pending: list = []

        def unpack_oldest() -> None:
            bucket, full, handle = pending.pop(0)
            handle.wait()
            with torch.no_grad():
                for item in bucket.items:
                    item.parameter.view(-1).copy_(full[item.offset:item.offset + item.numel])

        for bucket in self._hp_buckets:
            if len(pending) == 2:
                unpack_oldest()
            pending.append((bucket, *self._hp_allgather_submit(bucket.index, fresh=True)))
        while pending:
            unpack_oldest()

    def step(self, closure: Any = None) -> Any:  # noqa: D102 — torch's docstring applies
        refuse_closure(closure)
        if not self._hp_skip and not self._hp_synchronized:
            self.synchronize()
        elif self._hp_skip and not self._hp_synchronized:
            raise UsageError("step() inside skip_synchronize() but synchronize() was not called this "
                             "step: call opt.synchronize() first")
        self._hp_synchronized = False
        with timeline.span("step", "optimizer", "optimizer"):
            if self._hp_zero == 3:
                result = self._hp_zero3_step()
            else:
                self._hp_zero_load_pieces()
                result = self._hp_inner_step()
                self._hp_zero_gather()
        autotune.step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        if self._hp_zhandles:
            raise UsageError(f"zero_grad() while {len(self._hp_zhandles)} gradient reduce-scatters are in "
                             "flight: call step() or synchronize() first")
        self._hp_counts, self._hp_zready, self._hp_submitted = {}, {}, set()
        self._hp_synchronized = False
        for _, p in self._hp_parameters:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        for shard in self._hp_shards:
            shard.grad.zero_()

    # ------------------------------------------------------------------ ZeRO-3: parameters gathered for their units

    def _hp_zero3_setup(self, keep_gathered: bool) -> None:
        """The parameters become their shard: the current values go into it and every parameter but the deferred
        ones (tied across stages) is freed; the unit events of the pipeline that runs them gather and free."""
        registrations = drivers_of(context.current("DistributedOptimizer")).register(
            _Gathers(self), [p for _, p in self._hp_parameters])
        modules = [unit.module for r in registrations if r.driver.drives_units for unit in r.driver.units
                   if unit.module is not None]
        free = any(r.parameters and not r.driver.drives_units for r in registrations)
        self._hp_keep = bool(keep_gathered)
        self._hp_holds = [0] * len(self._hp_buckets)  # units (and full_parameters) using each bucket now
        self._hp_full: dict[int, torch.Tensor] = {}  # bucket -> its gathered flat buffer
        # bucket -> its flat buffer, kept for the bucket's life: freed by resizing its storage to nothing, so that
        # what autograd saved of it (a view: ``weight.t()``) holds no memory either, and gathered into again
        self._hp_flats: dict[int, torch.Tensor] = {}
        self._hp_prefetched: dict[int, tuple[torch.Tensor, Any]] = {}  # bucket -> (buffer, handle) in flight
        self._hp_unit_buckets: dict[int, list[int]] = {}
        self._hp_gathered_peak = 0
        self._hp_kept = {id(p) for r in registrations for unit in r.driver.units
                         for p in unit.parameters if id(p) in unit.deferred}
        self._hp_unmaterialized = sum(1 for bucket in self._hp_buckets for item in bucket.items
                                      if id(item.parameter) in self._hp_meta)
        if not self._hp_unmaterialized:
            self._hp_zero_load_pieces()
        self._hp_zero3_release(range(len(self._hp_buckets)))
        self._hp_modules = _ModuleGathers(self, modules, free)

    def materialize(self, module: torch.nn.Module, init: Any = None) -> int:
        """zero=3, the module built on the meta device: fills the shards module by module, no rank ever holding
        more than one module's parameters whole. For each module of ``module`` (in ``module.modules()`` order)
        owning some of this optimizer's parameters or a buffer on the meta device: its own parameters are made
        whole, its meta buffers real, ``init(module)`` fills them (default: a Hugging Face model's
        ``_init_weights``, else the module's ``reset_parameters()``), this replica's pieces go into the shard and
        the parameters are freed again. Every replica draws the same random numbers (seed them alike): the
        values are those of the same initialisation run on the whole module. Returns the most bytes held whole
        at once."""
        if not self._hp_unmaterialized:
            raise UsageError("opt.materialize(module): none of this optimizer's parameters is on the meta device "
                             "(they were built with their values; nothing to materialize)")
        init = init if init is not None else getattr(module, "_init_weights", None) or _reset_parameters
        device = self._hp_shards[0].device
        items = {id(item.parameter): (bucket, item) for bucket in self._hp_buckets for item in bucket.items}
        done, peak = set(), 0
        for sub in module.modules():
            own = [p for p in sub.parameters(recurse=False) if id(p) in items and id(p) not in done]
            buffers_meta = [name for name, b in sub.named_buffers(recurse=False) if b.device.type == "meta"]
            if not own and not buffers_meta:
                continue
            persistent = set(sub.state_dict(keep_vars=True)) if buffers_meta else set()
            for name in buffers_meta:
                sub.register_buffer(name, torch.empty_like(sub.get_buffer(name), device=device),
                                    persistent=name in persistent)
            for parameter in own:
                parameter.data = torch.empty(items[id(parameter)][1].shape, dtype=parameter.dtype, device=device)
            peak = max(peak, _tensor_bytes(own))
            with torch.no_grad():
                init(sub)
                for parameter in own:
                    self._hp_keep_piece(*items[id(parameter)])
                    done.add(id(parameter))
                    if id(parameter) not in self._hp_kept:
                        parameter.data = torch.empty(0, dtype=parameter.dtype, device=device)
        missing = [item.name for bucket, item in items.values() if id(item.parameter) not in done]
        if missing:
            raise UsageError(f"opt.materialize(module): {len(missing)} of the optimizer's parameters are not in "
                             f"this module ({missing[:3]}): pass the module that holds them all")
        self._hp_unmaterialized = 0
        return peak

    def _hp_keep_piece(self, bucket: _Bucket, item: _Item) -> None:
        """This replica's piece of one whole parameter into the shard."""
        begin, end = self._hp_zrank * bucket.piece, (self._hp_zrank + 1) * bucket.piece
        lo, hi = max(begin, item.offset), min(end, item.offset + item.numel)
        if lo < hi:
            shard = self._hp_shards[bucket.group]
            shard.data[bucket.shard_offset + lo - begin:bucket.shard_offset + hi - begin].copy_(
                item.parameter.detach().reshape(-1)[lo - item.offset:hi - item.offset])

    def _hp_buckets_of(self, unit: Any) -> list[int]:
        found = self._hp_unit_buckets.get(id(unit))
        if found is None:
            found = self._hp_unit_buckets[id(unit)] = [
                bucket.index for bucket in self._hp_buckets if any(unit.holds(item.parameter) for item in bucket.items)]
        return found

    def _hp_use(self, indices: Any, prefetch: int = 0, fresh: bool = False) -> None:
        """Buckets ``indices`` are in use from now (gathered where they are not). ``prefetch``: the direction the
        run goes through the buckets (-1 forward, 1 backward): the next bucket's gather starts behind them, to
        overlap the compute of these (every replica runs the same modules, so they prefetch the same). ``fresh``:
        gathered into new buffers, not the buckets' own (whose memory is freed under any view of it at the release:
        full_parameters() hands the parameters to the caller, who may keep views)."""
        if self._hp_unmaterialized:
            raise UsageError(f"DistributedOptimizer(zero=3): {self._hp_unmaterialized} parameters were built on "
                             "the meta device and have no values yet: call opt.materialize(module) first")
        needed = [i for i in indices if i not in self._hp_full]
        for i in indices:
            self._hp_holds[i] += 1
        if needed:
            self._hp_zero3_gather(needed, fresh)
        if prefetch and indices:
            following = (min(indices) - 1) if prefetch < 0 else (max(indices) + 1)
            if 0 <= following < len(self._hp_buckets) and following not in self._hp_full \
                    and following not in self._hp_prefetched:
                self._hp_prefetched[following] = self._hp_allgather_submit(following)

    def _hp_drop_prefetched(self) -> None:
        """Gathers started for a use that did not come before the step (their values go stale with it)."""
        prefetched, self._hp_prefetched = self._hp_prefetched, {}
        for index, (full, handle) in prefetched.items():
            handle.wait()
            if full is self._hp_flats.get(index):
                full.untyped_storage().resize_(0)

    def _hp_unuse(self, indices: Any) -> None:
        """Buckets ``indices`` are no longer used by one user; freed when none uses them (unless kept gathered)."""
        for i in indices:
            self._hp_holds[i] -= 1
        if not self._hp_keep:
            self._hp_zero3_release([i for i in indices if self._hp_holds[i] == 0])

    def _hp_unit_begins(self, unit: Any) -> None:
        self._hp_use(self._hp_buckets_of(unit))

    def _hp_unit_ends(self, unit: Any) -> None:
        self._hp_unuse(self._hp_buckets_of(unit))

    def _hp_zero3_release(self, indices: Any) -> None:
        for index in indices:
            if self._hp_full.pop(index, None) is self._hp_flats.get(index, False):
                self._hp_flats[index].untyped_storage().resize_(0)  # (views autograd saved let go of it too)
            for item in self._hp_buckets[index].items:
                if id(item.parameter) not in self._hp_kept:
                    item.parameter.data = torch.empty(0, dtype=item.parameter.dtype, device=item.parameter.device)

    def _hp_allgather_submit(self, index: int, fresh: bool = False) -> tuple[torch.Tensor, Any]:
        """Starts the allgather of bucket ``index``'s pieces: (the flat buffer it fills, its handle); ``fresh``: a
        new buffer rather than the bucket's own (ZeRO-3's, :meth:`_hp_flat`; zero=1/2's step gathers fresh)."""
        state = context.current("DistributedOptimizer")
        group_id = state.engine_group(self._hp_group, "DistributedOptimizer")
        bucket = self._hp_buckets[index]
        shard = self._hp_shards[bucket.group]
        piece = shard.detach()[bucket.shard_offset:bucket.shard_offset + bucket.piece]
        staged = staged_through_host(shard)
        if staged:  # through a host buffer, then into the bucket's own (_hp_zero3_gather)
            piece = _host_buffer(bucket.piece, shard).copy_(piece)
        full = _host_buffer(bucket.padded, shard) if staged or fresh else self._hp_flat(index)
        name = f"{self._hp_prefix}.zero.ag{bucket.index}"
        kind = (self._hp_layout_digest + 7919 * (bucket.index + 1)) & 0x3FFFFFFF
        counts = [bucket.piece] * self._hp_zsize
        handle = context.queue(
            state, group_id, name, "DistributedOptimizer",
            lambda: state.engine.submit_allgather(group_id, name, kind, piece.data_ptr(), full.data_ptr(), counts,
                                                  buffers.dtype_code(full)),
            (piece, full), lambda: None)
        return full, handle

    def _hp_flat(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s flat buffer, with room for the gathered bucket (its storage grown back if freed)."""
        bucket = self._hp_buckets[index]
        flat = self._hp_flats.get(index)
        if flat is None:
            shard = self._hp_shards[bucket.group]
            flat = self._hp_flats[index] = torch.empty(bucket.padded, dtype=shard.dtype, device=shard.device)
        elif flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(bucket.padded * flat.element_size())
        return flat

    def _hp_zero3_gather(self, indices: list[int], fresh: bool = False) -> None:
        """Allgathers buckets ``indices`` (all submitted, or prefetched, then each waited for): each parameter's
        data becomes a view of its bucket's gathered buffer; a kept (tied) parameter gets the values copied in."""
        if fresh:
            self._hp_drop_prefetched()
        pending = [(self._hp_buckets[i], *(self._hp_prefetched.pop(i, None) or self._hp_allgather_submit(i, fresh)))
                   for i in indices]
        for bucket, full, handle in pending:
            handle.wait()
            if fresh:
                full = full.to(self._hp_shards[bucket.group].device)
            elif full is not self._hp_flats.get(bucket.index):  # staged through the host
                full = self._hp_flat(bucket.index).copy_(full)
            self._hp_full[bucket.index] = full
            self._hp_gathered_peak = max(self._hp_gathered_peak, _tensor_bytes(self._hp_full.values()) + _tensor_bytes(
                full for full, _ in self._hp_prefetched.values()))
            with torch.no_grad():
                for item in bucket.items:
                    view = full[item.offset:item.offset + item.numel].view(item.shape)
                    if id(item.parameter) in self._hp_kept:
                        item.parameter.data.copy_(view)
                    else:
                        item.parameter.data = view

    def _hp_zero3_step(self) -> Any:
        """Steps the shard; the gathered copies are stale then: freed (those in use gathered again), and the kept
        (tied) parameters refreshed."""
        self._hp_drop_prefetched()
        result = self._hp_inner_step()
        stale = list(self._hp_full)
        self._hp_zero3_release(stale)
        refresh = sorted({i for i in stale if self._hp_holds[i]} | {
            b.index for b in self._hp_buckets if any(id(item.parameter) in self._hp_kept for item in b.items)})
        if refresh:
            self._hp_zero3_gather(refresh)
            self._hp_zero3_release([i for i in refresh if not self._hp_holds[i]])
        return result

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[dict[str, torch.nn.Parameter]]:
        """Every parameter whole for the ``with`` body, by name (zero=3: gathered, freed after; zero=1/2: as they
        are). ``writeback=True``: what the body wrote into them (a load) goes into the shards at the end."""
        every = range(len(self._hp_buckets))
        if self._hp_zero == 3:
            self._hp_use(every, fresh=True)
        try:
            yield dict(self._hp_parameters)
            if writeback:
                self._hp_zero_load_pieces()
        finally:
            if self._hp_zero == 3:
                self._hp_unuse(every)
                if not any(self._hp_holds):
                    self._hp_zero3_release(list(self._hp_full))

    # ------------------------------------------------------------------ what callers look at

    @property
    def zero(self) -> int:
        """The ZeRO stage: 1 (optimizer state sharded), 2 (and gradients) or 3 (and parameters)."""
        return self._hp_zero

    @property
    def zero_rank(self) -> int:
        """Which shard this replica holds: its rank in the optimizer's group."""
        return self._hp_zrank

    @property
    def zero_replicas(self) -> int:
        """How many shards the state is cut into: the size of the optimizer's group."""
        return self._hp_zsize

    @property
    def gathered_peak_bytes(self) -> int | None:
        """zero=3: the most bytes of gathered parameters this replica held at once so far (a chunk's, or every
        chunk's under ``zero3_keep_gathered`` or ``full_parameters()``); None for the other levels."""
        return self._hp_gathered_peak if self._hp_zero == 3 else None

    def shard_parameters(self) -> list[torch.nn.Parameter]:
        """This replica's flat shards (one per param group): what the wrapped optimizer steps; with zero=3 the only
        copy of its pieces of the parameters between uses."""
        return list(self._hp_shards)

    def shard_gradients(self) -> list[torch.Tensor]:
        """This replica's pieces of the averaged gradient (one flat tensor per param group), after
        ``synchronize()``."""
        return [shard.grad for shard in self._hp_shards]

    def shard_gradient_pieces(self, excluding: Any = frozenset()) -> list[torch.Tensor]:
        """This replica's pieces of the averaged gradient, one view per parameter that has some, leaving
        out the parameters whose ids are in ``excluding`` (e.g. a tied weight's copy another stage counts)."""
        r, pieces = self._hp_zrank, []
        for bucket in self._hp_buckets:
            grad = self._hp_shards[bucket.group].grad
            if grad is None:
                continue
            begin, end = r * bucket.piece, (r + 1) * bucket.piece
            for item in bucket.items:
                lo, hi = max(begin, item.offset), min(end, item.offset + item.numel)
                if lo < hi and id(item.parameter) not in excluding:
                    pieces.append(grad[bucket.shard_offset + lo - begin:bucket.shard_offset + hi - begin])
        return pieces

    def parameter_shapes(self, names: dict[int, str] | None = None) -> dict[str, tuple[int, ...]]:
        """Each parameter's whole shape, by name (``names``: id(parameter) -> name; default the optimizer's): what
        the layout keeps of a ZeRO-3 parameter while it is freed."""
        names = names or {}
        return {names.get(id(item.parameter), item.name): item.shape for bucket in self._hp_buckets
                for item in bucket.items}

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this replica holds (the shard's momentum / moments)."""
        return sum(v.numel() * v.element_size() for state in self.state.values()  # type: ignore[attr-defined]
                   for v in state.values() if torch.is_tensor(v) and v.dim() > 0)

    def sharded_state_by_name(self, names: dict[int, str] | None = None) -> dict[str, Any]:
        """This replica's optimizer state, per parameter name: ``{name: {key: (first element, piece)}}`` for
        the tensors of the parameter's size (momentum, moments), the others (step) as they are; and the
        param groups' hyper-parameters. What checkpoints save per owner. ``names``: id(parameter) -> the name
        to save it under (default: the optimizer's named_parameters)."""
        r = self._hp_zrank
        names = names or {}
        by_name: dict[str, dict[str, Any]] = {}
        for bucket in self._hp_buckets:
            shard = self._hp_shards[bucket.group]
            state = self.state.get(shard, {})  # type: ignore[attr-defined]
            begin, end = r * bucket.piece, (r + 1) * bucket.piece
            for item in bucket.items:
                entry = by_name.setdefault(names.get(id(item.parameter), item.name), {})
                lo, hi = max(begin, item.offset), min(end, item.offset + item.numel)
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() == 1 and value.numel() == shard.numel():
                        if lo < hi:
                            piece = value[bucket.shard_offset + lo - begin:bucket.shard_offset + hi - begin]
                            entry.setdefault(key, []).append((lo - item.offset, piece.detach().clone()))
                        else:
                            entry.setdefault(key, [])
                    else:
                        entry[key] = value.detach().clone() if torch.is_tensor(value) else value
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]  # type: ignore
        shapes = {names.get(id(item.parameter), item.name): item.shape
                  for bucket in self._hp_buckets for item in bucket.items}
        return {"state": by_name, "param_groups": groups, "shapes": shapes}

    def load_full_state_by_name(self, state: dict[str, dict[str, Any]], groups: list[dict],
                                names: dict[int, str] | None = None) -> None:
        """Loads optimizer state given per parameter name, each tensor whole (the parameter's shape), and
        keeps this replica's pieces: how a checkpoint saved with any D or zero level comes back."""
        r = self._hp_zrank
        names = names or {}
        for index, group in enumerate(self.param_groups):  # type: ignore[attr-defined]
            if index < len(groups):
                group.update({k: v for k, v in groups[index].items() if k not in ("params", "param_names")})
        for gi, shard in enumerate(self._hp_shards):
            new: dict[str, Any] = {}
            for bucket in self._hp_buckets:
                if bucket.group != gi:
                    continue
                begin, end = r * bucket.piece, (r + 1) * bucket.piece
                for item in bucket.items:
                    saved = state.get(names.get(id(item.parameter), item.name))
                    if not saved:
                        continue
                    lo, hi = max(begin, item.offset), min(end, item.offset + item.numel)
                    for key, value in saved.items():
                        if torch.is_tensor(value) and value.numel() == item.numel and value.dim() >= 1 \
                                and tuple(value.shape) == item.shape:
                            target = new.setdefault(key, torch.zeros_like(shard.detach()))
                            if lo < hi:
                                target[bucket.shard_offset + lo - begin:bucket.shard_offset + hi - begin].copy_(
                                    value.reshape(-1)[lo - item.offset:hi - item.offset])
                        elif key not in new:
                            new[key] = value.clone() if torch.is_tensor(value) else value
            self.state[shard] = new  # type: ignore[attr-defined]


#: tests: stage CPU shards through separate host buffers too, as GPU shards are (the CUDA path's logic on a CPU)
STAGE_CPU_SHARDS = False


def realize_meta(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, ...]]:
    """zero=3, before anything hooks the parameters: those of ``optimizer`` built on the meta device become empty
    tensors on this rank's device (the same Parameter objects: the module and the caller keep theirs), to be
    filled by ``materialize()``. Returns their shapes by id."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    meta = [p for p in params if p.device.type == "meta"]
    if meta and len(meta) < len(params):
        raise UsageError(f"DistributedOptimizer(zero=3): {len(meta)} of the {len(params)} parameters are on the "
                         "meta device and the others are not: build the whole module on the meta device (then "
                         "opt.materialize(module)) or none of it")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    shapes = {}
    for parameter in meta:
        shapes[id(parameter)] = tuple(parameter.shape)
        torch.utils.swap_tensors(parameter, torch.nn.Parameter(torch.empty(0, dtype=parameter.dtype, device=device),
                                                               requires_grad=parameter.requires_grad))
    return shapes


def _reset_parameters(module: torch.nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise UsageError(f"opt.materialize(module): {type(module).__name__} has no reset_parameters() to fill its "
                         "parameters: pass init=(a function of one module that fills its own parameters)")
    reset()


def staged_through_host(shard: torch.Tensor) -> bool:
    """Whether the engine's reduce-scatter / allgather of ``shard``'s buckets go through host buffers: a shard on
    a GPU (the engine reduces host memory), or any with :data:`STAGE_CPU_SHARDS`."""
    return shard.device.type != "cpu" or STAGE_CPU_SHARDS


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _host_buffer(numel: int, shard: torch.Tensor, zeros: bool = False) -> torch.Tensor:
    """A host tensor of ``shard``'s dtype (pinned for a CUDA shard: faster copies each way)."""
    pinned = shard.device.type == "cuda"
    make = torch.zeros if zeros else torch.empty
    return make(numel, dtype=shard.dtype, pin_memory=pinned)

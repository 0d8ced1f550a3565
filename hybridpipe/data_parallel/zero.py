"""ZeRO stages 1 and 2 inside a data group: ``hp.DistributedOptimizer(opt, ..., zero=1|2)``.

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
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _trace as timeline
from ..comm import autotune, buffers, context
from ..collectives.allgather import allgather_object
from ..collectives.common import Average, Sum
from ..errors import MismatchError, NotSupportedError, UsageError
from ..registry import ZERO_LEVELS, check_zero_level
from .compression import Compression

LEVELS = tuple(ZERO_LEVELS)


@dataclass
class _Item:
    name: str
    parameter: torch.nn.Parameter
    offset: int  # in its bucket's flat buffer
    numel: int


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


def check_level(zero: Any) -> int:
    return check_zero_level(zero, "DistributedOptimizer: ")


def refuse_closure(closure: Any) -> None:
    """``step(closure)`` of a DistributedOptimizer (sharded or not) is refused: the closure's gradients would not be
    averaged over the ranks."""
    if closure is not None:
        raise UsageError("DistributedOptimizer.step(closure) is not supported: the closure's "
                         "gradients would not be averaged over ranks; call backward, then step()")


class ZeroMixin:
    """The sharded step, layered over _DistributedOptimizerMixin (see DistributedOptimizer(zero=)), whose
    ``_hp_inner_step`` is the wrapped optimizer's own step."""

    def _hp_zero_setup(self, level: int) -> None:
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
            buckets = buffers.size_buckets(list(reversed(params)),  # the backward's order
                                           lambda p: p.numel() * p.element_size(), threshold)
            shard_numel = 0
            for members in buckets:
                items, offset = [], 0
                for p in members:
                    items.append(_Item(names[id(p)], p, offset, p.numel()))
                    offset += p.numel()
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
                if self._hp_zero == 2:
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
        r = self._hp_zrank
        with torch.no_grad():
            for bucket in self._hp_buckets:
                shard = self._hp_shards[bucket.group]
                begin, end = r * bucket.piece, (r + 1) * bucket.piece
                for item in bucket.items:
                    lo, hi = max(begin, item.offset), min(end, item.offset + item.numel)
                    if lo < hi:
                        shard.data[bucket.shard_offset + lo - begin:bucket.shard_offset + hi - begin].copy_(
                            item.parameter.detach().reshape(-1)[lo - item.offset:hi - item.offset])

    def _hp_zero_gather(self) -> None:
        """Allgathers every bucket's updated pieces into the parameters: two buckets in flight at a time
        (one gathering while the previous is copied out), so the full-size buffers held at once are two
        buckets', not the whole stage's."""
        state = context.current("DistributedOptimizer")
        group_id = state.engine_group(self._hp_group, "DistributedOptimizer")
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
            shard = self._hp_shards[bucket.group]
            piece = shard.detach()[bucket.shard_offset:bucket.shard_offset + bucket.piece]
            if staged_through_host(shard):
                piece = _host_buffer(bucket.piece, shard).copy_(piece)
            full = _host_buffer(bucket.padded, shard)
            name = f"{self._hp_prefix}.zero.ag{bucket.index}"
            kind = (self._hp_layout_digest + 7919 * (bucket.index + 1)) & 0x3FFFFFFF
            counts = [bucket.piece] * self._hp_zsize
            handle = context.queue(
                state, group_id, name, "DistributedOptimizer",
                lambda piece=piece, full=full, name=name, kind=kind, counts=counts: state.engine.submit_allgather(
                    group_id, name, kind, piece.data_ptr(), full.data_ptr(), counts, buffers.dtype_code(full)),
                (piece, full), lambda: None)
            pending.append((bucket, full, handle))
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

    # ------------------------------------------------------------------ what callers look at

    @property
    def zero(self) -> int:
        """The ZeRO stage: 1 (optimizer state sharded) or 2 (and gradients)."""
        return self._hp_zero

    @property
    def zero_rank(self) -> int:
        """Which shard this replica holds: its rank in the optimizer's group."""
        return self._hp_zrank

    @property
    def zero_replicas(self) -> int:
        """How many shards the state is cut into: the size of the optimizer's group."""
        return self._hp_zsize

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
        shapes = {names.get(id(item.parameter), item.name): tuple(item.parameter.shape)
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
                                and tuple(value.shape) == tuple(item.parameter.shape):
                            target = new.setdefault(key, torch.zeros_like(shard.detach()))
                            if lo < hi:
                                target[bucket.shard_offset + lo - begin:bucket.shard_offset + hi - begin].copy_(
                                    value.reshape(-1)[lo - item.offset:hi - item.offset])
                        elif key not in new:
                            new[key] = value.clone() if torch.is_tensor(value) else value
            self.state[shard] = new  # type: ignore[attr-defined]


#: tests: stage CPU shards through separate host buffers too, as GPU shards are (the CUDA path's logic on a CPU)
STAGE_CPU_SHARDS = False


def staged_through_host(shard: torch.Tensor) -> bool:
    """Whether the engine's reduce-scatter / allgather of ``shard``'s buckets go through host buffers: a shard on
    a GPU (the engine reduces host memory), or any with :data:`STAGE_CPU_SHARDS`."""
    return shard.device.type != "cpu" or STAGE_CPU_SHARDS


def _host_buffer(numel: int, shard: torch.Tensor, zeros: bool = False) -> torch.Tensor:
    """A host tensor of ``shard``'s dtype (pinned for a CUDA shard: faster copies each way)."""
    pinned = shard.device.type == "cuda"
    make = torch.zeros if zeros else torch.empty
    return make(numel, dtype=shard.dtype, pin_memory=pinned)

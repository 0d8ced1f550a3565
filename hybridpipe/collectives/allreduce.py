"""The allreduce family (Horovod's ``allreduce``, ``allreduce_``, ``grouped_allreduce``, their ``*_async``
forms): reduces tensors over the ranks of a group with the ring, shared memory or the MPI library.

* :func:`allreduce`, :func:`grouped_allreduce`: out of place, differentiable (the gradient is the allreduce of the
  gradient with the same op and factors, as in Horovod), with ``compression=``.
* :func:`allreduce_`, :func:`grouped_allreduce_`: in place (not differentiable).
* :func:`allreduce_async`, :func:`allreduce_async_`, :func:`grouped_allreduce_async`,
  :func:`grouped_allreduce_async_`: queued on the background engine (``csrc/engine.h``), which agrees with the other
  ranks on which named tensors are ready everywhere, packs them into fusion buckets and reduces them while Python
  goes on computing; they return a :class:`~hybridpipe.comm.context.Handle` at once. Tensors may become ready in
  different orders on different ranks: names, not call order, match them; a name some ranks never submit is
  reported after ``stall_check_seconds``. An op the engine does not reduce with (Product, Adasum) and the grouped
  calls run as one queued collective on the same thread instead of fused buckets.
* :func:`allreduce_nograd`, :func:`grouped_allreduce_nograd`: the blocking forms without autograd, which the
  optimizer and the pipeline call with a ring ``wire`` format of their own.

Every call runs on the communication thread (``context.call`` / ``context.submit``). Before moving data the ranks
agree on a small header (hybridpipe.comm.reduction). While ranks have joined (hp.join), a blocking allreduce runs
through the engine instead, where they contribute zeros (:func:`allreduce_while_joined`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from .._ext import core
from ..comm import buffers, context, staging
from ..comm.context import Handle, check_name, refusing, resolve_group, resolved, unnamed
from ..comm.reduction import allreduce_here, grouped_allreduce_here
from .common import (CORE_OPS, Average, check_tensors, checking, compressed, compressor, needs_grad, resolve_op,
                     scale_factor)

__all__ = ["allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allreduce_async",
           "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_", "allreduce_nograd",
           "grouped_allreduce_nograd", "allreduce_while_joined"]


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: Any, name: Any, prescale: float, postscale: float,
                group: Any, wire: Any) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale, ctx.group = op, prescale, postscale, group
        return allreduce_nograd(tensor, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                group=group, wire=wire)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (allreduce(grad, op=ctx.op, prescale_factor=ctx.prescale, postscale_factor=ctx.postscale,
                          group=ctx.group), None, None, None, None, None, None)


def allreduce(tensor: Any, average: Any = None, name: str | None = None, compression: Any = None,
              op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
              group: Any = None) -> Any:
    """Reduces ``tensor`` over the ranks of the group and returns the result as a new tensor/array;
    differentiable (the gradient is the allreduce of the gradient with the same op and factors).

    Args:
        tensor: torch.Tensor (any device, contiguous or not) or numpy.ndarray of dtype float32,
            float64, float16, bfloat16, int32 or int64; the same shape and dtype on every rank.
        average: deprecated (Horovod's): True is op=hp.Average, False op=hp.Sum; warns. Giving it with
            ``op`` is a ValueError.
        name: optional; every rank must pass the same name (checked with the shape).
        compression: None (default, as hp.Compression.none), hp.Compression.fp16 or bf16: the dtype on the wire
            between hosts (their ``.forced``: between the ranks of one host too; see hp.Compression), or a
            Horovod-style compressor (``compress`` / ``decompress``).
        op: hp.Average (default, like Horovod), hp.Sum, hp.Min, hp.Max, hp.Product or hp.Adasum (a power-of-two
            group).
        prescale_factor: multiplies the input before the reduction (on a copy).
        postscale_factor: multiplies the result.
        process_set: a hp.ProcessSet (Horovod's spelling of ``group``; default: every rank).
        group: None or "world" (all ranks), "data" (my stage's replicas), "pipe" (my pipeline), a
            hp.ProcessSet, or an mpi4py communicator.

    Returns:
        A new tensor (same device) or array with the reduced values.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops or names (on every rank).
        TypeError: not a tensor/array, or a dtype that cannot be reduced.
        ValueError: both ``average`` and ``op``, or both ``group`` and ``process_set``.
    """
    with checking("allreduce", [tensor], name, group, process_set, compression) as checked:
        op = resolve_op(op, average, "allreduce")
        checked.scales(prescale_factor, postscale_factor)
    group, prescale, postscale = checked.group, checked.prescale, checked.postscale
    compression = compressor(compression)
    [(wire, compression_ctx)], wire_format = compressed(compression, [tensor], op)
    if needs_grad(wire):
        reduced = _Allreduce.apply(wire, op, name, prescale, postscale, group, wire_format)
    else:
        reduced = allreduce_nograd(wire, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                   group=group, wire=wire_format)
    return compression.decompress(reduced, compression_ctx)


def allreduce_(tensor: Any, average: Any = None, name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = None, group: Any = None) -> Any:
    """In-place :func:`allreduce`: ``tensor`` holds the result afterwards and is returned."""
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group, "allreduce_",
                      True)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: Any, name: Any, prescale: float, postscale: float, group: Any, wire: Any,
                *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.prescale, ctx.postscale, ctx.group = op, prescale, postscale, group
        return tuple(grouped_allreduce_nograd(list(tensors), name=name, op=op, prescale_factor=prescale,
                                              postscale_factor=postscale, group=group, wire=wire))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.prescale,
                                    postscale_factor=ctx.postscale, group=ctx.group)
        return (None, None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[Any], average: Any = None, name: str | None = None,
                      compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None, group: Any = None) -> list:
    """Allreduces many tensors at once through the fusion buffer; returns new tensors/arrays, in order.
    Differentiable, like :func:`allreduce`.

    Tensors are packed into buckets of ``fusion_threshold_bytes`` (HYBRIDPIPE_FUSION_THRESHOLD) and
    each bucket is one ring allreduce, so many small gradients cost a few large messages.

    Args:
        tensors: a list of torch tensors / numpy arrays; every rank passes the same shapes and dtypes
            in the same order (dtypes may be mixed).
        average, name, compression, op, prescale_factor, postscale_factor, process_set, group: as in
            :func:`allreduce`.

    Raises:
        MismatchError: the lists differ between ranks (on every rank).
    """
    with checking("grouped_allreduce", tensors, name, group, process_set, compression) as checked:
        op = resolve_op(op, average, "grouped_allreduce")
        checked.scales(prescale_factor, postscale_factor)
    group, prescale, postscale = checked.group, checked.prescale, checked.postscale
    compression = compressor(compression)
    packed, wire_format = compressed(compression, tensors, op)
    wires = [wire for wire, _ in packed]
    if needs_grad(*wires):
        reduced = list(_GroupedAllreduce.apply(op, name, prescale, postscale, group, wire_format, *wires))
    else:
        reduced = grouped_allreduce_nograd(wires, name=name, op=op, prescale_factor=prescale,
                                           postscale_factor=postscale, group=group, wire=wire_format)
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, packed)]


def grouped_allreduce_(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                       group: Any = None) -> list:
    """In-place :func:`grouped_allreduce`; returns the same tensors."""
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                    "grouped_allreduce_", in_place=True)


def allreduce_nograd(tensor: Any, average: Any = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                     group: Any = None, *, wire: Any = None) -> Any:
    """Reduces ``tensor`` over the ranks of ``group`` and returns the result as a new tensor/array.

    Args:
        tensor: torch.Tensor (any device, contiguous or not) or numpy.ndarray of dtype float32,
            float64, float16, bfloat16, int32 or int64; the same shape and dtype on every rank.
        average: deprecated (Horovod's): True is op=hp.Average, False op=hp.Sum; warns.
        name: optional; every rank must pass the same name (it is checked with the shape).
        op: hp.Average (default, like Horovod), hp.Sum, hp.Min, hp.Max or hp.Product.
        prescale_factor: multiplies the input before the reduction (on a copy).
        postscale_factor: multiplies the result.
        process_set: a hp.ProcessSet (Horovod's spelling of ``group``).
        group: None or "world" (all ranks), "data" (my stage's replicas), "pipe" (my pipeline), a
            hp.ProcessSet, or an mpi4py communicator.
        wire: None, or what a float32 tensor in host memory travels as (a reduction.Wire, which hp.Compression.fp16
            / bf16 make); every rank must pass the same.

    Returns:
        A new tensor (same device) or array with the reduced values.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops, names or wires (on every rank).
        TypeError: not a tensor/array, or a dtype that cannot be reduced.
        ValueError: both ``average`` and ``op``, or both ``group`` and ``process_set``.
        ValueError: op=hp.Adasum over a group whose size is not a power of two.
    """
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group, "allreduce",
                      False, wire)


def _allreduce(tensor: Any, average: Any, name: str | None, op: Any, prescale: Any, postscale: Any, process_set: Any,
               group: Any, function: str, in_place: bool, wire: Any = None) -> Any:
    with refusing(function, "allreduce", group, process_set):
        op = resolve_op(op, average, function)
        check_name(name, function)
        prescale = scale_factor(prescale, "prescale_factor", function)
        postscale = scale_factor(postscale, "postscale_factor", function)
        group = resolve_group(group, process_set, function)
        check_tensors([tensor], group, function)
        group = resolved(group, function)
        buffers.check_reducible([buffers.dtype_code(tensor)], [tensor], function)
    ready = staging.ready_event(tensor)  # a CUDA tensor is read once what this thread queued has written it
    # out of place in host memory: an output the caller let go of, whose pages are mapped already (a fresh one's
    # first touch costs the ring time between its MPI calls)
    outputs = context.current(function).outputs
    reuse = not in_place and prescale == 1.0 and buffers.is_host_contiguous(tensor)
    output = outputs.take(tensor.detach() if buffers.is_tensor(tensor) else tensor) if reuse else None
    try:
        result = context.call(group, function, lambda: allreduce_here(tensor, op, name, prescale, postscale, group,
                                                                    function, in_place, ready, wire, output),
                            "allreduce")
    except context.RanksJoined:
        if op not in CORE_OPS:
            raise
        return allreduce_while_joined([tensor], in_place, op, prescale, postscale, group, function)[0]
    if output is not None and result is output:
        outputs.offer(result)
    return result


def grouped_allreduce_nograd(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                             group: Any = None, *, wire: Any = None) -> list:
    """Allreduces many tensors at once through the fusion buffer; returns new tensors/arrays.

    Tensors are packed into buckets of ``fusion_threshold_bytes`` (HYBRIDPIPE_FUSION_THRESHOLD) and
    each bucket is one ring allreduce, so many small gradients cost a few large messages.

    Args:
        tensors: a list of torch tensors / numpy arrays; every rank passes the same shapes and dtypes
            in the same order (dtypes may be mixed).
        average, name, op, prescale_factor, postscale_factor, process_set, group, wire: as in :func:`allreduce`
            (``wire`` applies to the float32 tensors in host memory).

    Returns:
        A list of new tensors/arrays, in the order given.

    Raises:
        MismatchError: the lists differ between ranks (on every rank).
    """
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                    "grouped_allreduce", in_place=False, wire=wire)


def _grouped(tensors: Sequence[Any], average: Any, name: str | None, op: Any, prescale: Any, postscale: Any,
             process_set: Any, group: Any, function: str, in_place: bool, wire: Any = None) -> list:
    with refusing(function, "grouped_allreduce", group, process_set):
        op = resolve_op(op, average, function)
        check_name(name, function)
        prescale = scale_factor(prescale, "prescale_factor", function)
        postscale = scale_factor(postscale, "postscale_factor", function)
        group = resolve_group(group, process_set, function)
        tensors = check_tensors(tensors, group, function)
        group = resolved(group, function)
        buffers.check_reducible([buffers.dtype_code(t) for t in tensors], tensors, function)
    ready = staging.ready_event(tensors[0]) if tensors else None
    try:
        return context.call(group, function, lambda: grouped_allreduce_here(tensors, op, name, prescale, postscale,
                                                                          group, function, in_place, ready, wire),
                          "grouped_allreduce")
    except context.RanksJoined:
        if op not in CORE_OPS:
            raise
        return allreduce_while_joined(tensors, in_place, op, prescale, postscale, group, function)


def allreduce_async_(tensor: Any, average: Any = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                     group: Any = None, *, wire: Any = None) -> Handle:
    """Queues an in-place allreduce of ``tensor``; ``handle.wait()`` returns ``tensor`` reduced.

    Do not read or write ``tensor`` until the handle is done.

    Args:
        tensor: torch.Tensor or numpy.ndarray (float32/64, float16, bfloat16, int32, int64).
        average: deprecated (Horovod's): True is op=hp.Average, False op=hp.Sum; warns.
        name: identifies the tensor across ranks (default: ``"allreduce_async_.noname.<n>"``, the n-th
            unnamed call of this process — deterministic when every rank makes the same calls).
        op: hp.Average (default), hp.Sum, hp.Min, hp.Max, hp.Product.
        prescale_factor: multiplies the tensor before the reduction.
        postscale_factor: multiplies the result.
        process_set: a hp.ProcessSet (Horovod's spelling of ``group``).
        group: None/"world", "data", "pipe", a hp.ProcessSet or an mpi4py communicator.
        wire: None, or what a float32 tensor in host memory travels as (a reduction.Wire, which
            hp.Compression.fp16 / bf16 make); every rank must pass the same under one name.
    """
    return _submit(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group,
                   "allreduce_async_", in_place=True, wire=wire)


def allreduce_async(tensor: Any, average: Any = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                    group: Any = None, *, wire: Any = None) -> Handle:
    """Like :func:`allreduce_async_` but reduces a copy: ``tensor`` is left as it is."""
    return _submit(tensor, average, name, op, prescale_factor, postscale_factor, process_set, group,
                   "allreduce_async", in_place=False, wire=wire)


def _submit(tensor: Any, average: Any, name: str | None, op: Any, prescale: Any, postscale: Any, process_set: Any,
            group: Any, function: str, in_place: bool, wire: Any = None) -> Handle:
    state = context.current(function)
    with refusing(function, "allreduce", group, process_set, name, asynchronous=True):
        op = resolve_op(op, average, function)
        check_name(name, function)
        prescale = scale_factor(prescale, "prescale_factor", function)
        postscale = scale_factor(postscale, "postscale_factor", function)
        group = resolve_group(group, process_set, function)
        check_tensors([tensor], group, function)
        group = resolved(group, function)
        if op in CORE_OPS:
            buffers.check_reducible([buffers.dtype_code(tensor)], [tensor], function)
    if op not in CORE_OPS:  # Product (MPI library) and Adasum (hybridpipe.comm.adasum): one queued call
        return context.submit(group, function, name, lambda: allreduce_here(tensor, op, name, prescale, postscale,
                                                                            group, function, in_place, None, wire),
                              "allreduce")
    group_id = state.engine_group(group, function)
    if name is None:
        name = unnamed(function)
    source: Any = None  # out of place: the engine reads `source` and writes `work`, a fresh output
    ready: Any = None  # a CUDA tensor's producer (or copy to the host), still running: the engine waits for it
    back: Any = None  # a CUDA tensor reduced in a contiguous copy of itself: copied back into it at the end
    on_device = buffers.device_code(tensor) == 1 and _device_fusion()
    if on_device:
        result, work, source, back, ready = _on_device(tensor, in_place, prescale)
    elif buffers.device_code(tensor) == 1:
        result, work, ready = _stage_down(tensor, in_place, prescale)
    elif not in_place and prescale == 1.0 and buffers.is_host_contiguous(tensor):
        source = tensor.detach() if buffers.is_tensor(tensor) else tensor
        result = work = state.outputs.take(source)
    else:
        result = tensor if in_place else buffers.clone(tensor)
        work = buffers.host(result)
        buffers.scale_(work, prescale)
    code = buffers.dtype_code(work)
    wire_format = core().WireFormat() if wire is None else wire.format()

    submitted: list[Handle] = []

    def finish() -> Any:
        _after_reduction(state, submitted[0], op, postscale, group, function, work)
        if on_device:  # the engine wrote `work` on the GPU and synchronized before it completed the handle
            if back is not None:
                import torch

                back.copy_(work)
                work.record_stream(torch.cuda.current_stream(work.device))  # freed only after that copy
            return result
        if ready is not None:  # back up on the waiting thread's stream; the pinned block stays ours until then
            result.detach().copy_(work, non_blocking=True)
        else:
            buffers.copy_into(result, work)
        if source is not None:
            state.outputs.offer(result)
        return result

    def submit() -> int:
        if source is None:
            return state.engine.submit(group_id, name, buffers.address(work), buffers.count(work), code, int(op),
                                       buffers.device_code(tensor), 0, 0 if ready is None else ready.cuda_event,
                                       wire_format)
        return state.engine.submit(group_id, name, buffers.address(source), buffers.count(work), code, int(op),
                                   buffers.device_code(tensor), buffers.address(work),
                                   0 if ready is None else ready.cuda_event, wire_format)

    submitted.append(context.queue(state, group_id, name, function, submit, (result, work, source, ready), finish))
    return submitted[0]


def _after_reduction(state: Any, handle: Handle, op: Any, postscale: float, group: Any, function: str,
                     work: Any) -> None:
    """A reduced ``work``'s own arithmetic after the engine: the average over the contributing ranks where some
    had joined (the engine summed, zeros from them), then ``postscale``."""
    contributors = handle.contributors
    if contributors and op == Average:
        buffers.divide_(work, contributors if state.config.join_average == "contributors"
                        else state.group_size(group, function))
    buffers.scale_(work, postscale)


class _Checked(NamedTuple):
    """What :class:`PreparedAllreduce` keeps from a call's checks."""

    state: Any       # the job they were made in
    group: Any       # the resolved group, and its engine id
    group_id: int
    dtype: Any       # the tensor's dtype and size
    count: int
    code: int        # the engine's dtype code
    op: Any
    wire_format: Any


def _direct(tensor: Any) -> bool:
    """Whether ``tensor`` is of the kind :class:`PreparedAllreduce` hands to the engine itself: a torch tensor the
    C++ core can read where it is (:func:`buffers.is_host_contiguous`)."""
    return type(tensor) is torch.Tensor and buffers.is_host_contiguous(tensor)


class PreparedAllreduce:
    """``hp.allreduce_async_(tensor, name=name, **options)`` for a tensor handed over again and again under one
    name (a parameter's gradient, every step): the first call takes the whole path (every argument check, a
    refusal stand-in on the other ranks when one fails); the later ones, while they bring a tensor of the same
    kind (torch, host memory, contiguous, the first one's dtype and size) with the same options in the same job,
    go to the engine at once with the checks' answers kept. Product and Adasum, tensors on a GPU and anything
    else take the whole path every time. The engine sees the same submission either way."""

    __slots__ = ("name", "_options", "_checked")

    def __init__(self, name: str) -> None:
        self.name = name
        self._options: dict[str, Any] = {}
        self._checked: _Checked | None = None

    def __call__(self, tensor: Any, op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                 group: Any = None, wire: Any = None) -> Handle:
        options = dict(op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor, group=group,
                       wire=wire)
        kept = self._checked
        if (self.checked and options == self._options and _direct(tensor) and tensor.dtype is kept.dtype
                and tensor.numel() == kept.count):
            return self._submit(tensor, kept, prescale_factor, postscale_factor)
        handle = allreduce_async_(tensor, name=self.name, **options)
        self._options, self._checked = options, self._kind(tensor, options)
        return handle

    def repeat(self, tensor: Any) -> Handle | None:
        """The last call again, with its options, for ``tensor`` (a caller that always passes the same options: a
        gradient's hook): its handle when the call's checks' answers hold for it (the same kind of tensor in the
        same job), else None, and the caller makes the whole call. A few attribute tests, no option comparison:
        the hand-off of each gradient of every step."""
        kept = self._checked
        if (kept is None or kept.state is not context.current_or_none() or type(tensor) is not torch.Tensor
                or tensor.layout is not torch.strided or not tensor.is_cpu or tensor.dtype is not kept.dtype
                or tensor.numel() != kept.count or not tensor.is_contiguous() or tensor.is_conj()
                or tensor.is_neg()):
            return None
        options = self._options
        return self._submit(tensor, kept, options["prescale_factor"], options["postscale_factor"])

    @property
    def checked(self) -> bool:
        """Whether a call like the last one (a tensor of its kind, its options, this job) goes to the engine at once."""
        return self._checked is not None and self._checked.state is context.current_or_none()

    def _kind(self, tensor: Any, options: dict[str, Any]) -> _Checked | None:
        """What the next calls may keep from this one's checks (None: they take the whole path too)."""
        op = resolve_op(options["op"], None, "allreduce_async_")
        if not _direct(tensor) or op not in CORE_OPS:
            return None
        state = context.current("allreduce_async_")
        group = resolved(options["group"], "allreduce_async_")
        wire = options["wire"]
        return _Checked(state, group, state.engine_group(group, "allreduce_async_"), tensor.dtype, tensor.numel(),
                        buffers.dtype_code(tensor), op, core().WireFormat() if wire is None else wire.format())

    def _submit(self, tensor: Any, kept: _Checked, prescale: float, postscale: float) -> Handle:
        work = tensor.detach()
        buffers.scale_(work, prescale)
        submitted: list[Handle] = []

        def finish() -> Any:
            _after_reduction(kept.state, submitted[0], kept.op, postscale, kept.group, "allreduce_async_", work)
            return tensor

        def submit() -> int:
            return kept.state.engine.submit(kept.group_id, self.name, work.data_ptr(), kept.count, kept.code,
                                            int(kept.op), 0, 0, 0, kept.wire_format)

        submitted.append(context.queue(kept.state, kept.group_id, self.name, "allreduce_async_", submit,
                                       (tensor, work, None, None), finish))
        return submitted[0]


def _device_fusion() -> bool:
    """Whether the engine packs CUDA tensors on the GPU: the extension was built with its CUDA kernels
    (csrc/cuda/fusion.cu). Without them each CUDA tensor is copied to pinned host memory on its own."""
    from .. import _ext

    return bool(_ext.cuda_compiled())


def _on_device(tensor: Any, in_place: bool, prescale: float) -> tuple[Any, Any, Any, Any, Any]:
    """A CUDA tensor's engine allreduce where the engine packs on the GPU: ``(result, work, source, back,
    ready)``. The engine reads ``source`` (None: ``work``) and writes ``work``, device memory both; the bucket
    it joins is gathered into one fusion buffer by one kernel, reduced through pinned host memory and scattered
    back by one kernel (csrc/cuda/fusion.cu), with no copy of its own per tensor. ``ready`` is an event recorded
    on the caller's stream after the work queued so far (and the prescaling): the engine announces the tensor
    once it has completed. ``back``: the caller's tensor when it is reduced in place through a contiguous copy
    (non-contiguous, or prescaled), which finish() copies back."""
    import torch

    from ..comm import device

    device.note_staged(tensor)
    value = tensor.detach()
    source = back = None
    if prescale != 1.0 or not value.is_contiguous():
        work = value.clone(memory_format=torch.contiguous_format)  # never scale the caller's input
        buffers.scale_(work, prescale)
        if in_place:
            back = value
        result = tensor if in_place else work
    elif in_place:
        result, work = tensor, value  # the caller's own tensor object back, as on every other route
    else:
        source, work = value, torch.empty_like(value)
        result = work
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensor.device))
    return result, work, source, back, ready


def _stage_down(tensor: Any, in_place: bool, prescale: float) -> tuple[Any, Any, Any]:
    """A CUDA tensor's engine allreduce: ``(result, work, ready)``. ``work`` is pinned host memory that a copy on
    the device's side stream fills after the work queued so far on the caller's stream (prescaled there);
    ``ready`` is the event recorded after that copy, which the engine polls before announcing the tensor, so
    that neither this thread nor the engine's waits for the copy (Horovod's ready events). The result goes back
    up on the stream of the thread that waits for the handle."""
    import torch

    from ..comm import device

    device.note_staged(tensor)
    caller = torch.cuda.current_stream(tensor.device)
    value = tensor.detach()
    result = tensor if in_place else torch.empty_like(value)
    if prescale != 1.0:
        value = value.clone()
        buffers.scale_(value, prescale)
    work = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    down, _ = staging.copy_streams(tensor.device)
    with torch.cuda.stream(down):
        down.wait_stream(caller)
        work.copy_(value, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(down)
    value.record_stream(down)  # the caching allocator keeps its memory until the copy has read it
    return result, work, ready


def grouped_allreduce_async(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                            group: Any = None, *, wire: Any = None) -> Handle:
    """Queues :func:`~hybridpipe.grouped_allreduce` (fused, as one collective); ``handle.wait()`` returns
    the list of new tensors. Ranks match it by ``name`` and must pass the same list (and ``wire``, as in
    :func:`allreduce_async_`)."""
    return _grouped_submit(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                           "grouped_allreduce_async", in_place=False, wire=wire)


def grouped_allreduce_async_(tensors: Sequence[Any], average: Any = None, name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None,
                             group: Any = None, *, wire: Any = None) -> Handle:
    """In-place :func:`grouped_allreduce_async`: ``handle.wait()`` returns the same tensors, reduced."""
    return _grouped_submit(tensors, average, name, op, prescale_factor, postscale_factor, process_set, group,
                           "grouped_allreduce_async_", in_place=True, wire=wire)


def _grouped_submit(tensors: Sequence[Any], average: Any, name: str | None, op: Any, prescale: Any, postscale: Any,
                    process_set: Any, group: Any, function: str, in_place: bool, wire: Any = None) -> Handle:
    with refusing(function, "grouped_allreduce", group, process_set, name, asynchronous=True):
        op = resolve_op(op, average, function)
        check_name(name, function)
        prescale = scale_factor(prescale, "prescale_factor", function)
        postscale = scale_factor(postscale, "postscale_factor", function)
        group = resolve_group(group, process_set, function)
        tensors = check_tensors(tensors, group, function)
        group = resolved(group, function)
    ready = staging.ready_event(tensors[0]) if tensors else None
    return context.submit(group, function, name, lambda: grouped_allreduce_here(
        tensors, op, name, prescale, postscale, group, function, in_place, ready, wire), "grouped_allreduce")


def allreduce_while_joined(tensors: list, in_place: bool, op: Any, prescale: float, postscale: float,
                           group: Any, function: str) -> list:
    """A synchronous allreduce that met ranks in hp.join: run on the engine, where they contribute zeros.
    Every rank that did not join gets here at the same point, so a per-group counter names it alike."""
    state = context.current(function)
    group_id = state.engine_group(group, function)
    index = state.joined_calls.get(group_id, 0)
    state.joined_calls[group_id] = index + 1
    submit = allreduce_async_ if in_place else allreduce_async
    handles = [submit(t, name=f"hybridpipe.joined.{index}.{i}", op=op, prescale_factor=prescale,
                      postscale_factor=postscale, group=group) for i, t in enumerate(tensors)]
    return [handle.wait() for handle in handles]

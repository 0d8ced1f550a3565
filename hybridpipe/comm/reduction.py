"""The reductions as they run on the communication thread, and the rules every allreduce path shares: the ops
(:class:`ReduceOp`), the argument checks, the header agreement, the library / ring / CUDA allreduces and the
engine's device allreduce. The API over them is the hybridpipe.collectives package (blocking, asynchronous and
differentiable forms, one module per collective family); it imports this module, which imports none of it.

Before moving data, the ranks of a collective agree on a small header (count, dtype, op, shape and
name digest) with one tiny MPI_Allreduce (max of the values and of their negatives). A disagreement —
different shapes, dtypes, ops, names, tensor lists, or a rank passing something unsupported — raises
MismatchError on every rank with every rank's values, instead of a hang or a truncation. The data
then moves through the C++ core (allreduce with Sum, Average, Min, Max) or through the MPI library
(Product).
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
import warnings
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from .._ext import core
from ..errors import BuildError, HorovodInternalError, MismatchError, NotSupportedError
from . import buffers, context, device, staging
from .buffers import check_array, copy_into, describe, host, is_tensor

__all__ = ["ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum", "CORE_OPS", "agree", "digest", "named",
           "list_ranks", "wait_policy", "reduce_op", "resolve_op", "scale_factor", "check_tensors", "device_buffer",
           "engine_device_allreduce", "allreduce_here", "grouped_allreduce_here", "from_address", "reduce_on_device",
           "Wire", "options_for", "wire_fields"]


class ReduceOp(enum.IntEnum):
    """Reduction of an allreduce. Average divides the sum by the group size (integers: truncating).

    Sum, Average, Min and Max run in hybridpipe's C++ core (ring, shared memory, hierarchical); Product
    runs in the MPI library (``MPI_PROD``; float16 / bfloat16 multiplied in float32 and rounded once).
    Adasum is Horovod's adaptive summation (hybridpipe.comm.adasum; CPU, power-of-two groups), run on
    the communication thread outside the C++ core.
    """

    Sum = 0
    Average = 1
    Min = 2
    Max = 3
    Product = 4
    Adasum = 5


Sum, Average, Min, Max, Product, Adasum = (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max,
                                           ReduceOp.Product, ReduceOp.Adasum)
CORE_OPS = (Sum, Average, Min, Max)  # what the C++ core and the engine reduce with

_SAME_TENSOR = "every rank must pass the same shape, dtype and op"


@dataclass(frozen=True)
class Wire:
    """What float32 buffers in host memory travel as between ranks in the C++ ring (hp.Compression.fp16 / bf16
    make one): float16 or bfloat16 (``dtype_code``, as buffers.dtype_code), each segment rounded right before it is
    sent and accumulated in float32 where it arrives. A group whose ranks share one host reduces float32 as it is
    (shared memory), unless ``on_one_host``: then the ring with the wire dtype there too. Other dtypes and
    buffers at or below small_message_bytes (the MPI library) travel as they are."""

    dtype_code: int
    on_one_host: bool = False

    def fields(self) -> list[int]:
        """Its header fields (wire_fields)."""
        return [self.dtype_code, int(self.on_one_host)]

    def format(self) -> Any:
        """The C++ core's WireFormat."""
        return core().WireFormat(self.dtype_code, self.on_one_host)

    def __str__(self) -> str:
        dtype = {2: "float16", 3: "bfloat16"}.get(self.dtype_code, str(self.dtype_code))
        return f" wire={dtype}" + (" (on one host too)" if self.on_one_host else "")


def options_for(ctx: Any, wire: Wire | None) -> Any:
    """The AllreduceOptions of a direct collective now (``ctx.allreduce_options()``), carrying ``wire`` if any."""
    base = ctx.allreduce_options()
    if wire is None:
        return base
    options = context.allreduce_options_for(ctx.config, base.wait)
    options.wire = wire.format()
    return options


def wire_fields(wire: Wire | None) -> list[int]:
    """The header fields of a wire format (the ranks of a collective must agree on it)."""
    return [-1, 0] if wire is None else wire.fields()


def wait_policy(config: Any = None) -> Any:
    """The polite wait of ``config`` (default: the one in force; ``HYBRIDPIPE_WAIT_SPIN_US`` /
    ``HYBRIDPIPE_WAIT_SLEEP_US``) for the background engine and direct collectives while tensors are
    in flight on the engine."""
    return context.wait_policy(context.current("wait_policy").config if config is None else config)


def digest(text: str) -> int:
    """A 31-bit digest of ``text`` for a header field (names, shape and dtype descriptions)."""
    return zlib.crc32(text.encode())


def list_ranks(descriptions: list) -> str:
    """``rank 0: …; rank 1: …`` for a mismatch message."""
    return "; ".join(f"rank {r}: {d}" for r, d in enumerate(descriptions))


def named(name: str | None) -> str:
    """`` name='...'`` for a description, or nothing when there is no name."""
    return "" if name is None else f" name={name!r}"


def agree(comm: Any, function: str, fields: Sequence[int], description: Callable[[], Any], fix: str,
          explain: Callable[[list], str] = list_ranks) -> None:
    """Raises MismatchError on every rank unless all ranks of ``comm`` passed the same ``fields``.

    The common case costs one MPI_Allreduce of 2·len(fields) integers (in C++); only on a mismatch
    are the ranks' ``description()`` values gathered and turned into a message by ``explain``.
    """
    if not core().headers_agree(comm.py2f(), list(fields), context.current(function).allreduce_options().wait):
        _mismatch(comm, function, description, fix, explain)


def _mismatch(comm: Any, function: str, description: Callable[[], Any], fix: str,
              explain: Callable[[list], str] = list_ranks) -> None:
    raise MismatchError(f"hp.{function}: ranks disagree ({explain(comm.allgather(description()))}); {fix}")


def reduce_op(op: Any, function: str) -> ReduceOp:
    """``op`` as a ReduceOp; TypeError naming it otherwise."""
    try:
        return ReduceOp(op)
    except ValueError:
        raise TypeError(f"hp.{function}: op must be hp.Sum, hp.Average, hp.Min or hp.Max, got {op!r} (or hp.Product; "
                        "see hp.ReduceOp)") from None


def _caller_level() -> int:
    """The warnings stacklevel of the first frame outside hybridpipe (the user's call), so that Python's
    default filters show a DeprecationWarning raised for code in ``__main__``."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("hybridpipe"):
        frame, level = frame.f_back, level + 1
    return level


def resolve_op(op: Any, average: Any, function: str) -> ReduceOp:
    """The op of a call from Horovod's ``op=`` and deprecated ``average=`` (None/None: Average).

    A ReduceOp in ``average``'s place is taken as ``op``: hybridpipe's earlier signature had ``op`` second.
    """
    if isinstance(average, ReduceOp) and op is None:
        return average
    if average is not None:
        if op is not None:
            raise ValueError(f"hp.{function}: op= supersedes the deprecated average=; pass only one of them "
                             f"(got average={average!r}, op={op!r})")
        warnings.warn(f"hp.{function}: average= is deprecated (as in Horovod); pass op=hp.Average or op=hp.Sum",
                      DeprecationWarning, stacklevel=_caller_level())
        return Average if average else Sum
    return Average if op is None else reduce_op(op, function)


def scale_factor(value: Any, keyword: str, function: str) -> float:
    """``prescale_factor`` / ``postscale_factor`` as a float; TypeError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"hp.{function}: {keyword} must be a number, got {value!r}")
    return float(value)


def check_tensors(tensors: Any, group: Any, function: str) -> list:
    """The rank-local checks of a collective's tensors and group (run inside :func:`context.refusing`):
    each is a torch tensor or numpy array, and this rank can use ``group``; returns the tensors as a list."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"hp.{function} takes a list or tuple of tensors, got {type(tensors).__name__}")
    for t in tensors:
        check_array(t, function)
    context.current(function).check_group(group, function)
    return list(tensors)


def _unsupported_op(op: ReduceOp, function: str) -> NotSupportedError:
    return NotSupportedError(f"hp.{function}: op=hp.{op.name} cannot be reduced here; use op=hp.Average, hp.Sum, "
                             "hp.Min, hp.Max, hp.Product or hp.Adasum")


def _library_reduce(source: Any, target: Any, op: ReduceOp, comm: Any, function: str) -> None:
    """Reduces through the MPI library (ops the C++ core has not: Product); halves in float32."""
    from mpi4py import MPI

    if op == Adasum:
        from .adasum import adasum_into

        adasum_into(source, target, comm, function)
        return
    if op != Product:
        raise _unsupported_op(op, function)
    if buffers.dtype_code(source) in (2, 3):  # float16, bfloat16: no MPI type; one rounding at the end
        wide = source.float() if is_tensor(source) else source.astype(np.float32)
        comm.Allreduce(MPI.IN_PLACE, buffers.numpy_view(wide), op=MPI.PROD)
        copy_into(target, wide.to(target.dtype) if is_tensor(wide) else wide.astype(target.dtype))
    elif source is target:
        comm.Allreduce(MPI.IN_PLACE, buffers.numpy_view(target), op=MPI.PROD)
    else:
        comm.Allreduce(buffers.numpy_view(source), buffers.numpy_view(target), op=MPI.PROD)


def _allreduce_into(source: Any, target: Any, op: ReduceOp, comm: Any, function: str, name: str | None = None,
                    device: str = "", wire: Wire | None = None) -> None:
    code = buffers.dtype_code(source)
    count = buffers.count(source)
    header = [1, count, code, int(op),
              digest(str(tuple(source.shape)) + device + ("" if name is None else f"|{name}")), *wire_fields(wire)]

    def description() -> str:
        return f"{describe(source)}{device} op={op.name}{named(name)}{wire or ''}"

    if code == buffers.UNSUPPORTED or op not in CORE_OPS:  # agree first: a bad value on one rank must not hang
        agree(comm, function, header, description, _SAME_TENSOR)
        buffers.check_reducible([code], [source], function)
        _library_reduce(source, target, op, comm, function)
        return
    ctx = context.current(function)
    if not core().allreduce(buffers.address(source), buffers.address(target), count, code, int(op), comm.py2f(),
                            options_for(ctx, wire), header):
        _mismatch(comm, function, description, _SAME_TENSOR)


def device_buffer(tensor: Any) -> list:
    """A contiguous CUDA tensor as an mpi4py buffer specification (bytes) on its device memory, for a CUDA-aware
    MPI."""
    from mpi4py import MPI

    return [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.numel() * tensor.element_size()), MPI.BYTE]


def _library_device_allreduce(source: Any, target: Any, op: ReduceOp, comm: Any) -> None:
    """MPI_Allreduce of device memory (small CUDA buffers on the cuda-aware route); Average divides on the GPU."""
    from mpi4py import MPI

    datatype = getattr(MPI, device.MPI_DEVICE_TYPES[buffers.dtype_code(source)])
    mpi_op = {Sum: MPI.SUM, Average: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX}[op]
    receive = [device_buffer(target)[0], datatype]
    if source is target:
        comm.Allreduce(MPI.IN_PLACE, receive, op=mpi_op)
    else:
        comm.Allreduce([device_buffer(source)[0], datatype], receive, op=mpi_op)
    if op == Average:
        target.div_(comm.Get_size())


_RING_TAGS = (7101, 7102)  # the device ring's reduce-scatter and allgather (the C++ ring uses 7001, 7002)


def _device_ring_allreduce(buffer: Any, op: ReduceOp, comm: Any, segment_bytes: int) -> None:
    """Ring allreduce of a contiguous CUDA tensor, in place, over a CUDA-aware MPI: the chunks travel as device
    memory (MPI_Isend / MPI_Irecv between GPUs: CUDA IPC between ranks of one host), and each reduce-scatter step is
    reduced on the GPU by the extension's kernel (:func:`reduce_on_device`; float16 / bfloat16 added in float32).
    The chunks go in segments of ``segment_bytes`` (HYBRIDPIPE_DEVICE_RING_SEGMENT_BYTES), so that a segment is
    reduced while the next one arrives and leaves for the next step once it is reduced (hybridpipe.comm.ring: the
    order, tested on CPU tensors in tests/comm/test_ring.py). Each segment is an MPI message of its own, about
    25 µs of CUDA IPC on an H100 (docs/gpu.md), hence segments far larger than staging's.

    Not MPI_Allreduce on device memory above 1 MiB: Open MPI reduces that on the host through its own staging
    (64 MiB on an H100 shared by 2 ranks: 94 ms, against 16 ms staged here and 2.8 ms by this ring, unsegmented;
    docs/gpu.md).
    """
    import torch

    from . import ring

    size, rank = comm.Get_size(), comm.Get_rank()
    flat = buffer.reshape(-1)
    if size > 1:
        longest = max(length for _, length in ring.chunk_bounds(flat.numel(), size))
        scratch = torch.empty(2 * longest, dtype=flat.dtype, device=flat.device)
        stream = torch.cuda.current_stream(flat.device)

        def reduce(target: Any, source: Any) -> Any:  # on the stream; its event is waited before MPI reads target
            reduce_on_device(target, source, op)
            done = torch.cuda.Event()
            done.record(stream)
            return done

        ring.ring_allreduce(flat, (scratch[:longest], scratch[longest:]), rank, size,
                            max(1, segment_bytes // flat.element_size()),
                            isend=lambda view, dest, tag: comm.Isend(device_buffer(view), dest, tag),
                            irecv=lambda view, source, tag: comm.Irecv(device_buffer(view), source, tag),
                            wait=lambda request: request.Wait(), reduce=reduce, reduced=lambda done: done.synchronize(),
                            tags=_RING_TAGS)
    if op == Average:
        flat.div_(size)


def engine_device_allreduce(comm: Any) -> Callable[[int, int, int, int, int], bool]:
    """The engine's device allreduce for its group over ``comm`` (``Engine.set_device_allreduce``): a bucket of
    CUDA tensors that the engine gathered into device memory (csrc/cuda/fusion.cu) is reduced there, in place,
    on the communication thread, as a grouped CUDA allreduce is on the cuda-aware route: MPI_Allreduce of the
    device memory below 1 MiB, the device ring above (hybridpipe.comm.device.CUDA_ALLREDUCE). It answers False
    where those do not apply (the staged route, an integer Average): the engine stages that bucket through
    pinned host memory. Not NCCL: its communicator is made by a collective the engine's cycle cannot wait for."""

    def reduce(address: int, count: int, code: int, op_code: int, gpu: int) -> bool:
        import torch

        if not device.cuda_aware():
            return False
        op = ReduceOp(op_code)
        algorithm = device.cuda_allreduce_algorithm("cuda-aware", count * core().dtype_size(code), code, op_code)
        if algorithm not in ("mpi-library", "device-ring"):
            return False
        with torch.cuda.device(gpu):
            buffer = from_address(address, count, code, gpu)
            if buffer.data_ptr() != address:  # a copy would be reduced and the bucket left as it was: never silently
                raise HorovodInternalError(
                    f"the engine's device allreduce got a copy of its fusion buffer ({address:#x} became "
                    f"{buffer.data_ptr():#x}); set HYBRIDPIPE_CUDA_AWARE_MPI=0 to stage it")
            if algorithm == "mpi-library":
                _library_device_allreduce(buffer, buffer, op, comm)
            else:
                segment = context.current("allreduce_async").config.device_ring_segment_bytes
                _device_ring_allreduce(buffer, op, comm, segment)
            torch.cuda.current_stream(buffer.device).synchronize()  # the engine scatters it on a stream of its own
        return True

    return reduce


def _reduce_cuda_buffer(packed: Any, output: Any, op: ReduceOp, comm: Any, ctx: Any, stream: Any,
                        nccl_comm: Any) -> None:
    """Reduces one packed CUDA buffer into ``output`` by the algorithm hybridpipe.comm.device picks for it (see
    :func:`_cuda_allreduce`)."""
    import torch

    code = buffers.dtype_code(packed)

    def transfer(_: int, segment: Any) -> None:
        core().allreduce(segment.data_ptr(), segment.data_ptr(), segment.numel(), code, int(op), comm.py2f(),
                         ctx.allreduce_options())

    mark = torch.cuda.Event()  # after the packing and scaling, on this thread's stream
    mark.record(stream)
    nccl_type = getattr(device.nccl_module(), device.NCCL_TYPES.get(code, ""), None) if nccl_comm else None
    algorithm = device.cuda_allreduce_algorithm(device.route(packed), packed.numel() * packed.element_size(),
                                                code, int(op), nccl_type is not None)
    if algorithm == "nccl":
        nccl = device.nccl_module()
        nccl_comm.allReduce(packed.data_ptr(), output.data_ptr(), packed.numel(), nccl_type,
                            {Sum: nccl.NCCL_SUM, Average: nccl.NCCL_SUM, Min: nccl.NCCL_MIN,
                             Max: nccl.NCCL_MAX}[op], stream.cuda_stream)
        if op == Average:
            output.div_(comm.Get_size())
    elif algorithm == "mpi-library":
        stream.synchronize()  # MPI knows no streams: the buffer must be written before it reads it
        _library_device_allreduce(packed, output, op, comm)
    elif algorithm == "device-ring":
        if output is not packed:
            output.copy_(packed)
        stream.synchronize()
        _device_ring_allreduce(output, op, comm, ctx.config.device_ring_segment_bytes)
    else:
        staging.run(packed, output, transfer, ready=mark, segment_bytes=ctx.config.staging_segment_bytes)


def _cuda_allreduce(tensors: Sequence[Any], op: ReduceOp, name: str | None, prescale: float, postscale: float,
                      comm: Any, function: str, in_place: bool, ready: Any, agreed: bool = False) -> list:
    """Allreduce of CUDA tensors (the routes of hybridpipe.comm.device), in the order of the list.

    The tensors of one dtype are packed into one device buffer by one kernel (``torch.cat``), reduced, and
    unpacked by one kernel (``torch._foreach_copy_``): a bucket of many small gradients costs two copy
    kernels, not a copy per tensor. A lone contiguous tensor is its own buffer. The buffer is then reduced by
    the algorithm hybridpipe.comm.device.CUDA_ALLREDUCE picks: NCCL where the group agreed to use it (on the
    stream the packing ran on); on the cuda-aware route MPI_Allreduce of device memory (small buffers) or a ring
    of device-memory transfers and GPU reductions (_device_ring_allreduce); otherwise through pinned host memory
    segment by segment, the copies overlapping the reduction (hybridpipe.comm.staging). ``agreed``: the
    ranks already agreed on the list (grouped calls); else they agree on the one tensor here, before any data
    moves, so that a rank with a different count never waits for a segment the others do not send.
    """
    import torch

    ctx = context.current(function)
    stream = torch.cuda.current_stream(tensors[0].device)
    if ready is not None:
        stream.wait_event(ready)  # the packing and scaling below run after the tensors' producer
    if not agreed:
        t = tensors[0]
        header = [1, buffers.count(t), buffers.dtype_code(t), int(op),
                  digest(str(tuple(t.shape)) + buffers.device_tag(t) + ("" if name is None else f"|{name}"))]
        agree(comm, function, header, lambda: f"{describe(t)} op={op.name}{named(name)}", _SAME_TENSOR)
    nccl_comm = None
    if ctx.config.gpu_allreduce != "mpi":  # collective the first time on this group: every rank is here
        gpu = tensors[0].device.index if tensors[0].device.index is not None else torch.cuda.current_device()
        nccl_comm = device.nccl_communicator(comm, gpu, ctx.config.gpu_allreduce, ctx.nccl_groups)
    results: list[Any] = [None] * len(tensors)
    by_dtype: dict[Any, list[int]] = {}
    for index, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(index)
    for indices in by_dtype.values():
        members = [tensors[i].detach().resolve_conj().resolve_neg() for i in indices]
        lone = len(members) == 1 and members[0].is_contiguous()
        if not lone:
            packed = output = torch.cat([m.reshape(-1) for m in members])  # one kernel; the copy is ours
        elif in_place:
            packed = output = members[0]  # the caller's memory holds the result afterwards
        else:
            packed, output = members[0], torch.empty_like(members[0])
            if prescale != 1.0:
                packed = output  # scale a copy, never the caller's input
                output.copy_(members[0])
        buffers.scale_(packed, prescale)
        _reduce_cuda_buffer(packed, output, op, comm, ctx, stream, nccl_comm)
        if postscale != 1.0:
            buffers.scale_(output, postscale)
        if lone:
            if in_place:
                results[indices[0]] = tensors[indices[0]]
            else:
                results[indices[0]] = output.view(tensors[indices[0]].shape)
            continue
        pieces = [piece.view(m.shape) for piece, m in zip(output.split([m.numel() for m in members]), members)]
        targets = [tensors[i].detach() for i in indices] if in_place else [torch.empty_like(m) for m in members]
        torch._foreach_copy_(targets, pieces)
        for i, target in zip(indices, targets):
            results[i] = tensors[i] if in_place else target  # in place: the caller's own tensor objects
    stream.synchronize()  # the caller may be another thread on another stream: the results are final on return
    return results


def allreduce_here(tensor: Any, op: ReduceOp, name: str | None, prescale: float, postscale: float, group: Any,
                   function: str, in_place: bool, ready: Any = None, wire: Wire | None = None, output: Any = None) -> Any:
    """One allreduce, run on the communication thread: the body of allreduce / allreduce_ and of the
    asynchronous ones the engine cannot run itself (Product). ``ready``: for a CUDA tensor, the event its
    producer's stream recorded when the call was made (staging.ready_event). ``wire``: what a float32 buffer in
    host memory travels as (:class:`Wire`). ``output``: out of place, where the result goes (a host tensor / array
    like ``tensor``; default: a new one)."""
    check_array(tensor, function)
    comm = context.communicator(group, function)
    if op in CORE_OPS and device.route(tensor) != "host" and buffers.dtype_code(tensor) != buffers.UNSUPPORTED:
        return _cuda_allreduce([tensor], op, name, prescale, postscale, comm, function, in_place, ready)[0]
    source = host(tensor)
    if in_place:
        target = source
    elif prescale == 1.0 and buffers.is_host_contiguous(source):
        target = buffers.empty_like(source) if output is None else output  # the core reads the source: no copy
    else:
        target = buffers.clone(source)
    if prescale != 1.0:
        source = target  # scale a copy (or the in-place work), never the caller's input
        buffers.scale_(target, prescale)
    _allreduce_into(source, target, op, comm, function, name, buffers.device_tag(tensor), wire)
    buffers.scale_(target, postscale)
    if in_place:
        copy_into(tensor, target)
        return tensor
    return target.to(tensor.device) if is_tensor(tensor) and tensor.device.type != "cpu" else target


def grouped_allreduce_here(tensors: Sequence[Any], op: ReduceOp, name: str | None, prescale: float, postscale: float,
                           group: Any, function: str, in_place: bool, ready: Any = None, wire: Wire | None = None) -> list:
    """A grouped allreduce, run on the communication thread (sync and async forms). ``ready``: for CUDA
    tensors, the event the caller's stream recorded when the call was made (staging.ready_event). ``wire``: what
    its float32 buffers in host memory travel as (:class:`Wire`)."""
    tensors = list(tensors)
    for t in tensors:
        check_array(t, function)
    ctx = context.current(function)
    comm = ctx.communicator(group, function)
    staged = bool(tensors) and op in CORE_OPS and all(device.route(t) != "host" for t in tensors) \
        and len({t.device for t in tensors}) == 1
    works = tensors if staged else [host(t) for t in tensors]
    targets = works if in_place or staged else [buffers.clone(w) for w in works]
    if prescale != 1.0 and not staged:
        works = targets
        for target in targets:
            buffers.scale_(target, prescale)
    codes = [buffers.dtype_code(w) for w in works]
    entries = [describe(t) for t in tensors]
    agree(comm, function, [2, len(tensors), digest("|".join(entries) + named(name)), int(op), *wire_fields(wire)],
           lambda: (op.name + named(name) + str(wire or ""), entries),
           "every rank must pass the same list of tensors (same order, shapes and dtypes), op, name and compression",
           _explain_lists)
    buffers.check_reducible(codes, works, function)
    if staged:  # packed on the device, one buffer per dtype (see _cuda_allreduce)
        return _cuda_allreduce(tensors, op, name, prescale, postscale, comm, function, in_place, ready, agreed=True)
    if op in CORE_OPS:
        order = sorted(range(len(works)), key=lambda i: codes[i])  # stable: one dtype's buckets in list order
        counts = [buffers.count(works[i]) for i in order]
        core().grouped_allreduce([buffers.address(works[i]) for i in order],
                                 [buffers.address(targets[i]) for i in order], counts, [codes[i] for i in order],
                                 int(op), comm.py2f(), ctx.config.fusion_threshold_bytes, options_for(ctx, wire))
    else:
        for work, target in zip(works, targets):
            _library_reduce(work, target, op, comm, function)
    results = []
    for original, target in zip(tensors, targets):
        buffers.scale_(target, postscale)
        if in_place:
            copy_into(original, target)
            results.append(original)
        elif is_tensor(original) and original.device.type != "cpu":
            results.append(target.to(original.device))
        else:
            results.append(target)
    return results


def _explain_lists(everyone: list) -> str:
    """Names the op or the first list position where ranks' (op, [tensor descriptions]) differ."""
    ops = [op for op, _ in everyone]
    if len(set(ops)) > 1:
        return list_ranks([f"op={op}" for op in ops])
    lengths = [len(entries) for _, entries in everyone]
    for index in range(max(lengths)):
        at = [entries[index] if index < len(entries) else "(no tensor)" for _, entries in everyone]
        if len(set(at)) > 1:
            return f"tensor {index}: " + list_ranks(at) + " | list lengths: " + list_ranks(lengths)
    return list_ranks(lengths)


class _DeviceMemory:
    """``count`` elements of ``itemsize`` bytes at device address ``address``, as the CUDA array interface tells
    them to torch (a signed integer type of that size: the interface has no bfloat16)."""

    def __init__(self, address: int, count: int, itemsize: int) -> None:
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": f"<i{itemsize}", "data": (address, False),
                                         "version": 3, "strides": None}


def from_address(address: int, count: int, code: int, gpu: int) -> Any:
    """A 1-D torch tensor over ``count`` elements of dtype code ``code`` (hybridpipe.comm.buffers) at device
    address ``address`` on GPU ``gpu``: a view, no copy; the memory stays its owner's (the engine's device fusion
    buffer, for its device allreduce)."""
    import torch

    dtype = next(key for key, value in buffers.torch_codes().items() if value == code)
    memory = torch.as_tensor(_DeviceMemory(address, count, dtype.itemsize), device=torch.device("cuda", gpu))
    return memory.view(dtype)


def reduce_on_device(accumulator: Any, incoming: Any, op: Any) -> Any:
    """``accumulator = op(accumulator, incoming)`` by the extension's CUDA kernel, on the current stream
    (the CUDA-aware ring's reduction step; float16 / bfloat16 are added in float32). ``hp.Average`` adds,
    like the ring's reduction steps do; the division comes once at the end.

    Raises:
        BuildError: the extension was built without its CUDA kernels (no nvcc at build time).
        TypeError: tensors not both contiguous CUDA tensors of one shape and a reducible dtype.
    """
    import torch

    extension = core()
    if not hasattr(extension, "cuda_reduce_into"):
        raise BuildError("hybridpipe was built without its CUDA kernels (no nvcc at build time): rebuild with "
                         "nvcc on PATH or CUDA_HOME set (HYBRIDPIPE_WITH_CUDA=1 makes a missing nvcc an error)")
    for x in (accumulator, incoming):
        if not (isinstance(x, torch.Tensor) and x.is_cuda and x.is_contiguous()):
            raise TypeError(f"reduce_on_device takes contiguous CUDA tensors, got {buffers.describe(x)}")
    if accumulator.shape != incoming.shape or accumulator.dtype != incoming.dtype:
        raise TypeError(f"reduce_on_device: {buffers.describe(accumulator)} and {buffers.describe(incoming)} differ")
    code = buffers.dtype_code(accumulator)
    buffers.check_reducible([code], [accumulator], "reduce_on_device")
    if int(op) > 3:
        raise TypeError(f"reduce_on_device: op {op!r} is not Sum, Average, Min or Max")
    with torch.cuda.device(accumulator.device):
        extension.cuda_reduce_into(accumulator.data_ptr(), incoming.data_ptr(), accumulator.numel(), code,
                                   int(op), torch.cuda.current_stream().cuda_stream)
    return accumulator

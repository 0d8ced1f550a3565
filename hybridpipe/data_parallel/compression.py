"""Horovod's gradient compressors: the wire format of what the data-parallel reductions send."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.buffers import torch_codes
from ..comm.reduction import CORE_OPS, Wire

__all__ = ["Compression", "ForcedCompression", "wire_for"]


class Compression(enum.Enum):
    """Wire format of gradients: ``none`` (their dtype), ``fp16`` or ``bf16`` (halves the bytes).

    A float32 tensor in host memory reduced with Sum, Average, Min or Max stays float32: the ring converts
    each segment to the wire dtype right before it sends it and accumulates what arrives in float32
    (docs/compression.md). Between the ranks of one host (shared memory) nothing is converted: halving bytes
    that never cross a network only costs the conversions; ``Compression.fp16.forced`` converts there too.
    Other tensors (CUDA, float64, bfloat16 with fp16, other ops) and custom compressors go through
    ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)`` as in Horovod: floating-point
    tensors (and numpy arrays, for fp16) travel in the wire dtype, others as they are; the reduction still
    accumulates in float32 and the result is cast back to the tensor's dtype.

    Example:
        >>> wire, ctx = hp.Compression.fp16.compress(torch.ones(3, dtype=torch.float64))
        >>> wire.dtype, hp.Compression.fp16.decompress(wire, ctx).dtype
        (torch.float16, torch.float64)
        >>> opt = hp.DistributedOptimizer(optimizer, compression=hp.Compression.bf16.forced)
    """

    none = None
    fp16 = torch.float16
    bf16 = torch.bfloat16

    @property
    def forced(self) -> ForcedCompression:
        """This compressor on every path, between the ranks of one host too (the ring instead of shared memory)."""
        return ForcedCompression(self)

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

    def wire_for(self, tensor: Any, op: Any) -> Wire | None:
        """The ring's wire format for ``tensor`` (the collectives ask a compressor this; see :func:`wire_for`)."""
        return wire_for(self, tensor, op)


@dataclass(frozen=True)
class ForcedCompression:
    """``hp.Compression.fp16.forced`` / ``bf16.forced``: the compressor, applied between the ranks of one host
    too (a group on one host then reduces with the ring in the wire dtype instead of shared memory).

    Example:
        >>> hp.allreduce(torch.ones(1 << 20), compression=hp.Compression.fp16.forced)
    """

    compression: Compression

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """As :meth:`Compression.compress`."""
        return self.compression.compress(tensor)

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """As :meth:`Compression.decompress`."""
        return self.compression.decompress(tensor, ctx)

    def wire_for(self, tensor: Any, op: Any) -> Wire | None:
        """As :meth:`Compression.wire_for`, converting between the ranks of one host too."""
        return wire_for(self, tensor, op)

    def __repr__(self) -> str:
        return f"hp.Compression.{self.compression.name}.forced"


def wire_for(compression: Any, tensor: Any, op: Any) -> Wire | None:
    """The wire format ``tensor`` travels in inside the allreduce with ``compression`` (hp.Compression.fp16 /
    bf16, or their ``.forced``): a float32 tensor or array in host memory reduced with Sum, Average, Min or
    Max. None: ``compression.compress`` / ``decompress`` around the allreduce instead (or no compression)."""
    forced = isinstance(compression, ForcedCompression)
    if forced:
        compression = compression.compression
    if not isinstance(compression, Compression) or compression.value is None or op not in CORE_OPS:
        return None
    if isinstance(tensor, torch.Tensor):
        host_float32 = tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.layout == torch.strided
    else:
        import numpy as np

        host_float32 = isinstance(tensor, np.ndarray) and tensor.dtype == np.float32
    return Wire(torch_codes()[compression.value], forced) if host_float32 else None

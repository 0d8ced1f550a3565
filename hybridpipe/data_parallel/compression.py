"""Horovod's gradient compressors: the wire format of what the data-parallel reductions send."""

from __future__ import annotations

import enum
from typing import Any

import torch

__all__ = ["Compression"]


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

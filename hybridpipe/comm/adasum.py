"""Adasum (Horovod's adaptive summation, Maleki et al. 2020) on CPU, by its published algorithm.

Two gradients ``a`` and ``b`` combine as ``a·(1 − a·b / (2‖a‖²)) + b·(1 − a·b / (2‖b‖²))``: orthogonal
gradients add, parallel ones average, so the combined step stays about as long as one rank's when the
ranks agree and grows when they bring different information. Over a group of ``2^k`` ranks the pairs
combine in a recursive-doubling tree, as Horovod's: at level ``j`` rank ``r`` exchanges its current vector
with rank ``r XOR 2^j`` and both compute the pair (the lower rank's vector as ``a``), so after ``k`` levels
every rank holds ``((x0 ⊕ x1) ⊕ (x2 ⊕ x3)) ⊕ …``, bit for bit the same everywhere. Each tensor combines on
its own (its own dot products). Arithmetic in float64; a zero vector combines as the other one.

Design reason: Horovod halves the vectors at every level and combines partial dot products (less
traffic); exchanging whole vectors computes the same tree with simpler code, at ``k`` times the bytes.
It runs on the communication thread like every other collective (``comm`` is hybridpipe's private one).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import buffers

__all__ = ["combine", "adasum_into"]

_TAG = 7103  # on hybridpipe's private communicators only


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The Adasum of two vectors (float64)."""
    dot = float(np.dot(a, b))
    a_norm, b_norm = float(np.dot(a, a)), float(np.dot(b, b))
    a_scale = 1.0 - dot / (2 * a_norm) if a_norm > 0 else 1.0
    b_scale = 1.0 - dot / (2 * b_norm) if b_norm > 0 else 1.0
    return a_scale * a + b_scale * b


def adasum_into(source: Any, target: Any, comm: Any, function: str) -> None:
    """Writes the Adasum over ``comm`` of every rank's ``source`` into ``target`` (host tensors / arrays)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size & (size - 1):
        raise ValueError(f"hp.{function}: op=hp.Adasum needs a power-of-two number of ranks, as Horovod's (this "
                         f"group has {size}); use a process set of 1, 2, 4, 8, ... ranks")
    if buffers.dtype_code(source) not in (0, 1, 2, 3):
        raise TypeError(f"hp.{function}: op=hp.Adasum combines floating-point tensors (float16, bfloat16, float32, "
                        f"float64), got {source.dtype}")
    wide = source.double() if buffers.is_tensor(source) else source.astype(np.float64)
    mine = np.ascontiguousarray(buffers.numpy_view(wide).reshape(-1))
    other = np.empty_like(mine)
    distance = 1
    while distance < size:
        partner = rank ^ distance
        comm.Sendrecv(mine, dest=partner, sendtag=_TAG, recvbuf=other, source=partner, recvtag=_TAG)
        mine = combine(mine, other) if rank < partner else combine(other, mine)
        distance *= 2
    result = mine.reshape(tuple(source.shape))
    if buffers.is_tensor(target):
        buffers.copy_into(target, buffers.torch_module().from_numpy(result).to(target.dtype))
    else:
        target[...] = result.astype(target.dtype)

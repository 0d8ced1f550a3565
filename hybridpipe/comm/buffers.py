"""Tensors and arrays as the C++ core sees them: dtype codes, host staging, addresses, raw bytes.

One module that collectives, the engine and the point-to-point transport share. It never imports
torch itself: a tensor's presence means whoever made it imported torch already.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Sequence

import numpy as np

from . import device

#: dtype codes of the C++ core (common.h DType)
NUMPY_CODES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2,
               np.dtype(np.int32): 4, np.dtype(np.int64): 5}
REDUCIBLE = "float32, float64, float16, bfloat16, int32, int64"
UNSUPPORTED = -1


def torch_module() -> Any:
    import torch

    return torch


@functools.lru_cache(maxsize=None)
def torch_codes() -> dict:
    torch = torch_module()
    return {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.int32: 4,
            torch.int64: 5}


def is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # torch is imported by whoever made a tensor; never import it here
    return torch is not None and isinstance(x, torch.Tensor)


def check_array(x: Any, function: str) -> None:
    if not (is_tensor(x) or isinstance(x, np.ndarray)):
        raise TypeError(f"hp.{function} takes a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if is_tensor(x):
        device.route(x)  # a device no route reaches (meta, mps) is refused here, before the ranks agree


def host(x: Any) -> Any:
    """A contiguous host-memory view of x, or a copy when x is on a GPU or not contiguous."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    x = x.detach()
    return _staged(x).contiguous() if x.device.type != "cpu" else x.contiguous()


def _staged(x: Any) -> Any:
    """A tensor off the host, copied into pinned host memory (the ``"staged"`` route of hybridpipe.comm.device).

    Pinned (page-locked) memory is what the GPU copies at full speed, both ways: a pageable ``x.cpu()`` plus the
    copy back are slower (docs/gpu.md has both measured on an H200). torch's caching host allocator keeps the
    pinned blocks for the next call of that size. The copy is blocking: it waits for the work queued on the
    current stream, so the tensor's producer has finished, and the host sees the values once it returns.
    """
    device.route(x)  # a device no route reaches is refused, naming it
    device.note_staged(x)
    staged = torch_module().empty(x.shape, dtype=x.dtype, pin_memory=True)
    staged.copy_(x)
    return staged


def is_host_contiguous(x: Any) -> bool:
    """Whether the C++ core can read ``x`` where it is: a C-contiguous numpy array, or a contiguous CPU
    tensor without a lazy conjugate / negation."""
    if isinstance(x, np.ndarray):
        return x.flags.c_contiguous
    return x.device.type == "cpu" and x.is_contiguous() and not x.is_conj() and not x.is_neg()


def empty_like(x: Any) -> Any:
    """An uninitialized contiguous host tensor / array with ``x``'s shape and dtype."""
    if isinstance(x, np.ndarray):
        return np.empty(x.shape, x.dtype)
    return torch_module().empty(x.shape, dtype=x.dtype)


class OutputPool:
    """Outputs of out-of-place allreduces, reused once their user let go of them.

    A fresh 100 MiB of outputs per call costs its page faults again and again (the ResNet-50 benchmark:
    up to 3× the in-place time). The pool keeps the memory (the torch storage) of each result it handed out
    and gives it out again, for an output of the same kind, shape and dtype, only when torch counts no other
    user of that storage: no tensor, view, numpy array on its memory or tensor autograd saved holds it — the
    count by which torch itself frees a storage. numpy results are arrays on a torch storage for that reason.
    Bounded by ``limit_bytes`` (the oldest go first); emptied by hp.shutdown.
    """

    def __init__(self, limit_bytes: int = 512 << 20) -> None:
        self.limit_bytes = limit_bytes
        self._items: dict[tuple, list[Any]] = {}  # (type, dtype, shape) -> storages of results handed out, oldest first
        self._bytes = 0

    @staticmethod
    def _key(x: Any) -> tuple:
        return (type(x), x.dtype, tuple(x.shape))

    @staticmethod
    def _storage(x: Any) -> Any:
        """The torch storage under a result this pool made (a numpy result's base is its tensor), else None."""
        torch = torch_module()
        tensor = x.base if isinstance(x, np.ndarray) else x
        return tensor.untyped_storage() if isinstance(tensor, torch.Tensor) else None

    @staticmethod
    def _output(like: Any, storage: Any = None) -> Any:
        """An output shaped as ``like`` on ``storage`` (None: new memory); a numpy array for a numpy ``like``."""
        torch = torch_module()
        numpy = isinstance(like, np.ndarray)
        try:
            dtype = torch.from_numpy(np.empty(0, like.dtype)).dtype if numpy else like.dtype
        except TypeError:  # a numpy dtype torch has no tensor for: a plain array, not pooled
            return np.empty(like.shape, like.dtype)
        if storage is None:
            tensor = torch.empty(like.shape, dtype=dtype)
        else:
            tensor = torch.empty(0, dtype=dtype).set_(storage, 0, tuple(like.shape))
        return tensor.numpy() if numpy else tensor

    def take(self, like: Any) -> Any:
        """An output for ``like`` (a contiguous host tensor / array): a released one, else a new one."""
        candidates = self._items.get(self._key(like))
        if candidates:
            torch = torch_module()
            for index, storage in enumerate(candidates):
                if torch._C._storage_Use_Count(storage._cdata) == 1:  # the pool's reference alone
                    del candidates[index]
                    self._bytes -= storage.nbytes()
                    return self._output(like, storage)
        return self._output(like)

    def offer(self, result: Any) -> None:
        """Remembers a result handed to the user, for a later take() once they dropped it."""
        storage = self._storage(result)
        if storage is None or storage.nbytes() > self.limit_bytes:
            return
        self._items.setdefault(self._key(result), []).append(storage)
        self._bytes += storage.nbytes()
        while self._bytes > self.limit_bytes:
            key = max(self._items, key=lambda k: len(self._items[k]))
            self._bytes -= self._items[key].pop(0).nbytes()
            if not self._items[key]:
                del self._items[key]

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0


def size_buckets(items: Sequence[Any], nbytes: Callable[[Any], int], limit: int) -> list[list[Any]]:
    """``items`` in their order, cut into consecutive buckets of at most ``limit`` bytes each (``nbytes(item)``);
    an item larger than ``limit`` is a bucket of its own, and items of no bytes join the bucket they come to.
    (The gradient buckets of ZeRO and of DistributedOptimizer on the GPU, given in backward order.)"""
    buckets: list[list[Any]] = []
    size = 0
    for item in items:
        item_bytes = nbytes(item)
        if not buckets or (size > 0 and size + item_bytes > limit):
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += item_bytes
    return buckets


def address(x: Any) -> int:
    return x.data_ptr() if is_tensor(x) else x.ctypes.data


def count(x: Any) -> int:
    return x.size if isinstance(x, np.ndarray) else x.numel()


def dtype_code(x: Any) -> int:
    codes = torch_codes() if is_tensor(x) else NUMPY_CODES
    return codes.get(x.dtype, UNSUPPORTED)


def check_reducible(codes: Sequence[int], arrays: Sequence[Any], function: str) -> None:
    for code, x in zip(codes, arrays):
        if code == UNSUPPORTED:
            raise TypeError(f"hp.{function}: dtype {x.dtype} cannot be reduced (use one of {REDUCIBLE})")


def byte_view(x: Any) -> np.ndarray:
    """The raw bytes of a contiguous host tensor/array as a uint8 numpy array (no copy)."""
    if is_tensor(x):
        return x.reshape(-1).view(torch_module().uint8).numpy()
    return x.reshape(-1).view(np.uint8)


def copy_into(destination: Any, source: Any) -> None:
    """Writes a staged result back into the caller's tensor/array (nothing when they are one)."""
    if destination is source:
        return
    if is_tensor(destination):
        if destination.device == source.device and destination.data_ptr() == source.data_ptr() \
                and destination.is_contiguous():
            return  # the in-place work was the tensor itself (a detached view of the same memory)
        destination.copy_(source)
    else:
        destination[...] = source


def clone(x: Any) -> Any:
    """A detached copy of a tensor/array (same device)."""
    return x.detach().clone() if is_tensor(x) else np.array(x, copy=True)


def scale_(x: Any, factor: float) -> None:
    """Multiplies a host tensor/array by ``factor`` in place (integers: the product truncated toward zero)."""
    if factor == 1.0 or count(x) == 0 or dtype_code(x) == UNSUPPORTED:  # not reducible: refused after agreeing
        return
    if is_tensor(x):
        if x.is_floating_point():
            x.mul_(factor)
        else:
            x.copy_((x.double() * factor).to(x.dtype))
    elif np.issubdtype(x.dtype, np.floating):
        x *= x.dtype.type(factor)
    else:
        x[...] = np.trunc(x * factor).astype(x.dtype)


def divide_(x: Any, divisor: int) -> None:
    """Divides a tensor/array by a positive int in place (integers: the exact quotient truncated toward zero,
    which multiplying by ``1 / divisor`` in floating point can miss by one)."""
    if divisor == 1 or count(x) == 0 or dtype_code(x) == UNSUPPORTED:
        return
    if is_tensor(x):
        if x.is_floating_point():
            x.div_(divisor)
        else:
            x.div_(divisor, rounding_mode="trunc")
    elif np.issubdtype(x.dtype, np.floating):
        x /= x.dtype.type(divisor)
    else:
        x[...] = np.sign(x) * (np.abs(x) // divisor)


def numpy_view(x: Any) -> np.ndarray:
    """A contiguous host tensor as a numpy array sharing its memory (arrays as they are)."""
    return x.numpy() if is_tensor(x) else x


def trailing(x: Any) -> str:
    """The dimensions after the first, the dtype and the rank of ``x`` (what gathering along dim 0 needs
    every rank to agree on), and its device when it is not the host."""
    return f"{tuple(x.shape[1:])} {str(x.dtype).replace('torch.', '')} ndim={len(x.shape)}{device_tag(x)}"


def device_tag(x: Any) -> str:
    """`` device=cuda`` for a tensor off the host, else nothing: ranks must agree on it (as in Horovod, a
    CPU tensor on one rank and a GPU tensor on another is an error), the device index may differ."""
    return f" device={x.device.type}" if is_tensor(x) and x.device.type != "cpu" else ""


def device_code(x: Any) -> int:
    """The engine's device field (csrc/engine.h): 0 host memory, 1 CUDA, 2 another accelerator."""
    if not is_tensor(x) or x.device.type == "cpu":
        return 0
    return 1 if x.device.type == "cuda" else 2


def row_bytes(x: Any) -> int:
    """Bytes of one first-dimension slice of a contiguous host tensor/array."""
    itemsize = x.dtype.itemsize if isinstance(x, np.ndarray) else x.element_size()
    return itemsize * int(np.prod(tuple(x.shape[1:]), dtype=np.int64))


def describe(x: Any) -> str:
    return f"shape={tuple(x.shape)} dtype={str(x.dtype).replace('torch.', '')}{device_tag(x)}"


def host_contiguous(tensor: Any) -> Any:
    """The tensor's raw values in contiguous host memory (lazy conj/neg views materialized);
    contiguous CPU tensors are not copied."""
    staged = tensor.detach().resolve_conj().resolve_neg()
    return _staged(staged).contiguous() if staged.device.type != "cpu" else staged.contiguous()


@functools.lru_cache(maxsize=None)
def _numpy_viewable() -> frozenset:
    torch = torch_module()
    return frozenset({torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
                      torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})


def raw_bytes(tensor: Any) -> bytes:
    """A tensor's values as bytes, C order (non-contiguous and GPU tensors included)."""
    if tensor.dtype in _numpy_viewable() and tensor.device.type == "cpu" and not tensor.is_conj() \
            and not tensor.is_neg():
        return tensor.detach().numpy().tobytes()  # the common case: two torch calls
    return host_contiguous(tensor).reshape(-1).view(torch_module().uint8).numpy().tobytes()

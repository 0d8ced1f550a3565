"""Split a mini-batch into micro-batches along dim 0 and merge outputs back; loss weights.

Design reasons:

* A batch is a tensor or any nesting of tuples/lists/dicts of tensors. Every tensor with at
  least one dimension is split along dim 0; everything else (ints, strings, ``None``, 0-dim
  tensors) is a setting, passed unchanged to every micro-batch.
* Splitting follows ``torch.tensor_split``: micro-batch sizes differ by at most one, the
  first ``batch_size % micro_batches`` micro-batches are one larger. So any batch size
  ``>= micro_batches`` works, and :func:`loss_weights` makes the size-weighted mean of the
  micro-batch mean losses equal the full-batch mean loss (hence equal gradients).
* Chunks are views of the batch (no copy); :func:`merge` concatenates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from hybridpipe.errors import HybridPipeError

__all__ = ["split", "merge", "micro_batch_sizes", "loss_weights", "map_tensors", "iter_tensors"]


def _rebuild(like: tuple[Any, ...] | list[Any], items: list[Any]) -> tuple[Any, ...] | list[Any]:
    """A tuple/list of the same type as ``like`` (named tuples included) holding ``items``."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    return type(like)(items)


def map_tensors(value: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``function`` to every tensor in a nesting of tuples/lists/dicts; keep the rest.

    Tuples and lists keep their type; mappings come back as plain ``dict``.
    """
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, (tuple, list)):
        return _rebuild(value, [map_tensors(item, function) for item in value])
    if isinstance(value, Mapping):
        return {key: map_tensors(item, function) for key, item in value.items()}
    return value


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nesting of tuples/lists/dicts, depth first, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from iter_tensors(item)


def micro_batch_sizes(batch_size: int, micro_batches: int) -> list[int]:
    """Sizes of the micro-batches :func:`split` makes (``torch.tensor_split`` semantics).

    Example:
        >>> micro_batch_sizes(10, 4)
        [3, 3, 2, 2]

    Raises:
        HybridPipeError: ``micro_batches < 1`` or ``batch_size < micro_batches``.
    """
    if micro_batches < 1:
        raise HybridPipeError(f"micro_batches must be >= 1 (got {micro_batches})")
    if batch_size < micro_batches:
        raise HybridPipeError(
            f"batch size {batch_size} is smaller than micro_batches {micro_batches} "
            f"(use a batch of at least {micro_batches} samples or micro_batches <= {batch_size})"
        )
    base, extra = divmod(batch_size, micro_batches)
    return [base + 1 if index < extra else base for index in range(micro_batches)]


def loss_weights(sizes: Sequence[int]) -> list[float]:
    """Per-micro-batch weights ``size_i / total``.

    ``sum(w_i * mean_loss_i)`` equals the full-batch mean loss, so scaling each micro-batch's
    loss by ``w_i`` before backward gives the full-batch gradients.

    Raises:
        HybridPipeError: no sizes, a negative size, or a zero total.
    """
    total = sum(sizes)
    if not sizes or total <= 0 or min(sizes) < 0:
        raise HybridPipeError(f"micro-batch sizes must be >= 0 with a positive total (got {list(sizes)})")
    return [size / total for size in sizes]


def _batch_dims(value: Any, path: str, found: list[tuple[str, int]]) -> None:
    """Collect (path, dim-0 size) of every splittable tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 0:
            found.append((path, value.shape[0]))
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _batch_dims(item, f"{path}[{index}]", found)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _batch_dims(item, f"{path}[{key!r}]", found)


def _split(value: Any, micro_batches: int) -> list[Any]:
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return list(torch.tensor_split(value, micro_batches, dim=0))
    if isinstance(value, (tuple, list)):
        columns = [_split(item, micro_batches) for item in value]
        return [_rebuild(value, [column[i] for column in columns]) for i in range(micro_batches)]
    if isinstance(value, Mapping):
        by_key = {key: _split(item, micro_batches) for key, item in value.items()}
        return [{key: column[i] for key, column in by_key.items()} for i in range(micro_batches)]
    return [value] * micro_batches


def split(batch: Any, micro_batches: int) -> list[Any]:
    """Split ``batch`` into ``micro_batches`` micro-batches along dim 0.

    Args:
        batch: A tensor, or tuples/lists/dicts (nested) of tensors and other values.
        micro_batches: Number of micro-batches.

    Returns:
        ``micro_batches`` values shaped like ``batch``; tensors are views of ``batch``'s.

    Raises:
        HybridPipeError: no tensor with a batch dimension, tensors disagree on dim 0 (the
            message names each one's path and size), or the batch is smaller than
            ``micro_batches``.

    Example:
        >>> chunks = split({"x": torch.zeros(5, 3), "scale": 2.0}, 2)
        >>> [tuple(c["x"].shape) for c in chunks], chunks[1]["scale"]
        ([(3, 3), (2, 3)], 2.0)
    """
    found: list[tuple[str, int]] = []
    _batch_dims(batch, "batch", found)
    if not found:
        raise HybridPipeError(
            f"batch has no tensor with a batch dimension to split (got {type(batch).__name__}; "
            f"pass a tensor or a tuple/list/dict of tensors)"
        )
    sizes = {size for _, size in found}
    if len(sizes) > 1:
        listing = ", ".join(f"{path} {size}" for path, size in found)
        raise HybridPipeError(
            f"tensors in one batch disagree on dim 0 ({listing}); every tensor must have the "
            f"same batch size (pass per-batch constants as non-tensors or 0-dim tensors)"
        )
    micro_batch_sizes(sizes.pop(), micro_batches)
    return _split(batch, micro_batches)


def _same(first: Any, other: Any) -> bool:
    if first is other:
        return True
    if isinstance(first, torch.Tensor) and isinstance(other, torch.Tensor):
        return first.shape == other.shape and bool(torch.equal(first, other))
    try:
        return bool(first == other)
    except (TypeError, ValueError, RuntimeError):
        return False


def _merge(chunks: list[Any], path: str) -> Any:
    first = chunks[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        if not all(isinstance(chunk, torch.Tensor) and chunk.dim() > 0 for chunk in chunks):
            raise HybridPipeError(f"micro-batch outputs differ in structure at {path} (tensor vs other)")
        return torch.cat(chunks, dim=0)
    if isinstance(first, (tuple, list)):
        if not all(type(chunk) is type(first) and len(chunk) == len(first) for chunk in chunks):
            lengths = [len(chunk) if isinstance(chunk, (tuple, list)) else None for chunk in chunks]
            raise HybridPipeError(
                f"micro-batch outputs differ in structure at {path} "
                f"({type(first).__name__} lengths {lengths})"
            )
        items = [_merge([chunk[i] for chunk in chunks], f"{path}[{i}]") for i in range(len(first))]
        return _rebuild(first, items)
    if isinstance(first, Mapping):
        if not all(isinstance(chunk, Mapping) and chunk.keys() == first.keys() for chunk in chunks):
            raise HybridPipeError(f"micro-batch outputs differ in keys at {path} (first has {list(first)})")
        return {key: _merge([chunk[key] for chunk in chunks], f"{path}[{key!r}]") for key in first}
    if not all(_same(first, chunk) for chunk in chunks[1:]):
        raise HybridPipeError(
            f"value at {path} differs between micro-batches and has no batch dimension to "
            f"concatenate (got {chunks[:4]}); give it a dim 0"
        )
    return first


def merge(chunks: Sequence[Any]) -> Any:
    """Inverse of :func:`split`: concatenate tensors along dim 0, keep the structure.

    Values without a batch dimension (non-tensors, 0-dim tensors) must be equal in every
    micro-batch — :func:`split` broadcast them — and are returned once.

    Raises:
        HybridPipeError: no chunks, chunks with different structure, or a value without a
            batch dimension that differs between chunks.
    """
    if len(chunks) == 0:
        raise HybridPipeError("merge needs at least one micro-batch (got 0)")
    return _merge(list(chunks), "batch")

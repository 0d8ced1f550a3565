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
* Nesting is walked by ``torch.utils._pytree`` (tuples, lists, named tuples, dicts), the one
  walker the pipeline uses (``comm/p2p.py`` describes messages with it too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hybridpipe.errors import UsageError

__all__ = ["split", "merge", "micro_batch_sizes", "loss_weights", "map_tensors", "iter_tensors", "as_leaf"]


def map_tensors(value: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``function`` to every tensor in a nesting of tuples/lists/dicts; keep the rest."""
    return pytree.tree_map_only(torch.Tensor, function, value)


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nesting of tuples/lists/dicts, depth first, in order."""
    return (leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor))


def as_leaf(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, as a leaf that requires grad when it is floating point or complex (a stage's input,
    timed or traced on its own)."""
    leaf = tensor.detach()
    return leaf.requires_grad_() if leaf.is_floating_point() or leaf.is_complex() else leaf


def _path(keys: Any) -> str:
    return "batch" + pytree.keystr(keys)


def micro_batch_sizes(batch_size: int, micro_batches: int) -> list[int]:
    """Sizes of the micro-batches :func:`split` makes (``torch.tensor_split`` semantics).

    Example:
        >>> micro_batch_sizes(10, 4)
        [3, 3, 2, 2]

    Raises:
        UsageError: ``micro_batches < 1`` or ``batch_size < micro_batches``.
    """
    if micro_batches < 1:
        raise UsageError(f"micro_batches must be >= 1 (got {micro_batches})")
    if batch_size == 0:
        raise UsageError(f"the batch is empty (0 samples; micro_batches {micro_batches}): the data loader "
                         "gave an empty batch, e.g. a dataset shard with no samples; check the dataset's length "
                         "and its sharding over grid.data_replicas")
    if batch_size < micro_batches:
        raise UsageError(
            f"batch size {batch_size} is smaller than micro_batches {micro_batches} "
            f"(use a batch of at least {micro_batches} samples or micro_batches <= {batch_size}; a dataset shorter "
            "than one batch, or a short last batch, gives such a batch: DataLoader(..., drop_last=True))"
        )
    base, extra = divmod(batch_size, micro_batches)
    return [base + 1 if index < extra else base for index in range(micro_batches)]


def loss_weights(sizes: Sequence[int]) -> list[float]:
    """Per-micro-batch weights ``size_i / total``.

    ``sum(w_i * mean_loss_i)`` equals the full-batch mean loss, so scaling each micro-batch's
    loss by ``w_i`` before backward gives the full-batch gradients.

    Raises:
        UsageError: no sizes, a negative size, or a zero total.
    """
    total = sum(sizes)
    if not sizes or total <= 0 or min(sizes) < 0:
        raise UsageError(f"micro-batch sizes must be >= 0 with a positive total (got {list(sizes)})")
    return [size / total for size in sizes]


def split(batch: Any, micro_batches: int) -> list[Any]:
    """Split ``batch`` into ``micro_batches`` micro-batches along dim 0.

    Args:
        batch: A tensor, or tuples/lists/dicts (nested) of tensors and other values.
        micro_batches: Number of micro-batches.

    Returns:
        ``micro_batches`` values shaped like ``batch``; tensors are views of ``batch``'s.

    Raises:
        UsageError: no tensor with a batch dimension, tensors disagree on dim 0 (the
            message names each one's path and size), or the batch is smaller than
            ``micro_batches``.

    Example:
        >>> chunks = split({"x": torch.zeros(5, 3), "scale": 2.0}, 2)
        >>> [tuple(c["x"].shape) for c in chunks], chunks[1]["scale"]
        ([(3, 3), (2, 3)], 2.0)
    """
    flat, spec = pytree.tree_flatten_with_path(batch)
    found = [(_path(keys), leaf.shape[0]) for keys, leaf in flat if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not found:
        raise UsageError(
            f"batch has no tensor with a batch dimension to split (got {type(batch).__name__}; "
            f"pass a tensor or a tuple/list/dict of tensors)"
        )
    sizes = {size for _, size in found}
    if len(sizes) > 1:
        listing = ", ".join(f"{path} {size}" for path, size in found)
        raise UsageError(
            f"tensors in one batch disagree on dim 0 ({listing}); every tensor must have the "
            f"same batch size (pass per-batch constants as non-tensors or 0-dim tensors)"
        )
    micro_batch_sizes(sizes.pop(), micro_batches)
    columns = [list(torch.tensor_split(leaf, micro_batches, dim=0))
               if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else [leaf] * micro_batches
               for _, leaf in flat]
    return [pytree.tree_unflatten([column[i] for column in columns], spec) for i in range(micro_batches)]


def _same(first: Any, other: Any) -> bool:
    if first is other:
        return True
    if isinstance(first, torch.Tensor) and isinstance(other, torch.Tensor):
        return first.shape == other.shape and bool(torch.equal(first, other))
    try:
        return bool(first == other)
    except (TypeError, ValueError, RuntimeError):
        return False


def _merge_leaf(values: list[Any], path: str) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        if not all(isinstance(value, torch.Tensor) and value.dim() > 0 for value in values):
            raise UsageError(f"micro-batch outputs differ in structure at {path} (tensor vs other)")
        return torch.cat(values, dim=0)
    if any(isinstance(value, torch.Tensor) and value.dim() > 0 for value in values):
        raise UsageError(f"micro-batch outputs differ in structure at {path} (tensor vs other)")
    if not all(_same(first, value) for value in values[1:]):
        raise UsageError(
            f"value at {path} differs between micro-batches and has no batch dimension to "
            f"concatenate (got {values[:4]}); give it a dim 0"
        )
    return first


def merge(chunks: Sequence[Any]) -> Any:
    """Inverse of :func:`split`: concatenate tensors along dim 0, keep the structure.

    Values without a batch dimension (non-tensors, 0-dim tensors) must be equal in every
    micro-batch — :func:`split` broadcast them — and are returned once.

    Raises:
        UsageError: no chunks, chunks with different structure, or a value without a
            batch dimension that differs between chunks.
    """
    if len(chunks) == 0:
        raise UsageError("merge needs at least one micro-batch (got 0)")
    flats = [pytree.tree_flatten_with_path(chunk) for chunk in chunks]
    first_paths, first_spec = [keys for keys, _ in flats[0][0]], flats[0][1]
    for index, (flat, spec) in enumerate(flats[1:], start=1):
        paths = [keys for keys, _ in flat]
        if paths != first_paths:
            where = next((i for i, (a, b) in enumerate(zip(first_paths, paths)) if a != b),
                         min(len(paths), len(first_paths)))
            mine = _path(first_paths[where]) if where < len(first_paths) else "nothing more"
            theirs = _path(paths[where]) if where < len(paths) else "nothing more"
            raise UsageError(f"micro-batch outputs differ in keys at batch: micro-batch 0 has {mine} "
                             f"where micro-batch {index} has {theirs}")
        if spec != first_spec:
            raise UsageError(f"micro-batch outputs differ in structure at batch (micro-batch 0: "
                             f"{first_spec}; micro-batch {index}: {spec})")
    leaves = [_merge_leaf([flat[i][1] for flat, _ in flats], _path(keys)) for i, keys in enumerate(first_paths)]
    return pytree.tree_unflatten(leaves, first_spec)

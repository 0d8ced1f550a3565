"""``hp.elastic.ElasticSampler``: Horovod's elastic sampler, cut for the grid the job runs on now.

What it yields, on every grid (one data rule, whatever grid the job runs on):

* The epoch's order is one permutation of the dataset's indices (``torch.randperm`` seeded with ``seed + epoch``, or
  ``range`` without ``shuffle``), the same on every rank and for every grid, with the indices already processed this
  epoch left out.
* What a rank gets is what it must hand to its step: on a uniform grid its data replica's share (the ranks of one
  pipeline, one per stage, get the same samples; with one stage a replica is a rank), on a grid with per-stage replica
  counts (``stage_replicas=``, micro-batches go round-robin over each stage's replicas) everything.
* Sample mode (Horovod's, no ``batch_size``): iterate it through a ``DataLoader(batch_size=b)``; the shares are
  interleaved, padded at the epoch's end with its first indices so that every share has as many samples (as
  Horovod's and ``DistributedSampler`` do; ``drop_last=True`` leaves the tail out instead).
* Batch mode (``batch_size=B``, the global mini-batch: pass it as ``DataLoader(batch_sampler=...)``): it yields, for
  each mini-batch of ``B`` consecutive indices of the order, this rank's contiguous share of it. The mini-batches are
  the same whatever the grid, so a job that changes grid mid-epoch (a rank lost under ``hp.elastic.run``) trains on
  the mini-batches one process would. ``B`` must be divisible by the replica count; a last, short mini-batch is
  yielded when the replicas can share it evenly (always on a non-uniform grid), else left out, as with ``drop_last``.

``record_batch(batch_index, batch_size)`` marks the indices of the current iteration's batch ``batch_index`` as
processed (batch mode: that whole mini-batch, on every rank's behalf). Kept in a ``hp.elastic.TorchState`` (a keyword
argument such as ``sampler=``), the sampler is committed with it, rolled back to the last commit after a failure, and
synced (the union of what every rank processed); ``reset()`` then re-cuts what is left of the epoch for the new grid.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch

from .. import runtime

__all__ = ["ElasticSampler"]


def _share() -> tuple[int, int]:
    """(how many shares the data is cut into, this rank's) on the job's grid now: its data replicas on a uniform
    grid, one share (the whole data) on a grid with per-stage replica counts."""
    grid = runtime.grid()
    if not grid.uniform:
        return 1, 0
    return grid.data_replicas, grid.replica


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)``: the epoch's samples not yet processed,
    this rank's share of them on the job's current grid (module docstring).

    Args:
        dataset: anything with ``len()``.
        shuffle: a permutation of the indices per epoch (seeded with ``seed + epoch``); else in order.
        seed: the shuffle's seed; the same on every rank.
        batch_size: the global mini-batch, for batch mode (``DataLoader(batch_sampler=sampler)``); None: sample
            mode (``DataLoader(sampler=sampler, batch_size=b)``, ``b`` samples per share).
        drop_last: leave out the epoch's tail that the shares cannot split evenly instead of padding it (sample
            mode) or of yielding a last short mini-batch (batch mode, where it is split evenly when it can be).

    Example:
        >>> sampler = hp.elastic.ElasticSampler(dataset, batch_size=64)
        >>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
        >>> state = hp.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
        >>> @hp.elastic.run
        ... def train(state):
        ...     for state.epoch in range(state.epoch, epochs):
        ...         state.sampler.set_epoch(state.epoch)   # a new epoch: nothing processed yet
        ...         for index, batch in enumerate(loader):
        ...             model.train_step(*batch)           # the same call on every grid
        ...             state.sampler.record_batch(index, 64)
        ...             state.commit()
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0, batch_size: int | None = None,
                 drop_last: bool = False) -> None:
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"hp.elastic.ElasticSampler: batch_size must be a positive int (the global mini-batch) "
                             f"or None (sample mode), got {batch_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"hp.elastic.ElasticSampler: seed must be an int (the same on every rank), got {seed!r}")
        self.dataset = dataset
        self.shuffle, self.seed, self.batch_size, self.drop_last = bool(shuffle), seed, batch_size, bool(drop_last)
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas, self.rank = 1, 0  # the shares and this rank's, as of the last reset()
        self.remaining_indices: list[int] = []
        self.indices: list = []  # the current iteration's: this rank's samples, or its share of each mini-batch
        self._batches: list[list[int]] = []  # batch mode: the whole mini-batches behind self.indices
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: its own order, nothing processed yet."""
        self.epoch = int(epoch)
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_index: int, batch_size: int) -> None:
        """Marks batch ``batch_index`` of the current iteration processed: ``batch_size`` of this rank's samples
        (sample mode), or that whole mini-batch (batch mode; ``batch_size`` is the global mini-batch or this rank's
        share of it)."""
        if self.batch_size is not None:
            if not 0 <= batch_index < len(self._batches):
                raise IndexError(f"hp.elastic.ElasticSampler.record_batch: batch {batch_index} is not one of this "
                                 f"iteration's {len(self._batches)} mini-batches")
            share = len(self.indices[batch_index])
            if batch_size not in (len(self._batches[batch_index]), share, self.batch_size):
                raise ValueError(f"hp.elastic.ElasticSampler.record_batch: batch_size {batch_size} is neither the "
                                 f"mini-batch ({self.batch_size}) nor this rank's share of it ({share})")
            self.record_indices(self._batches[batch_index])
            return
        self.record_indices(self.get_indices(batch_index, batch_size))

    def record_indices(self, indices: Any) -> None:
        """Marks dataset ``indices`` processed."""
        self.processed_indices.update(int(index) for index in indices)

    def get_indices(self, batch_index: int, batch_size: int) -> list[int]:
        """Sample mode: the indices of this rank's batch ``batch_index`` of ``batch_size`` in the current
        iteration."""
        start = batch_index * batch_size
        return list(self.indices[start:start + batch_size])

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Re-cuts the epoch's unprocessed indices for the job's grid now (after hp.init, a lost rank, a load)."""
        self.num_replicas, self.rank = _share()
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        self.remaining_indices = [index for index in order if index not in self.processed_indices]
        if self.batch_size is not None and self.batch_size % self.num_replicas:
            raise ValueError(f"hp.elastic.ElasticSampler: batch_size {self.batch_size} cannot be shared by the "
                             f"{self.num_replicas} data replicas of the grid ({runtime.grid().config}): pass a "
                             "multiple of the replica counts the job may run with")

    def _cut(self) -> tuple[list, list[list[int]]]:
        """This rank's part of the remaining indices (its samples, or its share of each mini-batch), and in batch
        mode the whole mini-batches."""
        parts, mine, remaining = self.num_replicas, self.rank, self.remaining_indices
        if self.batch_size is None:
            if self.drop_last:
                remaining = remaining[:len(remaining) - len(remaining) % parts]
            elif remaining and len(remaining) % parts:
                padding = parts - len(remaining) % parts
                remaining = remaining + (remaining * padding)[:padding]
            return remaining[mine::parts], []
        batches = [remaining[at:at + self.batch_size] for at in range(0, len(remaining), self.batch_size)]
        if batches and len(batches[-1]) < self.batch_size and (self.drop_last or len(batches[-1]) % parts):
            batches.pop()
        return [batch[mine * len(batch) // parts:(mine + 1) * len(batch) // parts] for batch in batches], batches

    def __iter__(self) -> Iterator[Any]:
        self.indices, self._batches = self._cut()
        return iter(copy.copy(self.indices))

    def __len__(self) -> int:
        return len(self._cut()[0])

    def merged_state(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """The state every rank goes on from, out of every rank's :meth:`state_dict`: rank 0's epoch and the union of
        what the ranks processed (each records its own share in sample mode)."""
        processed = set().union(*(state["processed_indices"] for state in states)) if states else set()
        return {"epoch": states[0]["epoch"] if states else self.epoch, "processed_indices": processed}

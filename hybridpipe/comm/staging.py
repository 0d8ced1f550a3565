"""The staged route of a CUDA buffer: through pinned host memory, a segment at a time, two segments in flight.

A collective on a CUDA tensor that the MPI library cannot read on the device (see hybridpipe.comm.device) is
run on host copies. Copying the whole tensor down, reducing it, and copying it back leaves the copy engines
and the network idle in turn; here the tensor is cut into segments (HYBRIDPIPE_STAGING_SEGMENT_BYTES) and two
pinned host slots alternate, so that while segment *i* is being reduced in one slot, segment *i + 1* is
already being copied down into the other, and segment *i − 1* is being copied back up:

    copy down  | 0 | 1 |   | 2 |   | 3 |
    reduce     |   | 0 | 1 | 2 | 3 |
    copy up    |       | 0 | 1 | 2 | 3 |

The copies down run on one side stream of the device, the copies up on another (two copy engines); a slot is
refilled only after the copy up out of it has finished, which the stream orders, not the host. The first copy
down waits for the tensor's producer: an event recorded on the caller's stream when the call was made
(:func:`ready_event`), so that a tensor written on a side stream, or by a thread other than the one that runs
the collective, is read only once it is written.

:func:`schedule` is the order of those steps with the steps passed in as functions, so that the order is
tested on machines without a GPU; :func:`segments` the arithmetic of the cut.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .. import running

__all__ = ["segments", "schedule", "ready_event", "run", "SLOTS"]

#: Host slots in flight: one being reduced while the next is filled (double buffering).
SLOTS = 2


def segments(count: int, itemsize: int, segment_bytes: int) -> list[tuple[int, int]]:
    """``(start, length)`` in elements of the segments of a buffer of ``count`` elements of ``itemsize`` bytes:
    each at most ``segment_bytes`` (at least one element), in order, covering the buffer once.

    Every rank cuts its buffer the same way from the same count, dtype and setting (they agree on the count and
    dtype before the first segment), so segment *i* of one rank meets segment *i* of the others.
    """
    if count < 0 or itemsize < 1 or segment_bytes < 1:
        raise ValueError(f"segments: count={count}, itemsize={itemsize}, segment_bytes={segment_bytes}")
    per = max(1, segment_bytes // itemsize)
    return [(start, min(per, count - start)) for start in range(0, count, per)]


def schedule(n: int, fetch: Callable[[int, int, int | None], None], wait_fetched: Callable[[int], None],
             transfer: Callable[[int, int], None], store: Callable[[int, int], None], slots: int = SLOTS) -> None:
    """Runs the steps of ``n`` segments over ``slots`` host slots, in the order that overlaps them.

    Args:
        fetch(i, slot, after): start copying segment ``i`` down into ``slot``, once the copy up of segment
            ``after`` out of that slot has finished (``None``: the slot is fresh). Does not wait.
        wait_fetched(i): wait until segment ``i`` is in its slot.
        transfer(i, slot): the collective on the slot (blocking; the slot holds the result after it).
        store(i, slot): start copying the slot's result up into segment ``i`` of the output. Does not wait.

    The caller waits for the last stores itself. Segment ``i + 1``'s copy down is started before segment ``i``
    is transferred, and ``i``'s copy up before ``i + 1`` is transferred: that is the overlap.
    """
    if slots < 1:
        raise ValueError(f"schedule: slots={slots} must be >= 1")
    for i in range(min(slots, n)):
        fetch(i, i % slots, None)
    for i in range(n):
        slot = i % slots
        wait_fetched(i)
        transfer(i, slot)
        store(i, slot)
        if i + slots < n:
            fetch(i + slots, slot, i)


def ready_event(tensor: Any) -> Any:
    """An event recorded now on the current stream of a CUDA ``tensor``'s device (None for other tensors):
    called in the thread that submits a collective, it marks the point after which the tensor is written."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def copy_streams(device: Any) -> tuple[Any, Any]:
    """The device's two side streams (copies down, copies up), made once per job (kept by the running job's
    ``copy_streams``; new ones for each call outside a job)."""
    job = running.current_or_none()
    streams = job.copy_streams if job is not None else {}
    if device not in streams:
        import torch

        streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return streams[device]


def run(source: Any, target: Any, transfer: Callable[[int, Any], None], ready: Any = None,
        segment_bytes: int = 4 << 20, fetch: bool = True) -> None:
    """Runs ``transfer`` over pinned host copies of the segments of ``source`` and writes the results into
    ``target``, double-buffered (see the module's text). Returns when ``target`` holds every result.

    Args:
        source: a contiguous CUDA tensor (read only when ``fetch``).
        target: a contiguous CUDA tensor with ``source``'s dtype and element count (``source`` itself for an
            in-place collective), or None when nothing comes back (a broadcast's root).
        transfer(i, host): the collective on segment ``i``'s pinned host copy (a 1-d tensor), in place.
        ready: an event the first copy down waits for (:func:`ready_event`); None: the current stream's
            work so far.
        fetch: False when the segments' values do not matter (a broadcast's receivers): nothing is copied
            down, the slots are only filled by ``transfer``.
    """
    import torch

    from . import device as devices

    devices.note_staged(source)
    flat = source.reshape(-1)
    out = None if target is None else target.reshape(-1)
    cuts = segments(flat.numel(), flat.element_size(), segment_bytes)
    if not cuts:
        return
    device = flat.device
    down, up = copy_streams(device)
    if ready is None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
    longest = max(length for _, length in cuts)
    hosts = [torch.empty(longest, dtype=flat.dtype, pin_memory=True) for _ in range(min(SLOTS, len(cuts)))]
    fetched: list[Any] = [None] * len(cuts)
    stored: list[Any] = [None] * len(cuts)

    def host(i: int, slot: int) -> Any:
        return hosts[slot][:cuts[i][1]]

    def start_fetch(i: int, slot: int, after: int | None) -> None:
        start, length = cuts[i]
        with torch.cuda.stream(down):
            down.wait_event(ready if after is None else stored[after])
            if fetch:
                host(i, slot).copy_(flat[start:start + length], non_blocking=True)
            fetched[i] = torch.cuda.Event()
            fetched[i].record(down)

    def start_store(i: int, slot: int) -> None:
        start, length = cuts[i]
        with torch.cuda.stream(up):
            if out is not None:
                out[start:start + length].copy_(host(i, slot), non_blocking=True)
            stored[i] = torch.cuda.Event()
            stored[i].record(up)

    try:
        schedule(len(cuts), start_fetch, lambda i: fetched[i].synchronize(),
                 lambda i, slot: transfer(i, host(i, slot)), start_store)
    finally:  # also after a failed transfer: no copy may still run into or out of the slots when they go
        down.synchronize()
        up.synchronize()

"""A ring allreduce cut into segments, so that a step's transfers and its reductions overlap.

The device ring (hybridpipe.collectives.allreduce, CUDA buffers on a CUDA-aware MPI) runs the textbook ring: a
reduce-scatter of ``n − 1`` steps, in each of which a rank sends one chunk to its right neighbour, receives
one from its left and reduces it into its own, then an allgather of ``n − 1`` steps that passes the
completed chunks around. Run step by step, the link idles while the GPU reduces and the GPU idles while the
link carries. Here each chunk is cut into segments (the same cut on every rank, so segment *k* meets segment
*k*), every receive of a step is posted at once, and

* the reduction of segment *k* starts as soon as segment *k* has arrived, while *k + 1* is still on the way;
* a segment the next step sends leaves as soon as its own reduction has finished, not when the whole chunk
  has (and in the allgather, as soon as it has arrived);

    step s   recv | 0 | 1 | 2 |
             reduce   | 0 | 1 | 2 |
    step s+1 send         | 0 | 1 | 2 |

The transfers and the reduction are passed in as functions, so the order is the same whatever moves the
bytes: :func:`ring_allreduce` runs on CPU tensors over mpi4py in the tests, and on device memory with the
GPU kernels in the device ring. Receives land in two scratch chunks used by alternate steps: a step's scratch
is refilled two steps later, by when every segment's reduction out of it has finished (the step between
waited for them before sending).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["chunk_bounds", "segment_bounds", "ring_allreduce"]


def chunk_bounds(count: int, size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the ``size`` chunks of a buffer of ``count`` elements: as equal as can be, the first
    ``count mod size`` one element longer, in order, covering the buffer once."""
    if count < 0 or size < 1:
        raise ValueError(f"chunk_bounds: count={count}, size={size}")
    base, extra = divmod(count, size)
    return [(i * base + min(i, extra), base + (1 if i < extra else 0)) for i in range(size)]


def segment_bounds(length: int, per_segment: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the segments of a chunk of ``length`` elements, each at most ``per_segment`` (at least
    one element); none for an empty chunk."""
    if length < 0 or per_segment < 1:
        raise ValueError(f"segment_bounds: length={length}, per_segment={per_segment}")
    return [(start, min(per_segment, length - start)) for start in range(0, length, per_segment)]


def ring_allreduce(flat: Any, scratch: Sequence[Any], rank: int, size: int, per_segment: int,
                   isend: Callable[[Any, int, int], Any], irecv: Callable[[Any, int, int], Any],
                   wait: Callable[[Any], None], reduce: Callable[[Any, Any], Any],
                   reduced: Callable[[Any], None], tags: tuple[int, int] = (7101, 7102)) -> None:
    """Ring allreduce of the 1-D ``flat`` in place (the reduction's operator is ``reduce``'s), segment by segment.

    Args:
        flat: this rank's buffer, sliced as ``flat[a:b]``; the result replaces it.
        scratch: two buffers of at least the longest chunk's length, of ``flat``'s kind (received segments).
        rank, size: this rank's place in the ring and the ring's length.
        per_segment: elements per segment (the same on every rank).
        isend(view, dest, tag) / irecv(view, source, tag): start a transfer, return its request.
        wait(request): wait until the request has completed.
        reduce(target, source): start reducing ``source`` into ``target`` (the same length); returns a handle.
        reduced(handle): wait until that reduction has finished (before its result is sent).
        tags: the reduce-scatter's and the allgather's message tags.
    """
    if size < 2:
        return
    chunks = chunk_bounds(flat.shape[0], size)
    right, left = (rank + 1) % size, (rank - 1) % size

    def view(chunk: int, segment: tuple[int, int]) -> Any:
        start = chunks[chunk][0] + segment[0]
        return flat[start:start + segment[1]]

    sends: list[Any] = []
    chunk_sends: dict[int, list[Any]] = {}  # chunk -> the reduce-scatter's sends out of it
    pending: dict[int, Any] = {}  # segment -> the handle of its reduction into the chunk sent next
    for step in range(size - 1):  # reduce-scatter: afterwards chunk rank + 1 is complete here
        outgoing, incoming = (rank - step) % size, (rank - step - 1) % size
        received = scratch[step % 2]
        in_segments = segment_bounds(chunks[incoming][1], per_segment)
        receives = [irecv(received[a:a + n], left, tags[0]) for a, n in in_segments]
        for k, segment in enumerate(segment_bounds(chunks[outgoing][1], per_segment)):
            if k in pending:  # reduced in the step before: finished before it leaves
                reduced(pending.pop(k))
            chunk_sends.setdefault(outgoing, []).append(isend(view(outgoing, segment), right, tags[0]))
        for k, (request, segment) in enumerate(zip(receives, in_segments)):
            wait(request)
            pending[k] = reduce(view(incoming, segment), received[segment[0]:segment[0] + segment[1]])
    arrived: dict[int, Any] = {}  # segment -> the receive of it into the chunk sent next
    for step in range(size - 1):  # allgather of the complete chunks
        outgoing, incoming = (rank + 1 - step) % size, (rank - step) % size
        in_segments = segment_bounds(chunks[incoming][1], per_segment)
        for request in chunk_sends.pop(incoming, []):  # a send buffer is not written before its send is done
            wait(request)
        receives = [irecv(view(incoming, segment), left, tags[1]) for segment in in_segments]
        for k, segment in enumerate(segment_bounds(chunks[outgoing][1], per_segment)):
            if k in pending:  # step 0 sends chunk rank + 1: the last reduce-scatter step's reductions
                reduced(pending.pop(k))
            elif k in arrived:
                wait(arrived.pop(k))
            sends.append(isend(view(outgoing, segment), right, tags[1]))
        arrived = dict(enumerate(receives))
    for request in arrived.values():
        wait(request)
    for request in sends + [r for requests in chunk_sends.values() for r in requests]:
        wait(request)

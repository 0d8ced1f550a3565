"""The segmented ring allreduce (hybridpipe.comm.ring) on CPU tensors over mpi4py: the same function, in the same
order, drives the device ring on GPUs (hybridpipe.comm.reduction._device_ring_allreduce). Its reductions here
are lazy — a reduction is carried out only when the ring says it waits for it — so a segment sent before its
reduction was waited for, or a scratch chunk refilled before the reduction reading it ran, gives a wrong sum.
Each ring and its checks run in a ``ranks_agree`` block: a check failing on one rank fails every rank there, and a
rank left in the ring by an exception on another makes the others abort the launch, not hang."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from agree import ranks_agree
from hybridpipe.comm import ring
from hybridpipe.comm.context import call

pytestmark = pytest.mark.mpi(ranks=[2, 4], long_ranks=[3], timeout=120, shared=True)  # 4: steps to order


def contribution(rank: int, count: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s buffer: small integers in float64, so every sum is exact and any rank can rebuild it."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-50, 50, (count,), generator=generator).double()


class LazyReductions:
    """``reduce`` and ``reduced`` for ring_allreduce: a reduction runs when it is waited for, reading its source
    then; ``done`` counts them."""

    def __init__(self, op):
        self.op, self.done, self.started = op, 0, 0

    def reduce(self, target, source):
        self.started += 1
        assert target.shape == source.shape
        return [target, source, False]

    def reduced(self, handle):
        target, source, finished = handle
        if not finished:
            target.copy_(self.op(target, source))
            handle[2] = True
            self.done += 1


def run_ring(flat, per_segment, comm, op=torch.add):
    lazy = LazyReductions(op)
    longest = max(length for _, length in ring.chunk_bounds(flat.shape[0], comm.size))
    scratch = [torch.full((longest,), float("nan"), dtype=flat.dtype) for _ in range(2)]

    def work():
        ring.ring_allreduce(flat, scratch, comm.rank, comm.size, per_segment,
                            isend=lambda view, dest, tag: comm.Isend(view.numpy(), dest=dest, tag=tag),
                            irecv=lambda view, source, tag: comm.Irecv(view.numpy(), source=source, tag=tag),
                            wait=lambda request: request.Wait(), reduce=lazy.reduce, reduced=lazy.reduced)

    call(None, "ring test", work)
    return lazy


@pytest.fixture(scope="module")
def comm():
    world = MPI.COMM_WORLD.Dup()
    yield world
    world.Free()


@pytest.mark.parametrize("count", [0, 1, 2, 5, 7, 1000, 1001])
@pytest.mark.parametrize("per_segment", [1, 3, 64, 1 << 20])
def test_the_segmented_ring_sums_exactly_for_any_length_and_segment(comm, count, per_segment):
    seed = count * 7 + per_segment
    flat = contribution(comm.rank, count, seed)
    with ranks_agree(comm):
        lazy = run_ring(flat, per_segment, comm)
        expected = sum(contribution(r, count, seed) for r in range(comm.size))
        assert torch.equal(flat, expected)
        assert lazy.done == lazy.started  # every reduction the ring started, it waited for
        # the reduce-scatter reduces n - 1 chunks, each in its segments
        chunks = ring.chunk_bounds(count, comm.size)
        incoming = [(comm.rank - step - 1) % comm.size for step in range(comm.size - 1)]
        assert lazy.started == sum(len(ring.segment_bounds(chunks[c][1], per_segment)) for c in incoming)


def test_the_reduction_is_the_one_passed_in(comm):
    flat = contribution(comm.rank, 37, 3)
    with ranks_agree(comm):
        run_ring(flat, 4, comm, op=torch.maximum)
        assert torch.equal(flat, torch.stack([contribution(r, 37, 3) for r in range(comm.size)]).amax(0))


@ranks_agree()
def test_the_cut_is_the_same_on_every_rank_and_covers_the_buffer_once():
    assert ring.chunk_bounds(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert ring.chunk_bounds(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert ring.segment_bounds(7, 3) == [(0, 3), (3, 3), (6, 1)]
    assert ring.segment_bounds(0, 3) == []
    for count in range(0, 40):
        for size in range(1, 6):
            bounds = ring.chunk_bounds(count, size)
            assert [start for start, _ in bounds] == [sum(n for _, n in bounds[:i]) for i in range(size)]
            assert sum(n for _, n in bounds) == count and max(n for _, n in bounds) - min(n for _, n in bounds) <= 1
    with pytest.raises(ValueError, match="per_segment=0"):
        ring.segment_bounds(4, 0)
    with pytest.raises(ValueError, match="size=0"):
        ring.chunk_bounds(4, 0)


class _HostEvent:
    """torch.cuda.Event's part the device ring uses, for host memory: recorded and waited for, in order."""

    log: list = []

    def record(self, stream) -> None:
        self.log.append(("record", id(self)))

    def synchronize(self) -> None:
        self.log.append(("synchronize", id(self)))


@pytest.mark.parametrize("op", ["Sum", "Average", "Max"])
def test_the_device_ring_runs_the_segmented_ring_with_the_device_steps_in_place(comm, monkeypatch, op):
    """The device ring's own wiring — its scratch, its cut of HYBRIDPIPE_DEVICE_RING_SEGMENT_BYTES into elements, the
    reduction kernel's arguments, the event waited for before a reduced segment is sent, the tags, Average's
    division — run on host memory: the CUDA calls are swapped for host ones, MPI reads host pointers the same way."""
    import hybridpipe as hp
    from hybridpipe.comm import reduction

    ops = {"Sum": torch.add, "Average": torch.add, "Max": torch.maximum}
    kernels = []

    def reduce_on_host(accumulator, incoming, reduce_op):
        kernels.append(reduce_op)
        accumulator.copy_(ops[op](accumulator, incoming))

    _HostEvent.log = []
    monkeypatch.setattr(reduction, "reduce_on_device", reduce_on_host)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    flat = contribution(comm.rank, 1001, 11).float().reshape(7, 143)  # any shape: flattened in place
    expected = torch.stack([contribution(r, 1001, 11).float() for r in range(comm.size)])
    expected = expected.amax(0) if op == "Max" else expected.sum(0) / (comm.size if op == "Average" else 1)
    with ranks_agree(comm):
        call(None, "device ring test", lambda: reduction._device_ring_allreduce(flat, getattr(hp, op), comm, 64))
        assert torch.equal(flat.reshape(-1), expected)
        per = 64 // 4  # 16 float32 elements a segment
        chunks = ring.chunk_bounds(1001, comm.size)
        incoming = [(comm.rank - step - 1) % comm.size for step in range(comm.size - 1)]
        assert len(kernels) == sum(len(ring.segment_bounds(chunks[c][1], per)) for c in incoming)
        assert set(kernels) == {getattr(hp, op)}
        recorded = [e for kind, e in _HostEvent.log if kind == "record"]
        assert len(recorded) == len(kernels) and sorted(e for kind, e in _HostEvent.log if kind == "synchronize") == \
            sorted(recorded)  # every reduction's event is waited for, once

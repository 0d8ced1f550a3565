"""The staged route's arithmetic and order (hybridpipe.comm.staging), with the copies and the transfer passed in as
functions that record what they were asked to do: the cut covers a buffer once, and the schedule overlaps the
copies with the transfer without ever reading a slot before it is filled or refilling it before it is emptied.
The same schedule drives the CUDA copies in tests/gpu."""

from __future__ import annotations

import numpy as np
import pytest

from hybridpipe.comm import staging


@pytest.mark.parametrize("count, itemsize, segment, expected", [
    (0, 4, 16, []),
    (1, 4, 16, [(0, 1)]),
    (10, 4, 16, [(0, 4), (4, 4), (8, 2)]),
    (8, 4, 16, [(0, 4), (4, 4)]),
    (3, 8, 4, [(0, 1), (1, 1), (2, 1)]),  # a segment smaller than an element still moves one element
    (7, 2, 6, [(0, 3), (3, 3), (6, 1)]),
])
def test_segments_cut_a_buffer_in_order_covering_it_once(count, itemsize, segment, expected):
    assert staging.segments(count, itemsize, segment) == expected


def test_segments_cover_random_buffers_exactly_within_the_size():
    rng = np.random.default_rng(7)
    for _ in range(200):
        count, itemsize, segment = int(rng.integers(0, 5000)), int(rng.choice([1, 2, 4, 8])), int(rng.integers(1, 900))
        cuts = staging.segments(count, itemsize, segment)
        assert sum(length for _, length in cuts) == count
        assert [start for start, _ in cuts] == list(np.cumsum([0] + [length for _, length in cuts])[:-1])
        assert all(1 <= length and (length * itemsize <= segment or length == 1) for _, length in cuts)
        assert all(length == cuts[0][1] for _, length in cuts[:-1])  # every rank cuts alike: equal but the last


def test_segments_refuse_a_bad_size():
    with pytest.raises(ValueError, match="segment_bytes=0"):
        staging.segments(4, 4, 0)


class Recorder:
    """The four steps, recorded, with the state a real run has: what each slot holds and whether a copy of it
    has finished (the copies finish only when waited for, the most adversarial timing)."""

    def __init__(self, n: int, slots: int) -> None:
        self.n, self.slots = n, slots
        self.log: list[tuple] = []
        self.slot_holds: dict[int, int | None] = {s: None for s in range(slots)}
        self.fetched: set[int] = set()
        self.stored: set[int] = set()
        self.pending_store: dict[int, int] = {}  # slot -> segment whose copy up out of it is queued

    def fetch(self, i: int, slot: int, after: int | None) -> None:
        self.log.append(("fetch", i, slot, after))
        # refilling a slot must be ordered after the copy up of the segment it held
        queued = self.pending_store.get(slot)
        assert queued == after, f"fetch {i} into slot {slot} after {after}, but its last store was {queued}"
        self.slot_holds[slot] = i

    def wait_fetched(self, i: int) -> None:
        self.log.append(("wait", i))
        self.fetched.add(i)

    def transfer(self, i: int, slot: int) -> None:
        assert i in self.fetched, f"segment {i} transferred before its copy down was waited for"
        assert self.slot_holds[slot] == i, f"slot {slot} holds {self.slot_holds[slot]}, not {i}"
        self.log.append(("transfer", i, slot))

    def store(self, i: int, slot: int) -> None:
        assert ("transfer", i, slot) in self.log
        self.log.append(("store", i, slot))
        self.pending_store[slot] = i
        self.stored.add(i)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_the_schedule_moves_every_segment_once_in_order_without_reusing_a_busy_slot(n, slots):
    r = Recorder(n, slots)
    staging.schedule(n, r.fetch, r.wait_fetched, r.transfer, r.store, slots=slots)
    transfers = [entry[1] for entry in r.log if entry[0] == "transfer"]
    assert transfers == list(range(n))
    assert r.stored == set(range(n))
    assert sorted(entry[1] for entry in r.log if entry[0] == "fetch") == list(range(n))


def test_double_buffering_overlaps_the_next_copy_down_and_the_last_copy_up_with_each_transfer():
    r = Recorder(5, 2)
    staging.schedule(5, r.fetch, r.wait_fetched, r.transfer, r.store)
    position = {entry: k for k, entry in enumerate(r.log)}
    for i in range(4):
        slot = i % 2
        next_fetch = next(e for e in r.log if e[0] == "fetch" and e[1] == i + 1)
        # segment i + 1 is already on its way down while segment i is transferred
        assert position[next_fetch] < position[("transfer", i, slot)]
        # and segment i's copy up is queued before segment i + 1 is transferred
        assert position[("store", i, slot)] < position[("transfer", i + 1, (i + 1) % 2)]
    assert [e for e in r.log if e[0] == "fetch"] == [
        ("fetch", 0, 0, None), ("fetch", 1, 1, None), ("fetch", 2, 0, 0), ("fetch", 3, 1, 1), ("fetch", 4, 0, 2)]


def test_one_slot_serializes_and_a_bad_slot_count_is_refused():
    r = Recorder(3, 1)
    staging.schedule(3, r.fetch, r.wait_fetched, r.transfer, r.store, slots=1)
    assert [e[0] for e in r.log] == ["fetch", "wait", "transfer", "store"] * 2 + ["fetch", "wait", "transfer", "store"]
    with pytest.raises(ValueError, match="slots=0"):
        staging.schedule(3, r.fetch, r.wait_fetched, r.transfer, r.store, slots=0)


def test_a_failed_transfer_stops_the_schedule_there():
    r = Recorder(4, 2)

    def failing(i: int, slot: int) -> None:
        if i == 1:
            raise RuntimeError("the link went down")
        r.transfer(i, slot)

    with pytest.raises(RuntimeError, match="link went down"):
        staging.schedule(4, r.fetch, r.wait_fetched, failing, r.store)
    assert r.stored == {0}


def test_ready_events_only_for_cuda_tensors():
    import torch

    assert staging.ready_event(torch.ones(2)) is None
    assert staging.ready_event(np.ones(2)) is None
    if torch.cuda.is_available():
        assert staging.ready_event(torch.ones(2, device="cuda")) is not None

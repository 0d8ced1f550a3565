"""Horovod's torch API under ``import hybridpipe as hvd``: every keyword, the collectives Horovod has beyond
allreduce (alltoall, reducescatter, grouped allgather, async forms), Product / Adasum, process sets,
gradients through the collectives, the timeline calls, and errors raised on every rank.

Each rank computes every rank's input from its rank number, so references need no communication. A test's
collectives come first in each ``ranks_agree`` block and its checks after them, so that a check failing on one
rank fails every rank there, with that rank's message, instead of leaving the others in the next collective.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hybridpipe as hvd
from agree import ranks_agree

pytestmark = pytest.mark.mpi(ranks=[2], long_ranks=[3], timeout=240, shared=True)

N, R = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank
TRIANGLE = N * (N + 1) / 2  # sum over ranks of (rank + 1)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.shutdown()


def rows_of(rows: int) -> list[int]:
    """Horovod's reducescatter split: the first rows % N ranks get one more row."""
    return [rows // N + (1 if r < rows % N else 0) for r in range(N)]


# ------------------------------------------------------------------ allreduce family


def test_allreduce_keywords():
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3) + R
    total = N * torch.arange(6, dtype=torch.float64).reshape(2, 3) + N * (N - 1) / 2
    with ranks_agree(what="name=, process_set="):
        named = hvd.allreduce(x, name="sum", op=hvd.Sum)
        in_set = hvd.allreduce(x, op=hvd.Sum, process_set=hvd.global_process_set)
        assert torch.equal(named, total) and torch.equal(in_set, total)
        assert torch.equal(x, torch.arange(6, dtype=torch.float64).reshape(2, 3) + R)  # untouched
    with ranks_agree(what="average=True"), pytest.warns(
            DeprecationWarning, match=r"hp.allreduce: average= is deprecated \(as in Horovod\); pass op="):
        averaged = hvd.allreduce(x, average=True)
    with ranks_agree(what="average=False"), pytest.warns(DeprecationWarning):
        summed = hvd.allreduce(x, average=False)
    with ranks_agree(what="average="):
        torch.testing.assert_close(averaged, total / N)
        assert torch.equal(summed, total)
    with ranks_agree(what="average= and op="), pytest.raises(
            ValueError, match=r"op= supersedes the deprecated average=.*average=True, op=<ReduceOp.Sum"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with ranks_agree(what="prescale_factor, postscale_factor"):
        both = hvd.allreduce(x, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.25)
        prescaled = hvd.allreduce(x, prescale_factor=2.0)
        ints = hvd.allreduce(torch.tensor([3, -3, 5], dtype=torch.int64), op=hvd.Sum, prescale_factor=0.5)
        torch.testing.assert_close(both, total * 0.75)
        torch.testing.assert_close(prescaled, total / N * 2)
        assert ints.tolist() == [N, -N, 2 * N]  # truncated: 1, -1, 2
    with ranks_agree(what="group= and process_set="), pytest.raises(
            ValueError, match=r"group= or as process_set=, not both \(got group='world' and "
                              r"process_set=ProcessSet\(process_set_id=0"):
        hvd.allreduce(x, group="world", process_set=hvd.global_process_set)
    with ranks_agree(what="process_set='data'"), pytest.raises(
            TypeError, match=r"process_set must be a hp.ProcessSet .* got str; for 'data'"):
        hvd.allreduce(x, process_set="data")
    with ranks_agree(what="compression"):
        half = hvd.allreduce(x.float(), op=hvd.Sum, compression=hvd.Compression.fp16)
        array = hvd.allreduce(x.numpy(), op=hvd.Sum, compression=hvd.Compression.fp16, name="numpy")
        assert half.dtype == torch.float32 and torch.equal(half, total.float())
        assert array.dtype == np.float64 and np.array_equal(array, total.numpy())


def test_allreduce_in_place_async_and_grouped_keywords():
    base = torch.arange(4, dtype=torch.float32) + R
    total = N * torch.arange(4, dtype=torch.float32) + N * (N - 1) / 2
    t = base.clone()
    with ranks_agree(what="allreduce_, allreduce_async"):
        returned = hvd.allreduce_(t, name="in_place", op=hvd.Sum, postscale_factor=2.0)
        handle = hvd.allreduce_async(base, name="async", op=hvd.Sum, prescale_factor=2.0,
                                     process_set=hvd.global_process_set)
        polled = hvd.poll(handle)
        synchronized = hvd.synchronize(handle)
        assert returned is t and torch.equal(t, 2 * total)
        assert handle.name == "async" and polled in (True, False)
        assert torch.equal(synchronized, 2 * total) and torch.equal(base, torch.arange(4.0) + R)
        assert hvd.poll(handle) is True
    t = base.clone()
    with ranks_agree(what="allreduce_async_(average=False)"), pytest.warns(DeprecationWarning):
        handle = hvd.allreduce_async_(t, average=False, name="async_")
    with ranks_agree(what="allreduce_async_"):
        synchronized = hvd.synchronize(handle)
        unnamed = hvd.allreduce_async_(base.clone(), postscale_factor=0.5).wait()  # unnamed, Average
        assert synchronized is t and torch.equal(t, total)
        torch.testing.assert_close(unnamed, total / N / 2)
    pair = [base, base.double().reshape(2, 2)]
    with ranks_agree(what="grouped_allreduce Max"):
        maxima = hvd.grouped_allreduce(pair, name="grouped", op=hvd.Max, process_set=hvd.global_process_set)
        assert torch.equal(maxima[0], torch.arange(4.0) + N - 1) and maxima[1].dtype == torch.float64
    with ranks_agree(what="grouped_allreduce(average=True)"), pytest.warns(DeprecationWarning):
        averaged = hvd.grouped_allreduce(pair, average=True, compression=hvd.Compression.fp16)
    copies = [p.clone() for p in pair]
    with ranks_agree(what="grouped_allreduce_, grouped_allreduce_async"):
        first = hvd.grouped_allreduce_(copies, op=hvd.Sum, prescale_factor=2.0)[0]
        results = hvd.synchronize(hvd.grouped_allreduce_async(pair, name="grouped_async", op=hvd.Sum))
        assert averaged[1].dtype == torch.float64
        torch.testing.assert_close(averaged[1], (total / N).double().reshape(2, 2))
        assert first is copies[0] and torch.equal(copies[0], 2 * total)
        assert torch.equal(results[0], total) and torch.equal(results[1], total.double().reshape(2, 2))
    copies = [p.clone() for p in pair]
    with ranks_agree(what="grouped_allreduce_async_"):
        handle = hvd.grouped_allreduce_async_(copies, name="grouped_async_", postscale_factor=N)
        assert handle.wait()[1] is copies[1] and torch.equal(copies[0], total)


def test_product_through_the_library_and_adasum_needs_a_power_of_two():
    product = float(np.prod([r + 2 for r in range(N)]))
    array = np.full(2, R + 2.0, dtype=np.float16)
    with ranks_agree(what="Product"):
        floats = hvd.allreduce(torch.full((5,), R + 2.0), op=hvd.Product)
        ints = hvd.allreduce(torch.full((3,), R + 2, dtype=torch.int64), op=hvd.Product)
        halves = hvd.allreduce(torch.full((4,), R + 2.0, dtype=torch.bfloat16), op=hvd.Product)
        returned = hvd.allreduce_(array, op=hvd.Product)
        waited = hvd.allreduce_async(torch.full((2,), R + 2.0), name="product", op=hvd.Product).wait()
        grouped = hvd.grouped_allreduce([torch.full((2,), R + 2.0), torch.full((1,), R + 2, dtype=torch.int32)],
                                        op=hvd.Product)
        assert torch.equal(floats, torch.full((5,), product))
        assert ints.tolist() == [product] * 3
        assert halves.dtype == torch.bfloat16 and halves.float().tolist() == [product] * 4
        assert returned is array and array.tolist() == [product] * 2
        assert waited.tolist() == [product] * 2
        assert grouped[0].tolist() == [product] * 2 and grouped[1].tolist() == [product]
    if N & (N - 1):  # Adasum needs a power-of-two group, as Horovod's: a ValueError on every rank
        with ranks_agree(what="Adasum on a group not a power of two"), pytest.raises(
                ValueError, match=rf"op=hp.Adasum needs a power-of-two number of ranks.*has {N}\)"):
            hvd.allreduce(torch.ones(3), op=hvd.Adasum)
    with ranks_agree(what="mismatched op"), pytest.raises(
            hvd.MismatchError, match=r"rank 0: shape=\(3,\) dtype=float32 op=Product; rank 1: .* op=Sum"):
        hvd.allreduce(torch.ones(3), op=hvd.Product if R == 0 else hvd.Sum)


def adasum_tree(vectors: list[np.ndarray]) -> np.ndarray:
    """Horovod's Adasum over ranks in numpy: pairs (lower rank first) combined level by level."""
    def pair(a, b):
        dot = a @ b
        return a * (1 - dot / (2 * (a @ a))) + b * (1 - dot / (2 * (b @ b)))

    level = [v.astype(np.float64) for v in vectors]
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def test_adasum_matches_the_numpy_tree():
    if N & (N - 1):
        pytest.skip("Adasum needs a power-of-two group")
    generator = np.random.default_rng(5)
    vectors = [generator.standard_normal(40) for _ in range(N)]
    vectors[-1] = vectors[0] * 2  # a parallel pair too
    want = adasum_tree(vectors)
    mine = torch.tensor(vectors[R], dtype=torch.float64)
    orthogonal = torch.zeros(N, dtype=torch.float64)
    orthogonal[R] = 1.0
    with ranks_agree(what="Adasum"):
        got = hvd.allreduce(mine, op=hvd.Adasum)
        waited = hvd.allreduce_async(mine.float(), name="adasum", op=hvd.Adasum).wait()
        grouped = hvd.grouped_allreduce([mine.reshape(5, 8), torch.ones(3) * (R + 1)], op=hvd.Adasum)
        added = hvd.allreduce(orthogonal, op=hvd.Adasum)
        averaged = hvd.allreduce(torch.full((4,), 3.0), op=hvd.Adasum)
        torch.testing.assert_close(got, torch.tensor(want))
        torch.testing.assert_close(waited, torch.tensor(want, dtype=torch.float32))
        torch.testing.assert_close(grouped[0], torch.tensor(want).reshape(5, 8))
        torch.testing.assert_close(grouped[1].double(),
                                   torch.tensor(adasum_tree([np.ones(3) * (r + 1) for r in range(N)])))
        # orthogonal vectors add, identical ones average: Adasum's two limits
        assert added.tolist() == [1.0] * N
        assert averaged.tolist() == [3.0] * 4
    with ranks_agree(what="Adasum of ints"), pytest.raises(TypeError, match=r"op=hp.Adasum combines floating-point"):
        hvd.allreduce(torch.ones(2, dtype=torch.int64), op=hvd.Adasum)


# ------------------------------------------------------------------ broadcast, allgather


def test_broadcast_keywords_and_async():
    mine = torch.arange(4.0) * (R + 1)
    for root in range(N):
        want = torch.arange(4.0) * (root + 1)
        with ranks_agree(what=f"root {root}"):
            got = hvd.broadcast(mine, root, name=f"b{root}", process_set=hvd.global_process_set)
            synchronized = hvd.synchronize(hvd.broadcast_async(mine, root_rank=root, name=f"async{root}",
                                                               process_set=hvd.global_process_set))
            t, u = mine.clone(), mine.clone()
            waited = hvd.broadcast_async_(t, root).wait()  # unnamed
            returned = hvd.broadcast_(u, root, name="in_place")
            assert torch.equal(got, want)
            assert torch.equal(mine, torch.arange(4.0) * (R + 1))
            assert torch.equal(synchronized, want)
            assert waited is t and torch.equal(t, want)
            assert returned is u and torch.equal(u, want)
    with ranks_agree(what="mismatched names"), pytest.raises(
            hvd.MismatchError, match=r"rank 0: root_rank=0 shape=\(4,\) dtype=float32 name='n0'; "
                                     r"rank 1: root_rank=0 .* name='n1'"):
        hvd.broadcast(mine, 0, name=f"n{R}")


def test_allgather_keywords_async_and_grouped():
    mine = torch.full((R + 1, 2), float(R))
    want = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(N)])
    ints = torch.arange(R, dtype=torch.int32)  # rank 0 sends no rows
    wants = [want, torch.cat([torch.arange(r, dtype=torch.int32) for r in range(N)])]
    with ranks_agree(what="allgather"):
        gathered = hvd.allgather(mine, name="gather", process_set=hvd.global_process_set)
        synchronized = hvd.synchronize(hvd.allgather_async(mine, name="gather_async"))
        grouped = hvd.grouped_allgather([mine, ints], name="grouped")
        got = hvd.grouped_allgather_async([mine.numpy(), ints], name="grouped_async",
                                          process_set=hvd.global_process_set).wait()
        assert torch.equal(gathered, want)
        assert torch.equal(synchronized, want)
        for result, expected in zip(grouped, wants):
            assert torch.equal(result, expected)
        assert isinstance(got[0], np.ndarray) and np.array_equal(got[0], want.numpy())
        assert torch.equal(got[1], wants[1])
    with ranks_agree(what="mismatched groups"), pytest.raises(
            hvd.MismatchError, match=r"rank 0: \['first dim 1, then \(2,\) float32 ndim=2'\]; rank 1: "):
        hvd.grouped_allgather([mine] if R == 0 else [mine, ints])


# ------------------------------------------------------------------ alltoall


def test_alltoall_even_split_splits_async_and_errors():
    sent = (R * 100 + torch.arange(2 * N, dtype=torch.float32)).reshape(2 * N, 1).repeat(1, 3)
    want = torch.cat([(s * 100 + torch.arange(2 * R, 2 * R + 2, dtype=torch.float32)) for s in range(N)])
    # rank R sends r + 1 rows to rank r: everyone receives R + 1 rows from each rank
    splits = [r + 1 for r in range(N)]
    rows = torch.arange(sum(splits), dtype=torch.int64) + 1000 * R
    start = sum(splits[:R])
    with ranks_agree(what="alltoall"):
        even = hvd.alltoall(sent, name="even", process_set=hvd.global_process_set)
        got, received = hvd.alltoall(rows, splits=splits)
        array, array_received = hvd.synchronize(hvd.alltoall_async(rows.numpy(), splits=np.array(splits), name="a2a"))
        _, pair_received = hvd.alltoall_async(sent).wait()  # the pair, even without splits (Horovod's synchronize)
        assert torch.equal(even, want.reshape(-1, 1).repeat(1, 3))
        assert received.dtype == torch.int32 and received.tolist() == [R + 1] * N
        assert got.tolist() == [1000 * s + start + i for s in range(N) for i in range(R + 1)]
        assert isinstance(array, np.ndarray) and array_received.tolist() == [R + 1] * N
        assert pair_received.tolist() == [2] * N
    # splits that do not fit on one rank: a ValueError there, a MismatchError naming it on the others
    with ranks_agree(what="splits that do not fit"), pytest.raises(
            ValueError if R == 0 else hvd.MismatchError, match=r"splits \[6\] must be \d non-negative ints"):
        hvd.alltoall(torch.arange(6), splits=[6] if R == 0 else [6] + [0] * (N - 1))
    with ranks_agree(what="uneven without splits"), pytest.raises(
            ValueError, match=r"first dimension \(5\) does not split evenly over \d ranks; pass splits="):
        hvd.alltoall(torch.arange(N * 2 + 1 if N == 2 else 5))
    with ranks_agree(what="mismatched dtypes"), pytest.raises(
            hvd.MismatchError, match=r"rank 1: first dim 2, then \(\) float64"):
        hvd.alltoall(torch.ones(2, dtype=torch.float64 if R == 1 else torch.float32), splits=[2] + [0] * (N - 1))


# ------------------------------------------------------------------ reducescatter


def test_reducescatter_uneven_rows_ops_and_keywords():
    for rows in (7, 2 * N, 1):
        x = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) * (R + 1)
        total = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) * TRIANGLE
        counts = rows_of(rows)
        start = sum(counts[:R])
        mine = total[start:start + counts[R]]
        with ranks_agree(what=f"{rows} rows"):
            got = hvd.reducescatter(x, op=hvd.Sum, name=f"rs{rows}", process_set=hvd.global_process_set)
            averaged = hvd.reducescatter(x)  # default: Average, as in Horovod
            scaled = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
            assert got.shape == (counts[R], 3) and torch.equal(got, mine)
            torch.testing.assert_close(averaged, mine / N)
            torch.testing.assert_close(scaled, mine)
    ints = torch.full((N, 2), R + 1, dtype=torch.int64) * torch.tensor([1, -1])
    with ranks_agree(what="dtypes, grouped, async, numpy"):
        averaged = hvd.reducescatter(ints)  # sum N(N+1)/2, divided by N truncating toward zero
        half = hvd.reducescatter(torch.full((N, 4), 0.1 * (R + 1), dtype=torch.float16), op=hvd.Sum)
        compressed = hvd.reducescatter(torch.ones(N, 2, dtype=torch.float64), op=hvd.Sum,
                                       compression=hvd.Compression.fp16)
        grouped = hvd.grouped_reducescatter([torch.ones(5, 1) * (R + 1), torch.ones(N, dtype=torch.int32)],
                                            op=hvd.Sum)
        waited = hvd.reducescatter_async(torch.ones(N, 2), name="rs_async", process_set=hvd.global_process_set,
                                         postscale_factor=3.0).wait()
        synchronized = hvd.synchronize(hvd.grouped_reducescatter_async(
            [torch.ones(N), torch.ones(2 * N)], op=hvd.Sum, name="grs_async", process_set=hvd.global_process_set))
        array = hvd.reducescatter(np.ones((N, 2)), op=hvd.Sum)
        assert averaged.tolist() == [[int(TRIANGLE / N), -int(TRIANGLE / N)]]
        assert half.dtype == torch.float16
        assert abs(half.float()[0, 0].item() - 0.1 * TRIANGLE) < 0.1 * TRIANGLE * 2 ** -9
        assert compressed.dtype == torch.float64 and compressed.tolist() == [[float(N)] * 2]
        assert grouped[0].tolist() == [[TRIANGLE]] * rows_of(5)[R] and grouped[1].tolist() == [N]
        assert waited.tolist() == [[3.0, 3.0]]
        assert [t.tolist() for t in synchronized] == [[float(N)], [float(N)] * 2]
        assert np.array_equal(array, np.full((1, 2), float(N)))
    with ranks_agree(what="Max"), pytest.raises(
            hvd.NotSupportedError, match=r"op=hp.Sum or op=hp.Average \(got hp.Max\); for Min, Max"):
        hvd.reducescatter(torch.ones(N), op=hvd.Max)
    with ranks_agree(what="mismatched shapes"), pytest.raises(
            hvd.MismatchError, match=r"rank 0: op=Average \['shape=\(4,\) dtype=float32'\]; rank 1: "
                                     r"op=Average \['shape=\(5,\)"):
        hvd.reducescatter(torch.ones(4 + (R == 1)))


# ------------------------------------------------------------------ process sets


def test_process_sets_static_dynamic_and_from_a_communicator():
    hvd.shutdown()
    even, odd = hvd.ProcessSet(range(0, N, 2)), hvd.ProcessSet(list(range(1, N, 2)))
    halves = None
    with ranks_agree(what="before hp.init"):
        assert even.process_set_id is None and even.size() is None
    hvd.init(process_sets=[even, odd])
    try:
        mine, other = (even, odd) if R % 2 == 0 else (odd, even)
        with ranks_agree(what="registered at hp.init"):
            assert (even.process_set_id, odd.process_set_id) == (1, 2)
            assert hvd.global_process_set.ranks == list(range(N)) and hvd.global_process_set.size() == N
            assert mine.included() and not other.included()
            assert mine.rank() == R // 2 and mine.size() == len(mine.ranks)
            with pytest.raises(ValueError, match=rf"rank {R} is not in process set {other.process_set_id}"):
                other.rank()
        value = torch.tensor([float(R)])
        members = len(mine.ranks)
        with ranks_agree(what="collectives on a process set"):
            summed = hvd.allreduce(value, op=hvd.Sum, process_set=mine)
            as_group = hvd.allreduce(value, op=hvd.Sum, group=mine)  # two spellings
            broadcast = hvd.broadcast(value, root_rank=mine.ranks[-1], process_set=mine)  # a global root
            gathered = hvd.allgather(value, process_set=mine)
            maximum = hvd.allreduce_async(value, name="set", op=hvd.Max, process_set=mine).wait()
            exchanged = hvd.alltoall(value.repeat(members), process_set=mine)
            scattered = hvd.reducescatter(torch.ones(members, 2), op=hvd.Sum, process_set=mine)
            hvd.barrier(process_set=mine)
            hvd.barrier(process_set=hvd.global_process_set)
            assert summed.item() == sum(mine.ranks) and as_group.item() == sum(mine.ranks)
            assert broadcast.item() == mine.ranks[-1]
            assert gathered.tolist() == [float(r) for r in mine.ranks]
            assert maximum.item() == max(mine.ranks)
            assert exchanged.tolist() == [float(r) for r in mine.ranks]
            assert scattered.tolist() == [[members] * 2]
        with ranks_agree(what="a root outside the set"), pytest.raises(
                ValueError, match=rf"root_rank {other.ranks[0]} is not in the process set"):
            hvd.broadcast(value, root_rank=other.ranks[0], process_set=mine)
        with ranks_agree(what="another rank's set"), pytest.raises(
                ValueError, match=rf"rank {R} is not in process set {other.process_set_id}"):
            hvd.allreduce(value, process_set=other)

        with ranks_agree(what="remove_process_set"):
            removed = hvd.remove_process_set(odd)
            assert removed is True and odd.process_set_id is None
            assert hvd.remove_process_set(odd) is False and hvd.remove_process_set(hvd.global_process_set) is False
        with ranks_agree(what="a removed set"), pytest.raises(
                ValueError, match=r"is not registered: pass it to hp.init\(process_sets=\[...\]\) or "
                                  r"hp.add_process_set"):
            hvd.allreduce(value, process_set=odd)
        with ranks_agree(what="add_process_set again"):
            added = hvd.add_process_set(odd)
            summed = hvd.allreduce(value, op=hvd.Sum, process_set=mine)
            assert added is odd and odd.process_set_id == 3  # again: the thread's group is reused
            assert summed.item() == sum(mine.ranks)
        with ranks_agree(what="registered twice"), pytest.raises(
                ValueError, match=re.escape(f"ranks {even.ranks} is already registered (id 1; use process set 1)")):
            hvd.add_process_set(hvd.ProcessSet(even.ranks[::-1]))
        with ranks_agree(what="the global set"), pytest.raises(ValueError, match=r"that is hp.global_process_set"):
            hvd.add_process_set(range(N))
        with ranks_agree(what="different sets"), pytest.raises(
                hvd.MismatchError, match=r"rank 0: \[0\]; rank 1: \[0, 1\]"):
            hvd.add_process_set([0] if R == 0 else [0, 1])

        split = MPI.COMM_WORLD.Split(R % 2, R)
        try:
            with ranks_agree(what="a set from a communicator"):
                halves = hvd.add_process_set(hvd.ProcessSet(split))
                summed = hvd.allreduce(value, op=hvd.Sum, process_set=halves)
                assert halves.process_set_id == 4 and halves.ranks == mine.ranks and halves.rank() == split.rank
                assert summed.item() == sum(mine.ranks)
        finally:
            split.Free()
    finally:
        hvd.shutdown()
        unregistered = even.process_set_id is None and (halves is None or halves.process_set_id is None)
        hvd.init(MPI.COMM_WORLD, process_sets="dynamic")  # Horovod's positional comm
    with ranks_agree(what="after hp.shutdown"):
        assert unregistered


def test_grid_groups_are_process_sets():
    hvd.shutdown()
    grid = hvd.init(pipeline_stages=N)  # one pipeline of N stages: data sets are single ranks
    try:
        data, pipe = hvd.data_process_set(), hvd.pipe_process_set()
        value = torch.tensor([float(R + 1)])
        with ranks_agree():
            over_pipe = hvd.allreduce(value, op=hvd.Sum, process_set=pipe)
            over_data = hvd.allreduce(value, op=hvd.Sum, process_set=data)
            broadcast = hvd.broadcast(value, root_rank=N - 1, process_set=pipe)
            assert (data.process_set_id, data.ranks, data.rank()) == (-1, [R], 0)
            assert (pipe.process_set_id, pipe.ranks, pipe.rank(), pipe.size()) == (-2, list(range(N)), grid.stage, N)
            assert over_pipe.item() == TRIANGLE
            assert over_data.item() == R + 1
            assert broadcast.item() == N
            assert hvd.remove_process_set(pipe) is False
    finally:
        hvd.shutdown()
        hvd.init()


# ------------------------------------------------------------------ gradients


def test_gradients_of_allreduce_allgather_and_broadcast():
    x = (torch.arange(4, dtype=torch.float64) * (R + 1)).requires_grad_()
    with ranks_agree(what="allreduce Sum"):
        (hvd.allreduce(x, op=hvd.Sum) * (R + 1)).sum().backward()
        assert x.grad.tolist() == [TRIANGLE] * 4  # the Sum of every rank's gradient
    x.grad = None
    with ranks_agree(what="allreduce Average"):
        (hvd.allreduce(x, prescale_factor=2.0) * (R + 1)).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((4,), 2.0 * TRIANGLE / N, dtype=torch.float64))  # Average, x2
    x.grad = None
    with ranks_agree(what="grouped_allreduce"):
        a, b = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)
        (a.sum() + b.sum() * (R + 1)).backward()
        assert x.grad.tolist() == [N + 2 * TRIANGLE] * 4

    rows = torch.full((R + 1, 2), float(R), requires_grad=True)
    with ranks_agree(what="allgather"):
        gathered = hvd.allgather(rows)
        weights = torch.arange(gathered.numel(), dtype=torch.float32).reshape(gathered.shape) * (R + 1)
        (gathered * weights).sum().backward()
        start = sum(r + 1 for r in range(R))  # this rank's rows: the average over ranks of the weights (Horovod's)
        expected = torch.arange(gathered.numel(), dtype=torch.float32).reshape(gathered.shape) * TRIANGLE / N
        torch.testing.assert_close(rows.grad, expected[start:start + R + 1])
    rows.grad = None
    with ranks_agree(what="grouped_allgather"):
        first, second = hvd.grouped_allgather([rows, rows * 3])
        (first.sum() + second.sum()).backward()
        assert rows.grad.tolist() == [[4.0, 4.0]] * (R + 1)

    y = torch.full((3,), float(R), requires_grad=True)
    with ranks_agree(what="broadcast"):
        (hvd.broadcast(y, root_rank=N - 1) * (R + 1)).sum().backward()
        assert y.grad.tolist() == ([TRIANGLE / N] * 3 if R == N - 1 else [0.0] * 3)


def test_gradients_of_alltoall_and_reducescatter():
    x = torch.ones(2 * N, 1, requires_grad=True)
    weights = (torch.arange(2 * N, dtype=torch.float32) + 1).reshape(-1, 1) * (R + 1)
    with ranks_agree(what="alltoall"):
        (hvd.alltoall(x) * weights).sum().backward()
        # my rows 2r, 2r+1 went to rank r, landing at its positions 2R, 2R+1 (weights (r+1)(2R+1), (r+1)(2R+2))
        expected = [[(r + 1) * (2 * R + 1 + j)] for r in range(N) for j in range(2)]
        assert x.grad.tolist() == expected
    x.grad = None
    splits = [r + 1 for r in range(N)]
    z = torch.ones(sum(splits), requires_grad=True)
    with ranks_agree(what="alltoall with splits"):
        got, received = hvd.alltoall(z, splits=splits)
        (got * (R + 1)).sum().backward()
        assert not received.requires_grad
        assert z.grad.tolist() == [float(r + 1) for r in range(N) for _ in range(splits[r])]

    counts = rows_of(7)
    owner = [r for r in range(N) for _ in range(counts[r])]
    for op, scale in ((hvd.Sum, N), (hvd.Average, 1)):
        w = torch.ones(7, 2, requires_grad=True)
        with ranks_agree(what=f"reducescatter {op}"):
            (hvd.reducescatter(w, op=op, postscale_factor=2.0) * (R + 1)).sum().backward()
            # Horovod's: allgather, x N for Sum
            assert w.grad.tolist() == [[2.0 * scale * (o + 1)] * 2 for o in owner]
    v = torch.ones(N, requires_grad=True)
    with ranks_agree(what="grouped_reducescatter"):
        first, second = hvd.grouped_reducescatter([v, v * 2], op=hvd.Sum)
        (first.sum() + second.sum()).backward()
        assert v.grad.tolist() == [3.0 * N] * N


# ------------------------------------------------------------------ errors, timeline, queries


def test_failed_collectives_are_horovod_internal_errors_on_every_rank():
    with ranks_agree(what="different names"), pytest.raises(
            hvd.HorovodInternalError, match=r"rank 0: shape=\(2,\) dtype=float32 op=Average name='m0'; "
                                            r"rank 1: shape=\(2,\) dtype=float32 op=Average name='m1'"):
        hvd.allreduce(torch.ones(2), name=f"m{R}")
    handle = hvd.allreduce_async(torch.ones(2 + (R == 1)), name="bad")
    with ranks_agree(what="different shapes"), pytest.raises(
            hvd.MismatchError, match=r"'bad' on group 'world': ranks disagree"):
        handle.wait()
    handle = hvd.broadcast_async(torch.ones(2), 0, name="kind") if R == 0 else hvd.allgather_async(
        torch.ones(2), name="kind")
    with ranks_agree(what="different collectives"), pytest.raises(
            hvd.HorovodInternalError, match=r"ranks of the group called different collectives"):
        hvd.synchronize(handle)
    with ranks_agree(what="afterwards"):
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(N)] * 2  # still usable


def test_timeline_start_stop_and_queries():
    path = MPI.COMM_WORLD.bcast(os.path.join(tempfile.mkdtemp(), "trace.json") if R == 0 else None)
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3))
    hvd.allgather_async(torch.ones(1), name="traced").wait()
    hvd.stop_timeline()
    hvd.stop_timeline()  # nothing recording: nothing to do
    with ranks_agree():  # (the others wait there for rank 0's checks)
        if R == 0:
            try:
                events = json.loads(Path(path).read_text())["traceEvents"]
            finally:
                shutil.rmtree(Path(path).parent)
            collectives = [e for e in events if e.get("cat") == "collective"]
            assert {e["pid"] for e in collectives} == set(range(N))
            assert any(e["name"] == "allreduce" for e in collectives)
            assert any(e["name"] == "allgather_async" and e["args"] == {"name": "traced"} for e in collectives)
        assert hvd.mpi_threads_supported() is True and hvd.mpi_built() is True and hvd.mpi_enabled() is True
        assert isinstance(hvd.cuda_built(), bool)

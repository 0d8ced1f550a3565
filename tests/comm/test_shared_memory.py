"""The shared-memory allreduce (csrc/shm_allreduce.cpp) against numpy, the ring, and its switch.

All ranks of an mpirun on this machine share one host, so allreduces above the small-message
cutoff go through the segment by default. These tests pin that down, stream buffers through a
4 KiB chunk (hundreds of chunks, every slot set reused many times, pieces cut at odd places), and
check that HYBRIDPIPE_SHARED_MEMORY=0 really leaves the segment out.
"""

import hashlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe._ext import core
from hybridpipe.comm import context
from hybridpipe.config import Config

pytestmark = pytest.mark.mpi(ranks=[3], long_ranks=[4], timeout=300, shared=True)  # one 3-rank launch with test_collective_errors

DTYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3, "int32": 4, "int64": 5}
OPS = {"sum": 0, "average": 1, "min": 2, "max": 3}


@pytest.fixture(autouse=True)
def runtime():
    hp.init()
    yield
    hp.shutdown()


def contribution(seed, count, dtype, rank):
    rng = np.random.default_rng([seed, rank, count])
    if dtype.startswith("int"):
        values = rng.integers(-1000, 1000, count).astype(np.float64)
    else:
        values = rng.standard_normal(count) * 4
    return torch.tensor(values).to(getattr(torch, dtype))


def reference(tensors, op, dtype):
    stacked = torch.stack([t.double() for t in tensors]).numpy()
    if op == "min":
        return stacked.min(0)
    if op == "max":
        return stacked.max(0)
    total = stacked.sum(0)
    if op == "sum":
        return total
    return np.trunc(total / len(tensors)) if dtype.startswith("int") else total / len(tensors)


def check(got, want, dtype, op, roundings=None):
    """`roundings` (half types only): when given, the result may come from MPI_Allreduce, whose half-type op
    rounds each combining step (up to `roundings` of them, each within half an ulp of its partial sum), so it
    is held to that bound, taken over the sum of magnitudes `roundings[1]`; by default it was summed in
    float32 and rounded once (the segment, the ring): within one ulp of the exact sum."""
    got = got.double().numpy()
    if dtype.startswith("int") or op in ("min", "max"):
        np.testing.assert_array_equal(got, want)
    elif dtype in ("float16", "bfloat16"):
        ulp = 2.0 ** -10 if dtype == "float16" else 2.0 ** -7
        if roundings is None:
            assert np.all(np.abs(got - want) <= np.maximum(np.abs(want) * ulp, 2.0 ** -24))
        else:
            steps, magnitude = roundings
            bound = steps * (magnitude * ulp / 2 * 1.01 + 2.0 ** -24)
            assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) - bound)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == "float32" else 1e-12, atol=1e-5)


def same_on_every_rank(comm, tensor):
    digest = hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    digests = comm.allgather(digest)
    assert len(set(digests)) == 1, f"ranks disagree on the result: {digests}"


def small_chunk_comm(chunk_bytes=4096):
    """A fresh communicator whose segment streams in `chunk_bytes` chunks (fixed at creation)."""
    comm = MPI.COMM_WORLD.Dup()
    options = core().AllreduceOptions()
    options.shared_memory_chunk_bytes = chunk_bytes
    info = core().shared_memory_info(comm.py2f(), options)
    return comm, options, info


def test_every_rank_of_one_host_gets_a_segment():
    n = MPI.COMM_WORLD.size
    comm, options, info = small_chunk_comm(128 * 1024)
    try:
        assert info["available"] is True and info["reason"] == ""
        assert info["chunk_bytes"] == 128 * 1024 and info["sets"] == 4
        header = -(-n * 3 * 64 // 4096) * 4096  # one 64-byte counter line per rank and kind, page-rounded
        assert info["mapped_bytes"] == header + 4 * (n + 1) * 128 * 1024
    finally:
        comm.Free()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_shared_memory_matches_numpy_across_hundreds_of_chunks(dtype):
    comm, options, info = small_chunk_comm()
    assert info["chunk_bytes"] == 4096
    rank, n = comm.rank, comm.size
    try:
        # one element, a chunk and a bit, an odd count over ~200 chunks (pieces not multiples of anything)
        for count in (1, 4096 // torch.tensor([], dtype=getattr(torch, dtype)).element_size() + 3, 200_003):
            for op, code in OPS.items():
                tensors = [contribution(count, count, dtype, r) for r in range(n)]
                mine = tensors[rank].clone()
                out = torch.empty_like(mine)
                core().allreduce(mine.data_ptr(), out.data_ptr(), count, DTYPES[dtype], code, comm.py2f(), options,
                                 [], core().AllreduceAlgorithm.SharedMemory)
                check(out, reference(tensors, op, dtype), dtype, op)
                assert torch.equal(mine, tensors[rank]), "the input was written to"
                same_on_every_rank(comm, out)
                # in place gives the same bits
                core().allreduce(mine.data_ptr(), mine.data_ptr(), count, DTYPES[dtype], code, comm.py2f(), options,
                                 [], core().AllreduceAlgorithm.SharedMemory)
                assert torch.equal(mine, out)
    finally:
        comm.Free()


def test_shared_memory_and_ring_agree():
    comm, options, _ = small_chunk_comm(64 * 1024)
    rank, n = comm.rank, comm.size
    try:
        tensors = [contribution(5, 1_000_003, "float64", r) for r in range(n)]
        results = {}
        for algorithm in ("SharedMemory", "Ring"):
            out = torch.empty_like(tensors[rank])
            core().allreduce(tensors[rank].data_ptr(), out.data_ptr(), out.numel(), DTYPES["float64"], OPS["sum"],
                             comm.py2f(), options, [], getattr(core().AllreduceAlgorithm, algorithm))
            results[algorithm] = out
        shared = results["SharedMemory"].numpy()
        np.testing.assert_allclose(shared, results["Ring"].numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(shared, reference(tensors, "sum", "float64"), rtol=1e-12, atol=1e-12)
    finally:
        comm.Free()


def test_grouped_allreduce_streams_mixed_buffers_through_small_chunks():
    hp.shutdown()
    hp.init(config=Config(shared_memory_chunk_bytes=4096, fusion_threshold_bytes=256 * 1024,
                          small_message_bytes=1024))
    rank, n = hp.rank(), hp.size()
    rng = np.random.default_rng(11)
    # empty and one-element tensors inside buckets, a bucket of one dtype cut by another, one alone
    specs = [(list(DTYPES)[int(rng.integers(0, 6))], int(rng.choice([0, 1, 7, 1000, 5000]))) for _ in range(40)]
    specs.append(("float32", 100_000))  # over the fusion threshold: streamed on its own
    for op in ("average", "max"):
        tensors = [[contribution(100 + i, count, dtype, r) for r in range(n)] for i, (dtype, count) in enumerate(specs)]
        mine = [group[rank].clone() for group in tensors]
        results = hp.grouped_allreduce(mine, op=getattr(hp, op.capitalize()))
        for (dtype, _), group, got in zip(specs, tensors, results):
            check(got, reference(group, op, dtype), dtype, op)
        hp.grouped_allreduce_(mine, op=getattr(hp, op.capitalize()))
        for got, want in zip(mine, results):
            assert torch.equal(got, want)
    comm = context.communicator(None, "test")
    assert core().shared_memory_info(comm.py2f(), context.allreduce_options_for(Config()), False)["available"]


def engine_run(seed):
    """Twelve tensors of 120-160 KiB through the engine; returns the 'world' counters' deltas."""
    rank, n = hp.rank(), hp.size()
    tensors = [[contribution(seed + i, 30_000 + 1000 * i, "float32", r) for r in range(n)] for i in range(12)]
    mine = [group[rank].clone() for group in tensors]
    before = hp.engine_stats("world")
    handles = [hp.allreduce_async_(t, name=f"shm.{seed}.{i}", op=hp.Sum, group="world") for i, t in enumerate(mine)]
    for handle in handles:
        hp.synchronize(handle)
    for group, got in zip(tensors, mine):
        check(got, reference(group, "sum", "float32"), "float32", "sum")
        same_on_every_rank(MPI.COMM_WORLD, got)
    after = hp.engine_stats("world")
    return {key: after[key] - before[key] for key in after}


def test_engine_buckets_go_through_the_segment():
    delta = engine_run(200)
    assert delta["tensors"] == 12 and delta["buckets"] >= 1
    assert delta["shared_memory"] == delta["buckets"], delta


def test_out_of_place_buckets_stream_their_outputs_at_any_alignment():
    """Out of place and over 1 MiB, the segment's results are written with streaming stores: tensors of odd
    lengths fused in one bucket put chunk and tensor boundaries at every 4-byte offset of the outputs."""
    rank, n = hp.rank(), hp.size()
    counts = [10_001 + 37 * i for i in range(30)] + [3, 1, 700_001]  # about 1.3 MiB fused, then 2.7 MiB alone
    for dtype in ("float32", "float16", "int64"):
        tensors = [[contribution(300 + i, count, dtype, r) for r in range(n)] for i, count in enumerate(counts)]
        mine = [group[rank].clone() for group in tensors]
        handles = [hp.allreduce_async(t, name=f"stream.{dtype}.{i}", op=hp.Sum) for i, t in enumerate(mine)]
        for group, tensor, handle in zip(tensors, mine, handles):
            got = hp.synchronize(handle)
            # which tensors share a bucket depends on when each reaches the engine: one that goes alone and
            # under small_message_bytes takes MPI_Allreduce, which rounds float16 at each of its n - 1 steps
            magnitude = torch.stack([t.double().abs() for t in group]).sum(0).numpy()
            check(got, reference(group, "sum", dtype), dtype, "sum", roundings=(n - 1, magnitude))
            assert torch.equal(tensor, group[rank])  # the input is only read
        same_on_every_rank(MPI.COMM_WORLD, got)
        big = contribution(400, 1_000_003, dtype, rank)
        check(hp.allreduce(big, op=hp.Max), reference([contribution(400, 1_000_003, dtype, r) for r in range(n)],
                                                      "max", dtype), dtype, "max")


def test_switched_off_the_ring_runs_and_no_segment_is_made():
    hp.shutdown()
    hp.init(config=Config(shared_memory=False))
    delta = engine_run(400)
    assert delta["tensors"] == 12 and delta["buckets"] >= 1 and delta["shared_memory"] == 0, delta
    rank, n = hp.rank(), hp.size()
    tensors = [contribution(300, 300_001, "float32", r) for r in range(n)]
    got = hp.allreduce(tensors[rank], op=hp.Sum)
    check(got, reference(tensors, "sum", "float32"), "float32", "sum")
    grouped = hp.grouped_allreduce([t[rank] for t in [[c[:1000] for c in tensors]] * 3], op=hp.Sum)
    check(grouped[0], reference([c[:1000] for c in tensors], "sum", "float32"), "float32", "sum")
    comm = context.communicator(None, "test")
    info = core().shared_memory_info(comm.py2f(), context.allreduce_options_for(Config()), False)
    assert info == {"available": False, "reason": "not created", "chunk_bytes": 0, "sets": 0, "mapped_bytes": 0}


def test_info_says_why_there_is_no_segment():
    options = core().AllreduceOptions()
    options.shared_memory = False
    info = core().shared_memory_info(MPI.COMM_WORLD.py2f(), options)
    assert info["available"] is False and info["reason"] == "switched off (shared_memory=False)"
    info = core().shared_memory_info(MPI.COMM_SELF.py2f(), core().AllreduceOptions())
    assert info["available"] is False and info["reason"] == "one rank: nothing to share"


# ------------------------------------------------------------------ fusion, value by value

HALF_EXACT = {"float16": 2048, "bfloat16": 256}  # integers up to these are exact in the half types
# per dtype, tensors of odd sizes next to each other (one bucket per dtype; empty ones inside), then a float32 bucket
# over 1 MiB: out of place through the segment its outputs are written with streaming stores
FUSED = [(dtype, count) for dtype in DTYPES for count in (1, 7, 1000, 0, 4099, 3)] + \
    [("float32", count) for count in (1, 5, 200_001, 3, 70_001)]
FUSION_PATHS = {
    "ring": dict(shared_memory=False),
    "segment": dict(),
    "segment_4KiB_chunks": dict(shared_memory_chunk_bytes=4096),
}


def exact_contribution(seed, count, dtype, rank, n):
    """Integers whose sums and minima every dtype holds exactly, whatever the order of the additions."""
    bound = HALF_EXACT.get(dtype, 10_000 * n) // n
    values = np.random.default_rng([seed, rank, count]).integers(-bound, bound + 1, count)
    return torch.from_numpy(values).to(getattr(torch, dtype))


def exact_reference(group, op):
    stacked = np.stack([t.to(torch.int64).numpy() for t in group])
    return stacked.sum(0) if op == "sum" else stacked.min(0)


def check_exact(results, tensors, op, path):
    for index, ((dtype, count), group, got) in enumerate(zip(FUSED, tensors, results)):
        assert got.dtype == getattr(torch, dtype) and got.shape == (count,), (path, index)
        want = exact_reference(group, op)
        wrong = np.flatnonzero(got.to(torch.int64).numpy() != want)
        assert wrong.size == 0, (f"{path}, {op}: tensor {index} ({dtype}, {count} elements) differs at elements "
                                 f"{wrong[:5].tolist()} (got {got[wrong[:5]].tolist()}, want {want[wrong[:5]].tolist()})")


@pytest.mark.parametrize("path", list(FUSION_PATHS))
def test_fused_buckets_of_every_dtype_come_back_exact_element_by_element(path):
    """Tensors of odd sizes and every dtype fused into buckets (the fusion buffer's pack / unpack at every
    offset), reduced through the ring, the shared-memory segment or the segment streaming 4 KiB chunks, by
    grouped_allreduce (out of place and in place) and by the engine (out of place: the 1 MiB bucket's outputs
    written with streaming stores): every element of every tensor equal to numpy's."""
    hp.shutdown()
    hp.init(config=Config(small_message_bytes=0, unfused_bytes=0, **FUSION_PATHS[path]))
    rank, n = hp.rank(), hp.size()
    for op, hp_op in (("sum", hp.Sum), ("min", hp.Min)):
        tensors = [[exact_contribution(500 + i, count, dtype, r, n) for r in range(n)]
                   for i, (dtype, count) in enumerate(FUSED)]
        mine = [group[rank].clone() for group in tensors]
        results = hp.grouped_allreduce(mine, op=hp_op)
        with ranks_agree(what=f"{path}, {op}, grouped_allreduce"):
            check_exact(results, tensors, op, path)
            assert all(torch.equal(t, group[rank]) for t, group in zip(mine, tensors)), "an input was written to"
        hp.grouped_allreduce_(mine, op=hp_op)
        with ranks_agree(what=f"{path}, {op}, grouped_allreduce_"):
            check_exact(mine, tensors, op, path)
        mine = [group[rank].clone() for group in tensors]
        before = hp.engine_stats("world")
        handles = [hp.allreduce_async(t, name=f"fused.{path}.{op}.{i}", op=hp_op, group="world")
                   for i, t in enumerate(mine)]
        results = [hp.synchronize(handle) for handle in handles]
        after = hp.engine_stats("world")
        with ranks_agree(what=f"{path}, {op}, engine"):
            check_exact(results, tensors, op, path)
            assert after["tensors"] - before["tensors"] == len(FUSED)
            assert after["buckets"] - before["buckets"] < len(FUSED) - 1, "the engine fused nothing"
            through_segment = after["shared_memory"] - before["shared_memory"]
            assert (through_segment == 0) if path == "ring" else (through_segment > 0), (before, after)

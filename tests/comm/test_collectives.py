"""Collectives against numpy references, every dtype × op × size class, at 2, 3, 4 and 8 ranks.

Each rank regenerates every rank's input from a seed, so the reference needs no communication.
"""

import numpy as np
import pytest
import torch

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.config import Config

pytestmark = pytest.mark.mpi(ranks=[2], long_ranks=[3, 4, 8], timeout=600, shared=True)

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
OPS = [hp.Sum, hp.Average, hp.Min, hp.Max]
# empty, one element, fewer elements than ranks, a prime, crossing the small-message threshold,
# a prime count well inside the ring
SIZES = [0, 1, 5, 7, 1000, 16411, 300007]


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hp.init()
    yield
    hp.shutdown()


def inputs(seed, count, dtype, n):
    """Every rank's input as float64 numpy arrays holding values exact in `dtype`."""
    arrays = []
    for r in range(n):
        rng = np.random.default_rng([seed, r, count])
        if dtype.startswith("int"):
            values = rng.integers(-1000, 1000, count).astype(np.float64)
        else:
            values = rng.standard_normal(count) * 4
        arrays.append(torch.tensor(values).to(getattr(torch, dtype)).double().numpy())
    return arrays


def reference(arrays, op, dtype):
    stacked = np.stack(arrays) if arrays[0].size else np.zeros((len(arrays), 0))
    if op in (hp.Min, hp.Max):
        return (stacked.min(0) if op == hp.Min else stacked.max(0)) if stacked.size else stacked[0]
    total = stacked.sum(0)
    if op == hp.Sum:
        return total
    if dtype.startswith("int"):
        return np.trunc(total / len(arrays))
    return total / len(arrays)


def magnitude(arrays):
    """Sum over ranks of |x|: what bounds the partial sums a reduction rounds along the way."""
    return np.abs(np.stack(arrays)).sum(0) if arrays[0].size else np.zeros(0)


def assert_matches(got, want, dtype, op, magnitude=None):
    got = np.asarray(got, dtype=np.float64)
    if dtype.startswith("int") or op in (hp.Min, hp.Max):
        np.testing.assert_array_equal(got, want)
    elif dtype in ("float16", "bfloat16"):
        # half values travel as 16-bit: float32 accumulation where received, each partial sum rounded to
        # be sent (n - 1 roundings of values at most `magnitude`), the result rounded once more
        ulp = 2.0 ** -10 if dtype == "float16" else 2.0 ** -7
        partial = 0 if magnitude is None else (hp.size() - 1) * ulp * magnitude
        tolerance = np.maximum(np.abs(want) * ulp + partial, 2.0 ** -24 if dtype == "float16" else 1e-38)
        excess = np.abs(got - want) - tolerance
        assert excess.max(initial=0) <= 0, f"max error over one ulp: {excess.max()}"
    else:
        rtol = 1e-6 if dtype == "float32" else 1e-12
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * 10)


@pytest.fixture(params=[True, False], ids=["shared_memory", "ring"])
def algorithm(request):
    """One host here, so large buffers go through shared memory by default; False forces the ring."""
    if not request.param:
        hp.shutdown()
        hp.init(config=Config(shared_memory=False))
    yield request.param
    if not request.param:
        hp.shutdown()
        hp.init()


def as_torch(array, dtype):
    return torch.from_numpy(array.copy()).to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_all_ops_and_sizes(dtype, algorithm):
    n, rank = hp.size(), hp.rank()
    for op in OPS:
        for count in SIZES:
            arrays = inputs(1, count, dtype, n)
            got = hp.allreduce(as_torch(arrays[rank], dtype), op=op)
            with ranks_agree(what=f"{op}, {count} elements"):
                assert got.dtype == getattr(torch, dtype) and got.shape == (count,)
                assert_matches(got.double().numpy(), reference(arrays, op, dtype), dtype, op, magnitude(arrays))


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_in_place_and_numpy(dtype):
    n, rank = hp.size(), hp.rank()
    arrays = inputs(2, 70001, dtype, n)
    tensor = as_torch(arrays[rank], dtype)
    address = tensor.data_ptr()
    returned = hp.allreduce_(tensor, op=hp.Sum)
    with ranks_agree(what="allreduce_"):
        assert returned is tensor and tensor.data_ptr() == address
        assert_matches(tensor.double().numpy(), reference(arrays, hp.Sum, dtype), dtype, hp.Sum, magnitude(arrays))
    if dtype != "bfloat16":  # numpy has no bfloat16
        array = as_torch(arrays[rank], dtype).numpy()
        result = hp.allreduce(array, op=hp.Max)
        with ranks_agree(what="numpy Max"):
            assert isinstance(result, np.ndarray) and result.dtype == array.dtype
            assert_matches(result, reference(arrays, hp.Max, dtype), dtype, hp.Max)
        hp.allreduce_(array, op=hp.Min)
        assert_matches(array, reference(arrays, hp.Min, dtype), dtype, hp.Min)


def test_allreduce_over_64_mib(algorithm):
    n, rank = hp.size(), hp.rank()
    count = 16 * 1024 * 1024 + 3  # 64 MiB + 12 bytes of float32
    mine = torch.full((count,), float(rank + 1))
    mine[-1] = -rank
    got = hp.allreduce(mine, op=hp.Sum)
    assert got[0].item() == n * (n + 1) / 2 and got[count // 2].item() == n * (n + 1) / 2
    assert got[-1].item() == -n * (n - 1) / 2
    assert torch.all(got[:-1] == n * (n + 1) / 2)


def test_allreduce_non_contiguous_and_multidimensional():
    n, rank = hp.size(), hp.rank()
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5) * (rank + 1)
    view = base.transpose(0, 2)  # not contiguous
    assert not view.is_contiguous()
    want = (torch.arange(60, dtype=torch.float32).reshape(3, 4, 5) * (n * (n + 1) / 2)).transpose(0, 2)
    got = hp.allreduce(view, op=hp.Sum)
    with ranks_agree():
        assert got.shape == view.shape and torch.equal(got, want)
    hp.allreduce_(view, op=hp.Sum)
    assert torch.equal(view, want) and torch.equal(base, want.transpose(0, 2))


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared_memory", "ring"])
@pytest.mark.parametrize("threshold", [1024, 4 * 1024 * 1024])
def test_grouped_allreduce_mixed_dtypes(threshold, shared_memory):
    hp.shutdown()
    hp.init(config=Config(fusion_threshold_bytes=threshold, shared_memory=shared_memory))
    n, rank = hp.size(), hp.rank()
    rng = np.random.default_rng(7)
    specs = [(DTYPES[i % len(DTYPES)], int(rng.integers(0, 3000))) for i in range(29)]
    specs.append(("float32", 300_000))  # bigger than a 1 KiB bucket: reduced on its own
    try:
        for op in (hp.Average, hp.Max):
            tensors, wants, sizes = [], [], []
            for index, (dtype, count) in enumerate(specs):
                arrays = inputs(100 + index, count, dtype, n)
                tensors.append(as_torch(arrays[rank], dtype))
                wants.append(reference(arrays, op, dtype))
                sizes.append(magnitude(arrays))
            results = hp.grouped_allreduce(tensors, op=op)
            with ranks_agree(what=f"{op}, grouped_allreduce"):
                for (dtype, _), got, want, size in zip(specs, results, wants, sizes):
                    assert got.dtype == getattr(torch, dtype)
                    assert_matches(got.double().numpy(), want, dtype, op, size)
            hp.grouped_allreduce_(tensors, op=op)
            with ranks_agree(what=f"{op}, grouped_allreduce_"):
                for (dtype, _), got, want, size in zip(specs, tensors, wants, sizes):
                    assert_matches(got.double().numpy(), want, dtype, op, size)
    finally:
        hp.shutdown()
        hp.init()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_broadcast_every_root(dtype):
    n, rank = hp.size(), hp.rank()
    for root in range(n):
        mine = (torch.arange(12).reshape(3, 4) * (rank + 1)).to(dtype)
        want = (torch.arange(12).reshape(3, 4) * (root + 1)).to(dtype)
        got = hp.broadcast(mine, root_rank=root)
        with ranks_agree(what=f"root {root}, broadcast"):
            assert torch.equal(got, want)
            assert torch.equal(mine, (torch.arange(12).reshape(3, 4) * (rank + 1)).to(dtype))  # untouched
        hp.broadcast_(mine, root_rank=root)
        with ranks_agree(what=f"root {root}, broadcast_"):
            assert torch.equal(mine, want)
    array = np.full(5, rank, dtype=np.float64)
    hp.broadcast_(array, root_rank=n - 1)
    np.testing.assert_array_equal(array, np.full(5, n - 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.bool])
def test_allgather_varying_first_dimension(dtype):
    n, rank = hp.size(), hp.rank()
    rows = [(r * 3) % 4 for r in range(n)]  # rank 0 contributes no rows
    mine = (torch.ones(rows[rank], 2, 3) * (rank + 1)).to(dtype)
    got = hp.allgather(mine)
    want = torch.cat([(torch.ones(rows[r], 2, 3) * (r + 1)).to(dtype) for r in range(n)])
    with ranks_agree():
        assert got.shape == (sum(rows), 2, 3) and torch.equal(got, want)
    array = np.arange(rank + 1, dtype=np.int64)
    np.testing.assert_array_equal(hp.allgather(array), np.concatenate([np.arange(r + 1) for r in range(n)]))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_reducescatter_and_allgather_every_algorithm(dtype, algorithm):
    """hp.reducescatter / hp.allgather (the C++ fast path: shared memory or ring above the small-message
    size, the MPI library below), against numpy, with uneven rows (some ranks get none)."""
    n, rank = hp.size(), hp.rank()
    for rows in (1, n + 1, 4 * n + 3, 30011):
        arrays = [a.reshape(rows, 5) for a in inputs(2, rows * 5, dtype, n)]
        for op in (hp.Sum, hp.Average):
            got = hp.reducescatter(as_torch(arrays[rank], dtype), op=op)
            base = rows // n
            start = rank * base + min(rank, rows % n)
            want = reference(arrays, op, dtype)[start:start + got.shape[0]]
            with ranks_agree(what=f"{rows} rows, {op}"):  # ranks holding no rows pass, the others may fail
                assert got.dtype == getattr(torch, dtype) and got.shape == (base + (rank < rows % n), 5)
                assert_matches(got.double().numpy(), want, dtype, op, magnitude(arrays)[start:start + got.shape[0]])
        gathered = hp.allgather(as_torch(arrays[rank][: rank * rows // n], dtype))
        want = np.concatenate([arrays[r][: r * rows // n] for r in range(n)])
        with ranks_agree(what=f"{rows} rows, allgather"):
            np.testing.assert_array_equal(gathered.double().numpy(), want)


def test_reducescatter_and_allgather_algorithms_directly():
    """The extension's reducescatter / allgather with each algorithm forced, any layout of counts (zeros,
    all on one rank), input untouched."""
    from hybridpipe._ext import core
    from hybridpipe.comm import context
    from mpi4py import MPI

    comm, n, rank = MPI.COMM_WORLD, hp.size(), hp.rank()
    options = context.current("test").allreduce_options()
    algorithms = [core().AllreduceAlgorithm.Ring, core().AllreduceAlgorithm.Library,
                  core().AllreduceAlgorithm.SharedMemory]
    for total in (3, 70001):
        for counts in ([total // n + (r < total % n) for r in range(n)], [0] * (n - 1) + [total]):
            arrays = inputs(3, total, "float32", n)
            for algorithm in algorithms:
                x = torch.from_numpy(arrays[rank].astype(np.float32))
                before = x.clone()
                out = torch.empty(counts[rank])
                core().reducescatter(x.data_ptr(), out.data_ptr(), counts, 0, int(hp.Sum), comm.py2f(), options,
                                     False, algorithm)
                start = sum(counts[:rank])
                with ranks_agree(what=f"{counts}, {algorithm}, reducescatter"):
                    np.testing.assert_allclose(out.double().numpy(), np.sum(arrays, 0)[start:start + counts[rank]],
                                               rtol=1e-5, atol=1e-5)
                    assert torch.equal(x, before)
                full = torch.full((total,), float("nan"))
                core().allgather(out.data_ptr(), full.data_ptr(), counts, 0, comm.py2f(), options, algorithm)
                everyone = torch.cat(comm.allgather(out))
                with ranks_agree(what=f"{counts}, {algorithm}, allgather"):
                    assert torch.equal(full, everyone)


def test_barrier_and_groups_of_a_grid():
    n, rank = hp.size(), hp.rank()
    hp.barrier()
    try:
        for stages in [s for s in (2, 4) if n % s == 0]:
            hp.shutdown()
            grid = hp.init(pipeline_stages=stages)
            value = torch.tensor([float(rank)], dtype=torch.float64)
            data_ranks = [grid.rank_of(grid.stage, r) for r in range(grid.data_replicas)]
            pipe_ranks = [grid.rank_of(s, grid.replica) for s in range(stages)]
            got = [hp.allreduce(value, op=hp.Sum, group="data").item(), hp.allreduce(value, op=hp.Max, group="pipe").item(),
                   hp.allgather(value, group="pipe").tolist(), hp.broadcast(value, root_rank=0, group="data").item()]
            hp.barrier(group="pipe")
            hp.barrier(group="data")
            big = hp.allreduce(torch.full((200_000,), float(rank)), op=hp.Sum, group="data")
            with ranks_agree(what=f"{stages} stages"):
                assert got == [sum(data_ranks), max(pipe_ranks), [float(r) for r in pipe_ranks], data_ranks[0]]
                assert torch.all(big == sum(data_ranks))
    finally:
        hp.shutdown()
        hp.init()


def test_user_communicator_group():
    from mpi4py import MPI

    rank = hp.rank()
    halves = MPI.COMM_WORLD.Split(color=rank % 2, key=rank)
    members = halves.allgather(rank)
    got = hp.allreduce(torch.tensor([float(rank)] * 100_000), op=hp.Sum, group=halves)
    small = hp.allreduce(torch.tensor([rank]), op=hp.Sum, group=halves).item()
    halves.Free()
    with ranks_agree():
        assert torch.all(got == sum(members))
        assert small == sum(members)

"""CUDA tensors through hybridpipe under a real mpirun (2 ranks; they share the GPU when there is one): every
collective and dtype against numpy, the engine's allreduce, cupy arrays, the extension's CUDA reduction kernel,
hp.init's device placement, and DistributedOptimizer and the pipeline (GPipe, 1F1B) on the GPU equal to one
process. Marked ``cuda``: skipped where torch sees no GPU (``make gpu-check`` runs it on a GPU machine)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import hybridpipe as hp
from hybridpipe import runtime
from hybridpipe.comm import buffers, device, reduction

pytestmark = [pytest.mark.mpi(ranks=[2], timeout=600), pytest.mark.cuda]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = {"Sum": (hp.Sum, np.sum), "Average": (hp.Average, np.mean), "Min": (hp.Min, np.min), "Max": (hp.Max, np.max)}


@pytest.fixture(scope="module")
def world():
    grid = hp.init(pipeline_stages=1)
    yield grid
    hp.shutdown()


def rank_values(rank: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Rank-dependent values that every dtype holds exactly (small integers; halves of them)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    values = torch.randint(-8, 9, shape, generator=generator).double() / (1 if not dtype.is_floating_point else 2)
    return values.to(dtype)


def everyone(shape, dtype: torch.dtype) -> np.ndarray:
    return np.stack([rank_values(r, shape, dtype).double().numpy() for r in range(hp.size())])


def test_hp_init_places_each_rank_on_its_gpu(world):
    assert torch.cuda.current_device() == hp.local_rank() % torch.cuda.device_count()
    assert device.compute_device(hp.local_rank(), True) == torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_allreduce_of_cuda_tensors_every_op_against_numpy(world, dtype):
    for op_name, (op, reference) in OPS.items():
        if op_name == "Average" and not dtype.is_floating_point:
            continue
        x = rank_values(hp.rank(), (1000, 3), dtype).cuda()
        result = hp.allreduce(x, op=op, name=f"allreduce.{op_name}.{dtype}")
        assert result.device == x.device and result.dtype == dtype
        expected = reference(everyone((1000, 3), dtype), axis=0)
        np.testing.assert_allclose(result.double().cpu().numpy(), expected, rtol=1e-2 if dtype.itemsize == 2 else 0)
        in_place = x.clone()
        assert hp.allreduce_(in_place, op=op) is in_place
        assert torch.equal(in_place, result)


def test_grouped_allreduce_broadcast_allgather_alltoall_reducescatter_on_cuda(world):
    rank, size = hp.rank(), hp.size()
    tensors = [rank_values(rank, (n,), torch.float32).cuda() for n in (1, 333, 70_000)]
    hp.grouped_allreduce_(tensors, op=hp.Sum)
    for tensor, n in zip(tensors, (1, 333, 70_000)):
        np.testing.assert_array_equal(tensor.cpu().numpy(), everyone((n,), torch.float32).sum(0))
        assert tensor.is_cuda

    root = torch.full((5, 4), float(rank), device="cuda")
    hp.broadcast_(root, root_rank=size - 1)
    assert root.is_cuda and torch.equal(root.cpu(), torch.full((5, 4), float(size - 1)))

    rows = torch.full((rank + 1, 3), float(rank), device="cuda")  # uneven first dimension
    gathered = hp.allgather(rows)
    assert gathered.is_cuda
    expected = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)])
    assert torch.equal(gathered.cpu(), expected)

    send = torch.arange(size * 2, dtype=torch.float32, device="cuda") + 100 * rank
    received = hp.alltoall(send)
    expected = torch.cat([torch.arange(rank * 2, rank * 2 + 2, dtype=torch.float32) + 100 * r for r in range(size)])
    assert received.is_cuda and torch.equal(received.cpu(), expected)

    whole = rank_values(rank, (size * 4, 2), torch.float32).cuda()
    mine = hp.reducescatter(whole, op=hp.Sum)
    expected = everyone((size * 4, 2), torch.float32).sum(0)[rank * 4:(rank + 1) * 4]
    assert mine.is_cuda and np.array_equal(mine.cpu().numpy(), expected)


def test_engine_allreduce_async_of_many_cuda_gradients(world):
    tensors = [rank_values(hp.rank(), (n,), torch.float32).cuda() for n in [7] * 50 + [300_000, 5]]
    handles = [hp.allreduce_async_(t, name=f"grad.{i}", op=hp.Average) for i, t in enumerate(tensors)]
    for handle, tensor in zip(handles, tensors):
        assert hp.synchronize(handle) is tensor
    for tensor in tensors:
        np.testing.assert_allclose(tensor.cpu().numpy(), everyone(tensor.shape, torch.float32).mean(0), rtol=1e-6)


def test_the_engine_packs_a_bucket_of_cuda_tensors_on_the_device(world):
    """Forty tensors produced behind some milliseconds of work on a side stream become ready together, so the
    engine fuses them: each bucket is gathered by one kernel and one copy down and scattered by one copy up and
    one kernel (engine_stats: cuda_launches), not a copy each way per tensor. Out of place, in place through a
    strided view, prescaled and averaged tensors, and half types, against numpy."""
    if not hp.cuda_built():
        pytest.skip("the extension was built without its CUDA kernels: the engine stages each tensor by itself")
    rank = hp.rank()
    before = hp.engine_stats("world")
    busy = torch.randn(2048, 2048, device="cuda")
    tensors = [torch.zeros(n, device="cuda") for n in range(1, 41)]
    sources = [rank_values(rank, (n,), torch.float32).cuda() for n in range(1, 41)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(20):
            busy = torch.tanh(busy @ busy)
        for tensor, source in zip(tensors, sources):
            tensor.copy_(source)  # queued behind the work above: the tensors are not ready before it ends
        handles = [hp.allreduce_async_(t, name=f"packed.{i}", op=hp.Sum, group="world") for i, t in enumerate(tensors)]
        for handle in handles:
            hp.synchronize(handle)
    side.synchronize()
    for n, tensor in enumerate(tensors, start=1):
        np.testing.assert_array_equal(tensor.cpu().numpy(), everyone((n,), torch.float32).sum(0))
    after = hp.engine_stats("world")
    buckets = after["cuda_buckets"] - before["cuda_buckets"]
    launches = after["cuda_launches"] - before["cuda_launches"]
    assert 1 <= buckets <= 40 and launches <= 4 * buckets
    assert launches < 40, f"{launches} kernels and copies for 40 tensors in {buckets} buckets: not packed"

    # the other forms through the same path
    x = rank_values(rank, (1000,), torch.float32).cuda()
    out = hp.synchronize(hp.allreduce_async(x, op=hp.Average, name="packed.out", prescale_factor=2.0,
                                            postscale_factor=0.5))
    np.testing.assert_allclose(out.cpu().numpy(), everyone((1000,), torch.float32).mean(0), rtol=1e-6)
    assert torch.equal(x.cpu(), rank_values(rank, (1000,), torch.float32))  # the input is left alone
    view = rank_values(rank, (30, 20), torch.float16).cuda().t()  # non-contiguous: reduced in a copy, copied back
    assert hp.synchronize(hp.allreduce_async_(view, op=hp.Sum, name="packed.view")) is view
    np.testing.assert_array_equal(view.double().cpu().numpy(), everyone((30, 20), torch.float16).sum(0).T)
    for dtype in (torch.bfloat16, torch.int64):
        y = rank_values(rank, (333,), dtype).cuda()
        hp.synchronize(hp.allreduce_async_(y, op=hp.Max, name=f"packed.max.{dtype}"))
        np.testing.assert_array_equal(y.double().cpu().numpy(), everyone((333,), dtype).max(0))


def test_a_large_cuda_buffer_is_reduced_exactly(world):
    count = 16 << 20  # 64 MiB of float32
    x = torch.full((count,), float(hp.rank() + 1), device="cuda")
    hp.allreduce_(x, op=hp.Sum)
    expected = float(sum(range(1, hp.size() + 1)))
    assert torch.all(x == expected).item()


@pytest.fixture
def small_segments(world):
    """The staged route (whatever the MPI library) with segments of 64 KiB (the default is 4 MiB), so that the
    tensors below take many of them."""
    import dataclasses

    from hybridpipe.comm import context

    ctx = context.current("small_segments")
    saved = ctx.config
    ctx.config = dataclasses.replace(saved, staging_segment_bytes=64 << 10, cuda_aware_mpi="0")
    yield
    ctx.config = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_staged_allreduce_in_many_segments_against_numpy(small_segments, dtype):
    shape = (333, 257)  # 85,581 elements: many 64 KiB segments and a short last one
    x = rank_values(hp.rank(), shape, dtype).cuda()
    expected = everyone(shape, dtype).sum(0)
    out = hp.allreduce(x, op=hp.Sum)
    assert out.is_cuda and out.dtype == dtype and out.shape == shape
    np.testing.assert_array_equal(out.double().cpu().numpy(), expected)
    assert torch.equal(x.cpu(), rank_values(hp.rank(), shape, dtype))  # out of place: the input is left alone
    scaled = hp.allreduce(x, op=hp.Sum, prescale_factor=2, postscale_factor=0.5)
    np.testing.assert_array_equal(scaled.double().cpu().numpy(), expected)
    assert torch.equal(x.cpu(), rank_values(hp.rank(), shape, dtype))
    view = rank_values(hp.rank(), shape[::-1], dtype).cuda().t()  # non-contiguous, reduced in place
    assert hp.allreduce_(view, op=hp.Sum) is view
    np.testing.assert_array_equal(view.double().cpu().numpy(), everyone(shape[::-1], dtype).sum(0).T)


def test_a_tensor_written_on_a_side_stream_is_reduced_after_its_producer(small_segments):
    """The producer is still running on another stream when the call is made: the copies down wait for the
    event the call recorded on that stream (without it they would read zeros)."""
    expected = float(hp.size() * (hp.size() + 1) // 2)
    busy = torch.randn(2048, 2048, device="cuda")
    x = torch.zeros(1 << 20, device="cuda")
    y = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(30):  # some milliseconds of work queued before the values are written
            busy = torch.tanh(busy @ busy)
        x.fill_(hp.rank() + 1.0)
        y.fill_(hp.rank() + 1.0)
        out = hp.allreduce(x, op=hp.Sum, name="side.sync")
        handle = hp.allreduce_async(y, op=hp.Sum, name="side.async", prescale_factor=2.0, postscale_factor=0.5)
        done = hp.synchronize(handle)
        grouped = hp.grouped_allreduce([x, y], op=hp.Sum, name="side.grouped")
    side.synchronize()
    assert torch.all(out == expected).item() and torch.all(done == expected).item()
    assert all(torch.all(t == expected).item() for t in grouped)


def test_grouped_allreduce_packs_many_small_tensors_on_the_device(small_segments):
    rank = hp.rank()
    shapes = [(3,), (40, 5), (1,), (7, 7, 7), (100_000,), (2, 3)]
    dtypes = [torch.float32, torch.float16, torch.float32, torch.float16, torch.float32, torch.int32]
    tensors = [rank_values(rank, shape, dtype).cuda() for shape, dtype in zip(shapes, dtypes)]
    outs = hp.grouped_allreduce(tensors, op=hp.Sum, name="packed")
    for out, tensor, shape, dtype in zip(outs, tensors, shapes, dtypes):
        assert out.is_cuda and out.dtype == dtype and tuple(out.shape) == shape
        np.testing.assert_array_equal(out.double().cpu().numpy(), everyone(shape, dtype).sum(0))
        assert torch.equal(tensor.cpu(), rank_values(rank, shape, dtype))
    floats = [t for t in tensors if t.is_floating_point()]
    handle = hp.grouped_allreduce_async_(floats, op=hp.Average, name="packed.async")
    assert all(a is b for a, b in zip(hp.synchronize(handle), floats))
    for tensor, shape, dtype in [(t, s, d) for t, s, d in zip(tensors, shapes, dtypes) if d.is_floating_point]:
        np.testing.assert_allclose(tensor.double().cpu().numpy(), everyone(shape, dtype).mean(0), rtol=1e-3)


def test_staged_broadcast_in_many_segments_from_every_root(small_segments):
    rank = hp.rank()
    for root in range(hp.size()):
        x = rank_values(rank, (300, 301), torch.float32).cuda()
        out = hp.broadcast(x, root_rank=root, name=f"bcast.{root}")
        assert out.is_cuda and torch.equal(out.cpu(), rank_values(root, (300, 301), torch.float32))
        assert torch.equal(x.cpu(), rank_values(rank, (300, 301), torch.float32))
        view = rank_values(rank, (301, 300), torch.float16).cuda().t()
        assert hp.broadcast_(view, root_rank=root) is view
        assert torch.equal(view.cpu(), rank_values(root, (301, 300), torch.float16).t())
        flags = torch.arange(100_000, device="cuda") % (rank + 2) == 0
        hp.broadcast_(flags, root_rank=root)
        assert torch.equal(flags.cpu(), torch.arange(100_000) % (root + 2) == 0)


@pytest.fixture(params=["staged", "cuda-aware"])
def gpu_route(world, request):
    """Each CUDA route in turn (HYBRIDPIPE_CUDA_AWARE_MPI=0 / 1); the cuda-aware one where the MPI library moves
    device memory (an Open MPI built --with-cuda: MPIX_Query_cuda_support() = 1)."""
    import dataclasses

    from hybridpipe.comm import context

    if request.param == "cuda-aware" and device.mpi_cuda_support() != 1:
        pytest.skip(f"this MPI does not move CUDA memory (MPIX_Query_cuda_support: {device.mpi_cuda_support()})")
    ctx = context.current("gpu_route")
    saved = ctx.config
    ctx.config = dataclasses.replace(saved, cuda_aware_mpi="1" if request.param == "cuda-aware" else "0")
    yield request.param
    ctx.config = saved


def test_each_route_reduces_broadcasts_and_sends_cuda_tensors_exactly(gpu_route):
    from mpi4py import MPI

    from hybridpipe.comm import p2p

    rank, size = hp.rank(), hp.size()
    assert device.route(torch.ones(1, device="cuda")) == gpu_route
    for dtype in DTYPES:
        for op_name, (op, reference) in OPS.items():
            if op_name == "Average" and not dtype.is_floating_point:
                continue
            x = rank_values(rank, (2000, 3), dtype).cuda()
            result = hp.allreduce(x, op=op, name=f"{gpu_route}.{op_name}.{dtype}")
            np.testing.assert_allclose(result.double().cpu().numpy(), reference(everyone((2000, 3), dtype), axis=0),
                                       rtol=1e-2 if dtype.itemsize == 2 else 1e-7)
    for dtype in (torch.float32, torch.bfloat16, torch.int32):  # 1.2 MiB and 600 KiB: the device ring
        big = rank_values(rank, (300_000,), dtype).cuda()
        for op_name, (op, reference) in OPS.items():
            if op_name == "Average" and not dtype.is_floating_point:
                continue
            result = hp.allreduce(big, op=op, name=f"{gpu_route}.big.{op_name}.{dtype}")
            np.testing.assert_allclose(result.double().cpu().numpy(), reference(everyone((300_000,), dtype), axis=0),
                                       rtol=1e-2 if dtype.itemsize == 2 else 1e-7)
        assert torch.equal(big.cpu(), rank_values(rank, (300_000,), dtype))
    mixed = [rank_values(rank, (n,), dtype).cuda() for n, dtype in [(5, torch.float32), (77, torch.float64),
                                                                     (9, torch.int64), (300, torch.float32)]]
    hp.grouped_allreduce_(mixed, op=hp.Sum)
    for tensor, (n, dtype) in zip(mixed, [(5, torch.float32), (77, torch.float64), (9, torch.int64),
                                          (300, torch.float32)]):
        np.testing.assert_array_equal(tensor.double().cpu().numpy(), everyone((n,), dtype).sum(0))
    view = rank_values(rank, (30, 40), torch.float32).cuda().t()
    hp.broadcast_(view, root_rank=size - 1)
    assert torch.equal(view.cpu(), rank_values(size - 1, (30, 40), torch.float32).t())

    comm = MPI.COMM_WORLD.Dup()
    try:
        value = {"activation": rank_values(0, (64, 1000), torch.float32).cuda(),
                 "extra": [rank_values(0, (3000,), torch.bfloat16).cuda().view(60, 50).t()]}  # non-contiguous
        if rank == 0:
            p2p.send(value, 1, 40, comm).wait()
        elif rank == 1:
            received = p2p.Receive(0, 40, comm, device="cuda").wait()
            assert received["activation"].is_cuda and received["extra"][0].is_cuda
            assert torch.equal(received["activation"].cpu(), value["activation"].cpu())
            assert torch.equal(received["extra"][0].cpu(), value["extra"][0].cpu())
        comm.Barrier()
    finally:
        comm.Free()


def test_the_engines_buckets_stay_in_device_memory_on_the_cuda_aware_route(gpu_route):
    """On the cuda-aware route the engine's buckets of CUDA tensors are reduced in device memory (gathered by one
    kernel, MPI_Allreduce of device memory below 1 MiB or the device ring above, scattered by one kernel:
    engine_stats' cuda_aware_buckets); on the staged route through pinned host memory. Exact either way: small
    and large buckets, float32 and bfloat16, Sum and Average, in and out of place, an integer Average (staged on
    both routes)."""
    if not hp.cuda_built():
        pytest.skip("the extension was built without its CUDA kernels: the engine stages each tensor by itself")
    rank = hp.rank()
    before = hp.engine_stats("world")
    cases = [((7,), torch.float32, hp.Sum), ((300_000,), torch.float32, hp.Average), ((1000,), torch.bfloat16, hp.Sum),
             ((600_001,), torch.bfloat16, hp.Max)]
    for i, (shape, dtype, op) in enumerate(cases):
        x = rank_values(rank, shape, dtype).cuda()
        reference = everyone(shape, dtype)
        expected = {hp.Sum: reference.sum(0), hp.Average: reference.mean(0), hp.Max: reference.max(0)}[op]
        out = hp.synchronize(hp.allreduce_async(x, op=op, name=f"route.{gpu_route}.{i}", group="world"))
        np.testing.assert_allclose(out.double().cpu().numpy(), expected, rtol=1e-2 if dtype.itemsize == 2 else 1e-6)
        assert torch.equal(x.cpu(), rank_values(rank, shape, dtype))
        assert hp.synchronize(hp.allreduce_async_(x, op=op, name=f"route.{gpu_route}.{i}.in", group="world")) is x
        np.testing.assert_allclose(x.double().cpu().numpy(), expected, rtol=1e-2 if dtype.itemsize == 2 else 1e-6)
    y = rank_values(rank, (5000,), torch.int32).cuda()
    on_host = rank_values(rank, (5000,), torch.int32)
    hp.synchronize(hp.allreduce_async_(y, op=hp.Average, name=f"route.{gpu_route}.int", group="world"))
    hp.synchronize(hp.allreduce_async_(on_host, op=hp.Average, name=f"route.{gpu_route}.int.host", group="world"))
    assert torch.equal(y.cpu(), on_host)  # an integer Average is staged and rounds as the host core does
    after = hp.engine_stats("world")
    in_device_memory = after["cuda_aware_buckets"] - before["cuda_aware_buckets"]
    buckets = after["cuda_buckets"] - before["cuda_buckets"]
    if gpu_route == "cuda-aware":
        assert (buckets, in_device_memory) == (9, 8)  # each call its own bucket; all but the integer Average
    else:
        assert (buckets, in_device_memory) == (9, 0)


def test_from_address_views_device_memory_in_every_dtype(world):
    for dtype in DTYPES:
        x = rank_values(hp.rank(), (1234,), dtype).cuda()
        view = reduction.from_address(x.data_ptr(), x.numel(), buffers.dtype_code(x), x.device.index or 0)
        assert view.dtype == dtype and view.data_ptr() == x.data_ptr() and torch.equal(view, x)


def test_nccl_is_not_used_by_ranks_sharing_a_gpu_and_forcing_it_says_why(world):
    """2 ranks on one GPU: NCCL refuses that, so auto falls back to MPI on both ranks; nccl is an error on both.
    (tests/gpu/test_nccl_mpi.py runs NCCL itself.)"""
    from mpi4py import MPI

    from hybridpipe import HybridPipeError

    shared = torch.cuda.device_count() < hp.size()
    comm = MPI.COMM_WORLD.Dup()
    try:
        made = device.nccl_communicator(comm, torch.cuda.current_device(), "auto")
        if shared or device.nccl_module() is None:
            assert made is None
            x = rank_values(hp.rank(), (1000,), torch.float32).cuda()
            np.testing.assert_array_equal(hp.allreduce(x, op=hp.Sum).cpu().numpy(), everyone((1000,), torch.float32).sum(0))
        forced = MPI.COMM_WORLD.Dup()
        try:
            if shared or device.nccl_module() is None:
                with pytest.raises(HybridPipeError, match="HYBRIDPIPE_GPU_ALLREDUCE=nccl, but NCCL cannot run"):
                    device.nccl_communicator(forced, torch.cuda.current_device(), "nccl")
        finally:
            forced.Free()
    finally:
        comm.Free()


def test_staging_warns_once_naming_the_mpi_library(gpu_route):
    runtime.job("test").warned_staging = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            hp.allreduce(torch.ones(4, device="cuda"))
    staged = [w for w in caught if "stages CUDA tensors through host memory" in str(w.message)]
    if gpu_route == "cuda-aware":  # float32 goes to MPI as device memory: nothing is staged
        assert not staged, [str(w.message) for w in caught]
        return
    assert len(staged) == 1, [str(w.message) for w in caught]
    assert "MPI: " in str(staged[0].message) and "CUDA support" in str(staged[0].message)


def test_cupy_arrays_are_accepted_in_and_out_of_place(world):
    cupy = pytest.importorskip("cupy")
    a = cupy.full((6,), hp.rank() + 1, dtype=cupy.float32)
    total = hp.allreduce(a, op=hp.Sum)
    assert isinstance(total, cupy.ndarray)
    assert cupy.asnumpy(total).tolist() == [float(sum(range(1, hp.size() + 1)))] * 6
    assert hp.allreduce_(a, op=hp.Max) is a
    assert cupy.asnumpy(a).tolist() == [float(hp.size())] * 6
    gathered = hp.allgather(cupy.full((1, 2), hp.rank(), dtype=cupy.int64))
    assert isinstance(gathered, cupy.ndarray) and cupy.asnumpy(gathered)[:, 0].tolist() == list(range(hp.size()))
    pair = [cupy.ones(3, dtype=cupy.float32), cupy.full((2, 2), hp.rank(), dtype=cupy.float64)]
    summed = hp.grouped_allreduce_(pair, op=hp.Sum)
    assert summed[0] is pair[0] and summed[1] is pair[1]  # the caller's own arrays, reduced in place
    assert cupy.asnumpy(pair[0]).tolist() == [float(hp.size())] * 3
    assert cupy.asnumpy(pair[1]).sum() == 4 * sum(range(hp.size()))
    handle = hp.allreduce_async_(pair[0], op=hp.Sum, name="cupy.async")
    hp.synchronize(handle)  # the torch view of pair[0]'s memory
    assert cupy.asnumpy(pair[0]).tolist() == [float(hp.size() ** 2)] * 3


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_the_extensions_cuda_reduction_kernel_against_torch(world, dtype):
    assert hp.cuda_built(), "the extension was built without its CUDA kernels (nvcc missing at build time?)"
    a, b = rank_values(0, (100_003,), dtype).cuda(), rank_values(1, (100_003,), dtype).cuda()
    for op, expected in ((hp.Sum, a + b), (hp.Average, a + b), (hp.Min, torch.minimum(a, b)),
                         (hp.Max, torch.maximum(a, b))):
        accumulator = a.clone()
        reduction.reduce_on_device(accumulator, b, op)
        torch.cuda.synchronize()
        assert torch.equal(accumulator, expected), (op, dtype)


def gpu_pair() -> tuple[nn.Module, nn.Module]:
    """A CUDA MLP and its one-process reference with the same weights."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).cuda()
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).cuda()
    model.load_state_dict(reference.state_dict())
    return model, reference


def train_against_one_process(model, optimizer, reference, reference_optimizer, clip: float | None = None) -> None:
    """4 steps: each rank its 8 rows of the global batch, the reference all of it; then the weights agree."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        x, y = torch.randn(8 * hp.size(), 16, generator=generator), torch.randn(8 * hp.size(), 4, generator=generator)
        x, y = x.cuda(), y.cuda()
        mine = slice(8 * hp.rank(), 8 * (hp.rank() + 1))
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        if clip is None:
            optimizer.step()
        else:
            optimizer.synchronize()
            hp.clip_grad_norm_(model, clip)
            with optimizer.skip_synchronize():
                optimizer.step()
        reference_optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        reference_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.is_cuda
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda text: f"{name}: {text}")


@pytest.mark.parametrize("groups", [None, 0], ids=["device-buckets", "one-by-one"])
def test_distributed_optimizer_on_the_gpu_equals_one_process(world, groups):
    model, reference = gpu_pair()
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters(), groups=groups)
    # left unset on the GPU: buckets in reverse model order (one here: 700 floats); groups=0: the engine
    assert optimizer._hp_groups == ([["2.bias", "2.weight", "0.bias", "0.weight"]] if groups is None else [])
    train_against_one_process(model, optimizer, reference,
                              torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_shards_gpu_parameters_and_equals_one_process(world, zero):
    """ZeRO on CUDA parameters: the shard and the AdamW moments live on the GPU (1/D of them), the buckets are
    reduced through pinned host buffers, and training equals one process, clipping included."""
    model, reference = gpu_pair()
    optimizer = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters(), zero=zero)
    train_against_one_process(model, optimizer, reference, torch.optim.AdamW(reference.parameters(), lr=0.01),
                              clip=0.05)
    assert all(shard.is_cuda for shard in optimizer._hp_shards)
    assert all(v.is_cuda for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_on_the_gpu_equals_one_process(schedule):
    hp.shutdown()  # the module's 1-stage grid; these come last in the file
    hp.init(pipeline_stages=2)
    try:
        torch.manual_seed(0)
        layers = [nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 5)]
        reference = nn.Sequential(*[nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 5)])
        reference.load_state_dict(nn.Sequential(*layers).state_dict())
        reference = reference.cuda()
        model = hp.PipelineModel(nn.Sequential(*layers), loss_fn=nn.CrossEntropyLoss(), micro_batches=4,
                                 schedule=schedule, balance=[3, 2])
        assert model.device.type == "cuda"  # hybridpipe's placement: the layers came on the CPU
        assert all(p.is_cuda for p in model.parameters())
        optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(5)
        for _ in range(3):
            x, y = torch.randn(16, 12, generator=generator), torch.randint(0, 5, (16,), generator=generator)
            optimizer.zero_grad()
            loss = model.train_step(x, y)
            optimizer.step()
            reference_optimizer.zero_grad()
            expected = nn.functional.cross_entropy(reference(x.cuda()), y.cuda())
            expected.backward()
            reference_optimizer.step()
            assert loss == pytest.approx(expected.item(), rel=1e-5)
        reference_parameters = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, reference_parameters[name.removeprefix("layers.")], rtol=1e-5, atol=1e-6)
        model.close()
    finally:
        hp.shutdown()

"""The segmented device ring (hybridpipe.comm.ring driving device-memory MPI_Isend / MPI_Irecv and the GPU reduction
kernel) on 3 and 4 ranks sharing the GPU: with 3 ranks the chunks are uneven, with 4 the ring takes 3 steps each
way, so a segment sent before its reduction finished, or a scratch chunk refilled too early, gives a wrong sum.
Segments of 16 KiB cut each chunk into tens of them. Needs an MPI library that moves device memory
(MPIX_Query_cuda_support() = 1); marked ``cuda``, skipped without a GPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import hybridpipe as hp
from hybridpipe.comm import buffers, context, device

pytestmark = [pytest.mark.mpi(ranks=[3, 4], timeout=300), pytest.mark.cuda]

SEGMENT_BYTES = 16 << 10


@pytest.fixture(scope="module")
def world():
    grid = hp.init(pipeline_stages=1)
    if device.mpi_cuda_support() != 1:
        hp.shutdown()
        pytest.skip(f"the MPI library does not move device memory ({device.describe()})")
    ctx = context.current("test_device_ring")
    saved = ctx.config
    ctx.config = dataclasses.replace(saved, device_ring_segment_bytes=SEGMENT_BYTES, cuda_aware_mpi="1",
                                     gpu_allreduce="mpi")
    yield grid
    ctx.config = saved
    hp.shutdown()


def values(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (halves for floating types): every dtype holds them and their sums exactly."""
    generator = torch.Generator().manual_seed(700 + rank)
    scale = 2 if dtype.is_floating_point else 1
    return (torch.randint(-8, 9, (count,), generator=generator).double() / scale).to(dtype)


def everyone(count: int, dtype: torch.dtype) -> np.ndarray:
    return np.stack([values(r, count, dtype).double().numpy() for r in range(hp.size())])


# element counts above the 1 MiB under which MPI_Allreduce takes device memory; none divides evenly by 3 or 4
CASES = [(torch.float32, 300_001), (torch.float64, 150_007), (torch.bfloat16, 600_011), (torch.float16, 600_013),
         (torch.int32, 262_147), (torch.int64, 131_075)]


@pytest.mark.parametrize("dtype,count", CASES, ids=lambda c: str(c).removeprefix("torch."))
def test_device_ring_in_many_segments_every_op_against_numpy(world, dtype, count):
    x = values(hp.rank(), count, dtype).cuda()
    assert device.cuda_allreduce_algorithm(device.route(x), count * dtype.itemsize, buffers.dtype_code(x),
                                           int(hp.Sum)) == "device-ring"
    reference = everyone(count, dtype)
    ops = [(hp.Sum, reference.sum(0)), (hp.Max, reference.max(0)), (hp.Min, reference.min(0))]
    if dtype.is_floating_point:
        ops.append((hp.Average, reference.mean(0)))
    for op, expected in ops:
        out = hp.allreduce(x, op=op, name=f"ring.{op.name}.{dtype}")
        assert out.is_cuda and out.dtype == dtype and out.shape == x.shape
        tolerance = 0 if op != hp.Average else {2: 1e-2, 4: 1e-6, 8: 1e-12}[dtype.itemsize]  # the division
        np.testing.assert_allclose(out.double().cpu().numpy(), expected, rtol=tolerance)
    assert torch.equal(x.cpu(), values(hp.rank(), count, dtype))  # out of place: the input is left alone
    hp.allreduce_(x, op=hp.Sum)
    np.testing.assert_array_equal(x.double().cpu().numpy(), reference.sum(0))


def test_device_ring_repeated_back_to_back_stays_exact(world):
    """Twenty allreduces queued without a host wait between them: each one's sends and receives must not meet
    the next one's (the same tags, the same neighbours)."""
    count = 1 << 19  # 2 MiB of float32
    xs = [values(hp.rank() + 10 * i, count, torch.float32).cuda() for i in range(20)]
    for i, x in enumerate(xs):
        hp.allreduce_(x, op=hp.Sum, name=f"ring.repeat.{i}")
    for i, x in enumerate(xs):
        expected = np.stack([values(r + 10 * i, count, torch.float32).numpy() for r in range(hp.size())]).sum(0)
        np.testing.assert_array_equal(x.cpu().numpy(), expected)


def test_grouped_allreduce_and_optimizer_buckets_through_the_device_ring(world):
    rank = hp.rank()
    counts = [5, 300_000, 17, 70_001]  # packed: 1.48 MB of float32, the device ring
    tensors = [values(rank, n, torch.float32).cuda() for n in counts]
    hp.grouped_allreduce_(tensors, op=hp.Sum)
    for tensor, n in zip(tensors, counts):
        np.testing.assert_array_equal(tensor.cpu().numpy(), everyone(n, torch.float32).sum(0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 3)).cuda()
    reference = [p.detach().clone() for p in model.parameters()]
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                        named_parameters=model.named_parameters())
    inputs = torch.randn(hp.size() * 4, 512, generator=torch.Generator().manual_seed(3)).cuda()
    mine = inputs[rank * 4:(rank + 1) * 4]
    model(mine).square().mean().backward()
    optimizer.step()
    # one process on the whole batch: the mean of the per-rank means is the mean over all of it
    single = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 3)).cuda()
    with torch.no_grad():
        for p, r in zip(single.parameters(), reference):
            p.copy_(r)
    single(inputs).square().mean().backward()
    with torch.no_grad():
        for p in single.parameters():
            p -= 0.5 * p.grad
    for got, want in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

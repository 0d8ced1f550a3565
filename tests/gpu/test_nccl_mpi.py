"""NCCL through cupy for CUDA allreduces (HYBRIDPIPE_GPU_ALLREDUCE): one rank per GPU. Launched with as many
ranks as there are GPUs where that is more than one, and with one rank everywhere (a one-rank NCCL communicator
still runs the whole path: the agreement, the unique id over MPI, the communicator, ncclAllReduce on the
packing stream). Marked ``cuda``; skipped without a GPU or without cupy's NCCL."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybridpipe as hp
from hybridpipe.comm import context, device

pytestmark = [pytest.mark.mpi(ranks=[1], timeout=300), pytest.mark.cuda]


@pytest.fixture(scope="module")
def world():
    if device.nccl_module() is None:
        pytest.skip("cupy with NCCL is not installed (cupy-cuda12x / cupy-cuda13x and nvidia-nccl)")
    grid = hp.init(pipeline_stages=1)
    yield grid
    hp.shutdown()


def values(rank: int, shape, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(50 + rank)
    return (torch.randint(-8, 9, shape, generator=generator).double() / 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_allreduce_through_nccl_against_numpy(world, dtype):
    size, rank = hp.size(), hp.rank()
    everyone = np.stack([values(r, (300, 7), dtype).double().numpy() for r in range(size)])
    x = values(rank, (300, 7), dtype).cuda()
    for op, reference in ((hp.Sum, everyone.sum(0)), (hp.Max, everyone.max(0)), (hp.Min, everyone.min(0))):
        np.testing.assert_allclose(hp.allreduce(x, op=op).double().cpu().numpy(), reference,
                                   rtol=1e-2 if dtype.itemsize == 2 else 1e-12)
    comm = context.communicator(None, "test")
    made = context.current("test").nccl_groups.get((comm.py2f(), torch.cuda.current_device()))
    assert made is not None  # the world's allreduces went through an NCCL communicator
    if dtype.is_floating_point:
        y = x.clone()
        hp.allreduce_(y, op=hp.Average)
        np.testing.assert_allclose(y.double().cpu().numpy(), everyone.mean(0), rtol=1e-2 if dtype.itemsize == 2 else 1e-12)


def test_grouped_allreduce_and_the_optimizers_buckets_through_nccl(world):
    size, rank = hp.size(), hp.rank()
    shapes = [(5,), (40, 3), (1,), (1000,)]
    tensors = [values(rank, shape, torch.float32).cuda() for shape in shapes]
    hp.grouped_allreduce_(tensors, op=hp.Sum)
    for tensor, shape in zip(tensors, shapes):
        np.testing.assert_allclose(tensor.cpu().numpy(), np.stack([values(r, shape, torch.float32).numpy()
                                                                  for r in range(size)]).sum(0))
    model = torch.nn.Linear(8, 2).cuda()
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    before = model.weight.detach().clone()
    model(torch.ones(4, 8, device="cuda")).sum().backward()
    expected = before - 0.1 * model.weight.grad  # every rank computed the same gradient: the average is it
    optimizer.step()
    torch.testing.assert_close(model.weight.detach(), expected)

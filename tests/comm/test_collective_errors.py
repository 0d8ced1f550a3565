"""Mismatches between ranks raise on every rank with every rank's values; bad input names the fix."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hybridpipe as hp
from hybridpipe import _ext

pytestmark = pytest.mark.mpi(ranks=[3])


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hp.init()
    yield
    hp.shutdown()


def test_shape_mismatch_raises_on_every_rank():
    rank = hp.rank()
    with pytest.raises(hp.MismatchError) as error:
        hp.allreduce(torch.ones(10 + (rank == 1)))
    message = str(error.value)
    assert "rank 0: shape=(10,) dtype=float32 op=Average" in message
    assert "rank 1: shape=(11,) dtype=float32 op=Average" in message
    assert "every rank must pass the same shape, dtype and op" in message
    assert hp.allreduce(torch.ones(4), op=hp.Sum).tolist() == [3.0] * 4  # still usable afterwards


def test_dtype_and_op_mismatch():
    rank = hp.rank()
    with pytest.raises(hp.MismatchError, match=r"rank 2: shape=\(5,\) dtype=float64"):
        hp.allreduce_(torch.ones(5, dtype=torch.float64 if rank == 2 else torch.float32))
    with pytest.raises(hp.MismatchError, match=r"rank 0: shape=\(5,\) dtype=float32 op=Sum; rank 1: .* op=Max"):
        hp.allreduce(torch.ones(5), op=hp.Sum if rank != 1 else hp.Max)


def test_unsupported_dtype_on_one_rank_is_a_mismatch_on_all():
    rank = hp.rank()
    with pytest.raises(hp.MismatchError, match=r"rank 1: shape=\(3,\) dtype=uint8"):
        hp.allreduce(torch.ones(3, dtype=torch.uint8 if rank == 1 else torch.float32))


def test_unsupported_dtype_everywhere_is_a_type_error():
    with pytest.raises(TypeError, match=r"dtype torch.bool cannot be reduced \(use one of float32, float64"):
        hp.allreduce(torch.ones(3, dtype=torch.bool))


def test_not_a_tensor_and_bad_op_and_bad_group():
    with pytest.raises(TypeError, match=r"hp.allreduce takes a torch.Tensor or numpy.ndarray, got list"):
        hp.allreduce([1.0, 2.0])
    with pytest.raises(TypeError, match=r"op must be hp.Sum, hp.Average, hp.Min or hp.Max, got 'sum'"):
        hp.allreduce(torch.ones(2), op="sum")
    with pytest.raises(ValueError, match=r"unknown group 'rows' \(use None/'world', 'data', 'pipe'"):
        hp.allreduce(torch.ones(2), group="rows")
    with pytest.raises(TypeError, match=r"group must be None, 'world', 'data', 'pipe' or an mpi4py"):
        hp.barrier(group=3)


def test_grouped_list_mismatch_names_the_tensor():
    rank = hp.rank()
    tensors = [torch.ones(4), torch.ones(2, 2), torch.ones(3 if rank != 2 else 4)]
    with pytest.raises(hp.MismatchError) as error:
        hp.grouped_allreduce(tensors)
    message = str(error.value)
    assert "tensor 2: rank 0: shape=(3,) dtype=float32; rank 1: shape=(3,) dtype=float32; " \
           "rank 2: shape=(4,) dtype=float32" in message
    shorter = tensors[:2] if rank == 0 else tensors
    with pytest.raises(hp.MismatchError, match=r"tensor 2: rank 0: \(no tensor\)"):
        hp.grouped_allreduce(shorter)


def test_broadcast_root_mismatch_and_out_of_range():
    rank = hp.rank()
    with pytest.raises(hp.MismatchError, match=r"rank 0: root_rank=0 .*rank 1: root_rank=1"):
        hp.broadcast(torch.ones(2), root_rank=min(rank, 1))
    with pytest.raises(ValueError, match=r"root_rank 5 is not a rank of a group of 3 \(use 0..2\)"):
        hp.broadcast(torch.ones(2), root_rank=5)


def test_allgather_trailing_mismatch_and_scalar():
    rank = hp.rank()
    with pytest.raises(hp.MismatchError, match=r"rank 1: first dim 2, then \(4,\) float32"):
        hp.allgather(torch.ones(2, 3 if rank != 1 else 4))
    with pytest.raises(ValueError, match=r"allgather needs a tensor with at least one dimension"):
        hp.allgather(torch.tensor(1.0))


def test_mpi_failure_in_cpp_names_rank_call_and_error_string():
    with pytest.raises(hp.MPIError) as error:
        _ext.core().allreduce(0, 0, 4, 0, 0, MPI.COMM_NULL.py2f(), _ext.core().AllreduceOptions())
    message = str(error.value)
    assert f"rank {hp.rank()}: MPI_Comm_rank failed with error code" in message
    assert "MPI_ERR_COMM" in message or "invalid communicator" in message
    assert hp.allreduce(np.ones(3), op=hp.Sum).tolist() == [3.0] * 3  # the rank is still healthy

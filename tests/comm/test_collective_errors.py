"""Mismatches between ranks raise on every rank with every rank's values; bad input names the fix. Each expected
error and the checks of its message run in a ranks_agree block, so a rank that did not raise as expected fails
every rank there instead of leaving the others in the next collective."""

import threading
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe import _ext
from hybridpipe.comm import context

pytestmark = pytest.mark.mpi(ranks=[3], shared=True)  # one mpirun with the other shared 3-rank files


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hp.init()
    yield
    hp.shutdown()


def test_shape_mismatch_raises_on_every_rank():
    rank = hp.rank()
    with ranks_agree(what="the mismatch"):
        with pytest.raises(hp.MismatchError) as error:
            hp.allreduce(torch.ones(10 + (rank == 1)))
        message = str(error.value)
        assert "rank 0: shape=(10,) dtype=float32 op=Average" in message
        assert "rank 1: shape=(11,) dtype=float32 op=Average" in message
        assert "every rank must pass the same shape, dtype and op" in message
    with ranks_agree(what="afterwards"):
        assert hp.allreduce(torch.ones(4), op=hp.Sum).tolist() == [3.0] * 4  # still usable afterwards


def test_dtype_and_op_mismatch():
    rank = hp.rank()
    with ranks_agree(), pytest.raises(hp.MismatchError, match=r"rank 2: shape=\(5,\) dtype=float64"):
        hp.allreduce_(torch.ones(5, dtype=torch.float64 if rank == 2 else torch.float32))
    with ranks_agree(), pytest.raises(
            hp.MismatchError, match=r"rank 0: shape=\(5,\) dtype=float32 op=Sum; rank 1: .* op=Max"):
        hp.allreduce(torch.ones(5), op=hp.Sum if rank != 1 else hp.Max)


def test_unsupported_dtype_on_one_rank_raises_there_and_is_a_mismatch_elsewhere():
    rank = hp.rank()
    error = TypeError if rank == 1 else hp.MismatchError
    with ranks_agree(), pytest.raises(error, match=r"dtype torch.uint8 cannot be reduced"):
        hp.allreduce(torch.ones(3, dtype=torch.uint8 if rank == 1 else torch.float32))


def test_unsupported_dtype_everywhere_is_a_type_error():
    with ranks_agree(), pytest.raises(
            TypeError, match=r"dtype torch.bool cannot be reduced \(use one of float32, float64"):
        hp.allreduce(torch.ones(3, dtype=torch.bool))


def test_not_a_tensor_and_bad_op_and_bad_group():
    with ranks_agree(), pytest.raises(
            TypeError, match=r"hp.allreduce takes a torch.Tensor or numpy.ndarray, got list"):
        hp.allreduce([1.0, 2.0])
    with ranks_agree(), pytest.raises(
            TypeError, match=r"op must be hp.Sum, hp.Average, hp.Min or hp.Max, got 'sum'"):
        hp.allreduce(torch.ones(2), op="sum")
    with ranks_agree(), pytest.raises(
            ValueError, match=r"unknown group 'rows' \(use None/'world', 'data', 'pipe'"):
        hp.allreduce(torch.ones(2), group="rows")
    with ranks_agree(), pytest.raises(
            TypeError, match=r"group must be None, 'world', 'data', 'pipe' or an mpi4py"):
        hp.barrier(group=3)


def test_grouped_list_mismatch_names_the_tensor():
    rank = hp.rank()
    tensors = [torch.ones(4), torch.ones(2, 2), torch.ones(3 if rank != 2 else 4)]
    with ranks_agree(what="a tensor's shape"):
        with pytest.raises(hp.MismatchError) as error:
            hp.grouped_allreduce(tensors)
        assert "tensor 2: rank 0: shape=(3,) dtype=float32; rank 1: shape=(3,) dtype=float32; " \
               "rank 2: shape=(4,) dtype=float32" in str(error.value)
    shorter = tensors[:2] if rank == 0 else tensors
    with ranks_agree(), pytest.raises(hp.MismatchError, match=r"tensor 2: rank 0: \(no tensor\)"):
        hp.grouped_allreduce(shorter)


def test_broadcast_root_mismatch_and_out_of_range():
    rank = hp.rank()
    with ranks_agree(), pytest.raises(hp.MismatchError, match=r"rank 0: root_rank=0 .*rank 1: root_rank=1"):
        hp.broadcast(torch.ones(2), root_rank=min(rank, 1))
    with ranks_agree(), pytest.raises(
            ValueError, match=r"root_rank 5 is not a rank of a group of 3 \(use 0..2\)"):
        hp.broadcast(torch.ones(2), root_rank=5)


def test_allgather_trailing_mismatch_and_scalar():
    rank = hp.rank()
    with ranks_agree(), pytest.raises(hp.MismatchError, match=r"rank 1: first dim 2, then \(4,\) float32"):
        hp.allgather(torch.ones(2, 3 if rank != 1 else 4))
    with ranks_agree(), pytest.raises(
            ValueError, match=r"allgather needs a tensor with at least one dimension"):
        hp.allgather(torch.tensor(1.0))


def test_mpi_failure_in_cpp_names_rank_call_and_error_string():
    with ranks_agree(what="MPI_COMM_NULL"):
        with pytest.raises(hp.MPIError) as error:
            _ext.core().allreduce(0, 0, 4, 0, 0, MPI.COMM_NULL.py2f(), _ext.core().AllreduceOptions())
        message = str(error.value)
        assert f"rank {hp.rank()}: MPI_Comm_rank failed with error code" in message
        assert "MPI_ERR_COMM" in message or "invalid communicator" in message
    with ranks_agree(what="afterwards"):
        assert hp.allreduce(np.ones(3), op=hp.Sum).tolist() == [3.0] * 3  # the rank is still healthy


# ------------------------------------------------------------------ a bad argument on one rank only


def _one_rank_refuses(call, good, bad, error, pattern, bad_rank=1):
    """``call(argument)`` with ``bad`` on ``bad_rank`` and ``good`` elsewhere: the bad rank raises ``error``
    (its own check), every other rank a MismatchError naming the bad rank and its error — within seconds,
    not after the 300 s timeout — and a collective afterwards works on every rank."""
    start = time.monotonic()
    with ranks_agree(what=f"{pattern} on rank {bad_rank}"):
        if hp.rank() == bad_rank:
            with pytest.raises(error, match=pattern):
                call(bad)
        else:
            with pytest.raises(hp.MismatchError, match=rf"rank {bad_rank} raised {error.__name__}: .*{pattern}"):
                call(good)
        assert time.monotonic() - start < 10
    with ranks_agree(what=f"afterwards ({pattern})"):
        assert hp.allreduce(torch.ones(2), op=hp.Sum).tolist() == [3.0, 3.0]


def test_sync_collectives_with_a_bad_argument_on_one_rank_raise_everywhere():
    _one_rank_refuses(lambda x: hp.allreduce(x), torch.ones(3), [1.0, 2.0, 3.0], TypeError,
                      r"hp.allreduce takes a torch.Tensor or numpy.ndarray, got list")
    _one_rank_refuses(lambda op: hp.allreduce(torch.ones(3), op=op), hp.Sum, "sum", TypeError,
                      r"op must be hp.Sum, hp.Average, hp.Min or hp.Max, got 'sum'", bad_rank=2)
    _one_rank_refuses(lambda name: hp.allreduce_(torch.ones(3), name=name), "x", 7, TypeError,
                      r"name must be a non-empty str, got 7", bad_rank=0)
    _one_rank_refuses(lambda f: hp.allreduce(torch.ones(3), prescale_factor=f), 2.0, "2", TypeError,
                      r"prescale_factor must be a number")
    _one_rank_refuses(lambda ts: hp.grouped_allreduce(ts), [torch.ones(2)], torch.ones(2), TypeError,
                      r"takes a list or tuple of tensors, got Tensor")
    _one_rank_refuses(lambda root: hp.broadcast(torch.ones(2), root_rank=root), 0, "0", TypeError,
                      r"root_rank must be an int")
    _one_rank_refuses(lambda group: hp.barrier(group=group), None, "rows", ValueError, r"unknown group 'rows'")
    _one_rank_refuses(lambda x: hp.allgather(x), torch.ones(2, 2), "rows", TypeError, r"got str")
    _one_rank_refuses(lambda splits: hp.alltoall(torch.ones(3, 2), splits=splits), [1, 1, 1], [1, 1, 2], ValueError,
                      r"splits \[1, 1, 2\] sum to 4, not to the first dimension \(3\)")
    _one_rank_refuses(lambda op: hp.reducescatter(torch.ones(3), op=op), hp.Sum, hp.Max, hp.NotSupportedError,
                      r"reducescatter reduces with op=hp.Sum or op=hp.Average \(got hp.Max\)")
    _one_rank_refuses(lambda x: hp.allreduce(x, compression=hp.Compression.fp16), torch.ones(2), np.ones(2, bool),
                      TypeError, r"dtype bool cannot be reduced")


def test_async_collectives_with_a_bad_argument_on_one_rank_raise_everywhere():
    def async_allreduce(x):
        return hp.allreduce_async_(x, name="refused.allreduce").wait()

    def async_named(op):
        return hp.allreduce_async(torch.ones(3), name="refused.op", op=op).wait()

    def async_unnamed(x):
        return hp.allgather_async(x).wait()

    _one_rank_refuses(async_allreduce, torch.ones(3), "x", TypeError, r"takes a torch.Tensor or numpy.ndarray, got str")
    _one_rank_refuses(async_allreduce, torch.ones(3), torch.ones(3, dtype=torch.bool), TypeError,
                      r"dtype torch.bool cannot be reduced")
    _one_rank_refuses(async_named, hp.Sum, 42, TypeError, r"op must be hp.Sum", bad_rank=2)
    _one_rank_refuses(async_unnamed, torch.ones(2), 3.0, TypeError, r"got float")
    _one_rank_refuses(lambda root: hp.broadcast_async_(torch.ones(2), root_rank=root, name="refused.b").wait(),
                      1, None, TypeError, r"root_rank must be an int")
    _one_rank_refuses(lambda ts: hp.grouped_allreduce_async_(ts, name="refused.g").wait(), [torch.ones(1)],
                      [torch.ones(1), "x"], TypeError, r"got str")


class _RecordingComm(MPI.Intracomm):
    """A user communicator that records which thread duplicates it."""

    threads: list = []

    def Dup(self, *args):  # noqa: N802 — mpi4py's name
        _RecordingComm.threads.append(threading.current_thread() is threading.main_thread())
        return super().Dup(*args)


def test_a_user_communicator_is_duplicated_on_the_communication_thread():
    halves = MPI.COMM_WORLD.Split(hp.rank() % 2, hp.rank())
    user = _RecordingComm(halves)
    try:
        with ranks_agree():
            summed = hp.allreduce(torch.ones(2), op=hp.Sum, group=user)
            waited = hp.allreduce_async_(torch.ones(2), op=hp.Sum, group=user, name="user").wait()
            assert summed.tolist() == [float(halves.size)] * 2
            assert waited.tolist() == [float(halves.size)] * 2
            assert _RecordingComm.threads == [False]  # once, and not on the calling (main) thread
    finally:
        halves.Free()


def test_a_tensor_on_another_device_on_one_rank_is_a_mismatch_on_the_engine():
    # the engine's device field, driven directly (this machine may have no GPU): rank 1 says "CUDA"
    state = context.current("test")
    x = torch.ones(3)
    handle = state.engine.submit(state.engine_group(None, "test"), "device.check", x.data_ptr(), 3, 0, 0,
                                 1 if hp.rank() == 1 else 0)
    with ranks_agree():
        error, _, _, kind, _ = state.engine.wait(handle)
        assert kind == _ext.core().ErrorKind.Mismatch
        assert "rank 0: count=3 dtype=float32 op=Sum; rank 1: count=3 dtype=float32 op=Sum device=cuda" in error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cpu_tensor_where_another_rank_passes_a_gpu_tensor_raises_everywhere():
    x = torch.ones(4, device="cuda" if hp.rank() == 0 else "cpu")
    with ranks_agree(), pytest.raises(
            hp.MismatchError, match=r"rank 0: shape=\(4,\) dtype=float32 device=cuda"):
        hp.allreduce(x)
    with ranks_agree(), pytest.raises(hp.MismatchError, match=r"device=cuda"):
        hp.allreduce_async_(x, name="devices").wait()
    with ranks_agree(), pytest.raises(hp.MismatchError, match=r"device=cuda"):
        hp.allgather(x)

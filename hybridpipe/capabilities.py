"""What this build of hybridpipe can do, under Horovod's query names (``hvd.mpi_built()`` & co.).

hybridpipe has one controller and one data path, MPI: the answers are facts of the build, not
settings. NCCL, Gloo, oneCCL, DDL and ROCm are never used (even when cupy or torch bring NCCL along,
GPU tensors are staged through host memory and reduced over MPI), so their queries are False (0 for
``nccl_built``, which Horovod returns as the NCCL version code).
"""

from __future__ import annotations

__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
           "ccl_built", "ddl_built", "cuda_built", "rocm_built", "cross_rank", "cross_size", "is_homogeneous"]


def mpi_built() -> bool:
    """True when the compiled extension (always built against MPI) loads and matches mpi4py's MPI."""
    from . import _ext
    from .errors import BuildError

    try:
        _ext.core()
    except BuildError:
        return False
    return True


def mpi_enabled() -> bool:
    """True when MPI is usable: it is hybridpipe's only transport, so the same as :func:`mpi_built`."""
    return mpi_built()


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it), so that other threads may use
    mpi4py beside hybridpipe.

    Raises:
        NotInitializedError: before ``hp.init()`` (Horovod raises too).
    """
    from .comm import context

    context.current("mpi_threads_supported")
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: hybridpipe has no Gloo controller."""
    return False


def gloo_enabled() -> bool:
    """False: hybridpipe has no Gloo controller."""
    return False


def nccl_built() -> int:
    """The NCCL version code (e.g. 22809 for 2.28.9, as Horovod returns it) where cupy brings NCCL, which the CUDA
    allreduces use (HYBRIDPIPE_GPU_ALLREDUCE, docs/gpu.md); 0 (Horovod's "not built") otherwise."""
    from .comm.device import nccl_module

    nccl = nccl_module()
    return int(nccl.get_version()) if nccl is not None else 0


def ccl_built() -> bool:
    """False: no oneCCL data path."""
    return False


def ddl_built() -> bool:
    """False: no IBM DDL data path."""
    return False


def cuda_built() -> bool:
    """Whether the extension was compiled with its CUDA kernels (pack/unpack, reduction on the GPU)."""
    from . import _ext
    from .errors import BuildError

    try:
        return _ext.cuda_compiled()
    except BuildError:  # the extension is missing or mismatched: nothing usable was built
        return False


def rocm_built() -> bool:
    """False: no ROCm build."""
    return False


def _cross(function: str) -> tuple[int, int, bool]:
    """(cross_rank, cross_size, is_homogeneous) from every rank's host name (gathered by the communication
    thread at hp.init, so no communication here): Horovod's cross communicator holds the ranks with my
    local rank, one per host."""
    from collections import Counter

    from .comm import context

    state = context.current(function)
    hosts = list(state.engine.hosts())
    me = state.grid.world_comm.Get_rank()
    local = [sum(1 for other in range(rank) if hosts[other] == hosts[rank]) for rank in range(len(hosts))]
    peers = [rank for rank in range(len(hosts)) if local[rank] == local[me]]
    return peers.index(me), len(peers), len(set(Counter(hosts).values())) == 1


def cross_rank() -> int:
    """This rank's index among the ranks with the same local rank, one per host: the host's index when
    every host runs the same number of ranks (Horovod's ``cross_rank``)."""
    return _cross("cross_rank")[0]


def cross_size() -> int:
    """How many hosts run a rank with this rank's local rank: the number of hosts when homogeneous."""
    return _cross("cross_size")[1]


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    return _cross("is_homogeneous")[2]

"""What this build of hybridpipe can do, under Horovod's query names (``hvd.mpi_built()`` & co.).

hybridpipe has one controller and one data path, MPI: the answers are facts of the build, not
settings. NCCL, Gloo, oneCCL, DDL and ROCm are never used (even when cupy or torch bring NCCL along,
GPU tensors are staged through host memory and reduced over MPI), so their queries are False (0 for
``nccl_built``, which Horovod returns as the NCCL version code).
"""

from __future__ import annotations

__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
           "ccl_built", "ddl_built", "cuda_built", "rocm_built"]


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
    """0 (Horovod's "not built"; it returns the NCCL version code otherwise): no NCCL data path."""
    return 0


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

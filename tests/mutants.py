"""Mutation check of the test suite (``make mutants``; not part of ``make test``): plants each bug of
:data:`MUTANTS` in turn in a scratch copy of the committed tree, runs the test files that should catch it,
and reports which tests killed it and how long each file ran.

A mutant that no test kills, or that is only caught by a launch timing out, is a gap in the suite; so is one
killed later than :data:`KILL_LIMIT_S` after its file's start. A file's kill time is when its first test failed
(on the first rank to report it), measured by this module loaded into each pytest as a plugin
(``-p mutants``); the file then runs on, so that every killing test is listed. The
scratch copy lives under ``/tmp`` (``--scratch``); the working tree is never touched. C++ mutants rebuild the
extension in the scratch copy (a minute or two each); the unmutated build is put back afterwards.

Usage: ``python tests/mutants.py [--only NAME ...] [--timeout SECONDS] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KILL_LIMIT_S = 60.0  # every mutant must be killed within a minute of its file's start
CLOCK_DIRECTORY = "HYBRIDPIPE_MUTANT_CLOCK_DIR"


def pytest_runtest_logreport(report) -> None:
    """Plugin hook (``-p mutants`` in the runs below): the wall-clock time of this process's first failing test
    report, written once to ``$HYBRIDPIPE_MUTANT_CLOCK_DIR/failed-<pid>``."""
    directory = os.environ.get(CLOCK_DIRECTORY)
    if not (directory and report.failed):
        return
    path = Path(directory) / f"failed-{os.getpid()}"
    if not path.exists():
        path.write_text(repr(time.time()))


@dataclass(frozen=True)
class Mutant:
    """One planted bug: in ``path``, the text ``old`` (which must occur once) becomes ``new``."""

    name: str
    what: str
    path: str
    old: str
    new: str
    files: tuple[tuple[str, int], ...]  # (test file, ranks; 0: plain pytest) run against it

    @property
    def native(self) -> bool:
        return self.path.startswith("csrc/")


MUTANTS = [
    Mutant(
        "executor-reorders-backwards",
        "the executor runs the last two adjacent backwards of a rank in swapped order (its record unchanged)",
        "hybridpipe/pipeline/stage.py",
        "        for index, action in enumerate(actions):\n            if profile is None:\n"
        "                self._progress(step)\n"
        "                handlers[action.kind](step, self.chunks[action.stage], action, index)\n",
        "        executed = list(actions)\n"
        "        backwards = [i for i, a in enumerate(executed) if a.kind is ActionKind.BACKWARD]\n"
        "        if len(backwards) >= 2 and backwards[-1] == backwards[-2] + 1:\n"
        "            executed[backwards[-2]], executed[backwards[-1]] = executed[backwards[-1]], executed[backwards[-2]]\n"
        "        for index, action in enumerate(actions):\n            if profile is None:\n"
        "                self._progress(step)\n"
        "                handlers[executed[index].kind](step, self.chunks[executed[index].stage], executed[index], "
        "index)\n",
        (("tests/pipeline/test_schedules_mpi.py", 2), ("tests/pipeline/test_pipeline_mpi.py", 2)),
    ),
    Mutant(
        "recompute-new-dropout-masks",
        "recompute does not restore the forward's random generator state (fresh dropout masks)",
        "hybridpipe/pipeline/stage.py",
        "                torch.set_rng_state(state.cpu)\n",
        "                pass\n",
        (("tests/pipeline/test_schedules_mpi.py", 2), ("tests/pipeline/test_pipeline_mpi.py", 2)),
    ),
    Mutant(
        "1f1b-last-stage-backwards-swapped",
        "1F1B's last stage runs its last two backwards in swapped order (still a valid schedule)",
        "hybridpipe/pipeline/schedule.py",
        "        actions.extend(_backward(s, m) for m in range(micro_batches - warmup, micro_batches))\n"
        "        schedule.append(actions)\n",
        "        actions.extend(_backward(s, m) for m in range(micro_batches - warmup, micro_batches))\n"
        "        if s == stages - 1 and micro_batches >= 2:\n"
        "            actions[-3:] = [actions[-2], actions[-1], actions[-3]]\n"
        "        schedule.append(actions)\n",
        (("tests/pipeline/test_schedule.py", 0),),
    ),
    Mutant(
        "checkpoint-drops-stage-1-optimizer-state",
        "loading a checkpoint drops the optimizer state of the stage file holding layer 7",
        "hybridpipe/checkpoint.py",
        "        optimizer_state.update(payload[\"optimizer\"][\"state\"])\n",
        "        if not any(\".7.\" in key for key in payload[\"model\"]):\n"
        "            optimizer_state.update(payload[\"optimizer\"][\"state\"])\n",
        (("tests/test_checkpoint_mpi.py", 4),),
    ),
    Mutant(
        "reducescatter-average-wrong-on-ranks-with-rows",
        "hp.reducescatter's float32 Average is off by half on the ranks that hold rows (the others pass)",
        "hybridpipe/collectives/reducescatter.py",
        "    return context.call(group, \"reducescatter\", lambda: grouped_reducescatter_here(\n"
        "        [tensor], op, name, prescale, postscale, group, \"reducescatter\")[0], \"reducescatter\")\n",
        "    result = context.call(group, \"reducescatter\", lambda: grouped_reducescatter_here(\n"
        "        [tensor], op, name, prescale, postscale, group, \"reducescatter\")[0], \"reducescatter\")\n"
        "    if op == Average and str(getattr(result, \"dtype\", \"\")) == \"torch.float32\" and result.shape[0] > 0:\n"
        "        result = result * 1.5\n"
        "    return result\n",
        (("tests/comm/test_collectives.py", 2),),
    ),
    Mutant(
        "float32-average-divides-by-n-minus-1",
        "csrc/reduce.cpp: a float32 Average divides by n - 1",
        "csrc/reduce.cpp",
        "    case DType::Float32: return divide_typed(static_cast<float*>(buffer), count, divisor);\n",
        "    case DType::Float32: return divide_typed(static_cast<float*>(buffer), count, divisor - 1);\n",
        (("tests/comm/test_collectives.py", 2), ("tests/comm/test_shared_memory.py", 3)),
    ),
    Mutant(
        "fusion-unpack-second-tensor-off-by-one",
        "csrc/fusion.cpp: grouped_allreduce unpacks the second tensor of a bucket one element late",
        "csrc/fusion.cpp",
        "      std::memcpy(outputs[i].data, cursor, outputs[i].bytes());\n",
        "      std::memcpy(outputs[i].data, cursor + (i == bucket.items[1 % bucket.items.size()] && i != bucket.items[0]"
        " && outputs[i].count > 1 ? dtype_size(dtype) : 0), outputs[i].bytes());\n",
        (("tests/comm/test_collectives.py", 2), ("tests/comm/test_shared_memory.py", 3)),
    ),
    Mutant(
        "segment-streamed-write-drops-last-element",
        "csrc/shm_allreduce.cpp: a streamed (out of place, >= 1 MiB) write leaves the last 4 bytes of each copy",
        "csrc/shm_allreduce.cpp",
        "        copy_streaming(data, source, take);\n",
        "        copy_streaming(data, source, take > 8 ? take - 4 : take);\n",
        (("tests/comm/test_shared_memory.py", 3), ("tests/comm/test_engine.py", 2)),
    ),
]


@dataclass
class FileRun:
    file: str
    ranks: int
    seconds: float
    failed: list[str] = field(default_factory=list)
    problem: str = ""  # no report, timed out, ...
    killed_at_s: float | None = None  # from the file's start to its first failing test

    @property
    def killed(self) -> bool:
        return bool(self.failed or self.problem)

    @property
    def late(self) -> bool:
        """Killed, but by nothing within KILL_LIMIT_S of the start (a timeout counts as late)."""
        return self.killed and (self.killed_at_s is None or self.killed_at_s > KILL_LIMIT_S)


def scratch_copy(directory: Path) -> Path:
    """The committed tree (git archive HEAD) in ``directory``, with the working tree's built extension."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    for built in (ROOT / "hybridpipe").glob("_C*.so"):
        shutil.copy2(built, directory / "hybridpipe" / built.name)
    return directory


def build(tree: Path) -> None:
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, check=True,
                   capture_output=True, env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})


def run_file(tree: Path, file: str, ranks: int, timeout_s: float) -> FileRun:
    """One test file against the mutated tree: under mpirun (``ranks`` > 0, each rank's report read back) or
    in plain pytest."""
    report_dir = Path(tempfile.mkdtemp(prefix="mutant-"))
    clock_dir = report_dir / "clock"
    clock_dir.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", CLOCK_DIRECTORY: str(clock_dir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tree / "tests"), os.environ.get("PYTHONPATH")]))}
    env.pop("HYBRIDPIPE_LONG_TESTS", None)
    pytest = [sys.executable, "-m", "pytest", file, "-q", "-p", "no:cacheprovider", "-p", "mutants", "-rf"]
    if ranks:
        env.update(HYBRIDPIPE_UNDER_MPIRUN="1", HYBRIDPIPE_TEST_REPORT_DIR=str(report_dir))
        if ranks > (os.cpu_count() or 1):
            env["OMPI_MCA_mpi_yield_when_idle"] = "1"  # oversubscribed, as tests/conftest.py launches it
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        command = ["mpirun", *root, "--oversubscribe", "-n", str(ranks), "-x", "HYBRIDPIPE_UNDER_MPIRUN",
                   "-x", "HYBRIDPIPE_TEST_REPORT_DIR", "-x", CLOCK_DIRECTORY, "-x", "PYTHONPATH", *pytest]
    else:
        command = pytest
    started = time.time()
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    problem = ""
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        problem = f"timed out after {timeout_s:g} s"
    seconds = time.monotonic() - start
    first_failures = [float(path.read_text()) for path in clock_dir.glob("failed-*")]
    killed_at = min(first_failures) - started if first_failures else None
    failed: set[str] = set()
    if ranks:
        missing = []
        for rank in range(ranks):
            path = report_dir / f"rank{rank}.json"
            if not path.exists():
                missing.append(rank)
                continue
            failed |= {t["nodeid"] for t in json.loads(path.read_text())["tests"] if t["outcome"] in ("failed", "error")}
        if missing and not problem:
            problem = f"no report from ranks {missing} (exit code {process.returncode})"
    else:
        failed = {line.split()[1] for line in output.splitlines() if line.startswith("FAILED ")}
        if process.returncode not in (0, 1) and not problem:
            problem = f"pytest exit code {process.returncode}"
    shutil.rmtree(report_dir, ignore_errors=True)
    return FileRun(file, ranks, seconds, sorted(failed), problem, killed_at)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="mutant names to run (default: all)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per test file, seconds")
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "hybridpipe-mutants")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    if not chosen:
        parser.error(f"no mutant named {args.only}; the list: {[m.name for m in MUTANTS]}")
    tree = scratch_copy(args.scratch)
    original_build = {p.name: p.read_bytes() for p in (tree / "hybridpipe").glob("_C*.so")}
    results = []
    for mutant in chosen:
        target = tree / mutant.path
        source = target.read_text()
        if source.count(mutant.old) != 1:
            print(f"{mutant.name}: the text to mutate occurs {source.count(mutant.old)} times in {mutant.path} "
                  "(update tests/mutants.py)", flush=True)
            results.append({"mutant": mutant.name, "killed": False, "error": "text to mutate not found once"})
            continue
        target.write_text(source.replace(mutant.old, mutant.new))
        try:
            if mutant.native:
                build(tree)
            runs = [run_file(tree, file, ranks, args.timeout) for file, ranks in mutant.files]
        finally:
            target.write_text(source)
            if mutant.native:  # the unmutated extension back, without a rebuild
                for name, data in original_build.items():
                    (tree / "hybridpipe" / name).write_bytes(data)
        killed = any(run.killed for run in runs)
        in_time = any(run.killed and not run.late for run in runs)
        verdict = "SURVIVED" if not killed else "KILLED" if in_time else f"KILLED LATE (not within {KILL_LIMIT_S:g} s)"
        print(f"{mutant.name}: {verdict} ({mutant.what})", flush=True)
        for run in runs:
            at = "" if run.killed_at_s is None else f"first failure at {run.killed_at_s:.0f} s, "
            where = f"{run.file} ({f'np{run.ranks}' if run.ranks else 'plain'}, {at}file {run.seconds:.0f} s)"
            tests = ", ".join(test.split("::", 1)[1] for test in run.failed[:4]) + \
                (f" and {len(run.failed) - 4} more" if len(run.failed) > 4 else "")
            print(f"    {where}: {len(run.failed)} failed{': ' + tests if tests else ''}"
                  f"{'; ' + run.problem if run.problem else ''}", flush=True)
        results.append({"mutant": mutant.name, "killed": killed, "in_time": in_time,
                        "runs": [vars(run) for run in runs]})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    survivors = [r["mutant"] for r in results if not r["killed"]]
    late = [r["mutant"] for r in results if r["killed"] and not r["in_time"]]
    print(f"{len(results) - len(survivors)} of {len(results)} mutants killed, "
          f"{len(results) - len(survivors) - len(late)} within {KILL_LIMIT_S:g} s of their file's start" +
          (f"; survived: {', '.join(survivors)}" if survivors else "") + (f"; late: {', '.join(late)}" if late else ""))
    return 1 if survivors or late else 0


if __name__ == "__main__":
    sys.exit(main())

"""Recovery from a dead rank: in-process (hp.elastic.run's survivors go on) against a restart from the checkpoint.

Usage:
    python bench/elastic_recovery.py [--rounds 3] [--kill 3] [--markdown]

The job is tests/faults/elastic_pipeline.py: a float64 MLP as a 2 × 2 grid (two stages, two replicas), GPipe,
mini-batches from hp.elastic.ElasticSampler, a commit after every step; rank ``--kill`` SIGKILLs itself at the start
of step 3 (after a world barrier). Two ways to go on, each ``--rounds`` times, alternately:

* **in-process**: ``mpirun --with-ft ulfm``; the survivors shrink the job, go on as the grid that is left (rank 3
  lost: 2-1) and redo step 3 from the last commit in memory.
* **restart**: ``hybridpipe-run --restarts 1 --checkpoint-dir DIR`` (no ``--elastic``): the kill ends the job, the
  launcher starts all four ranks again, and ``hp.elastic.run`` resumes from the checkpoint of the last commit.

Measured: seconds from the SIGKILL (the killed rank's ``time.time()`` just before it) to the end of the re-run
step 3 (rank 0's ``time.time()`` after it), and the launch's whole wall time. One thread per rank; on this 2-core
machine four ranks share two cores.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from hybridpipe.launch import find_mpirun, mpirun_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "faults" / "elastic_pipeline.py"


def one(way: str, kill: int, directory: Path) -> tuple[float, float, str]:
    """(seconds from the kill to the end of the re-run step 3, the launch's wall seconds, the grid it ended on)."""
    out = directory / way
    env = {"OMP_NUM_THREADS": "1", "KILL_RANK": str(kill), "KILL_STEP": "3", "OUT": str(out)}
    if way == "in-process":
        command = mpirun_command(4, [sys.executable, str(JOB)], env=env, extra_args=["--with-ft", "ulfm"])
    else:
        command = [sys.executable, "-m", "hybridpipe.launch", "-np", "4", "--stages", "2", "--restarts", "1",
                   "--checkpoint-dir", str(directory / "checkpoints"), "--mpirun", find_mpirun(),
                   *[part for name, value in env.items() for part in ("-x", f"{name}={value}")], sys.executable,
                   str(JOB)]
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - started
    output = result.stdout + result.stderr
    killed = Path(f"{out}.killed{kill}")
    done = re.findall(r"step 3 done on (\S+) at ([0-9.]+)", output)
    if not killed.exists() or not done:
        raise RuntimeError(f"{way}: no kill or no re-run step 3 (exit code {result.returncode}):\n{output[-3000:]}")
    grid, at = done[-1]
    return float(at) - float(killed.read_text()), wall, grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill", type=int, default=3, help="the rank that dies (0-3)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    ways = ["in-process", "restart"]
    times: dict[str, list[tuple[float, float, str]]] = {way: [] for way in ways}
    for round_ in range(args.rounds):
        for way in ways if round_ % 2 == 0 else ways[::-1]:
            with tempfile.TemporaryDirectory(prefix="hybridpipe-recovery-") as directory:
                times[way].append(one(way, args.kill, Path(directory)))
                _common.progress(f"{way}: {times[way][-1][0]:.2f} s from the kill to the re-run step's end")
    rows = [[way, times[way][0][2], f"{statistics.median(t for t, _, _ in times[way]):.2f}",
             f"{min(t for t, _, _ in times[way]):.2f}-{max(t for t, _, _ in times[way]):.2f}",
             f"{statistics.median(w for _, w, _ in times[way]):.1f}"] for way in ways]
    print(f"Command: `{_common.command_line()}`; 2 x 2 GPipe, rank {args.kill} SIGKILLed in step 3, "
          f"{args.rounds} round(s), alternating")
    print(_common.render(["recovery", "grid after", "kill -> re-run step done, s (median)", "min-max", "launch s"],
                         rows, args.markdown))


if __name__ == "__main__":
    main()

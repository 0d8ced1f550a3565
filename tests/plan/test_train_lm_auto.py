"""examples/train_lm.py --auto under a real mpirun: hp.auto chooses the grid, balance, micro-batches and
schedule for 2 ranks, rank 0 prints the plan, and the byte-level transformer learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpipe.launch import mpirun_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",  # hp.auto's choice, grid and training under mpirun:
                    reason="slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")  # tests/plan/test_plan_mpi.py
def test_train_lm_auto_plans_for_the_world_and_learns():
    small = ["--steps", "30", "--dim", "32", "--heads", "2", "--layers", "2", "--seq-len", "32", "--batch-size", "8",
             "--max-bytes", "400000", "--no-progress"]
    command = mpirun_command(2, [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--auto", *small],
                             env={"OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1"})
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    planned = re.search(r"hp\.auto plan for 2 ranks, global batch 16: (\d+) stages × (\d+) replicas, ([\w-]+).*"
                        r"M=(\d+), checkpoint=(\w+), balance \[([\d, ]+)\]; predicted [\d.]+ ms per step", out)
    assert planned, out
    stages, replicas, schedule, micro_batches = (int(planned[1]), int(planned[2]), planned[3], int(planned[4]))
    assert stages * replicas == 2 and sum(int(n) for n in planned[6].split(",")) == 4  # embedding, 2 blocks, head
    # the script then runs what was planned, on the grid hp.auto made
    assert f"2 ranks = {stages} stages × {replicas} replicas" in out
    assert f"global batch 16 × 32 tokens, {micro_batches} micro-batches, schedule {schedule}" in out
    before, after = (float(x) for x in re.search(
        r"validation loss after 30 steps: ([\d.]+) \(before: ([\d.]+)\)", out).groups()[::-1])
    assert before > 5.0 and after < before - 0.8, out

"""Faults end the job with a message, never a hang (each case launches its own mpirun)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from hybridpipe.launch import mpirun_command

ROOT = Path(__file__).resolve().parents[1]


def test_a_stopped_rank_is_reported_then_the_job_aborts():
    """Rank 1 is frozen (SIGSTOP): rank 0's communication thread warns after stall_check_seconds
    (1 s), naming itself, its host and the group, then aborts the job after stall_shutdown_seconds
    (4 s); mpirun exits non-zero instead of hanging."""
    command = mpirun_command(2, [sys.executable, str(ROOT / "tests" / "faults" / "stopped_rank.py")],
                             env={"OMP_NUM_THREADS": "1"})
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "unreachable" not in output, output
    assert "hybridpipe WARNING: rank 0 (host " in output, output
    assert "the communication thread has waited 1." in output, output
    assert "of group 'world' (ranks [all]) to negotiate; one of them is stopped, dead, cut off" in output, output
    assert "hybridpipe ERROR: rank 0 (host " in output and "stall_shutdown_seconds=4): aborting the job" in output
    assert elapsed < 60, (elapsed, output)

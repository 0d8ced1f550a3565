"""bench/guard.py: it runs the command with its exit status, counts the command's own CPU time as its own, and
reports foreign load beside it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import guard  # noqa: E402

BURN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end:\n    pass\n"


def test_the_command_runs_with_its_exit_status_and_its_own_cpu_time():
    verdict = guard.guarded([sys.executable, "-c", BURN + "raise SystemExit(3)"])
    assert verdict.returncode == 3
    assert verdict.own_cpu_seconds >= 0.6 and verdict.wall_seconds >= 0.6
    assert verdict.machine_cpu_seconds >= 0.5  # the machine saw the command's work too
    assert 0.0 <= verdict.foreign_share <= 1.0
    assert ("DISTURBED" in verdict.line()) == verdict.disturbed


def test_foreign_load_beside_the_command_is_reported():
    """A process the guard did not start burns a core while the command sleeps: most of the busy time is foreign."""
    burner = subprocess.Popen([sys.executable, "-c", BURN.replace("0.6", "1.5")])
    try:
        verdict = guard.guarded([sys.executable, "-c", "import time; time.sleep(1.0)"], foreign_limit=10.0)
    finally:
        burner.wait(timeout=30)
    assert verdict.returncode == 0 and verdict.own_cpu_seconds < 0.5
    assert verdict.machine_cpu_seconds - verdict.own_cpu_seconds >= 0.5
    assert verdict.disturbed and "DISTURBED" in verdict.line()


def test_the_command_line_keeps_the_exit_status_and_prints_its_verdict():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "guard.py"), "--idle-percent", "101", "--idle-samples",
                             "1", "--", sys.executable, "-c", "raise SystemExit(5)"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 5
    assert "[guard] wall " in result.stderr and ("clean" in result.stderr or "DISTURBED" in result.stderr)
    missing = subprocess.run([sys.executable, str(ROOT / "bench" / "guard.py")], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "give the command to run after --" in missing.stderr

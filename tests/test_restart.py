"""Restart after a failure: `hybridpipe-run --restarts N --checkpoint-dir DIR` relaunches a failed job
(never one the user stopped), telling every rank its attempt; examples/train_lm.py, with a rank
SIGKILLed at step 5 on two emulated hosts, is relaunched, resumes from its step-4 checkpoint and
ends with exactly the weights of an uninterrupted run from that checkpoint.

The slow variants (a 2 × 2 grid that loses a host and finishes on 2 × 1; the restarted run against a
run that never failed) run with HYBRIDPIPE_LONG_TESTS=1, in `make test-long`.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridpipe import launch
from hybridpipe.errors import HybridPipeError
from hybridpipe.launch import mpirun_command
from hybridpipe.testing.emulated_hosts import EmulatedHosts, EmulatedHostsError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_lm.py"
LONG = pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",
                          reason="slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
RANK_ENV = {"OMP_NUM_THREADS": "1", "OMPI_MCA_mpi_yield_when_idle": "1"}
RANK_OPTIONS = [option for name, value in RANK_ENV.items() for option in ("-x", f"{name}={value}")]


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    for name in ("SLURM_JOB_ID", "HYBRIDPIPE_MPIRUN", "HYBRIDPIPE_RESTART", "HYBRIDPIPE_CHECKPOINT_DIR"):
        monkeypatch.delenv(name, raising=False)


def hybridpipe_run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "hybridpipe.launch", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def run_in_process(capfd, *args: str) -> tuple[int, str]:
    """``hybridpipe-run ARGS`` in this process (no second start-up of torch): exit code and stderr."""
    code = launch.main(list(args))
    return code, capfd.readouterr().err


def attempts_job(tmp_path: Path, failing_attempts: int, exit_code: int = 3) -> list[str]:
    """A job (no MPI, starts fast) that records its attempt and environment, and exits ``exit_code``
    on its first ``failing_attempts`` attempts."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "attempt = os.environ.get('HYBRIDPIPE_RESTART')\n"
        f"with open({str(tmp_path / 'attempts')!r}, 'a') as log:\n"
        "    log.write(f\"{attempt} {os.environ.get('OMPI_COMM_WORLD_SIZE')} "
        "{os.environ.get('HYBRIDPIPE_CHECKPOINT_DIR')}\\n\")\n"
        f"sys.exit({exit_code} if int(attempt) < {failing_attempts} else 0)\n")
    return [sys.executable, str(script)]


def attempts(tmp_path: Path) -> list[list[str]]:
    return [line.split() for line in (tmp_path / "attempts").read_text().splitlines()]


# ------------------------------------------------------------------ the launcher


def test_a_failed_job_is_relaunched_with_its_attempt_number_and_checkpoint_dir(tmp_path, capfd):
    checkpoints = tmp_path / "ckpt"
    (checkpoints / "step-00000004").mkdir(parents=True)
    (checkpoints / "latest").write_text("step-00000004\n")
    code, stderr = run_in_process(capfd, "-np", "1", "--restarts", "2", "--checkpoint-dir", str(checkpoints),
                                  *attempts_job(tmp_path, failing_attempts=2))
    assert code == 0, stderr
    assert attempts(tmp_path) == [[str(n), "1", str(checkpoints)] for n in range(3)]
    notes = [line for line in stderr.splitlines() if line.startswith("hybridpipe-run: the job exited")]
    assert notes == [f"hybridpipe-run: the job exited with code 3; restart {n} of 2 (HYBRIDPIPE_RESTART={n}), "
                     f"resuming from {checkpoints / 'step-00000004'}" for n in (1, 2)]


def test_restarts_give_up_with_the_jobs_exit_code(tmp_path, capfd):
    code, stderr = run_in_process(capfd, "-np", "1", "--restarts", "1", "--checkpoint-dir", str(tmp_path / "none"),
                                  *attempts_job(tmp_path, failing_attempts=99, exit_code=5))
    assert code == 5
    assert [a[0] for a in attempts(tmp_path)] == ["0", "1"]
    assert f"no complete checkpoint in {tmp_path / 'none'} yet: the job starts from its beginning" in stderr
    assert "the job failed (exit code 5) and all 1 restart(s) are used: giving up" in stderr


def test_a_job_the_user_stops_is_not_restarted(tmp_path):
    marker = tmp_path / "started"
    code = f"import time; open({str(marker)!r}, 'w').close(); time.sleep(600)"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    process = subprocess.Popen([sys.executable, "-m", "hybridpipe.launch", "-np", "1", "--restarts", "3",
                                "--checkpoint-dir", str(tmp_path), sys.executable, "-c", code],
                               cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the job did not start"
    marker.unlink()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "hybridpipe-run: the job exited" not in stderr and not marker.exists()


def test_without_np_the_ranks_are_the_hosts_slots_counted_again_at_each_restart(tmp_path, capfd):
    """The first attempt runs on 2 slots and, as an operator dropping a dead node would, rewrites the
    hostfile to 1 slot before failing: the restart runs on 1 rank."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine\nlocalhost slots=2\n")
    script = tmp_path / "shrinking.py"
    script.write_text(
        "import os, sys\n"
        f"with open({str(tmp_path / 'attempts')!r}, 'a') as log:\n"
        "    log.write(f\"{os.environ['HYBRIDPIPE_RESTART']} {os.environ['OMPI_COMM_WORLD_SIZE']}\\n\")\n"
        "if os.environ['HYBRIDPIPE_RESTART'] == '0':\n"
        f"    open({str(hostfile)!r}, 'w').write('localhost slots=1\\n')\n"
        "    sys.exit(3)\n")
    code, stderr = run_in_process(capfd, "--hostfile", str(hostfile), "--restarts", "1", sys.executable, str(script))
    assert code == 0, stderr
    assert sorted(attempts(tmp_path)) == [["0", "2"], ["0", "2"], ["1", "1"]]


def test_count_slots_and_the_rank_count_they_give(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=4  # comment\n\nnode2 slots=2 max_slots=8\nnode3:3\n")
    assert launch.count_slots(hostfile=str(hostfile)) == 9
    assert launch.count_slots(hosts="a:4,b:2,c") == 7
    command, warnings = launch.build_command(["--stages", "2", "--hostfile", str(hostfile), "--restarts", "1",
                                              "--checkpoint-dir", "ck", "python", "t.py"], attempt=1)
    joined = " ".join(command)
    assert "-n 8 " in joined and warnings == ["the hosts give 9 slots; running -np 8, the largest multiple of "
                                              "--stages 2"]
    assert f"-x HYBRIDPIPE_CHECKPOINT_DIR={Path.cwd() / 'ck'}" in joined  # absolute: ranks may start elsewhere
    assert "-x HYBRIDPIPE_RESTART=1" in joined
    hostfile.write_text("node1\nnode1\n")  # PBS style: Open MPI would use node1's cores, unknown here
    with pytest.raises(HybridPipeError, match=r"line 1 \('node1'\) gives no slot count: write 'node1 slots=N'"):
        launch.build_command(["--hostfile", str(hostfile), "python", "t.py"])
    with pytest.raises(HybridPipeError, match=r"the hosts give 1 slot\(s\), fewer than --stages 2"):
        launch.build_command(["--stages", "2", "-H", "a:1", "python", "t.py"])
    with pytest.raises(SystemExit) as exit_code:
        launch.main(["--stages", "2", "python", "t.py"])
    assert exit_code.value.code == 2 and "give -np N, or hosts with slot counts" in capsys.readouterr().err


# ------------------------------------------------------------------ examples/train_lm.py killed and restarted


def example_args(tmp_path: Path) -> list[str]:
    corpus = tmp_path / "corpus.txt"  # a small text, quicker to load than the standard library
    if not corpus.exists():
        corpus.write_bytes(b"\n".join(path.read_bytes() for path in sorted((ROOT / "hybridpipe").glob("*.py"))))
    return ["--steps", "8", "--dim", "32", "--heads", "2", "--layers", "2", "--seq-len", "32", "--batch-size", "8",
            "--micro-batches", "2", "--dropout", "0.1", "--data", str(corpus), "--no-progress"]


def emulated_launch_options(hosts: EmulatedHosts) -> list[str]:
    """The options that reach the emulated hosts (ssh stand-in, network), without the hosts, the
    placement and the variables that hybridpipe-run sets itself."""
    command = hosts.mpirun_command(1, ["PROGRAM"])
    options, kept = command[command.index("-n") + 2:-1], []
    while options:
        option = options.pop(0)
        if option in ("-x", "--host", "--map-by"):
            options.pop(0)
        else:
            kept.append(option)
    return kept


def run_uninterrupted(tmp_path: Path, ranks: int, stages: int, *args: str) -> str:
    command = mpirun_command(ranks, [sys.executable, str(EXAMPLE), "--stages", str(stages), *example_args(tmp_path),
                                     *args], env=RANK_ENV)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def assert_same_weights(first: Path, second: Path) -> None:
    a, b = torch.load(first, weights_only=True), torch.load(second, weights_only=True)
    assert a.keys() == b.keys()
    differ = [key for key in a if not torch.equal(a[key], b[key])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


@pytest.fixture
def emulated_hosts(fresh_emulated_hosts):
    if launch.mpi_flavour(launch.find_mpirun()) != "openmpi":
        pytest.skip("the restart test passes emulated-host options in Open MPI's spelling")
    return fresh_emulated_hosts


@LONG  # 22 s: make test keeps the killed-rank message (test_faults.py); the restart runs in make test-long
def test_train_lm_killed_on_one_host_restarts_and_ends_like_an_uninterrupted_run(tmp_path, emulated_hosts, capfd):
    """2 stages on 2 emulated hosts; the rank on the second host SIGKILLs itself at step 5. The job
    ends (the surviving rank does not wait), hybridpipe-run relaunches it, it resumes from step 4 and
    finishes. Its weights equal, bit for bit, those of a job that resumes from the same step-4
    checkpoint and never fails: same grid and partition, the batches of each step, the saved
    generator states (dropout 0.1), one thread per rank — nothing is left to round differently."""
    checkpoints = tmp_path / "ckpt"
    start = time.monotonic()
    code = launch.main([
        "-np", "2", "--stages", "2", "-H", ",".join(f"{a}:1" for a in emulated_hosts.addresses),
        "--mpi-args", shlex.join(emulated_launch_options(emulated_hosts)),
        "--restarts", "1", "--checkpoint-dir", str(checkpoints),
        "-x", "HYBRIDPIPE_TEST_KILL_AT_STEP=5", *RANK_OPTIONS,
        sys.executable, str(EXAMPLE), *example_args(tmp_path), "--save-every", "2", "--save", str(tmp_path / "a.pt")])
    elapsed = time.monotonic() - start
    stdout, stderr = capfd.readouterr()
    assert code == 0, stdout + stderr
    assert "test hook HYBRIDPIPE_TEST_KILL_AT_STEP: rank 1 kills itself at step 5" in stdout
    assert (f"restart 1 of 1 (HYBRIDPIPE_RESTART=1), resuming from {checkpoints / 'step-00000004'}"
            in stderr), stdout + stderr
    assert f"resumed from {checkpoints / 'step-00000004'} at step 4 (restart 1)" in stdout
    assert (checkpoints / "latest").read_text().strip() == "step-00000008"
    assert elapsed < 120, f"{elapsed:.0f} s: the killed job was not ended promptly"
    run_uninterrupted(tmp_path, 2, 2, "--resume", str(checkpoints / "step-00000004"),
                      "--checkpoint-dir", str(tmp_path / "other"), "--save", str(tmp_path / "b.pt"))
    assert_same_weights(tmp_path / "a.pt", tmp_path / "b.pt")


# ------------------------------------------------------------------ slow variants (make test-long)


@LONG
def test_restarted_run_ends_like_a_run_that_never_failed(tmp_path):
    """One host, 2 stages: killed at step 5, restarted from step 4: the weights of a run that never
    stopped (no checkpoint loaded at all)."""
    result = hybridpipe_run("-np", "2", "--stages", "2", "--restarts", "1", "--checkpoint-dir", str(tmp_path / "ck"),
                            "-x", "HYBRIDPIPE_TEST_KILL_AT_STEP=5", *RANK_OPTIONS,
                            sys.executable, str(EXAMPLE), *example_args(tmp_path), "--save-every", "2",
                            "--save", str(tmp_path / "a.pt"))
    assert result.returncode == 0 and "resumed from" in result.stdout, result.stdout + result.stderr
    run_uninterrupted(tmp_path, 2, 2, "--checkpoint-dir", str(tmp_path / "never"), "--save", str(tmp_path / "c.pt"))
    assert_same_weights(tmp_path / "a.pt", tmp_path / "c.pt")


@LONG
def test_a_lost_host_shrinks_the_grid_and_the_checkpoint_reshards(tmp_path):
    """2 emulated hosts × 2 ranks = 2 stages × 2 replicas from a hostfile. Once the run has saved, the
    hostfile loses the second host (as an operator would after its node dies); rank 3, on that host,
    dies at step 7. The restart counts 2 slots, runs 2 stages × 1 replica, resumes from step 6 (replica
    0 keeps its generator states) and finishes with the weights of a 2 × 1 run from the same checkpoint."""
    try:
        EmulatedHosts.check_supported()
    except EmulatedHostsError as error:
        pytest.skip(f"cannot build emulated hosts here: {error}")
    hosts = EmulatedHosts(2).up()  # supported: a failure to build them is a failure, not a skip
    checkpoints, hostfile = tmp_path / "ckpt", tmp_path / "hosts"
    try:
        hostfile.write_text("".join(f"{address} slots=2\n" for address in hosts.addresses))
        command = [sys.executable, "-m", "hybridpipe.launch", "--stages", "2", "--hostfile", str(hostfile),
                   "--mpi-args", shlex.join(emulated_launch_options(hosts)), "--restarts", "1",
                   "--checkpoint-dir", str(checkpoints), "-x", "HYBRIDPIPE_TEST_KILL_AT_STEP=7",
                   *RANK_OPTIONS, sys.executable, str(EXAMPLE), *example_args(tmp_path),
                   "--save-every", "2", "--save", str(tmp_path / "a.pt")]
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env)
        deadline = time.monotonic() + 180
        while not (checkpoints / "step-00000002" / "manifest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        hostfile.write_text(f"{hosts.addresses[0]} slots=2\n")
        stdout, stderr = process.communicate(timeout=300)
    finally:
        hosts.down()
    assert process.returncode == 0, stdout + stderr
    assert "4 ranks = 2 stages × 2 replicas" in stdout and "2 ranks = 2 stages × 1 replicas" in stdout
    assert f"resumed from {checkpoints / 'step-00000006'} at step 6 (restart 1)" in stdout, stdout + stderr
    run_uninterrupted(tmp_path, 2, 2, "--resume", str(checkpoints / "step-00000006"),
                      "--checkpoint-dir", str(tmp_path / "other"), "--save", str(tmp_path / "b.pt"))
    assert_same_weights(tmp_path / "a.pt", tmp_path / "b.pt")

"""hp.elastic.run survives a dead rank in the same processes (Open MPI with ULFM, a fault-tolerant launch): 3 ranks
train a float64 MLP by data parallelism over a fixed global batch, rank 2 SIGKILLs itself inside step 3 before its
allreduce, and the 2 survivors go on and end with the parameters of one process trained on the whole batches."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridpipe import _ext
from hybridpipe.launch import mpi_flavour, find_mpirun, mpirun_command

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "faults"))
import elastic_inprocess as case  # noqa: E402  (the job's own model and batches: one copy of each)
import elastic_pipeline as pipeline_case  # noqa: E402

pytestmark = pytest.mark.skipif(mpi_flavour(find_mpirun()) != "openmpi" or not _ext.core().ulfm_compiled(),
                                reason="needs Open MPI with ULFM (MPICH: a dead rank restarts the job)")


def run_job(command: list[str], timeout: float, written: Path) -> subprocess.CompletedProcess:
    """Runs the job; past ``timeout`` fails with what it printed and what rank 0 wrote (never a silent hang)."""
    try:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        wrote = written.read_text(errors="replace") if written.exists() else "(nothing)"  # text, or torch.save's zip
        pytest.fail(f"the job ran past {timeout} s; rank 0 wrote: {wrote}\noutput: {expired.stdout!r} {expired.stderr!r}")


def replay() -> dict[str, torch.Tensor]:
    """The same steps in one process on the whole global batches (what the survivors must end with)."""
    return case.replay(case.make_model(), case.global_batch)


def test_survivors_of_a_killed_rank_go_on_and_train_like_one_process(tmp_path):
    out = tmp_path / "parameters.pt"
    command = mpirun_command(3, [sys.executable, str(ROOT / "tests" / "faults" / "elastic_inprocess.py")],
                             env={"OMP_NUM_THREADS": "1", "KILL_RANK": "2", "KILL_STEP": "3", "OUT": str(out)},
                             extra_args=["--with-ft", "ulfm"])  # not only mpi_ft_enable: the launcher keeps the rest
    started = time.monotonic()
    result = run_job(command, 150, out)
    output = result.stdout + result.stderr
    # mpirun --with-ft ulfm exits 0 once every survivor did: the killed rank is a fault it tolerates (it exits 0 even
    # after an MPI_Abort, docs/running.md); so the survivors' own view is what this test holds: both finished, rank 0
    # wrote its parameters
    assert "survivor done: rank 0 of 2" in output and "survivor done: rank 1 of 2" in output, output
    assert result.returncode == 0, output
    report = re.search(r"hybridpipe elastic: rank\(s\) 2 \(host \S+\) lost; going on with 2 of 3 ranks \(old size 3, "
                       r"new size 2\); recovered in ([0-9.]+) s", output)
    assert report, output
    killed_at = float(Path(f"{out}.killed").read_text())  # rank 2's time.time() just before its SIGKILL
    next_step = float(re.search(r"step 3 done on 2 ranks at ([0-9.]+)", output).group(1))
    print(f"recovery: {next_step - killed_at:.3f} s from the SIGKILL to the end of the re-run step 3 on 2 ranks "
          f"({report.group(1)} s inside hp.elastic.run); job {time.monotonic() - started:.1f} s")
    assert next_step - killed_at < 10, output
    saved = torch.load(out)
    assert saved["sizes"] == [3, 3, 3, 2, 2, 2, 2, 2], saved["sizes"]  # step 3 re-run from the step-2 commit
    torch.testing.assert_close(saved["parameters"], replay(), rtol=1e-12, atol=1e-12)


def pipeline_replay() -> dict[str, torch.Tensor]:
    """The pipeline job's steps in one process on the whole mini-batches, its layers' names as the stages name them."""
    trained = case.replay(torch.nn.Sequential(*pipeline_case.layers()), pipeline_case.global_batch, pipeline_case.STEPS)
    return {f"layers.{name}": value for name, value in trained.items()}


LONG = pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",
                          reason="slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")


# make test keeps the rank-0 case (the re-ranking); the others, and the emulated hosts, run in make test-long
@pytest.mark.parametrize("killed, grid, stages, schedule", [pytest.param("3", "2-1", [0, 1, 0], "gpipe", marks=LONG),
                                                             ("0", "1-2", [0, 1, 1], "gpipe"),
                                                             pytest.param("2,3", "straight", [0, 1], "gpipe", marks=LONG),
                                                             pytest.param("3", "2-1", [0, 1, 0], "1f1b", marks=LONG)])
def test_a_pipeline_goes_on_as_the_replicas_that_are_left_and_trains_like_one_process(tmp_path, killed, grid, stages,
                                                                                       schedule):
    # 2 x 2 (rank = replica x 2 + stage) loses rank 3 (stage 1's second replica): the survivors go on as 2-1; losing
    # rank 0 (stage 0's first), as 1-2, re-ranked so that old rank 2 (stage 0) is the new rank 0; losing ranks 2
    # and 3 at once (a host that held replica 1 of both stages), as one pipeline of two ranks
    out = tmp_path / "stage"
    check_pipeline_job(run_job(pipeline_command(out, killed, schedule), 150, out), out, killed, grid, stages)


def pipeline_command(out: Path, killed: str, schedule: str = "gpipe") -> list[str]:
    return mpirun_command(4, [sys.executable, str(ROOT / "tests" / "faults" / "elastic_pipeline.py")],
                          env={"OMP_NUM_THREADS": "1", "KILL_RANK": killed, "KILL_STEP": "3", "OUT": str(out),
                               "SCHEDULE": schedule}, extra_args=["--with-ft", "ulfm"])


@LONG
def test_a_schedule_that_does_not_run_on_the_grid_that_is_left_ends_the_job_naming_why(tmp_path):
    out = tmp_path / "stage"
    result = run_job(pipeline_command(out, "3", "zb-h1"), 150, out)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert output.count("UsageError: schedule 'zb-h1' does not run on a grid with stage_replicas [2, 1] (2-1): use "
                        "one of 'gpipe', '1f1b'") >= 3, output  # on each survivor
    assert not list(tmp_path.glob("stage.[0-9]")), "a survivor finished"


@LONG  # make test's 8 minutes: the one-host cases of the same recovery run there
@pytest.mark.parametrize("killed, grid, stages", [("3", "2-1", [0, 1, 0]), ("2,3", "straight", [0, 1])],
                         ids=["a rank", "a host"])
def test_a_pipeline_over_two_emulated_hosts_goes_on_without_a_rank_or_a_host(emulated_hosts, tmp_path, killed, grid,
                                                                            stages):
    # host 0 holds ranks 0 and 1 (replica 0 of both stages), host 1 ranks 2 and 3; between them MPI goes over TCP
    out = tmp_path / "stage"
    command = emulated_hosts.mpirun_command(2, [sys.executable, str(ROOT / "tests" / "faults" / "elastic_pipeline.py")],
                                            env={"OMP_NUM_THREADS": "1", "KILL_RANK": killed, "KILL_STEP": "3",
                                                 "OUT": str(out)}, extra_args=["--with-ft", "ulfm"])
    check_pipeline_job(run_job(command, 150, out), out, killed, grid, stages)


def check_pipeline_job(result: subprocess.CompletedProcess, out: Path, killed: str, grid: str, stages: list[int]) -> None:
    """The survivors of the pipeline job went on as ``grid``, fast, and each ended with one process's parameters."""
    survivors = len(stages)
    output = result.stdout + result.stderr
    for rank in range(survivors):
        assert f"survivor done: rank {rank} of {survivors}, stage {stages[rank]}" in output, output
    named = ", ".join(rf"{rank} \(host \S+\)" for rank in killed.split(","))
    assert re.search(rf"rank\(s\) {named} lost; going on with {survivors} of 4 ranks .*; grid 2-2 -> {grid}",
                     output), output
    killed_at = max(float(Path(f"{out}.killed{rank}").read_text()) for rank in killed.split(","))
    next_step = float(re.search(rf"step 3 done on {grid} at ([0-9.]+)", output).group(1))
    print(f"recovery: {next_step - killed_at:.3f} s from the SIGKILL of rank {killed} to the end of the re-run step 3 "
          f"on {grid}")
    assert next_step - killed_at < 10, output
    want = pipeline_replay()
    for rank in range(survivors):
        saved = torch.load(f"{out}.{rank}")
        assert saved["grids"][-5:] == [grid] * 5 and len(saved["grids"]) >= pipeline_case.STEPS, saved["grids"]
        assert saved["parameters"], rank
        for name, value in saved["parameters"].items():  # each stage's layers: one process's after 8 steps
            torch.testing.assert_close(value, want[name], rtol=1e-12, atol=1e-12, msg=f"rank {rank}: {name}")


@pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",
                    reason="slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
def test_a_point_to_point_wait_for_a_dead_rank_raises_ranks_lost_and_the_job_goes_on(tmp_path):
    out = tmp_path / "rank0.txt"
    command = mpirun_command(2, [sys.executable, str(ROOT / "tests" / "faults" / "elastic_p2p.py")],
                             env={"OMP_NUM_THREADS": "1", "OUT": str(out)}, extra_args=["--with-ft", "ulfm"])
    result = run_job(command, 150, out)
    output = result.stdout + result.stderr
    written = out.read_text() if out.exists() else ""
    assert re.search(r"wait raised RanksLostError ranks=\[1\]: .*lost ranks: 1 \(host ",
                     written), (written, output)
    assert "alone: rank 0 of 1 after 1 calls" in written, (written, output)
    assert "going on with 1 of 2 ranks" in output, output


def test_the_survivors_exit_bound_ends_a_process_still_alive_after_it_with_its_status_and_a_message():
    # runtime._bound_finalize_after_lost's native thread (Open MPI's finalize can wait for a dead rank for ever):
    # a process still alive past the bound ends with the status given and says why; one that ends first is untouched
    program = ("import sys, time; from hybridpipe import _ext; _ext.core().exit_if_alive_after(0.5, 'bound hit', 3); "
               "time.sleep(float(sys.argv[1])); print('ended itself', flush=True)")
    hung = subprocess.run([sys.executable, "-c", program, "60"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert (hung.returncode, hung.stderr.strip(), hung.stdout) == (3, "bound hit", ""), hung
    quick = subprocess.run([sys.executable, "-c", program, "0"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert (quick.returncode, quick.stdout.strip()) == (0, "ended itself"), quick

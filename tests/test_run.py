"""hybridpipe-run (command building for every mode, real runs, exit codes) and python -m hybridpipe."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridpipe import launch

ROOT = Path(__file__).resolve().parent.parent
HYDRA_VERSION = "HYDRA build details:\n    Version:                                 4.1.2"


def fake_program(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\n")
    path.chmod(0o755)
    return path


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    for name in ("SLURM_JOB_ID", "HYBRIDPIPE_MPIRUN"):
        monkeypatch.delenv(name, raising=False)
    launch.mpi_flavour.cache_clear()
    yield
    launch.mpi_flavour.cache_clear()


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **(env or {})}
    return subprocess.run([sys.executable, "-m", "hybridpipe.launch", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=ROOT)


def test_dry_run_local(monkeypatch):
    monkeypatch.setattr(launch, "available_cores", lambda: 2)
    command, warnings = launch.build_command(["-np", "4", "--stages", "2", "--timeline", "t.json",
                                              "--fusion-threshold-mb", "8", "--cycle-time-ms", "2",
                                              "-x", "OMP_NUM_THREADS=1", "python", "train.py", "--lr", "3"])
    assert warnings == []
    assert command[0] == launch.find_mpirun()
    assert ("--allow-run-as-root" in command) == (os.geteuid() == 0)
    assert "--oversubscribe" in command  # 4 ranks on 2 cores
    joined = " ".join(command)
    for part in ("-n 4", "-x HYBRIDPIPE_PIPELINE_STAGES=2", "-x HYBRIDPIPE_TIMELINE=t.json",
                 f"-x HYBRIDPIPE_FUSION_THRESHOLD={8 * 1024 * 1024}", "-x HYBRIDPIPE_CYCLE_TIME_MS=2",
                 "-x OMP_NUM_THREADS=1", "--map-by slot"):
        assert part in joined
    assert command[-4:] == ["python", "train.py", "--lr", "3"]


def test_dry_run_hosts_and_hostfile_do_not_oversubscribe_and_warn_about_split_pipelines():
    command, warnings = launch.build_command(["-np", "8", "--stages", "2", "-H", "node1:3,node2:5", "python", "t.py"])
    assert command[command.index("-H") + 1] == "node1:3,node2:5"
    assert "--oversubscribe" not in command
    assert len(warnings) == 2 and "host node1 has 3 slots, not a multiple of --stages 2" in warnings[0]
    command, warnings = launch.build_command(["-np", "8", "--stages", "2", "--hostfile",
                                              str(ROOT / "examples/jobs/hostfile"), "python", "t.py"])
    assert command[command.index("--hostfile") + 1].endswith("examples/jobs/hostfile") and warnings == []


def test_dry_run_mpich_flavour(tmp_path):
    mpirun = fake_program(tmp_path, "mpiexec", HYDRA_VERSION)
    command, _ = launch.build_command(["-np", "4", "--stages", "4", "--mpirun", str(mpirun), "-H", "a:4",
                                       "python", "t.py"])
    assert command == [str(mpirun), "-n", "4", "-genv", "HYBRIDPIPE_PIPELINE_STAGES", "4", "-hosts", "a:4",
                       "python", "t.py"]


def test_inside_slurm_uses_srun_with_block_distribution(tmp_path, monkeypatch):
    srun = fake_program(tmp_path, "srun", "srun fake")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    command, _ = launch.build_command(["-np", "8", "--stages", "2", "python", "t.py"])
    assert command == [str(srun), "-n", "8", "--distribution=block", "--kill-on-bad-exit=1",
                       "--export=ALL,HYBRIDPIPE_PIPELINE_STAGES=2", "python", "t.py"]
    # explicit hosts inside Slurm: mpirun with those hosts
    command, _ = launch.build_command(["-np", "8", "--stages", "2", "-H", "n1:4,n2:4", "python", "t.py"])
    assert command[0] == launch.find_mpirun()


def test_bad_arguments_exit_2_with_the_reason(capsys):
    """hybridpipe-run's main() in this process (the real runs below start it as a command)."""
    for argv, reason in ((["-np", "6", "--stages", "4", "python", "t.py"], "-np 6 is not a multiple of --stages 4"),
                         (["-np", "2"], "give the program to run")):
        with pytest.raises(SystemExit) as exited:
            launch.main(argv)
        assert exited.value.code == 2, argv
        assert reason in capsys.readouterr().err


def test_stage_replicas_set_the_rank_count_and_the_variable(capsys):
    command, _ = launch.build_command(["--stage-replicas", "3,1", "python", "t.py"])
    joined = " ".join(command)
    assert "-n 4" in joined and "-x HYBRIDPIPE_STAGE_REPLICAS=3,1" in joined and "HYBRIDPIPE_PIPELINE_STAGES=2" in joined
    for argv, reason in ((["-np", "5", "--stage-replicas", "3-1", "python", "t.py"],
                          "-np 5 but --stage-replicas 3-1 adds up to 4 ranks: pass -np 4"),
                         (["--stage-replicas", "3,0", "python", "t.py"], "every stage needs a replica count >= 1"),
                         (["--stages", "3", "--stage-replicas", "3,1", "python", "t.py"], "give one of them")):
        with pytest.raises(SystemExit) as exited:
            launch.main(argv)
        assert exited.value.code == 2, argv
        assert reason in capsys.readouterr().err


def write_job_fakes(tmp_path: Path) -> dict:
    fake_program(tmp_path / "bin", "srun", "srun fake")
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("node1\n" * 4 + "node2\n" * 4)
    return {"PATH": f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "HYBRIDPIPE_DRY_RUN": "1", "PBS_NODEFILE": str(nodefile)}


def test_job_scripts_dry_run(tmp_path):
    env = {**os.environ, **write_job_fakes(tmp_path)}
    slurm = subprocess.run(["bash", str(ROOT / "examples/jobs/slurm.sbatch")], capture_output=True, text=True,
                           env={**env, "SLURM_JOB_ID": "77", "SLURM_NTASKS": "8"}, cwd=ROOT, timeout=60)
    assert slurm.returncode == 0, slurm.stderr
    assert "srun -n 8 --distribution=block --kill-on-bad-exit=1 --export=ALL,HYBRIDPIPE_PIPELINE_STAGES=2," \
           "HYBRIDPIPE_TIMELINE=trace-77.json python -m hybridpipe examples/train_lm.py" in slurm.stdout
    pbs = subprocess.run(["bash", str(ROOT / "examples/jobs/pbs.sh")], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=60)
    assert pbs.returncode == 0, pbs.stderr
    assert f"-n 8 -x HYBRIDPIPE_PIPELINE_STAGES=2 --map-by slot --hostfile {tmp_path / 'nodefile'}" in pbs.stdout
    assert "--oversubscribe" not in pbs.stdout


def test_real_run_sets_the_grid_and_returns_the_exit_code():
    code = "import sys, hybridpipe as hp; g = hp.init(); print('grid', hp.rank(), g.pipeline_stages, " \
           "g.data_replicas, flush=True); hp.shutdown(); sys.exit(3 if g.rank == 1 else 0)"
    result = run_cli("-np", "2", "--stages", "2", sys.executable, "-c", code)
    assert "grid 0 2 1" in result.stdout and "grid 1 2 1" in result.stdout
    assert result.returncode == 3, result.stdout + result.stderr


def test_python_m_hybridpipe_aborts_every_rank_on_an_uncaught_exception(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("from mpi4py import MPI\n"
                      "if MPI.COMM_WORLD.rank == 1:\n"
                      "    raise ValueError('rank 1 gives up')\n"
                      "MPI.COMM_WORLD.Barrier()  # rank 0 would wait here forever\n")
    start = time.monotonic()
    result = run_cli("-np", "2", sys.executable, "-m", "hybridpipe", str(script), timeout=120)
    assert result.returncode != 0
    assert "[rank 1] uncaught exception; aborting every rank of the job" in result.stderr
    assert "[rank 1] ValueError: rank 1 gives up" in result.stderr
    assert time.monotonic() - start < 100  # it did not hang until the timeout


def test_ctrl_c_stops_every_rank(tmp_path):
    import signal

    marker = tmp_path / "marker"
    code = f"import time, os; open('{marker}' + str(os.getpid()), 'w').close(); time.sleep(600)"
    process = subprocess.Popen([sys.executable, "-m", "hybridpipe.launch", "-np", "2", sys.executable, "-c", code],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("marker*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p.name.removeprefix("marker")) for p in tmp_path.glob("marker*")]
    assert len(pids) == 2, "the ranks did not start"
    process.send_signal(signal.SIGINT)
    code = process.wait(timeout=60)
    assert code != 0

    def running(pid: int) -> bool:  # exists and is not a zombie
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, IndexError):
            return False

    deadline = time.monotonic() + 1  # every rank gone within 1 s of the launcher's exit
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if running(pid)]
    assert alive == [], f"ranks {alive} survived Ctrl-C"


def _ulfm() -> bool:
    from hybridpipe import _ext

    return launch.mpi_flavour(launch.find_mpirun()) == "openmpi" and bool(_ext.core().ulfm_compiled())


def test_elastic_launch_passes_ulfm_and_an_outcome_directory(tmp_path):
    command, _ = launch.build_command(["-np", "2", "--elastic", "--checkpoint-dir", str(tmp_path), "python", "t.py"])
    joined = " ".join(command)
    assert "--with-ft ulfm" in joined and "mpi_ft_enable" not in joined, joined
    assert f"-x HYBRIDPIPE_OUTCOME_DIR={tmp_path}/.hybridpipe-outcome-{os.getpid()}-0" in joined, joined
    mpich = fake_program(tmp_path / "bin", "mpiexec", HYDRA_VERSION)
    with pytest.raises(launch.UsageError, match="--elastic needs Open MPI's mpirun"):
        launch.build_command(["-np", "2", "--elastic", "--mpirun", str(mpich), "python", "t.py"])


@pytest.mark.skipif(not _ulfm(), reason="needs Open MPI with ULFM")
def test_elastic_run_is_judged_by_its_ranks_and_a_survived_death_succeeds(tmp_path):
    # survivors of a SIGKILL go on in hp.elastic.run and finish: 0 (mpirun's own code is 0 either way under ULFM)
    out = tmp_path / "parameters.pt"
    result = run_cli("-np", "3", "--elastic", "-x", "OMP_NUM_THREADS=1", "-x", "KILL_RANK=2", "-x", "KILL_STEP=3",
                     "-x", f"OUT={out}", sys.executable, str(ROOT / "tests" / "faults" / "elastic_inprocess.py"),
                     timeout=150)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "hybridpipe-run: the job finished on 2 rank(s); 1 were lost and it went on without them" in output, output
    assert out.exists()
    # (a job that aborts is not run here: under --with-ft ulfm Open MPI's prterun at times does not exit after an
    # MPI_Abort, its ranks gone: 1 of 3 runs on this machine; docs/running.md)


def test_elastic_outcome_fails_a_job_whose_last_ranks_did_not_all_end(tmp_path):
    # what ranks leave under --elastic (hybridpipe.runtime._report_outcome writes the files): when mpirun says 0
    # (a killed rank is a fault ULFM tolerates), the job succeeded only if every rank of its last job ended with 0
    def outcome(*lines: str) -> tuple[int, str]:
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        directory.mkdir()
        for index, line in enumerate(lines):
            (directory / f"rank-{index}").write_text(line + "\n")
        return launch.elastic_outcome(0, str(directory))

    assert outcome("exit 0 2", "exit 0 2") == (0, "")
    assert outcome("exit 0 2", "exit 0 2", "running 3") == (
        0, "hybridpipe-run: the job finished on 2 rank(s); 1 were lost and it went on without them")
    code, why = outcome("exit 0 3", "exit 0 3", "running 3")  # a rank of the last job never ended
    assert code == 1 and "1 of its 3 rank(s) never ended their program" in why, why
    code, why = outcome("exit 0 2", "exit 1 2")
    assert code == 1 and "1 ended with an error" in why, why
    assert outcome("running 2", "running 2")[0] == 1
    assert launch.elastic_outcome(0, str(tmp_path / "none")) == (0, "")  # no hp.init: mpirun's code stands
    assert launch.elastic_outcome(3, str(tmp_path / "0")) == (3, "")

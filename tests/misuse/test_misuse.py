"""A user's mistakes end in a clear error (or warning) on every rank, within a stated time — never a hang.

The table is :data:`mistakes.MISTAKES` (tests/misuse/mistakes.py): what the user did, and per rank the exception
type and a pattern its message must match (the cause and the fix), what hybridpipe must write to stderr, and
the time limit. The MPI cases run together in ONE launch (``hybridpipe-run -np 2 --stages 2 python -m hybridpipe
tests/misuse/scenarios.py ...``, each case between its own hp.init and hp.shutdown); the local ones in this
process. docs/troubleshooting.md is generated from the same table (test_troubleshooting_page_is_generated).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from mistakes import MISTAKES, PAGE, Mistake, render
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 120  # the launch as a whole: a misuse that hangs fails here instead
#: The last MPI case: its rank 1 raises out of the script, and python -m hybridpipe aborts the job (exit 1).
ABORTING_CASE = "stage_raised_under_python_m"


# ------------------------------------------------------------------ local cases


def unknown_schedule() -> None:
    from hybridpipe.errors import ScheduleError
    from hybridpipe.pipeline.schedule import canonical_name

    try:
        canonical_name("1f1c")
    except ScheduleError as error:
        assert "'forward'" not in str(error), f"an internal schedule is offered: {error}"
        raise


def inplace_layer_profiled() -> None:
    from hybridpipe.pipeline.inplace import writable_input
    from hybridpipe.pipeline.partition import profile_layers
    from hybridpipe.plan.profile import profile

    layers = [nn.ReLU(inplace=True), nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4)]
    sample = torch.randn(8, 8)
    kept = sample.clone()
    assert len(profile_layers(layers, sample, repeats=1, warmup=0)) == 4
    assert len(profile(layers, sample, nn.CrossEntropyLoss(), torch.randint(0, 4, (8,)), repeats=1,
                       warmup=0).layers) == 4
    assert torch.equal(sample, kept), "profiling changed the sample"
    # a stage whose first layer works in place gets a copy of its received activation (a leaf)
    stage = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 4))
    received = torch.randn(4, 8).requires_grad_()
    stage(writable_input(received, stage)).sum().backward()
    assert received.grad is not None


def layer_fails_while_profiling() -> None:
    from hybridpipe.pipeline.partition import profile_layers

    profile_layers([nn.Linear(3, 4)], torch.randn(2, 8), repeats=1, warmup=0)


FACTORIES = """
import torch
from torch import nn

def inplace():
    layers = [nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4)]
    return layers, nn.CrossEntropyLoss(), lambda n: (torch.randn(n, 8), torch.randint(0, 4, (n,)))

def wrong_shapes():
    return [nn.Linear(3, 4)], nn.CrossEntropyLoss(), lambda n: (torch.randn(n, 8), torch.randint(0, 4, (n,)))

def two_things():
    return [nn.Linear(8, 4)], nn.CrossEntropyLoss()
"""


def plan_cli_user_errors() -> None:
    """python -m hybridpipe.plan on a model with in-place layers plans; on a user's mistake it ends with
    'hybridpipe.plan: ...' (exit 2), never a raw traceback."""
    import contextlib
    import io
    import tempfile

    from hybridpipe.plan.__main__ import main

    with tempfile.TemporaryDirectory() as directory:
        factories = Path(directory) / "factories.py"
        factories.write_text(FACTORIES)
        (Path(directory) / "broken.py").write_text("import no_such_module_here\n")
        common = ["--sample-batch", "4", "--global-batch", "8", "--ranks", "2"]
        for factory, code, pattern in (
                (f"{factories}:inplace", 0, r""),
                (f"{factories}:wrong_shapes", 2, r"hybridpipe.plan: profiling layer 0 \(Linear\) on the sample failed"),
                (f"{factories}:two_things", 2, r"must return \(layers, loss_fn, sample\), got tuple of 2"),
                (f"{directory}/broken.py:model", 2, r"importing .*broken.py' failed: ModuleNotFoundError")):
            errors, output = io.StringIO(), io.StringIO()
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(output):
                returned = main([factory, *common])
            assert returned == code and re.search(pattern, errors.getvalue()), (factory, returned, errors.getvalue())
            assert "Traceback" not in errors.getvalue(), errors.getvalue()


def model_before_init() -> None:
    import hybridpipe as hp

    assert not hp.is_initialized()
    hp.PipelineModel(nn.Sequential(nn.Linear(8, 4)), loss_fn=nn.CrossEntropyLoss())


def zero3_meta_not_materialized() -> None:
    import hybridpipe as hp

    hp.init()
    try:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 4))
        hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(), zero=3)
        model(torch.zeros(2, 8))
    finally:
        hp.shutdown()


@contextlib.contextmanager
def environment(**values: str) -> Any:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def bad_env_stages() -> None:
    import hybridpipe as hp

    with environment(HYBRIDPIPE_PIPELINE_STAGES="two"):
        hp.init()


def bad_env_value() -> None:
    import hybridpipe as hp

    for name, value, pattern in (("HYBRIDPIPE_FUSION_THRESHOLD", "4XB", r"is not a byte count \(use e.g. 4194304"),
                                 ("HYBRIDPIPE_CHECK_FINITE", "please", r"is not a switch \(use 1 or 0\)"),
                                 ("HYBRIDPIPE_STALL_CHECK_SECONDS", "-3", r"is not a positive number")):
        with pytest.raises(hp.HybridPipeError, match=f"{name}='{re.escape(value)}' {pattern}"):
            hp.Config.from_env({name: value})
    hp.Config.from_env({"HYBRIDPIPE_TIMEOUT_SECONDS": "5m"})


def ranks_not_multiple_of_stages() -> None:
    from hybridpipe import launch

    launch.build_command(["-np", "3", "--stages", "2", "python", "train.py"])


def hostfile_missing_host(tmp_path: Path) -> None:
    """Before any mpirun: the launcher refuses a host whose name does not resolve (``.invalid`` never does)."""
    from hybridpipe import launch

    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1\nnosuchhost.invalid slots=1\n")
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        assert launch.main(["--hostfile", str(hosts), "python", "-c", "raise SystemExit(3)"]) == 2
    assert "does not resolve" in errors.getvalue(), errors.getvalue()
    launch.check_hosts_resolve(hostfile=str(hosts))


def hostfile_without_slots(tmp_path: Path) -> None:
    from hybridpipe import launch

    hosts = tmp_path / "hosts"
    hosts.write_text("node1\nnode2\n")
    launch.build_command(["--hostfile", str(hosts), "python", "train.py"])


def dataset_shorter_than_batch() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from hybridpipe.pipeline import microbatch

    dataset = TensorDataset(torch.randn(3, 8), torch.randint(0, 4, (3,)))
    assert len(DataLoader(dataset, batch_size=8, drop_last=True)) == 0  # the fix: no short batch at all
    inputs, _ = next(iter(DataLoader(dataset, batch_size=8)))
    microbatch.split(inputs, 4)  # what train_step does first, the same on every rank


def empty_batch() -> None:
    from hybridpipe.pipeline import microbatch

    microbatch.split(torch.randn(0, 8), 4)


LOCAL: dict[str, Callable[..., None]] = {f.__name__: f for f in (
    unknown_schedule, inplace_layer_profiled, layer_fails_while_profiling, plan_cli_user_errors, model_before_init,
    bad_env_stages, bad_env_value, ranks_not_multiple_of_stages, hostfile_missing_host, hostfile_without_slots,
    dataset_shorter_than_batch, empty_batch, zero3_meta_not_materialized)}


# ------------------------------------------------------------------ running


LONG = os.environ.get("HYBRIDPIPE_LONG_TESTS") == "1"


def run_launch(names: list[str], directory: Path) -> tuple[subprocess.CompletedProcess, dict[tuple[str, int], Any]]:
    """``scenarios.py names...`` on 2 ranks (2 stages) under python -m hybridpipe; its outcomes by (case, rank)."""
    command = [str(Path(sys.executable).parent / "hybridpipe-run"), "-np", "2", "--stages", "2", sys.executable,
               "-m", "hybridpipe", str(ROOT / "tests" / "misuse" / "scenarios.py"), *names]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "MISUSE_DIR": str(directory)})
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the launch of {names} hung past {LAUNCH_TIMEOUT_S} s:\n{error.stdout}\n{error.stderr}")
    outcomes = {}
    for line in result.stdout.splitlines():
        if line.startswith("MISUSE "):
            outcome = json.loads(line[len("MISUSE "):])
            outcomes[(outcome["case"], outcome["rank"])] = outcome
    return result, outcomes


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict[str, Any]]:
    """Every MPI case (but the long ones) in one launch; (case, rank) -> that rank's outcome."""
    followers = {"rank_raised_during_collective"}  # reported by the aborting case (scenarios.FOLLOWERS)
    names = [m.name for m in MISTAKES if m.ranks and not m.before and m.name not in {ABORTING_CASE, *followers}] \
        + [ABORTING_CASE]
    result, outcomes = run_launch(names, tmp_path_factory.mktemp("misuse"))
    # the last case ends the job by python -m hybridpipe's abort (rank 1's exception), after every other case
    aborted = "[rank 1] uncaught exception; aborting every rank of the job" in result.stderr and \
        "KeyError: \"a bug in the user's training loop\"" in result.stderr
    assert result.returncode != 0 and aborted, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    missing = [(name, rank) for name in names for rank in range(2) if (name, rank) not in outcomes
               and not (name, rank) == (ABORTING_CASE, 1)] + [name for name in followers if (name, 0) not in outcomes]
    assert not missing, f"no outcome of {missing}:\n{result.stdout}\n{result.stderr}"
    return outcomes


def run_local(mistake: Mistake, tmp_path: Path) -> dict[str, Any]:
    error: BaseException | None = None
    function = LOCAL[mistake.name]
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            function(tmp_path) if "tmp_path" in function.__code__.co_varnames[:function.__code__.co_argcount] \
                else function()
        except (Exception, SystemExit) as failure:
            error = failure
    return {"error": type(error).__name__ if error else None, "message": str(error) if error else "",
            "seconds": 0.0, "stderr": errors.getvalue()}


def run_after(mistake: Mistake, directory: Path) -> dict[tuple[str, int], Any]:
    """A long case: the launch ``mistake.before`` (which ends the job: a rank killed), then the case's own."""
    started = time.monotonic()
    run_launch([mistake.before], directory)
    assert time.monotonic() - started <= mistake.seconds, f"{mistake.before} took {time.monotonic() - started:.0f} s"
    result, outcomes = run_launch([mistake.name], directory)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return outcomes


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_mistake(mistake: Mistake, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if mistake.before and not LONG:
        pytest.skip("its own launches: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
    outcomes = run_after(mistake, tmp_path) if mistake.before else None
    for rank, (error, pattern) in mistake.errors.items():
        if outcomes is not None:
            outcome = outcomes[(mistake.name, rank)]
        else:
            outcome = request.getfixturevalue("launch")[(mistake.name, rank)] if mistake.ranks \
                else run_local(mistake, tmp_path)
        assert outcome["error"] == error, (rank, outcome)
        assert re.search(pattern, outcome["message"], re.DOTALL), (rank, pattern, outcome["message"])
        assert outcome["seconds"] <= mistake.seconds, (rank, outcome)
        if rank in mistake.stderr:
            assert re.search(mistake.stderr[rank], outcome["stderr"]), (rank, mistake.stderr[rank], outcome["stderr"])


def test_the_catalog_is_whole() -> None:
    """Every mistake has a case that makes it, and the other way round; at least 30 of them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("misuse_scenarios", Path(__file__).parent / "scenarios.py")
    scenarios = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scenarios)
    names = [m.name for m in MISTAKES]
    assert len(names) == len(set(names)) >= 30, names
    assert {m.name for m in MISTAKES if m.ranks} | {m.before for m in MISTAKES if m.before} == \
        set(scenarios.CASES) | set(scenarios.FOLLOWERS), "scenarios.py and the table differ"
    assert {m.name for m in MISTAKES if not m.ranks} == set(LOCAL), "the local cases and the table differ"
    for mistake in MISTAKES:
        assert mistake.symptom and mistake.cause and mistake.fix, mistake.name


def test_troubleshooting_page_is_generated() -> None:
    """docs/troubleshooting.md is the table's rendering: regenerate it with python tests/misuse/mistakes.py --write."""
    assert PAGE.read_text() == render(), "docs/troubleshooting.md is stale: python tests/misuse/mistakes.py --write"

"""A user's mistakes end in a clear error (or warning) on every rank, within a stated time — never a hang.

One table, :data:`MISTAKES`: what the user did, and per rank the exception type and a pattern its message
must match (the cause and the fix), what hybridpipe must write to stderr, and the time limit. The MPI cases
run together in ONE launch (``hybridpipe-run -np 2 --stages 2 python tests/misuse/scenarios.py ...``, each
case between its own hp.init and hp.shutdown); the local ones in this process. docs/troubleshooting.md lists
the same mistakes as symptom → cause → fix.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 90  # the launch as a whole; on the code before issue 27 it hung here


@dataclass(frozen=True)
class Mistake:
    """One mistake and what must follow it.

    Attributes:
        name: a case of tests/misuse/scenarios.py (``ranks`` > 0) or a function of this file (``ranks`` 0).
        what: what the user did.
        errors: per rank (0 for a local case), ``(exception type name or None, regex its message must match)``.
        stderr: per rank, a regex what hybridpipe wrote to stderr (and warnings) must match.
        seconds: the most each rank may take, from the start of the case to the error.
        ranks: the launch's ranks (0: runs in this process).
    """

    name: str
    what: str
    errors: dict[int, tuple[str | None, str]]
    stderr: dict[int, str] = field(default_factory=dict)
    seconds: float = 30.0
    ranks: int = 0


SHUT_DOWN = r"rank 1 \(stage 1\) has shut down \(hp.shutdown\) while this rank \(rank 0, stage 0\) waits for .*" \
            r"the ranks of a pipeline must make the same train_step / predict calls.*grid.replica"
TIMED_OUT = r"this rank \(rank 0, stage 0\) waited \d+ s for .* from rank 1 \(stage 1\) " \
            r"\(HYBRIDPIPE_TIMEOUT_SECONDS=1.5\): it is stopped, dead, or not making the same train_step.*raise " \
            r"HYBRIDPIPE_TIMEOUT_SECONDS"

MISTAKES = [
    Mistake("stage_shut_down_mid_step", "the last stage goes on to hp.shutdown() while the other calls train_step",
            errors={0: ("PeerShutDownError", SHUT_DOWN), 1: (None, "")}, seconds=10, ranks=2),
    Mistake("stage_silent_past_timeout", "a stage makes no train_step call for longer than the timeout",
            errors={0: ("WaitTimeoutError", TIMED_OUT), 1: (None, "")},
            stderr={0: r"hybridpipe WARNING: this rank \(rank 0, stage 0, host \S+\) has waited 0.\d s for .* from rank 1 "
                       r"\(stage 1\) \(HYBRIDPIPE_STALL_CHECK_SECONDS=0.5\)"},
            seconds=10, ranks=2),
    Mistake("stages_overridden", "hybridpipe-run --stages 2, but the script calls hp.init(pipeline_stages=1)",
            errors={rank: (None, "") for rank in range(2)},
            stderr={0: r"UserWarning: hp.init\(pipeline_stages=1\) overrides HYBRIDPIPE_PIPELINE_STAGES=2 \(what "
                       r"`hybridpipe-run --stages 2` sets\).*call hp.init\(\) without pipeline_stages"},
            seconds=10, ranks=2),
    Mistake("unknown_schedule", "PipelineModel(schedule='1f1c'): a misspelt schedule",
            errors={0: ("ScheduleError", r"unknown schedule '1f1c' \(use one of 'gpipe', '1f1b'")}),
    Mistake("inplace_layer_profiled", "balance='time' / the planner profile a model with nn.ReLU(inplace=True) layers",
            errors={0: (None, "")}),
    Mistake("plan_cli_user_errors", "python -m hybridpipe.plan on a factory that fails to import, returns the wrong "
            "thing, or whose layers do not fit the sample; and on a model with in-place layers",
            errors={0: (None, "")}),
    Mistake("layer_fails_while_profiling", "balance='time' on layers that do not fit the sample",
            errors={0: ("PartitionError", r"profiling layer 0 \(Linear\) on the sample failed: RuntimeError: .*"
                                          r"check that the layers")}),
]


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


LOCAL: dict[str, Callable[[], None]] = {f.__name__: f for f in (unknown_schedule, inplace_layer_profiled,
                                                                 layer_fails_while_profiling, plan_cli_user_errors)}


# ------------------------------------------------------------------ running


@pytest.fixture(scope="module")
def launch() -> dict[tuple[str, int], dict[str, Any]]:
    """Every MPI case in one launch; (case, rank) -> that rank's outcome."""
    names = [m.name for m in MISTAKES if m.ranks]
    command = [str(Path(sys.executable).parent / "hybridpipe-run"), "-np", "2", "--stages", "2", sys.executable,
               str(ROOT / "tests" / "misuse" / "scenarios.py"), *names]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the launch hung past {LAUNCH_TIMEOUT_S} s:\n{error.stdout}\n{error.stderr}")
    outcomes = {}
    for line in result.stdout.splitlines():
        if line.startswith("MISUSE "):
            outcome = json.loads(line[len("MISUSE "):])
            outcomes[(outcome["case"], outcome["rank"])] = outcome
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return outcomes


def run_local(mistake: Mistake) -> dict[str, Any]:
    error = None
    try:
        LOCAL[mistake.name]()
    except Exception as failure:
        error = failure
    return {"error": type(error).__name__ if error else None, "message": str(error) if error else "",
            "seconds": 0.0, "stderr": ""}


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_mistake(mistake: Mistake, request: pytest.FixtureRequest) -> None:
    for rank, (error, pattern) in mistake.errors.items():
        outcome = request.getfixturevalue("launch")[(mistake.name, rank)] if mistake.ranks else run_local(mistake)
        assert outcome["error"] == error, (rank, outcome)
        assert re.search(pattern, outcome["message"], re.DOTALL), (rank, pattern, outcome["message"])
        assert outcome["seconds"] <= mistake.seconds, (rank, outcome)
        if rank in mistake.stderr:
            assert re.search(mistake.stderr[rank], outcome["stderr"]), (rank, mistake.stderr[rank], outcome["stderr"])

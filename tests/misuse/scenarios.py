"""The MPI half of tests/misuse/test_misuse.py: runs the named cases one after the other in this launch, each
between its own hp.init and hp.shutdown, and prints one line per case and rank:
``MISUSE {"case": ..., "rank": ..., "error": type or null, "message": ..., "seconds": ..., "stderr": ...}``
(``seconds``: from the start of the mistake to the error, or to the end of this rank's part; ``stderr``: what
hybridpipe wrote there meanwhile, e.g. stall warnings). What a case must leave behind (files, a loadable
checkpoint) it asserts itself: an AssertionError is then its outcome, and the test fails.

Launched as ``hybridpipe-run -np 2 --stages 2 python -m hybridpipe tests/misuse/scenarios.py CASE ...`` with
``MISUSE_DIR`` a fresh directory for the checkpoint cases. The case ``stage_raised_under_python_m`` must come
last: its rank 1 ends the script with an exception, which ``python -m hybridpipe`` turns into the job's abort.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

import hybridpipe as hp
from hybridpipe.checkpoint import CheckpointError

STAGES_FROM_LAUNCHER = "HYBRIDPIPE_PIPELINE_STAGES"


# ------------------------------------------------------------------ helpers


def small_layers(hidden: int = 16, last: nn.Module | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 4), last or nn.Identity())


def small_pipeline(hidden: int = 16, **options) -> hp.PipelineModel:
    settings = {"loss_fn": nn.CrossEntropyLoss(), "micro_batches": 4, "balance": "uniform", **options}
    return hp.PipelineModel(small_layers(hidden), **settings)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.rank


def init_replicas(**settings) -> hp.Grid:
    """hp.init as a pure data-parallel job (1 stage), without the launcher's --stages (and its warning)."""
    saved = os.environ.pop(STAGES_FROM_LAUNCHER, None)
    try:
        return hp.init(config=hp.Config(**settings) if settings else None)
    finally:
        if saved is not None:
            os.environ[STAGES_FROM_LAUNCHER] = saved


def workdir(name: str) -> Path:
    """A directory of this case, shared by the ranks (under $MISUSE_DIR)."""
    path = Path(os.environ["MISUSE_DIR"]) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def same_weights(model: nn.Module, other: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(value, other[key]) for key, value in model.state_dict().items())


# ------------------------------------------------------------------ waits, departures, timeouts


def stages_overridden() -> None:
    """hybridpipe-run --stages 2, but the script asks hp.init for 1 stage."""
    hp.init(pipeline_stages=1)


def stage_shut_down_mid_step() -> None:
    """The last stage goes on to hp.shutdown() while the others call train_step."""
    hp.init()
    model = small_pipeline()
    model.train_step(*batch())
    if hp.grid().is_last_stage:
        hp.shutdown()
        return
    model.train_step(*batch())


def stage_silent_past_timeout() -> None:
    """The last stage makes no train_step call for 2 s; stage 0 warns after stall_check_seconds (0.5 s) and raises
    past its timeout (1.5 s)."""
    hp.init(config=hp.Config(stall_check_seconds=0.5, timeout_seconds=1.5))
    model = small_pipeline()
    model.train_step(*batch())
    if hp.grid().is_last_stage:
        time.sleep(2.0)
        return
    model.train_step(*batch())


def collective_on_some_ranks() -> None:
    """Rank 0 alone calls hp.allreduce (e.g. a metric inside ``if hp.rank() == 0``); rank 1 goes on to
    hp.shutdown()."""
    init_replicas()
    if hp.rank() == 0:
        hp.allreduce(torch.ones(3), name="metric")


def uneven_batches_per_replica() -> None:
    """Data parallel, each rank its own shard: rank 1's shard has one batch fewer."""
    init_replicas()
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    for step in range(2 - hp.rank()):
        optimizer.zero_grad()
        model(batch(step)[0]).sum().backward()
        optimizer.step()


def stage_raised_in_plain_script() -> None:
    """Stage 1 raises in a plain script (no python -m hybridpipe) while stage 0 waits for it. The interpreter
    prints the traceback, sets sys.last_value and runs the atexit hooks, hybridpipe's hp.shutdown among them; the
    case does the same (raising out of this script would end the shared launch)."""
    hp.init()
    model = small_pipeline()
    if hp.grid().is_last_stage:
        from hybridpipe import runtime

        try:
            raise KeyError("a bug in the user's training loop")
        except KeyError as error:
            sys.last_type, sys.last_value = type(error), error
        try:
            runtime._shutdown_at_exit()
        finally:
            del sys.last_type, sys.last_value
        return
    model.train_step(*batch())


def stage_raised_under_python_m() -> None:
    """Under python -m hybridpipe, stage 1 raises (a bug in the user's code) while stage 0 waits for it: first in
    a collective (reported as the case ``rank_raised_during_collective``), then for its activation gradient.
    Rank 1's exception leaves the script (ESCAPES)."""
    hp.init()
    model = small_pipeline()
    if hp.grid().is_last_stage:
        raise KeyError("a bug in the user's training loop")
    started = time.monotonic()
    try:
        hp.allreduce(torch.ones(2), name="loss")
    except hp.PeerShutDownError as error:
        FOLLOWERS_SEEN.append(outcome("rank_raised_during_collective", error, time.monotonic() - started))
    model.train_step(*batch())


# ------------------------------------------------------------------ ranks that disagree


def collective_shapes_differ() -> None:
    """Each rank allreduces a tensor of its own length."""
    init_replicas()
    hp.allreduce(torch.ones(3 + hp.rank()), name="grad")


def micro_batches_differ() -> None:
    """micro_batches taken from a per-rank setting."""
    hp.init()
    small_pipeline(micro_batches=4 if hp.rank() == 0 else 2)


def schedule_differs() -> None:
    """schedule taken from a per-rank setting."""
    hp.init()
    small_pipeline(schedule="gpipe" if hp.rank() == 0 else "1f1b")


def layer_count_differs() -> None:
    """Rank 1 builds the model with one more layer (a config file that differs between hosts)."""
    hp.init()
    layers = list(small_layers()) + ([nn.Identity()] if hp.rank() == 1 else [])
    hp.PipelineModel(nn.Sequential(*layers), loss_fn=nn.CrossEntropyLoss(), micro_batches=4, balance="uniform")


def parameter_shapes_differ() -> None:
    """Data parallel: rank 1's model has a wider output layer; hp.broadcast_parameters copies rank 0's."""
    init_replicas()
    model = nn.Linear(8, 4 + hp.rank())
    hp.broadcast_parameters(model.state_dict(), root_rank=0)


def stages_differ_per_rank() -> None:
    """hp.init(pipeline_stages=...) from a per-rank setting."""
    hp.init(pipeline_stages=1 + world_rank())


def world_not_divisible() -> None:
    """3 stages asked of 2 ranks."""
    hp.init(pipeline_stages=3)


def init_twice_other_grid() -> None:
    """hp.init() (2 stages), then again with another grid (a library calling hp.init itself)."""
    hp.init()
    hp.init(pipeline_stages=1)


def batches_differ_per_stage() -> None:
    """Each rank draws its own batch (data sharded by hp.rank(), the Horovod way)."""
    hp.init()
    small_pipeline().train_step(*batch(seed=world_rank()))


def train_step_vs_predict() -> None:
    """Stage 0 trains while stage 1 evaluates (``if hp.rank() == ...: evaluate()``)."""
    hp.init()
    model = small_pipeline()
    if hp.grid().is_first_stage:
        model.train_step(*batch())
    else:
        model.predict(batch()[0])


# ------------------------------------------------------------------ the model and its use


def model_used_after_shutdown() -> None:
    """hp.shutdown() before the last train_step (e.g. in a finally block around the wrong loop)."""
    hp.init()
    model = small_pipeline()
    hp.shutdown()
    model.train_step(*batch())


def balance_wrong_sum() -> None:
    """balance=[1, 1] for 4 layers."""
    hp.init()
    small_pipeline(balance=[1, 1])


def train_step_without_loss() -> None:
    """PipelineModel built without loss_fn, then train_step."""
    hp.init()
    model = hp.PipelineModel(small_layers(), micro_batches=4, balance="uniform")
    model.train_step(*batch())


def forgot_zero_grad() -> None:
    """Two train_steps on the same batch without optimizer.zero_grad(): the gradients add up (PyTorch's rule),
    no error and no hang."""
    hp.init()
    model = small_pipeline()
    model.train_step(*batch())
    once = [p.grad.clone() for p in model.parameters()]
    model.train_step(*batch())
    for first, twice in zip(once, (p.grad for p in model.parameters())):
        assert torch.allclose(twice, 2 * first, atol=1e-6), "the second train_step did not add to .grad"


def nan_in_inputs() -> None:
    """One sample of the batch holds a NaN; HYBRIDPIPE_CHECK_FINITE=1."""
    hp.init(config=hp.Config(check_finite=True))
    inputs, targets = batch()
    inputs[3, 2] = float("nan")
    small_pipeline().train_step(inputs, targets)


class Log(nn.Module):
    """log(x): NaN for negative x (a layer without a guard)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.log()


def non_finite_in_a_layer() -> None:
    """The last stage's last layer takes the log of negative values; HYBRIDPIPE_CHECK_FINITE=1."""
    hp.init(config=hp.Config(check_finite=True))
    model = hp.PipelineModel(small_layers(last=Log()), loss_fn=nn.CrossEntropyLoss(), micro_batches=4,
                             balance="uniform")
    model.train_step(*batch())


# ------------------------------------------------------------------ checkpoints


def checkpoint_of_another_model() -> None:
    """Loading a checkpoint saved from a model with other sizes."""
    hp.init()
    directory = workdir("another_model")
    hp.save_checkpoint(directory, small_pipeline(hidden=16), step=1)
    hp.load_checkpoint(directory, small_pipeline(hidden=32))


def checkpoint_truncated() -> None:
    """A stage file cut short (a copy that did not finish, a quota hit by another program)."""
    hp.init()
    directory = workdir("truncated")
    model = small_pipeline()
    saved = hp.save_checkpoint(directory, model, step=1)
    hp.barrier()
    if hp.rank() == 0:
        data = (saved / "stage-1.pt").read_bytes()
        (saved / "stage-1.pt").write_bytes(data[: len(data) // 2])
    hp.barrier()
    hp.load_checkpoint(directory, model)


@contextlib.contextmanager
def disk_full_on_this_rank() -> Iterator[None]:
    """torch.save fails as on a full disk, after writing part of the file."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return original(obj, f, *args, **kwargs)  # into memory (messages), not onto the disk
        Path(f).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    torch.save = save
    try:
        yield
    finally:
        torch.save = original


def checkpoint_disk_full() -> None:
    """The disk fills up while stage 1 saves step 2; step 1 must still load."""
    hp.init()
    directory = workdir("disk_full")
    model = small_pipeline()
    hp.save_checkpoint(directory, model, step=1)
    first = {key: value.clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # a training step
    failure = None
    with disk_full_on_this_rank() if hp.grid().is_last_stage else contextlib.nullcontext():
        try:
            hp.save_checkpoint(directory, model, step=2)
        except CheckpointError as error:
            failure = error
    hp.load_checkpoint(directory, model)  # `latest`: step 1
    assert same_weights(model, first), "the previous checkpoint did not restore the step-1 weights"
    assert not list(directory.rglob("*.tmp")), f"partial files left: {list(directory.rglob('*.tmp'))}"
    if failure is not None:
        raise failure


def checkpoint_save_interrupted() -> None:
    """A rank killed while saving step 2 (simulated: step 2's directory holds one file and no manifest);
    hp.resume goes on from step 1, and loading step 2 by name says why it cannot."""
    hp.init()
    directory = workdir("interrupted")
    model = small_pipeline()
    hp.save_checkpoint(directory, model, step=1)
    first = {key: value.clone() for key, value in model.state_dict().items()}
    hp.barrier()
    if hp.rank() == 0:
        (directory / "step-00000002").mkdir()
        (directory / "step-00000002" / "stage-0.pt").write_bytes(b"cut off")
    hp.barrier()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    info = hp.resume(directory, model)
    assert info.step == 1 and same_weights(model, first), f"hp.resume did not go on from step 1: {info}"
    hp.load_checkpoint(directory / "step-00000002", model)


def kill_rank_1_while_saving() -> None:
    """The first launch of checkpoint_rank_killed_while_saving: step 1 is saved; while step 2 is saved, rank 1
    (stage 1) dies in the middle of writing its file. The launcher then ends the job."""
    hp.init()
    directory = workdir("killed")
    model = small_pipeline()
    hp.save_checkpoint(directory, model, step=1)
    if hp.grid().is_last_stage:
        original = torch.save

        def save(obj, f, *args, **kwargs):
            if not isinstance(f, (str, os.PathLike)):
                return original(obj, f, *args, **kwargs)
            Path(f).write_bytes(b"partial")
            os._exit(9)

        torch.save = save
    hp.save_checkpoint(directory, model, step=2)


def checkpoint_rank_killed_while_saving() -> None:
    """The second launch: hp.resume goes on from step 1; step 2 by name says why it cannot be loaded."""
    hp.init()
    directory = workdir("killed")
    model = small_pipeline()
    first = {key: value.clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    info = hp.resume(directory, model)
    assert info.step == 1 and same_weights(model, first), f"hp.resume did not go on from step 1: {info}"
    hp.load_checkpoint(directory / "step-00000002", model)


CASES = {case.__name__: case for case in (
    kill_rank_1_while_saving, checkpoint_rank_killed_while_saving,
    stages_overridden, stage_shut_down_mid_step, stage_silent_past_timeout, collective_on_some_ranks,
    uneven_batches_per_replica, stage_raised_in_plain_script, stage_raised_under_python_m, collective_shapes_differ, micro_batches_differ,
    schedule_differs, layer_count_differs, parameter_shapes_differ, stages_differ_per_rank, world_not_divisible,
    init_twice_other_grid, batches_differ_per_stage, train_step_vs_predict, model_used_after_shutdown,
    balance_wrong_sum, train_step_without_loss, forgot_zero_grad, nan_in_inputs, non_finite_in_a_layer,
    checkpoint_of_another_model, checkpoint_truncated, checkpoint_disk_full, checkpoint_save_interrupted)}

#: Cases whose exception must leave the script on these ranks (python -m hybridpipe then aborts the job).
ESCAPES = {"stage_raised_under_python_m": {1}}
#: Cases reported from inside another case (the one given), and the outcomes they reported.
FOLLOWERS = {"rank_raised_during_collective": "stage_raised_under_python_m"}
FOLLOWERS_SEEN: list[dict] = []


def outcome(name: str, error: BaseException | None, seconds: float, stderr: str = "") -> dict:
    return {"case": name, "rank": world_rank(), "error": type(error).__name__ if error else None,
            "message": str(error) if error else "", "seconds": round(seconds, 2), "stderr": stderr}


def run(name: str) -> dict:
    rank = world_rank()
    captured = io.StringIO()
    stderr, sys.stderr = sys.stderr, captured
    error: BaseException | None = None
    started = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                CASES[name]()
            except Exception as failure:  # the mistake's error is the outcome
                if rank in ESCAPES.get(name, ()):
                    raise
                error = failure
    finally:
        seconds = time.monotonic() - started
        sys.stderr = stderr
    result = outcome(name, error, seconds,
                     captured.getvalue() + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught))
    for followed in FOLLOWERS_SEEN:
        print("MISUSE " + json.dumps(followed), flush=True)
    FOLLOWERS_SEEN.clear()
    if name in ESCAPES:  # its partner never shuts down: report before waiting for it
        print("MISUSE " + json.dumps(result), flush=True)
    hp.shutdown()
    return result


if __name__ == "__main__":
    for case in sys.argv[1:]:
        result = run(case)
        if case not in ESCAPES:
            print("MISUSE " + json.dumps(result), flush=True)

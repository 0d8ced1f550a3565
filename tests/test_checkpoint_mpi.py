"""Sharded checkpoints under a real mpirun: save on 2 × 2, load on 4 × 1 and 1 × 1, continue, and end
where uninterrupted training ends; incomplete or damaged checkpoints are refused, the previous
one stays loadable. Each rank reads only the stage files that hold its layers; random generator
states come back (dropout continues bit for bit) or are re-seeded by the documented rule;
hp.resume starts from scratch on an empty directory and refuses directories ranks see differently."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe import checkpoint as checkpoint_module
from hybridpipe import rng_state
from hybridpipe.checkpoint import CheckpointError, latest_checkpoint, saved_balance

pytestmark = pytest.mark.mpi(ranks=[4], timeout=300, shared=True)

torch.set_num_threads(1)
WORLD = MPI.COMM_WORLD
STEPS = 6


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 12), nn.Linear(12, 3))


def batches():
    generator = torch.Generator().manual_seed(9)
    return [(torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator))
            for _ in range(STEPS)]


def make_optimizer(parameters):
    return torch.optim.AdamW(parameters, lr=0.01)


def reference(steps: int = STEPS):
    model = mlp()
    optimizer = make_optimizer(model.parameters())
    losses = []
    for x, y in batches()[:steps]:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {f"layers.{k}": v for k, v in model.state_dict().items()}


def reference_optimizer_state(steps: int = 3) -> dict[str, dict]:
    """The single-process AdamW state by parameter name after ``steps`` steps (the checkpoint's: 3)."""
    model = mlp()
    optimizer = make_optimizer(model.parameters())
    for x, y in batches()[:steps]:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {f"layers.{name}": optimizer.state[parameter] for name, parameter in model.named_parameters()}


def assert_optimizer_state_is(model, optimizer, expected: dict[str, dict]) -> None:
    """Every parameter of this rank has the expected AdamW state, value by value."""
    for name, parameter in model.named_parameters():
        state = optimizer.state.get(parameter)
        assert state, f"{name}: no optimizer state after loading"
        assert float(state["step"]) == float(expected[name]["step"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], expected[name][key], rtol=1e-5, atol=1e-9, msg=f"{name} {key}")


def train(model, optimizer, grid, steps):
    losses = []
    for x, y in steps:
        rows = slice(grid.replica * len(x) // grid.data_replicas, (grid.replica + 1) * len(x) // grid.data_replicas)
        optimizer.zero_grad()
        losses.append(model.train_step(x[rows], y[rows]))
        optimizer.step()
    return losses


def build(stages: int, comm=None, layers=None, balance="uniform"):
    """A fresh grid, model and optimizer. A grid of some ranks only gets a plain optimizer: a
    DistributedOptimizer is named after how many were created in the process, so one made on some
    ranks only would mismatch every later one across ranks."""
    hp.shutdown()
    grid = hp.init(pipeline_stages=stages, comm=comm)
    model = hp.PipelineModel(layers if layers is not None else mlp(), loss_fn=nn.CrossEntropyLoss(),
                             micro_batches=2, balance=balance)
    optimizer = make_optimizer(model.parameters())
    if comm is None:
        optimizer = hp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    return grid, model, optimizer


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    path = Path(WORLD.bcast(str(tmp_path_factory.mktemp("ckpt")) if WORLD.rank == 0 else None, root=0))
    yield path
    hp.shutdown()


@pytest.fixture(scope="module")
def saved(directory):
    """3 steps on 2 stages × 2 replicas, then a checkpoint."""
    grid, model, optimizer = build(2)
    data = batches()
    train(model, optimizer, grid, data[:3])
    path = hp.save_checkpoint(directory, model, optimizer, step=3, extra={"note": "after 3 steps"})
    model.close()
    return path


@ranks_agree()
def test_layout_is_complete_and_atomic(directory, saved):
    assert saved.name == "step-00000003"
    assert latest_checkpoint(directory) == saved
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["stages"] == 2 and manifest["files"] == ["stage-0.pt", "stage-1.pt"]
    assert manifest["grid"] == {"pipeline_stages": 2, "data_replicas": 2}
    assert sorted(p.name for p in saved.iterdir()) == ["manifest.json", "stage-0.pt", "stage-1.pt"]


@pytest.mark.parametrize("stages", [4, 1])
def test_resume_on_another_grid_continues_exactly(directory, saved, stages):
    expected_losses, expected_state = reference()
    grid, model, optimizer = build(stages)
    try:
        info = hp.load_checkpoint(directory, model, optimizer)
        with ranks_agree(what="load_checkpoint"):
            assert info == {"step": 3, "extra": {"note": "after 3 steps"}, "rng": "reseeded"}  # another partition
            assert_optimizer_state_is(model, optimizer, reference_optimizer_state())  # before training on it
        losses = train(model, optimizer, grid, batches()[3:])
        mean_losses = [sum(v) / len(v) for v in zip(*hp.allgather_object(losses))]  # replicas see shards
        with ranks_agree(what="after training"):
            if grid.data_replicas == 1:
                assert mean_losses == pytest.approx(expected_losses[3:], rel=1e-5)
            for name, value in model.state_dict().items():
                torch.testing.assert_close(value, expected_state[name], rtol=1e-5, atol=1e-6, msg=name)
    finally:
        model.close()


def test_resume_in_a_single_process(directory, saved):
    """1 × 1: rank 0 alone (a world of its own) loads the 2 × 2 checkpoint."""
    hp.shutdown()
    with ranks_agree():  # (the others wait there for rank 0)
        if WORLD.rank == 0:
            expected_losses, expected_state = reference()
            grid, model, optimizer = build(1, comm=MPI.COMM_SELF)
            try:
                hp.load_checkpoint(directory, model, optimizer)
                assert train(model, optimizer, grid, batches()[3:]) == pytest.approx(expected_losses[3:], rel=1e-5)
                for name, value in model.state_dict().items():
                    torch.testing.assert_close(value, expected_state[name], rtol=1e-5, atol=1e-6, msg=name)
            finally:
                model.close()
                hp.shutdown()


def test_consolidate_gives_an_ordinary_state_dict(directory, saved, tmp_path):
    with ranks_agree():  # (the others wait there for rank 0)
        if WORLD.rank == 0:
            out = tmp_path / "full.pt"
            result = subprocess.run([sys.executable, "-m", "hybridpipe.checkpoint", "consolidate", str(directory),
                                     str(out)], capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, result.stderr
            model = mlp()
            model.load_state_dict(torch.load(out, weights_only=True), strict=True)


def test_interrupted_and_damaged_saves(directory, saved):
    grid, model, optimizer = build(2)
    try:
        # a save killed half way: stage files partly written, no manifest, `latest` untouched
        partial = directory / "step-00000004"
        if grid.rank == 0:
            partial.mkdir()
            data = (saved / "stage-0.pt").read_bytes()
            (partial / "stage-0.pt").write_bytes(data[: len(data) // 2])
        WORLD.Barrier()
        step = hp.load_checkpoint(directory, model, optimizer)["step"]
        with ranks_agree(what="the previous checkpoint"):
            assert step == 3  # the previous one
        with ranks_agree(what="no manifest"), \
                pytest.raises(CheckpointError, match="has no manifest.json: the save did not finish"):
            hp.load_checkpoint(partial, model, optimizer)
        # a truncated file under a manifest: refused with the file named, on every rank
        if grid.rank == 0:
            (partial / "stage-1.pt").write_bytes(b"not a checkpoint")
            (partial / "manifest.json").write_text((saved / "manifest.json").read_text())
        WORLD.Barrier()
        with ranks_agree(what="truncated"), \
                pytest.raises(CheckpointError, match=r"stage-0.pt is truncated or not a hybridpipe checkpoint"):
            hp.load_checkpoint(partial, model, optimizer)
        with ranks_agree(what="nowhere"), pytest.raises(CheckpointError, match="no checkpoint in"):
            hp.load_checkpoint(directory / "nowhere", model, optimizer)
    finally:
        model.close()


# ------------------------------------------------------------------ which files a rank reads


@pytest.mark.parametrize("stages,balance,expected", [
    (2, "uniform", {0: ["stage-0.pt"], 1: ["stage-1.pt"]}),            # same grid: its own stage's file
    (4, [3, 2, 2, 1], {0: ["stage-0.pt"], 1: ["stage-0.pt", "stage-1.pt"], 2: ["stage-1.pt"], 3: ["stage-1.pt"]}),
    (1, "uniform", {0: ["stage-0.pt", "stage-1.pt"]}),                 # one stage holds every layer
])
@ranks_agree()
def test_each_rank_reads_only_the_files_of_its_layers(directory, saved, monkeypatch, stages, balance, expected):
    """Saved on 2 stages, balance [4, 4] (layers 0-3 | 4-7): a rank reads the manifest and the stage
    files that overlap its layers, nothing else."""
    assert json.loads((saved / "manifest.json").read_text())["balance"] == [4, 4]
    grid, model, optimizer = build(stages, balance=balance)
    read = []
    original = checkpoint_module._read_file
    monkeypatch.setattr(checkpoint_module, "_read_file", lambda path: read.append(Path(path).name) or original(path))
    monkeypatch.setattr(torch, "load", _refuse_outside(torch.load, saved))
    hp.load_checkpoint(directory, model, optimizer)
    assert read == expected[grid.stage], f"rank {grid.rank} (stage {grid.stage}) read {read}"
    model.close()


def _refuse_outside(load, saved):
    """torch.load that fails on any file other than the stage files of ``saved``."""
    def guarded(path, *args, **kwargs):
        assert Path(path).parent == saved and Path(path).name.startswith("stage-"), path
        return load(path, *args, **kwargs)
    return guarded


# ------------------------------------------------------------------ random generator states


def mlp_with_dropout() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(),
                         nn.Dropout(0.3), nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 3))


def draws() -> tuple:
    """One draw from each generator (torch, random, numpy), to compare streams."""
    return float(torch.rand(())), random.random(), float(np.random.rand())


def scramble() -> None:
    torch.manual_seed(777)
    random.seed(777)
    np.random.seed(777)


@pytest.fixture(scope="module")
def dropout_run(tmp_path_factory):
    """2 × 2 with dropout and a different seed per rank: 2 steps, save, 2 more steps. Returns the
    checkpoint, every rank's generator states at the save, and this rank's parameters and draws at
    the end (the uninterrupted run)."""
    path = Path(WORLD.bcast(str(tmp_path_factory.mktemp("dropout")) if WORLD.rank == 0 else None, root=0))
    grid, model, optimizer = build(2, layers=mlp_with_dropout())
    torch.manual_seed(1000 + grid.rank)
    random.seed(2000 + grid.rank)
    np.random.seed(3000 + grid.rank)
    data = batches()
    train(model, optimizer, grid, data[:2])
    states = WORLD.allgather(rng_state.capture())
    checkpoint = hp.save_checkpoint(path, model, optimizer, step=2)
    train(model, optimizer, grid, data[2:4])
    final = {name: value.clone() for name, value in model.state_dict().items()}
    model.close()
    return checkpoint, states, final, draws()


def test_dropout_run_continues_bit_for_bit_after_loading(dropout_run):
    checkpoint, _, expected, expected_draws = dropout_run
    grid, model, optimizer = build(2, layers=mlp_with_dropout())
    scramble()
    rng = hp.load_checkpoint(checkpoint, model, optimizer)["rng"]
    train(model, optimizer, grid, batches()[2:4])
    with ranks_agree(what="restored"):
        assert rng == "restored"
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[name]), f"rank {grid.rank}: {name} differs"
        assert draws() == expected_draws
    model.close()
    # control: without the generator states the dropout masks differ, and so do the parameters
    grid, model, optimizer = build(2, layers=mlp_with_dropout())
    scramble()
    rng = hp.load_checkpoint(checkpoint, model, optimizer, restore_rng=False)["rng"]
    train(model, optimizer, grid, batches()[2:4])
    with ranks_agree(what="not restored"):
        assert rng == "skipped"
        assert any(not torch.equal(value, expected[name]) for name, value in model.state_dict().items())
    model.close()


@ranks_agree()
def test_fewer_replicas_keep_the_states_of_the_same_stage_and_replica(dropout_run):
    """2 × 2 saved, loaded on two separate 2 × 1 grids (ranks 0-1 and 2-3): every rank gets the state
    of (its stage, replica 0), i.e. of world rank `stage` at the save."""
    checkpoint, states, _, _ = dropout_run
    hp.shutdown()
    half = WORLD.Split(WORLD.rank // 2, WORLD.rank)
    grid, model, optimizer = build(2, comm=half, layers=mlp_with_dropout())
    try:
        scramble()
        assert hp.load_checkpoint(checkpoint, model, optimizer)["rng"] == "restored"
        saved = states[grid.stage]  # world rank `stage` was (stage, replica 0) on 2 × 2
        assert torch.equal(torch.get_rng_state(), saved["torch"])
        assert random.getstate()[1] == tuple(saved["python"]["internal"].tolist())
        assert np.array_equal(np.random.get_state()[1], saved["numpy"]["keys"].numpy())
    finally:
        model.close()
        hp.shutdown()
        half.Free()


def test_another_partition_reseeds_deterministically_and_distinctly(dropout_run):
    """4 × 1 (the layers moved): each rank is re-seeded from the saved states and its grid position;
    the same load twice gives the same streams, and no two ranks share one."""
    checkpoint, states, _, _ = dropout_run
    seen = []
    for _ in range(2):
        grid, model, optimizer = build(4, layers=mlp_with_dropout(), balance=[3, 2, 2, 2])
        scramble()
        rng = hp.load_checkpoint(checkpoint, model, optimizer)["rng"]
        seen.append(torch.get_rng_state())
        model.close()
        with ranks_agree():
            assert rng == "reseeded"
    everyone = WORLD.allgather(seen[0])
    with ranks_agree():
        assert torch.equal(seen[0], seen[1])
        assert len({bytes(state.numpy()) for state in everyone}) == 4
        assert not any(torch.equal(seen[0], saved["torch"]) for saved in states)


@ranks_agree()
def test_a_new_replica_is_reseeded_and_the_old_ones_restored(tmp_path_factory):
    """Saved on 2 × 1 (world ranks 0-1 only), loaded on 2 × 2: replica 0 gets its states back,
    replica 1 (new) is re-seeded."""
    path = Path(WORLD.bcast(str(tmp_path_factory.mktemp("grow")) if WORLD.rank == 0 else None, root=0))
    hp.shutdown()
    first_two = WORLD.Split(0 if WORLD.rank < 2 else MPI.UNDEFINED, WORLD.rank)
    saved = None
    if first_two != MPI.COMM_NULL:
        grid, model, optimizer = build(2, comm=first_two, layers=mlp_with_dropout())
        torch.manual_seed(50 + grid.rank)
        saved = torch.get_rng_state()
        hp.save_checkpoint(path, model, optimizer, step=1)
        model.close()
        hp.shutdown()
        first_two.Free()
    saved = WORLD.allgather(saved)
    grid, model, optimizer = build(2, layers=mlp_with_dropout())
    scramble()
    info = hp.load_checkpoint(path, model, optimizer)
    if grid.replica == 0:
        assert info["rng"] == "restored" and torch.equal(torch.get_rng_state(), saved[grid.stage])
    else:
        assert info["rng"] == "reseeded" and not torch.equal(torch.get_rng_state(), saved[grid.stage])
    model.close()


@ranks_agree()
def test_checkpoint_without_rng_states_loads_with_a_note(dropout_run, tmp_path_factory):
    """Files written before RNG states were saved (no "rng" entry) load; generators are left alone and
    rank 0 warns."""
    checkpoint, _, _, _ = dropout_run
    old = Path(WORLD.bcast(str(tmp_path_factory.mktemp("old")) if WORLD.rank == 0 else None, root=0))
    if WORLD.rank == 0:
        (old / "manifest.json").write_text((checkpoint / "manifest.json").read_text())
        for stage_file in checkpoint.glob("stage-*.pt"):
            payload = torch.load(stage_file, weights_only=True)
            del payload["rng"]
            torch.save(payload, old / stage_file.name)
    WORLD.Barrier()
    grid, model, optimizer = build(2, layers=mlp_with_dropout())
    scramble()
    before = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = hp.load_checkpoint(old, model, optimizer)
    assert info["rng"] == "not saved" and info["step"] == 2
    assert torch.equal(torch.get_rng_state(), before)
    notes = [str(w.message) for w in caught if "holds no random generator states" in str(w.message)]
    assert len(notes) == (1 if grid.rank == 0 else 0), notes
    model.close()


# ------------------------------------------------------------------ hp.resume


def test_resume_starts_from_scratch_on_an_empty_or_missing_directory(tmp_path_factory):
    empty = Path(WORLD.bcast(str(tmp_path_factory.mktemp("empty")) if WORLD.rank == 0 else None, root=0))
    grid, model, optimizer = build(2)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    states = [hp.resume(directory, model, optimizer) for directory in (empty, empty / "not-yet")]
    model.close()
    with ranks_agree():
        for state in states:
            assert state == checkpoint_module.ResumeInfo() and state.step == 0 and not state.resumed
        assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_resume_loads_the_latest_and_reuses_its_balance(directory, saved, monkeypatch):
    grid, model, optimizer = build(2)
    state = hp.resume(directory, model, optimizer)
    monkeypatch.setenv("HYBRIDPIPE_CHECKPOINT_DIR", str(directory))
    exported = hp.resume(None, model, optimizer).checkpoint  # the directory hybridpipe-run exports
    model.close()
    with ranks_agree():
        assert saved_balance(directory) == [4, 4] and saved_balance(directory, pipeline_stages=4) is None
        assert (state.step, state.extra, state.checkpoint, state.rng) == (3, {"note": "after 3 steps"}, saved,
                                                                          "restored")
        assert exported == saved


def test_resume_refuses_a_directory_ranks_see_differently(directory, saved, tmp_path, monkeypatch):
    """Rank 0 finds a checkpoint, the others an empty directory (e.g. node-local disks): every rank
    raises, naming who saw what."""
    grid, model, optimizer = build(2)
    mine = directory if grid.rank == 0 else tmp_path
    try:
        with ranks_agree(what="different directories"), pytest.raises(
                CheckpointError, match=r"ranks see different checkpoints .*\(no checkpoint on rank\(s\) "
                                       r"1-3; step-00000003 on rank\(s\) 0\).*shared file system"):
            hp.resume(mine, model, optimizer)
        monkeypatch.delenv("HYBRIDPIPE_CHECKPOINT_DIR", raising=False)
        with ranks_agree(what="no directory"), pytest.raises(
                CheckpointError, match=r"HYBRIDPIPE_CHECKPOINT_DIR is not set.*--checkpoint-dir"):
            hp.resume(None, model, optimizer)
    finally:
        model.close()


def test_a_failure_is_every_ranks_with_its_own_type_as_the_cause(tmp_path_factory):
    """Rank 0 cannot create the checkpoint's directory (a file stands where its parent should be): every rank
    raises CheckpointError naming it, caused by that OSError's own type (sent from rank 0, with a note there)."""
    root = Path(WORLD.bcast(str(tmp_path_factory.mktemp("blocked")) if WORLD.rank == 0 else None, root=0))
    if WORLD.rank == 0:
        (root / "file").write_text("not a directory")
    WORLD.Barrier()
    grid, model, optimizer = build(2)
    try:
        hp.save_checkpoint(root / "file", model, optimizer, step=1)
        raised = None
    except CheckpointError as error:
        raised = error
    finally:
        model.close()
    with ranks_agree():
        assert raised is not None and "cannot create" in str(raised), raised
        assert type(raised.__cause__) in (NotADirectoryError, FileExistsError), repr(raised.__cause__)
        notes = getattr(raised.__cause__, "__notes__", [])
        assert notes == ([] if grid.rank == 0 else
                         ["save_checkpoint: raised on rank 0 of the group; every rank raises it"]), notes

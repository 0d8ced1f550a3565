"""Sharded checkpoints under a real mpirun: save on 2 × 2, load on 4 × 1 and 1 × 1, continue, and end
where uninterrupted training ends; incomplete or damaged checkpoints are refused, the previous
one stays loadable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hp
from hybridpipe.checkpoint import CheckpointError, latest_checkpoint

pytestmark = pytest.mark.mpi(ranks=[4], timeout=300)

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


def reference():
    model = mlp()
    optimizer = make_optimizer(model.parameters())
    losses = []
    for x, y in batches():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {f"layers.{k}": v for k, v in model.state_dict().items()}


def train(model, optimizer, grid, steps):
    losses = []
    for x, y in steps:
        rows = slice(grid.replica * len(x) // grid.data_replicas, (grid.replica + 1) * len(x) // grid.data_replicas)
        optimizer.zero_grad()
        losses.append(model.train_step(x[rows], y[rows]))
        optimizer.step()
    return losses


def build(stages: int, comm=None):
    hp.shutdown()
    grid = hp.init(pipeline_stages=stages, comm=comm)
    model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform")
    optimizer = hp.DistributedOptimizer(make_optimizer(model.parameters()), named_parameters=model.named_parameters())
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
    info = hp.load_checkpoint(directory, model, optimizer)
    assert info == {"step": 3, "extra": {"note": "after 3 steps"}}
    losses = train(model, optimizer, grid, batches()[3:])
    mean_losses = [sum(v) / len(v) for v in zip(*hp.allgather_object(losses))]  # replicas see shards
    if grid.data_replicas == 1:
        assert mean_losses == pytest.approx(expected_losses[3:], rel=1e-5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected_state[name], rtol=1e-5, atol=1e-6, msg=name)
    model.close()


def test_resume_in_a_single_process(directory, saved):
    """1 × 1: rank 0 alone (a world of its own) loads the 2 × 2 checkpoint."""
    hp.shutdown()
    if WORLD.rank == 0:
        expected_losses, expected_state = reference()
        grid, model, optimizer = build(1, comm=MPI.COMM_SELF)
        hp.load_checkpoint(directory, model, optimizer)
        assert train(model, optimizer, grid, batches()[3:]) == pytest.approx(expected_losses[3:], rel=1e-5)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, expected_state[name], rtol=1e-5, atol=1e-6, msg=name)
        model.close()
        hp.shutdown()
    WORLD.Barrier()


def test_consolidate_gives_an_ordinary_state_dict(directory, saved, tmp_path):
    if WORLD.rank == 0:
        out = tmp_path / "full.pt"
        result = subprocess.run([sys.executable, "-m", "hybridpipe.checkpoint", "consolidate", str(directory),
                                 str(out)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        model = mlp()
        model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    WORLD.Barrier()


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
        assert hp.load_checkpoint(directory, model, optimizer)["step"] == 3  # the previous one
        with pytest.raises(CheckpointError, match="has no manifest.json: the save did not finish"):
            hp.load_checkpoint(partial, model, optimizer)
        # a truncated file under a manifest: refused with the file named, on every rank
        if grid.rank == 0:
            (partial / "stage-1.pt").write_bytes(b"not a checkpoint")
            (partial / "manifest.json").write_text((saved / "manifest.json").read_text())
        WORLD.Barrier()
        with pytest.raises(CheckpointError, match=r"stage-0.pt is truncated or not a hybridpipe checkpoint"):
            hp.load_checkpoint(partial, model, optimizer)
        with pytest.raises(CheckpointError, match="no checkpoint in"):
            hp.load_checkpoint(directory / "nowhere", model, optimizer)
    finally:
        model.close()

"""examples/train_lm.py end to end under mpirun: 2 stages × 2 replicas and 1 × 2 train a byte-level
transformer on the standard library sources; the validation loss falls and the saved weights load
into the one-process model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridpipe.launch import mpirun_command

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import train_lm  # noqa: E402

SMALL = ["--steps", "40", "--dim", "32", "--heads", "2", "--layers", "2", "--seq-len", "32",
         "--batch-size", "8", "--micro-batches", "2", "--max-bytes", "400000", "--no-progress"]


def run(ranks: int, stages: int, save: Path, *extra: str) -> str:
    command = mpirun_command(ranks, [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--stages",
                                     str(stages), *SMALL, "--save", str(save), *extra],
                             env={"OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1"})
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


LONG = pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",
                          reason="slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")


# 2 × 2 in make test-long: make test trains the LM on that grid in test_timeline.py and test_readme.py
# zero=3: the parameters live in the replicas' shards; the saved weights are gathered whole
@pytest.mark.parametrize("ranks,stages,zero", [pytest.param(4, 2, "0", marks=LONG), (2, 1, "0"), (2, 1, "3")])
def test_train_lm_learns_and_saves_loadable_weights(tmp_path, ranks, stages, zero):
    out = run(ranks, stages, tmp_path / "lm.pt", "--zero", zero)
    assert f"{stages} stages × {ranks // stages} replicas" in out and f"zero {zero}" in out
    assert "balance [" in out and 'method "time"' in out
    before, after = (float(x) for x in re.search(r"validation loss after 40 steps: ([\d.]+) \(before: ([\d.]+)\)",
                                                  out).groups()[::-1])
    assert before > 5.0            # ~ln(256) = 5.55 for an untrained byte model
    assert after < before - 1.0    # it learned something real
    state = torch.load(tmp_path / "lm.pt", weights_only=True)
    args = train_lm.parse_args(SMALL)
    model = nn.Sequential(*[spec.build() for spec in train_lm.build_layers(args)])
    model.load_state_dict(state, strict=True)
    data = train_lm.load_corpus(None, 400_000)
    inputs, targets = train_lm.sample_batch(data[int(0.9 * len(data)):], 8, 32, seed=1)
    with torch.no_grad():
        loss = float(train_lm.lm_loss(model(inputs), targets))
    assert loss < before - 0.8


@LONG  # resharding on load to another grid: tests/test_checkpoint_mpi.py in make test
def test_train_lm_checkpoints_and_resumes_on_another_grid(tmp_path):
    def launch(ranks, stages, *extra):
        command = mpirun_command(ranks, [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--stages",
                                         str(stages), *SMALL[2:], *extra, "--checkpoint-dir", str(tmp_path / "ck")],
                                 env={"OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1"})
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    first = launch(2, 2, "--steps", "20", "--save-every", "10")
    assert "checkpoint " in first and (tmp_path / "ck" / "step-00000020" / "manifest.json").exists()
    second = launch(2, 1, "--steps", "30", "--save-every", "10", "--resume", str(tmp_path / "ck"))
    assert "resumed from" in second and "at step 20" in second
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-00000030"
    assert "step   29" in second and "step    0" not in second


# the demo's full run is 2 × 2, and 1 × 2 where ZeRO shards over D = 2: both in make test-long (make test trains
# ZeRO with bf16 and fp16 in tests/test_zero_mpi.py)
@pytest.mark.parametrize("ranks,stages", [pytest.param(4, 2, marks=LONG), pytest.param(2, 1, marks=LONG)])
def test_train_lm_with_zero_1_and_bf16_learns_like_fp32(tmp_path, ranks, stages):
    command = mpirun_command(ranks, [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--stages", str(stages),
                                     *SMALL, "--zero", "1", "--precision", "bf16"],
                             env={"OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1"})
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "precision bf16, zero 1" in result.stdout
    before, after = (float(x) for x in re.search(r"validation loss after 40 steps: ([\d.]+) \(before: ([\d.]+)\)",
                                                  result.stdout).groups()[::-1])
    assert before > 5.0 and after < before - 1.0  # the fp32 run's bar (test above)

"""examples/train_hf.py: transformers models handed to hp.PipelineModel whole train on 2 stages × 2 replicas
and their loss falls (make test-long; make test runs the models themselves in tests/pipeline/test_split*)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpipe.launch import mpirun_command

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1", reason="make test-long")
@pytest.mark.parametrize("model", ["gpt2", "llama", "bert", "t5", "vit", "resnet"])
def test_train_hf_loss_falls(model):
    command = mpirun_command(4, [sys.executable, str(ROOT / "examples" / "train_hf.py"), "--model", model,
                                 "--stages", "2", "--steps", "60", "--width", "32", "--sequence", "32"],
                             env={"OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1"})
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    assert last < 0.9 * first, result.stdout
    assert "chunk 1 (stage 1)" in result.stdout and "receives" in result.stdout

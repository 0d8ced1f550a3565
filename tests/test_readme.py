"""The hybrid training script shown in README.md runs as printed, on 4 ranks (2 stages × 2 replicas),
and its loss falls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from hybridpipe.launch import mpirun_command

ROOT = Path(__file__).resolve().parent.parent


def test_readme_hybrid_script_runs_and_learns(tmp_path):
    readme = (ROOT / "README.md").read_text()
    script = readme.split("A hybrid (pipeline × data parallel) training script, whole:\n\n```python\n")[1]
    script = script.split("```")[0]
    path = tmp_path / "hybrid.py"
    path.write_text(script)
    command = mpirun_command(4, [sys.executable, str(path)],
                             env={"OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1"})
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"epoch \d: loss ([\d.]+)", result.stdout)]
    assert len(losses) == 3, result.stdout
    assert losses[-1] < 0.6 * losses[0], losses

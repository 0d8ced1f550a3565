"""The Horovod-style examples (examples/horovod/) at n = 2 under a real mpirun: each exits 0 and prints
what its Horovod original prints; the digits classifier learns (test accuracy averaged over ranks with
hvd.allreduce, well above chance)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpipe.launch import mpirun_command

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def _launch(script: str, *args: str) -> str:
    command = mpirun_command(2, [sys.executable, str(ROOT / "examples" / "horovod" / script), *args],
                             env={"OMP_NUM_THREADS": "1"})
    process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(command)} ran past {TIMEOUT_S} s\n--- stdout\n{stdout}\n--- stderr\n{stderr[-4000:]}")
    assert process.returncode == 0, (f"{' '.join(command)} exited {process.returncode}\n--- stdout\n{stdout}\n"
                                     f"--- stderr\n{stderr[-4000:]}")
    return stdout


# make test-long: make test runs the digits example (the same script set-up, real training)
@pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",
                    reason="slow: set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
def test_synthetic_benchmark_prints_horovods_report():
    stdout = _launch("synthetic_benchmark.py", "--image-size", "32", "--batch-size", "2", "--num-warmup-batches", "1",
                     "--num-batches-per-iter", "1", "--num-iters", "2", "--fp16-allreduce")
    assert "Model: resnet50\nBatch size: 2\nNumber of CPUs: 2\nRunning warmup...\nRunning benchmark...\n" in stdout
    assert len(re.findall(r"^Iter #\d: \d+\.\d img/sec per CPU$", stdout, re.MULTILINE)) == 2, stdout
    per_worker = re.search(r"^Img/sec per CPU: (\d+\.\d) \+-(\d+\.\d)$", stdout, re.MULTILINE)
    total = re.search(r"^Total img/sec on 2 CPU\(s\): (\d+\.\d) \+-(\d+\.\d)$", stdout, re.MULTILINE)
    assert per_worker and total, stdout
    assert float(total.group(1)) == pytest.approx(2 * float(per_worker.group(1)), abs=0.11)


def test_digits_classifier_learns():
    pytest.importorskip("sklearn", reason="the example needs scikit-learn (requirements-dev.txt)")
    stdout = _launch("digits.py", "--epochs", "3")
    assert stdout.count("Test set: Average loss:") == 3, stdout
    accuracy = float(re.search(r"^final test accuracy (\d\.\d+)$", stdout, re.MULTILINE).group(1))
    assert accuracy > 0.8, stdout  # chance is 0.1

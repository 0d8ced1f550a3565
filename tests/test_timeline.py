"""Timeline: a real 2 × 2 run writes a Chrome trace with every rank's forwards, backwards, waits, engine
phases and optimizer steps, and the PNG is drawn (make test-long); the tool's numbers are checked on a hand-made
trace (make test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpipe import timeline
from hybridpipe.launch import mpirun_command

ROOT = Path(__file__).resolve().parent.parent
MICRO_BATCHES, STEPS = 4, 3


def x(pid, name, cat, ts, dur, **args):
    event = {"ph": "X", "pid": pid, "tid": "compute", "name": name, "cat": cat, "ts": ts, "dur": dur}
    if args:
        event["args"] = args
    return event


def test_analysis_numbers_on_a_hand_made_trace(tmp_path):
    # two ranks, one step of 100 µs: rank 0 busy 0-40 and 60-80 (60 %), rank 1 busy 20-100 (80 %) with a
    # recompute nested in its backward (not counted twice); rings: 10 µs during rank 0's compute, 10 after all
    events = [
        x(0, "train_step", "step", 0, 100, index=1), x(1, "train_step", "step", 0, 100, index=1),
        x(0, "F0", "forward", 0, 40, stage=0, micro_batch=0), x(0, "B0", "backward", 60, 20, stage=0, micro_batch=0),
        x(1, "F0", "forward", 20, 30, stage=1, micro_batch=0), x(1, "B0", "backward", 50, 50, stage=1, micro_batch=0),
        x(1, "R0", "recompute", 50, 10, stage=1, micro_batch=0),
        x(0, "ring", "engine", 30, 10), x(0, "ring", "engine", 100, 10),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"pipeline_stages": 2, "data_replicas": 1}}))
    numbers = timeline.analyze(path)
    assert numbers["busy"] == {0: pytest.approx(0.6), 1: pytest.approx(0.8)}
    assert numbers["bubble_fraction"] == pytest.approx(0.3)
    assert numbers["allreduce_overlap"] == pytest.approx(0.5)
    assert numbers["steps"] == 1 and numbers["step_ms"] == pytest.approx(0.1)
    text = timeline.report(numbers)
    assert "bubble fraction: 30.0 %" in text and "50.0 % of it overlapped computation" in text


@pytest.mark.skipif(os.environ.get("HYBRIDPIPE_LONG_TESTS") != "1",
                    reason="slow (13 s): set HYBRIDPIPE_LONG_TESTS=1 (make test-long)")
def test_two_by_two_run_writes_the_trace_and_the_tool_draws_it(tmp_path):
    trace = tmp_path / "trace.json"
    script = ["--dim", "32", "--heads", "2", "--layers", "2", "--seq-len", "32", "--batch-size", "8",
              "--micro-batches", str(MICRO_BATCHES), "--max-bytes", "300000", "--no-progress",
              "--steps", str(STEPS), "--val-batches", "1", "--checkpoint", "always"]
    command = mpirun_command(4, [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--stages", "2", *script],
                             env={"HYBRIDPIPE_TIMELINE": str(trace), "OMPI_MCA_mpi_yield_when_idle": "1"})
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(trace.read_text())
    assert data["otherData"] == {"producer": "hybridpipe", "pipeline_stages": 2, "data_replicas": 2}
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0 (stage 0, replica 0)", "rank 1 (stage 1, replica 0)", "rank 2 (stage 0, replica 1)",
                     "rank 3 (stage 1, replica 1)"}
    assert not list(tmp_path.glob("trace.json.rank*.part"))  # merged and removed
    for rank in range(4):
        mine = [e for e in events if e["pid"] == rank]
        by_cat = lambda cat: [e for e in mine if e["cat"] == cat]  # noqa: E731
        assert len([e for e in by_cat("step") if e["name"] == "train_step"]) == STEPS
        forwards = sorted(e["args"]["micro_batch"] for e in by_cat("forward")
                          if e["args"]["stage"] == rank % 2)
        assert forwards[: STEPS * MICRO_BATCHES].count(0) >= STEPS  # every step's forwards (+ predicts)
        backwards = sorted(e["args"]["micro_batch"] for e in by_cat("backward"))
        assert backwards == sorted(list(range(MICRO_BATCHES)) * STEPS)
        assert len(by_cat("recompute")) == STEPS * MICRO_BATCHES  # checkpoint "always"
        waits = {e["name"].split()[1] for e in by_cat("recv")}
        assert waits >= ({"activation"} if rank % 2 else {"gradient"})
        engine = {e["name"] for e in mine if e["cat"] == "engine" and e["tid"] == "engine data"}
        assert {"negotiate", "ring"} <= engine
        assert {"synchronize", "step"} <= {e["name"] for e in by_cat("optimizer")}
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
    png = tmp_path / "schedule.png"
    tool = subprocess.run([sys.executable, "-m", "hybridpipe.timeline", str(trace), "--png", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert tool.returncode == 0, tool.stderr
    assert f"{STEPS} train steps" in tool.stdout and "bubble fraction:" in tool.stdout
    assert "% of it overlapped computation" in tool.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "RuntimeWarning" not in tool.stderr

"""A benchmark driver run with --markdown leaves its run's record in bench/results/ (HYBRIDPIPE_BENCH_RESULTS
elsewhere): the tables it printed, the command and the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
DRIVER = """
import sys
sys.path.insert(0, {bench!r})
import _common
print(_common.render(["n", "ms"], [["2", "0.5"], ["4", "0.9"]], "--markdown" in sys.argv))
"""


def run_driver(tmp_path: Path, *args: str, results: str | None = None) -> list[Path]:
    script = tmp_path / "tiny_bench.py"
    script.write_text(DRIVER.format(bench=str(BENCH)))
    env = {**os.environ, "HYBRIDPIPE_BENCH_RESULTS": results if results is not None else str(tmp_path / "out")}
    subprocess.run([sys.executable, str(script), *args], env=env, check=True, capture_output=True, timeout=120)
    return sorted((tmp_path / "out").glob("*.json")) if (tmp_path / "out").exists() else []


def test_a_markdown_run_writes_its_record(tmp_path):
    [record] = run_driver(tmp_path, "--markdown")
    assert record.name.startswith("tiny_bench-")
    run = json.loads(record.read_text())
    assert run["bench"] == "tiny_bench" and "--markdown" in run["command"]
    assert run["tables"] == [{"header": ["n", "ms"], "rows": [["2", "0.5"], ["4", "0.9"]]}]
    assert run["machine"]["cores"] == os.cpu_count() and run["machine"]["python"] == sys.version.split()[0]


def test_a_plain_run_or_a_disabled_record_writes_nothing(tmp_path):
    assert run_driver(tmp_path) == []
    assert run_driver(tmp_path, "--markdown", results="0") == []

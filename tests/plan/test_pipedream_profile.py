"""``python -m hybridpipe.plan --pipedream-profile``: Table 1 of the PipeDream paper from PipeDream's own
profiles (bench/data/pipedream/), and the dynamic program on tiny hand-made profiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpipe.errors import GridError
from hybridpipe.plan.__main__ import main
from hybridpipe.plan.pipedream import Hierarchy, PipeDreamProfile, PipeDreamProfileError, optimize

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "bench" / "data" / "pipedream"

# The paper's clusters (bench/data/pipedream/README.md, Table 2) in bytes per second. A: PCIe inside a server
# (10 GB/s, the low end of the 10-15 GB/s quoted), 10 Gbit/s Ethernet between; B: NVLink (~30 GB/s),
# 25 Gbit/s Ethernet.
CLUSTER = {"A": (10e9, 1.25e9), "B": (30e9, 3.125e9)}
# Table 1's rows for these profiles: (model file, servers, GPUs per server, cluster, the paper's configuration).
ROWS = [("vgg16", 4, 4, "A", "15-1"), ("vgg16", 2, 8, "B", "15-1"), ("resnet50", 4, 4, "A", "16"),
        ("resnet50", 2, 8, "B", "16"), ("gnmt_large", 1, 4, "A", "straight"), ("gnmt_large", 4, 4, "A", "straight"),
        ("gnmt_large", 2, 8, "B", "straight")]
# Rows whose decision this planner does not take, and why (docs/planner.md, "PipeDream's profiles").
NOT_TAKEN = {("gnmt_large", 4, 4, "A"): "node92 alone (76.8 ms) bounds any straight pipeline on 16 GPUs; "
                                        "replicating stages inside a server predicts ~2x faster",
             ("gnmt_large", 2, 8, "B"): "as for 4x4: node92 bounds straight; a replicated hybrid predicts ~1.9x"}


def _row_id(row) -> str:
    model, servers, gpus, cluster, _ = row
    return f"{model}-{servers}x{gpus}-{cluster}"


# Runs `python -m hybridpipe.plan ARGS` once per row inside one child process: runpy.run_module with
# run_name="__main__" is what `python -m` itself does, and one process imports torch once instead of seven
# times (about 2.5 s each on this 2-core VM).
_RUNNER = """
import contextlib, io, json, runpy, sys, time
results = []
for argv in json.loads(sys.argv[1]):
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = ["python -m hybridpipe.plan", *argv]
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("hybridpipe.plan", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code
    results.append([code, out.getvalue(), err.getvalue(), time.perf_counter() - started])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def cli_results():
    """Every row through the real command line in a child process: {row id: (exit code, stdout, stderr, s)}."""
    commands = []
    for model, servers, gpus, cluster, _ in ROWS:
        intra, inter = CLUSTER[cluster]
        commands.append(["--pipedream-profile", str(PROFILES / f"{model}.json"), "--servers", str(servers),
                         "--gpus-per-server", str(gpus), "--intra-bandwidth", f"{intra:g}", "--inter-bandwidth",
                         f"{inter:g}", "--json"])
    done = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(commands)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return {_row_id(row): tuple(result) for row, result in zip(ROWS, json.loads(done.stdout.splitlines()[-1]))}


def _profile_json(model: str) -> dict:
    return json.loads((PROFILES / f"{model}.json").read_text())


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(row) for row in ROWS])
def test_table1_row_through_the_cli(row, cli_results):
    model, servers, gpus, cluster, paper = row
    returncode, stdout, stderr, elapsed = cli_results[_row_id(row)]
    assert returncode == 0, stderr
    plan = json.loads(stdout.strip().splitlines()[-1])
    assert elapsed < 30, elapsed  # the row's whole command, after the interpreter's start
    assert sum(plan["stage_replicas"]) == servers * gpus
    nodes = _profile_json(model)["nodes"]
    assert sorted(node for stage in plan["stages"] for node in stage) == sorted(node["id"] for node in nodes)
    if (model, servers, gpus, cluster) in NOT_TAKEN:
        # The paper ran a straight pipeline; on this profile the planner finds stages replicated inside a
        # server much faster (test_straight_gnmt_is_bounded_by_its_slowest_layer shows why).
        assert plan["config"] != "straight" and max(plan["stage_replicas"]) > 1
        assert plan["predicted_speedup_over_dp"] > 1.5
        pytest.xfail(f"paper: straight; here {plan['config']}: {NOT_TAKEN[(model, servers, gpus, cluster)]}")
    assert plan["config"] == paper
    if paper == "15-1":
        assert plan["stage_replicas"] == [15, 1]
        replicas = {node: count for stage, count in zip(plan["stages"], plan["stage_replicas"]) for node in stage}
        for node in nodes:
            if node["desc"].startswith("Conv2d"):
                assert replicas[node["id"]] > 1, node
            if node["desc"].startswith("Linear"):
                assert replicas[node["id"]] == 1, node
        assert plan["stages"][1][0] == "node33"  # the cut after the last max-pool (node32), as PipeDream's
        assert plan["predicted_speedup_over_dp"] > 1.3
    elif paper == "16":
        assert plan["stage_replicas"] == [16] and plan["predicted_speedup_over_dp"] == pytest.approx(1.0)
    else:
        assert all(count == 1 for count in plan["stage_replicas"]) and len(plan["stage_replicas"]) == 4
        assert plan["predicted_speedup_over_dp"] > 1.1


def _tiny(layers, edges=None, batch=1):
    """A profile from (id, desc, forward ms, backward ms, activation bytes, parameter bytes) rows, a chain
    unless ``edges`` says otherwise; an Input node first."""
    nodes = [{"id": "in", "desc": "Input", "forward_ms": 5.0, "backward_ms": 0.0, "activation_bytes": 1e3,
              "parameter_bytes": 0.0}]
    nodes += [{"id": node, "desc": desc, "forward_ms": forward, "backward_ms": backward, "activation_bytes": activation,
               "parameter_bytes": parameters} for node, desc, forward, backward, activation, parameters in layers]
    ids = [node["id"] for node in nodes]
    if edges is None:
        edges = list(zip(ids, ids[1:]))
    return PipeDreamProfile.from_dict({"nodes": nodes, "edges": edges, "chain": ids, "profiled_batch_size": batch})


def test_heavy_compute_replicated_heavy_parameters_alone():
    # conv-like: 300 ms, 1 MB of parameters; fc-like: 10 ms, 1 GB. One server of 3 GPUs at 1 GB/s.
    profile = _tiny([("conv", "Conv2d", 100, 200, 1e6, 1e6), ("fc", "Linear", 5, 5, 1e3, 1e9)])
    plan = optimize(profile, Hierarchy(1, 3, 1e9, 1e9))
    # 2-1: conv on 2 replicas: (0.300 s + 2·(1/2)·1 MB / 1 GB/s) / 2 = 0.1505 s; fc alone 0.010 s;
    # the cut: 2 × 1 MB / 1 GB/s = 0.002 s. 1-2: 0.300 s. Data parallel (3): (0.310 + 2·(2/3)·1.001 GB / 1 GB/s) / 3.
    assert plan.config == "2-1" and plan.stage_replicas == [2, 1]
    assert plan.seconds == pytest.approx(0.1505)
    data_parallel = (0.310 + 2 * 2 / 3 * 1.001e9 / 1e9) / 3
    assert plan.data_parallel_seconds == pytest.approx(data_parallel)
    assert plan.predicted_speedup_over_dp == pytest.approx(data_parallel / 0.1505)
    assert plan.stages[1].input_seconds == pytest.approx(0.002)
    assert plan.to_json()["stages"] == [["in", "conv"], ["fc"]]  # the input node is pinned to stage 0


def test_a_stage_inside_one_server_uses_the_intra_server_bandwidth():
    # 2 servers × 2 GPUs, fast inside (10 GB/s), slow between (0.1 GB/s); two 200 ms layers of 100 MB each.
    profile = _tiny([("a", "Conv2d", 100, 100, 1e6, 1e8), ("b", "Conv2d", 100, 100, 1e6, 1e8)])
    plan = optimize(profile, Hierarchy(2, 2, 1e10, 1e8))
    # 2-2: each stage on one server: (0.2 + 2·(1/2)·0.1 GB / 10 GB/s) / 2 = 0.105 s; the cut crosses
    # servers: 2 MB / 0.1 GB/s = 0.02 s. 3-1 or 1-3 put 3 replicas over both servers: >= (0.2 + 1.33) / 3.
    assert plan.config == "2-2"
    assert plan.seconds == pytest.approx(0.105)
    assert [stage.servers for stage in plan.stages] == [1, 1]
    assert plan.stages[0].allreduce_seconds == pytest.approx(0.01)
    assert plan.stages[1].input_link == "inter" and plan.stages[1].input_seconds == pytest.approx(0.02)
    assert plan.data_parallel_seconds == pytest.approx((0.4 + 2 * 3 / 4 * 2e8 / 1e8) / 4)


def test_ties_go_to_data_parallelism():
    # Two equal layers without parameters: straight (1-1) and data parallel (2) both take 0.2 s per minibatch.
    profile = _tiny([("a", "ReLU", 100, 100, 0.0, 0.0), ("b", "ReLU", 100, 100, 0.0, 0.0)])
    plan = optimize(profile, Hierarchy(1, 2, 1e9, 1e9), tolerance=0.0)
    assert plan.config == "2" and plan.seconds == pytest.approx(0.2)


def test_the_same_profile_always_gets_the_same_plan():
    first, second = (optimize(_vgg(), Hierarchy(2, 8, *CLUSTER["B"])).to_json() for _ in range(2))
    assert _without_timing(first) == _without_timing(second)


def _without_timing(plan: dict) -> dict:
    return {key: value for key, value in plan.items() if key != "searched_seconds"}


def _vgg() -> PipeDreamProfile:
    return PipeDreamProfile.load(PROFILES / "vgg16.json")


def test_cut_bytes_count_every_tensor_still_needed_behind_the_cut():
    # a -> b -> c with a skip a -> c (a residual block): cutting before c sends a's and b's outputs.
    profile = _tiny([("a", "Conv2d", 1, 1, 10.0, 0.0), ("b", "Conv2d", 1, 1, 20.0, 0.0), ("c", "Add", 1, 1, 40.0, 0.0)],
                    edges=[("in", "a"), ("a", "b"), ("b", "c"), ("a", "c")])
    assert profile.input_ids == ("in",)
    assert [layer.node_id for layer in profile.layers] == ["a", "b", "c"]
    assert profile.cut_bytes == (0.0, 10.0, 30.0, 0.0)


def test_global_batch_scales_compute_and_activations_not_parameters():
    profile = _tiny([("conv", "Conv2d", 100, 200, 1e6, 1e6), ("fc", "Linear", 5, 5, 1e3, 1e9)], batch=8)
    full = optimize(profile, Hierarchy(1, 3, 1e9, 1e9))
    half = optimize(profile, Hierarchy(1, 3, 1e9, 1e9), global_batch=12)
    assert half.minibatch == 4 and full.minibatch == 8
    assert half.data_parallel.compute_seconds == pytest.approx(full.data_parallel.compute_seconds / 2)
    assert half.data_parallel.allreduce_seconds == pytest.approx(full.data_parallel.allreduce_seconds)


def test_errors_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(PipeDreamProfileError, match=r"no PipeDream profile at .*missing\.json.*bench/data/pipedream"):
        PipeDreamProfile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PipeDreamProfileError, match="not a JSON PipeDream profile"):
        PipeDreamProfile.load(tmp_path / "bad.json")
    with pytest.raises(PipeDreamProfileError, match=r"edge b -> a goes backwards"):
        _tiny([("a", "Conv2d", 1, 1, 1.0, 0.0), ("b", "Conv2d", 1, 1, 1.0, 0.0)], edges=[("in", "a"), ("b", "a")])
    profile = _tiny([("a", "Conv2d", 1, 1, 1.0, 0.0)])
    with pytest.raises(GridError, match=r"global batch 1000 .* 16 workers .*--global-batch 992"):
        optimize(profile, Hierarchy(4, 4, 1e9, 1e9), global_batch=1000)
    with pytest.raises(GridError, match=r"servers must be a positive integer \(got 0; pass e.g. --servers 4\)"):
        Hierarchy(0, 4, 1e9, 1e9)
    with pytest.raises(GridError, match=r"inter_bandwidth .*\(got -1; pass e.g. --inter-bandwidth"):
        Hierarchy(1, 4, 1e9, -1)


def test_cli_refuses_missing_flags_and_a_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--pipedream-profile", "x.json", "--servers", "4"])
    assert exit_info.value.code == 2
    assert "needs --gpus-per-server, --intra-bandwidth, --inter-bandwidth" in capsys.readouterr().err
    code = main(["--pipedream-profile", str(tmp_path / "none.json"), "--servers", "1", "--gpus-per-server", "2",
                 "--intra-bandwidth", "1e9", "--inter-bandwidth", "1e9"])
    assert code == 2 and "PipeDreamProfileError: no PipeDream profile" in capsys.readouterr().err


def test_cli_explains_the_configuration(capsys):
    assert main(["--pipedream-profile", str(PROFILES / "vgg16.json"), "--servers", "4", "--gpus-per-server", "4",
                 "--intra-bandwidth", "10e9", "--inter-bandwidth", "1.25e9"]) == 0
    text = capsys.readouterr().out
    assert "config 15-1" in text and "13 Conv2d" in text and "3 Linear" in text
    assert "cut between node32 (MaxPool2d) and node33" in text
    assert "494.6 MB of parameters are never allreduced" in text


def test_vgg_on_cluster_b_the_fastest_cuts_inside_conv5_and_the_tolerance_keeps_the_conv_fc_cut():
    hierarchy = Hierarchy(2, 8, *CLUSTER["B"])
    exact = optimize(_vgg(), hierarchy, tolerance=0.0)
    chosen = optimize(_vgg(), hierarchy)
    # The model alone moves conv5_2 and conv5_3 to the unreplicated stage (5.9 % faster, 31 % more bytes).
    assert exact.config == "15-1" and exact.stages[1].node_ids[0] == "node27"
    assert chosen.stages[1].node_ids[0] == "node33"
    assert exact.seconds < chosen.seconds < exact.seconds * 1.10
    assert chosen.bytes_per_minibatch < exact.bytes_per_minibatch


def test_straight_gnmt_is_bounded_by_its_slowest_layer():
    profile = PipeDreamProfile.load(PROFILES / "gnmt_large.json")
    slowest = max(layer.forward_seconds + layer.backward_seconds for layer in profile.layers)
    assert slowest == pytest.approx(0.0768, abs=1e-4)  # node92, an LSTM with a 66 ms backward
    hierarchy = Hierarchy(4, 4, *CLUSTER["A"])
    straight = optimize(profile, hierarchy, straight=True)
    best = optimize(profile, hierarchy)
    assert straight.config == "straight" and straight.seconds >= slowest
    assert best.seconds < slowest / 1.5

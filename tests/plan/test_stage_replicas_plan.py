"""The planner's stages with their own replica counts: the partitioner with replication against brute
force, the cost model's bounds for such grids, and the search choosing one where it pays (VGG-16's head on few
ranks across hosts) and never where it is off."""

from __future__ import annotations

import functools
import math
import random

import pytest

from hybridpipe.errors import HybridPipeError
from hybridpipe.plan.cost import Candidate, Cluster, predict
from hybridpipe.plan.models import model_profile
from hybridpipe.plan.profile import LayerCost, Profile
from hybridpipe.plan.search import compositions, format_bytes, plan, replicated_balance
import brute_force

FREE = dict(latency_us=0.0, intra_host_gbps=1e9, inter_host_gbps=1e9)


def bottleneck(times: list[float], balance: tuple[int, ...], counts: tuple[int, ...]) -> float:
    start, worst = 0, 0.0
    for size, count in zip(balance, counts):
        worst = max(worst, sum(times[start:start + size]) / count)
        start += size
    return worst


def test_compositions_are_every_split_of_the_ranks():
    assert compositions(4, 2) == [(1, 3), (2, 2), (3, 1)]
    assert len(compositions(8, 3)) == math.comb(7, 2)
    assert all(sum(c) == 8 and min(c) >= 1 for c in compositions(8, 3))


def test_replicated_balance_is_optimal_against_brute_force():
    generator = random.Random(3)
    for _ in range(200):
        layers = generator.randint(2, 9)
        stages = generator.randint(2, min(layers, 4))
        counts = tuple(generator.randint(1, 4) for _ in range(stages))
        times = [generator.choice([0.0, generator.uniform(0, 10)]) for _ in range(layers)]
        balance = replicated_balance(times, counts)
        assert len(balance) == stages and sum(balance) == layers and min(balance) >= 1
        best = min(bottleneck(times, b, counts) for b in brute_force.compositions(layers, stages))
        assert bottleneck(times, balance, counts) == pytest.approx(best)
    assert replicated_balance([1.0] * 8, (3, 1)) == (6, 2)  # 6 / 3 = 2 / 1: the replicated stage takes three times


@pytest.mark.parametrize("counts,balance,micro_batches,schedule", [
    ((2, 1), (2, 1), 8, "gpipe"), ((2, 1), (2, 1), 8, "1f1b"), ((1, 3), (1, 3), 9, "1f1b"),
    ((2, 1, 1), (2, 1, 1), 6, "gpipe"), ((3, 1), (3, 1), 7, "1f1b")])
def test_a_replicated_grid_costs_its_busiest_replica_plus_at_most_the_fill(counts, balance, micro_batches, schedule):
    """Free communication, equal layers: the step is at least the busiest replica's ceil(M / R_s) micro-batches of
    its stage, and at most that plus one micro-batch through every other stage (the fill and drain)."""
    profile = Profile([LayerCost("Linear", 1.0, 2.0, 4.0, 100.0, 1000) for _ in range(sum(balance))],
                      sample_batch=1, input_bytes=4.0)
    cluster = Cluster(ranks=sum(counts), **FREE)
    candidate = Candidate(len(counts), 1, balance, micro_batches, schedule, stage_replicas=counts)
    step = predict(profile, cluster, candidate, global_batch=micro_batches).step_seconds
    per_stage = [3e-3 * size for size in balance]  # forward + backward of one sample per layer
    busiest = max(math.ceil(micro_batches / count) * t for count, t in zip(counts, per_stage))
    assert busiest - 1e-12 <= step <= busiest + sum(per_stage) - min(per_stage) + 1e-12
    with pytest.raises(HybridPipeError, match="adding up to the cluster's 5 ranks"):
        predict(profile, Cluster(ranks=5, **FREE), candidate, global_batch=micro_batches)


@functools.lru_cache(maxsize=None)
def vgg16_on_16(grids: str = "all"):
    """VGG-16 on 16 V100s, 4 per host at 10 Gbit/s: (its profile, the best plan of ``grids``)."""
    profile = model_profile("vgg16", "v100")
    return profile, plan(profile, Cluster(ranks=16, ranks_per_host=4, intra_host_gbps=100, inter_host_gbps=10), 1024,
                         grids=grids)


def test_vgg16_across_hosts_replicates_the_convolutions_and_not_the_head():
    """VGG-16 on 16 V100s, 4 per host at 10 Gbit/s: the fully connected head's 470 MB of gradients would cross
    the hosts' links in data parallelism; the planner keeps the head's stage on few ranks (PipeDream's 15-1)."""
    profile, best = vgg16_on_16()
    assert best.stage_replicas is not None and best.stage_replicas[-1] <= 2, best.describe()
    assert best.stages == len(best.stage_replicas) and sum(best.stage_replicas) == 16 and best.replicas == 1
    last = sum(best.balance[:-1])  # every fully connected layer is on the last stage, with the last convolutions
    names = [layer.name for layer in profile.layers]
    assert [n for n in names if n.startswith("fc")] == [n for n in names[last:] if n.startswith("fc")], names[last:]
    assert best.stage_replicas[0] >= 8, best.describe()  # the first convolutions are where the replicas are
    assert best.init_arguments() == {"stage_replicas": best.stage_replicas}
    assert best.config == "-".join(map(str, best.stage_replicas)) and best.ranks == 16
    _, uniform = vgg16_on_16("uniform")
    assert uniform.stage_replicas is None and uniform.step_seconds > best.step_seconds * 1.02


def test_one_host_with_a_fast_link_keeps_data_parallelism():
    profile = model_profile("vgg16", "v100")
    best = plan(profile, Cluster(ranks=4, ranks_per_host=4, intra_host_gbps=1000), 256)
    assert best.stage_replicas is None and best.config == "4", best.describe()


def test_simulate_compares_the_best_grid_of_each_kind_at_16_gpus_of_cluster_a():
    """``--simulate --compare-grids`` on Cluster-A's shape (4 V100s per server on PCIe, 10 Gbit/s between): the
    data-parallel, uniform and own-replica-count plans side by side; at 16 GPUs the last wins, not at 4."""
    import json
    import subprocess
    import sys

    completed = subprocess.run([sys.executable, "-m", "hybridpipe.plan", "--model", "vgg16", "--gpu", "v100",
                                "--simulate", "--compare-grids", "--sizes", "4", "--gpus-per-host", "4",
                                "--intra-host-gbps", "80", "--inter-host-gbps", "10", "--global-batch", "256",
                                "--json"], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    [small] = [json.loads(line) for line in completed.stdout.splitlines()]
    assert small["gpus"] == 4 and small["data_parallel"]["config"] == "4"
    assert small["stage_replicas"]["config"] == "3-1" and small["stage_replicas"]["speedup_over_dp"] < 1.0
    profile, best = vgg16_on_16()  # the same comparison at 16 GPUs, from the plans the tests above made
    _, data_parallel = vgg16_on_16("data-parallel")
    assert best.samples_per_second / data_parallel.samples_per_second > 1.05 and data_parallel.config == "16"
    with pytest.raises(HybridPipeError, match="no stages-with-their-own-replica-counts configuration of 2 ranks"):
        plan(model_profile("vgg16", "v100"), Cluster(ranks=2), 64, grids="stage-replicas")
    with pytest.raises(HybridPipeError, match="grids='pipes'"):
        plan(model_profile("vgg16", "v100"), Cluster(ranks=2), 64, grids="pipes")


def test_the_plan_explains_where_its_stages_are_and_the_bytes_it_saves():
    profile, best = vgg16_on_16()
    lines = best.communication(profile)
    assert len(lines) == 2 * best.stages  # a line per stage, one per cut, the comparison
    assert lines[0].startswith(f"stage 0: {best.stage_replicas[0]} replica(s) on ranks [")
    assert "1 conv1" in lines[0] and "allreduced among its" in lines[0]
    assert lines[1].startswith(f"  cut after layer {best.balance[0] - 1}:")
    everything = sum(layer.parameter_bytes for layer in profile.layers)
    head = sum(layer.parameter_bytes for layer in profile.layers[best.balance[0]:])
    saved = 2 * 15 * everything - sum(2 * (r - 1) * w for r, w in zip(best.stage_replicas,
                                                                      (everything - head, head)))
    assert lines[-1].endswith(f"{format_bytes(saved)} fewer")
    assert plan(profile, Cluster(ranks=4, ranks_per_host=4, intra_host_gbps=1000), 256).communication(profile) == []

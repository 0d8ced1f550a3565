"""The planner beyond this machine, without MPI: built-in models against their published sizes, the
predicted scaling from 8 to 1024 GPUs (sane, monotonic, efficiency at most 1, fast), the cost model's
allreduce, overlap and overheads against hand-computed times, the memory-aware partitioner against brute
force, and the command line's --simulate with its errors."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from hybridpipe.errors import PartitionError
from hybridpipe.pipeline.partition import partition_by_weights
from hybridpipe.plan import Candidate, Cluster, allreduce_seconds, plan, predict
from hybridpipe.plan.__main__ import main, rate
from hybridpipe.plan.models import ACCELERATORS, MODELS, model_profile
from hybridpipe.plan.profile import LayerCost, Profile
from hybridpipe.plan.simulate import parse_sizes, render_scaling, scaling

H100_HOSTS = dict(ranks_per_host=8, intra_host_gbps=7200, inter_host_gbps=3200, latency_us=5,
                  memory_per_rank=80 * 2**30)


def test_built_in_models_have_their_published_sizes():
    # ResNet-101: 44.5 M parameters (torchvision: 44,549,160), 7.8 G multiply-adds at 224 × 224
    resnet = model_profile("resnet101", "p100", efficiency=1.0, call_overhead_us=0)
    assert resnet.parameter_bytes / 4 == pytest.approx(44_549_160, rel=1e-3)
    forward_flops = sum(layer.forward_ms for layer in resnet.layers) / 1e3 * 10.6e12
    assert forward_flops / 2 == pytest.approx(7.8e9, rel=0.02)
    # GPT-3 175B: 175 B parameters (plus the untied head's 0.6 B), training ≈ 6 FLOPs per parameter and token
    gpt = model_profile("gpt3-175b", "h100", efficiency=1.0, call_overhead_us=0)
    parameters = gpt.parameter_bytes / 2
    assert parameters == pytest.approx(175e9, rel=0.01)
    per_token = 3 * sum(layer.forward_ms for layer in gpt.layers) / 1e3 * 989e12 / 2048
    assert per_token == pytest.approx(6 * parameters, rel=0.05)
    assert MODELS["gpt3-175b"].global_batch == 1536  # 3.2 M tokens of 2048
    half = model_profile("gpt3-1.3b", "h100", efficiency=0.5, call_overhead_us=0)
    full = model_profile("gpt3-1.3b", "h100", efficiency=1.0, call_overhead_us=0)
    assert half.layers[5].forward_ms == pytest.approx(2 * full.layers[5].forward_ms)


def rows_are_sane(rows, weak: bool):
    planned = [row for row in rows if row.plan is not None]
    assert planned and planned[0].efficiency == pytest.approx(1.0)
    for row in planned:
        best = row.plan
        assert best.stages * best.replicas == row.ranks
        assert row.global_batch % best.replicas == 0
        assert best.step_seconds > 0 and 0 < row.efficiency <= 1 + 1e-9
        assert best.samples_per_second == pytest.approx(row.global_batch / best.step_seconds)
        assert best.memory_bytes_per_rank <= 80 * 2**30
    rates = [row.plan.samples_per_second for row in planned]
    assert rates == sorted(rates)  # more GPUs never predicted slower here
    if weak:  # each GPU keeps its share of the work: the per-GPU rate only falls
        efficiencies = [row.efficiency for row in planned]
        assert efficiencies == sorted(efficiencies, reverse=True)


@pytest.mark.parametrize("model,weak,batch", [("gpt3-1.3b", True, 64), ("gpt3-1.3b", False, 512),
                                              ("resnet101", True, 512)])
def test_predicted_scaling_from_8_to_1024_gpus_is_sane(model, weak, batch):
    gpu = "p100" if model == "resnet101" else "h100"
    host = ACCELERATORS[gpu]
    cluster = Cluster(ranks=8, ranks_per_host=host.per_host, intra_host_gbps=host.intra_host_gbps,
                      inter_host_gbps=host.inter_host_gbps, latency_us=host.latency_us,
                      memory_per_rank=host.memory_bytes)
    rows = scaling(model_profile(model, gpu), cluster, parse_sizes("8:1024"), batch, weak=weak,
                   optimizer_state_factor=6.0 if gpu == "h100" else 1.0)
    assert [row.ranks for row in rows] == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert [row.global_batch for row in rows] == ([batch * n // 8 for n in (8, 16, 32, 64, 128, 256, 512, 1024)]
                                                  if weak else [batch] * 8)
    rows_are_sane(rows, weak)
    table = render_scaling(rows)
    assert "efficiency vs 8 × linear" in table and table.count("\n") == 9


def test_a_thousand_ranks_plan_in_seconds_and_memory_pushes_big_models_into_pipelines():
    profile = model_profile("gpt3-175b", "h100")
    started = time.perf_counter()
    best = plan(profile, Cluster(ranks=1024, **H100_HOSTS), 1536, optimizer_state_factor=6.0)
    assert time.perf_counter() - started < 60  # about 2 s on an idle core
    assert best.stages * best.replicas == 1024 and best.stages >= 32  # 175 B × 16 bytes needs >= 35 GPUs
    assert best.memory_bytes_per_rank <= 80 * 2**30
    rows = scaling(profile, Cluster(ranks=8, **H100_HOSTS), [8, 16], 1536, weak=False, optimizer_state_factor=6.0)
    assert all(row.plan is None and "needs" in row.problem for row in rows)
    assert "no plan fits the memory (the smallest needs" in render_scaling(rows)


def uniform(layers: int, parameters: int = 0, forward_ms: float = 1.0, backward_ms: float = 2.0) -> Profile:
    return Profile([LayerCost("L", forward_ms, backward_ms, 4.0, 4.0, parameters) for _ in range(layers)],
                   sample_batch=1)


def test_allreduce_is_a_ring_inside_a_host_and_hierarchical_across_hosts():
    gbit = 1e9 / 8  # bytes per second of 1 Gbit/s
    cluster = Cluster(ranks=16, ranks_per_host=4, intra_host_gbps=8, inter_host_gbps=2, latency_us=10)
    nbytes = 1e9
    inside = allreduce_seconds(nbytes, [0, 1, 2, 3], cluster)
    assert inside == pytest.approx(2 * 3 * (10e-6 + nbytes / 4 / (8 * gbit)))
    one_per_host = allreduce_seconds(nbytes, [0, 4, 8, 12], cluster)  # a flat ring over the network
    assert one_per_host == pytest.approx(2 * 3 * (10e-6 + nbytes / 4 / (2 * gbit)))
    everyone = allreduce_seconds(nbytes, list(range(16)), cluster)  # 4 per host: reduce inside, then 4 hosts
    assert everyone == pytest.approx(2 * 3 * (10e-6 + nbytes / 4 / (8 * gbit))
                                     + 2 * 3 * (10e-6 + 4 * (nbytes / 16) / (2 * gbit)))
    shared = allreduce_seconds(nbytes, [0, 4, 8, 12], cluster, concurrent_groups=4)  # 4 groups share a NIC
    assert shared == pytest.approx(2 * 3 * (10e-6 + nbytes / 4 / (0.5 * gbit)))
    overhead = Cluster(ranks=2, allreduce_overhead_us=300, latency_us=0, intra_host_gbps=1e9)
    assert allreduce_seconds(8, [0, 1], overhead) == pytest.approx(300e-6, rel=1e-3)


def test_the_allreduce_overlaps_the_last_backward_bucket_by_bucket():
    # 1 stage × 2 replicas, 8 layers of 1 MiB each: with 1 MiB buckets, every bucket but the input layer's
    # is reduced while the backward goes on; with one 8 MiB bucket nothing is hidden
    profile = uniform(8, parameters=2**20)
    slow_link = dict(ranks=2, intra_host_gbps=8 * 2**20 * 8 / 1e9 / 0.004, latency_us=0)  # 8 MiB in 4 ms
    # (a ring of 2 ranks sends 2(D-1)/D = all of the bytes: reducing 8 MiB takes 4 ms, 1 MiB 0.5 ms)
    candidate = Candidate(1, 2, (8,), 1, "1f1b")
    compute = 8 * 3e-3
    flags = allreduce_seconds(64, [0, 1], Cluster(**slow_link))  # step() agrees on which gradients exist
    whole = predict(profile, Cluster(**slow_link, fusion_bytes=16 * 2**20), candidate, 2)
    assert whole.step_seconds == pytest.approx(compute + 4e-3 + flags)
    bucketed = predict(profile, Cluster(**slow_link, fusion_bytes=2**20), candidate, 2)
    assert bucketed.step_seconds == pytest.approx(compute + 4e-3 / 8 + flags)  # only the last bucket is exposed


def test_overheads_per_action_and_per_transfer_lengthen_the_critical_path():
    profile = uniform(4)
    free = Cluster(ranks=2, latency_us=0, intra_host_gbps=1e9)
    slow = Cluster(ranks=2, latency_us=0, intra_host_gbps=1e9, action_overhead_us=100, transfer_overhead_us=50)
    candidate = Candidate(2, 1, (2, 2), 4, "gpipe")
    base = predict(profile, free, candidate, 4).step_seconds
    assert base == pytest.approx((4 + 2 - 1) * 2 * 3e-3)
    split = Candidate(2, 1, (2, 2), 4, "zb-h1")  # I and W: two actions, each with its overhead
    assert (predict(profile, Cluster(ranks=2, latency_us=0, intra_host_gbps=1e9, action_overhead_us=100), split, 4)
            .pipeline_seconds > predict(profile, free, split, 4).pipeline_seconds + 2 * 5 * 100e-6)
    # GPipe's critical path: M + P - 1 forwards and backwards, each with its overhead and one hand-off
    assert predict(profile, slow, candidate, 4).step_seconds == pytest.approx(base + 5 * 2 * (100e-6 + 50e-6))
    with_update = Profile(profile.layers, 1, update_ms_per_mb=1.0)
    stepped = predict(Profile([LayerCost("L", 1.0, 2.0, 4.0, 4.0, 2**20)] * 4, 1, update_ms_per_mb=1.0), free,
                      candidate, 4).step_seconds
    assert stepped == pytest.approx(base + 2e-3)  # each stage steps 2 MiB of parameters at 1 ms per MiB
    assert predict(with_update, free, candidate, 4).step_seconds == pytest.approx(base)  # no parameters


def test_memory_aware_partitioner_is_optimal_against_brute_force():
    generator = random.Random(11)
    for _ in range(150):
        layers = generator.randint(1, 8)
        stages = generator.randint(1, layers)
        weights = [generator.uniform(0, 10) for _ in range(layers)]
        memory = [generator.uniform(0, 10) for _ in range(layers)]
        limit = generator.uniform(5, 30)

        def stage_sums(values, balance):
            bounds = list(itertools.accumulate([0, *balance]))
            return [sum(values[bounds[i]:bounds[i + 1]]) for i in range(len(balance))]

        balances = [[b - a for a, b in zip((0, *cuts), (*cuts, layers))]
                    for cuts in itertools.combinations(range(1, layers), stages - 1)]
        feasible = [b for b in balances if max(stage_sums(memory, b)) <= limit]
        if not feasible:
            with pytest.raises(PartitionError):
                partition_by_weights(weights, stages, memory=memory, memory_limit=limit)
            continue
        best = min(max(stage_sums(weights, b)) for b in feasible)
        balance = partition_by_weights(weights, stages, memory=memory, memory_limit=limit)
        assert max(stage_sums(memory, balance)) <= limit
        assert max(stage_sums(weights, balance)) == pytest.approx(best)


def test_invalid_batches_say_which_replica_counts_would_fit():
    from hybridpipe.errors import HybridPipeError

    with pytest.raises(HybridPipeError, match=r"global batch 7 does not split evenly over any possible replica "
                                               r"count \[2, 4\] of 4 ranks .* use a multiple of 2"):
        plan(uniform(2), Cluster(ranks=4), global_batch=7)


def test_simulate_prints_the_table_and_plots_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    image = tmp_path / "scaling.png"
    assert main(["--simulate", "--model", "gpt3-1.3b", "--gpu", "a100", "--sizes", "8:32", "--global-batch", "64",
                 "--plot", str(image)]) == 0
    out = capsys.readouterr().out
    assert "predicted scaling of gpt3-1.3b on a100 at 0.5 of its peak" in out
    assert "cluster: 8 per host, 4800 Gbit/s inside a host, 1600 Gbit/s between hosts" in out
    assert "weak scaling: global batch 64 at 8 GPUs" in out
    lines = [line.split() for line in out.splitlines() if line.strip()[:2] in ("8 ", "16", "32")]
    assert [line[0] for line in lines] == ["8", "16", "32"] and [line[7] for line in lines] == ["64", "128", "256"]
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["--simulate", "--profile", str(save_profile(tmp_path)), "--global-batch", "16", "--sizes", "2,4",
                 "--scaling", "strong", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "strong scaling: global batch 16 at every size" in out and "| GPUs | stages |" in out


def save_profile(tmp_path):
    path = tmp_path / "profile.json"
    uniform(4, parameters=1000).save(path)
    return path


@pytest.mark.parametrize("argv,message", [
    (["--simulate", "--model", "gpt3-1.3b", "--sizes", "abc"], "--sizes takes FIRST:LAST"),
    (["--simulate", "--model", "gpt3-1.3b", "--sizes", "64:8"], "need 1 <= FIRST <= LAST"),
    (["--simulate", "--model", "gpt3-1.3b", "--efficiency", "1.5"], "efficiency must be in (0, 1]"),
    (["--simulate", "--model", "gpt3-1.3b", "--ranks", "8"], "leave out --ranks"),
    (["--simulate"], "give one of MODULE:FACTORY (to profile), --profile FILE or --model NAME"),
    (["--model", "gpt3-1.3b"], "--ranks is required (or --simulate"),
    (["--simulate", "--model", "gpt3-9b"], "invalid choice: 'gpt3-9b'"),
    (["--simulate", "--model", "gpt3-1.3b", "--intra-host-gbps", "fast"], "'fast' is not a number or a product"),
    (["--simulate", "--profile", "PROFILE", "--gpu", "h100", "--global-batch", "8"], "--gpu costs a built-in"),
    (["--simulate", "--profile", "PROFILE"], "--global-batch is required with a profile"),
    (["--simulate", "--model", "gpt3-175b", "--sizes", "8", "--memory-per-rank", "lots"],
     "--memory-per-rank='lots' is not a byte count"),
])
def test_bad_flags_give_clear_errors(argv, message, tmp_path, capsys):
    argv = [str(save_profile(tmp_path)) if arg == "PROFILE" else arg for arg in argv]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_rates_take_products():
    assert rate("900*8") == 7200.0 and rate("400") == 400.0


def test_command_line_prints_the_zero_level_and_takes_precision(tmp_path, capsys):
    path = tmp_path / "one_layer.json"
    uniform(1, parameters=10**5).save(path)  # one layer: the 2 ranks can only be replicas
    assert main(["--profile", str(path), "--global-batch", "8", "--ranks", "2", "--zero", "2", "--precision",
                 "bf16", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "1 stages × 2 replicas, 1f1b, zero=2, bf16, M=" in out
    assert "opt = hp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), zero=2)" in out
    assert "'precision': 'bf16'" in out
    assert main(["--profile", str(path), "--global-batch", "8", "--ranks", "2"]) == 0
    assert "zero=" not in capsys.readouterr().out  # nothing to gain here: unsharded

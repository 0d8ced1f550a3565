"""The planner without MPI: the partitioner against brute force, the cost model against the schedules'
closed forms, profiles as JSON, the search's choices and errors, the command line."""

from __future__ import annotations

import dataclasses
import random
import warnings
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hybridpipe.plan as hplan
from hybridpipe.errors import HybridPipeError
from hybridpipe.pipeline.partition import partition_by_weights
from hybridpipe.plan.cost import Candidate, Cluster, allreduce_seconds, predict
from hybridpipe.plan.profile import LayerCost, Profile
from brute_force import compositions
from held_state import assert_as_held, holding

ROOT = Path(__file__).resolve().parents[2]


def largest_stage(weights: list[float], balance: list[int]) -> float:
    start, worst = 0, 0.0
    for count in balance:
        worst = max(worst, sum(weights[start:start + count]))
        start += count
    return worst


def test_partitioner_is_optimal_against_brute_force():
    generator = random.Random(7)
    for _ in range(200):
        layers = generator.randint(1, 9)
        stages = generator.randint(1, layers)
        weights = [generator.choice([0.0, generator.uniform(0, 10)]) for _ in range(layers)]
        best = min(largest_stage(weights, b) for b in compositions(layers, stages))
        balance = partition_by_weights(weights, stages)
        assert len(balance) == stages and sum(balance) == layers and min(balance) >= 1
        assert largest_stage(weights, balance) == pytest.approx(best)


def uniform_profile(layers: int = 8, forward_ms: float = 1.0, backward_ms: float = 2.0, parameters: int = 1000,
                    activation: float = 100.0) -> Profile:
    """Per-sample costs: with micro-batches of 1 sample each layer takes forward_ms / backward_ms."""
    return Profile([LayerCost("Linear", forward_ms, backward_ms, 4.0, activation, parameters) for _ in range(layers)],
                   sample_batch=1, input_bytes=4.0)


FREE = dict(latency_us=0.0, intra_host_gbps=1e9, inter_host_gbps=1e9)


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (4, 4)])
def test_predicted_pipeline_time_is_the_schedules_closed_form(stages, micro_batches):
    profile = uniform_profile(layers=2 * stages)
    cluster = Cluster(ranks=stages, **FREE)
    per_stage_f, per_stage_b = 2 * 1e-3, 2 * 2e-3  # two layers per stage, micro-batches of one sample
    for schedule in ("gpipe", "1f1b"):
        candidate = Candidate(stages, 1, (2,) * stages, micro_batches, schedule)
        prediction = predict(profile, cluster, candidate, global_batch=micro_batches)
        assert prediction.step_seconds == pytest.approx((micro_batches + stages - 1) * (per_stage_f + per_stage_b))
    interleaved = predict(profile, cluster, Candidate(stages, 1, (1,) * (2 * stages), micro_batches,
                                                     "interleaved-1f1b", virtual_stages=2), micro_batches)
    assert interleaved.step_seconds == pytest.approx(
        micro_batches * (per_stage_f + per_stage_b) + (stages - 1) * (per_stage_f + per_stage_b) / 2)
    pipedream = predict(profile, cluster, Candidate(stages, 1, (2,) * stages, micro_batches, "pipedream"),
                        micro_batches)
    assert pipedream.step_seconds == pytest.approx(micro_batches * (per_stage_f + per_stage_b))  # no bubble


def test_transfers_and_the_allreduce_add_what_they_cost():
    profile = uniform_profile(layers=4, parameters=10**6)
    slow_link = Cluster(ranks=4, ranks_per_host=2, latency_us=1000.0, intra_host_gbps=1e9, inter_host_gbps=1e9)
    free = Cluster(ranks=4, ranks_per_host=2, **FREE)
    candidate = Candidate(4, 1, (1, 1, 1, 1), 4, "gpipe")
    # 2·3 hops on the critical path (forward fill and backward drain) at 1 ms each
    assert (predict(profile, slow_link, candidate, 4).step_seconds
            - predict(profile, free, candidate, 4).step_seconds) == pytest.approx(6e-3)
    assert allreduce_seconds(8e9 / 8, [0, 1], Cluster(ranks=2, intra_host_gbps=8.0, latency_us=0.0)) == \
        pytest.approx(2 * 1 / 2 * 1.0)  # 2(D-1) steps of bytes/D over 8 Gbit/s: 1 GB → 1 s
    data_parallel = Candidate(1, 4, (4,), 1, "1f1b")
    reduce = allreduce_seconds(4 * 10**6, [0, 1, 2, 3], free)
    step = predict(profile, free, data_parallel, 4).step_seconds
    assert step == pytest.approx(4 * 3e-3 + reduce)  # nothing to hide it behind with one stage


def test_compute_contention_and_core_sharing_slow_what_computes_at_once():
    """Contention slows every rank; on a CPU host whose cores are known the ranks are simulated sharing them: all
    of data parallelism's ranks compute at once, throughout, but a pipeline's rank that computes while its
    neighbours wait (a bubble) has a core to itself, so only the actions that overlap share one."""
    profile = uniform_profile(layers=4)
    candidate = Candidate(4, 1, (1, 1, 1, 1), 4, "gpipe")
    free = predict(profile, Cluster(ranks=4, **FREE), candidate, 4).step_seconds
    contended = Cluster(ranks=4, compute_contention=1.25, **FREE)  # cores not known: every rank slower throughout
    assert contended.compute_slowdown == pytest.approx(1.25)
    assert predict(profile, contended, candidate, 4).step_seconds == pytest.approx(1.25 * free)
    shared = Cluster(ranks=4, ranks_per_host=4, cores_per_host=2, compute_contention=1.25, **FREE)
    assert shared.compute_slowdown == pytest.approx(2 * 1.25)  # two ranks per core, both cores busy
    data_parallel = Candidate(1, 4, (4,), 1, "gpipe")
    alone = predict(profile, Cluster(ranks=4, **FREE), data_parallel, 4).pipeline_seconds
    assert predict(profile, shared, data_parallel, 4).pipeline_seconds == pytest.approx(2.5 * alone)
    prediction = predict(profile, shared, candidate, 4)
    assert 1.25 * free < prediction.step_seconds < 2.5 * free
    assert any("× 1.25 for synchronous ranks computing at once" in note for note in prediction.notes)
    # 2 stages of 2 ms forward and 4 ms backward per micro-batch, 2 micro-batches, one core: F0 alone (0-2 ms);
    # F1 beside stage 1's F0 at half speed (2-6); F1 alone (6-8), B1 alone (8-12); B0 beside stage 0's B1
    # (12-20); B0 alone (20-24)
    one_core = Cluster(ranks=2, cores_per_host=1, **FREE)
    two_stages = predict(profile, one_core, Candidate(2, 1, (2, 2), 2, "gpipe"), 2)
    assert two_stages.pipeline_seconds == pytest.approx(24e-3)
    assert predict(profile, dataclasses.replace(one_core, cores_per_host=0), Candidate(2, 1, (2, 2), 2, "gpipe"),
                   2).pipeline_seconds == pytest.approx(18e-3)  # (M + P - 1) (f + b) on a core each
    # a waiting rank taking half a core (waiting_load 0.5): a rank computing alone goes at 1 / 1.5: F0 0-3, F1 and
    # stage 1's F0 3-7, F1 7-10, B1 10-16, B0 and stage 0's B1 16-24, B0 24-30; a whole core: every rank at half
    # speed throughout, as without the simulated sharing
    for waiting, expected in ((0.5, 30e-3), (1.0, 36e-3)):
        busy = dataclasses.replace(one_core, waiting_load=waiting)
        timed = predict(profile, busy, Candidate(2, 1, (2, 2), 2, "gpipe"), 2)
        assert timed.pipeline_seconds == pytest.approx(expected)
    with pytest.raises(HybridPipeError, match=r"compute_contention must be >= 1 \(got 0.5\)"):
        Cluster(ranks=2, compute_contention=0.5)


def test_memory_contention_applies_where_the_hosts_ranks_stream_more_than_its_cache():
    """Ranks whose weights and gradients (2 × their parameter bytes each) exceed the host's last cache together
    compute with memory_contention; smaller ones with compute_contention."""
    profile = uniform_profile(layers=4)
    weights = sum(layer.parameter_bytes for layer in profile.layers)
    candidate = Candidate(1, 2, (4,), 1, "1f1b")
    small = Cluster(ranks=2, compute_contention=1.1, memory_contention=1.8, cache_bytes=4 * weights, **FREE)
    large = dataclasses.replace(small, cache_bytes=weights)  # 2 ranks × 2 × weights > the cache
    assert small.slowdown_for(weights) == pytest.approx(1.1) and large.slowdown_for(weights) == pytest.approx(1.8)
    assert dataclasses.replace(large, memory_contention=0.0).slowdown_for(weights) == pytest.approx(1.1)
    assert dataclasses.replace(large, cache_bytes=0.0).slowdown_for(weights) == pytest.approx(1.1)
    free = Cluster(ranks=2, **FREE)
    base = predict(profile, free, candidate, 4).pipeline_seconds
    assert predict(profile, small, candidate, 4).pipeline_seconds == pytest.approx(1.1 * base)
    assert predict(profile, large, candidate, 4).pipeline_seconds == pytest.approx(1.8 * base)


def test_a_split_backward_pays_a_backward_call_per_layer_with_weights_again(monkeypatch):
    """zb-h1's W pass asks autograd for each layer's weight gradient apart: each such layer's fixed backward call
    cost is paid once more per micro-batch (two layers of 0.5 ms calls per chunk here), and only by zb-h1."""
    from hybridpipe.plan import cost

    plain = uniform_profile(layers=4)
    calls = dataclasses.replace(plain, layers=[dataclasses.replace(layer, backward_call_ms=0.5)
                                               for layer in plain.layers])
    cluster = Cluster(ranks=2, **FREE)
    zb, one_f = Candidate(2, 1, (2, 2), 4, "zb-h1"), Candidate(2, 1, (2, 2), 4, "1f1b")
    # the bound: each of the 4 micro-batches' backward (1 ms of calls) and, split, its W pass (1 ms more)
    assert (cost.step_lower_bound(calls, cluster, zb, 4) - cost.step_lower_bound(plain, cluster, zb, 4)
            == pytest.approx(4 * 2e-3))
    assert (cost.step_lower_bound(calls, cluster, one_f, 4) - cost.step_lower_bound(plain, cluster, one_f, 4)
            == pytest.approx(4 * 1e-3 + 1e-3))  # and the first stage's backward chained before the last's
    with_w = predict(calls, cluster, zb, 4).step_seconds
    monkeypatch.setattr(cost, "_weight_call_seconds", lambda profile, layers, cluster: [0.0] * len(layers))
    without_w = predict(calls, cluster, zb, 4).step_seconds
    assert 0 < with_w - without_w <= 4 * 1e-3 + 1e-9  # some of it hides in the schedule's bubble


def test_a_measured_split_cost_replaces_the_backward_call_estimate():
    """A profile that measured what the split costs (``split_call_ms``, per layer, whatever its weights) is
    charged that, not each weighted layer's fixed backward call again; a profile without it keeps the estimate."""
    from hybridpipe.plan import cost

    plain = uniform_profile(layers=4)
    calls = dataclasses.replace(plain, layers=[dataclasses.replace(layer, backward_call_ms=0.5)
                                               for layer in plain.layers])
    measured = dataclasses.replace(calls, layers=[dataclasses.replace(layer, split_call_ms=0.2)
                                                  for layer in calls.layers])
    cluster = Cluster(ranks=2, **FREE)
    zb = Candidate(2, 1, (2, 2), 4, "zb-h1")
    layers = cost._chunk_layers(zb.balance)
    assert cost._weight_call_seconds(calls, layers, cluster) == pytest.approx([1e-3, 1e-3])
    assert cost._weight_call_seconds(measured, layers, cluster) == pytest.approx([0.4e-3, 0.4e-3])
    # 4 micro-batches, each a 1 ms backward of calls and its 0.4 ms split, on the busiest stage
    assert (cost.step_lower_bound(measured, cluster, zb, 4) - cost.step_lower_bound(plain, cluster, zb, 4)
            == pytest.approx(4 * 1.4e-3))
    assert predict(measured, cluster, zb, 4).step_seconds < predict(calls, cluster, zb, 4).step_seconds


def test_memory_counts_what_the_schedule_holds():
    profile = uniform_profile(layers=4, parameters=1000, activation=100.0)
    cluster = Cluster(ranks=2, **FREE)
    gpipe = predict(profile, cluster, Candidate(2, 1, (2, 2), 8, "gpipe"), 8, optimizer_state_factor=2)
    one_f = predict(profile, cluster, Candidate(2, 1, (2, 2), 8, "1f1b"), 8, optimizer_state_factor=2)
    params = 2 * 1000 * (2 + 2)  # two layers: parameters, gradients, two Adam moments
    assert gpipe.memory_bytes_per_rank == [params + 8 * 200.0, params + 8 * 200.0]  # all M held
    assert one_f.memory_bytes_per_rank == [params + 2 * 200.0, params + 1 * 200.0]  # P - s held
    always = predict(profile, cluster, Candidate(2, 1, (2, 2), 8, "gpipe", "always"), 8, optimizer_state_factor=2)
    assert always.memory_bytes_per_rank[1] == params + 8 * 4.0 + 200.0  # inputs, and one being recomputed


def test_reductions_on_the_computing_cores_add_their_whole_time_after_the_backward():
    """A CPU model with fewer than two cores per rank: the reductions that overlap the backward run on its core,
    so the step ends their total time after the last backward; with cores to spare (or a GPU) they hide."""
    profile = uniform_profile(layers=4, parameters=10**6)
    candidate = Candidate(1, 2, (4,), 1, "1f1b")
    spare = Cluster(ranks=2, ranks_per_host=2, cores_per_host=4, fusion_bytes=10**6, latency_us=0.0,
                    intra_host_gbps=8.0)
    sharing = dataclasses.replace(spare, cores_per_host=2)
    assert sharing.reductions_share_cores("cpu") and not spare.reductions_share_cores("cpu")
    assert not sharing.reductions_share_cores("cuda:0")
    assert not dataclasses.replace(sharing, cores_per_host=0).reductions_share_cores("cpu")  # cores unknown
    hidden, shared = predict(profile, spare, candidate, 2), predict(profile, sharing, candidate, 2)
    bucket, flags = allreduce_seconds(10**6, [0, 1], spare), allreduce_seconds(64, [0, 1], spare)  # + step()'s
    assert hidden.pipeline_seconds == pytest.approx(shared.pipeline_seconds)
    # hidden: the first three buckets overlap the backward (each layer's 2 ms > a bucket's 1 ms), the last not
    assert hidden.step_seconds == pytest.approx(hidden.pipeline_seconds + bucket + flags)
    assert shared.step_seconds == pytest.approx(shared.pipeline_seconds + 4 * bucket + flags)
    gpu = dataclasses.replace(profile, device="cuda:0")
    assert predict(gpu, sharing, candidate, 2).step_seconds == pytest.approx(hidden.step_seconds)


def test_layer_times_add_up_to_the_whole_pass():
    """The profile scales its layers' times so that at the profiled batch they add up to one timed pass through
    all of them (forward, loss, backward), keeping their proportions; the note says by how much."""
    from hybridpipe.plan.profile import _scaled_to_whole

    costs = [LayerCost("A", 1.0, 2.0, 4.0, 4.0, 8, forward_call_ms=0.5, backward_call_ms=0.25, split_call_ms=0.1),
             LayerCost("B", 0.5, 1.0, 4.0, 4.0, 0)]
    # at 4 samples: A 4.5 + 8.25, B 2 + 4, the loss 0.25 * 4: 19.75 ms
    scaled, loss, factor = _scaled_to_whole(costs, 0.25, 4, 39.5)
    assert factor == pytest.approx(2.0) and loss == pytest.approx(0.5)
    assert scaled[0] == dataclasses.replace(costs[0], forward_ms=2.0, backward_ms=4.0, forward_call_ms=1.0,
                                            backward_call_ms=0.5, split_call_ms=0.2)
    assert scaled[1].split_call_ms is None and scaled[1].backward_ms == pytest.approx(2.0)
    assert _scaled_to_whole(costs, 0.25, 4, 0.0) == (costs, 0.25, 1.0)
    torch.manual_seed(0)
    profile = hplan.profile([nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)], torch.randn(16, 8), nn.MSELoss(),
                            torch.randn(16, 4), repeats=2, warmup=1)
    whole = float(profile.note.split("to the whole pass (")[1].split(" ms")[0])
    parts = sum(layer.forward_seconds(16) + layer.backward_seconds(16) for layer in profile.layers) * 1e3
    assert parts + profile.loss_ms * 16 == pytest.approx(whole, rel=1e-3, abs=2e-3)


def test_profile_measures_per_sample_costs_and_round_trips_as_json(tmp_path):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    profile = hplan.profile(layers, torch.randn(16, 8), nn.CrossEntropyLoss(), torch.randint(0, 4, (16,)),
                            repeats=2, warmup=1)
    assert [layer.name for layer in profile.layers] == ["Linear", "Tanh", "Linear"]
    assert [layer.output_bytes for layer in profile.layers] == [64.0, 64.0, 16.0]  # float32 per sample
    assert [layer.parameter_bytes for layer in profile.layers] == [(8 * 16 + 16) * 4, 0, (16 * 4 + 4) * 4]
    assert profile.input_bytes == 32.0 and profile.sample_batch == 16
    assert all(layer.forward_ms > 0 and layer.forward_call_ms >= 0 for layer in profile.layers)
    # the split backward (zb-h1's I and W) is timed where there is something to split
    assert profile.layers[1].split_call_ms == 0.0
    assert all(profile.layers[i].split_call_ms is not None and profile.layers[i].split_call_ms >= 0 for i in (0, 2))
    assert profile.loss_ms > 0
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    with pytest.raises(HybridPipeError, match="not a hybridpipe profile"):
        Profile.from_json('{"layers": []}')


def test_search_picks_the_fastest_and_respects_memory():
    profile = uniform_profile(layers=8, parameters=10**6, activation=10**4)
    cluster = Cluster(ranks=4, **FREE)
    best = hplan.plan(profile, cluster, global_batch=16)
    assert best.replicas == 4 and best.stages == 1  # free allreduce: pure data parallelism has no bubble
    assert best.step_seconds == pytest.approx(min(
        predict(profile, cluster, Candidate(p, 4 // p, tuple(partition_by_weights([3.0] * 8, p)), m, "1f1b"),
                16).step_seconds for p in (1, 2, 4) for m in (1, 2, 4) if (16 // (4 // p)) % m == 0))
    # a memory limit that a whole-model replica cannot meet forces pipeline stages
    whole = 8 * 10**6 * 4
    limited = hplan.plan(profile, Cluster(ranks=4, memory_per_rank=whole / 2, **FREE), global_batch=16)
    assert limited.stages >= 2 and limited.memory_bytes_per_rank <= whole / 2
    assert limited.model_arguments()["balance"] == limited.balance


def test_search_errors_say_what_would_fit():
    one_layer = uniform_profile(layers=1)  # cannot be cut: both ranks must be replicas
    with pytest.raises(HybridPipeError, match=r"global batch 3 does not split evenly .* use a multiple of 2"):
        hplan.plan(one_layer, Cluster(ranks=2, **FREE), global_batch=3)
    profile = uniform_profile(layers=4, parameters=10**6)
    with pytest.raises(HybridPipeError, match=r"fits memory_per_rank 1.0 KiB: the smallest needs [0-9.]+ MiB per rank .*"
                       r"raise the limit to at least [0-9.]+ MiB, use more ranks"):
        hplan.plan(profile, Cluster(ranks=2, memory_per_rank=1024, **FREE), global_batch=4)


def test_profile_leaves_the_callers_gradients_as_they_were():
    """The profile's backward passes (the whole pass, the split costs) add into no gradient the caller holds."""
    from hybridpipe.plan.profile import profile

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)]
    before = holding(layers)
    profile(layers, torch.randn(8, 4), nn.CrossEntropyLoss(), torch.randint(0, 2, (8,)),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert_as_held(layers, before)


def test_command_line_profiles_a_factory_and_prints_the_plan(tmp_path, capsys):
    factory = tmp_path / "model.py"
    factory.write_text(
        "import torch\nfrom torch import nn\n"
        "def build():\n"
        "    layers = [nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]\n"
        "    return layers, nn.CrossEntropyLoss(), lambda n: (torch.randn(n, 16), torch.randint(0, 3, (n,)))\n")
    saved = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, "-m", "hybridpipe.plan", f"{factory}:build", "--sample-batch", "8",
                             "--global-batch", "16", "--ranks", "2", "--explain", "--save-profile", str(saved)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "plan for 2 ranks, global batch 16:" in result.stdout
    assert "hybridpipe-run -np 2 --stages " in result.stdout and "hp.PipelineModel(layers, loss_fn, **{" in result.stdout
    assert "next best, and why each lost:" in result.stdout
    assert len(Profile.load(saved).layers) == 5
    from hybridpipe.plan.__main__ import main

    assert main(["--profile", str(saved), "--global-batch", "16", "--ranks", "2", "--memory-per-rank", "1KiB"]) == 2
    assert "the smallest needs" in capsys.readouterr().err


def test_calibration_fit_recovers_latency_and_bandwidth():
    from hybridpipe.plan.calibrate import SIZES, fit

    latency, per_byte = 50e-6, 1 / 2.5e9
    assert fit(SIZES, [latency + size * per_byte for size in SIZES]) == pytest.approx((latency, per_byte))
    assert fit([1, 2], [3.0, 3.0]) == pytest.approx((3.0, 0.0), abs=1e-12)  # flat: all latency


def test_zero_lowers_the_memory_per_rank_by_what_it_shards():
    """Per rank W parameter bytes, Adam (2 W of state), D replicas, activations A >= W: zero=0 holds
    W + W + 2W + A; zero=1 the parameters and their gradients whole, the state and a flat shard of the
    parameters and of its gradient /D, and A; zero=2 frees the whole gradients too (one micro-batch)."""
    profile = uniform_profile(layers=4, parameters=1000, activation=1000.0)
    weights, acts = 4 * 1000, 4 * 1000.0 * 4  # four layers; 4 samples per replica, one micro-batch
    for replicas in (2, 4, 8):
        memory = {zero: hplan.memory_per_rank(profile, Candidate(1, replicas, (4,), 1, "1f1b", zero=zero),
                                              4 * replicas, optimizer_state_factor=2)
                  for zero in (0, 1, 2)}
        shard = weights * (2 + 2) / replicas  # the shard's parameters, gradient and two Adam moments
        assert memory[0] == [weights * 4 + acts]
        assert memory[1] == [weights + weights + shard + acts]
        assert memory[2] == [weights + shard + acts]
        assert memory[0][0] - memory[1][0] == pytest.approx(2 * weights * (1 - 1 / replicas) - 2 * weights / replicas)
    # several micro-batches: the gradients accumulate whole before the last one, so zero=2 holds them then
    accumulating = hplan.memory_per_rank(profile, Candidate(1, 4, (4,), 2, "1f1b", zero=2), 16)
    assert accumulating == [weights + weights * 4 / 4 + weights + acts / 2]
    with pytest.raises(HybridPipeError, match=r"zero=1 shards over the data replicas, but there is 1: use zero=0"):
        predict(profile, Cluster(ranks=1), Candidate(1, 1, (4,), 1, "1f1b", zero=1), 4)
    with pytest.raises(HybridPipeError, match=r"zero must be one of 0, 1, 2, 3 \(got 4\)"):
        hplan.memory_per_rank(profile, Candidate(1, 2, (4,), 1, "1f1b", zero=4), 4)


def test_zero_time_is_a_reduce_scatter_an_allgather_and_a_step_on_the_shard():
    profile = uniform_profile(layers=4, parameters=10**6)
    profile.update_ms_per_mb = 2.0
    cluster = Cluster(ranks=4, latency_us=0.0, intra_host_gbps=8.0)  # 4 MB of gradients: one bucket, at the end
    group = [0, 1, 2, 3]
    assert hplan.reducescatter_seconds(4e6, group, cluster) + hplan.allgather_seconds(4e6, group, cluster) == \
        pytest.approx(allreduce_seconds(4e6, group, cluster))  # each half a ring
    update = 2.0 * 4e6 / 2**20 / 1e3
    unsharded = predict(profile, cluster, Candidate(1, 4, (4,), 1, "1f1b"), 4)
    sharded = predict(profile, cluster, Candidate(1, 4, (4,), 1, "1f1b", zero=1), 4)
    flags = allreduce_seconds(64, group, cluster)  # zero=0's agreement on which gradients exist
    assert unsharded.step_seconds == pytest.approx(4 * 3e-3 + allreduce_seconds(4e6, group, cluster) + flags + update)
    assert sharded.step_seconds == pytest.approx(4 * 3e-3 + allreduce_seconds(4e6, group, cluster) + update / 4)


def test_zero3_memory_and_time_from_the_links():
    """ZeRO-3 keeps the shard, its gradient and state, a few buckets gathered and (one micro-batch) a few buckets of
    gradients: less than ZeRO-2, which keeps the parameters whole; its step pays a gather of each chunk's parameters
    before each forward and each backward, per micro-batch, and no allgather after the update."""
    from hybridpipe.plan.cost import ZERO_BUCKET_BYTES

    profile = uniform_profile(layers=4, parameters=64 * 2**20)  # 64 MiB a layer: a bucket each
    weights = 4 * 64 * 2**20

    def memory(zero: int, replicas: int, micro_batches: int = 1) -> float:  # 4 samples per micro-batch
        candidate = Candidate(1, replicas, (4,), micro_batches, "1f1b", zero=zero)
        return hplan.memory_per_rank(profile, candidate, 4 * replicas * micro_batches)[0]

    assert memory(3, 4) < memory(2, 4) - weights / 2
    assert memory(3, 2) - memory(3, 4) == pytest.approx(weights * (2 + 2) * (1 / 2 - 1 / 4))  # all of it sharded
    assert memory(3, 4, 2) - memory(3, 4) == pytest.approx(weights - 2 * ZERO_BUCKET_BYTES)  # .grad whole when M > 1
    cluster = Cluster(ranks=4, latency_us=0.0, intra_host_gbps=8.0)
    group = [0, 1, 2, 3]
    gather = sum(hplan.allgather_seconds(ZERO_BUCKET_BYTES, group, cluster)
                 for _ in range(weights // ZERO_BUCKET_BYTES))
    steps = {(zero, m): predict(profile, cluster, Candidate(1, 4, (4,), m, "1f1b", zero=zero), 16).step_seconds
             for zero in (2, 3) for m in (1, 2)}
    assert steps[(3, 1)] > steps[(2, 1)]  # (the reduce-scatter overlaps the longer backward: less than a gather)
    # each micro-batch more: a forward's and a backward's gathers more
    assert steps[(3, 2)] - steps[(3, 1)] == pytest.approx(steps[(2, 2)] - steps[(2, 1)] + 2 * gather, rel=0.05)


def test_a_measured_zero_step_is_the_plain_step_plus_the_measured_time_per_mib_and_the_search_weighs_it():
    """Where calibrate measured ZeRO's step (here: 1 ms and 1.5 ms per MiB of a rank's parameters beyond a plain one),
    a sharded candidate is predicted as the plain one plus that, with ZeRO's memory (ZeRO-3, 2.5 ms, measured for one
    forward and backward: with M micro-batches its gathers come M times); the search then does not shard, though
    the links alone would make the sharded step faster."""
    profile = uniform_profile(layers=4, parameters=2**20)  # 1 MiB per layer: 4 MiB per rank
    profile.update_ms_per_mb = 20.0  # the links alone make a sharded step faster (a quarter of the update)
    links = Cluster(ranks=4, latency_us=0.0, intra_host_gbps=8.0)
    measured = dataclasses.replace(links, zero_step_us_per_mib=(1000.0, 1500.0, 2500.0))
    plain = predict(profile, measured, Candidate(1, 4, (4,), 1, "1f1b"), 4)
    for level, per_mib in ((1, 1e-3), (2, 1.5e-3), (3, 2.5e-3)):
        candidate = Candidate(1, 4, (4,), 1, "1f1b", zero=level)
        sharded = predict(profile, measured, candidate, 4)
        assert sharded.step_seconds == pytest.approx(plain.step_seconds + 4 * per_mib)
        assert sharded.memory_bytes_per_rank == hplan.memory_per_rank(profile, candidate, 4)
        assert any(f"ZeRO-{level}: the step as measured here" in note for note in sharded.notes)
        assert predict(profile, links, candidate, 4).step_seconds < plain.step_seconds  # modelled from the links
    two = predict(profile, measured, Candidate(1, 4, (4,), 2, "1f1b", zero=3), 8)
    assert two.step_seconds == pytest.approx(predict(profile, measured, Candidate(1, 4, (4,), 2, "1f1b"), 8).step_seconds
                                             + 4 * (1.5e-3 + 2 * 1e-3))
    assert Cluster(ranks=2, zero_step_us_per_mib=(1.0, 2.0)).zero_step_us_per_mib == (1.0, 2.0, 0.0)  # 3: not measured
    options = dict(checkpoints=("never",), max_micro_batches=1)
    assert hplan.plan(profile, links, 4, **options).zero > 0
    assert hplan.plan(profile, measured, 4, **options).zero == 0
    with pytest.raises(HybridPipeError, match="cluster values must be >= 0"):
        Cluster(ranks=2, zero_step_us_per_mib=(-1.0, 0.0))


def test_a_measured_data_parallel_step_bounds_the_step_where_the_reductions_share_the_cores():
    """calibrate's data_parallel_us_per_mib (a data-parallel step beyond the same step without reductions): where the
    ranks' reductions run on the cores they compute on, a rank with replicas ends its step no earlier than its last
    action, its update and that time for its parameters; with a core per rank, or no replicas, it changes nothing."""
    profile = uniform_profile(layers=4, parameters=2**20)  # 4 MiB per rank
    profile.update_ms_per_mb = 1.0
    shared = Cluster(ranks=4, ranks_per_host=4, cores_per_host=2, latency_us=0.0, intra_host_gbps=8.0)
    measured = dataclasses.replace(shared, data_parallel_us_per_mib=25_000.0)  # 25 ms per MiB: 100 ms for 4 MiB
    candidate = Candidate(1, 4, (4,), 1, "1f1b")
    plain = predict(profile, shared, candidate, 4)
    slow = predict(profile, measured, candidate, 4)
    update = 1.0 * 4 / 1e3 * shared.compute_slowdown  # 4 ranks on 2 cores: the update at half speed too
    assert slow.step_seconds == pytest.approx(plain.pipeline_seconds + update + 4 * 25e-3)
    assert slow.step_seconds > plain.step_seconds
    small = dataclasses.replace(shared, data_parallel_us_per_mib=1.0)  # below what the links model: theirs
    assert predict(profile, small, candidate, 4).step_seconds == pytest.approx(plain.step_seconds)
    own_cores = dataclasses.replace(measured, cores_per_host=8)
    assert predict(profile, own_cores, candidate, 4).step_seconds == \
        pytest.approx(predict(profile, dataclasses.replace(shared, cores_per_host=8), candidate, 4).step_seconds)
    straight = Candidate(4, 1, (1, 1, 1, 1), 4, "1f1b")
    assert predict(profile, measured, straight, 4).step_seconds == predict(profile, shared, straight, 4).step_seconds
    with pytest.raises(HybridPipeError, match="cluster values must be >= 0"):
        Cluster(ranks=2, data_parallel_us_per_mib=-1.0)


def test_search_shards_exactly_when_unsharded_does_not_fit_and_prefers_zero_0_at_equal_time():
    one_layer = Profile([LayerCost("Linear", 1.0, 2.0, 4.0, 1000.0, 10**5)], sample_batch=1, input_bytes=4.0)
    cluster = Cluster(ranks=4, latency_us=20.0, intra_host_gbps=10.0)
    options = dict(checkpoints=("never",), max_micro_batches=1)  # one candidate: 1 × 4, M=1, at three levels
    need = {zero: hplan.memory_per_rank(one_layer, Candidate(1, 4, (1,), 1, "1f1b", zero=zero), 16)[0]
            for zero in (0, 1, 2)}
    assert need[0] > need[1] > need[2]
    assert hplan.plan(one_layer, cluster, 16, **options).zero == 0  # no limit: sharding only costs time here
    for limit in sorted({need[0] + 1, need[0], need[0] - 1, (need[0] + need[1]) / 2, need[1], need[1] - 1,
                         need[2]}):
        best = hplan.plan(one_layer, dataclasses.replace(cluster, memory_per_rank=limit), 16, **options)
        assert (best.zero > 0) == (limit < need[0]), (limit, best)
        assert best.zero == (0 if limit >= need[0] else 1 if limit >= need[1] else 2)
        assert best.memory_bytes_per_rank == need[best.zero] <= limit
    with pytest.raises(HybridPipeError, match="allow zero=2"):
        hplan.plan(one_layer, dataclasses.replace(cluster, memory_per_rank=need[1] - 1), 16, zero_levels=(0, 1),
                   **options)
    # equal time (free links, no optimizer cost): zero=0; a sharded step clearly faster: sharded
    free = Cluster(ranks=4, **FREE)
    assert hplan.plan(one_layer, free, 16, **options).zero == 0
    slow_step = dataclasses.replace(one_layer, update_ms_per_mb=1e4)
    best = hplan.plan(slow_step, free, 16, **options)
    assert best.zero == 1 and best.optimizer_arguments() == {"zero": 1} and "zero=1" in best.describe()


def test_precision_halves_the_activations_stored_and_sent():
    profile = uniform_profile(layers=4, parameters=1000, activation=100.0)
    candidate = Candidate(2, 1, (2, 2), 8, "gpipe")
    fp32 = predict(profile, Cluster(ranks=2, **FREE), candidate, 8)
    bf16 = predict(profile, Cluster(ranks=2, **FREE), candidate, 8, precision="bf16")
    assert [a - b for a, b in zip(fp32.memory_bytes_per_rank, bf16.memory_bytes_per_rank)] == [8 * 200.0 / 2] * 2
    slow_link = Cluster(ranks=2, latency_us=0.0, intra_host_gbps=8e-6, inter_host_gbps=8e-6)  # 1 byte per ms
    saved = (predict(profile, slow_link, candidate, 8).step_seconds
             - predict(profile, slow_link, candidate, 8, precision="fp16").step_seconds)
    assert saved == pytest.approx(2 * 2.0 * 1e-3)  # a 4-byte output, halved, on the fill and the drain
    best = hplan.plan(profile, Cluster(ranks=2, **FREE), 8, precision="bf16")
    assert best.precision == "bf16" and best.model_arguments()["precision"] == "bf16"
    with pytest.raises(HybridPipeError, match=r"unknown precision 'fp8': use one of 'fp32', 'bf16', 'fp16'"):
        hplan.plan(profile, Cluster(ranks=2), 8, precision="fp8")


def test_equal_layers_get_the_same_balance_whatever_the_profiles_noise():
    """16 identical blocks profiled with ±15 % noise and one of them twice as slow (a hiccup, as this VM gives),
    between a light embedding and head, planned for 8 ranks with memory for an eighth of the model each: every
    run cuts the blocks the same way (without evening out identical layers, 8 runs gave 7 different balances,
    e.g. [3, 2, 3, 2, 2, 1, 2, 3] and [2, 1, 3, 2, 2, 2, 3, 3]); the layers that differ keep their own times."""
    from hybridpipe.pipeline.partition import even_out_identical

    def noisy_profile(seed: int) -> Profile:
        rng = random.Random(seed)
        slow = rng.randrange(16)
        block = [LayerCost(name="Block", forward_ms=rng.uniform(0.85, 1.15) * (2 if i == slow else 1),
                           backward_ms=2 * rng.uniform(0.85, 1.15) * (2 if i == slow else 1), output_bytes=512,
                           activation_bytes=2048, parameter_bytes=40_000) for i in range(16)]
        ends = [LayerCost(name="Embedding", forward_ms=0.5, backward_ms=0.5, output_bytes=512, activation_bytes=512,
                          parameter_bytes=40_000),
                LayerCost(name="Head", forward_ms=0.5, backward_ms=1.0, output_bytes=256, activation_bytes=1024,
                          parameter_bytes=40_000)]
        return Profile(layers=[ends[0], *block, ends[1]], sample_batch=8, input_bytes=64, loss_ms=0.1)

    cluster = Cluster(ranks=8, ranks_per_host=8, cores_per_host=8, memory_per_rank=0.6e6)
    plans = [hplan.plan(noisy_profile(seed), cluster, 64) for seed in range(8)]
    by_chunks: dict[int, set] = {}  # the schedule may differ (their costs are as close as the noise): not the cuts
    for chosen in plans:
        by_chunks.setdefault(len(chosen.balance), set()).add(tuple(chosen.balance))
    assert all(len(balances) == 1 for balances in by_chunks.values()), by_chunks
    assert by_chunks.get(8) in (None, {(3, 2, 2, 2, 2, 2, 2, 3)})
    weights = even_out_identical([3.0, 1.0, 1.2, 0.9, 7.0], ["a", "b", "b", "b", "c"])
    assert weights == [3.0, 1.0, 1.0, 1.0, 7.0]
    with pytest.raises(HybridPipeError, match="2 keys for 3 weights"):
        even_out_identical([1.0, 2.0, 3.0], ["a", "b"])


def test_the_lower_bound_is_each_of_its_parts_and_no_prediction_is_below_it():
    """step_lower_bound is the largest of: a replica's stages one after the other with M = 1 (the chain), the
    busiest link's bytes at its bandwidth, and the allreduce of a stage's gradients; predict never goes below it."""
    from hybridpipe.plan.cost import step_lower_bound

    profile = Profile([LayerCost("Linear", 1.0, 2.0, 10**6, 10**6, 1000) for _ in range(4)], sample_batch=1,
                      input_bytes=4.0)  # 1 MB sent per sample at a cut
    free = Cluster(ranks=4, **FREE)
    # M = 1 on 2 stages: 2 layers each, 1 + 2 ms per layer and sample, 8 samples per replica: 2 × 2 × 3 × 8 ms
    chain = Candidate(2, 2, (2, 2), 1, "gpipe")
    assert step_lower_bound(profile, free, chain, 16) == pytest.approx(2 * 2 * 3e-3 * 8)
    # the link: 8 samples of 1 MB one way each, at 0.1 Gbit/s (no latency): 640 ms, whatever M
    slow = Cluster(ranks=4, latency_us=0.0, intra_host_gbps=0.1, inter_host_gbps=0.1)
    link = 8 * 10**6 * 8 / 0.1e9
    assert step_lower_bound(profile, slow, chain, 16) == pytest.approx(link)
    assert step_lower_bound(profile, slow, Candidate(2, 2, (2, 2), 8, "gpipe"), 16) == pytest.approx(link)
    # the allreduce: 4 layers of 1 MB of parameters over 4 replicas at 0.1 Gbit/s, over the 48 ms of compute
    heavy = uniform_profile(layers=4, parameters=10**6)
    data_parallel = Candidate(1, 4, (4,), 1, "gpipe")
    reduce = allreduce_seconds(4 * 10**6, [0, 1, 2, 3], slow)
    assert reduce > 4 * 3e-3 * 4
    assert step_lower_bound(heavy, slow, data_parallel, 16) == pytest.approx(reduce)
    for cluster in (free, slow, Cluster(ranks=4, ranks_per_host=4, cores_per_host=2, **FREE)):
        for candidate in (chain, data_parallel, Candidate(4, 1, (1,) * 4, 4, "1f1b"),
                          Candidate(2, 2, (1,) * 4, 4, "interleaved-1f1b", virtual_stages=2),
                          Candidate(2, 2, (2, 2), 4, "zb-h1"),
                          Candidate(2, 1, (3, 1), 4, "gpipe", stage_replicas=(3, 1))):
            prediction = predict(profile, cluster, candidate, 16)
            bound = step_lower_bound(profile, cluster, candidate, 16)
            assert prediction.lower_bound_seconds == pytest.approx(bound) and bound > 0, candidate
            assert prediction.step_seconds >= bound * (1 - 1e-12), (candidate, prediction.notes)


def test_resuming_after_a_wait_costs_a_pipeline_and_not_data_parallelism():
    """resume_us is added to each action a rank starts after waiting for another: a 2-stage GPipe with M = 1 has one
    (stage 0's backward, after waiting for stage 1's; stage 1's forward is its first action), on each cluster
    simulation (cores known or not); one stage of data parallelism waits for nobody within its step."""
    profile = Profile([LayerCost("Linear", 1.0, 2.0, 100, 100, 1000) for _ in range(4)], sample_batch=1,
                      input_bytes=4.0)
    for cores in ({}, {"ranks_per_host": 2, "cores_per_host": 2}):
        plain, resumed = Cluster(ranks=2, **cores, **FREE), Cluster(ranks=2, resume_us=500.0, **cores, **FREE)
        chain = Candidate(2, 1, (2, 2), 1, "gpipe")
        extra = predict(profile, resumed, chain, 8).step_seconds - predict(profile, plain, chain, 8).step_seconds
        assert extra == pytest.approx(500e-6), cores
        data_parallel = Candidate(1, 2, (4,), 1, "1f1b")
        assert predict(profile, resumed, data_parallel, 8).step_seconds == \
            pytest.approx(predict(profile, plain, data_parallel, 8).step_seconds), cores
        assert any("after a wait" in note for note in predict(profile, resumed, chain, 8).notes)
    with pytest.raises(HybridPipeError, match="resume_us"):
        Cluster(ranks=2, resume_us=-1.0)


def test_a_simulation_below_the_bound_is_raised_to_it_with_a_note(monkeypatch):
    """The chain of a 2 × 2 M = 1 plan (each stage after the other, as on the MLP where the planner predicted below
    what one process needs) holds even where the simulation comes out faster: predict raises it and says so."""
    from hybridpipe.plan import cost

    profile = uniform_profile(layers=4)
    cluster = Cluster(ranks=4, **FREE)
    candidate = Candidate(2, 2, (2, 2), 1, "gpipe")
    real = cost._simulated

    def faster(*args, **kwargs):
        prediction = real(*args, **kwargs)
        prediction.step_seconds /= 3
        return prediction

    monkeypatch.setattr(cost, "_simulated", faster)
    prediction = cost.predict(profile, cluster, candidate, 8)
    assert prediction.step_seconds == pytest.approx(2 * 2 * 3e-3 * 4) == prediction.lower_bound_seconds
    assert prediction.samples_per_second == pytest.approx(8 / prediction.step_seconds)
    assert any(note.startswith("raised from the simulated") and "to the lower bound 48 ms" in note
               for note in prediction.notes), prediction.notes


def test_every_plan_the_search_produces_is_at_or_above_its_lower_bound():
    """Random profiles and clusters: the chosen plan, the plans to verify, and every alternative's numbers."""
    rng = random.Random(7)
    for _ in range(12):
        layers = rng.randint(2, 8)
        profile = Profile([LayerCost("Linear", rng.uniform(0.1, 3), rng.uniform(0.1, 6), rng.uniform(1, 1e4),
                                     rng.uniform(1, 1e5), rng.randint(1, 10**6)) for _ in range(layers)],
                          sample_batch=1, input_bytes=4.0)
        ranks = rng.choice([2, 4])
        cluster = Cluster(ranks=ranks, ranks_per_host=rng.choice([1, 2]), latency_us=rng.uniform(0, 50),
                          intra_host_gbps=rng.uniform(1, 100), inter_host_gbps=rng.uniform(0.1, 10),
                          cores_per_host=rng.choice([0, 1, 2]))
        found = hplan.plans(profile, cluster, global_batch=16, count=3)
        assert found[0].config == hplan.plan(profile, cluster, global_batch=16).config
        assert len({(p.stages, p.replicas, p.config, p.schedule, p.micro_batches, tuple(p.balance), p.checkpoint,
                     p.zero) for p in found}) == len(found)
        if len(found) > 1:
            assert len({(p.stages, p.replicas, p.config) for p in found}) >= 2  # another grid measured too
        for plan in found:
            assert plan.lower_bound_seconds > 0 and plan.step_seconds >= plan.lower_bound_seconds * (1 - 1e-12)
            assert plan.predicted_seconds == plan.step_seconds and plan.measured_seconds is None
    with pytest.raises(HybridPipeError, match=r"plans: count must be >= 1 \(got 0\)"):
        hplan.plans(uniform_profile(), Cluster(ranks=2, **FREE), 4, count=0)


def test_the_step_clock_keeps_the_median_training_step_and_warns_once_when_far_from_the_prediction(monkeypatch):
    """StepClock: each step's first forward (after step_ends) starts a step; from the 4th start on (2 warm-up
    steps) each start-to-start time enters plan.measured_seconds' median; after 5 of them, a median more than 25 %
    from the prediction warns once, naming the biggest term (not where the verification warned already)."""
    from hybridpipe.plan import verify
    from hybridpipe.plan.verify import StepClock

    best = hplan.plan(uniform_profile(layers=4), Cluster(ranks=1, **FREE), global_batch=4)
    clock = [0.0]
    monkeypatch.setattr(verify.time, "perf_counter", lambda: clock[0])

    def run(stepper: StepClock, seconds: list[float]) -> None:
        for step in seconds:
            for _ in range(3):  # a step's forwards: only the first starts it
                stepper.forward_begins(None)
            stepper.step_ends()
            clock[0] += step

    predicted = best.step_seconds
    near = StepClock(best, warn=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within 25 %: no warning
        run(near, [9 * predicted, 9 * predicted] + [predicted * f for f in (1.1, 0.9, 1.2, 1.0, 1.05, 1.0)])
    assert near.steps == 8 and best.measured_seconds == pytest.approx(predicted * 1.05)  # the 5 after warm-up
    far = StepClock(best, warn=True)
    with pytest.warns(UserWarning, match=r"is 50% below its measured median.* biggest term is .*\(in training: this "
                                         r"rank's median of 5 steps") as caught:
        run(far, [predicted] * 2 + [2 * predicted] * 12)
    assert len(caught) == 1 and best.measured_seconds == pytest.approx(2 * predicted)
    assert caught[0].filename == __file__  # the caller's line (here run()'s), not the clock's inside hybridpipe
    for quiet in (StepClock(best, warn=False), StepClock(best, warn=True, warned=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run(quiet, [2 * predicted] * 10)

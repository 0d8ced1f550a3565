"""--simulate against what was published: Horovod's scaling efficiencies of tf_cnn_benchmarks on
P100 hosts (4 GPUs each, 25 Gbit/s, 64 images per GPU) at 128 and 512 GPUs, and GPipe's Table 3 Transformer
speedups on one host of 8 P100s; the presets' sizes against their published counts; the data-parallel
engine's pieces (NCCL's ring model, cycle and fusion, the slowest GPU) against hand-computed values; the
JSON lines. Each runs in well under a second: no search, no MPI."""

from __future__ import annotations

import json

import pytest

from hybridpipe.plan.__main__ import main
from hybridpipe.plan.cost import Cluster
from hybridpipe.plan.models import conv_layers, model_profile, published_seconds_per_image
from hybridpipe.plan.profile import LayerCost, Profile
from hybridpipe.plan.simulate import Engine, data_parallel_step, ring_allreduce_seconds

HOROVOD = ["--simulate", "--data-parallel-only", "--gpu", "p100", "--gpus-per-host", "4", "--inter-host-gbps", "25",
           "--batch-per-gpu", "64"]
# Horovod's README / docs/benchmarks: 512 GPUs (128 servers) and the earlier 128-GPU chart (32 servers)
PUBLISHED = {"inception3": {128: 0.90, 512: 0.90}, "resnet101": {128: 0.90, 512: 0.90},
             "vgg16": {128: 0.79, 512: 0.68}}


def run_json(capsys, argv: list[str]) -> list[dict]:
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_horovod_efficiencies_within_six_points(capsys, model):
    rows = run_json(capsys, HOROVOD + ["--model", model, "--sizes", "1,128,512", "--json"])
    assert [row["gpus"] for row in rows] == [1, 128, 512]
    for row in rows:
        assert {"gpus", "samples_per_second", "speedup_over_one_gpu", "efficiency"} <= set(row)
        assert row["efficiency"] == pytest.approx(row["speedup_over_one_gpu"] / row["gpus"], abs=1e-3)
        assert row["samples_per_second"] == pytest.approx(row["gpus"] * 64 / row["step_seconds"], rel=1e-4)
    assert rows[0]["efficiency"] == 1.0
    assert rows[0]["samples_per_second"] == pytest.approx(1 / published_seconds_per_image(model, "p100"), rel=1e-3)
    for row in rows[1:]:
        assert abs(row["efficiency"] - PUBLISHED[model][row["gpus"]]) <= 0.06, (model, row)


def test_vgg_loses_more_than_the_others_and_more_at_512_than_128(capsys):
    efficiency = {model: {row["gpus"]: row["efficiency"] for row in
                          run_json(capsys, HOROVOD + ["--model", model, "--sizes", "128,512", "--json"])}
                  for model in PUBLISHED}
    assert efficiency["vgg16"][512] < efficiency["vgg16"][128] - 0.04  # the ring's latency grows with the GPUs
    assert max(efficiency["vgg16"].values()) < min(efficiency["resnet101"].values())


def test_gpipe_transformer_speedups_within_twenty_percent(capsys):
    rows = run_json(capsys, ["--simulate", "--pipeline-only", "--model", "transformer24", "--gpu", "p100",
                             "--gpus-per-host", "8", "--sizes", "2,4,8", "--micro-batches", "32", "--json"])
    normalized = {row["gpus"]: row["normalized_to_first"] for row in rows}
    assert normalized[2] == 1.0
    for gpus, published in ((4, 1.8), (8, 3.3)):
        assert normalized[gpus] == pytest.approx(published, rel=0.20)
    assert all(sum(row["balance"]) == 26 for row in rows)  # embedding, 24 blocks, head


def test_presets_have_their_published_sizes():
    def count(name):
        layers = conv_layers(name)
        return sum(layer[2] for layer in layers), sum(layer[1] for layer in layers)

    # parameters (torchvision / Keras) and multiply-adds as published
    for name, parameters, macs in (("inception3", 23.83e6, 5.71e9), ("vgg16", 138.36e6, 15.47e9),
                                   ("resnet50", 25.56e6, 4.09e9), ("resnet101", 44.55e6, 7.80e9),
                                   ("resnet152", 60.19e6, 11.51e9)):
        got_parameters, got_macs = count(name)
        assert got_parameters == pytest.approx(parameters, rel=2e-3), name
        assert got_macs == pytest.approx(macs, rel=5e-3), name
    # the existing ResNet-101 profile is the same network
    assert model_profile("resnet101", "p100").parameter_bytes == 4 * count("resnet101")[0]
    # ResNet-101's time per image lies between ResNet-50's and ResNet-152's published ones, by multiply-adds
    assert 1 / 219 < published_seconds_per_image("resnet101", "p100") < 1 / 91.8
    assert published_seconds_per_image("vgg16", "h100") is None
    # GPipe's Transformer: 24 blocks of width 2048 (12·h² + 13·h parameters each)
    transformer = model_profile("transformer24", "p100")
    assert sum(layer.name == "Block" for layer in transformer.layers) == 24
    assert transformer.layers[1].parameter_bytes == 4 * (12 * 2048**2 + 13 * 2048)


def test_measured_profile_reproduces_the_published_single_gpu_rate():
    profile = model_profile("inception3", "p100", measured=True)
    step = data_parallel_step(profile, Cluster(ranks=1), 1, 64)[0]
    assert 64 / step == pytest.approx(142.0, rel=1e-6)
    shares = [layer.forward_ms for layer in profile.layers]
    flops = [layer.forward_ms for layer in model_profile("inception3", "p100", call_overhead_us=0).layers]
    assert [a / sum(shares) for a in shares] == pytest.approx([b / sum(flops) for b in flops])


def test_ring_allreduce_is_nccls_model():
    cluster = Cluster(ranks=8, ranks_per_host=4, intra_host_gbps=80, inter_host_gbps=25)
    engine = Engine()
    nbytes = 64 * 2**20
    # 8 GPUs on 2 hosts: 14 steps, 2 of them between hosts; large: x1.9; 2·7/8 of the bytes at 25 Gbit/s of
    # which RoCE's packets carry 1024 payload bytes in 1106
    network = 3.125e9 * 1024 / 1106
    latency = (8.4 + 12 * 5.7 + 2 * 9.6) * 1.9 * 1e-6
    assert ring_allreduce_seconds(nbytes, 8, cluster, engine) == pytest.approx(latency + 14 / 8 * nbytes / network)
    # one host: the PCIe link, no plateau
    inside = (8.4 + 6 * 5.7) * 1e-6 + 6 / 4 * nbytes / 10e9
    assert ring_allreduce_seconds(nbytes, 4, cluster, engine) == pytest.approx(inside)
    # hierarchical: inside each host over shares, then the hosts' ring carrying each host's 2(H−1)/H
    hierarchical = ring_allreduce_seconds(nbytes, 8, cluster, Engine(hierarchical=True))
    expected = (8.4e-6 + 6 * 5.7e-6 + 6 / 4 * nbytes / 10e9 + (8.4 + 2 * 9.6) * 1.9e-6 + nbytes / network)
    assert hierarchical == pytest.approx(expected)
    assert ring_allreduce_seconds(nbytes, 1, cluster, engine) == 0.0


def test_cycle_fusion_and_the_slowest_gpu():
    # two layers of 48 MiB each; forward 10 ms, backward 20 ms each (the last layer's gradient first)
    layers = [LayerCost(name=f"L{i}", forward_ms=5.0, backward_ms=20.0, output_bytes=0, activation_bytes=0,
                        parameter_bytes=48 * 2**20) for i in range(2)]
    profile = Profile(layers=layers, sample_batch=1, input_bytes=0, loss_ms=0.0, update_ms_per_mb=0.0)
    cluster = Cluster(ranks=8, ranks_per_host=4, intra_host_gbps=80, inter_host_gbps=25, latency_us=0)
    engine = Engine(gpu_variation=0.0, cycle_phases=1)
    step, compute, count, busy = data_parallel_step(profile, cluster, 8, 1, engine)
    assert compute == pytest.approx(0.050)
    one = ring_allreduce_seconds(48 * 2**20, 8, cluster, engine)
    # L1 ready at 30 ms (a cycle tick: 30 = 6 × 5 ms), reduced alone; L0 ready at 50 ms, waits for that
    assert count == 2 and busy == pytest.approx(2 * one)
    assert step == pytest.approx(max(0.030 + one, 0.050) + one)
    # a fusion buffer holding both, and both ready in one cycle (a long cycle): one allreduce
    fused = data_parallel_step(profile, cluster, 8, 1, Engine(gpu_variation=0.0, cycle_ms=60.0,
                                                              fusion_bytes=128 * 2**20, cycle_phases=1))
    assert fused[2] == 1
    # the slowest of n GPUs spread 8 %: 1 GPU at the median, many approach 4 % slower
    assert Engine().slowest_pace(1) == pytest.approx(1.0)
    assert Engine().slowest_pace(512) == pytest.approx(0.96 + 0.08 / 513)
    slow = data_parallel_step(profile, cluster, 8, 1, Engine())[1]
    assert slow == pytest.approx(0.050 / Engine().slowest_pace(8))
    # the cycle's phase: L1 (ready at 30 ms) waits up to a cycle; averaged over the phases it waits 2 ms
    phases = [data_parallel_step(profile, cluster, 8, 1, Engine(gpu_variation=0.0, cycle_phases=1, cycle_ms=10.0))[0],
              data_parallel_step(profile, cluster, 8, 1, Engine(gpu_variation=0.0, cycle_phases=2, cycle_ms=10.0))[0]]
    assert phases[1] > phases[0]


def test_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "vgg16", "--gpu", "p100", "--ranks", "8", "--data-parallel-only"])
    with pytest.raises(SystemExit):
        main(["--simulate", "--model", "vgg16", "--data-parallel-only", "--pipeline-only"])
    with pytest.raises(SystemExit):
        main(["--simulate", "--model", "vgg16", "--batch-per-gpu", "64"])
    capsys.readouterr()
    # a model without a published throughput is costed from its FLOPs instead
    rows = run_json(capsys, ["--simulate", "--data-parallel-only", "--model", "gpt3-125m", "--gpu", "h100",
                             "--sizes", "8,16", "--batch-per-gpu", "4", "--json"])
    assert [row["gpus"] for row in rows] == [8, 16] and all(0 < row["efficiency"] <= 1 for row in rows)

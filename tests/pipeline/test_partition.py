"""Tests of hybridpipe.pipeline.partition: balances, optimal partition, profiling, report."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from hybridpipe.errors import PartitionError
from hybridpipe.pipeline import partition
from brute_force import compositions


def stage_sums(values, balance):
    sums, start = [], 0
    for count in balance:
        sums.append(sum(values[start : start + count]))
        start += count
    return sums


def test_uniform() -> None:
    assert partition.partition_uniform(10, 4) == [2, 2, 3, 3]
    assert partition.partition_uniform(8, 4) == [2, 2, 2, 2]
    assert partition.partition_uniform(5, 5) == [1] * 5
    message = r"pipeline_stages 6 > 4 layers \(use at most 4 stages or split layers\)"
    with pytest.raises(PartitionError, match=message):
        partition.partition_uniform(4, 6)


def test_validate_balance_errors() -> None:
    assert partition.validate_balance([3, 5, 4, 4], 16, 4) == [3, 5, 4, 4]
    with pytest.raises(PartitionError, match=r"sums to 15 but the model has 16 layers"):
        partition.validate_balance([3, 4, 4, 4], 16, 4)
    with pytest.raises(PartitionError, match=r"balance \[8, 0, 8\] has a stage with 0 layers"):
        partition.validate_balance([8, 0, 8], 16, 3)
    with pytest.raises(PartitionError, match=r"has 3 entries but pipeline_stages is 4 .*\[4, 4, 4, 4\]"):
        partition.validate_balance([6, 5, 5], 16, 4)
    with pytest.raises(PartitionError, match="list of ints"):
        partition.validate_balance([8.0, 8.0], 16, 2)
    with pytest.raises(PartitionError, match="pipeline_stages 6 > 4 layers"):
        partition.validate_balance([1, 1, 1, 1, 0, 0], 4, 6)


def test_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        layers = rng.randint(1, 9)
        stages = rng.randint(1, layers)
        weights = [rng.choice([0, rng.randint(0, 20), rng.random() * 10]) for _ in range(layers)]
        balance = partition.partition_by_weights(weights, stages)
        assert len(balance) == stages and sum(balance) == layers and min(balance) >= 1
        best = min(max(stage_sums(weights, b)) for b in compositions(layers, stages))
        assert max(stage_sums(weights, balance)) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_optimal_with_memory_bound_against_brute_force() -> None:
    rng = random.Random(1)
    for _ in range(200):
        layers = rng.randint(2, 8)
        stages = rng.randint(1, layers)
        weights = [rng.randint(0, 10) for _ in range(layers)]
        memory = [rng.randint(1, 10) for _ in range(layers)]
        limit = rng.randint(5, 30)
        feasible = [b for b in compositions(layers, stages) if max(stage_sums(memory, b)) <= limit]
        if not feasible:
            smallest = min(max(stage_sums(memory, b)) for b in compositions(layers, stages))
            with pytest.raises(PartitionError, match=f"smallest feasible memory_limit is {float(smallest)}"):
                partition.partition_by_weights(weights, stages, memory=memory, memory_limit=limit)
            continue
        balance = partition.partition_by_weights(weights, stages, memory=memory, memory_limit=limit)
        assert max(stage_sums(memory, balance)) <= limit
        assert max(stage_sums(weights, balance)) == min(max(stage_sums(weights, b)) for b in feasible)


def test_partition_by_weights_examples_and_errors() -> None:
    assert partition.partition_by_weights([1, 1, 1, 5, 1, 1], 3) == [3, 1, 2]
    assert partition.partition_by_weights([1] * 8, 4) == [2, 2, 2, 2]
    assert partition.partition_by_weights([0, 0, 0, 0], 2) == [1, 3]
    assert partition.partition_by_weights([5, 1, 1, 1, 1], 5) == [1, 1, 1, 1, 1]
    with pytest.raises(PartitionError, match="finite and >= 0"):
        partition.partition_by_weights([1, -1], 2)
    with pytest.raises(PartitionError, match="both memory and memory_limit"):
        partition.partition_by_weights([1, 1], 2, memory=[1, 1])
    with pytest.raises(PartitionError, match="memory has 1 entries but weights has 2"):
        partition.partition_by_weights([1, 1], 2, memory=[1], memory_limit=4)
    message = r"memory_limit 3 cannot be met with 2 stages \(smallest feasible memory_limit is 4.0"
    with pytest.raises(PartitionError, match=message):
        partition.partition_by_weights([1, 1, 1], 2, memory=[2, 2, 2], memory_limit=3)
    with pytest.raises(PartitionError, match="pipeline_stages 3 > 2 layers"):
        partition.partition_by_weights([1, 1], 3)


def test_large_partition_is_fast_and_balanced() -> None:
    weights = [1.0 + (i % 7) * 0.1 for i in range(400)]
    balance = partition.partition_by_weights(weights, 8)
    sums = stage_sums(weights, balance)
    assert max(sums) - min(sums) <= max(weights)


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def test_profile_layers_times_and_params() -> None:
    model = small_model()
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    profiles = partition.profile_layers(list(model), torch.randn(16, 8), repeats=2, warmup=1)
    assert [p.index for p in profiles] == list(range(5))
    assert [p.parameters for p in profiles] == [8 * 32 + 32, 0, 32 * 32 + 32, 0, 32 * 4 + 4]
    assert profiles[2].parameter_bytes == (32 * 32 + 32) * 4
    assert all(p.forward_ms > 0 and p.backward_ms > 0 for p in profiles)
    assert all(p.activation_bytes >= 16 * 4 * 4 for p in profiles)
    assert profiles[0].memory_bytes == profiles[0].parameter_bytes + profiles[0].activation_bytes
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 7.0))
    assert model[2].weight.grad is None


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 6)

    def forward(self, inputs: dict) -> tuple:
        return self.table(inputs["ids"]), inputs["mask"]


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, inputs: tuple) -> tuple:
        hidden, mask = inputs
        return self.linear(hidden) * mask.unsqueeze(-1), mask


def test_profile_layers_structured_values_and_no_grad_outputs() -> None:
    sample = {"ids": torch.randint(0, 10, (4, 5)), "mask": torch.ones(4, 5, dtype=torch.bool)}
    profiles = partition.profile_layers([Embed(), Masked(), nn.Identity()], sample, repeats=1, warmup=0)
    assert [p.parameters for p in profiles] == [60, 42, 0]
    assert profiles[0].backward_ms > 0 and profiles[1].backward_ms > 0
    no_grad = partition.profile_layers([nn.Flatten()], torch.arange(6).reshape(2, 3), repeats=1, warmup=0)
    assert no_grad[0].backward_ms == 0.0


def test_balance_by_methods_and_report() -> None:
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 4))
    balance, report = partition.balance_by("parameters", list(model), 2)
    params = [4 * 64 + 64, 0, 64 * 64 + 64, 64 * 4 + 4]
    best = min(max(stage_sums(params, b)) for b in compositions(4, 2))
    assert max(stage_sums(params, balance)) == best
    assert report.stage_parameters == stage_sums(params, balance)
    assert report.stage_ms is None
    text = str(report)
    assert 'method "parameters"' in text and "% of largest" in text and "100.0" in text

    balance, report = partition.balance_by("uniform", list(model), 3)
    assert balance == [1, 1, 2] and report.stage_layers == [range(0, 1), range(1, 2), range(2, 4)]

    balance, report = partition.balance_by("time", list(model), 2, torch.randn(8, 4))
    assert sum(balance) == 4 and len(report.stage_ms) == 2
    lines = str(report).splitlines()
    assert lines[1].split() == ["stage", "layers", "params", "ms", "%", "of", "slowest"]
    assert lines[2].split()[:2] == ["0", f"0-{balance[0] - 1}" if balance[0] > 1 else "0"]
    assert "100.0" in str(report)

    with pytest.raises(PartitionError, match="needs a sample_input"):
        partition.balance_by("time", list(model), 2)
    with pytest.raises(PartitionError, match="unknown balance method 'memory' .*uniform, parameters, time"):
        partition.balance_by("memory", list(model), 2)
    with pytest.raises(PartitionError, match="pipeline_stages 5 > 4 layers"):
        partition.balance_by("uniform", list(model), 5)

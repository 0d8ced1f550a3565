"""Tests of hybridpipe.pipeline.microbatch: split, merge, sizes and loss weights."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn

from hybridpipe.errors import HybridPipeError
from hybridpipe.pipeline import microbatch

Pair = namedtuple("Pair", ["inputs", "mask"])


def test_sizes_follow_tensor_split() -> None:
    assert microbatch.micro_batch_sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch.micro_batch_sizes(8, 8) == [1] * 8
    for batch, chunks in [(7, 3), (100, 16), (5, 1)]:
        expected = [len(c) for c in torch.tensor_split(torch.arange(batch), chunks)]
        assert microbatch.micro_batch_sizes(batch, chunks) == expected
    with pytest.raises(HybridPipeError, match=r"batch size 3 is smaller than micro_batches 4 \(.*at least 4"):
        microbatch.micro_batch_sizes(3, 4)
    with pytest.raises(HybridPipeError, match="micro_batches must be >= 1"):
        microbatch.micro_batch_sizes(3, 0)


def test_split_merge_tensor_round_trip_uneven() -> None:
    batch = torch.randn(10, 3)
    chunks = microbatch.split(batch, 4)
    assert [len(c) for c in chunks] == [3, 3, 2, 2]
    assert chunks[0].data_ptr() == batch.data_ptr()
    assert torch.equal(microbatch.merge(chunks), batch)


def test_split_merge_nested_structures() -> None:
    batch = {
        "ids": torch.arange(12).reshape(6, 2),
        "extra": [torch.ones(6), (torch.zeros(6, 1, 1), "tag")],
        "pair": Pair(torch.randn(6, 4), torch.ones(6, dtype=torch.bool)),
        "scale": 0.5,
        "temperature": torch.tensor(2.0),
        "nothing": None,
    }
    chunks = microbatch.split(batch, 4)
    assert len(chunks) == 4
    assert [c["ids"].shape[0] for c in chunks] == [2, 2, 1, 1]
    assert isinstance(chunks[1]["extra"], list) and isinstance(chunks[1]["extra"][1], tuple)
    assert isinstance(chunks[2]["pair"], Pair) and chunks[2]["pair"].mask.dtype == torch.bool
    assert all(c["scale"] == 0.5 and c["nothing"] is None and c["extra"][1][1] == "tag" for c in chunks)
    assert all(c["temperature"] is batch["temperature"] for c in chunks)
    merged = microbatch.merge(chunks)
    assert torch.equal(merged["ids"], batch["ids"])
    assert torch.equal(merged["extra"][0], batch["extra"][0])
    assert torch.equal(merged["extra"][1][0], batch["extra"][1][0])
    assert merged["extra"][1][1] == "tag" and merged["scale"] == 0.5 and merged["nothing"] is None
    assert isinstance(merged["pair"], Pair) and torch.equal(merged["pair"].inputs, batch["pair"].inputs)
    assert torch.equal(merged["temperature"], batch["temperature"])


def test_split_errors() -> None:
    with pytest.raises(HybridPipeError, match=r"disagree on dim 0 \(batch\[0\] 8, batch\[1\]\['mask'\] 6\)"):
        microbatch.split((torch.zeros(8), {"mask": torch.zeros(6)}), 2)
    with pytest.raises(HybridPipeError, match="batch size 3 is smaller than micro_batches 4"):
        microbatch.split(torch.zeros(3, 2), 4)
    with pytest.raises(HybridPipeError, match="no tensor with a batch dimension"):
        microbatch.split({"a": 1}, 2)


def test_merge_errors() -> None:
    with pytest.raises(HybridPipeError, match="at least one"):
        microbatch.merge([])
    with pytest.raises(HybridPipeError, match=r"differ in keys at batch"):
        microbatch.merge([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    with pytest.raises(HybridPipeError, match=r"differs between micro-batches"):
        microbatch.merge([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(HybridPipeError, match=r"differ in structure at batch\[1\]"):
        microbatch.merge([(torch.ones(1), torch.ones(2)), (torch.ones(1), 3)])


def test_loss_weights_reproduce_full_batch_mean() -> None:
    torch.manual_seed(0)
    values = torch.randn(11, dtype=torch.float64)
    chunks = microbatch.split(values, 4)
    weights = microbatch.loss_weights([len(c) for c in chunks])
    assert sum(weights) == pytest.approx(1.0)
    weighted = sum(w * c.mean() for w, c in zip(weights, chunks))
    assert weighted.item() == pytest.approx(values.mean().item(), rel=1e-12)
    with pytest.raises(HybridPipeError, match="positive total"):
        microbatch.loss_weights([0, 0])


def test_weighted_micro_batch_gradients_equal_full_batch() -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    inputs, targets = torch.randn(13, 5, dtype=torch.float64), torch.randint(0, 3, (13,))
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(model(inputs), targets).backward()
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    chunks = microbatch.split((inputs, targets), 4)
    weights = microbatch.loss_weights([len(x) for x, _ in chunks])
    for weight, (x, y) in zip(weights, chunks):
        (weight * loss_fn(model(x), y)).backward()
    for accumulated, expected in zip(model.parameters(), full):
        torch.testing.assert_close(accumulated.grad, expected, rtol=1e-12, atol=1e-12)


def test_map_and_iter_tensors() -> None:
    value = {"a": (torch.ones(2), 3), "b": [torch.zeros(1)]}
    assert [t.shape[0] for t in microbatch.iter_tensors(value)] == [2, 1]
    doubled = microbatch.map_tensors(value, lambda t: t + 1)
    assert doubled["a"][1] == 3 and torch.equal(doubled["b"][0], torch.ones(1))

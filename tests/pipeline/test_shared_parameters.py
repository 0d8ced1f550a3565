"""Parameters shared by layers on different pipeline stages (tied weights) are refused; no MPI."""

from __future__ import annotations

import ast
import copy
import doctest
import re

import pytest
import torch
from torch import nn

from hybridpipe.errors import PartitionError
from hybridpipe.pipeline import partition
from hybridpipe.pipeline.partition import check_shared_parameters, find_shared_parameters


def tied_language_model(vocab: int = 11, dim: int = 8) -> list[nn.Module]:
    """Embedding, two middle layers, and an output head that reuses the embedding's weight."""
    embedding, head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
    head.weight = embedding.weight
    return [embedding, nn.Linear(dim, dim), nn.Tanh(), head]


class Head(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(embedding.embedding_dim)
        self.out = nn.Linear(embedding.embedding_dim, embedding.num_embeddings)
        self.out.weight = embedding.weight


def test_tied_across_stages_names_each_layer_stage_and_the_fix() -> None:
    layers = tied_language_model()
    with pytest.raises(PartitionError) as caught:
        check_shared_parameters(layers, [2, 2])
    message = str(caught.value)
    assert message.startswith("a parameter is shared by layers on different pipeline stages")
    places = "layer 0 (Embedding).weight on stage 0, layer 3 (Linear).weight on stage 1"
    assert f"({places}; balance [2, 2])" in message
    # emb and head are the two ends: only one stage can hold both
    assert "keep layers 0-3 on one stage (no balance of 2 stages can; only pipeline_stages=1 can)" in message
    assert "copy.deepcopy" in message and "nn.Parameter(weight.detach().clone())" in message
    assert message.endswith("weight tying across pipeline stages is not supported yet")


def test_nested_names_and_a_whole_module_reused_on_another_stage() -> None:
    embedding = nn.Embedding(11, 8)
    layers = [embedding, nn.Tanh(), Head(embedding)]
    [shared] = find_shared_parameters(layers, [1, 2])
    assert str(shared) == "layer 0 (Embedding).weight on stage 0, layer 2 (Head).out.weight on stage 1"
    assert shared.layers == (0, 2)

    block = nn.Linear(4, 4)  # the same module object at positions 0 and 2
    found = find_shared_parameters(nn.Sequential(block, nn.Tanh(), block, nn.Tanh()), [2, 2])
    assert [str(s) for s in found] == [
        "layer 0 (Linear).weight on stage 0, layer 2 (Linear).weight on stage 1",
        "layer 0 (Linear).bias on stage 0, layer 2 (Linear).bias on stage 1",
    ]
    with pytest.raises(PartitionError, match=r"^2 parameters are shared by layers on different pipeline"):
        check_shared_parameters(nn.Sequential(block, nn.Tanh(), block, nn.Tanh()), [2, 2])


def test_three_stages_each_named() -> None:
    first, middle, last = (nn.Linear(4, 4, bias=False) for _ in range(3))
    middle.weight = last.weight = first.weight
    [shared] = find_shared_parameters([first, middle, last], [1, 1, 1])
    assert [stage for _, _, stage in shared.places] == [0, 1, 2]


def test_tied_within_one_stage_is_fine() -> None:
    layers = tied_language_model()
    assert find_shared_parameters(layers, [4]) == []  # P = 1
    check_shared_parameters(layers, [4])
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    layers = [first, nn.Tanh(), second, nn.Tanh(), nn.Linear(4, 2)]
    check_shared_parameters(layers, [3, 2])
    check_shared_parameters(layers, [3, 1, 1])
    with pytest.raises(PartitionError,
                       match=r"layer 0 \(Linear\).weight on stage 0, layer 2 \(Linear\).weight on stage 1"):
        check_shared_parameters(layers, [2, 3])


def test_untied_copies_are_fine() -> None:
    embedding, middle, tanh, head = tied_language_model()
    head.weight = nn.Parameter(embedding.weight.detach().clone())  # untied: its own Parameter
    check_shared_parameters([embedding, middle, tanh, head], [2, 2])
    untied = [copy.deepcopy(layer) for layer in tied_language_model()]  # one copy per layer: no tie left
    check_shared_parameters(untied, [2, 2])
    check_shared_parameters(copy.deepcopy(tied_language_model()), [4])  # one deepcopy keeps the tie
    assert find_shared_parameters([nn.Linear(3, 3) for _ in range(4)], [1, 1, 1, 1]) == []


def test_buffers_are_not_checked() -> None:
    first, second = nn.BatchNorm1d(4), nn.BatchNorm1d(4, affine=False)
    second.running_mean = first.running_mean
    check_shared_parameters([first, second], [1, 1])


def test_suggested_balance_keeps_the_shared_layers_together() -> None:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    layers = [nn.Tanh(), first, nn.Tanh(), second, nn.Tanh(), nn.Tanh()]
    with pytest.raises(PartitionError) as caught:
        check_shared_parameters(layers, [2, 2, 2])
    found = re.search(r"keep layers 1-3 on one stage with balance= \(e\.g\. balance=(\[[0-9, ]+\])\)",
                      str(caught.value))
    assert found, str(caught.value)
    suggestion = ast.literal_eval(found.group(1))
    assert len(suggestion) == 3 and sum(suggestion) == 6
    assert suggestion == [1, 3, 2]  # the fewest layers on the fullest stage
    check_shared_parameters(layers, suggestion)  # and it works


def test_no_balance_fits_with_too_many_stages_says_how_many_can() -> None:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    layers = [nn.Tanh(), first, nn.Tanh(), second, nn.Tanh()]  # layers 1-3 together: 3 pieces
    with pytest.raises(PartitionError, match=r"keep layers 1-3 on one stage \(no balance of 4 stages can; "
                                             r"at most pipeline_stages=3 can\)"):
        check_shared_parameters(layers, [1, 1, 1, 2])


def test_many_shared_parameters_are_listed_up_to_four() -> None:
    layers = [nn.Linear(2, 2, bias=False) for _ in range(6)]
    tied = [nn.Linear(2, 2, bias=False) for _ in range(6)]
    for source, target in zip(layers, tied):
        target.weight = source.weight
    with pytest.raises(PartitionError) as caught:
        check_shared_parameters(layers + tied, [6, 6])
    message = str(caught.value)
    assert message.startswith("6 parameters are shared")
    assert "; and 2 more; balance [6, 6])" in message
    assert "keep layers 0-11 on one stage" in message


def test_layer_count_and_balance_must_agree() -> None:
    with pytest.raises(PartitionError, match=r"balance \[2, 2\] sums to 4 but there are 3 layers"):
        find_shared_parameters([nn.Linear(2, 2)] * 3, [2, 2])
    with pytest.raises(PartitionError, match=r"balance \[1, 1\] sums to 2 but there are 3 layers"):
        find_shared_parameters([nn.Linear(2, 2), nn.Tanh(), nn.Tanh()], [1, 1])


def test_layers_may_be_a_generator_of_meta_layers() -> None:
    embedding = nn.Embedding(11, 8)

    def layers():
        yield embedding
        with torch.device("meta"):
            yield nn.Linear(8, 8)
            yield Head(embedding)  # meta LayerNorm, but the real embedding weight

    [shared] = find_shared_parameters(layers(), [1, 2])
    assert shared.layers == (0, 2)


def test_docstring_examples() -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for name in ("find_shared_parameters", "check_shared_parameters"):
        for test in finder.find(getattr(partition, name), name, globs={**vars(partition)}):
            runner.run(test)
    assert runner.summarize(verbose=False).failed == 0

"""Tied weights, found without MPI: parameters shared by layers on different pipeline stages, hp.TiedLayerSpec
keys and their checks, and the error an asynchronous schedule gives for them."""

from __future__ import annotations

import ast
import copy
import doctest
import re

import pytest
import torch
from torch import nn

import hybridpipe as hp
from hybridpipe.errors import HybridPipeError, PartitionError
from hybridpipe.pipeline import partition
from hybridpipe.pipeline.partition import find_shared_parameters, shared_parameters_error
from hybridpipe.pipeline.tied import find_ties, share_within_rank


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


def refusal(layers, balance, schedule="pipedream") -> str:
    shared = find_shared_parameters(layers, balance)
    assert shared, "the layers should share a parameter across stages"
    return str(shared_parameters_error(shared, balance, schedule))


def test_found_across_stages_with_each_layer_stage_and_name() -> None:
    [shared] = find_shared_parameters(tied_language_model(), [2, 2])
    assert str(shared) == "layer 0 (Embedding).weight on stage 0, layer 3 (Linear).weight on stage 1"
    assert shared.layers == (0, 3) and shared.names == ("weight", "weight")


def test_asynchronous_refusal_names_each_layer_stage_and_the_fixes() -> None:
    message = refusal(tied_language_model(), [2, 2], "2bw")
    assert message.startswith("a parameter is shared by layers on different pipeline stages")
    places = "layer 0 (Embedding).weight on stage 0, layer 3 (Linear).weight on stage 1"
    assert f"({places}; balance [2, 2])" in message
    assert "schedule '2bw' updates each stage on its own" in message
    assert "use a synchronous schedule ('1f1b', 'gpipe', 'interleaved-1f1b' or 'zb-h1'), which ties them" in message
    # emb and head are the two ends: only one stage can hold both
    assert "keep layers 0-3 on one stage (no balance of 2 stages can; only pipeline_stages=1 can)" in message
    assert "copy.deepcopy" in message and "nn.Parameter(weight.detach().clone())" in message


def test_nested_names_and_a_whole_module_reused_on_another_stage() -> None:
    embedding = nn.Embedding(11, 8)
    layers = [embedding, nn.Tanh(), Head(embedding)]
    [shared] = find_shared_parameters(layers, [1, 2])
    assert str(shared) == "layer 0 (Embedding).weight on stage 0, layer 2 (Head).out.weight on stage 1"
    assert shared.layers == (0, 2) and shared.names == ("weight", "out.weight")

    block = nn.Linear(4, 4)  # the same module object at positions 0 and 2
    found = find_shared_parameters(nn.Sequential(block, nn.Tanh(), block, nn.Tanh()), [2, 2])
    assert [str(s) for s in found] == [
        "layer 0 (Linear).weight on stage 0, layer 2 (Linear).weight on stage 1",
        "layer 0 (Linear).bias on stage 0, layer 2 (Linear).bias on stage 1",
    ]
    assert refusal(nn.Sequential(block, nn.Tanh(), block, nn.Tanh()), [2, 2]).startswith(
        "2 parameters are shared by layers on different pipeline")


def test_three_stages_each_named() -> None:
    first, middle, last = (nn.Linear(4, 4, bias=False) for _ in range(3))
    middle.weight = last.weight = first.weight
    [shared] = find_shared_parameters([first, middle, last], [1, 1, 1])
    assert [stage for _, _, stage in shared.places] == [0, 1, 2]


def test_shared_within_one_stage_is_not_reported() -> None:
    layers = tied_language_model()
    assert find_shared_parameters(layers, [4]) == []  # P = 1
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    layers = [first, nn.Tanh(), second, nn.Tanh(), nn.Linear(4, 2)]
    assert find_shared_parameters(layers, [3, 2]) == []
    assert find_shared_parameters(layers, [3, 1, 1]) == []
    [shared] = find_shared_parameters(layers, [2, 3])
    assert str(shared) == "layer 0 (Linear).weight on stage 0, layer 2 (Linear).weight on stage 1"


def test_untied_copies_are_not_shared() -> None:
    embedding, middle, tanh, head = tied_language_model()
    head.weight = nn.Parameter(embedding.weight.detach().clone())  # untied: its own Parameter
    assert find_shared_parameters([embedding, middle, tanh, head], [2, 2]) == []
    untied = [copy.deepcopy(layer) for layer in tied_language_model()]  # one copy per layer: no tie left
    assert find_shared_parameters(untied, [2, 2]) == []
    assert len(find_shared_parameters(copy.deepcopy(tied_language_model()), [2, 2])) == 1  # one deepcopy keeps it
    assert find_shared_parameters([nn.Linear(3, 3) for _ in range(4)], [1, 1, 1, 1]) == []


def test_buffers_are_not_checked() -> None:
    first, second = nn.BatchNorm1d(4), nn.BatchNorm1d(4, affine=False)
    second.running_mean = first.running_mean
    assert find_shared_parameters([first, second], [1, 1]) == []


def test_suggested_balance_keeps_the_shared_layers_together() -> None:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    layers = [nn.Tanh(), first, nn.Tanh(), second, nn.Tanh(), nn.Tanh()]
    found = re.search(r"keep layers 1-3 on one stage with balance= \(e\.g\. balance=(\[[0-9, ]+\])\)",
                      refusal(layers, [2, 2, 2]))
    assert found
    suggestion = ast.literal_eval(found.group(1))
    assert suggestion == [1, 3, 2]  # the fewest layers on the fullest stage
    assert find_shared_parameters(layers, suggestion) == []  # and it works


def test_no_balance_fits_with_too_many_stages_says_how_many_can() -> None:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    layers = [nn.Tanh(), first, nn.Tanh(), second, nn.Tanh()]  # layers 1-3 together: 3 pieces
    assert ("keep layers 1-3 on one stage (no balance of 4 stages can; at most pipeline_stages=3 can)"
            in refusal(layers, [1, 1, 1, 2]))


def test_many_shared_parameters_are_listed_up_to_four() -> None:
    layers = [nn.Linear(2, 2, bias=False) for _ in range(6)]
    tied = [nn.Linear(2, 2, bias=False) for _ in range(6)]
    for source, target in zip(layers, tied):
        target.weight = source.weight
    message = refusal(layers + tied, [6, 6])
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


# ------------------------------------------------------------------ ties: shared Parameters and TiedLayerSpec keys


def unembed(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def keyed_layers() -> list:
    return [hp.TiedLayerSpec("tokens", nn.Embedding, 11, 8), hp.LayerSpec(nn.Linear, 8, 8), hp.LayerSpec(nn.Tanh),
            hp.TiedLayerSpec("tokens", nn.Embedding, 11, 8, forward_fn=unembed)]


def test_ties_of_shared_parameters_map_chunks_to_ranks() -> None:
    [tie] = find_ties(tied_language_model(), [2, 2], 2)
    assert (tie.key, tie.places, tie.ranks, tie.across_ranks) == (None, ((0, "weight"), (3, "weight")), (0, 1), True)
    assert tie.names == ("layers.0.weight", "layers.3.weight")
    # interleaved: 4 chunks on 2 ranks; chunks 0 and 2 are both rank 0's, so nothing is tied across ranks
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    assert find_ties([first, nn.Tanh(), second, nn.Tanh()], [1, 1, 1, 1], 2) == []
    [tie] = find_ties([first, second, nn.Tanh(), nn.Tanh()], [1, 1, 1, 1], 2)  # chunks 0 and 1: ranks 0 and 1
    assert tie.ranks == (0, 1) and tie.chunks == (0, 1)


def test_tied_layer_spec_keys_are_ties_even_on_one_rank() -> None:
    [tie] = find_ties(keyed_layers(), [2, 2], 2)
    assert tie.key == "tokens" and tie.places == ((0, "weight"), (3, "weight")) and tie.ranks == (0, 1)
    assert str(tie) == "layer 0 (Embedding).weight on stage 0, layer 3 (Embedding).weight on stage 1"
    [tie] = find_ties(keyed_layers(), [4], 1)
    assert not tie.across_ranks
    built = nn.ModuleDict({str(i): spec.build() for i, spec in enumerate(keyed_layers())})
    assert built["0"].weight is not built["3"].weight
    share_within_rank([tie], built)
    assert built["0"].weight is built["3"].weight


def test_forward_fn_keeps_the_modules_parameter_names() -> None:
    head = keyed_layers()[-1].build()
    assert [name for name, _ in head.named_parameters()] == ["weight"]
    assert list(head.state_dict()) == ["weight"]
    x = torch.randn(2, 8)
    torch.testing.assert_close(head(x), x @ head.weight.t())
    head.weight = nn.Parameter(torch.zeros(11, 8))  # the wrapper and the module see one table
    assert head.tied_module.weight is head.weight
    assert "forward_fn=unembed" in repr(head) and "Embedding" in repr(head)
    assert repr(keyed_layers()[-1]) == ("TiedLayerSpec('tokens', Embedding, 11, 8, tied_weight_attr='weight', "
                                        "forward_fn=unembed)")


def test_tied_layer_spec_checks() -> None:
    with pytest.raises(TypeError, match=r"key must be a non-empty str"):
        hp.TiedLayerSpec(3, nn.Linear, 2, 2)
    with pytest.raises(TypeError, match=r"tied_weight_attr must be a parameter name"):
        hp.TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr=[])
    with pytest.raises(TypeError, match=r"forward_fn must be None or a callable"):
        hp.TiedLayerSpec("k", nn.Linear, 2, 2, forward_fn="x @ w")
    layers = [hp.TiedLayerSpec("k", nn.Linear, 4, 4, tied_weight_attr="kernel"), nn.Tanh()]
    with pytest.raises(HybridPipeError, match=r"TiedLayerSpec\('k', Linear\) at layer 0: the built module has no "
                                              r"parameter 'kernel' \(tied_weight_attr\); its parameters are "
                                              r"\['weight', 'bias'\]"):
        find_ties(layers, [1, 1], 2)
    layers = [hp.TiedLayerSpec("k", nn.Linear, 4, 4), nn.Tanh(), hp.TiedLayerSpec("k", nn.Linear, 4, 3)]
    with pytest.raises(HybridPipeError, match=r"key 'k' ties parameters of different shapes \(layer 0 \(Linear\)"
                                              r"\.weight: \(4, 4\), layer 2 \(Linear\)\.weight: \(3, 4\)\)"):
        find_ties(layers, [3], 1)  # checked on one stage too
    layers = [hp.TiedLayerSpec("k", nn.Linear, 4, 4, tied_weight_attr=["weight", "bias"]),
              hp.TiedLayerSpec("k", nn.Linear, 4, 4)]
    with pytest.raises(HybridPipeError, match=r"key 'k' ties different numbers of parameters"):
        find_ties(layers, [1, 1], 2)
    [weight, bias] = find_ties([hp.TiedLayerSpec("k", nn.Linear, 4, 4, tied_weight_attr=["weight", "bias"]),
                                hp.TiedLayerSpec("k", nn.Linear, 4, 4, tied_weight_attr=("weight", "bias"))], [1, 1], 2)
    assert weight.places == ((0, "weight"), (1, "weight")) and bias.places == ((0, "bias"), (1, "bias"))


def test_docstring_examples() -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for name in ("find_shared_parameters", "shared_parameters_error"):
        for test in finder.find(getattr(partition, name), name, globs={**vars(partition)}):
            runner.run(test)
    assert runner.summarize(verbose=False).failed == 0

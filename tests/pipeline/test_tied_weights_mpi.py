"""Tied weights under a real mpirun: a parameter shared by layers on different stages is refused on
every rank; shared within one stage, on one stage (P = 1), or untied, the model trains like one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridpipe as hp
from hybridpipe.errors import MismatchError, PartitionError
from training import train_pipeline

pytestmark = pytest.mark.mpi(ranks=2, timeout=180)

torch.set_num_threads(1)

VOCAB, DIM = 11, 8


def grid_fixture(stages: int):
    @pytest.fixture
    def fixture():
        grid = hp.init(pipeline_stages=stages)
        try:
            yield grid
        finally:
            hp.shutdown()

    return fixture


two_stages = grid_fixture(2)
one_stage = grid_fixture(1)  # 2 ranks: two replicas of a one-stage pipeline


def tied_language_model() -> nn.Sequential:
    """Embedding(V, d) ... Linear(d, V) whose weight IS the embedding's, as a one-process tied LM."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(DIM, DIM), nn.Tanh(), head)


def untied(model: nn.Sequential) -> nn.Sequential:
    """The same numbers, but the head gets its own Parameter."""
    model = copy.deepcopy(model)
    model[3].weight = nn.Parameter(model[0].weight.detach().clone())
    return model


class TiedHead(nn.Linear):
    """An output head built from a LayerSpec that reuses an embedding module's weight."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__(embedding.embedding_dim, embedding.num_embeddings, bias=False)
        self.weight = embedding.weight


def batches(steps: int = 3, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (batch,), generator=generator),
             torch.randint(0, VOCAB, (batch,), generator=generator)) for _ in range(steps)]


def train_reference(model: nn.Module, data, lr: float = 0.1) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for inputs, targets in data:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses



def assert_same_parameters(model: hp.PipelineModel, reference: nn.Module) -> None:
    expected = dict(reference.named_parameters(remove_duplicate=False))
    names = [name for name, _ in model.named_parameters()]
    assert names, "this stage should hold parameters"
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, expected[name.removeprefix("layers.")], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ refused on every rank


@pytest.mark.parametrize("balance", ["uniform", "parameters", [2, 2], [1, 3], "time"])
def test_tied_across_stages_is_refused_on_every_rank(two_stages, balance):
    sample = torch.randint(0, VOCAB, (4,)) if balance == "time" else None
    with pytest.raises(PartitionError) as caught:
        hp.PipelineModel(tied_language_model(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2,
                         balance=balance, sample_input=sample)
    message = str(caught.value)
    assert "a parameter is shared by layers on different pipeline stages" in message
    assert "layer 0 (Embedding).weight on stage 0, layer 3 (Linear).weight on stage 1; balance [" in message
    assert "only pipeline_stages=1 can" in message and "copy.deepcopy" in message
    assert "weight tying across pipeline stages is not supported yet" in message
    # no rank was left behind in a collective: the next collective call meets every rank
    from mpi4py import MPI

    assert MPI.COMM_WORLD.allgather(type(caught.value).__name__) == ["PartitionError"] * MPI.COMM_WORLD.size


def test_tied_head_built_from_a_layer_spec_is_refused(two_stages):
    embedding = nn.Embedding(VOCAB, DIM)
    layers = [embedding, hp.LayerSpec(nn.Linear, DIM, DIM), nn.Tanh(), hp.LayerSpec(TiedHead, embedding)]
    with pytest.raises(PartitionError, match=r"layer 0 \(Embedding\)\.weight on stage 0, layer 3 \(TiedHead\)"
                                             r"\.weight on stage 1; balance \[2, 2\]"):
        hp.PipelineModel(layers, loss_fn=nn.CrossEntropyLoss(), balance=[2, 2])


def test_ranks_given_different_models_raise_mismatch_not_hang(two_stages):
    model = tied_language_model() if two_stages.rank == 0 else untied(tied_language_model())
    with pytest.raises(MismatchError, match=r"layers_sharing_parameters_across_stages.*"
                                            r"rank 0: layers_sharing_parameters_across_stages=\(\(0, 3\),\); "
                                            r"rank 1: layers_sharing_parameters_across_stages=\(\)"):
        hp.PipelineModel(model, loss_fn=nn.CrossEntropyLoss(), balance=[2, 2])


# ------------------------------------------------------------------ what keeps working


def test_untied_copy_trains_across_stages_like_one_process(two_stages):
    data = batches()
    reference = untied(tied_language_model())
    expected = train_reference(reference, data)
    model = hp.PipelineModel(untied(tied_language_model()), loss_fn=nn.CrossEntropyLoss(), micro_batches=2,
                             balance=[2, 2])
    try:
        assert train_pipeline(model, data) == pytest.approx(expected, rel=1e-5)
        assert_same_parameters(model, reference)
    finally:
        model.close()


def test_tied_within_one_stage_trains_like_one_process(two_stages):
    torch.manual_seed(0)
    first, second = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
    second.weight = first.weight
    layers = nn.Sequential(nn.Embedding(VOCAB, DIM), first, nn.Tanh(), second, nn.Tanh(),
                           nn.Linear(DIM, VOCAB))
    reference = copy.deepcopy(layers)  # one deepcopy keeps the tie
    assert reference[1].weight is reference[3].weight
    data = batches()
    expected = train_reference(reference, data)
    model = hp.PipelineModel(layers, loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance=[4, 2])
    try:
        if model.stage == 0:
            assert model.layers["1"].weight is model.layers["3"].weight
        assert train_pipeline(model, data) == pytest.approx(expected, rel=1e-5)
        assert_same_parameters(model, reference)
    finally:
        model.close()


def test_tied_model_on_one_stage_trains_like_one_process(one_stage):
    data = batches()
    reference = tied_language_model()
    expected = train_reference(reference, data)
    model = hp.PipelineModel(tied_language_model(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2)
    try:
        assert model.layers["0"].weight is model.layers["3"].weight
        assert train_pipeline(model, data) == pytest.approx(expected, rel=1e-5)
        assert_same_parameters(model, reference)
    finally:
        model.close()

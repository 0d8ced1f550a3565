"""Features together, under a real mpirun on 4 ranks, each against one process on the same micro-batches
(float64):

* a weight tied across stages + ``hp.clip_grad_norm_`` (with and without ZeRO): the tied weight counts
  once in the global norm, and every clipped update equals one process's.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hp

pytestmark = pytest.mark.mpi(ranks=[4], timeout=240, shared=True)

torch.set_num_threads(1)
WORLD = MPI.COMM_WORLD
VOCAB, DIM, LENGTH = 16, 8, 3


def init(stages: int):
    hp.shutdown()
    return hp.init(pipeline_stages=stages)


@pytest.fixture
def grid_2x2():
    yield init(2)
    hp.shutdown()


def shard(batch, grid):
    rows = len(batch[0]) // grid.data_replicas
    return tuple(t[grid.replica * rows:(grid.replica + 1) * rows] for t in batch)


def assert_like(model: hp.PipelineModel, expected: dict[str, torch.Tensor], exact: bool = False, **tolerance) -> None:
    """This rank's parameters equal ``expected`` (one process's, keyed without ``layers.``)."""
    for name, parameter in model.named_parameters():
        wanted = expected[name.removeprefix("layers.")]
        if exact:
            assert torch.equal(parameter, wanted), f"{name}: differs by {(parameter - wanted).abs().max().item()}"
        else:
            torch.testing.assert_close(parameter, wanted, msg=lambda text: f"{name}: {text}", **tolerance)


# ------------------------------------------------------------------ tied weights + clipping


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def tied_model() -> nn.Sequential:
    """Embedding, two Linear+Tanh blocks, and a head whose weight IS the embedding's (float64): with
    balance [2, 3] the embedding is on stage 0, the head on stage 1."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)
    head.weight = embedding.weight
    blocks = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2)]
    return nn.Sequential(embedding, *blocks, nn.LayerNorm(DIM), head).double()


def token_batches(steps: int):
    generator = torch.Generator().manual_seed(5)
    return [(torch.randint(0, VOCAB, (8, LENGTH), generator=generator),
             torch.randint(0, VOCAB, (8, LENGTH), generator=generator)) for _ in range(steps)]


@pytest.mark.parametrize("zero", [0, 1])
def test_a_tied_weight_counts_once_in_the_clipped_norm(grid_2x2, zero):
    """Both stages hold the tied embedding/head; the norm counts it once, as one process does (before the
    fix: 6.6375 vs 6.4894 at the first step), and every clipped SGD update equals one process's."""
    grid, max_norm, steps = grid_2x2, 0.25, 3
    batches = token_batches(steps)
    reference = tied_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    model = hp.PipelineModel(tied_model(), loss_fn=sequence_loss, micro_batches=2, balance=[2, 3])
    assert model.tied_parameter_names == [("layers.0.weight", "layers.4.weight")]
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                        named_parameters=model.named_parameters(), zero=zero)
    try:
        for batch in batches:
            reference_optimizer.zero_grad()
            sequence_loss(reference(batch[0]), batch[1]).backward()
            expected_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm))
            reference_optimizer.step()
            optimizer.zero_grad()
            model.train_step(*shard(batch, grid))
            optimizer.synchronize()
            norm = hp.clip_grad_norm_(model, max_norm)
            print(f"zero={zero}: norm {norm:.6f}, one process {expected_norm:.6f}")
            assert expected_norm > max_norm  # the clipping bites
            assert norm == pytest.approx(expected_norm, rel=1e-12)
            with optimizer.skip_synchronize():
                optimizer.step()
        assert_like(model, dict(reference.named_parameters(remove_duplicate=False)), rtol=1e-10, atol=1e-12)
        infinity = hp.clip_grad_norm_(model, 1e9, norm_type=float("inf"))
        assert infinity == pytest.approx(max(p.grad.abs().max().item() for p in reference.parameters()), rel=1e-12)
    finally:
        model.close()

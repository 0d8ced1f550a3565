"""Features together, under a real mpirun on 4 ranks, each against one process on the same micro-batches
(float64) or against an uninterrupted run:

* a weight tied across stages + ``hp.clip_grad_norm_`` (with and without ZeRO): the tied weight counts
  once in the global norm, and every clipped update equals one process's;
* ``precision="fp16"`` + checkpoints: the loss scaler's state is saved and restored (on the same grid and
  on another), so a resumed run trains as the uninterrupted one; a checkpoint without it still loads;
* ``hp.elastic.TorchState`` + ``@hp.elastic.run`` around a 2 × 2 PipelineModel: the state syncs within
  each stage's replicas, a roll back restores it, and training equals one process.

Checks run in ranks_agree blocks after the steps they check, so a check failing on one rank fails every rank
there instead of leaving the others in the next step's collectives.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hp
from agree import ranks_agree

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
    try:
        with ranks_agree(what="the tie"):
            assert model.tied_parameter_names == [("layers.0.weight", "layers.4.weight")]
        optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                            named_parameters=model.named_parameters(), zero=zero)
        for step, batch in enumerate(batches):
            reference_optimizer.zero_grad()
            sequence_loss(reference(batch[0]), batch[1]).backward()
            expected_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm))
            reference_optimizer.step()
            optimizer.zero_grad()
            with ranks_agree(what=f"step {step}"):
                model.train_step(*shard(batch, grid))
                optimizer.synchronize()
                norm = hp.clip_grad_norm_(model, max_norm)
                print(f"zero={zero}: norm {norm:.6f}, one process {expected_norm:.6f}")
                assert expected_norm > max_norm  # the clipping bites
                assert norm == pytest.approx(expected_norm, rel=1e-12)
            with optimizer.skip_synchronize():
                optimizer.step()
        with ranks_agree(what="after the steps"):
            infinity = hp.clip_grad_norm_(model, 1e9, norm_type=float("inf"))
            assert_like(model, dict(reference.named_parameters(remove_duplicate=False)), rtol=1e-10, atol=1e-12)
            assert infinity == pytest.approx(max(p.grad.abs().max().item() for p in reference.parameters()),
                                             rel=1e-12)
    finally:
        model.close()


# ------------------------------------------------------------------ fp16 + checkpoints


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12),
                         nn.Linear(12, 3))


BALANCE = {2: [3, 3], 4: [2, 2, 1, 1]}  # every stage holds parameters


def vector_batches(steps: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(9)
    return [(torch.randn(8, 6, generator=generator, dtype=dtype), torch.randint(0, 3, (8,), generator=generator))
            for _ in range(steps)]


def fp16_run(stages: int):
    """A fp16 pipeline whose scaler grows after 3 good steps, and an SGD DistributedOptimizer; the last
    stage's gradients turn inf while ``poison["on"]`` (as an overflow would)."""
    grid = init(stages)
    model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance=BALANCE[stages],
                             precision="fp16")
    model.scaler.growth_interval = 3
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters())
    poison = {"on": False}
    if model.is_last_stage:
        last = next(p for n, p in model.named_parameters() if n.startswith("layers.5."))
        last.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    return grid, model, optimizer, poison


def fp16_steps(grid, model, optimizer, poison, batches, poisoned=()):
    for index, batch in batches:
        poison["on"] = index in poisoned
        optimizer.zero_grad()
        model.train_step(*shard(batch, grid))
        model.scaler.step(optimizer)
        model.scaler.update()


def scaler_state(model) -> dict:
    scaler = model.scaler
    return {"scale": scaler.get_scale(), "growth_tracker": scaler.state_dict()["growth_tracker"],
            "skipped_steps": scaler.skipped_steps}


def test_fp16_resumes_with_the_loss_scalers_state(tmp_path_factory):
    """Six steps, step 1 overflowing (scale halved, then grown again after 3 good steps), equal whether
    run through or saved after step 3 on 2 × 2 and resumed on 2 × 2 (bit for bit) or on 4 × 1 (to float
    tolerance). Before the fix the resumed scaler restarted at 65536 with no growth progress."""
    directory = Path(WORLD.bcast(str(tmp_path_factory.mktemp("fp16")) if WORLD.rank == 0 else None))
    batches = list(enumerate(vector_batches(6)))
    grid, model, optimizer, poison = fp16_run(2)
    try:
        with ranks_agree(what="run through"):
            fp16_steps(grid, model, optimizer, poison, batches, poisoned={1})
            expected = {name.removeprefix("layers."): p.detach().clone() for name, p in model.named_parameters()}
            expected = {k: v for held in hp.allgather_object(expected, group="pipe") for k, v in held.items()}
            through = scaler_state(model)
            assert (through["scale"], through["skipped_steps"]) == (2.0 ** 16, 1)  # halved at 1, grown after 2-4
    finally:
        model.close()

    grid, model, optimizer, poison = fp16_run(2)
    try:
        with ranks_agree(what="before the save"):
            fp16_steps(grid, model, optimizer, poison, batches[:3], poisoned={1})
            saved = scaler_state(model)
            assert (saved["scale"], saved["growth_tracker"], saved["skipped_steps"]) == (2.0 ** 15, 1, 1)
        hp.save_checkpoint(directory, model, optimizer, step=3)
    finally:
        model.close()
    for stages, exact in ((2, True), (4, False)):
        grid, model, optimizer, poison = fp16_run(stages)
        try:
            with ranks_agree(what=f"{stages} stages: a fresh scaler"):
                assert model.scaler.get_scale() == 2.0 ** 16
            with ranks_agree(what=f"{stages} stages: loaded"):
                hp.load_checkpoint(directory, model, optimizer)
                restored = scaler_state(model)
                assert restored == saved, f"the scaler was not restored ({restored} here, {saved} saved)"
            with ranks_agree(what=f"{stages} stages: trained on"):
                fp16_steps(grid, model, optimizer, poison, batches[3:])
                assert scaler_state(model) == through
                assert_like(model, expected, exact=exact, rtol=1e-3, atol=1e-5)  # 4 × 1: fp16 rounds other sums
        finally:
            model.close()

    # a checkpoint without scaler state (saved in fp32) loads into a fp16 model: the scaler is left alone
    init(2)
    plain = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform")
    hp.save_checkpoint(directory / "fp32", plain)
    plain.close()
    grid, model, optimizer, poison = fp16_run(2)
    try:
        with ranks_agree(what="a checkpoint without scaler state"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                hp.load_checkpoint(directory / "fp32", model)
            assert model.scaler.get_scale() == 2.0 ** 16
            if WORLD.rank == 0:
                assert any("holds no loss-scaler state" in str(w.message) for w in caught), [
                    str(w.message) for w in caught]
    finally:
        model.close()
        hp.shutdown()


# ------------------------------------------------------------------ elastic around a pipeline


def test_elastic_trains_a_pipeline_like_one_process(grid_2x2):
    """2 stages × 2 replicas under @hp.elastic.run: replica 1 starts with other weights (the first sync
    makes them replica 0's, stage by stage; before the fix it raised MismatchError over the world), a
    failure at step 2 rolls every rank back to the commit after step 1, and after 4 steps the model equals
    one process's."""
    grid, steps = grid_2x2, 4
    batches = vector_batches(steps, dtype=torch.float64)
    reference = mlp().double()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for inputs, targets in batches:
        reference_optimizer.zero_grad()
        nn.functional.cross_entropy(reference(inputs), targets).backward()
        reference_optimizer.step()

    model = hp.PipelineModel(mlp().double(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform")
    optimizer = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05),
                                        named_parameters=model.named_parameters())
    if grid.replica == 1:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
    state = hp.elastic.TorchState(model, optimizer, step=0)
    starts = []

    @hp.elastic.run
    def train(state):
        starts.append(state.step)
        while state.step < steps:
            optimizer.zero_grad()
            model.train_step(*shard(batches[state.step], grid))
            optimizer.step()
            if state.step == 2 and len(starts) == 1:
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.mul_(3.0)  # as if the failed step had half-applied something
                raise hp.HorovodInternalError("a collective failed (injected at step 2)")
            state.step += 1
            state.commit()
        return state.step

    try:
        with ranks_agree():
            trained = train(state)
            # the sync really is per stage: one stage's state, broadcast within its replicas only
            mine = {name: p.detach().clone() for name, p in model.named_parameters()}
            replicas = hp.allgather_object(mine, group="data")
            assert trained == steps
            assert starts == [0, 2]
            assert_like(model, dict(reference.named_parameters()), rtol=1e-9, atol=1e-12)
            for other in replicas[1:]:
                assert other.keys() == mine.keys() and all(torch.equal(other[k], replicas[0][k]) for k in mine)
    finally:
        model.close()

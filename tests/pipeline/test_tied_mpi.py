"""Tied weights across pipeline stages under a real mpirun: a GPT-like model whose output head IS its embedding
(a shared nn.Parameter, or hp.TiedLayerSpec) trains like one process on grids 2 × 1, 1 × 2, 4 × 1 and 2 × 2
(stages × replicas), every copy of the tied weight stays bit-identical, and asynchronous schedules refuse.
Checks run in ranks_agree blocks after the steps and collectives they check, so a check failing on one rank
fails every rank there instead of leaving the others in the next step."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.errors import MismatchError, PartitionError

pytestmark = pytest.mark.mpi(ranks=[2, 4], timeout=240, shared=True)

torch.set_num_threads(1)
WORLD = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)
GRIDS = {2: [1, 2], 4: [4, 2]}.get(WORLD, [WORLD])  # pipeline stages; the rest are replicas
VOCAB, DIM, LENGTH, STEPS = 32, 16, 4, 3


@pytest.fixture(scope="module", params=GRIDS, ids=lambda p: f"P{p}")
def grid(request):
    the_grid = hp.init(pipeline_stages=request.param)
    yield the_grid
    hp.shutdown()


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def block() -> nn.Module:
    # every layer holds parameters, so that every rank builds an optimizer (their names count them)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())


def tied_gpt() -> nn.Sequential:
    """Token embedding, six Linear+Tanh blocks, LayerNorm, and a head whose weight IS the embedding's."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)
    nn.init.normal_(embedding.weight, std=0.3)
    head.weight = embedding.weight
    return nn.Sequential(embedding, *[block() for _ in range(6)], nn.LayerNorm(DIM), head)


def unembed(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def spec_layers() -> list[hp.LayerSpec]:
    """The same architecture from specs: the head is the embedding module used through forward_fn."""
    blocks = [hp.LayerSpec(block) for _ in range(6)]
    return [hp.TiedLayerSpec("tokens", nn.Embedding, VOCAB, DIM), *blocks, hp.LayerSpec(nn.LayerNorm, DIM),
            hp.TiedLayerSpec("tokens", nn.Embedding, VOCAB, DIM, forward_fn=unembed)]


def spec_reference(seed: int) -> nn.Sequential:
    """One process: layer i built under seed + i (as seed_layers does), the head sharing layer 0's weight."""
    built = []
    for index, spec in enumerate(spec_layers()):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + index)
            built.append(spec.build())
    built[-1].weight = built[0].weight
    return nn.Sequential(*built)


def data(grid, steps: int = STEPS, per_replica: int = 8, seed: int = 5):
    """Per step: (this replica's shard, the global batch = every replica's shard in order)."""
    out = []
    for step in range(steps):
        shards = []
        for replica in range(grid.data_replicas):
            generator = torch.Generator().manual_seed(seed + 100 * step + replica)
            shards.append((torch.randint(0, VOCAB, (per_replica, LENGTH), generator=generator),
                           torch.randint(0, VOCAB, (per_replica, LENGTH), generator=generator)))
        whole = tuple(torch.cat([shard[i] for shard in shards]) for i in range(2))
        out.append((shards[grid.replica], whole))
    return out


def adamw(parameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=0.05, weight_decay=0.1)


def assert_like_reference(model: hp.PipelineModel, reference: nn.Module) -> None:
    """Parameters equal to one process's to float tolerance: AdamW at lr 0.05 turns a last-bit difference of a
    gradient summed in another order (micro-batches, two passes) into up to a few 1e-6 after three steps."""
    expected = dict(reference.named_parameters(remove_duplicate=False))
    own = {f"layers.{i}." for i in model.layers_of_stage(model.stage)}
    assert sorted(name for name, _ in model.named_parameters(remove_duplicate=False)) == sorted(
        f"layers.{name}" for name in expected if any(f"layers.{name}".startswith(prefix) for prefix in own))
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, expected[name.removeprefix("layers.")], rtol=1e-5, atol=1e-5,
                                   msg=lambda text: f"{name}: {text}")


def assert_copies_bit_identical(model: hp.PipelineModel) -> int:
    """Every copy of every tied weight, on every rank of the grid, holds the same bits; returns how many
    copies of the first tie the grid holds."""
    own = dict(model.named_parameters(remove_duplicate=False))
    mine = {name: own[name].detach().clone() for tie in model.tied_parameter_names for name in tie if name in own}
    everyone = hp.allgather_object(mine, group="world")
    with ranks_agree(what="tied copies"):
        for tie in model.tied_parameter_names:
            copies = [(rank, name, held[name]) for rank, held in enumerate(everyone) for name in tie if name in held]
            for rank, name, tensor in copies[1:]:
                assert torch.equal(tensor, copies[0][2]), (
                    f"{name} on rank {rank} differs from {copies[0][1]} on rank {copies[0][0]} by "
                    f"{(tensor - copies[0][2]).abs().max().item()}")
    first = model.tied_parameter_names[0]
    return sum(1 for held in everyone for name in first if name in held)


def train(model: hp.PipelineModel, reference: nn.Module, batches, passes: int = 1) -> list[tuple[float, float]]:
    """K steps of AdamW through hp.DistributedOptimizer, and the same in one process on the global batch;
    ``passes`` train_steps (on consecutive halves of this replica's shard) per optimizer step."""
    optimizer = hp.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                        backward_passes_per_step=passes)
    reference_optimizer = adamw(reference.parameters())
    losses = []
    for step, ((inputs, targets), (all_inputs, all_targets)) in enumerate(batches):
        optimizer.zero_grad()
        size = inputs.shape[0] // passes
        loss = 0.0
        for part in range(passes):
            rows = slice(part * size, (part + 1) * size)
            loss += model.train_step(inputs[rows], targets[rows]) / passes
        tied = {name for tie in model.tied_parameter_names for name in tie if len(tie) > 1}
        with ranks_agree(what=f"step {step}: tied gradients in flight"):
            if model._tied is not None:  # a tied gradient is reduced over the replicas in step(), after the tie's sum
                assert not tied & set(optimizer.in_flight())
        optimizer.step()
        reference_optimizer.zero_grad()
        expected = sequence_loss(reference(all_inputs), all_targets)
        expected.backward()
        reference_optimizer.step()
        losses.append((loss, expected.item()))
    return losses


# ------------------------------------------------------------------ equal to one process, copies bit-identical


@pytest.mark.parametrize("schedule,passes", [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 1), ("gpipe", 2)])
def test_tied_gpt_trains_like_one_process_and_copies_stay_identical(grid, schedule, passes):
    stages = grid.pipeline_stages
    if schedule in ("interleaved-1f1b", "zb-h1") and grid.data_replicas > 1:
        pytest.skip("kept short: these run on the grids without replicas (2 × 1, 4 × 1)")
    extra = {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {}
    model = hp.PipelineModel(tied_gpt(), loss_fn=sequence_loss, micro_batches=2 * stages, balance="uniform",
                             schedule=schedule, **extra)
    reference = tied_gpt()
    try:
        with ranks_agree(what="the tie"):
            if stages > 1:  # the embedding's rank (0) and the head's each hold a copy
                assert model.tied_parameter_names == [("layers.0.weight", f"layers.{len(reference) - 1}.weight")]
                assert bool(model._tied.parameters) == (grid.stage in {0, (model.chunks - 1) % stages})
            else:  # one rank holds both layers: they share the nn.Parameter, nothing to tie
                assert model._tied is None and model.layers["0"].weight is model.layers["8"].weight
        losses = train(model, reference, data(grid, per_replica=4 * stages * passes), passes)
        with ranks_agree(what="after training"):
            if grid.data_replicas == 1:
                assert [loss for loss, _ in losses] == pytest.approx([e for _, e in losses], rel=1e-5)
            assert_like_reference(model, reference)
        if stages > 1:
            copies = assert_copies_bit_identical(model)
            with ranks_agree(what="copies"):
                assert copies == 2 * grid.data_replicas
    finally:
        model.close()


def test_tied_layer_spec_trains_like_one_process(grid):
    stages = grid.pipeline_stages
    model = hp.PipelineModel(spec_layers(), loss_fn=sequence_loss, micro_batches=stages, balance="uniform",
                             seed_layers=7)
    reference = spec_reference(7)
    last = len(reference) - 1
    try:
        with ranks_agree(what="as built"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(7 + last)
                assert not torch.equal(spec_layers()[last].build().weight, reference[0].weight)  # they differ
            assert model.tied_parameter_names == [("layers.0.weight", f"layers.{last}.weight")]
            if stages == 1:  # both ends on one rank: one nn.Parameter object
                assert model.layers["0"].weight is model.layers[str(last)].weight
            if model.is_last_stage:  # the head's copy started as the embedding's (broadcast from stage 0)
                assert "forward_fn=unembed" in repr(model.layers[str(last)])
                torch.testing.assert_close(model.layers[str(last)].weight, reference[0].weight, rtol=0, atol=0)
        losses = train(model, reference, data(grid, per_replica=2 * stages))
        with ranks_agree(what="after training"):
            if grid.data_replicas == 1:
                assert [loss for loss, _ in losses] == pytest.approx([e for _, e in losses], rel=1e-5)
            assert_like_reference(model, reference)
        assert_copies_bit_identical(model)
    finally:
        model.close()


def test_tied_head_from_a_layer_spec_factory_reusing_the_embedding(grid):
    """A LayerSpec whose factory reuses a real module's Parameter is found too (built on the meta device)."""

    class TiedHead(nn.Linear):
        def __init__(self, embedding: nn.Embedding) -> None:
            super().__init__(embedding.embedding_dim, embedding.num_embeddings, bias=False)
            self.weight = embedding.weight

    reference = tied_gpt()
    layers = [copy.deepcopy(reference[0]), *[copy.deepcopy(layer) for layer in reference[1:-1]]]
    layers.append(hp.LayerSpec(TiedHead, layers[0]))
    model = hp.PipelineModel(layers, loss_fn=sequence_loss, micro_batches=grid.pipeline_stages, balance="uniform")
    try:
        with ranks_agree(what="the tie"):
            if grid.pipeline_stages > 1:
                assert model.tied_parameter_names == [("layers.0.weight", f"layers.{len(layers) - 1}.weight")]
        train(model, reference, data(grid, steps=1, per_replica=4))
        with ranks_agree(what="after training"):
            assert_like_reference(model, reference)
        if grid.pipeline_stages > 1:
            assert_copies_bit_identical(model)
    finally:
        model.close()


# ------------------------------------------------------------------ checkpoints


def global_batches(grid, first: int, steps: int, size: int = 8):
    """Per step: (this replica's rows of a global batch that does not depend on the grid, the global batch)."""
    out = []
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(1000 + step)
        whole = (torch.randint(0, VOCAB, (size, LENGTH), generator=generator),
                 torch.randint(0, VOCAB, (size, LENGTH), generator=generator))
        rows = slice(grid.replica * size // grid.data_replicas, (grid.replica + 1) * size // grid.data_replicas)
        out.append(((whole[0][rows], whole[1][rows]), whole))
    return out


SAVED: dict[str, str] = {}


def test_checkpoint_of_a_tied_model_loads_on_another_grid(grid, tmp_path):
    """Saved on the first grid after two steps, loaded on the second (1 × 2 → 2 × 1 holds the weight once
    in the optimizer state, under its first name; 4 × 1 → 2 × 2), a third step still equals one process."""
    stages = grid.pipeline_stages
    model = hp.PipelineModel(tied_gpt(), loss_fn=sequence_loss, micro_batches=stages, balance="uniform")
    optimizer = hp.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters())
    reference = tied_gpt()
    reference_optimizer = adamw(reference.parameters())
    for _, (inputs, targets) in global_batches(grid, 0, 2):
        reference_optimizer.zero_grad()
        sequence_loss(reference(inputs), targets).backward()
        reference_optimizer.step()
    try:
        if stages == GRIDS[0]:  # first grid: train two steps and save
            for (inputs, targets), _ in global_batches(grid, 0, 2):
                optimizer.zero_grad()
                model.train_step(inputs, targets)
                optimizer.step()
            SAVED["directory"] = hp.broadcast_object(str(tmp_path), group="world")
            hp.save_checkpoint(SAVED["directory"], model, optimizer, step=2)
            with ranks_agree(what="saved"):
                assert_like_reference(model, reference)
            return
        info = hp.load_checkpoint(SAVED["directory"], model, optimizer)
        with ranks_agree(what="loaded"):
            assert info["step"] == 2
            assert_like_reference(model, reference)
        if stages > 1:
            assert_copies_bit_identical(model)
        with ranks_agree(what="the optimizer state and the consolidated file"):  # (the others wait for rank 0)
            tied = [p for name, p in model.named_parameters() if name in model.tied_parameter_names[0]]
            assert tied and all(optimizer.state[p]["step"] == 2 for p in tied)  # the moments came back too
            if grid.rank == 0:  # one ordinary state_dict: the tied weight under both names, the same values
                state = torch.load(hp.consolidate(SAVED["directory"], tmp_path / "whole.pt"), weights_only=True)
                assert torch.equal(state["0.weight"], state["8.weight"])
                one_process = tied_gpt()
                one_process.load_state_dict(state, strict=True)
                torch.testing.assert_close(one_process[8].weight, reference[8].weight, rtol=1e-5, atol=1e-6)
        [((inputs, targets), (all_inputs, all_targets))] = global_batches(grid, 2, 1)
        optimizer.zero_grad()
        model.train_step(inputs, targets)
        optimizer.step()
        reference_optimizer.zero_grad()
        sequence_loss(reference(all_inputs), all_targets).backward()
        reference_optimizer.step()
        with ranks_agree(what="a step after loading"):
            assert_like_reference(model, reference)
        if stages > 1:
            assert_copies_bit_identical(model)
    finally:
        model.close()


# ------------------------------------------------------------------ refused, agreed


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_asynchronous_schedules_refuse_weights_tied_across_stages(grid, schedule):
    if grid.pipeline_stages == 1:
        pytest.skip("one stage holds both ends: nothing is tied across stages")
    with ranks_agree(what="refused"):
        with pytest.raises(PartitionError) as caught:
            hp.PipelineModel(tied_gpt(), loss_fn=sequence_loss, micro_batches=grid.pipeline_stages,
                             balance="uniform", schedule=schedule,
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
        message = str(caught.value)
        assert message.startswith("a parameter is shared by layers on different pipeline stages (layer 0 "
                                  "(Embedding).weight on stage 0, layer 8 (Linear).weight on stage ")
        assert f"schedule {schedule!r} updates each stage on its own" in message
        assert "use a synchronous schedule ('1f1b', 'gpipe', 'interleaved-1f1b' or 'zb-h1'), which ties them" in \
            message
        assert "only pipeline_stages=1 can" in message and "copy.deepcopy" in message
    # every rank raised: the next collective meets every rank
    raised = hp.allgather_object(type(caught.value).__name__, group="world")
    with ranks_agree(what="raised everywhere"):
        assert raised == ["PartitionError"] * WORLD


def test_ranks_given_different_models_raise_mismatch_not_hang(grid):
    if grid.pipeline_stages == 1:
        pytest.skip("one stage: no tie across stages to disagree on")
    untied = tied_gpt()
    untied[-1].weight = nn.Parameter(untied[0].weight.detach().clone())
    model = tied_gpt() if grid.rank == 0 else untied
    with ranks_agree(), pytest.raises(
            MismatchError, match=r"layers_tied_across_stages.*rank 0: layers_tied_across_stages="
                                 r"\(\(0, 8\),\); rank 1: layers_tied_across_stages=\(\)"):
        hp.PipelineModel(model, loss_fn=sequence_loss, balance="uniform")


def test_shared_within_one_stage_is_not_a_tie_and_trains_like_one_process(grid):
    stages = grid.pipeline_stages
    torch.manual_seed(0)
    first, second = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
    second.weight = first.weight
    middle = [block() for _ in range(max(stages - 2, 0))]
    layers = nn.Sequential(nn.Embedding(VOCAB, DIM), first, nn.Tanh(), second, *middle, nn.Linear(DIM, VOCAB))
    reference = copy.deepcopy(layers)  # one deepcopy keeps the tie
    balance = [4] + [1] * (stages - 1) if stages > 1 else [5]  # layers 1 and 3 on stage 0
    model = hp.PipelineModel(layers, loss_fn=sequence_loss, micro_batches=2, balance=balance)
    try:
        with ranks_agree(what="no tie"):
            assert model._tied is None and model.tied_parameter_names == []
            if model.stage == 0:
                assert model.layers["1"].weight is model.layers["3"].weight
        train(model, reference, data(grid, steps=2, per_replica=4))
        with ranks_agree(what="after training"):
            assert_like_reference(model, reference)
    finally:
        model.close()

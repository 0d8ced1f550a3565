"""The pipeline engine under a real mpirun: one process per stage, every stage's parameters compared
with a one-process copy of the model trained on the same mini-batches."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import hybridpipe as hp
from hybridpipe.comm.p2p import RemoteError
from hybridpipe.errors import HybridPipeError, MismatchError, PartitionError, ScheduleError
from hybridpipe.pipeline.stage import PipelineBroken
from agree import ranks_agree
from training import (MODELS, assert_same_parameters, batches, build, sequence_loss,
                      train_pipeline, train_reference, uneven)

pytestmark = pytest.mark.mpi(ranks=[2, 4], long_ranks=[1], timeout=300, shared=True)

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def grid():
    from mpi4py import MPI

    the_grid = hp.init(pipeline_stages=MPI.COMM_WORLD.size)
    yield the_grid
    hp.shutdown()

# ------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_training_equals_one_process(grid, kind, schedule, checkpoint):
    loss_fn = MODELS[kind][1]
    data = batches(kind)
    reference = build(kind)
    expected_losses = train_reference(reference, loss_fn, data)
    model = hp.PipelineModel(build(kind), loss_fn=loss_fn, micro_batches=4, balance="uniform",
                             schedule=schedule, checkpoint=checkpoint)
    try:
        losses = train_pipeline(model, data)
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert_same_parameters(model, reference)
        recomputed = {"never": 0, "except_last": 3, "always": 4}[checkpoint]
        assert model.last_step.recomputed == recomputed
    finally:
        model.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uneven_balance_and_uneven_last_micro_batch(grid, schedule):
    data = batches("mlp", batch=11)  # 11 rows in 3 micro-batches: 4, 4, 3
    reference = build("mlp")
    expected_losses = train_reference(reference, nn.CrossEntropyLoss(), data)
    balance = uneven(9, grid.pipeline_stages)
    model = hp.PipelineModel(build("mlp"), loss_fn=nn.CrossEntropyLoss(), micro_batches=3, balance=balance,
                             schedule=schedule)
    try:
        with ranks_agree(what="layout"):  # before training: a rank leaving would strand the others
            assert model.balance == balance
            assert list(model.layers_of_stage(grid.stage)) == list(
                range(sum(balance[: grid.stage]), sum(balance[: grid.stage + 1])))
        assert train_pipeline(model, data) == pytest.approx(expected_losses, rel=1e-5)
        assert_same_parameters(model, reference)
    finally:
        model.close()


def test_shapes_may_change_between_steps(grid):
    reference = build("transformer")
    model = hp.PipelineModel(build("transformer"), loss_fn=sequence_loss, micro_batches=2, balance="uniform")
    generator = torch.Generator().manual_seed(5)
    data = [(torch.randint(1, 11, (6, length), generator=generator),
             torch.randint(0, 11, (6, length), generator=generator)) for length in (3, 9, 5)]
    try:
        expected = train_reference(reference, sequence_loss, data)
        assert train_pipeline(model, data) == pytest.approx(expected, rel=1e-5)
        assert_same_parameters(model, reference)
    finally:
        model.close()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_predict_equals_one_process_forward(grid, kind):
    reference = build(kind)
    inputs, _ = batches(kind, steps=1, batch=9)[0]
    model = hp.PipelineModel(build(kind), loss_fn=MODELS[kind][1], micro_batches=4, balance="uniform")
    try:
        with torch.no_grad():
            expected = reference(inputs)
        output = model.predict(inputs)
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
        assert not output.requires_grad
    finally:
        model.close()


# ------------------------------------------------------------------ memory: what the executor holds


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stored_activations_gpipe_holds_all_1f1b_at_most_p_minus_stage(grid, schedule):
    micro_batches = 8
    model = hp.PipelineModel(build("mlp"), loss_fn=nn.CrossEntropyLoss(), micro_batches=micro_batches,
                             balance="uniform", schedule=schedule)
    try:
        inputs, targets = batches("mlp", steps=1, batch=16)[0]
        model.train_step(inputs, targets)
        peak = model.last_step.peak_stored
        if schedule == "gpipe":
            assert peak == micro_batches
        else:
            assert peak == min(grid.pipeline_stages - grid.stage, micro_batches)
            assert peak <= grid.pipeline_stages
    finally:
        model.close()


# ------------------------------------------------------------------ re-materialization and RNG


def dropout_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.3),
                         nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.2), nn.Linear(16, 5))


def test_recompute_replays_the_same_dropout_masks(grid):
    data = batches("mlp")
    results = {}
    for checkpoint in ("never", "always"):
        model = hp.PipelineModel(dropout_mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=4,
                                 balance="uniform", checkpoint=checkpoint)
        try:
            torch.manual_seed(1234 + grid.stage)
            losses = train_pipeline(model, data)
            results[checkpoint] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
        finally:
            model.close()
    assert results["never"][0] == results["always"][0]
    for name, value in results["never"][1].items():
        assert torch.equal(value, results["always"][1][name]), name
    # and dropout really was active: the losses differ from the same model without dropout masks
    model = hp.PipelineModel(dropout_mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=4, balance="uniform")
    try:
        model.eval()
        assert train_pipeline(model, data) != results["never"][0]
    finally:
        model.close()


# ------------------------------------------------------------------ construction: specs, names, balance


class CountingLinear(nn.Linear):
    built: list[int] = []

    def __init__(self, index: int, width: int) -> None:
        super().__init__(width, width)
        if self.weight.device.type != "meta":  # parameter counting builds on the meta device
            CountingLinear.built.append(index)


def test_layer_specs_build_only_this_stage_and_keep_original_names(grid):
    CountingLinear.built = []
    count = 2 * grid.pipeline_stages + 1
    specs = [hp.LayerSpec(CountingLinear, i, 6) for i in range(count)]
    model = hp.PipelineModel(specs, loss_fn=nn.MSELoss(), micro_batches=2, balance="parameters", seed_layers=7)
    try:
        own = list(model.layers_of_stage(grid.stage))
        assert CountingLinear.built == own  # only this stage's layers got real memory
        names = [name for name, _ in model.named_parameters()]
        assert names == [f"layers.{i}.{p}" for i in own for p in ("weight", "bias")]
        assert sorted(model.state_dict()) == sorted(names)
        # seed_layers: layer i is the same whatever the stage count
        for i in own:
            with torch.random.fork_rng():
                torch.manual_seed(7 + i)
                expected = nn.Linear(6, 6)
            torch.testing.assert_close(model.layers[str(i)].weight, expected.weight, rtol=0, atol=0)
    finally:
        model.close()


def test_balance_by_time_is_the_same_on_every_rank_and_reported(grid):
    model = hp.PipelineModel(build("mlp"), loss_fn=nn.CrossEntropyLoss(), micro_batches=2,
                             sample_input=torch.randn(4, 12))
    try:
        from mpi4py import MPI

        everyone = MPI.COMM_WORLD.allgather(model.balance)
        assert all(b == model.balance for b in everyone)
        assert sum(model.balance) == 9 and len(model.balance) == grid.pipeline_stages
        report = str(model.balance_report)
        assert 'method "time"' in report and "% of slowest" in report
    finally:
        model.close()


def test_default_balance_without_sample_is_parameters_and_says_so(grid):
    model = hp.PipelineModel(build("mlp"), loss_fn=nn.CrossEntropyLoss(), micro_batches=2)
    try:
        assert "no sample_input" in str(model.balance_report)
    finally:
        model.close()


# ------------------------------------------------------------------ errors, on every rank


def test_more_stages_than_layers(grid):
    if grid.pipeline_stages < 2:
        pytest.skip("needs 2+ stages")
    with pytest.raises(PartitionError, match=rf"pipeline_stages {grid.pipeline_stages} > 1 layers"):
        hp.PipelineModel([nn.Linear(2, 2)], loss_fn=nn.MSELoss())


def test_balance_that_does_not_sum(grid):
    with pytest.raises(PartitionError, match=r"sums to \d+ but the model has 9 layers"):
        hp.PipelineModel(build("mlp"), loss_fn=nn.MSELoss(), balance=[1] * (grid.pipeline_stages - 1) + [3])


def test_bad_settings_name_the_value(grid):
    with pytest.raises(ScheduleError, match="unknown schedule 'zigzag'"):
        hp.PipelineModel(build("mlp"), loss_fn=nn.MSELoss(), schedule="zigzag")
    with pytest.raises(HybridPipeError, match="unknown checkpoint mode 'sometimes'"):
        hp.PipelineModel(build("mlp"), loss_fn=nn.MSELoss(), checkpoint="sometimes")
    with pytest.raises(HybridPipeError, match=r"micro_batches must be a positive int \(got 0\)"):
        hp.PipelineModel(build("mlp"), loss_fn=nn.MSELoss(), micro_batches=0)
    with pytest.raises(TypeError, match=r"layers\[1\] is a str"):
        hp.PipelineModel([nn.Linear(2, 2), "relu"], loss_fn=nn.MSELoss())


def test_batch_smaller_than_micro_batches(grid):
    model = hp.PipelineModel(build("mlp"), loss_fn=nn.CrossEntropyLoss(), micro_batches=8, balance="uniform")
    try:
        with pytest.raises(HybridPipeError, match="batch size 5 is smaller than micro_batches 8"):
            model.train_step(torch.randn(5, 12), torch.zeros(5, dtype=torch.long))
    finally:
        model.close()


def test_ranks_disagreeing_on_settings_raise_everywhere(grid):
    if grid.size < 2:
        pytest.skip("needs 2+ ranks")
    with pytest.raises(MismatchError, match=r"micro_batches.*rank 0: micro_batches=2; rank 1: micro_batches=3"):
        hp.PipelineModel(build("mlp"), loss_fn=nn.MSELoss(), micro_batches=2 + min(grid.rank, 1),
                         balance="uniform")


class FailsOnSecondCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.linear = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise ValueError("layer exploded on purpose")
        return self.linear(x)


def test_an_exception_on_one_stage_raises_on_every_stage_and_breaks_the_pipeline(grid):
    layers = list(build("mlp"))
    layers.insert(len(layers) - 1, FailsOnSecondCall())  # in the last stage
    model = hp.PipelineModel(layers, loss_fn=nn.CrossEntropyLoss(), micro_batches=3, balance="uniform")
    inputs, targets = batches("mlp", steps=1, batch=6)[0]
    try:
        if grid.is_last_stage:
            with pytest.raises(ValueError, match="layer exploded on purpose"):
                model.train_step(inputs, targets)
        else:
            last = grid.pipeline_stages - 1
            with pytest.raises(RemoteError, match=rf"stage {last} .*raised ValueError: layer exploded"):
                model.train_step(inputs, targets)
        with pytest.raises(PipelineBroken, match="failed in an earlier step"):
            model.train_step(inputs, targets)
    finally:
        model.close()


def test_forward_is_not_callable_and_loss_is_required(grid):
    model = hp.PipelineModel(build("mlp"), micro_batches=2, balance="uniform")
    try:
        with pytest.raises(HybridPipeError, match="train_step"):
            model(torch.randn(2, 12))
        with pytest.raises(HybridPipeError, match="loss_fn"):
            model.train_step(torch.randn(4, 12), torch.zeros(4, dtype=torch.long))
    finally:
        model.close()

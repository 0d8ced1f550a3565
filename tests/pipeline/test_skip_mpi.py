"""Skip connections across pipeline stages under a real mpirun: a projection stashed on the first stage and popped
on the last (stages 0 -> 3 at P = 4: it skips the stages between), plus a skip inside the last stage, train like
one process with every synchronous schedule and checkpoint mode, on grids 2 × 1, 4 × 1 and 2 × 2."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.errors import HybridPipeError

from skip_models import CLASSES, WIDTH, StashProjection, skip_model

pytestmark = pytest.mark.mpi(ranks=[2, 4], timeout=240, shared=True)

torch.set_num_threads(1)
WORLD = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)
GRIDS = {2: [2], 4: [4, 2]}.get(WORLD, [WORLD])
BALANCE = {2: [3, 8], 4: [3, 2, 2, 4]}
CASES = [("gpipe", "never", 1), ("1f1b", "except_last", 1), ("1f1b", "always", 1), ("zb-h1", "never", 1),
         ("interleaved-1f1b", "never", 2)]


@pytest.fixture(scope="module", params=GRIDS, ids=lambda p: f"P{p}")
def grid(request):
    the_grid = hp.init(pipeline_stages=request.param)
    yield the_grid
    hp.shutdown()


def batches(grid, steps: int = 3, per_replica: int = 8):
    out = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(10 + step)
        x = torch.randn(per_replica * grid.data_replicas, WIDTH, generator=generator)
        y = torch.randint(0, CLASSES, (per_replica * grid.data_replicas,), generator=generator)
        mine = slice(grid.replica * per_replica, (grid.replica + 1) * per_replica)
        out.append(((x[mine], y[mine]), (x, y)))
    return out


@pytest.mark.parametrize("schedule,checkpoint,virtual", CASES, ids=lambda v: str(v))
def test_a_skip_across_stages_trains_like_one_process(grid, schedule, checkpoint, virtual):
    stages = grid.pipeline_stages
    if virtual > 1 and stages != 2:
        pytest.skip("interleaved: 2 ranks × 2 chunks (the balance puts the stash on chunk 0, the pop on chunk 3)")
    reference = skip_model()
    balance = BALANCE[stages * virtual]
    model = hp.PipelineModel(copy.deepcopy(reference), loss_fn=nn.CrossEntropyLoss(), micro_batches=4,
                             schedule=schedule, checkpoint=checkpoint, balance=balance,
                             **({"virtual_stages": virtual} if virtual > 1 else {}))
    try:
        with ranks_agree(what="the routes"):
            route = model.skip_routes["residual"]
            assert (route.stash_chunk, route.pop_chunk) == (0, stages * virtual - 1)
            assert model.skip_routes["inner"].stash_chunk == model.skip_routes["inner"].pop_chunk
        optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step, ((x, y), (all_x, all_y)) in enumerate(batches(grid)):
            optimizer.zero_grad()
            with ranks_agree(what=f"step {step}"):
                loss = model.train_step(x, y)
                optimizer.step()
                reference_optimizer.zero_grad()
                expected = nn.functional.cross_entropy(reference(all_x), all_y)
                expected.backward()
                reference_optimizer.step()
                if grid.data_replicas == 1:
                    assert loss == pytest.approx(expected.item(), rel=1e-5)
        in_flight = list(model._executor.in_flight)  # after training (before predict)
        with ranks_agree(what="after training"):
            prediction = model.predict(all_x[:8])
            expected_parameters = dict(reference.named_parameters())
            for name, parameter in model.named_parameters():
                torch.testing.assert_close(parameter, expected_parameters[name.removeprefix("layers.")], rtol=1e-5,
                                           atol=1e-6, msg=lambda text: f"{name}: {text}")
            if model.stage == 0:  # trained only through the gradient that came back along the skip
                assert not torch.equal(model.layers["2"].projection.weight, skip_model()[2].projection.weight)
            assert in_flight == []  # both ends let go of every micro-batch's skip tensors
            torch.testing.assert_close(prediction, reference(all_x[:8]), rtol=1e-5, atol=1e-6)
    finally:
        model.close()


def test_a_layer_that_does_not_stash_its_declared_name_is_an_error_on_every_rank(grid):
    @hp.skippable(stash=["residual"])
    class Forgetful(StashProjection):
        def forward(self, x):
            return x  # declares the stash, never calls hp.stash

    layers = list(skip_model())
    layers[2] = Forgetful()
    model = hp.PipelineModel(nn.Sequential(*layers), loss_fn=nn.CrossEntropyLoss(), micro_batches=2,
                             balance=BALANCE[grid.pipeline_stages])
    try:
        x, y = torch.randn(4, WIDTH), torch.randint(0, CLASSES, (4,))
        with ranks_agree(), pytest.raises(
                HybridPipeError, match=r"chunk 0's forward did not hp.stash \['residual'\]|raised "
                                       r"HybridPipeError: chunk 0's forward did not hp.stash"):
            model.train_step(x, y)
    finally:
        model.close()

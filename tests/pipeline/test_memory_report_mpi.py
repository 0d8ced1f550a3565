"""model.memory_report(): every rank's parameter, gradient, optimizer-state and activation bytes against
what they must be for a model whose sizes are known, under a real mpirun."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridpipe as hp
from agree import ranks_agree

pytestmark = pytest.mark.mpi(ranks=[2], timeout=120, shared=True)

torch.set_num_threads(1)
WIDTH, ROWS, MICRO = 64, 32, 4
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4


@pytest.fixture(params=[2, 1], ids=["2x1", "1x2"])
def grid(request):
    hp.shutdown()
    yield hp.init(pipeline_stages=request.param)
    hp.shutdown()


def test_memory_report_counts_what_the_rank_holds(grid):
    torch.manual_seed(0)
    stages = grid.pipeline_stages
    layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    model = hp.PipelineModel(layers, loss_fn=nn.MSELoss(), micro_batches=MICRO, balance="uniform")
    zero = 1 if grid.data_replicas > 1 else 0
    optimizer = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters()), named_parameters=model.named_parameters(),
                                        zero=zero)
    try:
        # every collective first, every assertion after: a rank failing one must not leave the other waiting
        unmeasured = model.memory_report(optimizer)
        model.measure_activations = True
        optimizer.zero_grad()
        model.train_step(torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH))
        optimizer.step()
        report = model.memory_report(optimizer)
        model.measure_activations = False
        off_again = model.memory_report(optimizer)
        with ranks_agree():  # a check failing on one rank fails both, with its message
            assert unmeasured[grid.rank].activations_peak is None and "-" in str(unmeasured)
            assert [r.rank for r in report.ranks] == list(range(grid.size))  # the same table on every rank
            mine = report[grid.rank]
            layers_here = 4 // stages
            assert mine.parameters == layers_here * LAYER_BYTES
            if zero:  # AdamW's two moments for this replica's half (padding: at most one element per bucket)
                half = 2 * LAYER_BYTES * layers_here // 2
                assert half <= mine.optimizer_state <= half + 64
                assert mine.gradients >= mine.parameters  # zero=1: the local gradients and the shard's
            else:
                assert mine.optimizer_state == 2 * mine.parameters
                assert mine.gradients == mine.parameters
            # a Linear keeps its input for backward: ROWS / M × WIDTH floats per layer and micro-batch held;
            # counted per storage, so the first layer's inputs (views of the one input batch) count as that batch
            layer_input = (ROWS // MICRO) * WIDTH * 4
            batch = ROWS * WIDTH * 4
            held = mine.stored_micro_batches
            assert held == (stages - grid.stage if stages > 1 else 1)  # 1F1B: stage s holds P - s
            if grid.is_first_stage:
                expected = batch + held * (layers_here - 1) * layer_input
                if grid.is_last_stage:  # MSELoss keeps its input and target (a view of the target batch)
                    expected += held * layer_input + batch
                assert mine.activations_peak == expected
            else:
                assert mine.activations_peak >= held * layers_here * layer_input
            assert mine.peak_rss > 50 * 2 ** 20 and mine.cuda_peak is None
            assert "memory per rank (MiB)" in str(report) and "activations peak" in str(report)
            assert off_again[grid.rank].activations_peak == mine.activations_peak  # off: the peak stays
            assert not model.measure_activations
    finally:
        model.close()


def test_memory_report_with_zero_3_shows_the_shards_and_the_largest_gather():
    """zero=3 on 1 x 2 (one stage: its one chunk is what the executor gathers): each rank holds half the
    parameters (its shard), its largest gather is the whole chunk, its optimizer state is for half the
    parameters, and after the step no gradient but the shard's."""
    hp.shutdown()
    grid = hp.init(pipeline_stages=1)
    torch.manual_seed(0)
    model = hp.PipelineModel(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]), loss_fn=nn.MSELoss(),
                             micro_batches=MICRO)
    optimizer = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters()), named_parameters=model.named_parameters(),
                                        zero=3)
    try:
        before = model.memory_report(optimizer)
        optimizer.zero_grad()
        model.train_step(torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH))
        optimizer.step()
        report = model.memory_report(optimizer)
        with ranks_agree():
            whole = 4 * LAYER_BYTES
            mine, first = report[grid.rank], before[grid.rank]
            assert whole // 2 <= mine.parameters <= whole // 2 + 64 and first.parameters == mine.parameters
            assert first.gathered_peak == 0 and mine.gathered_peak >= whole  # one bucket's padding at most more
            assert mine.gathered_peak <= whole + 64 * 4
            assert whole <= mine.optimizer_state <= whole + 128  # two moments of half the parameters
            assert mine.gradients <= whole // 2 + 64  # the shard's gradient only
            assert "gathered peak" in str(report)
    finally:
        model.close()
        hp.shutdown()

"""The planner under mpirun: hp.auto plans for the running job, re-makes the grid as planned, and the model
and optimizer it returns train like one process on the global batch; calibrate measures the job's links."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridpipe as hp
from hybridpipe.plan.auto import auto
from hybridpipe.plan.search import Plan

pytestmark = pytest.mark.mpi(ranks=[2], timeout=300)

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hp.init()
    yield
    hp.shutdown()


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]


def global_batches(steps: int = 3, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(size, 8, generator=generator), torch.randint(0, 4, (size,), generator=generator))
            for _ in range(steps)]


@pytest.mark.parametrize("given", [None, "pipeline"])
def test_auto_builds_what_it_planned_and_trains_like_one_process(given):
    plan = None
    if given == "pipeline":
        plan = Plan(stages=2, replicas=1, balance=[2, 3], micro_batches=4, schedule="1f1b", checkpoint="never",
                    step_seconds=0.0, samples_per_second=0.0, memory_bytes_per_rank=0.0, global_batch=8)
    sample = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    model, opt = auto(layers(), nn.CrossEntropyLoss(), sample, global_batch=8,
                      optimizer=lambda params: torch.optim.SGD(params, lr=0.1), plan=plan)
    try:
        grid = hp.grid()
        assert (grid.pipeline_stages, grid.data_replicas) == (model.plan.stages, model.plan.replicas)
        assert model.balance == model.plan.balance and model.micro_batches == model.plan.micro_batches
        if plan is not None:
            assert model.plan is plan and grid.pipeline_stages == 2
        reference = nn.Sequential(*layers())
        reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for inputs, targets in global_batches():
            shard = slice(grid.replica * 8 // grid.data_replicas, (grid.replica + 1) * 8 // grid.data_replicas)
            opt.zero_grad()
            model.train_step(inputs[shard], targets[shard])
            opt.step()
            reference_opt.zero_grad()
            nn.CrossEntropyLoss()(reference(inputs), targets).backward()
            reference_opt.step()
        expected = {f"layers.{name}": p for name, p in reference.named_parameters()}
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(parameter, expected[name], rtol=1e-5, atol=1e-6)
    finally:
        model.close()


def test_calibrate_measures_the_links_and_the_planner_reads_them(tmp_path_factory):
    import json

    from hybridpipe.plan.calibrate import SIZES, calibrate, load_cluster

    result = calibrate(repeats=3)
    assert result["ranks"] == hp.size() and result["ranks_per_host"] == hp.local_size()
    assert len(result["intra_p2p_seconds"]) == len(SIZES) and all(t > 0 for t in result["intra_p2p_seconds"])
    assert len(result["allreduce_seconds"]) == len(SIZES)
    assert result["intra_latency_us"] >= 0 and result["intra_gbps"] > 0 and result["allreduce_gbps"] > 0
    assert "inter_gbps" not in result  # one host
    path = tmp_path_factory.mktemp("cluster") / "cluster.json"
    path.write_text(json.dumps(result))
    cluster = load_cluster(str(path), ranks=8)
    assert cluster.ranks == 8 and cluster.ranks_per_host == result["ranks_per_host"]
    assert cluster.intra_host_gbps == pytest.approx(result["intra_gbps"])
    assert cluster.latency_us == pytest.approx(result["intra_latency_us"])

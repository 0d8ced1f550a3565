"""hp.auto(module) under mpirun: a transformers GPT-2 (tied head) handed in whole is profiled by its unit
calls, planned, split by module names as planned, printed with its split report, and trains like one
process on the global batch (float64)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch.nn import functional as F

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.pipeline.split import trace_module
from hybridpipe.plan.cost import Cluster

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pipeline"))
from split_models import gpt2  # noqa: E402

pytestmark = pytest.mark.mpi(ranks=[2], timeout=300, shared=True)

torch.set_num_threads(1)
GLOBAL_BATCH = 8


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())  # float64 through (no float32 cast)


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hp.init()
    yield
    hp.shutdown()


def test_auto_splits_a_transformers_module_as_planned_and_trains_like_one_process(capfd):
    torch.set_default_dtype(torch.float64)
    try:
        module, batch, _ = gpt2(4)
        module = module.double()
        reference = copy.deepcopy(module)
        # a slow link: allreducing the gradients costs more than sending a micro-batch's hidden state, so the
        # plan is a pipeline and the module is cut (a cluster this machine is not: measuring the plans here would
        # keep data parallelism, so verify=False)
        cluster = Cluster(ranks=2, ranks_per_host=2, intra_host_gbps=0.01)
        model, opt = hp.auto(module, loss_fn, sample=batch(4, 0), global_batch=GLOBAL_BATCH, cluster=cluster,
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1), zero=0, verify=False)
        try:
            plan = model.plan
            with ranks_agree(what="as planned"):
                assert (plan.stages, plan.replicas) == (2, 1) and hp.grid().pipeline_stages == 2, plan.describe()
                units = [call.name for call in trace_module(copy.deepcopy(reference), batch(4, 0)[0])[1].calls]
                assert len(plan.split) == plan.stages * plan.virtual_stages - 1 and set(plan.split) <= set(units[1:])
                assert model.micro_batches == plan.micro_batches and model.schedule_name == plan.schedule
                starts = [units.index(name) for name in plan.split]
                assert sum(model.balance) == len(units) and starts == [sum(model.balance[:c + 1])
                                                                       for c in range(len(starts))]
                printed = capfd.readouterr().out
                if hp.rank() == 0:
                    assert "hp.auto plan for 2 ranks" in printed and "chunk 1 (stage 1)" in printed, printed
                    assert "receives" in printed and plan.split[0] in printed
            reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            for step in range(3):
                inputs, targets = batch(GLOBAL_BATCH, 10 + step)
                opt.zero_grad()
                with ranks_agree(what=f"step {step}"):
                    loss = model.train_step(inputs, targets)
                    opt.step()
                    reference_opt.zero_grad()
                    expected = loss_fn(reference(**inputs), targets)
                    expected.backward()
                    reference_opt.step()
                    assert loss == pytest.approx(float(expected.detach()), rel=1e-9)
            with ranks_agree(what="after training"):
                expected_parameters = dict(reference.named_parameters())
                own = dict(model.named_parameters())
                assert own and set(own) <= set(expected_parameters)
                for name, parameter in own.items():
                    torch.testing.assert_close(parameter, expected_parameters[name], rtol=1e-7, atol=1e-10)
        finally:
            model.close()
    finally:
        torch.set_default_dtype(torch.float32)

"""hp.auto's verification on 4 ranks with tied weights: a trial's copy of the layers keeps their tie, a trial on a
grid where the tie spans some stages only (stage 0 and stage 3 of 4: a process set of its own) leaves nothing
registered behind, so the plan kept on another grid is built there (the job re-made) and trains like one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridpipe as hp
from hybridpipe import runtime
from agree import ranks_agree

pytestmark = pytest.mark.mpi(ranks=[4], timeout=240, shared=True)

torch.set_num_threads(1)
VOCAB, DIM, LENGTH, BATCH = 32, 16, 4, 8


def tied_lm() -> nn.Sequential:
    """Embedding, six Linear + Tanh blocks, LayerNorm and a head whose weight IS the embedding's."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)
    head.weight = embedding.weight
    blocks = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(6)]
    return nn.Sequential(embedding, *blocks, nn.LayerNorm(DIM), head)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def test_a_trial_with_a_tie_set_leaves_the_grid_free_for_the_kept_plan(monkeypatch):
    from hybridpipe.plan import auto as auto_module, verify

    hp.shutdown()
    hp.init()
    real_plans, real_trial = auto_module.plans, verify._trial

    def chosen(profile, cluster, global_batch, *count, **kwargs):  # a 4-stage plan (tie over stages 0 and 3),
        every = real_plans(profile, cluster, global_batch, 200, **kwargs)  # then data parallelism
        four = next(p for p in every if p.stages == 4 and p.virtual_stages == 1)
        return [four, next(p for p in every if p.stages == 1)]

    trials = []

    def slow_four(plan, *args):  # the 4-stage plan measures slow, so the other grid's plan is kept
        made = []
        real_built = auto_module._built

        def built(layers_, *rest):  # the trial's model, and what it made on the grid
            pair = real_built(layers_, *rest)
            made.append((pair[0].tied_parameter_names, runtime.job("test").made_on_grid()))
            return pair

        monkeypatch.setattr(auto_module, "_built", built)
        times = real_trial(plan, *args)
        monkeypatch.setattr(auto_module, "_built", real_built)
        trials.append((plan.stages, made[0], runtime.job("test").made_on_grid()))
        return [t * 100 for t in times] if plan.stages == 4 else times

    monkeypatch.setattr(auto_module, "search", lambda *args, **kwargs: chosen(*args, **kwargs)[0])
    monkeypatch.setattr(auto_module, "plans", lambda *args, **kwargs: chosen(*args, **kwargs))
    monkeypatch.setattr(verify, "_trial", slow_four)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    layers = tied_lm()
    reference = copy.deepcopy(layers)
    model, opt = hp.auto(list(layers), loss_fn, (inputs[:2], targets[:2]), BATCH, verify_plans=2, verify_seconds=60,
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    try:
        with ranks_agree(what="the kept plan, on its grid"):
            assert [stages for stages, _, _ in trials] == [4, 1]
            tie = [("layers.0.weight", "layers.8.weight")]
            assert trials[0][1] == (tie, ["process set 1 (ranks [0, 3])"])  # the copies stayed tied
            assert trials[1][1][1] == []  # one stage holds both ends: no set
            assert trials[0][2] == [] and trials[1][2] == []  # each trial's set gone with it
            assert (model.plan.stages, model.plan.replicas) == (1, 4)
            assert hp.grid().pipeline_stages == 1 and hp.grid().data_replicas == 4
            assert model.plan.verification[1]["kept"] and not model.plan.verification[0]["kept"]
        share = BATCH // 4
        mine = slice(hp.rank() * share, (hp.rank() + 1) * share)
        reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model.train_step(inputs[mine], targets[mine])
            opt.step()
            reference_opt.zero_grad()
            loss_fn(reference(inputs), targets).backward()
            reference_opt.step()
        with ranks_agree(what="trained like one process"):
            own = dict(model.named_parameters())
            torch.testing.assert_close(own["layers.0.weight"], reference[0].weight, rtol=1e-5, atol=1e-6)
    finally:
        model.close()
        hp.shutdown()

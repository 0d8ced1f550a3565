"""hp.auto's search for a model with tied weights: only the grids and schedules the runtime keeps ties in step on
(uniform grids, synchronous schedules), for layer lists (a TiedLayerSpec key twice, one Parameter in two layers)
and modules (a transformers-style tied head); a model without ties gets every grid and, when asked, PipeDream
and 2BW. The search itself then offers no plan with its own replica counts per stage."""

from __future__ import annotations

from torch import nn

import hybridpipe as hp
from hybridpipe.pipeline import schedule as sched
from hybridpipe.plan.auto import has_tied_weights, search_options
from hybridpipe.plan.cost import Cluster
from hybridpipe.plan.models import model_profile
from hybridpipe.plan.search import SYNCHRONOUS_CHOICES, plans


def head(embedding: nn.Embedding, x):
    return x @ embedding.weight.t()


def tied_specs() -> list:
    return [hp.TiedLayerSpec("tokens", nn.Embedding, 64, 16), hp.LayerSpec(nn.Linear, 16, 16),
            hp.TiedLayerSpec("tokens", nn.Embedding, 64, 16, forward_fn=head)]


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.body = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, x):
        return self.lm_head(self.body(self.embed(x)))


def test_ties_are_seen_in_layer_lists_and_modules():
    assert has_tied_weights(tied_specs(), module=False)
    shared = nn.Linear(8, 8)
    assert has_tied_weights([shared, nn.ReLU(), shared], module=False)  # one module (its Parameters) twice
    assert not has_tied_weights([nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)], module=False)
    assert not has_tied_weights([hp.TiedLayerSpec("once", nn.Linear, 8, 8), hp.LayerSpec(nn.Linear, 8, 8)],
                                module=False)  # a key used once ties nothing
    assert has_tied_weights(TiedLM(), module=True)
    untied = TiedLM()
    untied.lm_head.weight = nn.Parameter(untied.embed.weight.detach().clone())
    assert not has_tied_weights(untied, module=True)


def test_a_tied_model_is_searched_on_uniform_grids_with_synchronous_schedules():
    tied = search_options(tied_specs(), module=False, asynchronous=True)
    assert tied == {"schedules": SYNCHRONOUS_CHOICES, "grids": "uniform"}
    assert search_options(TiedLM(), module=True, asynchronous=False) == tied
    free = search_options([nn.Linear(8, 8), nn.Linear(8, 8)], module=False, asynchronous=True)
    assert free == {"schedules": SYNCHRONOUS_CHOICES + sched.ASYNCHRONOUS, "grids": "all"}


def test_the_search_with_a_tied_models_options_offers_no_own_replica_counts():
    """VGG-16 across hosts is where the search picks stages with their own replica counts; with a tied model's
    options none of the plans it offers to measure has them."""
    profile = model_profile("vgg16", "v100")
    cluster = Cluster(ranks=16, ranks_per_host=4, intra_host_gbps=100, inter_host_gbps=10)
    everything = plans(profile, cluster, 1024, count=3, **search_options([nn.Linear(2, 2)], False, False))
    assert everything[0].stage_replicas is not None  # what it would offer an untied model
    offered = plans(profile, cluster, 1024, count=3, **search_options(tied_specs(), False, False))
    assert len(offered) == 3 and all(p.stage_replicas is None for p in offered), [p.describe() for p in offered]
    assert all(p.schedule in SYNCHRONOUS_CHOICES for p in offered)

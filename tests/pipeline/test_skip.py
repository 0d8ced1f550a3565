"""Skip connections without MPI: hp.stash / hp.pop in one process, and the routes PipelineModel derives from the
@hp.skippable declarations (and their errors, which name the layers and the fix)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridpipe as hp
from hybridpipe.errors import HybridPipeError
from hybridpipe.pipeline.skip import skip_routes

from skip_models import AddBack, StashInner, StashProjection, skip_model


def test_one_process_stash_and_pop_add_the_projection_back():
    model = skip_model()
    x = torch.randn(5, 8)
    h = model[1](model[0](x))
    residual = model[2].projection(h)
    h = model[6](model[5](model[4](model[3](h))))
    h = torch.tanh(h) + 0.5 * h
    expected = model[10](h + residual)
    torch.testing.assert_close(model(x), expected)
    model(x).sum().backward()  # the stashed projection gets its gradient through the pop
    assert model[2].projection.weight.grad is not None and model[2].projection.weight.grad.abs().sum() > 0


def test_routes_name_each_skip_with_its_chunks():
    layers = list(skip_model())
    chunks = [0] * 3 + [1] * 2 + [2] * 2 + [3] * 4
    routes = skip_routes(layers, chunks)
    assert sorted(routes) == ["inner", "residual"]
    residual = routes["residual"]
    assert (residual.stash_layer, residual.pop_layer, residual.stash_chunk, residual.pop_chunk) == (2, 9, 0, 3)
    assert (routes["inner"].stash_chunk, routes["inner"].pop_chunk) == (3, 3)
    spec_routes = skip_routes([hp.LayerSpec(StashProjection), hp.LayerSpec(AddBack)], [0, 1])
    assert spec_routes["residual"].pop_chunk == 1  # LayerSpecs are read from their class, unbuilt


def test_route_errors_name_the_layers_and_the_fix():
    with pytest.raises(HybridPipeError, match=r"skip 'residual' is never popped: declare the other end with "
                                              r"@hp.skippable\(pop=\['residual'\]\)"):
        skip_routes([StashProjection(), nn.Tanh()], [0, 1])
    with pytest.raises(HybridPipeError, match=r"skip 'residual' is popped by layer 0, not after layer 1"):
        skip_routes([AddBack(), StashProjection()], [0, 1])
    with pytest.raises(HybridPipeError, match=r"skip 'inner' is stashed by layers 0 and 1"):
        skip_routes([StashInner(), StashInner()], [0, 0])
    with pytest.raises(TypeError, match=r"skip names are non-empty strings \(got ''\)"):
        hp.skippable(stash=[""])


def test_pop_without_a_stash_says_what_to_do():
    with pytest.raises(HybridPipeError, match=r"hp.pop\('nothing'\): nothing was stashed under this name"):
        hp.pop("nothing")

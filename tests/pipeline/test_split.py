"""The module splitter without MPI: units, what crosses each cut, refusals, and every model of split_models
run chunk after chunk in one process (each chunk's module forward with earlier chunks' calls substituted),
equal to the unsplit forward."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridpipe.pipeline import split
from hybridpipe.pipeline.split import SplitError, SplitPlan
from split_models import MODELS, Branching


def chained(module, inputs, boundaries):
    """Runs the chunks of ``module`` cut at ``boundaries`` one after the other in this process."""
    units, trace = split.trace_module(module, inputs)
    plan = SplitPlan(module, units, trace, boundaries, ranks=len(boundaries) - 1)
    split.install_dispatch(units)
    received = inputs
    for chunk in range(plan.chunks):
        received = split.SplitChunk(plan, chunk, torch.device("cpu"))(received, inputs)
        if chunk < plan.chunks - 1:
            assert sorted(received["values"]) == plan.receives[chunk + 1]
    return plan, received


@pytest.mark.parametrize("name,chunks", [(name, 3 if name in ("t5", "unet", "shared_loop") else 2)
                                         for name in sorted(MODELS)])
def test_chunks_in_a_row_equal_the_module(name, chunks):
    module, batch, _ = MODELS[name]()
    module = module.double().eval()
    torch.set_default_dtype(torch.float64)
    try:
        inputs, _ = batch(3, 5)
    finally:
        torch.set_default_dtype(torch.float32)
    reference = copy.deepcopy(module)
    with torch.no_grad():
        expected = reference(**inputs) if isinstance(inputs, dict) else reference(inputs)
        units, trace = split.trace_module(copy.deepcopy(module), inputs)
        count = len(trace.calls)
        boundaries = [count * c // chunks for c in range(chunks)] + [count]
        plan, output = chained(module, inputs, boundaries)
    assert split.first_difference(expected, output, 1e-12, 1e-12) is None
    assert plan.chunks == chunks


def test_units_and_crossings_of_gpt2():
    module, batch, _ = MODELS["gpt2"]()
    inputs, _ = batch(2, 0)
    units, trace = split.trace_module(module, inputs)
    names = [call.name for call in trace.calls]
    assert names == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.h.2",
                     "transformer.h.3", "transformer.ln_f", "lm_head"]
    plan = SplitPlan(module, units, trace, split.boundaries_from_names(trace, ["transformer.h.2"], 2), ranks=2)
    # only block 1's output crosses: positions and the causal mask are recomputed from the batch
    assert [label for label, _, _ in plan.crossing(1)] == ["transformer.h.1"]
    assert plan.shapes_in[1]  # the embeddings' shapes, for the glue that reads them
    ties, names = split._ties(plan)
    assert names == [("transformer.wte.weight", "lm_head.weight")] and ties[0].ranks == (0, 1)


def test_split_points_are_checked():
    module, batch, _ = MODELS["gpt2"]()
    _, trace = split.trace_module(module, batch(2, 0)[0])
    with pytest.raises(SplitError, match="split lists 2 module names, but 2 chunks need 1"):
        split.boundaries_from_names(trace, ["transformer.h.1", "transformer.h.2"], 2)
    with pytest.raises(SplitError, match="'transformer.h.7' is not a unit .* are \\['transformer.wte'"):
        split.boundaries_from_names(trace, ["transformer.h.7"], 2)
    with pytest.raises(SplitError, match="must be in call order"):
        split.boundaries_from_names(trace, ["transformer.h.2", "transformer.h.1"], 3)


def test_branch_on_an_activation_is_refused_and_after_the_last_cut_allowed():
    module = Branching()
    units, trace = split.trace_module(module, torch.randn(2, 6))
    with pytest.raises(SplitError, match=r"Tensor.__bool__ at .*split_models.py:\d+ \(if x.mean\(\) > 0:\).* "
                                         r"computed by layers.1"):
        SplitPlan(module, units, trace, [0, 2, 4], ranks=2)
    SplitPlan(module, units, trace, [0, 1, 4], ranks=2)  # layers.1 and the branch both on the last chunk


def test_control_flow_that_differs_from_the_sample_raises():
    class Skips(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(3)])

        def forward(self, x, skip_middle=False):
            for index, layer in enumerate(self.layers):
                if not (skip_middle and index == 1):
                    x = layer(x)
            return x

    module = Skips()
    with torch.no_grad():
        plan, _ = chained(module, {"x": torch.randn(2, 3)}, [0, 2, 3])
        with pytest.raises(SplitError, match="unit call 1 is layers.2, but the sample forward made layers.1"):
            split.SplitChunk(plan, 0, torch.device("cpu"))(None, {"x": torch.randn(2, 3), "skip_middle": True})


def test_a_module_without_units_is_refused():
    with pytest.raises(SplitError, match="calls no submodule with parameters"):
        split.trace_module(torch.nn.ReLU(), torch.randn(2))

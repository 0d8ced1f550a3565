"""hp.PipelineModel(module, sample=...): ordinary nn.Modules -- transformers GPT-2 (tied head), Llama (RoPE),
BERT (dict inputs with an attention mask, tied decoder), T5 (encoder output used by every decoder block), ViT
and ResNet, and hand-written ones (a U-Net's skips, a block applied twice, a keyword-only forward returning a
dict) -- split over a real mpirun and trained 3 steps: the parameters equal one process training the same
micro-batches (float64). Also: names are the module's own, a full state_dict loads into the stages, a branch on
an activation is refused, split points by name. make test runs a slice of the (model, grid, schedule)
matrix; make test-long runs all of it. Checks go through ranks_agree (or agreed()), after the steps they check:
a check failing on one rank fails every rank there, none is left waiting in the next step or in close()."""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.pipeline import microbatch
from hybridpipe.pipeline.split import SplitError
from split_models import MODELS, Branching

pytestmark = pytest.mark.mpi(ranks=[4], long_ranks=[2], timeout=300, shared=True)

torch.set_num_threads(1)
WORLD = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)
LONG = os.environ.get("HYBRIDPIPE_LONG_TESTS") == "1"
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
GRIDS = {4: [4, 2], 2: [2]}.get(WORLD, [WORLD])  # pipeline stages; the rest are replicas (P=2 on 4 ranks: 2 × 2)
# make test: the grids and schedules spread over the models whose routing differs most (a tied head, RoPE, a dict
# with a padding mask, an encoder output read by every decoder block, skips, a block on two stages); make test-long:
# every model × schedule × grid (tests/pipeline/test_split.py runs every model's split forward without MPI)
SLICE = {
    4: [("gpt2", "interleaved-1f1b"), ("t5", "1f1b"), ("unet", "gpipe"), ("shared_loop", "zb-h1")],
    2: [("llama", "zb-h1"), ("bert", "gpipe")],
}
CASES = sorted({(m, s) for m in MODELS for s in SCHEDULES} if LONG else {c for cs in SLICE.values() for c in cs})
MICRO_BATCHES = 4
PER_REPLICA = 8


@pytest.fixture(scope="module", params=GRIDS, ids=lambda p: f"P{p}")
def grid(request):
    the_grid = hp.init(pipeline_stages=request.param)
    yield the_grid
    hp.shutdown()


def build(name: str, grid, schedule: str, **options):
    module, batch, loss_fn = MODELS[name]()
    module = module.double()
    reference = copy.deepcopy(module)
    extra = {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {}
    sample, _ = batch(PER_REPLICA // MICRO_BATCHES, 0)
    model = hp.PipelineModel(module, loss_fn=loss_fn, micro_batches=MICRO_BATCHES, schedule=schedule, sample=sample,
                             **extra, **options)
    return model, reference, batch, loss_fn


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def agreed(problem: str | None) -> None:
    """Every rank's outcome, asserted on every rank (a failure on one rank fails all of them, none waits)."""
    problems = [f"rank {rank}: {text}" for rank, text in enumerate(hp.allgather_object(problem, group="world")) if text]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name,schedule", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_trains_like_one_process(grid, float64, name, schedule):
    if not LONG and (name, schedule) not in SLICE.get(grid.pipeline_stages, []):
        pytest.skip("in make test-long")
    try:
        model, reference, batch, loss_fn = build(name, grid, schedule)
    except SplitError as error:
        if "fewer than the" not in str(error):
            raise
        pytest.skip(str(error))  # more chunks than the model has unit calls (make test-long's matrix)
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        shards = [batch(PER_REPLICA, 10 * step + replica + 1) for replica in range(grid.data_replicas)]
        optimizer.zero_grad()
        loss = model.train_step(*shards[grid.replica])
        optimizer.step()
        reference_optimizer.zero_grad()
        losses = []
        for inputs, targets in shards:
            for x, y in zip(microbatch.split(inputs, MICRO_BATCHES), microbatch.split(targets, MICRO_BATCHES)):
                output = reference(**x) if isinstance(x, dict) else reference(x)
                micro_loss = loss_fn(output, y)
                (micro_loss / (MICRO_BATCHES * len(shards))).backward()
                losses.append(float(micro_loss))
        reference_optimizer.step()
        mine = sum(losses[grid.replica * MICRO_BATCHES:(grid.replica + 1) * MICRO_BATCHES]) / MICRO_BATCHES
        agreed(None if loss == pytest.approx(mine, rel=1e-9) else f"step {step}: loss {loss} instead of {mine}")
    expected = dict(reference.named_parameters())
    own = dict(model.named_parameters())
    problem = None if own and set(own) <= set(expected) else f"parameters {sorted(own)} not of the module"
    for parameter_name, parameter in own.items():
        try:
            torch.testing.assert_close(parameter, expected[parameter_name], rtol=1e-7, atol=1e-10)
        except AssertionError as error:
            problem = problem or f"{parameter_name}: {error}"
    agreed(problem)
    # the stages of a pipeline hold every parameter between them, tied ones on several
    held = hp.allgather_object(sorted(own), group="world")
    model.close()
    with ranks_agree():
        assert set().union(*map(set, held)) == set(expected)


def test_names_state_dict_and_report(grid, float64):
    if grid.pipeline_stages != 4 and not LONG:
        pytest.skip("one grid in make test (every grid in make test-long)")
    model, reference, _, _ = build("gpt2", grid, "1f1b", split="auto")
    try:
        full = reference.state_dict()
        own = model.state_dict()
        with ranks_agree(what="state_dict"):
            assert own and set(own) <= set(full)
            assert all(not value.is_meta for value in own.values())
        # a full state_dict of the unsplit module (another initialization) loads into the stages
        torch.manual_seed(123)
        other = type(reference)(reference.config).double().state_dict()
        with ranks_agree(what="load_state_dict"):
            model.load_state_dict(other)
            for key, value in model.state_dict().items():
                assert torch.equal(value, other[key]), key
        with ranks_agree(what="an unexpected key"), pytest.raises(
                hp.HybridPipeError, match="unexpected keys \\['nonsense'\\]"):
            model.load_state_dict({**other, "nonsense": torch.zeros(1)})
        with ranks_agree(what="ties and the split report"):
            assert ("transformer.wte.weight", "lm_head.weight") in model.tied_parameter_names
            report = model.split_report()
            assert "chunk 0 (stage 0)" in report and "transformer.wte" in report and "lm_head" in report
            assert re.search(r"receives 1 value\(s\).*\n\s+transformer\.h\.\d: \(2, 12, 16\) float64", report), report
    finally:
        model.close()


def test_split_points_by_name(grid, float64):
    if grid.pipeline_stages != 2 and not LONG:
        pytest.skip("one grid in make test (every grid in make test-long)")
    names = ["transformer.h.1", "transformer.h.2", "transformer.h.3"][:grid.pipeline_stages - 1] \
        if grid.pipeline_stages == 4 else ["transformer.h.2"]
    model, *_ = build("gpt2", grid, "1f1b", split=names)
    first_block = {0: "transformer.wte", 1: names[0]}.get(grid.stage, names[grid.stage - 1])
    holds_it = any(n.startswith(first_block) for n, _ in model.named_parameters())
    model.close()
    with ranks_agree(what="the stage's first block"):
        assert holds_it, f"stage {grid.stage} does not begin with {first_block}"
    with ranks_agree(what="a split point that is not a unit"), pytest.raises(
            SplitError, match="split point 'transformer.h.9' is not a unit"):
        build("gpt2", grid, "1f1b", split=["transformer.h.9"] * (grid.pipeline_stages - 1))


def test_branch_on_an_activation_is_refused(grid):
    if grid.pipeline_stages != 2 and not LONG:
        pytest.skip("one grid in make test (every grid in make test-long)")
    torch.manual_seed(0)
    with ranks_agree():
        with pytest.raises(SplitError) as error:
            hp.PipelineModel(Branching(), loss_fn=torch.nn.functional.mse_loss, micro_batches=2,
                             sample=torch.randn(2, 6))
        message = str(error.value)
        assert "reads the value of an activation" in message and "layers.1" in message
        assert "split_models.py" in message and "x.mean() > 0" in message and "move the branch into a module" in message


def test_stages_that_begin_with_an_in_place_layer(grid, float64):
    """nn.ReLU(inplace=True) first on every stage (torchvision's style): the received activation is copied for it,
    and training equals one process (autograd refused the in-place change of the received leaf)."""
    if grid.pipeline_stages != 4 and not LONG:
        pytest.skip("one grid in make test (every grid in make test-long)")
    torch.manual_seed(0)
    layers = []
    for _ in range(grid.pipeline_stages):
        layers += [torch.nn.ReLU(inplace=True), torch.nn.Linear(6, 6)]
    reference = torch.nn.Sequential(*copy.deepcopy(layers))
    model = hp.PipelineModel(layers, loss_fn=torch.nn.functional.mse_loss, micro_batches=2, schedule="1f1b",
                             balance=[2] * grid.pipeline_stages)
    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.randn(4, 6)
    hp.broadcast_(y, root_rank=0, group="world")
    model.train_step(x, y)
    for chunk_x, chunk_y in zip(x.tensor_split(2), y.tensor_split(2)):
        (torch.nn.functional.mse_loss(reference(chunk_x.clone()), chunk_y) / 2).backward()
    expected = dict(reference.named_parameters())
    agreed(next((f"{n}: {p.grad} vs {expected[n.removeprefix('layers.')].grad}" for n, p in model.named_parameters()
                 if not torch.allclose(p.grad, expected[n.removeprefix("layers.")].grad, rtol=1e-9, atol=1e-12)),
                None))
    model.close()


def test_a_meta_module_is_built_stage_by_stage(grid, tmp_path_factory):
    """A transformers GPT-2 of 8 blocks built under torch.device("meta"): each rank allocates only its stage's
    parameters (a quarter on 4 stages, at most 0.35 of the model's bytes), initialized by transformers' own
    _init_weights; with weights= a safetensors file, each rank reads its tensors and equals the CPU model."""
    if grid.pipeline_stages != 4 and not LONG:
        pytest.skip("4 stages in make test (every grid in make test-long)")
    from safetensors.torch import save_file
    from transformers import GPT2LMHeadModel

    full, batch, loss_fn = MODELS["gpt2"](layers=8)
    total = sum(p.numel() * p.element_size() for p in full.parameters())
    path = tmp_path_factory.mktemp("weights") / "gpt2.safetensors" if hp.rank() == 0 else None
    if hp.rank() == 0:
        save_file({k: v.clone().contiguous() for k, v in full.state_dict().items()}, str(path))
    path = hp.broadcast_object(str(path) if path else None, root_rank=0, group="world")
    inputs, targets = batch(8, 1)
    for weights in (None, path):
        with torch.device("meta"):
            module = GPT2LMHeadModel(full.config)
        model = hp.PipelineModel(module, loss_fn=loss_fn, micro_batches=4, sample={"input_ids": inputs["input_ids"][:2]},
                                 weights=weights)
        mine = sum(p.numel() * p.element_size() for p in model.parameters())
        problem = None if mine <= (0.35 if grid.pipeline_stages == 4 else 0.6) * total else \
            f"holds {mine} of {total} parameter bytes"
        if weights is not None:
            expected = full.state_dict()
            problem = problem or next((k for k, v in model.state_dict().items() if not torch.equal(v, expected[k])),
                                      None)
        loss = model.train_step(inputs, targets)
        problem = problem or (None if 3.0 < loss < 4.5 else f"first loss {loss} (vocabulary 48: ln 48 = 3.87)")
        agreed(problem)
        model.close()
    with ranks_agree(what="verify=True"), pytest.raises(
            hp.HybridPipeError, match="verify=True needs the module's weights"):
        with torch.device("meta"):
            module = GPT2LMHeadModel(full.config)
        hp.PipelineModel(module, loss_fn=loss_fn, micro_batches=4, sample={"input_ids": inputs["input_ids"][:2]},
                         verify=True)


def test_stages_given_different_batches_fail_on_every_rank(grid, float64):
    """A pipeline's stages fed different samples (a sampler sharded by rank, not by replica): the first activation
    message carries stage 0's batch fingerprint, the next stage refuses it, and every stage raises, naming the fix
    (this trained at chance without a word). Equal batches pass, and the switch (model.check_batches,
    HYBRIDPIPE_CHECK_BATCHES) lets a mismatch through when off."""
    if grid.pipeline_stages != 4 and not LONG:
        pytest.skip("one grid in make test (every grid in make test-long)")
    model, _, batch, _ = build("keyword_dict", grid, "1f1b", split="auto", verify=False)
    try:
        with ranks_agree(what="the default"):
            assert model.check_batches  # on by default (HYBRIDPIPE_CHECK_BATCHES)
        same = batch(PER_REPLICA, 7)
        model.train_step(*same)
        model.check_batches = False
        model.train_step(*batch(PER_REPLICA, 8 + grid.stage))  # unchecked: runs (and would train on garbage)
        model.check_batches = True
        with ranks_agree(what="different batches"):
            with pytest.raises(hp.HybridPipeError) as error:
                model.train_step(*batch(PER_REPLICA, 8 + grid.stage))
            text = str(error.value)
            assert "was given a different batch than stage" in text and "num_replicas=grid.data_replicas" in text, text
            assert "same shapes, different values" in text, text
    finally:
        model.close()

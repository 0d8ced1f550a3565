"""The contract between the pipeline and data parallelism (hybridpipe/gradient_sync.py) under a real mpirun: a
recording GradientSync registered on a PipelineModel hears, on each rank, exactly the calls its schedule implies
(forward pairs, backward pairs with ``last`` on each chunk's last B or W, every final gradient inside the last
one, a re-materialized forward inside its backward, tied weights never final, then step_ends); without a pipeline,
plain autograd drives it through the gradient hooks; and no Parameter carries an attribute of hybridpipe's."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe import runtime
from hybridpipe.gradient_sync import GradientSync, drivers_of
from hybridpipe.pipeline import schedule as sched
from hybridpipe.pipeline.schedule import ActionKind

pytestmark = pytest.mark.mpi(ranks=[2], timeout=240, shared=True)

torch.set_num_threads(1)
DIM, M = 4, 4


class Recorder(GradientSync):
    """Every call, in order; a run of gradient_final calls becomes one event with the sorted names."""

    def __init__(self, names: dict) -> None:
        self.names, self.events = names, []

    def forward_begins(self, unit):
        self.events.append(("forward_begins", unit.index))

    def forward_ends(self, unit):
        self.events.append(("forward_ends", unit.index))

    def backward_begins(self, unit, last):
        self.events.append(("backward_begins", unit.index, last))

    def gradient_final(self, parameter):
        name = self.names[id(parameter)]
        if self.events and self.events[-1][0] == "gradient_final":
            self.events[-1] = ("gradient_final", tuple(sorted(self.events[-1][1] + (name,))))
        else:
            self.events.append(("gradient_final", (name,)))

    def backward_ends(self, unit, last):
        self.events.append(("backward_ends", unit.index, last))

    def step_ends(self):
        self.events.append(("step_ends",))


@pytest.fixture
def pipeline():
    yield hp.init(pipeline_stages=2)
    hp.shutdown()


def mlp(chunks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*itertools.chain.from_iterable((nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(chunks)))


def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, DIM, generator=generator), torch.randn(8, DIM, generator=generator)


def expected(actions, finals: dict, recompute: bool) -> list:
    """The calls ``actions`` imply; ``finals``: chunk -> the names whose gradients its last backward makes final."""
    last = {a.stage: i for i, a in enumerate(actions) if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)}
    events = []
    for index, action in enumerate(actions):
        chunk = action.stage
        if action.kind is ActionKind.FORWARD:
            events += [("forward_begins", chunk), ("forward_ends", chunk)]
            continue
        is_last = last[chunk] == index
        events.append(("backward_begins", chunk, is_last))
        if recompute and action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            events += [("forward_begins", chunk), ("forward_ends", chunk)]
        if is_last and finals[chunk]:
            events.append(("gradient_final", tuple(sorted(finals[chunk]))))
        events.append(("backward_ends", chunk, is_last))
    return events + [("step_ends",)]


def chunk_names(model, chunk: int) -> list[str]:
    prefixes = tuple(f"layers.{i}." for i in model.layers_of_chunk(chunk))
    return [name for name, _ in model.named_parameters() if name.startswith(prefixes)]


@pytest.mark.parametrize("schedule, virtual, checkpoint", [
    ("1f1b", 1, "never"), ("zb-h1", 1, "never"), ("1f1b", 1, "always"), ("interleaved-1f1b", 2, "never")])
def test_the_schedule_drives_the_registered_syncs(pipeline, schedule, virtual, checkpoint):
    model = hp.PipelineModel(mlp(2 * virtual), loss_fn=nn.functional.mse_loss, micro_batches=M, schedule=schedule,
                             virtual_stages=virtual, checkpoint=checkpoint)
    recorder = Recorder({id(p): name for name, p in model.named_parameters()})
    registration = model.register_gradient_sync(recorder)
    opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    x, y = batch()
    model.train_step(x, y)
    opt.step()
    actions = sched.get_schedule(schedule, 2, M, virtual)[pipeline.stage]
    own = range(pipeline.stage, 2 * virtual, 2)
    want = expected(actions, {c: chunk_names(model, c) for c in own}, recompute=checkpoint == "always")
    drivers = drivers_of(runtime.job("test"))
    with ranks_agree():
        assert recorder.events == want
        # the optimizer registered with the pipeline that runs its parameters, beside the recorder
        first = next(model.parameters())
        assert drivers.runner_of(first) is not None
        assert drivers.syncs_of(first)[0] is recorder and len(drivers.syncs_of(first)) == 2
    registration.remove()
    recorder.events.clear()
    opt.zero_grad()
    model.train_step(x, y)
    opt.step()
    with ranks_agree():
        assert recorder.events == []


def test_the_last_backward_of_each_chunk_signals(pipeline):
    """1F1B on 2 stages, 4 micro-batches: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3 and its gradients are final only
    in B3; stage 1 runs F0 B0 F1 B1 F2 B2 F3 B3, final only in its B3 too."""
    model = hp.PipelineModel(mlp(2), loss_fn=nn.functional.mse_loss, micro_batches=M, schedule="1f1b")
    recorder = Recorder({id(p): name for name, p in model.named_parameters()})
    model.register_gradient_sync(recorder)
    model.train_step(*batch())
    backwards = [e for e in recorder.events if e[0] in ("backward_begins", "gradient_final")]
    with ranks_agree():
        assert [e[2] if e[0] == "backward_begins" else "final" for e in backwards] == \
            [False, False, False, True, "final"]
        assert recorder.events[-1] == ("step_ends",)


def test_a_tied_weight_is_never_final_in_a_backward(pipeline):
    torch.manual_seed(0)
    vocab = 6
    embedding, head = nn.Embedding(vocab, DIM), nn.Linear(DIM, vocab, bias=False)
    head.weight = embedding.weight
    model = hp.PipelineModel([embedding, nn.Linear(DIM, DIM), nn.Tanh(), head], loss_fn=nn.functional.cross_entropy,
                             micro_batches=2, balance=[2, 2])
    names = {id(p): name for name, p in model.named_parameters()}
    recorder = Recorder(names)
    model.register_gradient_sync(recorder)
    tokens = torch.arange(8) % vocab
    model.train_step(tokens, tokens.flip(0))
    final = {name for event in recorder.events if event[0] == "gradient_final" for name in event[1]}
    tied = set(itertools.chain.from_iterable(model.tied_parameter_names))
    with ranks_agree():
        assert final == set(names.values()) - tied
        assert recorder.events[-1] == ("step_ends",)


def test_plain_autograd_drives_it_through_the_hooks():
    hp.init()
    try:
        module = mlp(1)
        opt = hp.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1),
                                      named_parameters=module.named_parameters(), backward_passes_per_step=2)
        recorder = Recorder({id(p): name for name, p in module.named_parameters()})
        drivers = drivers_of(runtime.job("test"))
        drivers.register(recorder, module.parameters())
        x, y = batch()
        for _ in range(2):
            nn.functional.mse_loss(module(x), y).backward()
        opt.step()
        with ranks_agree():
            assert drivers.runner_of(module[0].weight) is None  # no pipeline runs it
            # each accumulation is final (no unit events between the two backwards: one run of four calls)
            assert recorder.events == [("gradient_final", ("0.bias", "0.bias", "0.weight", "0.weight"))]
    finally:
        hp.shutdown()


class Blocks(nn.Module):
    """A module that is not a layer list (PipelineModel traces and splits it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = mlp(2)

    def forward(self, x):
        return self.blocks(x)


@pytest.mark.parametrize("zero, split", [(0, False), (2, False), (1, True)])
def test_no_parameter_carries_an_attribute(pipeline, zero, split):
    layers = Blocks() if split else mlp(2)
    before = {id(p): set(vars(p)) for p in layers.parameters()}
    extra = dict(sample=batch()[0][:2]) if split else {}
    model = hp.PipelineModel(layers, loss_fn=nn.functional.mse_loss, micro_batches=M, schedule="zb-h1", **extra)
    opt = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), zero=zero)
    model.train_step(*batch())
    hp.clip_grad_norm_(model, 1.0)
    opt.step()
    with ranks_agree():
        assert {name: sorted(set(vars(p)) - before[id(p)]) for name, p in model.named_parameters()} == \
            {name: [] for name, _ in model.named_parameters()}
        assert all(not vars(p) for p in model.parameters())


def test_no_parameter_of_an_asynchronous_pipeline_carries_an_attribute(pipeline):
    model = hp.PipelineModel(mlp(2), loss_fn=nn.functional.mse_loss, micro_batches=M, schedule="pipedream",
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    model.train_step(*batch())
    model.flush()
    with ranks_agree():
        assert all(not vars(p) for p in model.parameters())
    with pytest.raises(hp.HybridPipeError, match="updates the weights inside the pipeline"):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(hp.HybridPipeError, match="steps its own optimizer"):
        hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())

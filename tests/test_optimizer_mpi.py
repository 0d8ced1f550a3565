"""DistributedOptimizer on the 2-D grid under a real mpirun: parameters after 3 steps equal one-process
training on the same global batches, for grids 1×1, 2×1, 1×2, 2×2 and 4×2. Training and its checks run in
ranks_agree blocks (the steps first, the checks after), so a check failing on one rank fails every rank there."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.errors import HybridPipeError

pytestmark = pytest.mark.mpi(ranks=[2], long_ranks=[1, 4, 8], timeout=400, shared=True)

torch.set_num_threads(1)
SIZE = MPI.COMM_WORLD.size
# (stages, replicas) grids this launch can form: 1 → 1×1; 2 → 2×1, 1×2; 4 → 2×2; 8 → 4×2
GRIDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2)], 8: [(4, 2)]}[SIZE]
STEPS, PER_REPLICA = 3, 8


@pytest.fixture(params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def grid(request):
    stages, _ = request.param
    hp.shutdown()
    yield hp.init(pipeline_stages=stages)
    hp.shutdown()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(),
                         nn.Linear(10, 3))


def global_batches(replicas: int, steps: int = STEPS, per_replica: int = PER_REPLICA):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(replicas * per_replica, 6, generator=generator),
             torch.randint(0, 3, (replicas * per_replica,), generator=generator)) for _ in range(steps)]


def shard(batch, grid, per_replica: int = PER_REPLICA):
    rows = slice(grid.replica * per_replica, (grid.replica + 1) * per_replica)
    return batch[0][rows], batch[1][rows]


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01),
}


def reference_parameters(make_optimizer, batches, passes: int = 1) -> dict[str, torch.Tensor]:
    model = mlp()
    optimizer = make_optimizer(model.parameters())
    for index in range(0, len(batches), passes):
        optimizer.zero_grad()
        inputs = torch.cat([b[0] for b in batches[index:index + passes]])
        targets = torch.cat([b[1] for b in batches[index:index + passes]])
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    return {f"layers.{name}": p.detach() for name, p in model.named_parameters()}


def assert_matches(named, expected, rtol=1e-5, atol=1e-6):
    named = list(named)
    assert named
    for name, parameter in named:
        torch.testing.assert_close(parameter.detach(), expected[name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_and_data_parallel_equal_one_process(grid, schedule, optimizer_name):
    batches = global_batches(grid.data_replicas)
    expected = reference_parameters(OPTIMIZERS[optimizer_name], batches)
    model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform",
                             schedule=schedule)
    optimizer = hp.DistributedOptimizer(OPTIMIZERS[optimizer_name](model.parameters()),
                                        named_parameters=model.named_parameters())
    try:
        with ranks_agree(what="the wrapped class"):
            assert isinstance(optimizer, type(OPTIMIZERS[optimizer_name]([nn.Parameter(torch.zeros(1))])))
        with ranks_agree(what="after training"):
            for batch in batches:
                optimizer.zero_grad()
                model.train_step(*shard(batch, grid))
                optimizer.step()
            assert_matches(model.named_parameters(), expected)
    finally:
        model.close()


def test_horovod_style_plain_module(grid):
    """import hybridpipe as hvd: a plain nn.Module with pipeline_stages=1 is pure data parallelism."""
    if grid.pipeline_stages != 1:
        pytest.skip("pure data parallelism needs pipeline_stages=1")
    hvd = hp
    batches = global_batches(grid.data_replicas)
    expected = {name.removeprefix("layers."): p for name, p in
                reference_parameters(OPTIMIZERS["adamw"], batches).items()}
    torch.manual_seed(100 + hvd.rank())  # different initial weights everywhere ...
    model = nn.Sequential(*[copy.deepcopy(layer) for layer in mlp()])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (hvd.rank() > 0))
    with ranks_agree():
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # ... until rank 0's are broadcast
        optimizer = OPTIMIZERS["adamw"](model.parameters())
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=1.0)  # schedulers still work
        for batch in batches:
            optimizer.zero_grad()
            inputs, targets = shard(batch, grid)
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            scheduler.step()
        assert_matches(model.named_parameters(), expected)


def test_backward_passes_per_step_two_equals_a_doubled_batch(grid):
    batches = global_batches(grid.data_replicas, steps=4)
    expected = reference_parameters(OPTIMIZERS["sgd"], batches, passes=2)
    model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform")
    optimizer = hp.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                        named_parameters=model.named_parameters(), backward_passes_per_step=2)
    try:
        with ranks_agree():
            for index in range(0, len(batches), 2):
                optimizer.zero_grad()
                for batch in batches[index:index + 2]:
                    model.train_step(*shard(batch, grid))
                optimizer.step()
            assert_matches(model.named_parameters(), expected)
    finally:
        model.close()


def test_clip_grad_norm_is_global_over_stages_and_replicas(grid):
    batches = global_batches(grid.data_replicas, steps=1)
    reference = mlp()
    inputs, targets = batches[0]
    nn.functional.cross_entropy(reference(inputs), targets).backward()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
    expected = {f"layers.{name}": p.grad for name, p in reference.named_parameters()}
    model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform")
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    try:
        with ranks_agree():
            model.train_step(*shard(batches[0], grid))
            optimizer.synchronize()
            norm = hp.clip_grad_norm_(model, 0.05)
            assert norm == pytest.approx(expected_norm, rel=1e-5)
            assert_matches(((n, p.grad) for n, p in model.named_parameters()), expected)
        with optimizer.skip_synchronize():
            optimizer.step()
    finally:
        model.close()


def test_fp16_compression_is_close(grid):
    batches = global_batches(grid.data_replicas)
    expected = reference_parameters(OPTIMIZERS["sgd"], batches)
    model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform")
    optimizer = hp.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                        named_parameters=model.named_parameters(),
                                        compression=hp.Compression.fp16)
    try:
        with ranks_agree():
            for batch in batches:
                optimizer.zero_grad()
                model.train_step(*shard(batch, grid))
                optimizer.step()
            assert_matches(model.named_parameters(), expected, rtol=1e-2, atol=1e-3)
            for _, p in model.named_parameters():
                assert p.dtype == torch.float32
    finally:
        model.close()


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, use_b: bool):
        h = self.body(x)
        return self.a(h) + (self.b(h) if use_b else 0)


def test_a_parameter_without_gradient_on_some_ranks_is_treated_alike(grid):
    if grid.pipeline_stages != 1:
        pytest.skip("plain module")
    model = TwoHeads()
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    x = torch.ones(3, 4)
    model(x, use_b=grid.replica == 0).sum().backward()  # head b gets a gradient on replica 0 only
    with ranks_agree():
        optimizer.synchronize()
        everyone = hp.allgather_object({n: None if p.grad is None else p.grad.clone()
                                        for n, p in model.named_parameters()})
        for name, grad in everyone[0].items():
            for other in everyone[1:]:
                torch.testing.assert_close(other[name], grad)
        # head b's gradient is replica 0's divided by the number of replicas (others contributed zeros)
        assert model.b.weight.grad is not None
    with optimizer.skip_synchronize():
        optimizer.step()


def test_objects(grid):
    with ranks_agree():
        broadcast = hp.broadcast_object({"step": 7 + grid.replica}, root_rank=0)
        replicas = hp.allgather_object(grid.replica)
        ranks = hp.allgather_object(grid.rank, group="world")
        assert broadcast == {"step": 7}
        assert replicas == list(range(grid.data_replicas))
        assert ranks == list(range(grid.size))
    with ranks_agree(what="a root outside"), pytest.raises(
            ValueError, match=rf"root_rank {grid.data_replicas} is outside"):
        hp.broadcast_object(1, root_rank=grid.data_replicas)


def test_errors(grid):
    model = nn.Linear(2, 2)
    with ranks_agree(what="a list"), pytest.raises(TypeError, match="wraps a torch.optim.Optimizer, got list"):
        hp.DistributedOptimizer([1, 2])
    with ranks_agree(what="op=Min"), pytest.raises(
            ValueError, match="op must be hp.Average, hp.Sum or hp.Adasum \\(got Min\\)"):
        hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), op=hp.Min)
    with ranks_agree(what="backward_passes_per_step=0"), pytest.raises(
            ValueError, match="backward_passes_per_step must be a positive int \\(got 0\\)"):
        hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), backward_passes_per_step=0)
    with ranks_agree(what="a missing name"), pytest.raises(ValueError, match="named_parameters misses 1 parameters"):
        hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1),
                                named_parameters=[("weight", model.weight)])
    with ranks_agree(what="duplicate names"), pytest.raises(ValueError, match="duplicate names \\['w'\\]"):
        hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1),
                                named_parameters=[("w", model.weight), ("w", model.bias)])
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1),
                                        named_parameters=model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    with ranks_agree(what="skip_synchronize without synchronize"), pytest.raises(
            HybridPipeError, match="call opt.synchronize\\(\\) first"):
        with optimizer.skip_synchronize():
            optimizer.step()
    with ranks_agree(what="step afterwards"):
        optimizer.step()  # the group is still consistent: every rank reduced once


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_reductions_start_during_the_last_backward_not_at_step(grid, schedule):
    batches = global_batches(grid.data_replicas, steps=2)
    model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=4, balance="uniform",
                             schedule=schedule)
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    names = sorted(name for name, _ in model.named_parameters())
    try:
        before = hp.engine_stats("data")["tensors"]
        alone = grid.data_replicas == 1  # a stage without replicas: nothing to reduce, the engine is left out
        with ranks_agree(what="after the last backward"):
            model.train_step(*shard(batches[0], grid))
            assert optimizer.in_flight() == ([] if alone else names)  # queued by the hooks, once each
            if not alone:
                with pytest.raises(HybridPipeError,
                                   match=r"zero_grad\(\) while \d+ gradient allreduces are in flight"):
                    optimizer.zero_grad()
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        with ranks_agree(what="after step"):
            optimizer.step()
            assert optimizer.in_flight() == []
            # each gradient once, plus step()'s one has-gradient agreement (also on the engine); none alone
            assert hp.engine_stats("data")["tensors"] - before == (0 if alone else len(names) + 1)
            if alone:  # the gradients are this rank's own, untouched
                for name, p in model.named_parameters():
                    torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=0)
        optimizer.zero_grad()
    finally:
        model.close()


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(0.3)  # the first layer's backward: the later layers' gradients are final already
        return grad


class SlowBackward(nn.Module):
    def forward(self, x):
        return _SlowBackward.apply(x)


def test_overlap_first_allreduce_starts_before_the_last_backward_ends(grid):
    """Engine timestamps: a gradient's ring allreduce begins while the stage is still in its last
    backward (a deliberately slow first layer keeps that backward busy for 0.3 s per micro-batch)."""
    if grid.data_replicas < 2:
        pytest.skip("needs data replicas to reduce over")
    layers = []
    for stage in range(grid.pipeline_stages):  # per stage: parameters, a slow layer, parameters
        last = stage == grid.pipeline_stages - 1
        layers += [nn.Linear(6 if stage == 0 else 10, 10), SlowBackward(), nn.Linear(10, 3 if last else 10)]
    torch.manual_seed(0)
    model = hp.PipelineModel(layers, loss_fn=nn.CrossEntropyLoss(), micro_batches=2,
                             balance=[3] * grid.pipeline_stages)
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    try:
        model.train_step(*shard(global_batches(grid.data_replicas, steps=1)[0], grid))
        backward_end = model.last_step.last_backward_finished
        handles = [optimizer._hp_handles[name][0] for name in optimizer.in_flight()]
        with ranks_agree():
            optimizer.synchronize()
            # a ring needs every replica's gradient: compare with the replica that finished last
            # (ranks run at different speeds on a busy machine; the clock is the same on one host)
            slowest_end = max(hp.allgather_object(backward_end))
            first_start = min(h.started_at for h in handles)
            assert 0 < first_start < slowest_end, (first_start, slowest_end)
    finally:
        model.close()

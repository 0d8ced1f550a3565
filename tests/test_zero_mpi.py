"""ZeRO-1 and ZeRO-2 (hp.DistributedOptimizer(..., zero=1|2)) under a real mpirun: the parameters after K
steps equal one-process training on the same global batches (and so the unsharded optimizer), on the
grids 1×2 (2 ranks), 1×4 and 2×2 (4 ranks), with SGD-momentum and AdamW; the optimizer state per
replica is at most 1/D of the unsharded state plus one bucket; clipping is global over shards and
stages; a checkpoint saved sharded loads into another zero level. Training and its checks run in ranks_agree
blocks (the steps first, the checks after), so a check failing on one rank fails every rank there."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.config import Config

pytestmark = pytest.mark.mpi(ranks=[2, 4], timeout=300, shared=True)

torch.set_num_threads(1)
SIZE = MPI.COMM_WORLD.size
GRIDS = {2: [(1, 2)], 4: [(1, 4), (2, 2)]}[SIZE]
STEPS, PER_REPLICA = 3, 8
# a small fusion threshold: several buckets per stage, parameters cut across replicas' pieces
CONFIG = Config(fusion_threshold_bytes=512)


@pytest.fixture(params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def grid(request):
    stages, _ = request.param
    hp.shutdown()
    yield hp.init(pipeline_stages=stages, config=CONFIG)
    hp.shutdown()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 9), nn.Tanh(),
                         nn.Linear(9, 3))


def global_batches(replicas: int, steps: int = STEPS):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(replicas * PER_REPLICA, 6, generator=generator),
             torch.randint(0, 3, (replicas * PER_REPLICA,), generator=generator)) for _ in range(steps)]


def shard(batch, grid):
    rows = slice(grid.replica * PER_REPLICA, (grid.replica + 1) * PER_REPLICA)
    return batch[0][rows], batch[1][rows]


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01),
}


def reference(make_optimizer, batches, clip=None):
    model = mlp()
    optimizer = make_optimizer(model.parameters())
    for inputs, targets in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {f"layers.{name}": p.detach() for name, p in model.named_parameters()}


def assert_matches(named, expected):
    named = list(named)
    assert named
    for name, parameter in named:
        torch.testing.assert_close(parameter.detach(), expected[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def train(grid, optimizer_name, zero, batches, clip=None, schedule="1f1b"):
    model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform",
                             schedule=schedule)
    optimizer = hp.DistributedOptimizer(OPTIMIZERS[optimizer_name](model.parameters()),
                                        named_parameters=model.named_parameters(), zero=zero)
    for batch in batches:
        optimizer.zero_grad()
        model.train_step(*shard(batch, grid))
        if clip is None:
            optimizer.step()
        else:
            optimizer.synchronize()
            hp.clip_grad_norm_(model, clip)
            with optimizer.skip_synchronize():
                optimizer.step()
    return model, optimizer


def state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0)


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_equals_one_process(grid, zero, optimizer_name):
    batches = global_batches(grid.data_replicas)
    expected = reference(OPTIMIZERS[optimizer_name], batches)
    model, optimizer = train(grid, optimizer_name, zero, batches)
    try:
        with ranks_agree():
            assert_matches(model.named_parameters(), expected)
            assert optimizer.zero == zero and isinstance(optimizer, torch.optim.Optimizer)
            # optimizer state: at most 1/D of the unsharded state plus one bucket (the padding)
            local = sum(p.numel() * p.element_size() for p in model.parameters())
            moments = 1 if optimizer_name == "sgd" else 2
            assert 0 < state_bytes(optimizer) <= moments * (local / grid.data_replicas + CONFIG.fusion_threshold_bytes)
            if zero == 2:  # the gradients were freed once sent: only the shard's remain
                assert all(p.grad is None for p in model.parameters())
            else:
                assert all(p.grad is not None for p in model.parameters())
    finally:
        model.close()


def test_zero_clip_grad_norm_is_global(grid):
    batches = global_batches(grid.data_replicas)
    expected = reference(OPTIMIZERS["sgd"], batches, clip=0.05)
    model, _ = train(grid, "sgd", 2, batches, clip=0.05)
    try:
        with ranks_agree():
            assert_matches(model.named_parameters(), expected)
    finally:
        model.close()


def test_zero_backward_passes_per_step(grid):
    batches = global_batches(grid.data_replicas, steps=4)
    model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform")
    optimizer = hp.DistributedOptimizer(OPTIMIZERS["adamw"](model.parameters()),
                                        named_parameters=model.named_parameters(), zero=1, backward_passes_per_step=2)
    reference_model = mlp()
    reference_optimizer = OPTIMIZERS["adamw"](reference_model.parameters())
    try:
        with ranks_agree():
            for index in range(0, len(batches), 2):
                optimizer.zero_grad()
                reference_optimizer.zero_grad()
                for batch in batches[index:index + 2]:
                    model.train_step(*shard(batch, grid))
                    (nn.functional.cross_entropy(reference_model(batch[0]), batch[1]) / 2).backward()
                optimizer.step()
                reference_optimizer.step()
            assert_matches(model.named_parameters(),
                           {f"layers.{n}": p.detach() for n, p in reference_model.named_parameters()})
    finally:
        model.close()


def test_zero_bad_level_and_unsupported_options(grid):
    model = nn.Linear(3, 3)
    with ranks_agree(what="zero=4"), pytest.raises(ValueError, match=r"zero must be one of 0, 1, 2, 3 \(got 4\)"):
        hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), zero=4)
    with ranks_agree(what="keep_gathered"), pytest.raises(ValueError, match=r"zero3_keep_gathered=True needs zero=3"):
        hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), zero=2, zero3_keep_gathered=True)
    with ranks_agree(what="compression"), pytest.raises(hp.errors.NotSupportedError, match="compression"):
        hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=hp.Compression.fp16, zero=1)


def test_zero_checkpoint_loads_into_another_zero_level(grid, tmp_path_factory):
    """Saved with zero=2 (each replica writes its own shard of the optimizer state), loaded with zero=0 and
    zero=1: training on from there equals training on without the checkpoint."""
    directory = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("zero")) if hp.rank() == 0 else None)
    batches = global_batches(grid.data_replicas, steps=4)
    model, optimizer = train(grid, "adamw", 2, batches[:2])
    hp.save_checkpoint(directory, model, optimizer, step=2)
    model.close()
    expected = reference(OPTIMIZERS["adamw"], batches)
    for zero in (0, 1):
        model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform")
        optimizer = hp.DistributedOptimizer(OPTIMIZERS["adamw"](model.parameters()),
                                            named_parameters=model.named_parameters(), zero=zero)
        try:
            with ranks_agree(what=f"loaded with zero={zero}"):
                hp.load_checkpoint(directory, model, optimizer)
                for batch in batches[2:]:
                    optimizer.zero_grad()
                    model.train_step(*shard(batch, grid))
                    optimizer.step()
                assert_matches(model.named_parameters(), expected)
        finally:
            model.close()


def test_zero_checkpoint_saved_with_four_replicas_loads_with_two(tmp_path_factory):
    """Saved on 1 × 4 with zero=2 (four optimizer shards), loaded on 2 × 2 (D = 2) with zero=0 and zero=1."""
    if SIZE != 4:
        pytest.skip("needs 4 ranks")
    directory = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("zero4")) if MPI.COMM_WORLD.rank == 0 else None)
    hp.shutdown()
    grid = hp.init(pipeline_stages=1, config=CONFIG)
    try:
        batches = global_batches(4, steps=4)
        model, optimizer = train(grid, "sgd", 2, batches[:2])
        hp.save_checkpoint(directory, model, optimizer, step=2)
        model.close()
    finally:
        hp.shutdown()
    expected = reference(OPTIMIZERS["sgd"], batches)
    grid = hp.init(pipeline_stages=2, config=CONFIG)
    try:
        for zero in (0, 1):
            model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform")
            optimizer = hp.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                                named_parameters=model.named_parameters(), zero=zero)
            try:
                with ranks_agree(what=f"loaded with zero={zero}"):
                    hp.load_checkpoint(directory, model, optimizer)
                    for inputs, targets in batches[2:]:  # the same global batch of 32, now 16 per replica
                        rows = slice(grid.replica * 16, (grid.replica + 1) * 16)
                        optimizer.zero_grad()
                        model.train_step(inputs[rows], targets[rows])
                        optimizer.step()
                    assert_matches(model.named_parameters(), expected)
            finally:
                model.close()
    finally:
        hp.shutdown()


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_zero_2_under_other_schedules(grid, schedule):
    batches = global_batches(grid.data_replicas)
    expected = reference(OPTIMIZERS["adamw"], batches)
    model, _ = train(grid, "adamw", 2, batches, schedule=schedule)
    try:
        with ranks_agree():
            assert_matches(model.named_parameters(), expected)
    finally:
        model.close()


def test_zero_with_fp16_scaler_and_clipping_equals_zero_0(grid):
    """fp16: unscale (the shards), clip globally, step through the agreed scaler: zero=1 ends where zero=0
    does, step by step."""
    batches = global_batches(grid.data_replicas)
    finals = []
    for zero in (0, 1):
        model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=2, balance="uniform",
                                 precision="fp16")
        optimizer = hp.DistributedOptimizer(OPTIMIZERS["adamw"](model.parameters()),
                                            named_parameters=model.named_parameters(), zero=zero)
        norms = []
        try:
            for step, batch in enumerate(batches):
                optimizer.zero_grad()
                model.train_step(*shard(batch, grid))
                model.scaler.unscale_(optimizer)
                norms.append(hp.clip_grad_norm_(model, 0.05))
                with ranks_agree(what=f"zero={zero}, step {step}"):
                    stepped = model.scaler.step(optimizer)
                    assert stepped
                model.scaler.update()
            finals.append(({n: p.detach().clone() for n, p in model.named_parameters()}, norms))
        finally:
            model.close()
    (zero0, norms0), (zero1, norms1) = finals
    with ranks_agree():
        assert norms1 == pytest.approx(norms0, rel=1e-5) and min(norms0) > 0.05  # the clip was active
        assert_matches(zero1.items(), zero0)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_staged_through_host_buffers_equals_one_process(grid, zero, monkeypatch):
    """The GPU path's staging (each bucket's reduced piece in a host buffer, then copied into the shard's
    gradient; the updated pieces copied to a host buffer for the allgather) run on CPU shards: the same
    training as one process, clipping included (make gpu-check runs it with CUDA shards)."""
    from hybridpipe.data_parallel import zero as zero_module

    monkeypatch.setattr(zero_module, "STAGE_CPU_SHARDS", True)
    batches = global_batches(grid.data_replicas)
    expected = reference(OPTIMIZERS["adamw"], batches, clip=0.05)
    model, optimizer = train(grid, "adamw", zero, batches, clip=0.05)
    try:
        with ranks_agree():
            assert_matches(model.named_parameters(), expected)
            assert not optimizer._hp_zstaged and not optimizer._hp_zhandles  # every staged piece was copied in
    finally:
        model.close()

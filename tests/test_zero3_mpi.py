"""ZeRO-3 (hp.DistributedOptimizer(..., zero=3)) under a real mpirun, float64: after 3 AdamW steps the parameters
equal one process on the same global batches, on 1 × 2, 1 × 4 and 2 × 2 under gpipe, 1f1b, interleaved-1f1b and
zb-h1, with re-materialization, global clipping, weights tied across stages and zero3_keep_gathered, and without a
pipeline (a plain nn.Module); between uses every parameter is freed (only the shard holds the weights) and a
module's parameters are whole while it runs, never the whole stage at once; a checkpoint saved with zero=3 on
2 × 2 resumes on 1 × 4 with zero=0 and on 4 × 1. Training runs in ranks_agree blocks, so a check failing on one
rank fails every rank."""

from __future__ import annotations

import math

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
CONFIG = Config(fusion_threshold_bytes=512)  # several buckets per chunk, parameters cut across the pieces


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


@pytest.fixture(params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def grid(request):
    stages, _ = request.param
    hp.shutdown()
    yield hp.init(pipeline_stages=stages, config=CONFIG)
    hp.shutdown()


class Head(nn.Module):
    """The output head reading the embedding's weight (tied, as a language model's)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def layers(tied: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    if tied:
        embedding = nn.Embedding(7, 6)
        return [embedding, nn.Linear(6, 13), nn.Tanh(), nn.Linear(13, 6), nn.Tanh(), nn.Linear(6, 6), Head(embedding)]
    return [nn.Linear(6, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 9), nn.Tanh(), nn.Linear(9, 3)]


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


def global_batches(replicas: int, tied: bool = False, steps: int = STEPS):
    generator = torch.Generator().manual_seed(3)
    rows = replicas * PER_REPLICA
    if tied:
        return [(torch.randint(0, 7, (rows,), generator=generator), torch.randint(0, 7, (rows,), generator=generator))
                for _ in range(steps)]
    return [(torch.randn(rows, 6, generator=generator), torch.randint(0, 3, (rows,), generator=generator))
            for _ in range(steps)]


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def reference(batches, tied: bool = False, clip: float | None = None) -> dict[str, torch.Tensor]:
    model = nn.Sequential(*layers(tied))
    optimizer = adamw(model.parameters())
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {f"layers.{name}": p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def shard(batch, grid):
    rows = slice(grid.replica * PER_REPLICA, (grid.replica + 1) * PER_REPLICA)
    return batch[0][rows], batch[1][rows]


def build(schedule: str = "1f1b", tied: bool = False, checkpoint: str = "never", zero: int = 3, **options):
    model = hp.PipelineModel(layers(tied), loss_fn=loss_fn, micro_batches=2, balance="uniform", schedule=schedule,
                             checkpoint=checkpoint, virtual_stages=2 if schedule == "interleaved-1f1b" else 1)
    optimizer = hp.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                        zero=zero, **options)
    return model, optimizer


def train(model, optimizer, grid, batches, clip: float | None = None) -> None:
    for batch in batches:
        optimizer.zero_grad()
        model.train_step(*shard(batch, grid))
        if clip is None:
            optimizer.step()
            continue
        optimizer.synchronize()
        hp.clip_grad_norm_(model, clip)
        with optimizer.skip_synchronize():
            optimizer.step()


def assert_whole_and_equal(model, optimizer, expected) -> None:
    with optimizer.full_parameters() as full:
        named = dict(model.named_parameters())
        assert named and set(full) == set(named)
        for name, parameter in named.items():
            torch.testing.assert_close(parameter.detach(), expected[name], rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")


def freed(model) -> bool:
    """Every parameter freed: the shard alone holds the weights."""
    return all(p.numel() == 0 for p in model.parameters())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
def test_zero3_equals_one_process(grid, schedule):
    if schedule == "interleaved-1f1b" and grid.pipeline_stages == 1:
        pytest.skip("interleaved needs stages")
    batches = global_batches(grid.data_replicas)
    expected = reference(batches)
    model, optimizer = build(schedule)
    try:
        with ranks_agree(what=schedule):
            assert optimizer.zero == 3 and all(p.numel() == 0 for p in model.parameters())
            train(model, optimizer, grid, batches)
            assert all(p.numel() == 0 for p in model.parameters()) and all(p.grad is None for p in model.parameters())
            assert_whole_and_equal(model, optimizer, expected)
            assert all(p.numel() == 0 for p in model.parameters())  # freed again after full_parameters
            # each replica keeps 1/D of its stage's parameters (plus each bucket's padding)
            shards = sum(s.numel() for s in optimizer.shard_parameters())
            whole = sum(math.prod(shape) for shape in optimizer.parameter_shapes().values())
            assert whole / grid.data_replicas <= shards <= whole / grid.data_replicas + 8 * grid.data_replicas
    finally:
        model.close()


@pytest.mark.parametrize("variant", ["recompute", "clip", "keep_gathered"])
def test_zero3_with_recompute_clipping_and_kept_gathers(grid, variant):
    batches = global_batches(grid.data_replicas)
    clip = 0.05 if variant == "clip" else None
    expected = reference(batches, clip=clip)
    options = {"zero3_keep_gathered": True} if variant == "keep_gathered" else {}
    model, optimizer = build(checkpoint="always" if variant == "recompute" else "never", **options)
    try:
        with ranks_agree(what=variant):
            train(model, optimizer, grid, batches, clip=clip)
            assert freed(model)  # kept gathers end at the step too
            assert_whole_and_equal(model, optimizer, expected)
    finally:
        model.close()


def test_zero3_gathers_a_module_only_while_it_runs(grid):
    """Each layer's own parameters are whole inside its forward and freed once it returns, and never the whole
    stage at once: the gathers go module by module (the gradients, checked above, need the backward's too).
    Buckets of one parameter each: a bucket is what is gathered, and 512 bytes' span layers."""
    stages = grid.pipeline_stages
    hp.shutdown()
    grid = hp.init(pipeline_stages=stages, config=Config(fusion_threshold_bytes=64))
    batches = global_batches(grid.data_replicas)
    model, optimizer = build()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    whole = sum(math.prod(shape) for shape in optimizer.parameter_shapes().values()) * 8
    seen = []

    def inside(module, args):  # (the optimizer's global hook ran first)
        seen.append(("inside", all(p.numel() > 0 for p in module.parameters()),
                     sum(p.numel() for p in model.parameters())))

    def after(module, args, output):
        seen.append(("after", all(p.numel() == 0 for p in module.parameters()), 0))

    handles = [h for m in linears for h in (m.register_forward_pre_hook(inside), m.register_forward_hook(after))]
    try:
        with ranks_agree(what="gathered while running"):
            assert len(linears) >= 2
            train(model, optimizer, grid, batches[:1])
            assert {kind for kind, _, _ in seen} == {"inside", "after"} and all(ok for _, ok, _ in seen), seen
            assert max(n for _, _, n in seen) < whole // 8, seen  # elements gathered at once < the stage's
            assert 0 < optimizer.gathered_peak_bytes < whole, (optimizer.gathered_peak_bytes, whole)
            assert freed(model)
    finally:
        for handle in handles:
            handle.remove()
        model.close()


def test_zero3_with_weights_tied_across_stages():
    if SIZE != 4:
        pytest.skip("needs 4 ranks")
    hp.shutdown()
    grid = hp.init(pipeline_stages=2, config=CONFIG)
    try:
        batches = global_batches(grid.data_replicas, tied=True)
        expected = reference(batches, tied=True)
        model, optimizer = build(tied=True)
        try:
            with ranks_agree(what="tied"):
                train(model, optimizer, grid, batches)
                # the tied weight's copies stay whole on their holders, up to date after each step; the rest is freed
                whole = {name: p for name, p in model.named_parameters() if p.numel()}
                assert set(whole) == ({"layers.0.weight"} if grid.stage == 0 else {"layers.6.weight"}), set(whole)
                for name, parameter in whole.items():
                    torch.testing.assert_close(parameter.detach(), expected[name], rtol=1e-9, atol=1e-12)
                assert_whole_and_equal(model, optimizer, expected)
        finally:
            model.close()
    finally:
        hp.shutdown()


def test_zero3_checkpoint_resumes_on_other_grids_with_other_levels(tmp_path_factory):
    """Saved with zero=3 on 2 × 2 after 2 steps; loaded on 1 × 4 with zero=0 and on 4 × 1 (one replica: zero=0),
    two more steps each equal one process's four."""
    if SIZE != 4:
        pytest.skip("needs 4 ranks")
    directory = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("zero3")) if MPI.COMM_WORLD.rank == 0 else None)
    batches = global_batches(4 // 2, steps=2) + global_batches(4 // 2, steps=2)
    hp.shutdown()
    grid = hp.init(pipeline_stages=2, config=CONFIG)
    try:
        model, optimizer = build()
        train(model, optimizer, grid, batches[:2])
        hp.save_checkpoint(directory, model, optimizer, step=2)
        model.close()
    finally:
        hp.shutdown()
    expected = reference(batches)
    for stages in (1, 4):
        grid = hp.init(pipeline_stages=stages, config=CONFIG)
        try:
            model, optimizer = build(zero=0)
            try:
                with ranks_agree(what=f"resumed on {stages} stages"):
                    hp.load_checkpoint(directory, model, optimizer)
                    for inputs, targets in batches[2:]:  # the same global batches of 16 rows, cut over D replicas
                        rows = inputs.shape[0] // grid.data_replicas
                        part = slice(grid.replica * rows, (grid.replica + 1) * rows)
                        optimizer.zero_grad()
                        model.train_step(inputs[part], targets[part])
                        optimizer.step()
                    for name, parameter in model.named_parameters():
                        torch.testing.assert_close(parameter.detach(), expected[name], rtol=1e-9, atol=1e-12)
            finally:
                model.close()
        finally:
            hp.shutdown()


def test_zero3_loads_a_checkpoint_into_its_shards(grid, tmp_path_factory):
    """Saved with zero=0, loaded into zero=3 on the same grid: training on equals training on without it."""
    directory = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("into3")) if MPI.COMM_WORLD.rank == 0 else None)
    batches = global_batches(grid.data_replicas, steps=4)
    model, optimizer = build(zero=0)
    train(model, optimizer, grid, batches[:2])
    hp.save_checkpoint(directory, model, optimizer, step=2)
    model.close()
    model, optimizer = build()
    try:
        with ranks_agree(what="loaded into zero=3"):
            hp.load_checkpoint(directory, model, optimizer)
            assert freed(model)
            train(model, optimizer, grid, batches[2:])
            assert_whole_and_equal(model, optimizer, reference(batches))
    finally:
        model.close()


class Twice(nn.Module):
    """A block called twice in one forward: its parameters' gradient sums both calls."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(13, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(torch.tanh(self.inner(x))))


class Plain(nn.Module):
    """No pipeline: an embedding tied to the head, a block called twice (re-materialized by torch's checkpoint when
    asked), layers of their own."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpointed = checkpointed
        self.embedding = nn.Embedding(7, 6)
        self.up, self.twice, self.down = nn.Linear(6, 13), Twice(), nn.Linear(13, 6)
        self.head = Head(self.embedding)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(self.embedding(tokens)))
        h = torch.utils.checkpoint.checkpoint(self.twice, h, use_reentrant=False) if self.checkpointed \
            else self.twice(h)
        return self.head(self.down(h))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "checkpointed"])
def test_zero3_without_a_pipeline(checkpointed):
    """Pure data parallelism of a plain nn.Module over every rank: equal to one process after 3 AdamW steps, the
    parameters freed between uses, evaluation under no_grad gathering too."""
    hp.shutdown()
    hp.init(config=CONFIG)
    try:
        batches = global_batches(SIZE, tied=True)
        reference_model = Plain(checkpointed)
        reference_optimizer = adamw(reference_model.parameters())
        for inputs, targets in batches:
            reference_optimizer.zero_grad()
            loss_fn(reference_model(inputs), targets).backward()
            reference_optimizer.step()
        model = Plain(checkpointed)
        optimizer = hp.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                            zero=3)
        rows = slice(hp.rank() * PER_REPLICA, (hp.rank() + 1) * PER_REPLICA)
        with ranks_agree(what=f"no pipeline, checkpointed={checkpointed}"):
            assert freed(model)
            for inputs, targets in batches:
                optimizer.zero_grad()
                loss_fn(model(inputs[rows]), targets[rows]).backward()
                optimizer.step()
                assert freed(model)
            with torch.no_grad():
                torch.testing.assert_close(model(batches[0][0]), reference_model(batches[0][0]), rtol=1e-9, atol=1e-12)
            assert freed(model)
            expected = {name: p.detach() for name, p in reference_model.named_parameters()}
            with optimizer.full_parameters() as full:
                assert set(full) == set(expected)
                for name, parameter in full.items():
                    torch.testing.assert_close(parameter.detach(), expected[name], rtol=1e-9, atol=1e-12,
                                               msg=lambda m: f"{name}: {m}")
            assert 0 < optimizer.gathered_peak_bytes
    finally:
        hp.shutdown()


def test_zero3_materializes_a_meta_module_as_shards():
    """A transformers Llama built on the meta device: DistributedOptimizer(zero=3) makes its parameters empty real
    tensors (the same objects), opt.materialize(model) fills the shards module by module (no rank holding more
    than one module's parameters whole), and 3 AdamW steps equal one process that initialised the whole model the
    same way."""
    transformers = pytest.importorskip("transformers")
    hp.shutdown()
    hp.init(config=CONFIG)
    try:
        config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                          tie_word_embeddings=False)
        with torch.device("meta"):
            reference, model = transformers.LlamaForCausalLM(config), transformers.LlamaForCausalLM(config)
        reference.to_empty(device="cpu")
        torch.manual_seed(5)
        with torch.no_grad():
            for module in reference.modules():  # what materialize does, on the whole model
                if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(False)):
                    reference._init_weights(module)
        optimizer = hp.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                            zero=3)
        whole = sum(p.numel() * p.element_size() for p in reference.parameters())
        with ranks_agree(what="meta materialized"):
            assert freed(model) and all(p.device.type == "cpu" for p in model.parameters())
            with pytest.raises(hp.errors.UsageError, match=r"meta device .* call opt.materialize\(module\) first"):
                model(torch.zeros(1, 4, dtype=torch.long))
            torch.manual_seed(5)
            peak = optimizer.materialize(model)
            assert 0 < peak < whole / 4, (peak, whole)
            assert freed(model)
            generator = torch.Generator().manual_seed(1)
            reference_optimizer = adamw(reference.parameters())
            for _ in range(STEPS):
                ids = torch.randint(0, 32, (2 * SIZE, 9), generator=generator)
                reference_optimizer.zero_grad()
                reference(ids, labels=ids).loss.backward()
                reference_optimizer.step()
                optimizer.zero_grad()
                mine = ids[2 * hp.rank():2 * hp.rank() + 2]
                model(mine, labels=mine).loss.backward()
                optimizer.step()
            with optimizer.full_parameters() as full:
                expected = dict(reference.named_parameters())
                assert set(full) == set(expected)
                for name, parameter in full.items():
                    torch.testing.assert_close(parameter.detach(), expected[name].detach(), rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{name}: {m}")
    finally:
        hp.shutdown()


def saved_tensors(root) -> list[torch.Tensor]:
    """Every tensor autograd saved in the graph behind ``root``."""
    found, seen, todo = [], set(), [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found += [getattr(node, name) for name in dir(node)
                  if name.startswith("_saved_") and isinstance(getattr(node, name), torch.Tensor)]
        todo += [next_node for next_node, _ in node.next_functions]
    return found


def test_zero3_frees_what_autograd_saved_of_a_parameter():
    """On 3-D inputs a linear layer's graph keeps a view of its weight (``weight.t()``): after the forward the view
    holds no memory (the bucket's storage is freed under it), and the backward, gathering into it again, computes
    what one process computes."""
    hp.shutdown()
    hp.init(config=Config(fusion_threshold_bytes=64))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 13), nn.Tanh(), nn.Linear(13, 3))
        reference = nn.Sequential(nn.Linear(6, 13), nn.Tanh(), nn.Linear(13, 3))
        reference.load_state_dict(model.state_dict())
        optimizer = hp.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                            zero=3)
        inputs = torch.randn(SIZE, 5, 6, generator=torch.Generator().manual_seed(2))
        with ranks_agree(what="saved views freed"):
            loss = model(inputs[hp.rank():hp.rank() + 1]).square().mean()
            # (described, never printed: a freed view must not be read)
            views = sorted((tuple(t.shape), t.untyped_storage().nbytes()) for t in saved_tensors(loss))
            # the second layer's weight, saved for its input's gradient (the first's input needs none)
            assert [v for v in views if v[0] in {(6, 13), (13, 3)}] == [((13, 3), 0)], views
            loss.backward()
            optimizer.step()
            reference_optimizer = adamw(reference.parameters())
            reference(inputs).square().mean().backward()
            reference_optimizer.step()
            with optimizer.full_parameters() as full:
                for name, parameter in reference.named_parameters():
                    torch.testing.assert_close(full[name].detach(), parameter.detach(), rtol=1e-9, atol=1e-12)
    finally:
        hp.shutdown()

"""interleaved-1f1b, zb-h1, pipedream and 2bw under a real mpirun, on grids of P = 2, 3, 4 stages and 1 or 2
replicas: the synchronous ones against one-process training, the asynchronous ones against a one-process
replay of their schedule (pipedream) or 2BW's update formula."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import hybridpipe as hp
from hybridpipe.errors import HybridPipeError, PartitionError, ScheduleError
from hybridpipe.pipeline import microbatch
from hybridpipe.pipeline import schedule as sched
from hybridpipe.pipeline.schedule import Schedule
from agree import ranks_agree
from training import Block, Embed, Head, replay_asynchronous, sequence_loss, two_bw_reference

pytestmark = pytest.mark.mpi(ranks=[2, 4], long_ranks=[3], timeout=300, shared=True)  # P = 3 in make test-long

torch.set_num_threads(1)
WORLD = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)
LONG = os.environ.get("HYBRIDPIPE_LONG_TESTS") == "1"
# pipeline stages; the rest are replicas (the 2 × 2 grid in make test-long: test_pipeline_mpi, test_tied_mpi and
# test_zero_mpi train on it in make test)
GRIDS = {2: [2], 3: [3], 4: [4, 2] if LONG else [4]}.get(WORLD, [WORLD])


@pytest.fixture(scope="module", params=GRIDS, ids=lambda p: f"P{p}")
def grid(request):
    the_grid = hp.init(pipeline_stages=request.param)
    yield the_grid
    hp.shutdown()


def mlp(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(2 * stages):
        layers += [nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(6, 3))


def transformer(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(11, 8), *[Block(8) for _ in range(2 * stages - 1)], Head(8, 11))


def data_for(kind: str, grid, steps: int = 2, per_replica: int = 8, seed: int = 3):
    """Per step: (this replica's shard, the global batch = every replica's shard in order)."""
    out = []
    for step in range(steps):
        shards = []
        for replica in range(grid.data_replicas):
            generator = torch.Generator().manual_seed(seed + 100 * step + replica)
            if kind == "mlp":
                shards.append((torch.randn(per_replica, 6, generator=generator),
                               torch.randint(0, 3, (per_replica,), generator=generator)))
            else:
                ids = torch.randint(1, 11, (per_replica, 5), generator=generator)
                ids[:, -1] = 0
                shards.append((ids, torch.randint(0, 11, (per_replica, 5), generator=generator)))
        whole = tuple(torch.cat([shard[i] for shard in shards]) for i in range(2))
        out.append((shards[grid.replica], whole))
    return out


def assert_parameters_equal(model: hp.PipelineModel, reference_parameters: dict[str, torch.Tensor]) -> None:
    own = dict(model.named_parameters())
    assert own, "every rank holds parameters in these models"
    for name, parameter in own.items():
        torch.testing.assert_close(parameter, reference_parameters[name.removeprefix("layers.")], rtol=1e-5,
                                   atol=1e-6, msg=lambda text: f"{name}: {text}")


# ------------------------------------------------------------------ synchronous: equal to one process


SYNCHRONOUS_CASES = [(kind, checkpoint) for checkpoint in ("never", "except_last", "always") for kind in ("mlp",)] + [
    ("transformer", "except_last")]  # every mode on the MLP; the dict-passing transformer in the mixed one


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-h1"])
@pytest.mark.parametrize("kind,checkpoint", SYNCHRONOUS_CASES)
def test_synchronous_schedules_train_like_one_process(grid, schedule, checkpoint, kind):
    stages = grid.pipeline_stages
    build, loss_fn = (mlp, nn.CrossEntropyLoss()) if kind == "mlp" else (transformer, sequence_loss)
    micro_batches = 2 * stages
    extra = {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {}
    model = hp.PipelineModel(build(stages), loss_fn=loss_fn, micro_batches=micro_batches, balance="uniform",
                             schedule=schedule, checkpoint=checkpoint, **extra)
    reference = build(stages)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    data = data_for(kind, grid, per_replica=2 * micro_batches)
    try:
        for (inputs, targets), (all_inputs, all_targets) in data:
            optimizer.zero_grad()
            loss = model.train_step(inputs, targets)
            optimizer.step()
            reference_optimizer.zero_grad()
            expected = loss_fn(reference(all_inputs), all_targets)
            expected.backward()
            reference_optimizer.step()
            with ranks_agree(what="loss"):  # before the next train_step: a rank leaving would strand the others
                if grid.data_replicas == 1:
                    assert loss == pytest.approx(expected.item(), rel=1e-5)
        assert_parameters_equal(model, dict(reference.named_parameters()))
        actions = model._schedule(schedule)
        assert model.last_step.peak_stored == sched.peak_in_flight(actions)
        if schedule == "zb-h1":
            assert model.last_step.peak_stored <= stages  # 1F1B's peak (its first stage)
        recomputed = {"never": 0, "except_last": micro_batches - 1, "always": micro_batches}[checkpoint]
        assert model.last_step.recomputed == recomputed * model.virtual_stages
    finally:
        model.close()


# ------------------------------------------------------------------ the executor runs the schedule, bit for bit

ALL_SYNCHRONOUS = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]  # at P = 4 in make test: "except_last" only
SEED = 4321


def dropout_mlp(stages: int) -> nn.Sequential:
    """float64, a Dropout after every hidden layer (uniform balance gives every chunk some)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(2 * stages):
        layers += [nn.Linear(6, 6), nn.Tanh(), nn.Dropout(0.3)]
    return nn.Sequential(*layers, nn.Linear(6, 3)).double()


def replay_in_one_process(model: hp.PipelineModel, schedule: Schedule, inputs, targets, loss_fn):
    """The pipeline's run in one process, action by action in each rank's order (any order across ranks that
    respects the data flow): each rank's random stream seeded as the test seeds the ranks, drawn by its forwards
    in its order (the dropout masks), no recompute; micro-batch gradients added up in each chunk's B / W order.
    Returns {layer parameter name: gradient} and how many dropout outputs had zeros."""
    stages, chunks = model.stages, model.chunks
    layers = list(dropout_mlp(stages))
    modules = [nn.Sequential(*[layers[i] for i in model.layers_of_chunk(c)]) for c in range(chunks)]
    names = {id(p): f"{i}.{n}" for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    xs, ys = microbatch.split(inputs, model.micro_batches), microbatch.split(targets, model.micro_batches)
    weights = [len(y) / len(targets) for y in ys]
    states = []
    for rank in range(stages):
        torch.manual_seed(SEED + rank)
        states.append(torch.get_rng_state())
    zeroed = []
    for layer in layers:
        if isinstance(layer, nn.Dropout):
            layer.register_forward_hook(lambda module, args, out: zeroed.append(bool((out == 0).any())))
    forward, gradient_in, accumulated = {}, {}, {}
    position = [0] * stages

    def ready(action: sched.Action) -> bool:
        c, m = action.stage, action.micro_batch
        if action.kind is sched.ActionKind.FORWARD:
            return c == 0 or (c - 1, m) in forward
        return c == chunks - 1 or (c, m) in gradient_in

    def run(rank: int, action: sched.Action) -> None:
        c, m = action.stage, action.micro_batch
        kind = action.kind
        if kind is sched.ActionKind.FORWARD:
            torch.set_rng_state(states[rank])
            x = xs[m] if c == 0 else forward[(c - 1, m)][1].detach().requires_grad_(True)
            y = modules[c](x)
            if c == chunks - 1:
                y = loss_fn(y, ys[m]) * weights[m]
            forward[(c, m)] = (x, y)
            states[rank] = torch.get_rng_state()
            return
        x, y = forward[(c, m)]
        wanted = []
        if kind in (sched.ActionKind.BACKWARD, sched.ActionKind.BACKWARD_INPUT) and c > 0:
            wanted.append(x)
        if kind in (sched.ActionKind.BACKWARD, sched.ActionKind.BACKWARD_WEIGHT):
            wanted += list(modules[c].parameters())
        if not wanted:  # the first chunk's I: no input gradient to compute
            return
        grads = torch.autograd.grad(y, wanted, None if c == chunks - 1 else gradient_in[(c, m)], retain_graph=True)
        if wanted and wanted[0] is x:
            gradient_in[(c - 1, m)], grads = grads[0], grads[1:]
        for parameter, grad in zip(wanted[-len(grads):] if grads else [], grads):
            key = names[id(parameter)]
            accumulated[key] = grad if key not in accumulated else accumulated[key] + grad

    while any(position[r] < len(schedule[r]) for r in range(stages)):
        moved = False
        for rank in range(stages):
            while position[rank] < len(schedule[rank]) and ready(schedule[rank][position[rank]]):
                run(rank, schedule[rank][position[rank]])
                position[rank] += 1
                moved = True
        assert moved, f"the replay is stuck at {position}"
    return accumulated, sum(zeroed)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"] if WORLD != 4 or LONG else ["except_last"])
@pytest.mark.parametrize("schedule", ALL_SYNCHRONOUS)
def test_executor_runs_the_schedules_actions_and_equals_their_replay_bit_for_bit(grid, schedule, checkpoint):
    """What each rank's executor ran (last_step.actions) is the schedule's own list for that rank; its gradients
    (float64, dropout, no optimizer) equal bit for bit a one-process replay adding micro-batch gradients in the
    schedule's order with the same dropout masks (recompute must replay them: checkpoint "always" /
    "except_last" under every synchronous schedule, virtual stages included)."""
    stages = grid.pipeline_stages
    micro_batches = 2 * stages
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    loss_fn = nn.CrossEntropyLoss()
    model = hp.PipelineModel(dropout_mlp(stages), loss_fn=loss_fn, micro_batches=micro_batches, balance="uniform",
                             schedule=schedule, checkpoint=checkpoint, virtual_stages=virtual)
    (inputs, targets), _ = data_for("mlp", grid, steps=1, per_replica=2 * micro_batches)[0]
    inputs = inputs.double()
    try:
        torch.manual_seed(SEED + grid.stage)
        model.train_step(inputs, targets)
        ran = list(model.last_step.actions)
        recomputed = model.last_step.recomputed
        gradients = {name.removeprefix("layers."): p.grad for name, p in model.named_parameters()}
    finally:
        model.close()
    own = sched.get_schedule(schedule, stages, micro_batches, virtual)
    expected, zeroed = replay_in_one_process(model, own, inputs, targets, loss_fn)
    with ranks_agree(what=f"{schedule}, checkpoint={checkpoint}"):
        assert [str(a) for a in ran] == [str(a) for a in own[grid.stage]]
        assert recomputed == {"never": 0, "except_last": micro_batches - 1, "always": micro_batches}[checkpoint] \
            * virtual
        assert zeroed > 0, "dropout zeroed nothing: the masks were not tested"
        assert gradients and all(g is not None for g in gradients.values())
        for name, gradient in gradients.items():
            assert torch.equal(gradient, expected[name]), \
                f"{name}: largest difference {(gradient - expected[name]).abs().max().item():.3g}"


def test_interleaved_ranks_hold_every_pth_chunk_and_tag_messages_by_chunk(grid):
    stages = grid.pipeline_stages
    model = hp.PipelineModel(mlp(stages), loss_fn=nn.CrossEntropyLoss(), micro_batches=stages,
                             schedule="interleaved-1f1b", virtual_stages=2)
    try:
        with ranks_agree(what="layout"):
            assert len(model.balance) == 2 * stages
            chunks = [model.layers_of_chunk(c) for c in (grid.stage, grid.stage + stages)]
            assert list(model.layers_of_stage(grid.stage)) == [i for chunk in chunks for i in chunk]
            assert sorted(int(k) for k in model.layers) == list(model.layers_of_stage(grid.stage))
        (inputs, targets), _ = data_for("mlp", grid, steps=1, per_replica=stages)[0]
        reference = mlp(stages)
        with torch.no_grad():
            expected = reference(inputs)
        torch.testing.assert_close(model.predict(inputs), expected, rtol=1e-5, atol=1e-6)
        assert "virtual_stages=2" in repr(model)
    finally:
        model.close()


def test_zero_bubble_defers_linear_weight_gradients_and_reports_fused_layers(grid):
    stages = grid.pipeline_stages
    model = hp.PipelineModel(transformer(stages), loss_fn=sequence_loss, micro_batches=stages,
                             balance="uniform", schedule="zb-h1")
    try:
        (inputs, targets), _ = data_for("transformer", grid, steps=1, per_replica=stages)[0]
        model.train_step(inputs, targets)
        report = model.split_backward_report()
        with ranks_agree(what="report"):
            assert report.startswith(f"stage {grid.stage}: W deferred for ")
            deferred, fused = report.split("; fused into I: ")
            assert "mlp.0 (Linear)" in deferred and "norm1 (LayerNorm)" in deferred  # every Block's
            assert "attention (MultiheadAttention)" in fused  # no split rule: its weights' gradients come in I
            assert "out_proj" in fused  # a Linear that MultiheadAttention uses without calling it
            if grid.is_first_stage:
                assert "tokens (Embedding)" in deferred and "(Embed)" in fused  # Embed.positions is its own
        flat = hp.PipelineModel(mlp(stages), loss_fn=nn.CrossEntropyLoss(), micro_batches=stages, schedule="zb-h1")
        try:
            (x, y), _ = data_for("mlp", grid, steps=1, per_replica=stages)[0]
            flat.train_step(x, y)
            assert flat.split_backward_report().endswith("fused into I: nothing")
        finally:
            flat.close()
    finally:
        model.close()


# ------------------------------------------------------------------ asynchronous: PipeDream and 2BW


def micro_batch_stream(data, micro_batches: int) -> list[tuple]:
    """The global micro-batches in admission order (micro-batch m = every replica's m-th piece)."""
    out = []
    for _, (inputs, targets) in data:
        out += list(zip(microbatch.split(inputs, micro_batches), microbatch.split(targets, micro_batches)))
    return out


def replica_micro_batch_data(data, grid, micro_batches: int) -> list[tuple]:
    """This replica's (inputs, targets) per train_step, ordered so that its m-th micro-batch is the
    replica's piece of the global micro-batch m of :func:`micro_batch_stream`."""
    out = []
    for _, (inputs, targets) in data:
        pieces = []
        for tensor in (inputs, targets):
            chunks = microbatch.split(tensor, micro_batches)
            pieces.append(torch.cat([torch.tensor_split(c, grid.data_replicas)[grid.replica] for c in chunks]))
        out.append(tuple(pieces))
    return out


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_stashes_weights_and_equals_a_replay_of_its_schedule(grid, vertical_sync):
    stages, micro_batches, steps = grid.pipeline_stages, 3, 3
    factory = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.5)  # noqa: E731
    model = hp.PipelineModel(mlp(stages), loss_fn=nn.CrossEntropyLoss(), micro_batches=micro_batches,
                             balance="uniform", schedule="pipedream", optimizer=factory, vertical_sync=vertical_sync,
                             checkpoint="except_last")
    data = data_for("mlp", grid, steps=steps, per_replica=micro_batches * 2)
    records, losses = [], {}
    try:
        for inputs, targets in replica_micro_batch_data(data, grid, micro_batches):
            loss = model.train_step(inputs, targets)
            finished = model.weight_versions()
            with ranks_agree(what="step loss"):
                assert (loss is None) == (not finished)  # the mean over micro-batches finished here
                if finished:
                    assert loss == pytest.approx(sum(model.last_step.losses.values()) / len(finished))
            records += finished
            losses.update(model.last_step.losses)
        model.flush()
        records += model.weight_versions()
        losses.update(model.last_step.losses)
        everyone = hp.allgather_object(losses, group="pipe")
        modules, used = replay_asynchronous("pipedream", mlp(stages), model.balance,
                                            micro_batch_stream(data, micro_batches), nn.CrossEntropyLoss(), factory,
                                            vertical_sync, micro_batches)
        with ranks_agree(what="after flush"):
            assert sorted(losses) == list(range(steps * micro_batches))
            assert all(other == losses for other in everyone)  # the last stage's
            assert sorted(m for m, _, _ in records) == list(range(steps * micro_batches))
            lag = stages - 1 if vertical_sync else stages - grid.stage - 1
            for m, forward, backward in records:
                assert forward == backward  # weight stashing
                assert forward == max(m - lag, 0)  # staleness: P - s - 1 updates (vertical sync: stage 0's)
            assert sorted(used[grid.stage]) == sorted((m, f) for m, f, _ in records)
            offset = sum(model.balance[:grid.stage])
            expected = {f"{offset + int(name.split('.')[0])}.{name.split('.', 1)[1]}": p
                        for name, p in modules[grid.stage].named_parameters()}
            assert_parameters_equal(model, expected)
            kept = model._executor.chunks[grid.stage].stash.peak_versions
            assert kept <= (stages + 1 if vertical_sync else stages - grid.stage)  # P - s; vertical sync: older too
    finally:
        model.close()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_2bw_equals_its_update_formula(grid, optimizer):
    stages, micro_batches, steps = grid.pipeline_stages, max(grid.pipeline_stages, 2), 4
    if optimizer == "sgd":
        factory = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    else:
        factory = lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)  # noqa: E731
    model = hp.PipelineModel(mlp(stages), loss_fn=nn.CrossEntropyLoss(), micro_batches=micro_batches,
                             balance="uniform", schedule="2bw", optimizer=factory)
    data = data_for("mlp", grid, steps=steps, per_replica=micro_batches * 2)
    try:
        versions = []
        for inputs, targets in replica_micro_batch_data(data, grid, micro_batches):
            model.train_step(inputs, targets)
            versions += model.weight_versions()
        model.flush()
        versions += model.weight_versions()
        assert [f for m, f, b in sorted(versions)] == [max(m // micro_batches - 1, 0) for m, _, _ in sorted(versions)]
        assert all(f == b for _, f, b in versions)
        assert model._executor.chunks[grid.stage].stash.peak_versions <= 2
        global_batches = [(torch.cat(microbatch.split(x, micro_batches)), torch.cat(microbatch.split(y, micro_batches)))
                          for _, (x, y) in data]
        reference = two_bw_reference(mlp(stages), global_batches, nn.CrossEntropyLoss(), factory)
        assert_parameters_equal(model, dict(reference.named_parameters()))
    finally:
        model.close()


# ------------------------------------------------------------------ errors name the fix


def test_schedule_option_errors(grid):
    stages = grid.pipeline_stages
    loss = nn.CrossEntropyLoss()
    with pytest.raises(HybridPipeError, match=r"'pipedream' updates the weights inside the pipeline.*optimizer="):
        hp.PipelineModel(mlp(stages), loss_fn=loss, micro_batches=2, schedule="pipedream")
    with pytest.raises(HybridPipeError, match=r"'1f1b' is synchronous.*DistributedOptimizer"):
        hp.PipelineModel(mlp(stages), loss_fn=loss, micro_batches=2, optimizer=lambda p: torch.optim.SGD(p, lr=1))
    with pytest.raises(PartitionError, match=rf"cuts the model into {stages * 8} chunks, but it has "
                                             rf"{4 * stages + 1} layers: use virtual_stages <= "):
        hp.PipelineModel(mlp(stages), loss_fn=loss, micro_batches=stages, schedule="interleaved-1f1b",
                         virtual_stages=8)
    with pytest.raises(PartitionError, match=rf"has 2 entries, but with virtual_stages=2 .* {2 * stages} chunks"):
        hp.PipelineModel(mlp(stages), loss_fn=loss, micro_batches=stages, schedule="interleaved-1f1b",
                         virtual_stages=2, balance=[1, 4 * stages])
    with pytest.raises(ScheduleError, match=rf"micro_batches must be a multiple of {stages}"):
        hp.PipelineModel(mlp(stages), loss_fn=loss, micro_batches=stages + 1, schedule="interleaved-1f1b",
                         virtual_stages=2)
    with pytest.raises(HybridPipeError, match="needs schedule='interleaved-1f1b'"):
        hp.PipelineModel(mlp(stages), loss_fn=loss, micro_batches=2, virtual_stages=2)
    model = hp.PipelineModel(mlp(stages), loss_fn=loss, micro_batches=2, schedule="pipedream",
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    try:
        (x, y), _ = data_for("mlp", grid, steps=1, per_replica=4)[0]
        model.train_step(x, y)
        mine = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(HybridPipeError, match="do not call step"):
            mine.step()
        with pytest.raises(HybridPipeError, match="do not call step"):
            model.optimizer.step()
        model.flush()
    finally:
        model.close()


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_asynchronous_checkpoint_flushes_saves_the_pipeline_optimizer_and_resumes(grid, schedule, tmp_path_factory):
    stages, micro_batches = grid.pipeline_stages, max(grid.pipeline_stages, 2)
    path = hp.broadcast_object(str(tmp_path_factory.mktemp(schedule)) if grid.rank == 0 else None, root_rank=0,
                               group="world")
    factory = lambda params: torch.optim.AdamW(params, lr=0.01)  # noqa: E731
    data = [x for x in replica_micro_batch_data(data_for("mlp", grid, steps=4, per_replica=2 * micro_batches),
                                                grid, micro_batches)]

    def build() -> hp.PipelineModel:
        return hp.PipelineModel(mlp(stages), loss_fn=nn.CrossEntropyLoss(), micro_batches=micro_batches,
                                balance="uniform", schedule=schedule, optimizer=factory)

    straight, resumed = build(), build()
    try:
        for inputs, targets in data[:2]:
            straight.train_step(inputs, targets)
            resumed.train_step(inputs, targets)
        hp.save_checkpoint(path, resumed, step=2)  # flushes: nothing in flight after it
        with ranks_agree(what="flushed"):
            assert resumed._executor.in_flight == []
        # 2BW restarts its double buffer from loaded weights (W(-1) = W(0) again): so does `straight`
        hp.save_checkpoint(f"{path}-straight", straight, step=2)
        hp.load_checkpoint(f"{path}-straight", straight)
        fresh = build()
        try:
            hp.load_checkpoint(path, fresh)
            with ranks_agree(what="loaded"):
                assert fresh.optimizer.state_dict()["state"], "the pipeline's AdamW state was saved and loaded"
            for inputs, targets in data[2:]:
                straight.train_step(inputs, targets)
                fresh.train_step(inputs, targets)
            straight.flush()
            fresh.flush()
            assert_parameters_equal(fresh, {n.removeprefix("layers."): p for n, p in straight.named_parameters()})
        finally:
            fresh.close()
    finally:
        straight.close()
        resumed.close()


def test_memory_balance_keeps_every_stage_within_the_limit(grid):
    from hybridpipe.pipeline.partition import profile_layers

    stages = grid.pipeline_stages
    torch.manual_seed(0)
    widths = [6] + [6, 48] * stages + [6]  # alternating thin and wide layers: uneven parameter bytes
    layers = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    sample = torch.randn(4, 6)
    held = stages  # 1f1b: the first stage holds P micro-batches
    profiles = profile_layers(list(layers), sample, repeats=1, warmup=0)
    memory = [2 * p.parameter_bytes + held * p.activation_bytes for p in profiles]
    limit = int(sum(memory) / stages * 1.5)
    model = hp.PipelineModel(layers, loss_fn=nn.MSELoss(), micro_batches=stages, balance="memory",
                             memory_limit=limit, sample_input=sample)
    try:
        assert model.balance_report.method == "memory"
        start = 0
        for count in model.balance:
            assert sum(memory[start:start + count]) <= limit
            start += count
    finally:
        model.close()
    with pytest.raises(PartitionError, match=r"cannot be met with \d+ stages \(smallest feasible memory_limit is"):
        hp.PipelineModel(layers, loss_fn=nn.MSELoss(), micro_batches=stages, balance="memory", memory_limit=100,
                         sample_input=sample)
    with pytest.raises(PartitionError, match='balance="memory" needs memory_limit='):
        hp.PipelineModel(layers, loss_fn=nn.MSELoss(), micro_batches=stages, balance="memory", sample_input=sample)
    with pytest.raises(PartitionError, match='memory_limit is for balance="memory"'):
        hp.PipelineModel(layers, loss_fn=nn.MSELoss(), micro_batches=stages, memory_limit="1GiB")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bf16_pipeline_equals_one_process_under_autocast(grid, schedule):
    stages, micro_batches = grid.pipeline_stages, 2 * grid.pipeline_stages
    model = hp.PipelineModel(transformer(stages), loss_fn=sequence_loss, micro_batches=micro_batches,
                             balance="uniform", schedule=schedule, precision="bf16", checkpoint="except_last")
    reference = transformer(stages)
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    seen_inputs, seen_outputs = set(), set()
    first = model.layers[str(model.layers_of_stage(grid.stage)[0])]
    first.register_forward_hook(lambda module, args, output: seen_inputs.update(
        t.dtype for t in microbatch.iter_tensors(args[0]) if t.is_floating_point()) and None)
    linear = next(m for m in model.layers.modules() if type(m) is nn.Linear)  # (not MultiheadAttention.out_proj)
    linear.register_forward_hook(lambda module, args, output: seen_outputs.add(output.dtype) and None)
    try:
        for (inputs, targets), (all_inputs, all_targets) in data_for("transformer", grid,
                                                                     per_replica=2 * micro_batches):
            optimizer.zero_grad()
            model.train_step(inputs, targets)
            optimizer.step()
            reference_optimizer.zero_grad()
            # one process: the same micro-batches of every replica, each under autocast
            pieces = list(zip(*(microbatch.split(t, micro_batches * grid.data_replicas)
                                for t in (all_inputs, all_targets))))
            for x, y in pieces:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = sequence_loss(reference(x), y) / len(pieces)
                loss.backward()
            reference_optimizer.step()
        for name, parameter in model.named_parameters():
            assert parameter.dtype == torch.float32  # master weights stay float32
            torch.testing.assert_close(parameter, dict(reference.named_parameters())[name.removeprefix("layers.")],
                                       rtol=2e-2, atol=2e-3)  # bf16 tolerance; the dtypes below tell bf16 from fp32
        assert seen_inputs == (set() if grid.is_first_stage else {torch.bfloat16})  # activations crossed in bf16
        assert seen_outputs == {torch.bfloat16}  # the stage's matrix products ran in bfloat16
    finally:
        model.close()
    with pytest.raises(HybridPipeError, match="unknown precision 'fp8': use one of 'fp32', 'bf16', 'fp16'"):
        hp.PipelineModel(transformer(stages), loss_fn=sequence_loss, precision="fp8")
    with pytest.raises(HybridPipeError, match="precision='fp16' needs a synchronous schedule"):
        hp.PipelineModel(transformer(stages), loss_fn=sequence_loss, precision="fp16", schedule="pipedream",
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def test_fp16_loss_scaler_skips_the_same_steps_everywhere(grid):
    """fp16 with the agreed scaler equals one process under autocast with torch.amp.GradScaler; an inf
    injected into one parameter of the LAST stage at step 1 makes every rank skip that step and halve
    the scale."""
    stages, micro_batches = grid.pipeline_stages, 2 * grid.pipeline_stages
    model = hp.PipelineModel(transformer(stages), loss_fn=sequence_loss, micro_batches=micro_batches,
                             balance="uniform", precision="fp16")
    reference = transformer(stages)
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference_scaler = torch.amp.GradScaler("cpu")
    poison = {"on": False}
    last = str(len(reference) - 1)
    victim = next(p for n, p in reference.named_parameters() if n.startswith(last + "."))
    victim.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    if grid.is_last_stage:
        mine = next(p for n, p in model.named_parameters() if n.startswith(f"layers.{last}."))
        mine.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    try:
        stepped = []
        for index, ((inputs, targets), (all_inputs, all_targets)) in enumerate(
                data_for("transformer", grid, steps=3, per_replica=2 * micro_batches)):
            poison["on"] = index == 1
            optimizer.zero_grad()
            model.train_step(inputs, targets)
            stepped.append(model.scaler.step(optimizer))
            model.scaler.update()
            reference_optimizer.zero_grad()
            pieces = list(zip(*(microbatch.split(t, micro_batches * grid.data_replicas)
                                for t in (all_inputs, all_targets))))
            for x, y in pieces:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = sequence_loss(reference(x), y) / len(pieces)
                reference_scaler.scale(loss).backward()
            reference_scaler.step(reference_optimizer)
            reference_scaler.update()
        assert stepped == [True, False, True]  # on every rank, the last stage's inf included
        assert model.scaler.get_scale() == reference_scaler.get_scale() == 2.0 ** 15
        for name, parameter in model.named_parameters():
            assert parameter.dtype == torch.float32
            torch.testing.assert_close(parameter, dict(reference.named_parameters())[name.removeprefix("layers.")],
                                       rtol=2e-2, atol=2e-3)
    finally:
        model.close()

"""Every feature with every other: the cases of hybridpipe/testing/compatibility.py, each against
one process on the same micro-batches (asynchronous schedules: their one-process replay), or refused.

One launch of 4 ranks: a case on a 4-rank grid (2×2, 4×1) uses every rank; cases on 2-rank grids (2×1,
1×2) run two at a time, one on ranks 0–1 and one on ranks 2–3 (``hp.init(comm=…)``). Each rank's outcome
is gathered before asserting, so a failure on one rank fails the test on every rank with its message.
``make test`` runs the pairwise cases; ``make test-long`` (HYBRIDPIPE_LONG_TESTS=1) every triple.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import sys
import traceback
from pathlib import Path

import pytest
import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hp
from hybridpipe import errors as hp_errors
from hybridpipe.pipeline import microbatch
from hybridpipe.testing import compatibility as compat

sys.path.insert(0, str(Path(__file__).resolve().parent / "pipeline"))
from skip_models import WIDTH as SKIP_WIDTH, AddBack, StashProjection  # noqa: E402 - the skip tests' own ends


pytestmark = pytest.mark.mpi(ranks=[4], timeout=300, shared=True)

torch.set_num_threads(1)
WORLD = MPI.COMM_WORLD
VOCAB, WIDTH, LENGTH, ROWS, MICRO_BATCHES, STEPS, MAX_NORM = 16, 8, 3, 16, 4, 4, 0.2
assert SKIP_WIDTH == WIDTH
LONG = os.environ.get("HYBRIDPIPE_LONG_TESTS") == "1"
CASES = compat.covering_cases(3 if LONG else 2)
if os.environ.get("HYBRIDPIPE_COMPAT_CASES"):  # debugging: run only these, e.g. '[{"schedule": "1f1b", "tied": "yes"}]'
    CASES = [{**{n: v[0] for n, v in compat.OPTIONS.items()}, **c} for c in json.loads(os.environ["HYBRIDPIPE_COMPAT_CASES"])]


def slots(cases: list[dict]) -> list[list[dict]]:
    """4-rank cases alone; 2-rank ones in pairs (ranks 0–1, ranks 2–3)."""
    wide = [c for c in cases if _ranks(c) == 4]
    narrow = [c for c in cases if _ranks(c) == 2]
    return [[c] for c in wide] + [narrow[i:i + 2] for i in range(0, len(narrow), 2)]


def _ranks(case: dict) -> int:
    stages, replicas = compat.grid_shape(case["grid"])
    return stages * replicas


SLOTS = slots(CASES)


# ------------------------------------------------------------------ the model


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


ZOO = (block, lambda: nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)),
       Residual, lambda: nn.LayerNorm(WIDTH))


def build(case: dict, dtype: torch.dtype) -> nn.Sequential:
    """8 layers: embedding, 5 blocks (the first and last a skip's ends), LayerNorm, head (tied or not). A case
    with a ``zoo`` seed: 5, 9 or 13 blocks drawn from :data:`ZOO`, the skip's ends at random places."""
    blocks = 5
    kinds = [0] * blocks
    stash, pop = 1, blocks
    if case.get("zoo") is not None:
        rng = random.Random(case["zoo"])
        blocks = rng.choice([5, 9, 13])
        kinds = [rng.randrange(len(ZOO)) for _ in range(blocks)]
        stash = rng.randint(1, blocks - 1)
        pop = rng.randint(stash + 1, blocks)
    torch.manual_seed(0)
    embedding, head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
    if case["tied"] == "yes":
        head.weight = embedding.weight
    skip = case["skip"] == "yes"
    layers: list[nn.Module] = [embedding]
    for position, kind in enumerate(kinds, 1):
        if skip and position == stash:
            layers.append(StashProjection())
        elif skip and position == pop:
            layers.append(AddBack())
        else:
            layers.append(ZOO[kind]())
    return nn.Sequential(*layers, nn.LayerNorm(WIDTH), head).to(dtype)


def compiled_layer(case: dict) -> int:
    """The block a ``compile=yes`` case wraps in torch.compile (one with parameters)."""
    if case.get("zoo") is None:
        return 3
    layers = build({**case, "compile": "no"}, torch.float64)
    return next(i for i in range(len(layers) - 2, 0, -1) if any(True for _ in layers[i].parameters()))


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    return [(torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator),
             torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)) for _ in range(STEPS)]


def dtype_of(case: dict) -> torch.dtype:
    return torch.float64 if case["precision"] == "fp32" else torch.float32  # autocast leaves float64 alone


def autocast(case: dict):
    if case["precision"] == "fp32":
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cpu", dtype=torch.bfloat16 if case["precision"] == "bf16" else torch.float16)


def asynchronous_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


# ------------------------------------------------------------------ one process


def one_process(case: dict, data: list) -> dict[str, torch.Tensor]:
    """The parameters after STEPS steps of one process on the same micro-batches (by name, ties repeated)."""
    model = build(case, dtype_of(case))
    if case["schedule"] in compat.ASYNCHRONOUS:
        return _replay(case, model, data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    scaler = torch.amp.GradScaler("cpu") if case["precision"] == "fp16" else None
    for step, (inputs, targets) in enumerate(data):
        # the micro-batches of the grid that runs this step (a resumed case changes grid: fp16's overflows
        # depend on how the batch is cut)
        resumed = case["checkpoint"] == "resume" and step >= STEPS // 2
        _, replicas = compat.grid_shape(compat.RESUME_GRID[case["grid"]] if resumed else case["grid"])
        pieces = MICRO_BATCHES * replicas
        optimizer.zero_grad()
        for x, y in zip(microbatch.split(inputs, pieces), microbatch.split(targets, pieces)):
            with autocast(case):
                loss = sequence_loss(model(x), y) / pieces
            (scaler.scale(loss) if scaler else loss).backward()
        if case["clip"] == "yes":
            if scaler:
                scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            assert norm > MAX_NORM, f"clipping must bite (norm {norm})"
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}


def _replay(case: dict, model: nn.Sequential, data: list) -> dict[str, torch.Tensor]:
    """pipedream / 2bw in one process, from their weight-version rules: 2bw takes batch t's gradient at
    W(t-1) (W(-1) = W(0)) and applies it to W(t); pipedream (one micro-batch per version on each stage,
    P - s - 1 updates stale) is replayed from the schedule by tests/pipeline/training.py. A checkpoint
    flushes the pipeline: the versions start again from the saved weights."""
    optimizer = asynchronous_optimizer(list(model.parameters()))
    segments = [data[:STEPS // 2], data[STEPS // 2:]] if case["checkpoint"] == "resume" else [data]
    if case["schedule"] == "2bw":
        for segment in segments:
            previous = {k: v.detach().clone() for k, v in model.named_parameters()}
            for inputs, targets in segment:
                weights = {k: v.clone().requires_grad_(True) for k, v in previous.items()}
                with autocast(case):
                    loss = sequence_loss(torch.func.functional_call(model, weights, (inputs,)), targets)
                loss.backward()
                previous = {k: v.detach().clone() for k, v in model.named_parameters()}
                for name, parameter in model.named_parameters():
                    parameter.grad = weights[name].grad
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}
    for segment, grid in zip(segments, (case["grid"], compat.RESUME_GRID[case["grid"]])):
        stages, replicas = compat.grid_shape(grid)
        stream = []  # global micro-batch m: every replica's m-th piece, in admission order
        for inputs, targets in segment:
            shards = [(x.tensor_split(replicas)[r], y.tensor_split(replicas)[r])
                      for r, (x, y) in enumerate([(inputs, targets)] * replicas)]
            for m in range(MICRO_BATCHES):
                stream.append(tuple(torch.cat([microbatch.split(shard[i], MICRO_BATCHES)[m] for shard in shards])
                                    for i in range(2)))
        pipedream_replay(case, model, stages, stream)
    return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}


def pipedream_replay(case: dict, model: nn.Sequential, stages: int, stream: list[tuple]) -> None:
    """PipeDream's schedule run in one process, action by action in the simulated time order: each stage a
    slice of ``model`` with its own SGD, a forward at the stage's current weights (kept as that micro-batch's
    version: weight stashing), its backward at that version, an update after each backward. A skip's stash
    and pop share micro-batch m's context; its gradient reaches the stashing stage's graph (kept for the
    stage's own backward, which comes later)."""
    from hybridpipe.pipeline import schedule as sched
    from hybridpipe.pipeline.skip import SkipContext, skip_context

    size = len(model) // stages
    modules = [nn.Sequential(*model[s * size:(s + 1) * size]) for s in range(stages)]
    optimizers = [asynchronous_optimizer(list(m.parameters())) for m in modules]
    plan = sched.async_schedule("pipedream", stages, MICRO_BATCHES, steps=len(stream) // MICRO_BATCHES, flush=True)
    timeline = sched.simulate(plan)
    events = sorted((item.start, rank, position, item.action) for rank, items in enumerate(timeline.stages)
                    for position, item in enumerate(items))
    flight, skips = {}, {}
    for _, s, _, action in events:
        m = action.micro_batch
        if action.kind is sched.ActionKind.FORWARD:
            weights = {k: v.detach().clone().requires_grad_(True) for k, v in modules[s].named_parameters()}
            x = stream[m][0] if s == 0 else flight[(s - 1, m)][1].detach().requires_grad_(True)
            with skip_context(skips.setdefault(m, SkipContext())), autocast(case):
                y = torch.func.functional_call(modules[s], weights, (x,))
                if s == stages - 1:
                    y = sequence_loss(y, stream[m][1])
            flight[(s, m)] = (x, y, weights)
        elif action.kind is sched.ActionKind.BACKWARD:
            x, y, weights = flight[(s, m)]
            y.backward(None if s == stages - 1 else flight[(s + 1, m)][0].grad, retain_graph=True)
            for name, parameter in modules[s].named_parameters():
                grad = weights[name].grad
                parameter.grad = grad.clone() if parameter.grad is None else parameter.grad + grad
        else:
            optimizers[s].step()
            optimizers[s].zero_grad(set_to_none=True)


# ------------------------------------------------------------------ hybridpipe


def pipeline(case: dict) -> tuple[hp.PipelineModel, object]:
    layers = build(case, dtype_of(case))
    if case["compile"] == "yes":  # aot_eager: what torch.compile does to autograd, without a C++ build
        at = compiled_layer(case)
        layers[at] = torch.compile(layers[at], backend="aot_eager")
    schedule = case["schedule"]
    asynchronous = schedule in compat.ASYNCHRONOUS
    model = hp.PipelineModel(layers, loss_fn=sequence_loss, micro_batches=MICRO_BATCHES, schedule=schedule,
                             balance="uniform", virtual_stages=2 if schedule == "interleaved-1f1b" else 1,
                             checkpoint=case["recompute"], precision=case["precision"],
                             optimizer=asynchronous_optimizer if asynchronous else None)
    if asynchronous and case["zero"] == 0:
        return model, model.optimizer
    optimizer = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.02),
                                        named_parameters=model.named_parameters(), zero=case["zero"])
    return model, optimizer


def train(case: dict, model: hp.PipelineModel, optimizer, grid: hp.Grid, data: list) -> None:
    rows = ROWS // grid.data_replicas
    for inputs, targets in data:
        shard = (inputs[grid.replica * rows:(grid.replica + 1) * rows],
                 targets[grid.replica * rows:(grid.replica + 1) * rows])
        if case["schedule"] in compat.ASYNCHRONOUS:
            if case["clip"] == "yes":
                hp.clip_grad_norm_(model, MAX_NORM)
            model.train_step(*shard)  # micro-batch m of every replica forms global micro-batch m
            continue
        optimizer.zero_grad()
        model.train_step(*shard)
        scaler = model.scaler
        if case["clip"] == "yes":
            if scaler:
                scaler.unscale_(optimizer)
            else:
                optimizer.synchronize()
            hp.clip_grad_norm_(model, MAX_NORM)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        elif case["clip"] == "yes":
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
    if case["schedule"] in compat.ASYNCHRONOUS:
        model.flush()


def run_case(case: dict, comm, directory: Path) -> None:
    stages, _ = compat.grid_shape(case["grid"])
    refusal = compat.refusal_for(case)
    data = batches()
    grid = hp.init(pipeline_stages=stages, comm=comm)
    if refusal is not None:
        refusals = compat.refusals_for(case)  # the library raises whichever it meets first
        with pytest.raises(tuple(getattr(hp_errors, r.error) for r in refusals)) as raised:
            model, optimizer = pipeline(case)
            try:
                elastic_train(case, model, optimizer, grid, data[:2])
            finally:
                model.close()
        assert any(isinstance(raised.value, getattr(hp_errors, r.error)) and re.search(r.match, str(raised.value))
                   for r in refusals), f"{raised.value!r} is none of the refusals {[r.match for r in refusals]}"
        return
    expected = one_process(case, data)
    first, second = (data[:STEPS // 2], data[STEPS // 2:]) if case["checkpoint"] == "resume" else (data, [])
    model, optimizer = pipeline(case)
    try:
        elastic_train(case, model, optimizer, grid, first)
        if second:
            hp.save_checkpoint(directory, model, optimizer, step=len(first))
            model.close()
            hp.shutdown()
            stages, _ = compat.grid_shape(compat.RESUME_GRID[case["grid"]])
            grid = hp.init(pipeline_stages=stages, comm=comm)
            model, optimizer = pipeline(case)
            hp.load_checkpoint(directory, model, optimizer)
            elastic_train(case, model, optimizer, grid, second)
        check(case, model, optimizer, expected)
        if case["schedule"] == "zb-h1" and case["compile"] == "yes" and case.get("zoo") is None and any(
                name.startswith("layers.3.") for name, _ in model.named_parameters()):
            # the compiled block's weight gradients cannot be deferred: split_backward_report says so
            assert "layers.3._orig_mod.0 (Linear) (inside torch.compile)" in \
                model.split_backward_report(), model.split_backward_report()
    finally:
        model.close()


def elastic_train(case: dict, model, optimizer, grid, data: list) -> None:
    if case["elastic"] == "no":
        train(case, model, optimizer, grid, data)
        return
    state = hp.elastic.TorchState(model, optimizer, step=0)
    failed = []

    @hp.elastic.run
    def loop(state):
        while state.step < len(data):
            train(case, model, optimizer, grid, data[state.step:state.step + 1])
            if state.step == 1 and not failed:
                failed.append(True)
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.mul_(3.0)  # a half-applied step, rolled back
                raise hp.HorovodInternalError("injected at step 1")
            state.step += 1
            state.commit()

    loop(state)
    assert failed


def check(case: dict, model: hp.PipelineModel, optimizer, expected: dict[str, torch.Tensor]) -> None:
    tolerance = {"fp32": dict(rtol=1e-7, atol=1e-10), "bf16": dict(rtol=3e-2, atol=5e-3),
                 "fp16": dict(rtol=1e-2, atol=1e-3)}[case["precision"]]
    whole = getattr(optimizer, "full_parameters", contextlib.nullcontext)  # zero=3: the parameters gathered
    with whole():
        own = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    assert own or case["grid"] == "4x1", "this rank holds no parameters"
    for name, parameter in own.items():
        torch.testing.assert_close(parameter, expected[name.removeprefix("layers.").replace("_orig_mod.", "")],
                                   msg=lambda text: f"{name}: {text}", **tolerance)


@pytest.mark.parametrize("slot", range(len(SLOTS)),
                         ids=[" & ".join(compat.case_id(c) for c in slot) for slot in SLOTS])
def test_every_pair_of_features_trains_like_one_process_or_is_refused(slot, tmp_path_factory):
    run_slot(SLOTS[slot], tmp_path_factory)


def random_cases(count: int, seed: int = 2026) -> list[dict]:
    """Seeded random cases beyond the table: every option drawn at random, and a random model (``zoo``)."""
    rng = random.Random(seed)
    return [{**{name: rng.choice(values) for name, values in compat.OPTIONS.items()}, "zoo": rng.randrange(10 ** 6)}
            for _ in range(count)]


RANDOM_SLOTS = slots(random_cases(24)) if LONG else []


@pytest.mark.skipif(not LONG, reason="make test-long: 24 random cases (random models, options and grids)")
@pytest.mark.parametrize("slot", range(len(RANDOM_SLOTS)) if LONG else [0])
def test_random_models_and_options_train_like_one_process_or_are_refused(slot, tmp_path_factory):
    run_slot(RANDOM_SLOTS[slot], tmp_path_factory)


def run_slot(cases: list[dict], tmp_path_factory) -> None:
    """Runs the slot's case(s) (see :func:`slots`) and fails on every rank if one failed anywhere."""
    directory = Path(WORLD.bcast(str(tmp_path_factory.mktemp("compat")) if WORLD.rank == 0 else None))
    hp.shutdown()
    if _ranks(cases[0]) == 4:
        comm, case = WORLD, cases[0]
    else:
        half = WORLD.rank // 2
        comm = WORLD.Split(half, WORLD.rank)
        case = cases[half] if half < len(cases) else None
    failure = None
    try:
        if case is not None:
            run_case(case, comm, directory if comm is WORLD else directory / f"half{WORLD.rank // 2}")
    except BaseException as error:  # noqa: BLE001 - reported on every rank below
        failure = f"rank {WORLD.rank}, case {compat.case_id(case)}: {type(error).__name__}: {error}\n" \
                  f"{''.join(traceback.format_tb(error.__traceback__)[-4:])}"
    finally:
        hp.shutdown()
        if comm is not WORLD:
            comm.Free()
    failures = [f for f in WORLD.allgather(failure) if f]
    assert not failures, "\n".join(failures)

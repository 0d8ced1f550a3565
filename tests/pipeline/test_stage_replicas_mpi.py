"""Grids whose stages have their own replica counts (``hp.init(stage_replicas=[3, 1])``, PipeDream's "3-1") under a
real mpirun on 4 ranks: every rank passes the whole mini-batch, micro-batch m runs on replica m mod R_s of stage s,
and training equals one process on that mini-batch (float64, gpipe and 1f1b; M a multiple of the replica
counts or not); the grid's numbering, a checkpoint saved on 3-1 and loaded on 2 × 2 and 1 × 4, and the refusals."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import hybridpipe as hp
from hybridpipe.errors import GridError, HybridPipeError, ScheduleError
from agree import ranks_agree

pytestmark = pytest.mark.mpi(ranks=[4], timeout=240, shared=True)

torch.set_num_threads(1)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(6, 3)).double()


def batches(steps: int, size: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(size, 6, generator=generator, dtype=torch.float64),
             torch.randint(0, 3, (size,), generator=generator)) for _ in range(steps)]


def one_process(steps: list, lr: float = 0.1) -> tuple[nn.Sequential, list[float]]:
    """The same mini-batches through the whole model in one process (SGD with momentum)."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for inputs, targets in steps:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def train(model: hp.PipelineModel, optimizer, steps: list) -> list[float]:
    losses = []
    for inputs, targets in steps:
        optimizer.zero_grad()
        losses.append(model.train_step(inputs, targets))
        optimizer.step()
    return losses


def check_against(model: hp.PipelineModel, reference: nn.Sequential) -> None:
    want = dict(reference.named_parameters())
    own = dict(model.named_parameters())
    assert own
    for name, parameter in own.items():
        torch.testing.assert_close(parameter, want[name.removeprefix("layers.")], rtol=1e-9, atol=1e-12,
                                   msg=lambda text: f"{name}: {text}")


def build(schedule: str, micro_batches: int, balance: list[int]) -> tuple[hp.PipelineModel, torch.optim.Optimizer]:
    model = hp.PipelineModel(list(mlp()), loss_fn=nn.functional.cross_entropy, micro_batches=micro_batches,
                             balance=balance, schedule=schedule)
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters())
    return model, optimizer


CASES = [  # stage_replicas, schedule, micro-batches, balance
    ([3, 1], "gpipe", 6, [5, 2]),
    ([3, 1], "1f1b", 4, [4, 3]),
    ([1, 3], "1f1b", 4, [3, 4]),     # M not a multiple of 3: replica 0 of stage 1 runs two micro-batches
    ([1, 3], "gpipe", 5, [2, 5]),
    ([2, 1, 1], "1f1b", 5, [3, 2, 2]),
    ([2, 1, 1], "gpipe", 4, [2, 2, 3]),
    ([1, 1, 2], "1f1b", 3, [2, 2, 3]),
]


@pytest.mark.parametrize("replicas,schedule,micro_batches,balance", CASES,
                         ids=[f"{'-'.join(map(str, c[0]))}-{c[1]}-M{c[2]}" for c in CASES])
def test_trains_like_one_process(replicas, schedule, micro_batches, balance):
    grid = hp.init(stage_replicas=replicas)
    try:
        steps = batches(3)
        model, optimizer = build(schedule, micro_batches, balance)
        losses = train(model, optimizer, steps)
        reference, reference_losses = one_process(steps)
        actions = model.last_step.actions
        with ranks_agree():
            assert grid.stage_replicas == tuple(replicas) and grid.data_replicas == replicas[grid.stage]
            # this rank ran its own micro-batches only, each forward and backward once
            mine = sorted({a.micro_batch for a in actions})
            assert mine == [m for m in range(micro_batches) if m % replicas[grid.stage] == grid.replica]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-12, atol=0)
            check_against(model, reference)
        model.close()
    finally:
        hp.shutdown()


class Net(nn.Module):
    """:func:`mlp` inside a module of its own: handed to hp.PipelineModel whole, it is traced and split by name."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("replicas,split", [([3, 1], ["body.4"]), ([1, 3], ["body.2"])], ids=["3-1", "1-3"])
def test_a_split_module_is_verified_and_trains_like_one_process(replicas, split):
    """A whole module split by name on a grid with its own replica count per stage: the split's check run (one
    micro-batch, on replica 0 of each stage; the other replicas take its output) ends on every rank, and training
    equals one process."""
    grid = hp.init(stage_replicas=replicas)
    try:
        steps = batches(2)
        model = hp.PipelineModel(Net(), loss_fn=nn.functional.cross_entropy, micro_batches=4, split=split,
                                 sample=torch.randn(4096, 6, dtype=torch.float64), schedule="1f1b",
                                 verify=True)  # activations past the eager limit: a send no one receives blocks
        optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                            named_parameters=model.named_parameters())
        losses = train(model, optimizer, steps)
        reference, reference_losses = one_process(steps)
        with ranks_agree():
            assert grid.stage_replicas == tuple(replicas)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-12, atol=0)
            want = dict(reference.named_parameters())
            own = dict(model.named_parameters())
            assert own and all(name.startswith("body.") for name in own), sorted(own)
            for name, parameter in own.items():
                torch.testing.assert_close(parameter, want[name.removeprefix("body.")], rtol=1e-9, atol=1e-12)
        model.close()
    finally:
        hp.shutdown()


def test_grid_numbering_and_describe():
    grid = hp.init(stage_replicas=[3, 1])
    try:
        with ranks_agree():
            assert [grid.place_of(r) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (0, 2)]
            assert (grid.stage, grid.replica) == grid.place_of(grid.rank)
            assert grid.ranks_of_stage(0) == [0, 2, 3] and grid.ranks_of_stage(1) == [1]
            assert grid.config == "3-1" and not grid.uniform
            assert grid.data_comm.Get_size() == grid.data_replicas and grid.data_comm.Get_rank() == grid.replica
            assert sorted(grid.pipeline_peers()) == ([1] if grid.stage == 0 else [0, 2, 3])
            assert "-" in grid.table().splitlines()[2] or grid.table().splitlines()[2].split()[-1] == "1"
    finally:
        hp.shutdown()
    same = hp.init(stage_replicas=[2, 2])  # uniform counts: exactly the grid of pipeline_stages=2
    try:
        with ranks_agree():
            assert same.uniform and same.config == "2-2" and (same.stage, same.replica) == (same.rank % 2, same.rank // 2)
    finally:
        hp.shutdown()


def test_the_launcher_variable_sets_the_grid(monkeypatch):
    monkeypatch.setenv("HYBRIDPIPE_STAGE_REPLICAS", "1,3")  # what hybridpipe-run --stage-replicas 1,3 sets
    grid = hp.init()
    try:
        with ranks_agree():
            assert grid.stage_replicas == (1, 3) and grid.place_of(grid.rank) == (grid.stage, grid.replica)
    finally:
        hp.shutdown()
    with pytest.warns(UserWarning, match="overrides HYBRIDPIPE_STAGE_REPLICAS=1,3") if hp_rank() == 0 else \
            contextlib.nullcontext():
        grid = hp.init(pipeline_stages=2)
    try:
        with ranks_agree():
            assert grid.uniform and grid.stage_replicas == (2, 2)
    finally:
        hp.shutdown()


def hp_rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


def test_bad_stage_replicas_are_refused_on_every_rank():
    with ranks_agree():
        with pytest.raises(GridError, match=r"sums to 3 ranks but the job has 4.*-np 3"):
            hp.init(stage_replicas=[2, 1])
        with pytest.raises(GridError, match=r"replica count >= 1"):
            hp.init(stage_replicas=[4, 0])
        with pytest.raises(GridError, match=r"2 replica counts for 3 stages"):
            hp.init(pipeline_stages=3, stage_replicas=[3, 1])
    from mpi4py import MPI
    mine = [3, 1] if MPI.COMM_WORLD.Get_rank() else [1, 3]
    with ranks_agree():
        with pytest.raises(GridError, match=r"ranks passed different stage_replicas.*rank 0: \[1, 3\]"):
            hp.init(stage_replicas=mine)
        assert not hp.is_initialized()


def test_schedules_that_do_not_run_say_so():
    hp.init(stage_replicas=[3, 1])
    try:
        with ranks_agree():
            with pytest.raises(HybridPipeError, match=r"schedule 'interleaved-1f1b' does not run on a grid with "
                                                      r"stage_replicas \[3, 1\] \(3-1\)"):
                hp.PipelineModel(list(mlp()), loss_fn=nn.functional.cross_entropy, micro_batches=4, balance=[2, 1, 2, 2],
                                 schedule="interleaved-1f1b", virtual_stages=2)
    finally:
        hp.shutdown()


def test_checkpoint_saved_on_3_1_resumes_on_uniform_grids(tmp_path_factory):
    from mpi4py import MPI

    directory = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("ckpt")) if MPI.COMM_WORLD.Get_rank() == 0 else None)
    steps = batches(4)
    hp.init(stage_replicas=[3, 1])
    try:
        model, optimizer = build("1f1b", 4, [4, 3])
        train(model, optimizer, steps[:2])
        hp.save_checkpoint(directory, model, optimizer, step=2)
        model.close()
    finally:
        hp.shutdown()
    # 10 samples do not split into 4 equal shards: the 1 × 4 grid trains on the first 8 of each later batch
    later = {2: steps[2:], 1: [(x[:8], y[:8]) for x, y in steps[2:]]}
    for stages in (2, 1):
        grid = hp.init(pipeline_stages=stages)
        try:
            shards = [(x.chunk(grid.data_replicas)[grid.replica], y.chunk(grid.data_replicas)[grid.replica])
                      for x, y in later[stages]]
            model, optimizer = build("1f1b", 2 if stages == 2 else 1, [4, 3] if stages == 2 else [7])
            hp.load_checkpoint(directory, model, optimizer)
            train(model, optimizer, shards)
            reference, _ = one_process(steps[:2] + later[stages])
            with ranks_agree():
                check_against(model, reference)
            model.close()
        finally:
            hp.shutdown()


def test_auto_builds_the_grid_of_a_plan_with_its_own_replica_counts():
    from hybridpipe.plan.search import Plan

    hp.init(pipeline_stages=1)
    try:
        given = Plan(stages=2, replicas=1, balance=[4, 3], micro_batches=4, schedule="1f1b", checkpoint="never",
                     step_seconds=1.0, samples_per_second=10.0, memory_bytes_per_rank=0.0, global_batch=10,
                     stage_replicas=[3, 1])
        steps = batches(3)
        model, optimizer = hp.auto(list(mlp()), nn.functional.cross_entropy, steps[0], 10,
                                   lambda parameters: torch.optim.SGD(parameters, lr=0.1, momentum=0.9), plan=given)
        grid = hp.grid()
        train(model, optimizer, steps)
        reference, _ = one_process(steps)
        with ranks_agree():
            assert grid.stage_replicas == (3, 1) and model.plan.config == "3-1"
            check_against(model, reference)
        model.close()
    finally:
        hp.shutdown()


def test_auto_remakes_the_grid_with_the_jobs_settings_and_refuses_while_a_process_set_lives_on_it():
    """hp.auto's re-made grid keeps the job's own settings (hp.init(config=...)); a process set made on the old grid
    would end with it, so the re-making is refused on every rank, naming the set and the fix."""
    from hybridpipe.plan.search import Plan

    given = Plan(stages=2, replicas=1, balance=[4, 3], micro_batches=4, schedule="1f1b", checkpoint="never",
                 step_seconds=1.0, samples_per_second=10.0, memory_bytes_per_rank=0.0, global_batch=10,
                 stage_replicas=[3, 1])
    factory = lambda parameters: torch.optim.SGD(parameters, lr=0.1)  # noqa: E731
    hp.init(pipeline_stages=1, config=hp.Config(cycle_time_ms=3.5))
    try:
        pair = hp.add_process_set([0, 1])
        try:
            hp.auto(list(mlp()), nn.functional.cross_entropy, batches(1)[0], 10, factory, plan=given)
            refused = None
        except hp.GridError as error:
            refused = str(error)
        with ranks_agree():
            assert refused is not None and "hp.auto: the plan needs the grid {'stage_replicas': [3, 1]}" in refused \
                and "process set 1 (ranks [0, 1])" in refused and "call hp.auto before making them" in refused, refused
            assert hp.grid().pipeline_stages == 1  # the running grid is left as it was
        hp.remove_process_set(pair)
        model, _ = hp.auto(list(mlp()), nn.functional.cross_entropy, batches(1)[0], 10, factory, plan=given)
        with ranks_agree():
            assert hp.grid().stage_replicas == (3, 1) and hp.config().cycle_time_ms == 3.5
        model.close()
    finally:
        hp.shutdown()


@pytest.mark.parametrize("replicas,balance,micro_batches", [([3, 1], [4, 3], 6), ([1, 3], [3, 4], 3),
                                                             ([2, 1, 1], [3, 2, 2], 4)])
def test_pipedream_matches_its_one_process_replay(replicas, balance, micro_batches):
    """PipeDream's 1F1B-RR: each replica its micro-batches, each stage's round of replicas one averaged update with
    weight stashing; two train_steps and a flush against the replay (tests/pipeline/training.py)."""
    from training import replay_pipedream_replicas

    grid = hp.init(stage_replicas=replicas)
    try:
        factory = lambda parameters: torch.optim.SGD(parameters, lr=0.1, momentum=0.9)  # noqa: E731
        model = hp.PipelineModel(list(mlp()), loss_fn=nn.functional.cross_entropy, micro_batches=micro_batches,
                                 balance=balance, schedule="pipedream", optimizer=factory)
        steps = batches(2, size=2 * micro_batches)
        for inputs, targets in steps:
            model.train_step(inputs, targets)
        model.flush()
        data = [(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]) for x, y in steps for i in range(micro_batches)]
        modules = replay_pipedream_replicas(mlp(), balance, replicas, data, nn.functional.cross_entropy, factory,
                                            micro_batches)
        want = {f"{sum(balance[:grid.stage]) + int(name.split('.')[0])}.{name.split('.', 1)[1]}": p
                for name, p in modules[grid.stage].named_parameters()}
        with ranks_agree():
            for name, parameter in model.named_parameters():
                torch.testing.assert_close(parameter, want[name.removeprefix("layers.")], rtol=1e-9, atol=1e-12,
                                           msg=lambda text: f"{name}: {text}")
        model.close()
    finally:
        hp.shutdown()


def test_pipedream_needs_whole_rounds():
    hp.init(stage_replicas=[3, 1])
    try:
        with ranks_agree():
            with pytest.raises(ScheduleError, match=r"micro_batches a multiple of every count.*4 is not a multiple of 3: use e.g. 3"):
                hp.PipelineModel(list(mlp()), loss_fn=nn.functional.cross_entropy, micro_batches=4, balance=[4, 3],
                                 schedule="pipedream", optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    finally:
        hp.shutdown()



def test_elastic_sampler_cuts_the_same_mini_batches_for_every_grid_and_goes_on_after_a_grid_change():
    """hp.elastic.ElasticSampler on 1 x 4, 2 x 2 and 3-1: in batch mode each global mini-batch is the same
    consecutive slice of the epoch's permutation on every grid; a uniform grid's data replicas share it (the ranks
    of one pipeline get the same part), a 3-1 grid gives every rank all of it. Sample mode shares the epoch out
    disjointly, padded with its first indices to equal shares. After two mini-batches on 1 x 4 and a change of grid,
    the state rolled back and synced on 3-1 yields the rest of the epoch, none skipped or repeated."""
    dataset = list(range(22))
    order = torch.randperm(22, generator=torch.Generator().manual_seed(5 + 1)).tolist()  # seed 5, epoch 1
    want = [order[at:at + 8] for at in range(0, 22, 8)]  # 8, 8, and a last 6
    shapes = {"1x4": dict(), "2x2": dict(pipeline_stages=2), "3-1": dict(stage_replicas=[3, 1])}
    for label, kwargs in shapes.items():
        grid = hp.init(**kwargs)
        try:
            sampler = hp.elastic.ElasticSampler(dataset, seed=5, batch_size=8)
            sampler.set_epoch(1)
            mine = list(sampler)
            every = hp.allgather_object((grid.replica, mine), group="world")
            shares = hp.allgather_object((grid.replica, list(hp.elastic.ElasticSampler(dataset, shuffle=False))),
                                         group="world")
            with ranks_agree():
                assert len(sampler) == len(mine)
                if not grid.uniform:
                    assert all(part == want for _, part in every), (label, every)
                    assert all(share == dataset for _, share in shares), label
                    continue
                parts = grid.data_replicas
                expected = want if 6 % parts == 0 else want[:2]  # 1 x 4: the last 6 cannot be shared by 4
                by_replica = dict(every)
                assert len(by_replica) == parts and all(part == by_replica[r] for r, part in every), (label, every)
                assert [sum((by_replica[r][k] for r in range(parts)), []) for k in range(len(expected))] == expected
                assert all(len(by_replica[r][k]) == len(expected[k]) // parts for r in range(parts)
                           for k in range(len(expected))), label
                by_replica = dict(shares)
                assert sorted(sum(by_replica.values(), [])) == sorted(dataset + dataset[:(-22) % parts]), label
                assert len({len(share) for share in by_replica.values()}) == 1, label
        finally:
            hp.shutdown()
    hp.init()  # 1 x 4: two mini-batches trained and committed, then the grid changes
    try:
        with ranks_agree():
            with pytest.raises(ValueError, match=r"batch_size 6 cannot be shared by the 4 data replicas of the grid"):
                hp.elastic.ElasticSampler(dataset, batch_size=6)
            with pytest.raises(ValueError, match=r"batch_size must be a positive int .* got 0"):
                hp.elastic.ElasticSampler(dataset, batch_size=0)
            with pytest.raises(TypeError, match=r"seed must be an int \(the same on every rank\), got 1.5"):
                hp.elastic.ElasticSampler(dataset, seed=1.5)
        sampler = hp.elastic.ElasticSampler(dataset, seed=5, batch_size=8)
        state = hp.elastic.ObjectState(sampler=sampler, step=0)
        sampler.set_epoch(1)
        parts = list(sampler)
        for index in range(2):
            sampler.record_batch(index, len(parts[index]))  # this rank's share's size: the whole mini-batch marked
        state.commit()
        with ranks_agree():
            with pytest.raises(ValueError, match=r"batch_size 5 is neither the mini-batch \(8\) nor this rank's"):
                sampler.record_batch(0, 5)
            with pytest.raises(IndexError, match="batch 7 is not one of this iteration's 2 mini-batches"):
                sampler.record_batch(7, 8)
        sampler.set_epoch(2)  # after the commit: rolled back below
    finally:
        hp.shutdown()
    hp.init(stage_replicas=[3, 1])
    try:
        state.restore()
        state.sync()
        rest = list(sampler)
        with ranks_agree():
            assert state.sampler is sampler and state.step == 0
            assert sampler.state_dict() == {"epoch": 1, "processed_indices": set(want[0] + want[1])}
            assert rest == [want[2]], rest  # the last 6, whole on every rank of 3-1
    finally:
        hp.shutdown()

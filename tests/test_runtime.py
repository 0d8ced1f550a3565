"""hp.init / the rank grid / shutdown under a real mpirun, errors raised on every rank. Checks go through
ranks_agree (a test's collectives first, its checks after), so a check failing on one rank fails every rank at
that point instead of leaving the others in the next collective."""

import pytest
import torch
from mpi4py import MPI

import hybridpipe as hp
from agree import ranks_agree

pytestmark = pytest.mark.mpi(ranks=4, long_ranks=8, shared=True)  # one mpirun with the other 4-rank files

WORLD = MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def clean_runtime():
    hp.shutdown()
    yield
    hp.shutdown()


@ranks_agree()
def test_calls_before_init_name_the_fix():
    assert not hp.is_initialized()
    for call in (hp.rank, hp.size, hp.grid, hp.local_rank, hp.local_size):
        with pytest.raises(hp.NotInitializedError, match=r"hp\.\w+\(\) was called before hp\.init\(\)"):
            call()
    with pytest.raises(hp.NotInitializedError, match=r"hp\.allreduce\(\) was called before hp\.init"):
        hp.allreduce(torch.ones(1))


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_grid_mapping_and_communicators(stages):
    n, world_rank = WORLD.Get_size(), WORLD.Get_rank()
    with ranks_agree():
        grid = hp.init(pipeline_stages=stages)
        in_my_pipeline = grid.pipe_comm.allgather(world_rank)
        in_my_stage = grid.data_comm.allgather(world_rank)
        assert (grid.pipeline_stages, grid.data_replicas, grid.size) == (stages, n // stages, n)
        assert (grid.stage, grid.replica, grid.rank) == (world_rank % stages, world_rank // stages, world_rank)
        assert grid.rank_of(grid.stage, grid.replica) == world_rank
        # pipe_comm: my pipeline's stages, ranked by stage, consecutive world ranks (node-local when packed)
        assert grid.pipe_comm.Get_size() == stages and grid.pipe_comm.Get_rank() == grid.stage
        assert in_my_pipeline == list(range(grid.replica * stages, (grid.replica + 1) * stages))
        # data_comm: my stage's replicas, ranked by replica
        assert grid.data_comm.Get_size() == n // stages and grid.data_comm.Get_rank() == grid.replica
        assert in_my_stage == list(range(grid.stage, n, stages))
        assert grid.is_first_stage == (grid.stage == 0) and grid.is_last_stage == (grid.stage == stages - 1)
        assert (hp.rank(), hp.size(), hp.grid()) == (world_rank, n, grid)
        # all ranks of this test run on one host
        assert (hp.local_rank(), hp.local_size()) == (world_rank, n)
        assert "stage \\ replica" in grid.table() and str(n - 1) in grid.table()


def test_init_twice_same_grid_returns_it_and_other_grid_is_an_error():
    grid = hp.init(pipeline_stages=2)
    with ranks_agree(what="the same grid again"):
        assert hp.init(pipeline_stages=2) is grid
    with ranks_agree(what="another grid"), pytest.raises(
            hp.GridError, match=r"already initialized with pipeline_stages=2 on \d+ ranks; "
                                r".*\(call hp.shutdown\(\) first\)"):
        hp.init(pipeline_stages=1)
    hp.shutdown()
    shut_down = not hp.is_initialized()
    with ranks_agree(what="after hp.shutdown"):
        stages = hp.init(pipeline_stages=1).pipeline_stages
        assert shut_down and stages == 1


@ranks_agree()
def test_shutdown_drops_the_jobs_state_and_init_starts_a_new_one():
    from hybridpipe import runtime

    hp.init()
    first = runtime.job("test")
    assert first.grid is hp.grid() and first.local_comm.Get_size() == hp.local_size()
    first.warned_staging = True  # what a job holds (the staging warning, NCCL communicators, streams, ...)
    hp.shutdown()
    assert not hp.is_initialized()
    with pytest.raises(hp.NotInitializedError, match=r"hp\.test\(\) was called before hp\.init"):
        runtime.job("test")
    hp.init()
    second = runtime.job("test")
    assert second is not first and not second.warned_staging and second.timeline is None


@ranks_agree()
def test_world_size_not_divisible_names_both_fixes():
    n = WORLD.Get_size()
    with pytest.raises(hp.GridError) as error:
        hp.init(pipeline_stages=3)
    assert f"world size {n} is not divisible by pipeline_stages 3" in str(error.value)
    assert f"pass -np {(n // 3 + 1) * 3} or --stages 2" in str(error.value)
    assert not hp.is_initialized()


@pytest.mark.parametrize("bad", [0, -2])
@ranks_agree()
def test_stages_below_one(bad):
    with pytest.raises(hp.GridError, match=rf"pipeline_stages must be >= 1, got {bad}"):
        hp.init(pipeline_stages=bad)


@ranks_agree()
def test_stages_not_an_int():
    with pytest.raises(hp.GridError, match=r"pipeline_stages must be an int, got '2' \(str\)"):
        hp.init(pipeline_stages="2")


@ranks_agree()
def test_ranks_disagreeing_on_stages_fail_everywhere():
    stages = 2 if WORLD.Get_rank() == 0 else 1
    with pytest.raises(hp.GridError, match=r"ranks passed different pipeline_stages to hp.init \(rank 0: 2, rank 1: 1"):
        hp.init(pipeline_stages=stages)
    assert not hp.is_initialized()


def test_init_on_a_sub_communicator():
    world_rank = WORLD.Get_rank()
    half = WORLD.Split(color=world_rank % 2, key=world_rank)
    try:
        with ranks_agree():
            grid = hp.init(pipeline_stages=2, comm=half)
            total = hp.allreduce(torch.tensor([world_rank]), op=hp.Sum).item()
            members = half.allgather(world_rank)
            assert grid.size == WORLD.Get_size() // 2 and grid.rank == world_rank // 2
            assert total == sum(members)
    finally:
        hp.shutdown()
        half.Free()

"""Harness case: hybridpipe.testing.agree.ranks_agree; a check failing on one rank fails every rank at the
same point, and the ranks stay in step for the next test."""

import pytest
from mpi4py import MPI

from agree import ranks_agree

pytestmark = pytest.mark.mpi(ranks=2, timeout=60, shared=True)

WORLD = MPI.COMM_WORLD


def test_rank_one_fails_in_a_loop_of_collectives():
    for iteration in range(4):
        total = WORLD.allreduce(iteration)  # without agreement rank 0 would wait here for rank 1
        with ranks_agree(what=f"iteration {iteration}"):
            assert total == 2 * iteration
            assert not (WORLD.rank == 1 and iteration == 2), "rank 1 fails on purpose"
    raise AssertionError("not reached")


@ranks_agree()
def test_decorated_test_fails_on_rank_zero():
    assert WORLD.rank != 0, "rank 0 fails on purpose"


def test_ranks_still_in_step():
    assert WORLD.allgather(WORLD.rank) == [0, 1]
    with ranks_agree():
        pass

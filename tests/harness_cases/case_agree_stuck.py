"""Harness case: rank 1 never reaches ranks_agree (stuck in a collective rank 0 skipped): rank 0 aborts
the job after its timeout instead of hanging."""

import pytest
from mpi4py import MPI

from agree import ranks_agree

pytestmark = pytest.mark.mpi(ranks=2, timeout=60)


def test_rank_one_stuck_elsewhere():
    world = MPI.COMM_WORLD
    other = world.Dup()
    if world.rank == 1:
        other.Barrier()  # rank 0 never comes: rank 1 waits here for good
    with ranks_agree(timeout_s=2):
        pass

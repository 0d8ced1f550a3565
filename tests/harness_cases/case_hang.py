"""Harness case: rank 1 never reaches the barrier rank 0 waits in."""

import time

import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi(ranks=2, timeout=10)


def test_hangs():
    if MPI.COMM_WORLD.rank == 1:
        time.sleep(3600)
    MPI.COMM_WORLD.Barrier()

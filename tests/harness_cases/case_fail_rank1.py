"""Harness case: the test fails on rank 1 only."""

import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi(ranks=2, timeout=60)


def test_fails_on_rank_one():
    rank = MPI.COMM_WORLD.rank
    print(f"hello from rank {rank}")
    assert rank != 1, "rank 1 fails on purpose"

"""Harness case: a shared file whose test fails on rank 1; it runs in the same mpirun as case_shared_pass.py."""

import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi(ranks=2, timeout=60, shared=True)


def test_fails_on_rank_one_in_a_shared_launch():
    rank = MPI.COMM_WORLD.rank
    print(f"shared hello from rank {rank}")
    assert rank != 1, "rank 1 fails on purpose"

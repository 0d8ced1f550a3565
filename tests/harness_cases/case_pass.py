"""Harness case: passes on both ranks; one test is skipped everywhere."""

import os

import pytest

# The parent pytest must never import an MPI file (it would initialise MPI there).
assert os.environ.get("HYBRIDPIPE_UNDER_MPIRUN") == "1", "imported outside mpirun"

from mpi4py import MPI  # noqa: E402

pytestmark = pytest.mark.mpi(ranks=2, timeout=60)


def test_allreduce_sums_ranks():
    assert MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.rank) == 1


def test_skipped_everywhere():
    pytest.skip("nothing to see")

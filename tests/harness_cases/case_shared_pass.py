"""Harness case: a shared file whose test passes; it runs in the same mpirun as case_shared_fail.py."""

import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi(ranks=2, timeout=60, shared=True)


def test_passes_beside_a_failing_file():
    assert MPI.COMM_WORLD.allreduce(1) == 2

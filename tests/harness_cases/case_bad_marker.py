"""Harness case: an mpi marker the parent cannot read without importing the file."""

import pytest

RANKS = 2
pytestmark = pytest.mark.mpi(ranks=RANKS)


def test_never_runs():
    raise AssertionError("must not be collected")

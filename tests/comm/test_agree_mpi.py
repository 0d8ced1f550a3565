"""agree_on_failure under mpirun (2 ranks): one rank's exception is raised on every rank with its own type,
message and attributes; the result of root's work reaches every rank; an exception that does not pickle
arrives as RemoteError naming its type."""

from __future__ import annotations

import pytest
from mpi4py import MPI

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.comm.agree import RemoteError, agree_on_failure
from hybridpipe.errors import HybridPipeError

pytestmark = pytest.mark.mpi(ranks=[2], timeout=120, shared=True)


@pytest.fixture(scope="module")
def comm():
    hp.init()
    duplicate = MPI.COMM_WORLD.Dup()
    yield duplicate
    duplicate.Free()


def outcome(comm, fn, **options):
    """(value, None) or (None, the exception raised) of agree_on_failure on this rank."""
    try:
        return agree_on_failure(comm, fn, **options), None
    except Exception as error:  # noqa: BLE001 - the test looks at it
        return None, error


def test_roots_result_reaches_every_rank_and_only_root_runs_it(comm):
    ran = []
    value, error = outcome(comm, lambda: ran.append(comm.rank) or {"rank": comm.rank, "data": [1, 2]}, root=0)
    with ranks_agree():
        assert error is None and value == {"rank": 0, "data": [1, 2]}
        assert ran == ([0] if comm.rank == 0 else [])


def test_roots_exception_is_raised_on_every_rank_with_its_type_and_attributes(comm):
    def work():
        raise FileNotFoundError(2, "No such file or directory", "/nonexistent/profile.json")

    _, error = outcome(comm, work, root=0, what="reading the profile")
    with ranks_agree():
        assert type(error) is FileNotFoundError and error.filename == "/nonexistent/profile.json", repr(error)
        notes = getattr(error, "__notes__", [])
        if comm.rank == 0:
            assert notes == []  # the original, with its own traceback
        else:
            assert notes == ["reading the profile: raised on rank 0 of the group; every rank raises it"], notes


def test_one_ranks_failure_fails_every_rank_and_the_others_keep_their_results(comm):
    def work():
        if comm.rank == 1:
            raise ValueError(f"bad shard on rank {comm.rank}")
        return comm.rank

    _, error = outcome(comm, work)
    value, fine = outcome(comm, lambda: comm.rank * 10)
    with ranks_agree():
        assert type(error) is ValueError and str(error) == "bad shard on rank 1", repr(error)
        assert fine is None and value == comm.rank * 10


def test_the_lowest_failing_ranks_exception_wins_and_a_ranks_own_is_its_cause(comm):
    def work():
        raise KeyError(f"rank {comm.rank}")

    _, error = outcome(comm, work)
    with ranks_agree():
        assert type(error) is KeyError and error.args == ("rank 0",), repr(error)
        if comm.rank == 1:
            assert type(error.__cause__) is KeyError and error.__cause__.args == ("rank 1",)


def test_an_exception_that_does_not_pickle_arrives_as_remote_error(comm):
    class Local(Exception):  # a local class: pickle cannot find it by name
        pass

    def work():
        raise Local("only rank 0 knows this class")

    _, error = outcome(comm, work, root=0)
    with ranks_agree():
        if comm.rank == 0:
            assert type(error) is Local
        else:
            assert isinstance(error, RemoteError) and isinstance(error, HybridPipeError), repr(error)
            assert error.rank == 0 and error.type_name.endswith("Local")
            assert str(error).endswith("Local on rank 0: only rank 0 knows this class"), str(error)

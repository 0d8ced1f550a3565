"""MPI test files' helper: ranks agree before they assert, so that a check failing on one rank fails on every
rank at the same point, with that rank's message (it imports mpi4py and numpy only: cheap to import).

An MPI test whose assertion fails on one rank leaves the test there while the other ranks go on into the
next collective; the ranks then meet in mismatched collectives and the launch hangs until its timeout,
with no assertion in the report. Wrapping the assertions (not the collectives) in :func:`ranks_agree`
makes every rank gather every rank's verdict first::

    got = hp.allreduce(x)
    with ranks_agree():
        assert torch.equal(got, want)

It also works as a decorator on a test whose collectives all come before a failure can happen. The gather
waits at most ``timeout_s``: a rank that never arrives (stuck in another collective after an earlier,
unguarded failure) makes the waiting ranks print why and abort the job, a failure in seconds, not a hang.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
from collections.abc import Iterator
from typing import Any

try:
    import pytest

    _CAUGHT: tuple[type[BaseException], ...] = (Exception, pytest.fail.Exception)
except ImportError:  # pragma: no cover - the helper is for tests, but importable without pytest
    _CAUGHT = (Exception,)

DEFAULT_TIMEOUT_S = float(os.environ.get("HYBRIDPIPE_AGREE_TIMEOUT_S", "60"))
MESSAGE_CHARS = 4000


class OtherRankFailed(AssertionError):
    """Raised on the ranks that passed a :func:`ranks_agree` block that another rank failed."""


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + " ..."


def _wait(request: Any, comm: Any, timeout_s: float, what: str) -> None:
    """Polls ``request`` until done; past ``timeout_s``, says why on stderr and aborts every rank."""
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not request.Test():
        if time.monotonic() > deadline:
            message = (f"ranks_agree{what}: rank {comm.Get_rank()} waited {timeout_s:g} s for the other ranks' "
                       "verdicts; some rank never came (stuck in another collective after a failure this "
                       "helper did not guard): aborting the job rather than hanging")
            print(message, file=sys.stderr, flush=True)
            sys.stdout.flush()
            comm.Abort(1)
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def gather_verdicts(comm: Any, failure: str | None, timeout_s: float = DEFAULT_TIMEOUT_S,
                    what: str = "") -> list[str | None]:
    """Every rank's ``failure`` (None: passed), in rank order; a collective over ``comm``."""
    import numpy as np
    from mpi4py import MPI

    payload = b"" if failure is None else pickle.dumps(failure)
    lengths = np.zeros(comm.Get_size(), dtype=np.int64)
    _wait(comm.Iallgather(np.array([len(payload)], dtype=np.int64), lengths), comm, timeout_s, what)
    if not lengths.any():
        return [None] * comm.Get_size()
    gathered = bytearray(int(lengths.sum()))
    displacements = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    comm.Allgatherv([payload, MPI.BYTE], [gathered, (lengths.tolist(), displacements.tolist()), MPI.BYTE])
    verdicts: list[str | None] = []
    for length, start in zip(lengths.tolist(), displacements.tolist()):
        verdicts.append(pickle.loads(bytes(gathered[start:start + length])) if length else None)
    return verdicts


@contextlib.contextmanager
def ranks_agree(comm: Any = None, what: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[None]:
    """Runs the block, then gathers every rank's pass / fail over ``comm`` (default: MPI.COMM_WORLD); when
    any rank failed, every rank raises: the failing ranks their own exception, the others
    :class:`OtherRankFailed` naming the failing ranks and the first one's message.

    Every rank of ``comm`` must enter the block the same number of times. Keep collectives out of the
    block (a rank that fails before one would leave the others waiting in it); guard the assertions.

    Args:
        comm: An mpi4py communicator.
        what: Named in the messages (e.g. the loop's case) to say where the ranks were.
        timeout_s: How long to wait for the other ranks before aborting the job.
    """
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    failure: BaseException | None = None
    try:
        yield
    except _CAUGHT as error:
        failure = error
    label = f" ({what})" if what else ""
    verdicts = gather_verdicts(comm, None if failure is None else _describe(failure), timeout_s, label)
    failed = [rank for rank, verdict in enumerate(verdicts) if verdict is not None]
    if failure is not None:
        raise failure
    if failed:
        raise OtherRankFailed(f"rank {failed[0]} failed{label} (failed on ranks {failed} of {len(verdicts)}); "
                              f"its message: {verdicts[failed[0]]}")

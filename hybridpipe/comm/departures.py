"""Departure notices: which ranks have shut down, so that a rank waiting for one of them raises at once.

``hp.shutdown()`` first tells every rank that may wait for this one through point-to-point transfers
(the other stages of its pipeline) that it is leaving: one small message each, on a communicator of
its own. Each rank keeps a receive for such notices posted (from any source) while hybridpipe runs,
and every point-to-point wait (:mod:`hybridpipe.comm.p2p`) watches it beside its own requests: a wait
for a rank that has left ends in :class:`~hybridpipe.errors.PeerShutDownError` instead of hanging.

A notice says why the rank leaves: ``hp.shutdown()``, or an uncaught exception (``python -m hybridpipe``
tells the others before it aborts the job; a plain script's ``hp.shutdown`` at interpreter exit finds the
exception in ``sys.last_value``), so that they name the rank that failed and not the wrong fix.

Why a notice and not a timeout: the rank that left still answers the engine's negotiation (it waits
there, in ``hp.shutdown``, for the others to stop too), so nothing looks stalled; only it knows it
will send nothing more.

At shutdown every rank has sent its notices before its engine agrees to stop, so after the engine
stopped each rank receives the notices its receive did not take (it knows whose: its pipeline's
other stages) and no message is left behind on a freed communicator.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._ext import core

__all__ = ["Departures", "NOTICE_TAG", "SHUT_DOWN", "FAILED"]

#: Tag of departure notices on the context's own communicator.
NOTICE_TAG = 7
#: How a rank left (:meth:`Departures.how_left`).
SHUT_DOWN = "has shut down (hp.shutdown)"
FAILED = "failed with an uncaught exception (its traceback is in its output)"
_ANNOUNCE_WAIT_SECONDS = 5.0  # a notice is a few bytes (sent eagerly): this only bounds a broken MPI


class Departures:
    """The departure notices of one hp.init (owned by the :class:`~hybridpipe.comm.context.CommContext`).

    Args:
        grid: the runtime's Grid; its ``world_comm`` is duplicated here (collective).
    """

    def __init__(self, grid: Any) -> None:
        from mpi4py import MPI

        self.comm = grid.world_comm.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self._place_of = grid.rank, grid.place_of
        # who may wait for me (and whom I may wait for) through the pipeline: my replica's other stages (on a
        # non-uniform grid, every rank of another stage)
        self.peers = grid.pipeline_peers()
        self.left: dict[int, str] = {}  # world rank whose notice came -> why it left (see how_left)
        self._world_group = grid.world_comm.Get_group()
        self._world_ranks: dict[tuple[int, int], int] = {}
        self._buffer = np.full(1, -1, dtype=np.int64)
        self._request: Any = None

    def start(self) -> None:
        """Posts the notice receive (after the engine drives transfers: it then makes the MPI calls)."""
        self._post()

    def _post(self) -> None:
        from mpi4py import MPI

        if len(self.left) >= len(self.peers):
            self._request = None  # everyone who could tell us has: nothing more will come
            return
        self._buffer = np.full(1, -1, dtype=np.int64)
        self._request = core().irecv(self._buffer.ctypes.data, self._buffer.nbytes, MPI.ANY_SOURCE, NOTICE_TAG,
                                     self.comm.py2f(), self._buffer)

    @property
    def request(self) -> Any:
        """The posted notice receive (a P2PRequest to wait on beside others), or None."""
        return self._request

    def heard(self) -> None:
        """The notice receive completed: records who left and posts the next receive."""
        if self._request is None or not self._request.test():
            return
        self._record()
        self._post()

    def _record(self) -> None:
        if self._buffer[0] >= 0:
            rank, failed = divmod(int(self._buffer[0]), 2)
            self.left[rank] = FAILED if failed else SHUT_DOWN

    def how_left(self, world_rank: int) -> str:
        """How ``world_rank`` left, for a message: ``has shut down (hp.shutdown)`` or ``failed with an uncaught
        exception ...``."""
        return self.left.get(world_rank, SHUT_DOWN)

    def stage_of(self, world_rank: int) -> int:
        return self._place_of(world_rank)[0]

    def world_rank(self, comm_f: int, rank: int) -> int | None:
        """``rank`` of the communicator with Fortran handle ``comm_f`` as a rank of the world (None: not in it)."""
        key = (comm_f, rank)
        if key not in self._world_ranks:
            from mpi4py import MPI

            group = MPI.Comm.f2py(comm_f).Get_group()
            try:
                [world] = MPI.Group.Translate_ranks(group, [rank], self._world_group)
            finally:
                group.Free()
            self._world_ranks[key] = -1 if world == MPI.UNDEFINED else world
        found = self._world_ranks[key]
        return None if found < 0 else found

    def announce(self, failed: bool = False) -> None:
        """Tells every peer that this rank leaves: hp.shutdown (before the engine stops), or ``failed``: an
        uncaught exception (``python -m hybridpipe``, before it aborts the job)."""
        mine = np.array([2 * self.rank + int(failed)], dtype=np.int64)
        sends = [core().isend(mine.ctypes.data, mine.nbytes, peer, NOTICE_TAG, self.comm.py2f(), mine)
                 for peer in self.peers]
        for send in sends:
            core().wait_any([send], core().WaitPolicy(0.0, 1000.0), _ANNOUNCE_WAIT_SECONDS)

    def withdraw(self) -> None:
        """Cancels the notice receive (while the engine still runs); a notice it already took is recorded."""
        if self._request is not None:
            self._request.cancel()
            self._record()
            self._request = None

    def close(self, lost: bool = False) -> None:
        """After the engine stopped: receives the notices still on their way (every peer sent one), frees the
        communicator. ``lost``: ranks of the job died (hp.elastic.run goes on without them): nobody sends one,
        the communicator is revoked and freed."""
        import time

        from mpi4py import MPI

        if lost:
            self.comm.Revoke()
            self._world_group.Free()
            self.comm.Free()
            return
        buffers = [np.empty(1, dtype=np.int64) for _ in self.peers]
        requests = [self.comm.Irecv(buffer, source=peer, tag=NOTICE_TAG)
                    for peer, buffer in zip(self.peers, buffers) if peer not in self.left]
        deadline = time.monotonic() + _ANNOUNCE_WAIT_SECONDS  # bounded: an engine that failed agreed on nothing
        while requests and not MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(0.001)
        for request in requests:
            if request != MPI.REQUEST_NULL:
                request.Cancel()
                request.Free()
        self._world_group.Free()
        self.comm.Free()

"""Every rank learns of a failure: ``agree_on_failure(comm, fn)``, the one place that turns "one rank's work
raised" into "every rank raises that exception", keeping its type.

Design reasons:

* A rank that raises while the others go on to the next collective leaves them waiting for it; the rule is
  an error on every rank, never a hang (DESIGN.md). Each site that let one rank do work the others depend
  on (rank 0 profiles, every rank loads a shard) used to catch, flatten the exception to a string, broadcast
  it and tell success from failure by the string's shape. Here the exception itself travels (pickled, as
  MPI's object collectives send it), so every rank raises the same type with the same message and
  attributes: ``except FileNotFoundError`` works on every rank, not only the one that failed.
* An exception that does not pickle (a local class, an unpicklable attribute) arrives as
  :class:`RemoteError` (a ``HybridPipeError``) naming its type and message.
* On the rank that failed the original exception is re-raised with its traceback; on the others the copy
  carries a note (PEP 678) naming the rank it came from.
* The collectives run on the communication thread (``engine.call``), as every MPI call of the package does.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hybridpipe.comm.engine import call
from hybridpipe.errors import RemoteError

__all__ = ["Failure", "RemoteError", "agree_on_failure"]

T = TypeVar("T")


@dataclass(frozen=True)
class Failure:
    """What a failing rank sends: the pickled exception (None if it does not pickle), its type and message.
    ``Failure.of(error, rank)`` makes one; ``.exception(what)`` is the exception another rank raises."""

    pickled: bytes | None
    type_name: str
    message: str
    rank: int

    @classmethod
    def of(cls, error: BaseException, rank: int) -> Failure:
        try:
            pickled: bytes | None = pickle.dumps(error)
            pickle.loads(pickled)  # some exceptions pickle but do not rebuild (a required __init__ argument)
        except Exception:  # noqa: BLE001 - any failure to round-trip: send the type's name and the message
            pickled = None
        return cls(pickled, f"{type(error).__module__}.{type(error).__qualname__}", str(error), rank)

    def exception(self, what: str) -> BaseException:
        """The exception to raise on a rank that did not fail."""
        error: BaseException = (pickle.loads(self.pickled) if self.pickled is not None
                                else RemoteError.of_type(self.type_name, self.message, self.rank))
        error.add_note(f"{what}: raised on rank {self.rank} of the group; every rank raises it")
        return error


@dataclass(frozen=True)
class _Value:
    value: Any


def agree_on_failure(comm: Any, fn: Callable[[], T], *, root: int | None = None, what: str = "") -> T:
    """Runs ``fn`` and makes its failure every rank's (collective over ``comm``, an mpi4py communicator).

    ``root=None``: every rank runs ``fn``; if any raised, every rank raises the exception of the lowest rank
    that did (the others' are dropped), else each rank gets its own result.
    ``root=r``: only rank ``r`` runs ``fn``; every rank gets its result (broadcast, so it must pickle), or
    raises its exception.

    The exception keeps its type on every rank (:class:`RemoteError` if it cannot be sent). ``what`` names
    the work in the note added on the ranks that did not fail (and in the communication thread's label).
    """
    rank = comm.Get_rank()
    label = what or "agree_on_failure"
    original: BaseException | None = None
    outcome: Failure | _Value | None = None
    if root is None or rank == root:
        try:
            outcome = _Value(fn())
        except Exception as error:  # noqa: BLE001 - every rank raises it below, with its type
            original, outcome = error, Failure.of(error, rank)
    if root is None:
        failure = outcome if isinstance(outcome, Failure) else None
        failures = call(None, label, lambda: comm.allgather(failure))
        first = next((f for f in failures if f is not None), None)
    else:
        outcome = call(None, label, lambda: comm.bcast(outcome, root=root))
        first = outcome if isinstance(outcome, Failure) else None
    if first is None:
        assert isinstance(outcome, _Value)
        return outcome.value
    if original is not None and first.rank == rank:
        raise original
    raise first.exception(label) from original  # this rank's own failure, if any, as the cause

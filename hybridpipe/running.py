"""Which job is running: the one object that owns everything a job holds between hp.init and hp.shutdown.

That object is the :class:`~hybridpipe.comm.context.CommContext` hp.init makes (the grid and its communicators,
the engine, the process sets, NCCL communicators, staging streams, the timeline's recorder, ...); hp.shutdown
drops it, and with it all of that state. This module only holds it: it imports nothing of the package but its
errors, so that every layer (the timeline's recorder, comm's device and process sets, which the context is built
from) can ask for the running job without importing the class that imports them.
"""

from __future__ import annotations

from typing import Any

from .errors import NotInitializedError

__all__ = ["current", "current_or_none", "replace", "unopened_receives"]

_current: Any = None  # the running job (a CommContext), or None
# hybridpipe.comm.p2p's receives posted outside a job (p2p works without hp.init: the planner's ping-pong, scripts
# that only exchange tensors); inside one they are the job's (CommContext.unopened_receives)
_outside_job: dict[tuple[int, int, int], list[Any]] = {}


def current(function: str) -> Any:
    """The running job; NotInitializedError (naming ``hp.<function>``) before hp.init."""
    if _current is None:
        raise NotInitializedError(f"hp.{function}() was called before hp.init(); call hp.init() first")
    return _current


def current_or_none() -> Any:
    """The running job, or None."""
    return _current


def replace(job: Any) -> Any:
    """Makes ``job`` (a CommContext, or None) the running one; returns the one it replaces."""
    global _current
    previous, _current = _current, job
    return previous


def unopened_receives() -> dict[tuple[int, int, int], list[Any]]:
    """hybridpipe.comm.p2p's receives whose headers are not opened yet, per (communicator handle, source, tag), in
    posting order: the running job's, or outside a job the process's own."""
    return _current.unopened_receives if _current is not None else _outside_job

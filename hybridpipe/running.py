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

__all__ = ["current", "current_or_none", "replace"]

_current: Any = None  # the running job (a CommContext), or None


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

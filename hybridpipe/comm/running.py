"""Which communication context is running (hp.init starts one, hp.shutdown stops it).

Kept apart from the context's class (hybridpipe/comm/context.py) so that the modules the context is built from
(device, process sets) can ask for the running one without importing the class that imports them.
"""

from __future__ import annotations

from typing import Any

from ..errors import NotInitializedError

__all__ = ["current", "current_or_none", "replace"]

_current: Any = None  # the running CommContext, or None


def current(function: str) -> Any:
    """The running context; NotInitializedError (naming ``hp.<function>``) before hp.init."""
    if _current is None:
        raise NotInitializedError(f"hp.{function}() was called before hp.init(); call hp.init() first")
    return _current


def current_or_none() -> Any:
    """The running context, or None."""
    return _current


def replace(context: Any) -> Any:
    """Makes ``context`` (a CommContext, or None) the running one; returns the one it replaces."""
    global _current
    previous, _current = _current, context
    return previous

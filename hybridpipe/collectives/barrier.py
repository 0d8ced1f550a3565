"""Horovod's ``barrier``: blocks until every rank of the group has called it (on the communication thread,
in the engine's agreed order, like every other collective)."""

from __future__ import annotations

from typing import Any

from ..comm import context
from ..comm.context import refusing, resolve_group, resolved

__all__ = ["barrier"]


def barrier(process_set: Any = None, group: Any = None) -> None:
    """Blocks until every rank of the group (or process set) has called barrier."""
    with refusing("barrier", "barrier", group, process_set):
        group = resolve_group(group, process_set, "barrier")
        group = resolved(group, "barrier")
    context.call(group, "barrier", lambda: context.communicator(group, "barrier").Barrier(), "barrier")

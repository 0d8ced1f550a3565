"""Object collectives (Horovod's ``broadcast_object`` / ``allgather_object``): any picklable object, over the
replicas of this rank's stage by default, on the engine's communication thread like every other collective.

Also the two rules the data-parallel helpers share with them (hybridpipe/data_parallel/optimizer.py): which
group a call means (:func:`target`) and where its ``root_rank`` sits in it (:func:`root_index`).
"""

from __future__ import annotations

from typing import Any

from . import context
from .collectives import check_root

__all__ = ["DEFAULT_GROUP", "allgather_object", "broadcast_object", "group_name", "root_index", "spelling", "target"]

#: The group of the data-parallel helpers when none is given: the replicas of this rank's pipeline stage.
DEFAULT_GROUP = "data"


def group_name(group: Any) -> str:
    """How an error message names ``group``."""
    if isinstance(group, context.Group):
        return group.label
    return group if isinstance(group, str) else "a user communicator" if group is not None else "world"


def spelling(group: Any, process_set: Any, function: str) -> Any:
    """The group a data-parallel helper means, as the user spelled it: ``process_set`` (Horovod's keyword) or
    ``group`` (default "data"). What a long-lived object keeps (a DistributedOptimizer resolves it at each step:
    elastic training re-makes the job under it)."""
    if process_set is None:
        return DEFAULT_GROUP if group is None else group
    return context.resolve_group(group, process_set, function)


def target(group: Any, process_set: Any, function: str) -> context.Group:
    """The group of a one-shot call (an object collective, a parameter broadcast), resolved once
    (:class:`~hybridpipe.comm.context.Group`): raises what using it would raise; no communication."""
    return context.resolved(spelling(group, process_set, function), function)


def root_index(group: Any, root_rank: Any, function: str) -> int:
    """The rank in ``group``'s communicator of ``root_rank`` (a global rank for a process set)."""
    root = check_root(root_rank, function)
    state = context.current(function)
    set_ranks = state.set_ranks(group, function)
    if set_ranks is not None:
        if root not in set_ranks:
            raise ValueError(f"{function}: root_rank {root} is not in the process set (ranks {set_ranks}); with a "
                             "process set, root_rank is a global rank (hp.rank()), as in Horovod")
        return set_ranks.index(root)
    size = state.group_size(group, function)
    if not 0 <= root < size:
        raise ValueError(f"{function}: root_rank {root} is outside the {group_name(group)} group of {size} ranks")
    return root


def _agreed_kind(function: str, name: Any) -> str:
    """The kind the ranks agree on for an object collective: its name is part of it (checked across ranks)."""
    return function if name is None else f"{function}|{name}"


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None,
                     group: Any = None) -> Any:
    """Returns ``root_rank``'s ``obj`` (pickled) on every rank of the group (default ``"data"``; with
    ``process_set``, ``root_rank`` is a global rank, as in Horovod). ``name`` is checked across ranks."""
    with context.refusing("broadcast_object", "broadcast_object", group, process_set):
        context.check_name(name, "broadcast_object")
        resolved = target(group, process_set, "broadcast_object")
        root = root_index(resolved, root_rank, "broadcast_object")
    return context.call(resolved, "broadcast_object",
                        lambda: context.communicator(resolved, "broadcast_object").bcast(obj, root=root),
                        _agreed_kind("broadcast_object", name))


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None, group: Any = None) -> list:
    """Every rank's ``obj`` (pickled), as a list in rank order of the group (default ``"data"``)."""
    with context.refusing("allgather_object", "allgather_object", group, process_set):
        context.check_name(name, "allgather_object")
        resolved = target(group, process_set, "allgather_object")
    return context.call(resolved, "allgather_object",
                        lambda: context.communicator(resolved, "allgather_object").allgather(obj),
                        _agreed_kind("allgather_object", name))

"""Every exception class hybridpipe defines: one base class, the misuse classes and the runtime classes.

Every message names the offending values in parentheses and says how to fix it, e.g.
``GridError: world size 6 is not divisible by pipeline_stages 4 (pass -np 8 or --stages 2)``.

- Misuse (a bad argument, setting, environment variable, file or call order) raises :class:`UsageError` or one
  of its subclasses (all of them ``ValueError``), or the built-in ``TypeError`` for a value of the wrong type.
- A runtime failure raises a runtime class: :class:`HorovodInternalError` (a collective failed; with
  :class:`MismatchError`, :class:`MPIError`, :class:`RanksJoined`,
  :class:`RanksLostError`), :class:`RemoteError` (another rank failed and
  said so), :class:`PeerShutDownError`, :class:`WaitTimeoutError`, :class:`PipelineBroken`,
  :class:`NonFiniteError`, :class:`CheckpointError`; a missing piece of the installation :class:`BuildError`.
- :class:`InternalError`: one of hybridpipe's own invariants failed (a bug to report).
- :func:`warn_user`: a warning attributed to the user's line that led to it (not to hybridpipe's or torch's code
  in between).

Modules that raised their own classes before (``hybridpipe.comm.p2p.RemoteError``,
``hybridpipe.checkpoint.CheckpointError``, ...) import them from here: the old names are the same objects.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = [
    "UsageError",
    "InternalError",
    "RemoteError",
    "RanksJoined",
    "RanksLostError",
    "PipelineBroken",
    "SplitError",
    "CheckpointError",
    "PipeDreamProfileError",
    "EmulatedHostsError",
    "HostsUpdatedInterrupt",
    "DuplicateNameError",
    "HybridPipeError",
    "HorovodInternalError",
    "NotSupportedError",
    "NotInitializedError",
    "GridError",
    "MismatchError",
    "MPIError",
    "BuildError",
    "PartitionError",
    "ScheduleError",
    "PeerShutDownError",
    "WaitTimeoutError",
    "NonFiniteError",
]


class HybridPipeError(RuntimeError):
    """Base class of every error hybridpipe raises on purpose."""


class HorovodInternalError(HybridPipeError):
    """A collective failed: ranks disagreed, an MPI call failed, or the communication thread stopped.

    Horovod's name for the same event, so that ``except hvd.HorovodInternalError`` in a ported script
    catches hybridpipe's failed collectives (:class:`MismatchError` and :class:`MPIError` derive from it).
    """


class UsageError(HybridPipeError, ValueError):
    """hybridpipe was called in a way it cannot carry out: a bad argument, setting, environment variable or file, or
    calls in the wrong order. The message names the value and the fix."""


class InternalError(HybridPipeError):
    """One of hybridpipe's own invariants failed: a bug in hybridpipe, to be reported with the message."""


class NotSupportedError(HybridPipeError, NotImplementedError):
    """A Horovod feature hybridpipe does not have (yet), e.g. ``op=hp.Adasum``; the message names the
    alternative."""


class NotInitializedError(HybridPipeError):
    """A hybridpipe function that needs the runtime was called before ``hp.init()``."""


class GridError(UsageError):
    """The requested stages × replicas grid does not fit the communicator."""


class MismatchError(HorovodInternalError):
    """Ranks of one collective disagree (count, dtype, op, shape, tensor set).

    Raised on every rank of the collective, with every rank's values, instead of hanging.
    """


class MPIError(HorovodInternalError):
    """An MPI call inside the C++ core failed; the message names the rank, the call and
    MPI's error string."""


class BuildError(HybridPipeError, ImportError):
    """A piece of the installation is missing or unusable: the compiled extension ``hybridpipe._C`` (or it was built
    against another MPI), the MPI launcher, NCCL where ``HYBRIDPIPE_GPU_ALLREDUCE=nccl`` asks for it, or an optional
    package a command needs (matplotlib for ``--plot``). The message says what to install."""


class DuplicateNameError(UsageError):
    """An asynchronous operation was given a name that is already in flight on its group (a
    ``ValueError``, as Horovod raises there)."""


class PartitionError(UsageError):
    """Layers cannot be split into the requested pipeline stages."""


class ScheduleError(UsageError):
    """A pipeline schedule is malformed (missing action, wrong order, would deadlock)."""


class PeerShutDownError(HybridPipeError):
    """A rank this rank waits for (a pipeline neighbour's activation or gradient, or a collective) has called
    ``hp.shutdown()`` or ended with an exception: it will never send what this rank waits for. Usually the
    ranks made different numbers of ``train_step`` (or collective) calls: uneven data per rank.

    Attributes:
        source: the rank that left, in the communicator of the wait.
    """

    source: int | None = None


class WaitTimeoutError(HybridPipeError, TimeoutError):
    """A wait for another rank (a pipeline transfer) lasted longer than ``HYBRIDPIPE_TIMEOUT_SECONDS``."""

    source: int | None = None


class NonFiniteError(HybridPipeError, FloatingPointError):
    """NaN or inf appeared in a training step (with ``HYBRIDPIPE_CHECK_FINITE=1``): the message names the stage,
    micro-batch and the first layer (or the batch's inputs, or the loss) where it appeared."""


class RanksJoined(HorovodInternalError):
    """A collective other than an allreduce ran into ranks that have joined (hp.join): the ranks that did not
    join all raise it at the same point (a synchronous allreduce catches it and runs on the engine instead)."""


class RanksLostError(HorovodInternalError):
    """Processes of the job died (killed, crashed, out of memory) while ``hp.elastic.run`` survives failures (a
    fault-tolerant MPI: Open MPI started with ``--with-ft ulfm``): the communication thread failed every pending
    and later operation and revoked its communicators instead of aborting the job. ``hp.elastic.run`` catches it
    and goes on with the survivors; outside it the job ends as before.

    Attributes:
        ranks: the lost ranks, as ranks of the job's world when it failed (ascending; empty when MPI had not said
            which yet on this rank: another rank noticed first and revoked the communicators).
        hosts: the host of each of ``ranks``.
    """

    def __init__(self, message: str, *, ranks: list[int] | tuple[int, ...] = (), hosts: list[str] | tuple[str, ...] = ()
                 ) -> None:
        super().__init__(message)
        self.ranks, self.hosts = list(ranks), list(hosts)


class RemoteError(HybridPipeError):
    """Another rank failed and told this one: a pipeline neighbour's error forwarded to the ranks that wait for it,
    or (``hybridpipe.comm.agree``) an exception whose own type could not be sent. The message names the failing
    rank and its error.

    Attributes:
        source: the rank the error came from, in the communicator of the wait or the group (None: unknown).
        type_name: the failing exception's type (module and name) where it is known, else None.
        remote_message: that exception's own message, where it is known.
    """

    def __init__(self, message: str, *, source: int | None = None, type_name: str | None = None,
                 remote_message: str | None = None) -> None:
        super().__init__(message)
        self.source, self.type_name, self.remote_message = source, type_name, remote_message

    @property
    def rank(self) -> int | None:
        """The failing rank (the same as :attr:`source`)."""
        return self.source

    @classmethod
    def of_type(cls, type_name: str, message: str, rank: int) -> RemoteError:
        """Stands for ``type_name(message)`` raised on ``rank``, which could not be sent as itself."""
        return cls(f"{type_name} on rank {rank}: {message}", source=rank, type_name=type_name, remote_message=message)


class PipelineBroken(HybridPipeError):
    """The pipeline failed in an earlier step; its message queues are in an unknown state."""


class SplitError(PartitionError):
    """A module cannot be split where asked; the message names the value, the modules and a fix."""


class CheckpointError(HybridPipeError):
    """A checkpoint is missing, incomplete, truncated or not a hybridpipe checkpoint."""


class PipeDreamProfileError(UsageError):
    """A PipeDream profile (JSON) is missing or malformed; the message names the file and the field."""


class EmulatedHostsError(HybridPipeError):
    """Emulated hosts cannot be built here (not root, no ip/unshare/tc) or a command failed."""


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 - Horovod's name
    """Horovod raises it when hosts were added or removed; ``hp.elastic.run`` then syncs and calls the function
    again. hybridpipe's jobs have a fixed size, so only your code raises it (``skip_sync``: as in Horovod)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(warnings.__file__)) + os.sep


def _library_frame(filename: str) -> bool:
    """Whether a frame of ``filename`` is hybridpipe's, torch's or the standard library's (contextlib, functools;
    not what is installed beside it in site-packages)."""
    if filename.startswith(_PACKAGE_DIR) or filename.startswith("<frozen "):
        return True
    if filename.startswith(_STDLIB_DIR) and "-packages" + os.sep not in filename:
        return True
    torch = sys.modules.get("torch")
    return torch is not None and filename.startswith(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside hybridpipe, torch and the
    standard library: a warning raised in a hook, a gradient sync or the planner names the user's line (the
    ``train_step`` or ``hp.auto`` call) rather than the library line it passed through."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _library_frame(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 2)

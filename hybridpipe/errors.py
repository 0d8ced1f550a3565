"""The exceptions hybridpipe raises: one base class and a few specific subclasses.

Every message names the offending values in parentheses and says how to fix it, e.g.
``GridError: world size 6 is not divisible by pipeline_stages 4 (pass -np 8 or --stages 2)``.
"""

from __future__ import annotations

__all__ = [
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


class NotSupportedError(HybridPipeError, NotImplementedError):
    """A Horovod feature hybridpipe does not have (yet), e.g. ``op=hp.Adasum``; the message names the
    alternative."""


class NotInitializedError(HybridPipeError):
    """A hybridpipe function that needs the runtime was called before ``hp.init()``."""


class GridError(HybridPipeError, ValueError):
    """The requested stages × replicas grid does not fit the communicator."""


class MismatchError(HorovodInternalError):
    """Ranks of one collective disagree (count, dtype, op, shape, tensor set).

    Raised on every rank of the collective, with every rank's values, instead of hanging.
    """


class MPIError(HorovodInternalError):
    """An MPI call inside the C++ core failed; the message names the rank, the call and
    MPI's error string."""


class BuildError(HybridPipeError, ImportError):
    """The compiled extension ``hybridpipe._C`` is missing or was built against another MPI."""


class DuplicateNameError(HybridPipeError, ValueError):
    """An asynchronous operation was given a name that is already in flight on its group (a
    ``ValueError``, as Horovod raises there)."""


class PartitionError(HybridPipeError, ValueError):
    """Layers cannot be split into the requested pipeline stages."""


class ScheduleError(HybridPipeError, ValueError):
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

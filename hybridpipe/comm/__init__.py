"""Communication: collectives, the background engine, stage-to-stage transfers.

The runtime starts and stops it (``hp.init`` / ``hp.shutdown``) through :func:`start` and
:func:`stop`; everything else reaches the running :class:`~hybridpipe.comm.context.CommContext`
through :func:`~hybridpipe.comm.context.current`.
"""

from typing import Any

from . import device, process_sets
from .context import CommContext, communicator, current, stop
from .context import start as _start_context
from .reduction import engine_device_allreduce

__all__ = ["CommContext", "communicator", "current", "start", "stop", "process_sets", "device"]


def start(config: Any, grid: Any, base_comm: Any = None, local_comm: Any = None) -> CommContext:
    """Called by hp.init: makes the communication context (the running job), whose engine reduces buckets of CUDA
    tensors in device memory with reduction.engine_device_allreduce where it can."""
    return _start_context(config, grid, engine_device_allreduce, base_comm, local_comm)

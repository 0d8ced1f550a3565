"""Communication: collectives, the background engine, stage-to-stage transfers.

The runtime starts and stops it (``hp.init`` / ``hp.shutdown``) through :func:`start` and
:func:`stop`; everything else reaches the running :class:`~hybridpipe.comm.context.CommContext`
through :func:`~hybridpipe.comm.context.current`.
"""

from . import device, process_sets
from .context import CommContext, communicator, current, start, stop

__all__ = ["CommContext", "communicator", "current", "start", "stop", "process_sets", "device"]

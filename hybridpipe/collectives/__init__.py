"""The collectives, one module per family, each holding its blocking, in-place, ``*_async`` and differentiable
forms side by side (Horovod's ``mpi_ops.py`` in families): :mod:`.allreduce`, :mod:`.broadcast`, :mod:`.allgather`,
:mod:`.alltoall`, :mod:`.reducescatter`, :mod:`.sparse` (sparse allreduce), :mod:`.barrier`, over :mod:`.common`
(ops, argument checks, compression's protocol). The package exports them as ``hp.allreduce`` & co.; they run on
the communication layer's engine thread (:mod:`hybridpipe.comm`).
"""

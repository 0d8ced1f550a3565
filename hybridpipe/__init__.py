"""hybridpipe: Horovod-style data parallelism and GPipe/1F1B pipeline parallelism for PyTorch over MPI.

Example:
    >>> import hybridpipe as hp
    >>> grid = hp.init(pipeline_stages=2)          # mpirun -np 4 → 2 stages × 2 replicas
    >>> total = hp.allreduce(torch.ones(3), op=hp.Sum, group="data")
"""

# Only the light modules load with the package (errors, config, runtime: the standard library and numpy), so
# that the launcher (`hybridpipe-run`, `python -m hybridpipe.launch`), `python -m hybridpipe`, the emulated
# hosts and the planner's profile-only commands start without importing torch. Every other public name is
# imported on first use (PEP 562), from the module the table below names.
import importlib

from . import errors as _errors
from .config import Config
from .errors import (
    BuildError,
    CheckpointError,
    DuplicateNameError,
    EmulatedHostsError,
    GridError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    HybridPipeError,
    InternalError,
    MismatchError,
    MPIError,
    NonFiniteError,
    NotInitializedError,
    NotSupportedError,
    PartitionError,
    PeerShutDownError,
    PipeDreamProfileError,
    PipelineBroken,
    RanksJoined,
    RanksLostError,
    RemoteError,
    ScheduleError,
    SplitError,
    UsageError,
    WaitTimeoutError,
)
from .runtime import Grid, config, grid, init, is_initialized, local_rank, local_size, rank, shutdown, size

#: The public names imported on first use, by the module that defines them.
_LAZY_MODULES = {
    ".capabilities": ("ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
        "gloo_enabled", "is_homogeneous", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
        "rocm_built",),
    ".checkpoint": ("consolidate", "load_checkpoint", "resume", "save_checkpoint",),
    ".collectives.allgather": ("allgather", "allgather_async", "allgather_object", "grouped_allgather",
        "grouped_allgather_async",),
    ".collectives.allreduce": ("allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
        "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",),
    ".collectives.alltoall": ("alltoall", "alltoall_async",),
    ".collectives.barrier": ("barrier",),
    ".collectives.broadcast": ("broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",),
    ".collectives.common": ("Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum",),
    ".collectives.reducescatter": ("grouped_reducescatter", "grouped_reducescatter_async", "reducescatter",
        "reducescatter_async",),
    ".collectives.sparse": ("sparse_allreduce_async",),
    ".pretrained": ("load_pretrained", "save_pretrained",),
    ".comm.engine": ("Handle", "engine_stats", "join", "poll", "start_timeline", "stop_timeline", "synchronize",),
    ".comm.process_sets": ("ProcessSet", "add_process_set", "data_process_set", "global_process_set",
        "pipe_process_set", "remove_process_set",),
    ".data_parallel.amp": ("LossScaler",),
    ".data_parallel.compression": ("Compression",),
    ".data_parallel.optimizer": ("DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters",
        "clip_grad_norm_",),
    ".data_parallel.sync_batch_norm": ("SyncBatchNorm",),
    ".pipeline.model": ("LayerSpec", "PipelineModel", "TiedLayerSpec",),
    ".pipeline.skip": ("pop", "skippable", "stash",),
    ".plan.auto": ("auto",),
}
_LAZY = {name: module for module, names in _LAZY_MODULES.items() for name in names}

#: cupy arrays are taken wherever torch tensors are (viewed through DLPack; hybridpipe/comm/device.py).
_TAKES_CUPY = frozenset((
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "broadcast", "broadcast_",
    "allgather", "grouped_allgather", "alltoall", "reducescatter", "grouped_reducescatter",
    "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "broadcast_async", "broadcast_async_", "allgather_async", "grouped_allgather_async", "alltoall_async",
    "reducescatter_async", "grouped_reducescatter_async"))


def __getattr__(name: str):
    if name == "elastic":  # hvd.elastic.run / hvd.elastic.TorchState
        value = importlib.import_module(".data_parallel.elastic", __name__)
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        if name in _TAKES_CUPY:
            value = importlib.import_module(".comm.device", __name__).accepts_cupy(value)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    # runtime
    "init", "shutdown", "is_initialized", "grid", "Grid", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous",
    "config", "Config",
    # collectives
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "broadcast", "broadcast_",
    "allgather", "grouped_allgather", "alltoall", "reducescatter", "grouped_reducescatter", "barrier",
    "ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum",
    "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "broadcast_async", "broadcast_async_", "allgather_async", "grouped_allgather_async", "alltoall_async",
    "reducescatter_async", "grouped_reducescatter_async", "synchronize", "poll", "Handle", "engine_stats", "join",
    "sparse_allreduce_async",
    # process sets
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "data_process_set",
    "pipe_process_set",
    # build queries and the timeline (Horovod's names)
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ccl_built",
    "ddl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    # pipeline
    "PipelineModel", "LayerSpec", "TiedLayerSpec", "auto", "skippable", "stash", "pop",
    # data parallelism (Horovod-compatible names)
    "DistributedOptimizer", "Compression", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object", "allgather_object", "clip_grad_norm_", "SyncBatchNorm", "elastic", "LossScaler",
    # checkpoints
    "save_checkpoint", "load_checkpoint", "resume", "consolidate", "save_pretrained", "load_pretrained",
    # errors (every class of hybridpipe.errors)
    *_errors.__all__,
]

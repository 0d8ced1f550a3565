"""hybridpipe: Horovod-style data parallelism and GPipe/1F1B pipeline parallelism for PyTorch over MPI.

Example:
    >>> import hybridpipe as hp
    >>> grid = hp.init(pipeline_stages=2)          # mpirun -np 4 → 2 stages × 2 replicas
    >>> total = hp.allreduce(torch.ones(3), op=hp.Sum, group="data")
"""

from ._trace import start_timeline, stop_timeline
from .capabilities import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from .checkpoint import CheckpointError, consolidate, load_checkpoint, resume, save_checkpoint
from .comm.collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allreduce_,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce_,
)
from .comm.engine import (
    Handle,
    allreduce_async,
    allreduce_async_,
    engine_stats,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    synchronize,
)
from .comm.exchange import (
    allgather_async,
    alltoall_async,
    grouped_allgather_async,
    grouped_reducescatter_async,
    reducescatter_async,
    sparse_allreduce_async,
)
from .comm.process_sets import (
    ProcessSet,
    add_process_set,
    data_process_set,
    global_process_set,
    pipe_process_set,
    remove_process_set,
)
from .config import Config
from .differentiable import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from .errors import (
    BuildError,
    DuplicateNameError,
    GridError,
    HorovodInternalError,
    HybridPipeError,
    MismatchError,
    MPIError,
    NonFiniteError,
    NotInitializedError,
    NotSupportedError,
    PeerShutDownError,
    WaitTimeoutError,
)
from .amp import LossScaler
from .optimizer import (
    Compression,
    DistributedOptimizer,
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    clip_grad_norm_,
)
from .pipeline.model import LayerSpec, PipelineModel, TiedLayerSpec
from .pipeline.skip import pop, skippable, stash
from .plan.auto import auto
from .sync_batch_norm import SyncBatchNorm
from . import elastic  # noqa: E402 — hvd.elastic.run / TorchState need the names above
from .runtime import Grid, config, grid, init, is_initialized, local_rank, local_size, rank, shutdown, size
from .comm.device import accepts_cupy as _accepts_cupy

# cupy arrays are taken wherever torch tensors are (viewed through DLPack; hybridpipe/comm/device.py)
for _name in ("allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "broadcast", "broadcast_",
              "allgather", "grouped_allgather", "alltoall", "reducescatter", "grouped_reducescatter",
              "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
              "broadcast_async", "broadcast_async_", "allgather_async", "grouped_allgather_async", "alltoall_async",
              "reducescatter_async", "grouped_reducescatter_async"):
    globals()[_name] = _accepts_cupy(globals()[_name])
del _name

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
    "save_checkpoint", "load_checkpoint", "resume", "consolidate", "CheckpointError",
    # errors
    "HybridPipeError", "HorovodInternalError", "NotSupportedError", "NotInitializedError", "GridError",
    "DuplicateNameError",
    "MismatchError", "MPIError", "BuildError", "PeerShutDownError", "WaitTimeoutError", "NonFiniteError",
]

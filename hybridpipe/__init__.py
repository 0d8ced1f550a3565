"""hybridpipe: Horovod-style data parallelism and GPipe/1F1B pipeline parallelism for PyTorch over MPI.

Example:
    >>> import hybridpipe as hp
    >>> grid = hp.init(pipeline_stages=2)          # mpirun -np 4 → 2 stages × 2 replicas
    >>> total = hp.allreduce(torch.ones(3), op=hp.Sum, group="data")
"""

from .comm.collectives import (
    Average,
    Max,
    Min,
    ReduceOp,
    Sum,
    allgather,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    grouped_allreduce,
    grouped_allreduce_,
)
from .checkpoint import CheckpointError, consolidate, load_checkpoint, resume, save_checkpoint
from .comm.engine import Handle, allreduce_async, allreduce_async_, engine_stats, poll, synchronize
from .config import Config
from .errors import (
    BuildError,
    GridError,
    HybridPipeError,
    MismatchError,
    MPIError,
    NotInitializedError,
)
from .optimizer import (
    Compression,
    DistributedOptimizer,
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    clip_grad_norm_,
)
from .pipeline.model import LayerSpec, PipelineModel
from .runtime import Grid, config, grid, init, is_initialized, local_rank, local_size, rank, shutdown, size

__version__ = "0.1.0"

__all__ = [
    # runtime
    "init", "shutdown", "is_initialized", "grid", "Grid", "rank", "size", "local_rank", "local_size",
    "config", "Config",
    # collectives
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "broadcast", "broadcast_",
    "allgather", "barrier", "ReduceOp", "Sum", "Average", "Min", "Max",
    "allreduce_async", "allreduce_async_", "synchronize", "poll", "Handle", "engine_stats",
    # pipeline
    "PipelineModel", "LayerSpec",
    # data parallelism (Horovod-compatible names)
    "DistributedOptimizer", "Compression", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object", "allgather_object", "clip_grad_norm_",
    # checkpoints
    "save_checkpoint", "load_checkpoint", "resume", "consolidate", "CheckpointError",
    # errors
    "HybridPipeError", "NotInitializedError", "GridError", "MismatchError", "MPIError", "BuildError",
]

"""Where a buffer lives and how it travels: the one place that picks, per buffer, the route a collective, the
engine's allreduce or a pipeline transfer takes, and which GPU a rank computes on.

Routes, each with the rule that says when it applies (:data:`ROUTES`; the first that applies is taken):

* ``"host"``: host memory (a CPU tensor, a numpy array). The C++ core reads and writes it where it is.
* ``"cuda-aware"``: a CUDA tensor, when the MPI library moves device memory itself: it says so
  (``MPIX_Query_cuda_support``, Open MPI built ``--with-cuda``) and HYBRIDPIPE_CUDA_AWARE_MPI is ``auto``
  (the default), or that setting is ``1``. Device pointers go straight to MPI, after the tensor's producer
  has finished: the pipeline's point-to-point transfers, broadcast, and the blocking allreduce and grouped
  allreduce (:data:`CUDA_ALLREDUCE`: MPI_Allreduce of device memory below ``CUDA_RING_MIN_BYTES``, above it a
  ring of device-memory transfers reduced on the GPU by the extension's kernels, half types added in
  float32). An integer Average and the engine's fused allreduce (its fusion buffer is host memory) are staged.
* ``"staged"``: any other CUDA tensor. It is copied to pinned host memory, reduced or sent there, and the
  result is copied back, a segment at a time with the copies overlapping the transfer
  (hybridpipe.comm.staging), after the work queued on the caller's stream when the call was made. The first
  staged buffer of a process warns once, naming the MPI library, whether it reports CUDA support and how to
  get the CUDA-aware route.

NCCL (``HYBRIDPIPE_GPU_ALLREDUCE=auto``, the default, or ``nccl``): where cupy brings NCCL on every rank of a
group and each of its ranks has a GPU of its own, the group's blocking and grouped allreduces of CUDA buffers
run ``ncclAllReduce`` on a communicator made once from the group's ranks (rank 0's unique id broadcast over
MPI), whatever the route; ``mpi`` never uses it, ``nccl`` makes its absence an error. Every rank must use the
same setting. The first such allreduce on a group decides, for all its ranks alike (:func:`nccl_decision`).

cupy arrays are accepted wherever torch tensors are (:func:`accepts_cupy`): they are viewed as torch tensors
through DLPack (no copy), so an in-place collective writes into the cupy array's memory, and an out-of-place
one returns a cupy array.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

from .. import running

__all__ = ["ROUTES", "route", "cuda_aware", "CUDA_ALLREDUCE", "cuda_allreduce_algorithm", "nccl_module",
           "nccl_decision", "gpu_place", "nccl_communicator", "forget_nccl", "note_staged", "mpi_cuda_support", "describe", "accepts_cupy", "is_cupy",
           "compute_device", "set_device"]


def _device_type(x: Any) -> str:
    """``x``'s torch device type; ``"cpu"`` for anything that is not a torch tensor (numpy arrays)."""
    torch = sys.modules.get("torch")  # torch is imported by whoever made a tensor
    return x.device.type if torch is not None and isinstance(x, torch.Tensor) else "cpu"


def _is_cuda(x: Any) -> bool:
    return _device_type(x) == "cuda"


def cuda_aware() -> bool:
    """Whether CUDA buffers go to the MPI library as device memory (the ``"cuda-aware"`` route): the setting
    HYBRIDPIPE_CUDA_AWARE_MPI (``Config.cuda_aware_mpi``) when it is ``1`` or ``0``, else (``auto``) whether
    the library reports CUDA support."""
    from ..config import Config

    state = running.current_or_none()
    setting = (state.config if state is not None else Config.from_env()).cuda_aware_mpi
    if setting != "auto":
        return setting == "1"
    return mpi_cuda_support() == 1


#: (name, applies) in order of preference: the first route whose rule holds for a buffer is its route.
ROUTES: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("host", lambda x: _device_type(x) == "cpu"),
    ("cuda-aware", lambda x: _is_cuda(x) and cuda_aware()),
    ("staged", _is_cuda),
)


#: Below this many bytes a CUDA buffer on the cuda-aware route is reduced by MPI_Allreduce on its device memory,
#: from here on by the device ring: the library wins on small buffers, the ring once its fixed cost is paid back
#: (the crossing, measured on an H100: docs/gpu.md and bench/results/gpu-allreduce-*.json).
CUDA_RING_MIN_BYTES = 1 << 20

#: dtype codes (buffers.dtype_code) MPI reduces as device memory, with their MPI datatypes' names
MPI_DEVICE_TYPES = {0: "FLOAT", 1: "DOUBLE", 4: "INT32_T", 5: "INT64_T"}


def _reducible_on_device(code: int, op: int) -> bool:
    return not (op == 1 and code in (4, 5))  # an integer Average: the host core's rounding, so staged


#: dtype codes NCCL reduces, with the names of cupy.cuda.nccl's constants
NCCL_TYPES = {0: "NCCL_FLOAT32", 1: "NCCL_FLOAT64", 2: "NCCL_FLOAT16", 3: "NCCL_BFLOAT16", 4: "NCCL_INT32",
              5: "NCCL_INT64"}

#: The allreduce algorithms of a CUDA buffer, in order of preference: (name, applies(route, nbytes, dtype code,
#: op, nccl)), ``nccl`` being whether the group agreed to use NCCL (:func:`nccl_decision`); the first that
#: applies is taken (:func:`cuda_allreduce_algorithm`).
CUDA_ALLREDUCE: tuple[tuple[str, Callable[[str, int, int, int, bool], bool]], ...] = (
    ("nccl", lambda route, nbytes, code, op, nccl: nccl and code in NCCL_TYPES and _reducible_on_device(code, op)),
    ("mpi-library", lambda route, nbytes, code, op, nccl: route == "cuda-aware" and nbytes < CUDA_RING_MIN_BYTES
     and code in MPI_DEVICE_TYPES and _reducible_on_device(code, op)),
    ("device-ring", lambda route, nbytes, code, op, nccl: route == "cuda-aware" and _reducible_on_device(code, op)),
    ("staged", lambda route, nbytes, code, op, nccl: True),
)


def cuda_allreduce_algorithm(route_name: str, nbytes: int, code: int, op: int, nccl: bool = False) -> str:
    """How a CUDA buffer of ``nbytes`` bytes on route ``route_name`` is allreduced: ``"nccl"`` (NCCL through
    cupy, where the group agreed to), ``"mpi-library"`` (MPI_Allreduce of device memory), ``"device-ring"``
    (device-memory ring, reduced by the GPU kernels) or ``"staged"`` (through pinned host memory); see
    :data:`CUDA_ALLREDUCE`."""
    for name, applies in CUDA_ALLREDUCE:
        if applies(route_name, nbytes, code, op, nccl):
            return name
    raise AssertionError("the staged algorithm applies to every CUDA buffer")


@functools.lru_cache(maxsize=None)
def nccl_module() -> Any:
    """cupy's NCCL binding (``cupy.cuda.nccl``), or None where cupy or its NCCL is not installed."""
    try:
        from cupy.cuda import nccl

        nccl.get_version()
        return nccl
    except Exception:  # noqa: BLE001 — no cupy, no NCCL library, no driver: NCCL is not available here
        return None


def nccl_decision(setting: str, ranks: list[tuple[bool, str, str]]) -> tuple[bool, str]:
    """Whether a group uses NCCL for its CUDA allreduces, from every rank's ``(NCCL available, host, GPU)``
    (gathered, so every rank decides the same): ``(use, why not)``. NCCL needs it on every rank and a GPU of
    its own per rank (it refuses two ranks of one communicator on one GPU).

    Raises:
        UsageError: ``setting`` is ``"nccl"`` and NCCL cannot run, naming the reason.
    """
    from ..errors import BuildError

    if setting == "mpi":
        return False, "HYBRIDPIPE_GPU_ALLREDUCE=mpi"
    missing = [rank for rank, (available, _, _) in enumerate(ranks) if not available]
    places = [(host, gpu) for _, host, gpu in ranks]
    shared = sorted({place for place in places if places.count(place) > 1})
    reason = ""
    if missing:
        reason = (f"cupy with NCCL is not importable on rank(s) {missing} (pip install cupy-cuda12x or "
                  "cupy-cuda13x, and nvidia-nccl-cu12 / -cu13)")
    elif shared:
        host, gpu = shared[0]
        sharing = [rank for rank, place in enumerate(places) if place == shared[0]]
        reason = (f"ranks {sharing} share GPU {gpu} on {host}, and NCCL allows one rank per GPU in a communicator "
                  "(one rank per GPU: as many ranks per host as GPUs)")
    if reason and setting == "nccl":
        raise BuildError(f"HYBRIDPIPE_GPU_ALLREDUCE=nccl, but NCCL cannot run: {reason}; or set it to auto")
    return not reason, reason


def gpu_place(device_index: int) -> tuple[bool, str, str]:
    """This rank's ``(NCCL available, host, GPU uuid)`` for GPU ``device_index``: what :func:`nccl_decision` takes
    from every rank of a group (two ranks share a GPU when host and uuid are the same)."""
    import socket

    import torch

    uuid = str(getattr(torch.cuda.get_device_properties(device_index), "uuid", device_index))
    return nccl_module() is not None, socket.gethostname(), uuid


def nccl_communicator(comm: Any, device_index: int, setting: str, made_here: dict | None = None) -> Any:
    """The NCCL communicator of ``comm``'s ranks on this rank's GPU ``device_index`` (made once: rank 0's
    unique id broadcast over MPI), or None where the group does not use NCCL (:func:`nccl_decision`).
    Collective over ``comm`` the first time: every rank of it calls it for the same allreduce. Kept in
    ``made_here``: the job's ``nccl_groups`` (default: the running job's) until hp.shutdown."""
    if made_here is None:
        made_here = running.current("allreduce").nccl_groups
    key = (comm.py2f(), device_index)
    if key in made_here:
        return made_here[key]
    nccl = nccl_module()
    use, _ = nccl_decision(setting, comm.allgather(gpu_place(device_index)))
    made = None
    if use:
        import cupy

        unique = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None, root=0)
        with cupy.cuda.Device(device_index):
            made = nccl.NcclCommunicator(comm.Get_size(), unique, comm.Get_rank())
    made_here[key] = made
    return made


def forget_nccl(made_here: dict[tuple[int, int], Any]) -> None:
    """Destroys the NCCL communicators of a job's ``nccl_groups`` (hp.shutdown: their MPI communicators are
    freed)."""
    for made in made_here.values():
        if made is not None and hasattr(made, "destroy"):
            made.destroy()
    made_here.clear()


def route(x: Any) -> str:
    """The route of one buffer: ``"host"``, ``"cuda-aware"`` or ``"staged"`` (see the module's text).

    Raises:
        TypeError: a tensor on a device hybridpipe cannot reach (e.g. ``meta``, ``mps``), naming the device.
    """
    for name, applies in ROUTES:
        if applies(x):
            return name
    raise TypeError(f"hybridpipe cannot communicate a tensor on device {x.device} (use a CPU or CUDA tensor: "
                    f"tensor.cpu() or tensor.cuda())")


def note_staged(x: Any) -> None:
    """Called for every staged buffer: warns once per job that CUDA tensors go through host memory (not
    where the MPI library moves device memory: what is staged then is staged by choice, see the module)."""
    job = running.current_or_none()
    if (job is not None and job.warned_staging) or not _is_cuda(x) or cuda_aware():
        return
    if job is not None:
        job.warned_staging = True
    warnings.warn(f"hybridpipe stages CUDA tensors through host memory ({describe()}): collectives and "
                  "pipeline transfers of GPU tensors are copied to the host and back (an MPI built with CUDA, "
                  "e.g. Open MPI configured --with-cuda, moves device memory itself; silence with "
                  "warnings.filterwarnings('ignore', message='hybridpipe stages'))", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def mpi_cuda_support() -> int:
    """1 when the loaded MPI library reports that it moves CUDA memory itself, 0 when it reports it does not,
    -1 when it has no way to say (only Open MPI answers ``MPIX_Query_cuda_support``)."""
    from .. import _ext

    return int(_ext.core().mpi_cuda_support())


def describe() -> str:
    """One line: the MPI library, what it says of CUDA, and the route CUDA buffers take."""
    from .. import _ext

    library = _ext.core().mpi_library_version().splitlines()[0].strip()
    support = {1: "reports CUDA support", 0: "reports no CUDA support", -1: "cannot report CUDA support"}
    taken = ("the cuda-aware route (the engine's fused allreduce: staged)"
             if cuda_aware() else "the staged route")
    return f"MPI: {library}, which {support[mpi_cuda_support()]}; CUDA buffers take {taken}"


def is_cupy(x: Any) -> bool:
    """Whether ``x`` is a cupy array (checked without importing cupy)."""
    return type(x).__module__.startswith("cupy") and hasattr(x, "__dlpack__")


def _to_torch(x: Any) -> Any:
    import torch

    return torch.from_dlpack(x)


def _convert(value: Any) -> tuple[Any, bool]:
    if is_cupy(value):
        return _to_torch(value), True
    if isinstance(value, (list, tuple)) and any(is_cupy(item) for item in value):
        return type(value)(_to_torch(item) if is_cupy(item) else item for item in value), True
    return value, False


def _back(result: Any, converted: list, originals: list) -> Any:
    """The result with the caller's converted inputs replaced by their cupy originals (in-place forms) and
    other CUDA torch tensors viewed as cupy arrays (out-of-place forms); lists and tuples walked."""
    torch = sys.modules["torch"]
    if isinstance(result, torch.Tensor):
        for tensor, original in zip(converted, originals):
            if result is tensor:
                return original
        if result.device.type != "cuda":
            return result
        import cupy

        return cupy.from_dlpack(result)
    if isinstance(result, (list, tuple)):
        return type(result)(_back(item, converted, originals) for item in result)
    return result


def accepts_cupy(function: Callable) -> Callable:
    """Decorator: a cupy array (or a list of them) as the first argument is viewed as a torch tensor on the
    same memory; the result comes back in cupy arrays (the caller's own arrays for in-place forms)."""

    @functools.wraps(function)
    def wrapper(first: Any, *args: Any, **kwargs: Any) -> Any:
        converted, was_cupy = _convert(first)
        if not was_cupy:
            return function(first, *args, **kwargs)
        result = function(converted, *args, **kwargs)
        many = isinstance(first, (list, tuple))
        return _back(result, list(converted) if many else [converted], list(first) if many else [first])

    return wrapper


def compute_device(local_rank: int, enabled: bool) -> Any:
    """The torch device this rank computes on: ``cuda:(local_rank mod visible GPUs)`` when CUDA is available
    and placement is ``enabled`` (HYBRIDPIPE_SET_DEVICE), else the CPU."""
    import torch

    if enabled and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def set_device(local_rank: int, enabled: bool) -> Any:
    """Makes :func:`compute_device` torch's current CUDA device (hp.init does it) and returns it."""
    device = compute_device(local_rank, enabled)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    return device

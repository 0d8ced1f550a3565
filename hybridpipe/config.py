"""Every HYBRIDPIPE_* setting, read in one place into one dataclass.

Settings come from the environment so that `hybridpipe-run`, `mpirun -x` and Slurm job scripts
can set them for every rank without touching the training script; `hp.init(config=...)` can
override them in code.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping

from .errors import UsageError

__all__ = ["Config", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1024**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(text: str, name: str = "value") -> int:
    """Parses a byte count such as ``4194304``, ``4MiB``, ``256KiB`` or ``64mb``.

    Raises:
        UsageError: the text is not a non-negative byte count; the message names it.
    """
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(f"{name}={text!r} is not a byte count (use e.g. 4194304, 4MiB or 256KiB)")
    return int(match.group(1)) * _UNITS[unit]


def _positive_float(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise UsageError(f"{name}={text!r} is not a positive number of seconds/milliseconds (e.g. 5)")
    return value


def _wait_spin(text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not a number of microseconds (e.g. 200; -1 for MPI's own "
                         "spinning wait)") from None


def _nice(text: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise UsageError(f"{name}={text!r} is not a nice increment 0..19 (0: same priority as compute)")
    return value


def _switch(text: str, name: str) -> bool:
    value = text.strip().lower()
    if value not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise UsageError(f"{name}={text!r} is not a switch (use 1 or 0)")
    return value in ("1", "true", "yes", "on")


def _auto_switch(text: str, name: str) -> str:
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    if value not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise UsageError(f"{name}={text!r} is not auto, 1 or 0")
    return "1" if value in ("1", "true", "yes", "on") else "0"


def _gpu_allreduce(text: str, name: str) -> str:
    value = text.strip().lower()
    if value not in ("nccl", "mpi", "auto"):
        raise UsageError(f"{name}={text!r} is not nccl, mpi or auto")
    return value


def _join_average(text: str, name: str) -> str:
    value = text.strip().lower()
    if value not in ("size", "contributors"):
        raise UsageError(f"{name}={text!r} is not size or contributors")
    return value


def _non_negative_float(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise UsageError(f"{name}={text!r} is not a number of seconds >= 0 (0 turns it off)")
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """Tunables of the communication core. Defaults come from bench/allreduce.py on a 2-core host.

    Attributes:
        fusion_threshold_bytes: grouped allreduces pack tensors into buckets of at most this size
            (HYBRIDPIPE_FUSION_THRESHOLD, e.g. ``4MiB``).
        unfused_bytes: in grouped allreduces and the engine, a tensor of at least this size is
            reduced in place on its own rather than copied into and out of a fusion bucket; 0 packs
            everything below the fusion threshold (HYBRIDPIPE_UNFUSED_BYTES).
        segment_bytes: ring segment; a received segment is reduced while the next is in flight
            (HYBRIDPIPE_SEGMENT_BYTES).
        receive_window: ring receives posted ahead per step (HYBRIDPIPE_RECEIVE_WINDOW).
        small_message_bytes: at or below this size the MPI library's own MPI_Allreduce is used
            instead of the ring (HYBRIDPIPE_SMALL_MESSAGE_BYTES).
        shared_memory: when every rank of a communicator is on one host, allreduces above the
            small-message cutoff go through one shared-memory segment (each rank copies its data
            in, sums its piece of everyone's data, copies the result out) instead of the ring; 0
            uses the ring everywhere (HYBRIDPIPE_SHARED_MEMORY, 1 or 0).
        shared_memory_chunk_bytes: the unit in which buffers stream through that segment; the
            segment holds 4 x (ranks + 1) chunks (HYBRIDPIPE_SHARED_MEMORY_CHUNK, e.g. ``128KiB``).
        hierarchical: "auto", "1" or "0": groups spanning hosts reduce buffers above the small-message
            cutoff inside each host (shared memory), then between hosts with every rank of a host
            carrying its share on its own ring, then gathered inside each host. auto: when some
            host has more than one of the group's ranks; 1: whenever the group spans hosts; 0: the
            flat ring (HYBRIDPIPE_HIERARCHICAL).
        hierarchical_chunk_bytes: the hierarchical allreduce streams a buffer through those steps in
            chunks that put about this many bytes on the link between hosts (a float32 buffer compressed to
            16 bits: twice the elements), so that the steps inside a host overlap the transfer between
            hosts; a buffer under 4 chunks, or any with 0, goes as one chunk (HYBRIDPIPE_HIERARCHICAL_CHUNK,
            e.g. ``2MiB``).
        cycle_time_ms: how often the background engine fuses and runs ready tensors
            (HYBRIDPIPE_CYCLE_TIME_MS).
        stall_check_seconds: warn when a collective waits this long for some rank
            (HYBRIDPIPE_STALL_CHECK_SECONDS).
        check_batches: the stages of a pipeline check, at each train_step / predict, that they were given
            the same batch (shapes and a fingerprint, carried by the first activation message; see
            hybridpipe/pipeline/batch_check.py) (HYBRIDPIPE_CHECK_BATCHES, default 1).
        check_finite: each stage checks its inputs, every layer's output and the loss for NaN / inf and raises
            NonFiniteError naming where they first appear (hybridpipe/pipeline/finite.py; a debugging aid that
            costs a check per layer call) (HYBRIDPIPE_CHECK_FINITE, default 0).
        profile_executor: every PipelineModel adds up where each action's time goes (waiting, sending,
            computing, the executor's own Python; ``model.executor_profile``, hybridpipe/pipeline/executor_profile.py)
            (HYBRIDPIPE_PROFILE_EXECUTOR, default 0).
        stall_shutdown_seconds: 0 (off), or stop the engine of a group, failing its pending
            handles on every rank, when a tensor has waited this long for some rank
            (HYBRIDPIPE_STALL_SHUTDOWN_SECONDS).
        timeout_seconds: 0 (never), or abort the job when the communication thread has waited this
            long for other ranks (a negotiation or an allreduce that does not complete: a rank died,
            stopped or was cut off); the message names the ranks that did not answer a probe and
            their hosts (HYBRIDPIPE_TIMEOUT_SECONDS, default 300).
        wait_spin_us: how pipeline receives/sends and the background engine's ring wait for MPI:
            test for this many microseconds, then sleep between tests so that the waiting thread
            leaves the core to compute threads (HYBRIDPIPE_WAIT_SPIN_US). A negative value uses
            MPI's own wait, which spins on the core until the message is in.
        wait_sleep_us: the longest sleep between two tests of a polite wait; sleeps start at
            2 us and double (HYBRIDPIPE_WAIT_SLEEP_US).
        engine_nice: the background engine's threads run this many nice levels below the
            process (0..19; Linux), so compute threads preempt the ring on a host without a spare
            core and the reduction fills the gaps instead of slowing the backward pass
            (HYBRIDPIPE_ENGINE_NICE).
        waiters_help: a thread blocked in ``handle.wait()`` / ``step()`` runs the background
            engine's bucket allreduces of that handle's group itself, at its own priority and
            without sleeping between tests, instead of leaving them to the niced engine thread;
            the waiting thread has nothing else to do (HYBRIDPIPE_WAITERS_HELP, 1 or 0).
        timeline: path of a Chrome-trace timeline to write, or "" (HYBRIDPIPE_TIMELINE).
        autotune: during the first steps of training, try fusion thresholds and cycle times and keep
            the fastest, the same choice on every rank (HYBRIDPIPE_AUTOTUNE, 1 or 0;
            hybridpipe/comm/autotune.py).
        autotune_log: a CSV file rank 0 writes every autotuning trial to, or "" (HYBRIDPIPE_AUTOTUNE_LOG).
        autotune_warmup_samples: steps measured nowhere after the start and after each change of setting
            (HYBRIDPIPE_AUTOTUNE_WARMUP_SAMPLES).
        autotune_steps_per_sample: steps timed per trial; a trial's time is the median
            (HYBRIDPIPE_AUTOTUNE_STEPS_PER_SAMPLE).
        set_device: where CUDA is available, ``hp.init`` makes GPU ``local_rank mod visible GPUs`` torch's
            current device and ``PipelineModel`` builds its stage there (HYBRIDPIPE_SET_DEVICE, 1 or 0).
        staging_segment_bytes: a CUDA buffer taking the staged route is copied to pinned host memory and back
            in segments of this size, two in flight, so that the copies overlap the transfer
            (HYBRIDPIPE_STAGING_SEGMENT_BYTES, e.g. ``4MiB``).
        device_ring_segment_bytes: the device ring (CUDA buffers over a CUDA-aware MPI) sends each chunk in
            segments of this size, each reduced while the next arrives (HYBRIDPIPE_DEVICE_RING_SEGMENT_BYTES,
            e.g. ``64MiB``). Each segment is one more MPI message, about 25 µs of CUDA IPC on an H100
            (docs/gpu.md), so it is larger than the staging segment.
        cuda_aware_mpi: whether CUDA buffers go to the MPI library as device memory: "auto" when it reports
            CUDA support (``MPIX_Query_cuda_support``), "1" always, "0" never (HYBRIDPIPE_CUDA_AWARE_MPI).
        gpu_allreduce: who reduces CUDA buffers in blocking and grouped allreduces: "nccl" (NCCL through
            cupy, an error where it cannot run), "mpi" (MPI: cuda-aware or staged), "auto" (NCCL where cupy
            has it and every rank of the group has a GPU of its own, else MPI) (HYBRIDPIPE_GPU_ALLREDUCE).
        join_average: what an ``hp.Average`` allreduce divides by while some ranks of its group are in ``hp.join()``
            (they contribute zeros): "size", the group's size, as Horovod does; "contributors", the ranks that
            contributed, the mean over the ranks that still have data (HYBRIDPIPE_JOIN_AVERAGE).
    """

    fusion_threshold_bytes: int = 4 * 1024 * 1024
    unfused_bytes: int = 256 * 1024
    segment_bytes: int = 256 * 1024
    receive_window: int = 4
    small_message_bytes: int = 64 * 1024
    shared_memory: bool = True
    shared_memory_chunk_bytes: int = 128 * 1024
    hierarchical: str = "auto"
    hierarchical_chunk_bytes: int = 2 * 1024 * 1024
    cycle_time_ms: float = 0.5
    stall_check_seconds: float = 60.0
    stall_shutdown_seconds: float = 0.0
    timeout_seconds: float = 300.0
    wait_spin_us: float = 200.0
    wait_sleep_us: float = 200.0
    engine_nice: int = 19
    waiters_help: bool = True
    timeline: str = ""
    autotune: bool = False
    autotune_log: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 5
    set_device: bool = True
    staging_segment_bytes: int = 4 * 1024 * 1024
    device_ring_segment_bytes: int = 64 * 1024 * 1024
    cuda_aware_mpi: str = "auto"
    gpu_allreduce: str = "auto"
    check_batches: bool = True
    check_finite: bool = False
    profile_executor: bool = False
    join_average: str = "size"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Config":
        """Reads the HYBRIDPIPE_* variables; unset ones keep their defaults.

        Raises:
            UsageError: a variable holds a malformed value (named in the message).
        """
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name, field, parse in (
            ("HYBRIDPIPE_FUSION_THRESHOLD", "fusion_threshold_bytes", parse_bytes),
            ("HYBRIDPIPE_UNFUSED_BYTES", "unfused_bytes", parse_bytes),
            ("HYBRIDPIPE_SEGMENT_BYTES", "segment_bytes", parse_bytes),
            ("HYBRIDPIPE_RECEIVE_WINDOW", "receive_window", parse_bytes),
            ("HYBRIDPIPE_SMALL_MESSAGE_BYTES", "small_message_bytes", parse_bytes),
            ("HYBRIDPIPE_SHARED_MEMORY", "shared_memory", _switch),
            ("HYBRIDPIPE_SHARED_MEMORY_CHUNK", "shared_memory_chunk_bytes", parse_bytes),
            ("HYBRIDPIPE_HIERARCHICAL", "hierarchical", _auto_switch),
            ("HYBRIDPIPE_HIERARCHICAL_CHUNK", "hierarchical_chunk_bytes", parse_bytes),
            ("HYBRIDPIPE_CYCLE_TIME_MS", "cycle_time_ms", _positive_float),
            ("HYBRIDPIPE_STALL_CHECK_SECONDS", "stall_check_seconds", _positive_float),
            ("HYBRIDPIPE_STALL_SHUTDOWN_SECONDS", "stall_shutdown_seconds", _non_negative_float),
            ("HYBRIDPIPE_TIMEOUT_SECONDS", "timeout_seconds", _non_negative_float),
            ("HYBRIDPIPE_WAIT_SPIN_US", "wait_spin_us", _wait_spin),
            ("HYBRIDPIPE_WAIT_SLEEP_US", "wait_sleep_us", _positive_float),
            ("HYBRIDPIPE_ENGINE_NICE", "engine_nice", _nice),
            ("HYBRIDPIPE_WAITERS_HELP", "waiters_help", _switch),
            ("HYBRIDPIPE_AUTOTUNE", "autotune", _switch),
            ("HYBRIDPIPE_AUTOTUNE_WARMUP_SAMPLES", "autotune_warmup_samples", parse_bytes),
            ("HYBRIDPIPE_AUTOTUNE_STEPS_PER_SAMPLE", "autotune_steps_per_sample", parse_bytes),
            ("HYBRIDPIPE_SET_DEVICE", "set_device", _switch),
            ("HYBRIDPIPE_STAGING_SEGMENT_BYTES", "staging_segment_bytes", parse_bytes),
            ("HYBRIDPIPE_DEVICE_RING_SEGMENT_BYTES", "device_ring_segment_bytes", parse_bytes),
            ("HYBRIDPIPE_CUDA_AWARE_MPI", "cuda_aware_mpi", _auto_switch),
            ("HYBRIDPIPE_GPU_ALLREDUCE", "gpu_allreduce", _gpu_allreduce),
            ("HYBRIDPIPE_CHECK_BATCHES", "check_batches", _switch),
            ("HYBRIDPIPE_CHECK_FINITE", "check_finite", _switch),
            ("HYBRIDPIPE_PROFILE_EXECUTOR", "profile_executor", _switch),
            ("HYBRIDPIPE_JOIN_AVERAGE", "join_average", _join_average),
        ):
            if env.get(name, "").strip():
                values[field] = parse(env[name], name)
        if env.get("HYBRIDPIPE_TIMELINE"):
            values["timeline"] = env["HYBRIDPIPE_TIMELINE"]
        if env.get("HYBRIDPIPE_AUTOTUNE_LOG"):
            values["autotune_log"] = env["HYBRIDPIPE_AUTOTUNE_LOG"]
        return cls(**values).validated()

    def validated(self) -> "Config":
        """Returns self after checking ranges; raises HybridPipeError naming a bad field."""
        if self.fusion_threshold_bytes < 1:
            raise UsageError(f"fusion_threshold_bytes={self.fusion_threshold_bytes} must be >= 1 (e.g. 4MiB)")
        if self.segment_bytes < 8:
            raise UsageError(f"segment_bytes={self.segment_bytes} must be >= 8 (e.g. 256KiB)")
        if self.shared_memory_chunk_bytes < 4096:
            raise UsageError(f"shared_memory_chunk_bytes={self.shared_memory_chunk_bytes} must be >= 4096 "
                             "(e.g. 128KiB)")
        if self.stall_shutdown_seconds < 0:
            raise UsageError(f"stall_shutdown_seconds={self.stall_shutdown_seconds} must be >= 0 (0: off)")
        if self.staging_segment_bytes < 4096:
            raise UsageError(f"staging_segment_bytes={self.staging_segment_bytes} must be >= 4096 (e.g. 4MiB)")
        if self.device_ring_segment_bytes < 4096:
            raise UsageError(f"device_ring_segment_bytes={self.device_ring_segment_bytes} must be >= 4096 "
                             "(e.g. 64MiB)")
        if self.gpu_allreduce not in ("nccl", "mpi", "auto"):
            raise UsageError(f"gpu_allreduce={self.gpu_allreduce!r} must be 'nccl', 'mpi' or 'auto'")
        if self.cuda_aware_mpi not in ("auto", "1", "0"):
            raise UsageError(f"cuda_aware_mpi={self.cuda_aware_mpi!r} must be 'auto', '1' or '0'")
        if self.join_average not in ("size", "contributors"):
            raise UsageError(f"join_average={self.join_average!r} must be 'size' (Horovod's) or 'contributors'")
        if self.hierarchical not in ("auto", "1", "0"):
            raise UsageError(f"hierarchical={self.hierarchical!r} must be 'auto', '1' or '0'")
        if self.hierarchical_chunk_bytes < 0:
            raise UsageError(f"hierarchical_chunk_bytes={self.hierarchical_chunk_bytes} must be >= 0 "
                             "(e.g. 4MiB; 0: one chunk)")
        if self.timeout_seconds < 0:
            raise UsageError(f"timeout_seconds={self.timeout_seconds} must be >= 0 (0: never; default 300)")
        if self.wait_sleep_us <= 0:
            raise UsageError(f"wait_sleep_us={self.wait_sleep_us} must be > 0 (e.g. 200)")
        if not 0 <= self.engine_nice <= 19:
            raise UsageError(f"engine_nice={self.engine_nice} must be in 0..19 (e.g. 10)")
        if self.receive_window < 1:
            raise UsageError(f"receive_window={self.receive_window} must be >= 1 (e.g. 4)")
        if self.autotune_warmup_samples < 0:
            raise UsageError(f"autotune_warmup_samples={self.autotune_warmup_samples} must be >= 0 (e.g. 3)")
        if self.autotune_steps_per_sample < 1:
            raise UsageError(f"autotune_steps_per_sample={self.autotune_steps_per_sample} must be >= 1 (e.g. 5)")
        return self

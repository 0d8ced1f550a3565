"""``python -m hybridpipe.plan calibrate``: measure this job's links and save them as the planner's cluster.

Run it under the launcher that will run the training, on the same hosts::

    hybridpipe-run -np 8 python -m hybridpipe.plan calibrate --output cluster.json

Design reasons:

* It measures the paths the training uses, not MPI alone: point-to-point messages go through
  ``hybridpipe.comm.p2p`` (the pipeline's transfers, on the communication thread), allreduces
  through ``hp.allreduce`` (the ring, shared memory or hierarchical path the engine picks).
* Latency and bandwidth come from a least-squares fit of ``time = α + bytes / β`` over message
  sizes from 8 bytes to 4 MiB (medians of repeats): α is the latency, β the bandwidth. A ping-pong
  between world ranks 0 and 1 gives the inside-a-host link; between rank 0 and the first rank of
  another host, the link between hosts (when the job spans hosts).
* The ring allreduce's fit (``time = a + bytes · b``) is kept too, for the group sizes in the job.
* Compute contention (``compute_contention``): the median of the slowest rank's synchronous step (a fixed
  kernel, then an allreduce of a few bytes through the engine, as a data-parallel step ends; every rank
  computing, steps back to back) over rank 0's median time for the kernel alone, per share of a core.
  Profiles are made by one process; under mpirun every core computes at once (slower on a VM whose vCPUs
  share a core), a synchronous step waits for the slowest rank, so a core whose speed moves on its own
  paces the job, and where ranks outnumber cores the ones waiting at the exchange cost the others their
  time slices.
* What a waiting rank costs its host (``waiting_load``): the ranks take turns computing a fixed kernel for
  50 ms while all the others wait for its message in the pipeline's receive (its polite wait, its
  communication thread's cycles); a waiting rank's process CPU time over the wait's wall time, the median
  over the turns and the ranks. Where ranks outnumber cores, the planner's simulation counts each rank not
  computing as this much of a computing one on its host's cores.
* The framework's own time per pipeline action (``action_overhead_us``): every rank runs a
  one-stage ``PipelineModel`` of two tiny layers at once (so ranks sharing cores share them here
  too) with 16 and with 2 micro-batches; the difference of the step times over the 28 extra
  actions is what one action costs beyond its layers' compute. Measured when the job's grid has
  one stage (as ``python -m hybridpipe.plan calibrate`` makes it).
* A rank's own time per pipeline transfer (``transfer_overhead_us``, the hand-offs to and from
  the communication thread): ``python -m hybridpipe.plan calibrate`` then re-makes the grid as one
  pipeline per host and times a 1F1B step of tiny layers with 16 and with 2 micro-batches; the
  hand-off time is the one for which the cost model's simulation of those two steps (with the
  measured action overhead and hop latency, no compute) differs by as much as the measured ones.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from hybridpipe import runtime
from hybridpipe.comm import p2p
from hybridpipe.collectives.allreduce import allreduce_, grouped_allreduce_
from hybridpipe.comm.engine import call
from hybridpipe.comm.reduction import Average, Sum
from hybridpipe.data_parallel.optimizer import DistributedOptimizer
from hybridpipe.errors import UsageError
from hybridpipe.pipeline import schedule as sched
from hybridpipe.pipeline.model import PipelineModel
from hybridpipe.plan.cost import Cluster
from hybridpipe.plan.cost import ZERO_LEVELS  # the levels the cost model plans

__all__ = ["calibrate", "cluster_of", "fit", "host_cores", "load_cluster", "transfer_overhead", "SIZES"]

SIZES = [8, 1024, 16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024]


def fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least squares of ``seconds = a + sizes · b`` with ``a, b >= 0``; returns ``(a, b)``."""
    x, y = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        return float(max(y.min(), 0.0)), 0.0
    if intercept < 0:
        return 0.0, float((x * y).sum() / (x * x).sum())
    return float(intercept), float(slope)


def _ping_pong(comm: Any, peer: int, me: int, repeats: int) -> list[float]:
    """One-way times per size between ``me`` and ``peer`` (half the round trip), medians."""
    times = []
    for size in SIZES:
        payload = torch.zeros(size // 4, dtype=torch.float32)
        runs = []
        for run in range(repeats + 2):
            started = time.perf_counter()
            if me < peer:
                p2p.send(payload, peer, 0, comm).wait()
                p2p.Receive(peer, 2, comm).wait()
            else:
                p2p.Receive(peer, 0, comm).wait()
                p2p.send(payload, peer, 2, comm).wait()
            if run >= 2:
                runs.append((time.perf_counter() - started) / 2)
        times.append(statistics.median(runs))
    return times


def _tiny_steps(layers: int, repeats: int) -> dict[int, float]:
    """Median step time of a 1F1B ``PipelineModel`` of ``layers`` tiny layers (one per stage or all on
    one), with 2 and with 16 micro-batches, on the job's grid."""
    torch.manual_seed(0)
    inputs, targets = torch.randn(16, 4), torch.randn(16, 4)
    stages = runtime.grid().pipeline_stages
    steps = {}
    for micro_batches in (2, 16):
        model = PipelineModel([nn.Linear(4, 4) for _ in range(layers)], nn.MSELoss(),
                              micro_batches=micro_batches, balance=[layers // stages] * stages)
        try:
            runs = []
            for run in range(repeats + 2):
                started = time.perf_counter()
                model.train_step(inputs, targets)
                if run >= 2:
                    runs.append(time.perf_counter() - started)
            steps[micro_batches] = statistics.median(runs)
        finally:
            model.close()
    return steps


def _kernel() -> None:
    """A fixed compute kernel (float32 256 × 256 matmuls and tanh, about the layers' mix) on this process's torch
    threads (one under ``bench/planner_validation.py``, which sets OMP_NUM_THREADS=1)."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=generator), torch.randn(256, 256, generator=generator)
    for _ in range(8):
        a = torch.tanh(a @ b) * 0.5


def last_level_cache_bytes() -> int:
    """The largest CPU cache of this host, bytes (Linux sysfs; 0 where it cannot be read)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (entry / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def memory_kernel(weight_bytes: int) -> Callable[[], None]:
    """A kernel like a layer stack's step over ``weight_bytes`` of float32 weights (1 MiB matrices): a forward of 32
    rows through each, then each one's weight gradient written, so that it streams its weights and gradients as a
    training step does; where the host's ranks stream more than its last cache holds, they contend for memory."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(512, 512, generator=generator) * 0.05 for _ in range(max(1, weight_bytes // 2**20))]
    grads = [torch.empty_like(w) for w in weights]
    x0 = torch.randn(32, 512, generator=generator)

    def kernel() -> None:
        x = x0
        for w in weights:
            x = torch.tanh(x @ w)
        for grad in grads:
            torch.mm(x0.t(), x, out=grad)

    return kernel


def _windows(count: int, kernels: int, synchronize: Any, step_end: Any, alone: bool,
             kernel: Callable[[], None] = _kernel) -> tuple[list[float], list[float]]:
    """``count`` pairs of windows, each after ``synchronize()``: in the first of a pair only a rank with ``alone``
    computes ``kernels`` kernels; in the second every rank runs :data:`SYNCHRONOUS_STEPS` steps back to back,
    each ``kernels`` kernels and then ``step_end()`` (the exchange that ends a synchronous step), and the last
    step is timed (a step that starts where the previous exchange left each rank, as in training).
    Alternating, so that both kinds see the same spells of a machine whose speed moves. Returns this rank's
    times of each kind (the first empty where it did not compute alone)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(count):
        synchronize()
        if alone:
            started = time.perf_counter()
            for _ in range(kernels):
                kernel()
            times[0].append(time.perf_counter() - started)
        synchronize()
        for _ in range(SYNCHRONOUS_STEPS):
            started = time.perf_counter()
            for _ in range(kernels):
                kernel()
            step_end()
        times[1].append(time.perf_counter() - started)
    return times


#: A window of :func:`compute_contention` takes about this long on one free core; it runs ``CONTENTION_WINDOWS``
#: pairs of windows (this VM has spells of 1–3 s in which one core runs slower, and a shorter measurement reads
#: whichever spell it fell in).
CONTENTION_WINDOW_SECONDS = 0.015
CONTENTION_WINDOWS = 64
#: Steps of the synchronous windows, the last one timed.
SYNCHRONOUS_STEPS = 2


#: How long a rank waiting in :func:`sleeping_barrier` sleeps between two tests.
BARRIER_SLEEP_SECONDS = 0.0002


def sleeping_barrier(comm: Any) -> None:
    """A barrier over ``comm`` whose waiting ranks sleep between tests. MPI's own barrier spins, and where a
    host's ranks outnumber its cores a spinning rank takes the core from the one being timed beside it: the
    windows of :func:`compute_contention` would time the spinning, not the compute (4 ranks on this project's
    2-core VM read 1.01–1.57 with MPI's barrier between the windows, 1.02–1.44 with this one, docs/planner.md)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(BARRIER_SLEEP_SECONDS)


def compute_contention(comm: Any, windows: int = CONTENTION_WINDOWS, exchange_seconds: float = 0.0,
                       kernel: Callable[[], None] = _kernel, samples: list | None = None) -> float:
    """How much slower a synchronous job's ranks compute than the one process a profile is made in, beyond the
    sharing of cores by more ranks than a host has (which :attr:`Cluster.compute_slowdown` counts apart): the
    median over ``windows`` windows of the slowest rank's synchronous step — a fixed kernel, then an allreduce of
    a few bytes through the engine, as a data-parallel step ends — less ``exchange_seconds`` (that allreduce's
    own time, measured apart), over the median window of world rank 0 computing the kernel alone while the
    others sleep (the two kinds of window alternate, so both see the same spells), divided by the ranks per
    core (at least 1).

    What it holds: cores that slow each other down (a VM's vCPUs that are hyperthreads of one core, shared
    caches and memory bandwidth); cores whose speed moves on its own (this project's 2-core VM has spells of
    1–3 s in which one core, not both, runs 30–60 % slower), which a synchronous step waits for at every
    exchange while a profile's medians see a free core; and, with more ranks than cores, the ranks waiting at
    the exchange while the others still compute, across the scheduler's time slices (measured: 2 ranks
    1.2–1.3×, 4 ranks on 2 cores 2.3–2.6× alone where the cores are shared 2× — docs/planner.md). 1.0 with one
    rank. ``samples`` (a list): this call's windows are added to it (on world rank 0) and the value is over all
    the windows in it, so that calls made apart in time measure one value over a longer span than the VM's spells.
    Collective over ``comm``; every rank must call ``hp.allreduce_`` from this thread."""
    rank = comm.Get_rank()
    if comm.Get_size() < 2:
        return 1.0
    sharing = max(1.0, runtime.local_size() / max(1, host_cores()))
    flag = torch.zeros(2)

    def barrier() -> None:
        call(None, "calibrate", lambda: sleeping_barrier(comm))

    def step_end() -> None:
        allreduce_(flag, op=Sum, name="calibrate.contention")

    kernels = 1
    if rank == 0:
        kernel()
        started = time.perf_counter()
        for _ in range(3):
            kernel()
        kernels = max(1, round(CONTENTION_WINDOW_SECONDS / ((time.perf_counter() - started) / 3)))
    kernels = call(None, "calibrate", lambda: comm.bcast(kernels, root=0))
    alone, steps = _windows(windows, kernels, barrier, step_end, rank == 0, kernel)
    gathered = call(None, "calibrate", lambda: comm.gather(steps, root=0))
    if rank != 0:
        return 1.0
    slowest = [max(times[w] for times in gathered) - exchange_seconds for w in range(windows)]
    samples = [] if samples is None else samples
    samples.append((alone, slowest))
    return max(1.0, statistics.median(t for _, block in samples for t in block)
               / statistics.median(t for block, _ in samples for t in block) / sharing)


#: Seconds :func:`model_contention` aims to spend (its windows: at least two alone per computing rank, at most
#: :data:`MODEL_CONTENTION_PAIRS`).
MODEL_CONTENTION_SECONDS = 2.0
MODEL_CONTENTION_PAIRS = 32


def _pass_seconds(one_pass: Callable[[], None]) -> float:
    """Seconds of ``one_pass()`` after one untimed (more than 0): what a measurement on the model sizes itself by."""
    one_pass()
    started = time.perf_counter()
    one_pass()
    return max(1e-9, time.perf_counter() - started)


def model_contention(comm: Any, one_pass: Callable[[], None] | None,
                     seconds: float = MODEL_CONTENTION_SECONDS) -> tuple[float, int]:
    """:func:`compute_contention` measured on the model itself: ``one_pass()`` is this rank's forward and
    backward (of the model, or of the slice it profiled; None: it computes nothing), repeated to fill
    :data:`CONTENTION_WINDOW_SECONDS` where it is shorter. Pairs of windows alternate: one rank computes alone
    while the others sleep (the ranks with a pass take turns), then every rank runs :data:`SYNCHRONOUS_STEPS`
    windows of one common length (the longest rank's alone, times the ranks per core), passes back to back until
    the window ends, so that a rank with a cheaper slice does not stop early and leave the others its core; each
    window ends in an allreduce of a few bytes, and the last one's time per pass is kept. In each pair the slowest
    rank's time per pass together over its own median alone sets the pair's value; the result is the median
    pair's divided by the ranks per core (at least 1). Measured on the model's own
    kernels, minutes closer to the steps than a ``calibrate`` run: what the planner multiplies the profile by.
    Collective over ``comm``; returns ``(contention, pairs of windows)`` on every rank (1.0 with one rank)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:
        return 1.0, 0
    flag = torch.zeros(2)
    estimate, repeats = 0.0, 1
    if one_pass is not None:
        seconds_each = _pass_seconds(one_pass)
        repeats = max(1, round(CONTENTION_WINDOW_SECONDS / seconds_each))
        estimate = seconds_each * repeats

    def work() -> None:
        for _ in range(repeats):
            one_pass()

    estimates = call(None, "calibrate", lambda: comm.allgather(estimate))
    computing = [r for r, value in enumerate(estimates) if value > 0]
    if not computing:
        return 1.0, 0
    sharing = max(1.0, runtime.local_size() / max(1, host_cores()))
    span = max(estimates) * sharing  # a synchronous window: every rank computes all along it
    per_pair = max(estimates) + SYNCHRONOUS_STEPS * span
    pairs = max(2 * len(computing), min(MODEL_CONTENTION_PAIRS, round(seconds / per_pair)))
    alone: list[float] = []
    together: list[float] = []
    for pair in range(pairs):
        call(None, "calibrate", lambda: sleeping_barrier(comm))
        if one_pass is not None and rank == computing[pair % len(computing)]:
            started = time.perf_counter()
            work()
            alone.append((time.perf_counter() - started) / repeats)
        call(None, "calibrate", lambda: sleeping_barrier(comm))
        each = 0.0
        for _ in range(SYNCHRONOUS_STEPS):
            started = time.perf_counter()
            if one_pass is not None:  # passes until the window's end, so that no rank leaves the others early
                passes = 0
                while passes == 0 or time.perf_counter() - started < span:
                    one_pass()
                    passes += 1
                each = (time.perf_counter() - started) / passes
            allreduce_(flag, op=Sum, name="calibrate.model_contention")
        together.append(each)
    own = statistics.median(alone) if alone else 0.0
    ratios = [t / own if own > 0 else 0.0 for t in together]
    gathered = call(None, "calibrate", lambda: comm.allgather(ratios))
    slowest = [max(values[w] for values in gathered) for w in range(pairs)]
    return max(1.0, statistics.median(slowest) / sharing), pairs


#: :func:`model_resume`'s budget (seconds of rounds; at least :data:`MODEL_RESUME_MIN_ROUNDS` rounds), passes per
#: rank back to back in a round (the first of them untimed: it resumes too) and laps of the relay.
MODEL_RESUME_SECONDS = 1.0
MODEL_RESUME_MIN_ROUNDS = 3
MODEL_RESUME_MAX_ROUNDS = 12
RESUME_BACK_TO_BACK = 4
RESUME_LAPS = 4
RESUME_TAG = 12


def model_resume(comm: Any, one_pass: Callable[[], None] | None,
                 seconds: float = MODEL_RESUME_SECONDS) -> tuple[float, int]:
    """How much longer a rank takes for its pass right after waiting for another rank, as a pipeline's stage computes
    after each receive, than for passes back to back, as a profile times them (its caches cold, its core woken):
    ``one_pass()`` is this rank's forward and backward (the slice it profiled; None: nothing). Rounds of two halves:
    the ranks with a pass take turns running :data:`RESUME_BACK_TO_BACK` passes in a row while the others sleep (the
    first untimed), then a token goes round them :data:`RESUME_LAPS` times through the pipeline's own transfers
    (``hybridpipe.comm.p2p``, its polite wait), each rank timing the one pass it runs when the token arrives. Per rank
    and round its median pass after a wait less its median back to back (the two halves seconds apart at most, so
    that the machine's drift between rounds cancels), the median over the rounds; the result, in microseconds, is the
    median over the ranks (at least 0). Collective over ``comm``; returns ``(microseconds, rounds)`` on every rank (0.0, 0 where
    fewer than two ranks have a pass)."""
    rank = comm.Get_rank()
    estimate = 0.0 if one_pass is None else _pass_seconds(one_pass)
    estimates = call(None, "calibrate", lambda: comm.allgather(estimate))
    computing = [r for r, value in enumerate(estimates) if value > 0]
    if len(computing) < 2:
        return 0.0, 0
    per_round = sum(estimates) * (RESUME_BACK_TO_BACK + RESUME_LAPS)
    rounds = max(MODEL_RESUME_MIN_ROUNDS, min(MODEL_RESUME_MAX_ROUNDS, round(seconds / per_round)))
    mine = computing.index(rank) if rank in computing else -1
    previous, following = computing[mine - 1], computing[(mine + 1) % len(computing)]
    token = torch.ones(4)
    differences: list[float] = []  # per round: its median pass after a wait less its median back to back

    def timed() -> float:
        started = time.perf_counter()
        one_pass()
        return time.perf_counter() - started

    for _ in range(rounds):
        back: list[float] = []
        for turn in computing:
            call(None, "calibrate", lambda: sleeping_barrier(comm))
            if turn == rank:
                back = [timed() for _ in range(RESUME_BACK_TO_BACK)][1:]
        call(None, "calibrate", lambda: sleeping_barrier(comm))
        if mine < 0:
            continue
        resumed = []
        for lap in range(RESUME_LAPS):
            if mine > 0 or lap > 0:
                p2p.Receive(previous, RESUME_TAG, comm).wait(what="calibrate.model_resume's token")
            resumed.append(timed())
            p2p.send(token, following, RESUME_TAG, comm).wait()
        if mine == 0:
            p2p.Receive(previous, RESUME_TAG, comm).wait(what="calibrate.model_resume's token")
        differences.append(statistics.median(resumed) - statistics.median(back))
    extra = statistics.median(differences) * 1e6 if differences else None
    extras = [value for value in call(None, "calibrate", lambda: comm.allgather(extra)) if value is not None]
    return max(0.0, statistics.median(extras)), rounds


def _contention_halves(comm: Any, exchange_seconds: float,
                       streaming: Callable[[], None] | None) -> Callable[[], tuple[float, float]]:
    """A function that measures half of :func:`compute_contention`'s windows (and of the streaming kernel's, when
    there is one) and returns ``(compute, memory)`` over every window measured so far: called twice, some
    seconds apart, the values span more than one of this VM's spells (1–3 s) of a slower core."""
    compute: list = []
    memory: list = []

    def measure() -> tuple[float, float]:
        value = compute_contention(comm, CONTENTION_WINDOWS // 2, exchange_seconds, samples=compute)
        streamed = compute_contention(comm, CONTENTION_WINDOWS // 4, exchange_seconds, kernel=streaming,
                                      samples=memory) if streaming else 0.0
        return value, streamed

    return measure


def _submit_overhead(repeats: int) -> float:
    """Seconds a ``hp.DistributedOptimizer`` adds to the backward per gradient tensor (its hook handing the tensor to
    the engine): a forward and backward of 32 tiny layers (64 tensors) with its hooks, against the same without
    (collective: every rank at once, as in training)."""
    torch.manual_seed(0)
    plain, hooked = (nn.Sequential(*[nn.Linear(4, 4) for _ in range(32)]) for _ in range(2))
    optimizer = DistributedOptimizer(torch.optim.SGD(hooked.parameters(), lr=0.0),
                                     named_parameters=hooked.named_parameters())
    x = torch.ones(2, 4)
    times: dict[str, list[float]] = {"plain": [], "hooked": []}
    for run in range(repeats + 2):
        for kind, model in (("plain", plain), ("hooked", hooked)):
            model.zero_grad()
            started = time.perf_counter()
            model(x).sum().backward()
            if run >= 2:
                times[kind].append(time.perf_counter() - started)
            if kind == "hooked":
                optimizer.synchronize()
    tensors = 2 * 32
    return max(0.0, (statistics.median(times["hooked"]) - statistics.median(times["plain"])) / tensors)


#: bytes of the gradients :func:`_after_reduction` reduces before timing the update
AFTER_REDUCTION_BYTES = 8 * 2**20


def _after_reduction(comm: Any, repeats: int) -> float:
    """Seconds per MiB that an SGD-like update over the parameters takes longer right after their gradients' allreduce
    than alone (the communication thread and the caches after a reduction; a data-parallel step's optimizer runs
    there). Collective over ``comm``."""
    grads = [torch.ones(AFTER_REDUCTION_BYTES // 4 // 16) for _ in range(16)]
    weights = [torch.zeros_like(g) for g in grads]
    times: dict[str, list[float]] = {"alone": [], "after": []}
    for run in range(repeats + 2):
        for kind in ("alone", "after"):
            call(None, "calibrate", lambda: sleeping_barrier(comm))
            if kind == "after":
                grouped_allreduce_(grads, op=Average)
            started = time.perf_counter()
            for weight, grad in zip(weights, grads):
                weight.add_(grad, alpha=-0.01)
            if run >= 2:
                times[kind].append(time.perf_counter() - started)
    extra = (statistics.median(times["after"]) - statistics.median(times["alone"])) / (AFTER_REDUCTION_BYTES / 2**20)
    everyone = call(None, "calibrate", lambda: comm.allgather(extra))
    return max(0.0, statistics.median(everyone))


#: Layers of :func:`_probe_model` (1 MiB each).
PROBE_LAYERS = 8


def _probe_model() -> nn.Module:
    """:func:`_zero_extra`'s and :func:`_data_parallel_extra`'s probe: eight 512 × 512 layers (8 MiB, more than
    one gradient bucket)."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(PROBE_LAYERS)])


def _steps_in_turns(comm: Any, probes: dict[Any, tuple[nn.Module, Any]], inputs: torch.Tensor, repeats: int,
                    whole: bool) -> dict[Any, list[float]]:
    """This rank's times of ``repeats`` training steps of each probe (a model and its optimizer) on ``inputs``, after
    two untimed rounds: the probes take turns, each after a sleeping barrier, so that they see the same spells of
    the machine. ``whole``: the step from ``zero_grad`` to the end of ``step()``; else ``step()`` alone."""
    times: dict[Any, list[float]] = {key: [] for key in probes}
    for run in range(repeats + 2):
        for key, (model, optimizer) in probes.items():
            call(None, "calibrate", lambda: sleeping_barrier(comm))
            started = time.perf_counter()
            optimizer.zero_grad()
            model(inputs).square().mean().backward()
            if not whole:
                started = time.perf_counter()
            optimizer.step()
            if run >= 2:
                times[key].append(time.perf_counter() - started)
    return times


#: Samples per rank of :func:`_data_parallel_extra`'s probe (its backward takes about as long as its reductions).
DATA_PARALLEL_PROBE_BATCH = 32


def _data_parallel_extra(comm: Any, repeats: int) -> float:
    """Seconds per MiB of a rank's parameters that a data-parallel step (``hp.DistributedOptimizer``: the hooks, the
    reductions on the ranks' own cores, the agreement, the update right after) takes beyond the same step with the
    torch optimizer alone, every rank computing at once: the probe's forward and backward on 32 samples and an SGD
    step, the two kinds in turns after a sleeping barrier, the slowest rank's median. Collective over ``comm``; the
    job's data-parallel grid (one stage)."""
    torch.manual_seed(0)
    plain, reduced = _probe_model(), _probe_model()
    optimizers = {"plain": (plain, torch.optim.SGD(plain.parameters(), lr=1e-4)),
                  "reduced": (reduced, DistributedOptimizer(torch.optim.SGD(reduced.parameters(), lr=1e-4),
                                                            named_parameters=reduced.named_parameters()))}
    times = _steps_in_turns(comm, optimizers, torch.randn(DATA_PARALLEL_PROBE_BATCH, 512), repeats, whole=True)
    every = call(None, "calibrate", lambda: comm.allgather(times))
    slowest = {kind: statistics.median(max(rank[kind][i] for rank in every) for i in range(repeats))
               for kind in times}
    mib = sum(p.numel() * 4 for p in plain.parameters()) / 2**20
    return max(0.0, (slowest["reduced"] - slowest["plain"]) / mib)


def _zero_extra(comm: Any, repeats: int) -> dict[int, float]:
    """Seconds per MiB of a rank's parameters that a ZeRO-1, ZeRO-2 and ZeRO-3 step take beyond a plain data-parallel
    one, on :func:`_probe_model` with negligible compute (two samples), the levels taking turns so that they see the
    same spells of the machine, the slowest rank's median: for levels 1 and 2 from the end of the backward to the
    end of ``step()`` (the reductions, the update, ZeRO's copies and the allgather of the updated shards); for level
    3 the whole step, since its gathers come before each module's forward and backward.
    Collective over ``comm``; the job's data-parallel grid (one stage)."""
    torch.manual_seed(0)

    def probe(level: int) -> tuple[nn.Module, Any]:
        model = _probe_model()
        return model, DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                           named_parameters=model.named_parameters(), zero=level)

    extra = {}
    mib = PROBE_LAYERS * (512 * 512 + 512) * 4 / 2**20
    for levels, whole in (([lv for lv in ZERO_LEVELS if lv < 3], False), ([0, 3] if 3 in ZERO_LEVELS else [], True)):
        if len(levels) < 2:
            continue
        probes = {level: probe(level) for level in levels}
        times = _steps_in_turns(comm, probes, torch.randn(2, 512), repeats, whole=whole)
        mine = [statistics.median(times[level]) for level in levels]
        slowest = dict(zip(levels, (max(values) for values in zip(*call(None, "calibrate",
                                                                          lambda: comm.allgather(mine))))))
        extra.update({level: max(0.0, (slowest[level] - slowest[0]) / mib) for level in levels if level})
    return extra


WAITING_TURN_SECONDS = 0.05  # one turn of waiting_load: the computing rank's kernel time


def waiting_load(comm: Any, turns: int = 8) -> float:
    """Process CPU seconds per second of a rank that waits in the pipeline's receive while another rank computes
    (collective over ``comm``); see the module docstring."""
    size, rank = comm.size, comm.rank
    shares = []
    payload = torch.ones(4)
    for turn in range(turns + 1):
        worker, tag = turn % size, 4 + 2 * (turn % 2)
        call(None, "calibrate", lambda: sleeping_barrier(comm))
        if rank == worker:
            started = time.perf_counter()
            while time.perf_counter() - started < WAITING_TURN_SECONDS:
                _kernel()
            for send in [p2p.send(payload, peer, tag, comm) for peer in range(size) if peer != rank]:
                send.wait()
        else:
            cpu, wall = time.process_time(), time.perf_counter()
            p2p.Receive(worker, tag, comm).wait()
            if turn > 0:
                shares.append((time.process_time() - cpu) / (time.perf_counter() - wall))
    mine = statistics.median(shares) if shares else 0.0
    return statistics.median(call(None, "calibrate", lambda: comm.allgather(mine)))


def _action_overhead(repeats: int) -> float:
    """Seconds per pipeline action beyond the layers' compute (see the module docstring)."""
    steps = _tiny_steps(2, repeats)
    return max(0.0, (steps[16] - steps[2]) / (2 * (16 - 2)))


def transfer_overhead(action_overhead_us: float, latency_us: float, repeats: int = 9) -> float:
    """A rank's own time per pipeline transfer, microseconds (collective: every rank of a grid with
    several stages calls it); see the module docstring."""
    state = runtime.job("calibrate")
    stages = state.grid.pipeline_stages
    if stages < 2:
        raise UsageError("transfer_overhead needs a grid of two or more pipeline stages (hp.init(pipeline_stages=2))")
    steps = _tiny_steps(stages, repeats)
    measured = call(None, "calibrate", lambda: state.grid.world_comm.allgather(steps[16] - steps[2]))
    target = statistics.median(measured)
    action, latency = action_overhead_us * 1e-6, latency_us * 1e-6

    def simulated(hand_off: float) -> float:
        def duration(a: sched.Action) -> float:
            return action + hand_off * ((a.stage > 0) + (a.stage < stages - 1))
        times = [sched.simulate(sched.one_f_one_b(stages, m), duration, duration, transfer_time=latency).makespan
                 for m in (2, 16)]
        return times[1] - times[0]

    low, high = 0.0, max(target, 1e-6)
    if simulated(low) >= target:
        return 0.0
    while simulated(high) < target:
        high *= 2
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < target else (low, middle)
    return (low + high) / 2 * 1e6


def host_cores() -> int:
    """Cores the ranks of this host may use together (collective over the job): the union of their
    affinity masks. One rank's own mask undercounts: mpirun binds each rank to a core of its own."""
    state = runtime.job("host_cores")
    if hasattr(os, "sched_getaffinity"):
        mine = sorted(os.sched_getaffinity(0))
    else:
        mine = list(range(os.cpu_count() or 1))
    masks = call(None, "host_cores", lambda: state.local_comm.allgather(mine))
    return len(set().union(*(set(mask) for mask in masks)))


def calibrate(repeats: int = 9) -> dict[str, Any]:
    """Measures the running job's links (collective: every rank calls it after ``hp.init``)."""
    state = runtime.job("calibrate")
    world = state.grid.world_comm
    size, rank = world.size, world.rank
    hosts = call(None, "calibrate", lambda: world.allgather(runtime.local_rank() == 0))
    host_starts = [r for r, first in enumerate(hosts) if first]
    result: dict[str, Any] = {"format": "hybridpipe-cluster-1", "ranks": size, "ranks_per_host": runtime.local_size(),
                              "cores_per_host": host_cores(), "sizes": SIZES}
    comm = call(None, "calibrate", world.Dup)
    try:
        pairs = []
        if size > 1 and runtime.local_size() > 1:
            pairs.append(("intra", 0, 1))
        if len(host_starts) > 1:
            pairs.append(("inter", 0, host_starts[1]))
        for label, a, b in pairs:
            if rank in (a, b):
                times = _ping_pong(comm, b if rank == a else a, rank, repeats)
                if rank == a:
                    latency, per_byte = fit(SIZES, times)
                    result[f"{label}_p2p_seconds"] = times
                    result[f"{label}_latency_us"] = latency * 1e6
                    result[f"{label}_gbps"] = 8 / per_byte / 1e9 if per_byte > 0 else 0.0
            call(None, "calibrate", comm.Barrier)
        reduce_times = []
        for nbytes in SIZES:
            tensor = torch.ones(max(nbytes // 4, 1))
            runs = []
            for run in range(repeats + 2):
                # ranks meet the reduction as a step's backward ends: each from its own work, not from spinning
                # together in MPI's barrier on the communication thread
                call(None, "calibrate", lambda: sleeping_barrier(comm))
                started = time.perf_counter()
                allreduce_(tensor, op=Sum)
                if run >= 2:
                    runs.append(time.perf_counter() - started)
            reduce_times.append(statistics.median(runs))
        cache = last_level_cache_bytes()
        # each rank streams weights and gradients of cache / ranks bytes each: twice the cache over the host
        streaming = memory_kernel(max(2**20, cache // max(1, runtime.local_size()))) if cache else None
        contentions = _contention_halves(comm, reduce_times[0], streaming)
        contentions()  # the first half of the windows here, the second after the measurements below
        mine = _submit_overhead(repeats)  # on this thread: the hooks hand their tensors to the engine's
        submits = call(None, "calibrate", lambda: world.allgather(mine))
        after = _after_reduction(comm, repeats) if size > 1 else 0.0
        if rank == 0:
            result["submit_overhead_us"] = statistics.median(submits) * 1e6
            result["after_reduction_us_per_mib"] = after * 1e6
        if size > 1 and state.grid.pipeline_stages == 1:
            extra, step = _zero_extra(comm, repeats), _data_parallel_extra(comm, repeats)
            if rank == 0:
                for level, seconds in extra.items():
                    result[f"zero{level}_us_per_mib"] = seconds * 1e6
                result["data_parallel_us_per_mib"] = step * 1e6
        contention, memory = contentions()
        waiting = waiting_load(comm) if size > 1 else 0.0
        if rank == 0:
            result["waiting_load"] = waiting
            result["compute_contention"] = contention
            result["memory_contention"] = max(memory, contention) if memory else 0.0
            result["cache_bytes"] = cache
        if state.grid.pipeline_stages == 1:
            mine = _action_overhead(repeats)  # the pipeline's own work, not on the communication thread
            overheads = call(None, "calibrate", lambda: world.gather(mine, root=0))
            if rank == 0:
                result["action_overhead_us"] = statistics.median(overheads) * 1e6
        if rank == 0:
            a, b = fit(SIZES, reduce_times)
            result["allreduce_seconds"] = reduce_times
            result["allreduce_alpha_us"] = a * 1e6
            result["allreduce_gbps"] = 8 / b / 1e9 if b > 0 else 0.0
    finally:
        call(None, "calibrate", comm.Free)
    return call(None, "calibrate", lambda: world.bcast(result if rank == 0 else None, root=0))


def load_cluster(path: str, memory_per_rank: float = 0.0, ranks: int | None = None) -> Cluster:
    """A :class:`Cluster` from a calibration file (``ranks`` overrides its rank count, e.g. to plan for
    more hosts of the same kind)."""
    with open(path) as file:
        data = json.load(file)
    if data.get("format") != "hybridpipe-cluster-1":
        raise UsageError(f"{path} is not a hybridpipe calibration (python -m hybridpipe.plan calibrate)")
    return cluster_of(data, memory_per_rank, ranks)


def cluster_of(data: dict[str, Any], memory_per_rank: float = 0.0, ranks: int | None = None) -> Cluster:
    """A :class:`Cluster` from :func:`calibrate`'s result (as :func:`load_cluster` reads it from its file)."""
    intra = data.get("intra_gbps") or data.get("allreduce_gbps") or 40.0
    latency = data.get("intra_latency_us", data.get("allreduce_alpha_us", 20.0))
    # the allreduce's fixed cost beyond the ring steps the model counts (2(R−1) latencies)
    overhead = max(0.0, data.get("allreduce_alpha_us", 0.0) - 2 * (int(data["ranks"]) - 1) * latency)
    return Cluster(ranks=ranks or int(data["ranks"]), ranks_per_host=int(data["ranks_per_host"]),
                   cores_per_host=int(data.get("cores_per_host", 0)), intra_host_gbps=float(intra),
                   inter_host_gbps=float(data.get("inter_gbps") or intra), latency_us=float(latency),
                   memory_per_rank=memory_per_rank, action_overhead_us=float(data.get("action_overhead_us", 0.0)),
                   allreduce_overhead_us=overhead,
                   transfer_overhead_us=float(data.get("transfer_overhead_us", 0.0)),
                   compute_contention=float(data.get("compute_contention", 1.0)),
                   memory_contention=float(data.get("memory_contention", 0.0)),
                   cache_bytes=float(data.get("cache_bytes", 0.0)),
                   submit_overhead_us=float(data.get("submit_overhead_us", 0.0)),
                   after_reduction_us_per_mib=float(data.get("after_reduction_us_per_mib", 0.0)),
                   zero_step_us_per_mib=tuple(float(data.get(f"zero{level}_us_per_mib", 0.0)) for level in (1, 2, 3)),
                   data_parallel_us_per_mib=float(data.get("data_parallel_us_per_mib", 0.0)),
                   waiting_load=float(data.get("waiting_load", 0.0)))

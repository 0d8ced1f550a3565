"""Data-parallel benchmark: hybridpipe DistributedOptimizer vs one process vs torch DDP, the 2-D grid,
and ResNet-50's gradients through the background engine.

Usage:
    python bench/data_parallel.py [--dp-ranks 2] [--grid 2x2] [--micro-batches 8,4,2] [--ranks 2,4,8]
                                  [--repeats 10] [--no-ddp] [--no-mlp] [--no-resnet]
                                  [--sweep-cycle-ms 0.25,1,4] [--sweep-fusion 1MiB,16MiB] [--markdown]
    python bench/data_parallel.py --zero-memory [bench/zero_memory.py's options]   (ZeRO × precision)

Run plainly, this script is the driver: it starts every variant in a fresh set of processes (a
plain subprocess for the one-process run, ``mpirun -n n ... --worker`` for the rest; the command
comes from ``hybridpipe.launch.mpirun_command``), reads rank 0's JSON result from a temporary
file, and prints the tables. With ``--worker`` it is one rank of one variant.

Two benchmarks:

1. **MLP training throughput.** ``--layers`` × (Linear(width, width) + Tanh), MSE loss against
   fixed random targets, plain SGD, a global batch of ``--batch`` rows per step. Every process
   runs one compute thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``). Variants, each
   in its own launch, all from the same initial weights (layer ``i`` built under seed
   ``SEED + i``) on the same global batch:
     * ``one process``: the whole model and batch in one plain process (the reference);
     * ``hybridpipe DP``: ``hp.DistributedOptimizer`` on ``--dp-ranks`` ranks, each a shard of
       batch/n rows (gradient hooks queue each gradient on the background engine during
       backward; ``step()`` waits);
     * ``torch DDP``: ``DistributedDataParallel`` on gloo over loopback, same shards;
     * ``hybridpipe 2-D``: ``--grid P×D`` (stages × replicas): ``hp.PipelineModel`` (uniform
       balance, 1F1B, M micro-batches per replica batch, one launch per M of ``--micro-batches``)
       + ``hp.DistributedOptimizer``;
     * ``grouped after backward`` (diagnostic): hybridpipe without the engine: backward, then one
       ``hp.grouped_allreduce_`` of all gradients on the training thread, then the SGD step;
     * ``allreduce_async_ after backward`` (diagnostic): the engine without overlap: backward,
       then each gradient submitted with ``hp.allreduce_async_`` and all waited for, then SGD.
       These two show what overlapping the reduction with backward gains or costs on this machine,
       and whether a cost is the overlap's or the engine's.
   A step = zero_grad + forward + backward + optimizer step. The first and last losses are
   reported (mean over the shards): equal columns show the variants trained the same model the
   same way. "fwd+bwd" and "step()" split a step on the slowest rank (DDP's reduction runs inside
   backward, hybridpipe's overlaps backward and is waited for in step()).
2. **ResNet-50 gradients through the engine** (shapes from bench/resnet50_shapes.py: 161 float32
   tensors, 25,557,032 values). On n ranks, in one job and interleaved repetition by repetition:
     * ``161 × allreduce_async_``: each tensor submitted with its own name, one by one in reverse
       order (as backward produces them), then every handle waited; the time runs from the first
       submit to the return of the last wait;
     * ``161 × allreduce_async``: the same, out of place (each result a new tensor, written by the
       engine straight from the input); "out of place / in place" is the median over repetitions
       of the ratio of the two (measured back to back, so machine noise cancels partly);
     * ``grouped_allreduce_``: one call on the same list (fused on the calling thread);
     * ``mpi4py × 161``: one ``Comm.Allreduce`` per tensor (Open MPI's MPI_Allreduce);
     * the memory floor (not an allreduce): every rank at once copies all the gradients' bytes as one
       block; an allreduce through shared memory writes (and at n = 2 reads) each rank's bytes at least
       twice, so twice that copy's time is a floor no implementation beats on this machine, and
       "mpi4py × 161 / floor" the largest speed-up over the mpi4py calls there can be.
   All use op sum on the same buffers (zeros, checked once with rank + 1). For the async variant
   the script also reports where the time goes (the submit loop, when the first bucket started
   and the last one finished, from the handles' ``started_at`` / ``finished_at``) and the deltas
   of ``hp.engine_stats("world")`` per run (negotiation cycles, name gathers = slow rounds,
   buckets).

How it measures (a shared, noisy 2-core machine is the expected case, so it never asserts speed):
  * MLP: ``--warmup`` untimed steps, then ``--blocks`` blocks of ``--steps`` steps, each block
    after a barrier; a block's time is the slowest rank's; steps/s = steps / median block time
    (over every block of every ``--rounds`` round). Rounds repeat all launches, order rotated.
  * ResNet: two warm-up repetitions, then ``--repeats``; each call after a barrier, its time
    the max over ranks; the table shows the median.
  * ``--sweep-cycle-ms`` / ``--sweep-fusion`` / ``--sweep-env`` compare engine settings
    (HYBRIDPIPE_CYCLE_TIME_MS, HYBRIDPIPE_FUSION_THRESHOLD, any HYBRIDPIPE_NAME=VALUE), each alone,
    against the defaults INSIDE one job (one launch for DP at ``--dp-ranks``, one per ResNet rank
    count): per block the settings take turns, each under its own ``hp.init(config=...)`` /
    ``hp.shutdown()``, so machine noise spreads over all of them. One more table.
  * Ranks beyond the available cores run oversubscribed with OMPI_MCA_mpi_yield_when_idle=1 (the
    table says which). Every launch sets OMP_NUM_THREADS=1 and forwards the HYBRIDPIPE_*
    variables in force.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # hybridpipe from this checkout when it is not installed

from _common import (command_line, format_ratio, int_list, progress, render, round_ratio, run_worker,  # noqa: E402
                     start_gloo)

# An allreduce through shared memory of private buffers reads and writes each rank's buffer at least twice
# over: its share of the others' reductions goes out (n-1)/n, its own share is reduced (the n inputs read, the
# result written to its output and to the segment), the others' results come in (n-1)/n: 2N bytes written per
# rank, as two copies of the buffer write (the reads are more, 2N at n = 2). A kernel-assisted single copy
# (CMA, which Open MPI's sm uses) that reads a peer's private buffer directly saves at most half a write of the
# buffer at n = 2: 1.75 copies, so a speed-up over the floor's ratio by more than 2 / 1.75 is not possible either.
MEMORY_FLOOR_COPIES = 2
RESNET_ROUNDS = 5  # the engine's ratios are medians over this many rounds of the repetitions, with their spread

SEED = 1234
DATA_SEED = 7
LEARNING_RATE = 0.1
RESNET_WARMUP = 2
#: a step's phases: zero_grad + forward + backward; optimizer.step() (hybridpipe: waits for the
#: reductions); the engine's allreduce time (union of its buckets' ring runs); when the first
#: bucket started (from the step's start); how long after backward ended the last bucket finished.
PHASES = ("fwd_bwd", "step", "ring", "first_start", "tail")
STATS_KEYS = ("cycles", "slow_rounds", "tensors", "buckets", "helped", "bytes")

#: Reference numbers and targets quoted in the issue (measured there on this kind of machine).
ISSUE = {
    "horovod_dp_steps": 2.73, "horovod_one_thread_steps": 2.70, "dp_target_ratio": 1.6,
    "deepspeed_grid_steps": 1.28, "grid_target_ratio": 1.5,
    "horovod_resnet_ms": {2: 90.0, 4: 215.0, 8: 471.0}, "resnet_target_ms": {2: 30.0, 4: 80.0, 8: 180.0},
}

MLP_LABELS = {"single": "one process, one thread",
              "independent": "n processes, no gradient exchange (compute ceiling)",
              "hybridpipe": "hybridpipe DistributedOptimizer",
              "ddp": "torch DDP (gloo)",
              "grouped": "hybridpipe grouped_allreduce_ after backward (no overlap; diagnostic)",
              "async-after": "hybridpipe allreduce_async_ per gradient after backward "
                             "(engine, no overlap; diagnostic)",
              "grid": "hybridpipe PipelineModel + DistributedOptimizer"}


# ------------------------------------------------------------------------------------------ model

def _model_classes() -> Any:
    """Block (Linear + Tanh) is defined lazily so that the driver never imports torch."""
    from torch import nn

    class Block(nn.Module):
        """One layer of the MLP: Linear(width, width) then Tanh."""

        def __init__(self, width: int) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)
            self.act = nn.Tanh()

        def forward(self, x: Any) -> Any:
            return self.act(self.linear(x))

    return Block


def seeded_layer(cls: Any, index: int, *args: Any) -> Any:
    """Layer ``index`` built under seed SEED + index (what PipelineModel(seed_layers=SEED) does)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + index)
        return cls(*args)


def global_batch(rows: int, width: int) -> tuple[Any, Any]:
    """The same inputs and targets in every process (targets inside Tanh's range)."""
    import torch

    generator = torch.Generator().manual_seed(DATA_SEED)
    inputs = torch.randn(rows, width, generator=generator)
    targets = torch.randn(rows, width, generator=generator).clamp_(-0.9, 0.9)
    return inputs, targets


# ------------------------------------------------------------------------------------------ MLP workers

class MLPWorker:
    """One process of one MLP variant; subclasses build ``self.step_fn`` (returns this rank's loss,
    already a mean over its shard) and the process-group hooks."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch, self.args = torch, args
        self.Block = _model_classes()
        self.inputs, self.targets = global_batch(args.batch, args.width)
        self.rank, self.size = 0, 1
        self.phase = [0.0] * len(PHASES)  # seconds summed over this block's steps
        self.handles: list[Any] = []

    # process-group hooks (one process: trivial)
    def barrier(self) -> None:
        pass

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def mean_loss(self, loss: float) -> float:
        return loss

    def engine_stats(self) -> dict[str, int] | None:
        return None

    def close(self) -> None:
        pass

    def build(self) -> Callable[[], float]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"torch": self.torch.__version__}

    def timed_step(self, zero_grad: Callable[[], None], forward_backward: Callable[[], Any],
                   step: Callable[[], Any]) -> Callable[[], float]:
        """Wraps one training step; adds its phases to ``self.phase`` (see PHASES)."""
        clock, phase, handles = time.monotonic, self.phase, self.handles

        def run() -> float:
            handles.clear()
            start = clock()
            zero_grad()
            loss = forward_backward()
            middle = clock()
            step()
            end = clock()
            phase[0] += middle - start
            phase[1] += end - middle
            if handles:  # hybridpipe: the engine's allreduces of this step (waited for by step())
                spans = sorted({(h.started_at, h.finished_at) for h in handles if h.started_at})
                phase[2] += sum(f - s for s, f in spans)
                phase[3] += min(s for s, _ in spans) - start
                phase[4] += max(f for _, f in spans) - middle
            return loss
        return run

    def trace_engine(self) -> None:
        """Keeps the handles DistributedOptimizer gets from the engine, for the phase columns (the
        optimizer calls ``hybridpipe.collectives.allreduce.allreduce_async_``; this wraps that function)."""
        from hybridpipe.collectives import allreduce as engine

        submit, handles = getattr(self, "_untraced", engine.allreduce_async_), self.handles
        self._untraced = submit

        def traced(*args: Any, **kwargs: Any) -> Any:
            handle = submit(*args, **kwargs)
            handles.append(handle)
            return handle
        engine.allreduce_async_ = traced

    def restore_engine(self) -> None:
        from hybridpipe.collectives import allreduce as engine

        engine.allreduce_async_ = getattr(self, "_untraced", engine.allreduce_async_)

    def run(self) -> dict[str, Any]:
        args = self.args
        step = self.build()
        losses = []
        for _ in range(args.warmup):
            losses.append(step())
        stats_before = self.engine_stats()
        blocks, cpu, other, phases = [], [], [], []
        clock = time.perf_counter
        for _ in range(args.blocks):
            self.phase[:] = [0.0] * len(PHASES)
            self.barrier()
            start, cpu_start, thread_start = clock(), time.process_time(), time.thread_time()
            for _ in range(args.steps):
                losses.append(step())
            blocks.append(clock() - start)
            cpu.append(time.process_time() - cpu_start)
            # CPU of every thread but the training thread: the engine's, gloo's, MPI's
            other.append((cpu[-1] - (time.thread_time() - thread_start)) / args.steps)
            phases.append([p / args.steps for p in self.phase])
        stats_after = self.engine_stats()
        all_blocks = self.gather(blocks)
        all_cpu = self.gather(cpu)
        all_other = self.gather(other)
        all_phases = self.gather(phases)
        result = {
            "variant": args.variant, "ranks": self.size, "steps_per_block": args.steps,
            "block_seconds": [max(column) for column in zip(*all_blocks)],
            "cpu_seconds": [sum(column) for column in zip(*all_cpu)],
            "other_thread_cpu_seconds": [max(column) for column in zip(*all_other)],
            # per block: the rank with the longest block's phase split
            "phase_seconds": [all_phases[max(range(self.size), key=lambda r: all_blocks[r][b])][b]
                              for b in range(args.blocks)],
            "first_loss": self.mean_loss(losses[0]), "last_loss": self.mean_loss(losses[-1]),
            "steps_total": len(losses),
        }
        if stats_before is not None and stats_after is not None:
            timed = args.blocks * args.steps
            result["engine_per_step"] = {k: (stats_after[k] - stats_before[k]) / timed for k in STATS_KEYS}
            result["engine_slow_rounds_total"] = stats_after["slow_rounds"]
        result.update(self.describe())
        return result


def mlp_training(worker: Any, x: Any, y: Any, wrap: Callable[[Any, Any], Any] | None = None,
                 step: Callable[[Any, Any], None] | None = None,
                 wrap_model: Callable[[Any], Any] | None = None) -> Callable[[], float]:
    """The benchmark MLP trained with SGD on (x, y): ``worker.timed_step`` of zero_grad, forward +
    backward, and ``optimizer.step()`` — or ``step(model, optimizer)``. ``wrap_model(model)`` may
    replace the model (e.g. by DDP around it), ``wrap(model, optimizer)`` the SGD optimizer (e.g. by
    a DistributedOptimizer around it)."""
    from torch import nn

    args = worker.args
    model = nn.Sequential(*[seeded_layer(worker.Block, i, args.width) for i in range(args.layers)])
    if wrap_model is not None:
        model = wrap_model(model)
    optimizer = worker.torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    if wrap is not None:
        optimizer = wrap(model, optimizer)
    loss_fn = nn.MSELoss()

    def forward_backward() -> float:
        loss = loss_fn(model(x), y)
        loss.backward()
        return float(loss.detach())
    return worker.timed_step(lambda: optimizer.zero_grad(set_to_none=True), forward_backward,
                             optimizer.step if step is None else lambda: step(model, optimizer))


def hp_distributed(model: Any, optimizer: Any) -> Any:
    """``optimizer`` wrapped in hp.DistributedOptimizer over ``model``'s named parameters."""
    import hybridpipe as hp

    return hp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


class SingleWorker(MLPWorker):
    """The whole model and the whole batch in one process, one thread."""

    def build(self) -> Callable[[], float]:
        return mlp_training(self, self.inputs, self.targets)


class MPIWorker(MLPWorker):
    def __init__(self, args: argparse.Namespace) -> None:
        from mpi4py import MPI

        super().__init__(args)
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    def gather(self, value: Any) -> list[Any]:
        return self.comm.allgather(value)

    def mean_loss(self, loss: float) -> float:
        # equal shards: the mean of the shard means is the global batch's mean loss
        return self.comm.allreduce(loss) / self.size

    def shard(self, replicas: int, replica: int) -> tuple[Any, Any]:
        rows = self.args.batch // replicas
        part = slice(replica * rows, (replica + 1) * rows)
        return self.inputs[part].contiguous(), self.targets[part].contiguous()


class IndependentWorker(MPIWorker):
    """Each rank trains its own shard with plain SGD and never exchanges gradients: the compute-only
    ceiling of data parallelism on this machine (its models drift apart; its loss is not comparable)."""

    def build(self) -> Callable[[], float]:
        return mlp_training(self, *self.shard(self.size, self.rank))


class HybridpipeDPWorker(MPIWorker):
    """hp.DistributedOptimizer over every rank (pipeline_stages=1)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        import hybridpipe as hp

        self.hp = hp
        self.grid = hp.init(pipeline_stages=1)
        self.trace_engine()

    def build(self) -> Callable[[], float]:
        return mlp_training(self, *self.shard(self.size, self.rank), wrap=hp_distributed)

    def engine_stats(self) -> dict[str, int] | None:
        return self.hp.engine_stats("data")

    def describe(self) -> dict[str, Any]:
        from hybridpipe._ext import describe

        config = self.hp.config()
        return {"torch": self.torch.__version__, "describe": describe(),
                "cycle_time_ms": config.cycle_time_ms,
                "fusion_threshold_bytes": config.fusion_threshold_bytes}

    def close(self) -> None:
        self.hp.shutdown()


class GroupedWorker(HybridpipeDPWorker):
    """Diagnostic: no engine, no overlap: backward, then one hp.grouped_allreduce_ of every gradient
    (average) on the training thread, then plain SGD."""

    def build(self) -> Callable[[], float]:
        hp = self.hp

        def step(model: Any, optimizer: Any) -> None:
            hp.grouped_allreduce_([p.grad for p in model.parameters()], op=hp.Average)
            optimizer.step()
        return mlp_training(self, *self.shard(self.size, self.rank), step=step)

    def engine_stats(self) -> dict[str, int] | None:
        return None


class AsyncAfterWorker(HybridpipeDPWorker):
    """Diagnostic: the engine without overlap: backward first, then every gradient submitted with
    hp.allreduce_async_ (last layer first, as the hooks would) and waited for, then plain SGD."""

    def build(self) -> Callable[[], float]:
        hp = self.hp

        def step(model: Any, optimizer: Any) -> None:
            handles = [hp.allreduce_async_(p.grad, name=name, op=hp.Average, group="data")
                       for name, p in list(model.named_parameters())[::-1]]
            self.handles.extend(handles)
            for handle in handles:
                handle.wait()
            optimizer.step()
        return mlp_training(self, *self.shard(self.size, self.rank), step=step)


class GridWorker(HybridpipeDPWorker):
    """hp.PipelineModel over P stages × D replicas, hp.DistributedOptimizer over each stage's replicas."""

    def __init__(self, args: argparse.Namespace) -> None:
        MPIWorker.__init__(self, args)
        import hybridpipe as hp

        self.hp = hp
        self.grid = hp.init(pipeline_stages=args.stages)
        self.trace_engine()
        self.model: Any = None

    def build(self) -> Callable[[], float]:
        torch, args, hp, grid = self.torch, self.args, self.hp, self.grid
        from torch import nn

        specs = [hp.LayerSpec(self.Block, args.width) for _ in range(args.layers)]
        self.model = model = hp.PipelineModel(specs, loss_fn=nn.MSELoss(),
                                              micro_batches=args.micro_batches[0], balance="uniform",
                                              schedule="1f1b", checkpoint="never", seed_layers=SEED)
        optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LEARNING_RATE),
                                            named_parameters=model.named_parameters())
        x, y = self.shard(grid.data_replicas, grid.replica)
        return self.timed_step(lambda: optimizer.zero_grad(set_to_none=True),
                               lambda: float(model.train_step(x, y)), optimizer.step)

    def mean_loss(self, loss: float) -> float:
        # train_step's loss is the replica's shard loss on every rank of that pipeline: averaging
        # over all ranks weighs every replica P times, i.e. equally
        return self.comm.allreduce(loss) / self.size

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
        self.hp.shutdown()


class DDPWorker(MPIWorker):
    """torch.nn.parallel.DistributedDataParallel on gloo over loopback (default 25 MB buckets)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.dist, self.store = start_gloo(self.comm)

    def build(self) -> Callable[[], float]:
        from torch.nn.parallel import DistributedDataParallel

        return mlp_training(self, *self.shard(self.size, self.rank), wrap_model=DistributedDataParallel)

    def close(self) -> None:
        self.comm.Barrier()
        self.dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ ResNet worker

class ResNetWorker:
    """161 ResNet-50 gradient tensors: the async engine vs one grouped call vs 161 MPI_Allreduce."""

    def __init__(self, args: argparse.Namespace) -> None:
        import numpy as np
        import torch
        from mpi4py import MPI

        import hybridpipe as hp
        from resnet50_shapes import RESNET50_TENSORS, resnet50_parameter_shapes

        torch.set_num_threads(1)
        self.np, self.torch, self.MPI, self.hp = np, torch, MPI, hp
        self.args = args
        hp.init()
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        shapes = resnet50_parameter_shapes()
        assert len(shapes) == RESNET50_TENSORS
        self.names = [f"resnet50.{name}" for name, _ in shapes]
        self.tensors = [torch.zeros(shape, dtype=torch.float32) for _, shape in shapes]
        self.arrays = [t.numpy().reshape(-1) for t in self.tensors]  # the same memory, for mpi4py
        total = sum(t.numel() for t in self.tensors)
        self.flat_source, self.flat_target = torch.zeros(total), torch.empty(total)  # the memory floor's copy
        self.async_runs: list[dict[str, Any]] = []
        self.checking = False

    # -- the four calls; each reduces self.tensors in place with op sum

    def call_async(self) -> None:
        hp = self.hp
        before = hp.engine_stats("world")
        start_mono = time.monotonic()
        handles = [hp.allreduce_async_(self.tensors[i], name=self.names[i], op=hp.Sum, group="world")
                   for i in reversed(range(len(self.tensors)))]
        submitted = time.monotonic()
        for handle in handles:
            handle.wait()
        end = time.monotonic()
        after = hp.engine_stats("world")
        self.async_runs.append({
            "submit_s": submitted - start_mono,
            "first_start_s": min(h.started_at for h in handles) - start_mono,
            "last_finish_s": max(h.finished_at for h in handles) - start_mono,
            "total_s": end - start_mono,
            "distinct_starts": len({h.started_at for h in handles}),
            "stats": {k: after[k] - before[k] for k in STATS_KEYS},
        })

    def call_async_out(self) -> None:
        """The out-of-place form, ``hp.allreduce_async``: the engine reads each tensor and writes a new one."""
        hp = self.hp
        order = list(reversed(range(len(self.tensors))))
        handles = [hp.allreduce_async(self.tensors[i], name=f"{self.names[i]}.out", op=hp.Sum, group="world")
                   for i in order]
        outputs = [handle.wait() for handle in handles]
        if self.checking:  # check() reads self.arrays: put the results there
            for i, output in zip(order, outputs):
                self.tensors[i].copy_(output)

    def call_grouped(self) -> None:
        self.hp.grouped_allreduce_(self.tensors, op=self.hp.Sum, group="world")

    def call_mpi(self) -> None:
        comm, in_place, total = self.comm, self.MPI.IN_PLACE, self.MPI.SUM
        for array in self.arrays:
            comm.Allreduce(in_place, array, op=total)

    def call_copy(self) -> None:
        """Not an allreduce: one copy of all the gradients' bytes in one contiguous block (the memory floor)."""
        self.flat_target.copy_(self.flat_source)

    def check(self, name: str, call: Callable[[], None]) -> bool:
        """One untimed call with rank + 1 everywhere; True on every rank iff all got n(n+1)/2."""
        for a in self.arrays:
            a[...] = self.rank + 1
        self.checking = True
        call()
        self.checking = False
        expected = self.size * (self.size + 1) / 2
        ok = all(bool(self.np.all(a == expected)) for a in self.arrays)
        for a in self.arrays:
            a[...] = 0  # zeros stay zeros in the timed calls
        everyone = bool(self.comm.allreduce(int(ok), op=self.MPI.MIN))
        if not everyone and self.rank == 0:
            progress(f"WRONG RESULT from {name} at n={self.size} (expected {expected} everywhere)")
        return everyone

    def run(self) -> dict[str, Any]:
        np, args = self.np, self.args
        calls = {"async": self.call_async, "async_out": self.call_async_out, "grouped": self.call_grouped,
                 "mpi4py": self.call_mpi}
        correct = {name: self.check(name, call) for name, call in calls.items()}
        first_run = self.async_runs.pop()["stats"]  # the check: the names' first negotiation
        self.async_runs.clear()
        calls["copy"] = self.call_copy  # timed with the others, every rank at once; not checked
        names = list(calls)
        times = np.zeros((len(names), args.repeats), dtype=np.float64)
        clock = time.perf_counter
        for repetition in range(RESNET_WARMUP + args.repeats):
            shift = repetition % len(names)
            for index in [*range(shift, len(names)), *range(shift)]:  # rotate who goes first
                self.comm.Barrier()
                start = clock()
                calls[names[index]]()
                elapsed = clock() - start
                if repetition >= RESNET_WARMUP:
                    times[index, repetition - RESNET_WARMUP] = elapsed
        self.comm.Allreduce(self.MPI.IN_PLACE, times, op=self.MPI.MAX)
        # where the async time goes: per run, the max over ranks of each figure
        keys = ("submit_s", "first_start_s", "last_finish_s", "total_s")
        mine = np.array([[run[k] for k in keys] for run in self.async_runs], dtype=np.float64)
        self.comm.Allreduce(self.MPI.IN_PLACE, mine, op=self.MPI.MAX)
        timed = mine[RESNET_WARMUP:]
        config = self.hp.config()
        from hybridpipe._ext import describe

        return {
            "n": self.size, "repeats": args.repeats, "correct": correct,
            "seconds": {name: float(np.median(times[i])) for i, name in enumerate(names)},
            "all_seconds": {name: times[i].tolist() for i, name in enumerate(names)},
            "async_breakdown": {k: timed[:, j].tolist() for j, k in enumerate(keys)},
            "async_stats_first": first_run,
            "async_stats_warmup": [run["stats"] for run in self.async_runs[:RESNET_WARMUP]],
            "async_stats_timed": {k: [run["stats"][k] for run in self.async_runs[RESNET_WARMUP:]]
                                  for k in STATS_KEYS},
            "async_distinct_starts": [run["distinct_starts"] for run in self.async_runs[RESNET_WARMUP:]],
            "world_stats_end": self.hp.engine_stats("world"),
            "cycle_time_ms": config.cycle_time_ms, "fusion_threshold_bytes": config.fusion_threshold_bytes,
            "describe": describe(), "torch": self.torch.__version__,
        }

    def close(self) -> None:
        self.hp.shutdown()


# ------------------------------------------------------------------------------------------ engine settings

BASELINE = "(defaults)"  # no override: the environment's HYBRIDPIPE_* values / the defaults


def setting_config(setting: str) -> Any:
    """The hp.Config for one sweep setting ("NAME=VALUE" over the environment, or BASELINE)."""
    from hybridpipe.config import Config

    environ = dict(os.environ)
    if setting != BASELINE:
        for part in setting.split("+"):  # several variables at once: A=1+B=2
            name, value = part.split("=", 1)
            environ[name] = value
    return Config.from_env(environ)


def baseline_info() -> dict[str, Any]:
    from hybridpipe._ext import describe

    config = setting_config(BASELINE)
    return {"describe": describe(), "cycle_time_ms": config.cycle_time_ms,
            "fusion_threshold_bytes": config.fusion_threshold_bytes}


class SweepDPWorker(MPIWorker):
    """hybridpipe DP under several engine settings in ONE job: per block and setting (order
    rotated), hp.init(config=...), a fresh model + DistributedOptimizer, warm-up, ``--steps`` timed
    steps, hp.shutdown(). Interleaving keeps machine noise off the comparison."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        import hybridpipe as hp

        self.hp = hp

    def run(self) -> dict[str, Any]:
        torch, args, hp = self.torch, self.args, self.hp
        settings = args.settings
        blocks = {s: [] for s in settings}
        phases = {s: [] for s in settings}
        engine = {s: [] for s in settings}
        x, y = self.shard(self.size, self.rank)
        for block in range(args.blocks):
            shift = block % len(settings)
            for setting in settings[shift:] + settings[:shift]:
                hp.init(pipeline_stages=1, config=setting_config(setting))
                self.trace_engine()
                step = mlp_training(self, x, y, wrap=hp_distributed)
                for _ in range(args.warmup):
                    step()
                before = hp.engine_stats("data")
                self.phase[:] = [0.0] * len(PHASES)
                self.comm.Barrier()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                elapsed = time.perf_counter() - start
                after = hp.engine_stats("data")
                blocks[setting].append(elapsed)
                phases[setting].append([p / args.steps for p in self.phase])
                engine[setting].append({k: (after[k] - before[k]) / args.steps for k in STATS_KEYS})
                hp.shutdown()
                self.restore_engine()
        everyone = self.gather(blocks)
        slowest = {s: [max(r[s][b] for r in everyone) for b in range(args.blocks)] for s in settings}
        return {"variant": args.variant, "ranks": self.size, "steps_per_block": args.steps,
                "settings": settings, "block_seconds": slowest, "phase_seconds": phases,
                "engine_per_step": engine, **baseline_info(), "torch": torch.__version__}

    def close(self) -> None:
        self.hp.shutdown()


class SweepResNetWorker(ResNetWorker):
    """ResNet-50's 161 tensors through the engine under several settings in ONE job: per block and
    setting (order rotated), hp.init(config=...), one untimed async run (the names' first
    negotiation) and one warm-up, then ``repeats // blocks`` timed async runs alternating with as
    many grouped_allreduce_ calls (the fusion threshold applies to both), hp.shutdown()."""

    def run(self) -> dict[str, Any]:
        np, args, hp = self.np, self.args, self.hp
        settings = args.settings
        per_block = max(1, args.repeats // args.blocks)
        times = {s: {"async": [], "grouped": []} for s in settings}
        hp.shutdown()  # __init__ started the defaults; every block starts its own
        for block in range(args.blocks):
            shift = block % len(settings)
            for setting in settings[shift:] + settings[:shift]:
                hp.init(config=setting_config(setting))
                for _ in range(2):
                    self.call_async()
                for _ in range(per_block):
                    for name, call in (("async", self.call_async), ("grouped", self.call_grouped)):
                        self.comm.Barrier()
                        start = time.perf_counter()
                        call()
                        times[setting][name].append(time.perf_counter() - start)
                hp.shutdown()
        hp.init()  # close() shuts down
        flat = np.array([times[s][k] for s in settings for k in ("async", "grouped")], dtype=np.float64)
        self.comm.Allreduce(self.MPI.IN_PLACE, flat, op=self.MPI.MAX)
        rows = iter(flat.tolist())
        seconds = {s: {k: next(rows) for k in ("async", "grouped")} for s in settings}
        return {"variant": args.variant, "n": self.size, "settings": settings, "all_seconds": seconds,
                **baseline_info(), "torch": self.torch.__version__}


VARIANTS = ("single", "independent", "hybridpipe", "ddp", "grouped", "async-after", "grid", "resnet",
            "dp-sweep", "resnet-sweep")


def worker_main(args: argparse.Namespace) -> int:
    worker_class = {"single": SingleWorker, "independent": IndependentWorker,
                    "hybridpipe": HybridpipeDPWorker,
                    "ddp": DDPWorker, "grouped": GroupedWorker, "async-after": AsyncAfterWorker,
                    "dp-sweep": SweepDPWorker,
                    "resnet-sweep": SweepResNetWorker,
                    "grid": GridWorker, "resnet": ResNetWorker}[args.variant]
    return run_worker(worker_class(args), args.result)


# ------------------------------------------------------------------------------------------ driver

@dataclass
class Launch:
    """One set of fresh processes running one variant under one engine setting."""

    kind: str       # "mlp" or "resnet"
    variant: str    # single / hybridpipe / ddp / grid / resnet
    ranks: int
    micro_batches: int = 0  # the 2-D grid's M
    results: list[dict[str, Any]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        grid = f" M={self.micro_batches}" if self.micro_batches else ""
        return f"{self.kind} {self.variant} n={self.ranks}{grid}"


def sweep_settings(args: argparse.Namespace) -> list[str]:
    settings = [f"HYBRIDPIPE_CYCLE_TIME_MS={v}" for v in args.sweep_cycle_ms]
    settings += [f"HYBRIDPIPE_FUSION_THRESHOLD={v}" for v in args.sweep_fusion]
    return settings + args.sweep_env


def plan(args: argparse.Namespace) -> tuple[list[Launch], list[Launch]]:
    main: list[Launch] = []
    if not args.no_mlp:
        main.append(Launch("mlp", "single", 1))
        main.append(Launch("mlp", "independent", args.dp_ranks))
        main.append(Launch("mlp", "hybridpipe", args.dp_ranks))
        if not args.no_ddp:
            main.append(Launch("mlp", "ddp", args.dp_ranks))
        main.append(Launch("mlp", "grouped", args.dp_ranks))
        main.append(Launch("mlp", "async-after", args.dp_ranks))
        if not args.no_grid:
            main += [Launch("mlp", "grid", args.stages * args.replicas, micro_batches=m)
                     for m in args.micro_batches]
    if not args.no_resnet:
        main += [Launch("resnet", "resnet", n) for n in args.ranks]
    sweep: list[Launch] = []
    if sweep_settings(args):
        if not args.no_mlp:
            sweep.append(Launch("sweep", "dp-sweep", args.dp_ranks))
        if not args.no_resnet:
            sweep += [Launch("sweep", "resnet-sweep", n) for n in args.ranks]
    return ([] if args.sweep_only else main), sweep


def run_launch(launch: Launch, args: argparse.Namespace, folder: Path, index: int) -> None:
    from hybridpipe.launch import available_cores, mpirun_command

    result_path = folder / f"result-{index}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result_path),
            "--variant", launch.variant, "--batch", str(args.batch), "--width", str(args.width),
            "--layers", str(args.layers),
            "--micro-batches", str(launch.micro_batches or args.micro_batches[0]),
            "--grid", f"{args.stages}x{args.replicas}", "--steps", str(args.steps),
            "--blocks", str(args.blocks),
            "--warmup", str(args.warmup), "--repeats", str(args.repeats),
            "--settings", ",".join([BASELINE] + sweep_settings(args))]
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.update({k: v for k, v in os.environ.items()
                if k.startswith("HYBRIDPIPE_") and k != "HYBRIDPIPE_MPIRUN"})
    if launch.variant == "single":
        command, child_env = argv, {**os.environ, **env}
    else:
        if launch.ranks > available_cores():
            env["OMPI_MCA_mpi_yield_when_idle"] = "1"
        command, child_env = mpirun_command(launch.ranks, argv, env=env), None
    progress(f"{launch.label}: {shlex.join(command)}")
    started = time.perf_counter()
    # the ranks' stdout goes to our stderr: stdout holds nothing but the tables
    completed = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=sys.stderr, env=child_env,
                               timeout=args.timeout, check=False)
    if completed.returncode != 0 or not result_path.exists():
        raise SystemExit(f"bench: {launch.label} failed (exit status {completed.returncode}); "
                         "its output is above")
    result = json.loads(result_path.read_text())
    result_path.unlink()
    result["oversubscribed"] = launch.ranks > available_cores()
    launch.results.append(result)
    launch.seconds.append(time.perf_counter() - started)
    if launch.variant == "dp-sweep":
        shown = ", ".join(f"{k} {result['steps_per_block'] / statistics.median(v):.2f}"
                          for k, v in result["block_seconds"].items()) + " steps/s"
    elif launch.variant == "resnet-sweep":
        shown = ", ".join(f"{k} {statistics.median(v['async']) * 1e3:.1f}"
                          for k, v in result["all_seconds"].items()) + " ms (async)"
    elif launch.kind == "mlp":
        shown = f"{result['steps_per_block'] / statistics.median(result['block_seconds']):.2f} steps/s"
    else:
        shown = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in result["seconds"].items())
    progress(f"{launch.label}: {shown} (launch took {launch.seconds[-1]:.0f} s)")


def _blocks(launch: Launch) -> list[float]:
    return [t for r in launch.results for t in r["block_seconds"]]


def steps_per_s(launch: Launch) -> float:
    return launch.results[0]["steps_per_block"] / statistics.median(_blocks(launch))


def _cpu_cores(launch: Launch) -> float:
    return statistics.median(c / t for r in launch.results
                             for c, t in zip(r["cpu_seconds"], r["block_seconds"]))


def _other_cpu(launch: Launch) -> float:
    return statistics.median(v for r in launch.results for v in r["other_thread_cpu_seconds"])


def _phases_ms(launch: Launch) -> dict[str, float]:
    """Median over blocks of each phase per step (ms); ring/first_start/tail absent without engine."""
    phases = [p for r in launch.results for p in r["phase_seconds"]]
    medians = {name: statistics.median(p[i] for p in phases) * 1e3 for i, name in enumerate(PHASES)
               if i < len(phases[0])}
    if not medians.get("ring"):
        for name in ("ring", "first_start", "tail"):
            medians.pop(name, None)
    return medians


def _resnet_median(launch: Launch, name: str) -> float:
    return statistics.median(t for r in launch.results for t in r["all_seconds"][name])


def mlp_rows(launches: list[Launch], args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    mlp = [launch for launch in launches if launch.kind == "mlp"]
    reference = next((launch for launch in mlp if launch.variant == "single"), None)
    base = steps_per_s(reference) if reference else None
    header = ["variant", "ranks", "steps/s", "ms/step", "× one process", "target", "fwd+bwd ms", "step() ms",
              "engine ring ms", "first bucket at ms", "last bucket after bwd ms", "engine cycles / buckets (helped)",
              "CPU cores used", "other threads' CPU ms", "loss step 1", "loss last step"]
    rows = []
    for launch in mlp:
        rate = steps_per_s(launch)
        phase = _phases_ms(launch)
        first = launch.results[0]
        if launch.variant == "grid":
            m = launch.micro_batches
            ranks = (f"{launch.ranks} = {args.stages} stages × {args.replicas} replicas, M={m} "
                     f"({args.batch // args.replicas // m} rows)")
        else:
            ranks = str(launch.ranks)
        if first.get("oversubscribed"):
            ranks += " (oversubscribed)"
        target = ""
        if launch.variant == "hybridpipe" and base:
            target = f"≥ {ISSUE['dp_target_ratio']:.1f}× ({ISSUE['dp_target_ratio'] * base:.2f} steps/s)"
        elif launch.variant == "grid":
            target = (f"≥ {ISSUE['grid_target_ratio'] * ISSUE['deepspeed_grid_steps']:.2f} steps/s "
                      f"(1.5 × DeepSpeed's {ISSUE['deepspeed_grid_steps']})")
        engine = first.get("engine_per_step")
        rows.append([MLP_LABELS[launch.variant], ranks, f"{rate:.2f}", f"{1e3 / rate:.0f}",
                     f"{rate / base:.2f}" if base else "n/a", target or "—", f"{phase['fwd_bwd']:.0f}",
                     f"{phase['step']:.1f}", *(f"{phase[k]:.1f}" if k in phase else "—"
                                               for k in ("ring", "first_start", "tail")),
                     f"{engine['cycles']:.0f} / {engine['buckets']:.0f} ({engine['helped']:.0f})" if engine else "—",
                     f"{_cpu_cores(launch):.2f}",
                     f"{max(0.0, _other_cpu(launch)) * 1e3:.0f}",
                     *((f"{first['first_loss']:.7f}", f"{launch.results[-1]['last_loss']:.7f}")
                       if launch.variant != "independent" else ("—", "— (no exchange)"))])
    return header, rows


def _rounds(launch: Launch, name: str) -> list[list[float]]:
    """The repetitions of ``name`` (interleaved with the other calls, repetition by repetition) in
    ``RESNET_ROUNDS`` consecutive rounds."""
    times = [t for r in launch.results for t in r["all_seconds"][name]]
    size = max(1, len(times) // RESNET_ROUNDS)
    return [times[i * size:(i + 1) * size] for i in range(min(RESNET_ROUNDS, len(times)))]


def resnet_rows(launches: list[Launch]) -> tuple[list[str], list[list[str]]]:
    header = ["n", "161 × allreduce_async_ ms", "161 × allreduce_async (out of place) ms", "out of place / in place",
              "grouped_allreduce_ ms", "mpi4py Allreduce × 161 ms",
              "Horovod (issue) ms", "target ms", "async / grouped",
              f"mpi4py × 161 / async (≥ 2 wanted; {RESNET_ROUNDS} rounds)", "submit loop ms",
              "first bucket starts ms",
              "last bucket ends ms", "cycles / buckets (helped) per run", "slow rounds: first / warm-up / timed runs",
              "memory floor ms (2 copies)", "mpi4py × 161 / floor (the most any allreduce reaches here)"]
    rows = []
    for launch in (launch for launch in launches if launch.kind == "resnet"):
        r = launch.results[0]
        n = r["n"]
        kinds = [k for k in ("async", "async_out", "grouped", "mpi4py") if k in r["all_seconds"]]
        seconds = {k: _resnet_median(launch, k) for k in kinds}
        cells = {k: f"{v * 1e3:.1f}" + ("" if all(x["correct"][k] for x in launch.results) else " WRONG")
                 for k, v in seconds.items()}
        breakdown = {k: statistics.median(v for x in launch.results for v in x["async_breakdown"][k])
                     for k in r["async_breakdown"]}
        timed = {k: [v for x in launch.results for v in x["async_stats_timed"][k]]
                 for k in r["async_stats_timed"]}
        first_run = sum(x["async_stats_first"]["slow_rounds"] for x in launch.results)
        warm = sum(s["slow_rounds"] for x in launch.results for s in x["async_stats_warmup"])
        slow_timed = sum(v for x in launch.results for v in x["async_stats_timed"]["slow_rounds"])
        label = str(n) + (" (oversubscribed)" if r.get("oversubscribed") else "")
        ratio = (statistics.median(out / inside for x in launch.results
                                   for out, inside in zip(x["all_seconds"]["async_out"], x["all_seconds"]["async"]))
                 if "async_out" in seconds else None)
        rows.append([label, cells["async"], cells.get("async_out", "—"),
                     "—" if ratio is None else f"{ratio:.2f}", cells["grouped"], cells["mpi4py"],
                     f"{ISSUE['horovod_resnet_ms'][n]:.0f}" if n in ISSUE["horovod_resnet_ms"] else "—",
                     f"≤ {ISSUE['resnet_target_ms'][n]:.0f}" if n in ISSUE["resnet_target_ms"] else "—",
                     f"{seconds['async'] / seconds['grouped']:.2f}",
                     format_ratio(*round_ratio(_rounds(launch, "mpi4py"), _rounds(launch, "async")), RESNET_ROUNDS),
                     f"{breakdown['submit_s'] * 1e3:.1f}", f"{breakdown['first_start_s'] * 1e3:.1f}",
                     f"{breakdown['last_finish_s'] * 1e3:.1f}",
                     (f"{statistics.median(timed['cycles']):.0f} / {statistics.median(timed['buckets']):.0f} "
                      f"({statistics.median(timed['helped']):.0f})"),
                     f"{first_run} / {warm} / {slow_timed}", *_floor_cells(launch)])
    return header, rows


def _floor_cells(launch: Launch) -> list[str]:
    """The memory floor (``MEMORY_FLOOR_COPIES`` times the median time of one copy of all the gradients,
    every rank copying at once) and the ratio to it of the 161 mpi4py calls, per round: no allreduce through
    shared memory can beat the mpi4py calls by more here."""
    if "copy" not in launch.results[0]["all_seconds"]:
        return ["—", "—"]
    floor = [[MEMORY_FLOOR_COPIES * t for t in times] for times in _rounds(launch, "copy")]
    return [f"{MEMORY_FLOOR_COPIES * _resnet_median(launch, 'copy') * 1e3:.1f}",
            format_ratio(*round_ratio(_rounds(launch, "mpi4py"), floor), RESNET_ROUNDS)]


def sweep_rows(sweep: list[Launch], args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    dp = next((launch for launch in sweep if launch.variant == "dp-sweep"), None)
    resnet = [launch for launch in sweep if launch.variant == "resnet-sweep"]
    header = ["setting"]
    if dp:
        header += [f"DP n={args.dp_ranks} steps/s", "× defaults", "step() ms", "engine ring ms",
                   "cycles / buckets per step"]
    for launch in resnet:
        header += [f"ResNet async n={launch.ranks} ms", "× defaults", "grouped ms"]
    rows = []
    settings = [BASELINE] + sweep_settings(args)

    def dp_rate(setting: str) -> float:
        blocks = [t for r in dp.results for t in r["block_seconds"][setting]]
        return dp.results[0]["steps_per_block"] / statistics.median(blocks)

    def resnet_ms(launch: Launch, setting: str, name: str) -> float:
        return statistics.median(t for r in launch.results for t in r["all_seconds"][setting][name]) * 1e3

    for setting in settings:
        row = [setting if setting != BASELINE else "none (defaults / environment)"]
        if dp:
            phases = [p for r in dp.results for p in r["phase_seconds"][setting]]
            engine = [e for r in dp.results for e in r["engine_per_step"][setting]]
            rate = dp_rate(setting)
            row += [f"{rate:.2f}", f"{rate / dp_rate(BASELINE):.2f}",
                    f"{statistics.median(p[1] for p in phases) * 1e3:.1f}",
                    f"{statistics.median(p[2] for p in phases) * 1e3:.1f}",
                    f"{statistics.median(e['cycles'] for e in engine):.0f} / "
                    f"{statistics.median(e['buckets'] for e in engine):.0f}"]
        for launch in resnet:
            value = resnet_ms(launch, setting, "async")
            row += [f"{value:.1f}", f"{value / resnet_ms(launch, BASELINE, 'async'):.2f}",
                    f"{resnet_ms(launch, setting, 'grouped'):.1f}"]
        rows.append(row)
    return header, rows


def report(main: list[Launch], sweep: list[Launch], args: argparse.Namespace, started: str,
           total_seconds: float) -> str:
    from hybridpipe.launch import available_cores

    command = command_line()
    everything = main + sweep
    info = next((r for launch in everything for r in launch.results if "describe" in r), {})
    torch_version = next((r["torch"] for launch in everything for r in launch.results if "torch" in r), "")
    setup = (f"{started}; {info.get('describe', '')}; torch {torch_version}; {available_cores()} CPU cores; "
             "one compute thread per process (torch.set_num_threads(1), OMP_NUM_THREADS=1); ranks above the "
             "core count "
             "oversubscribed with OMPI_MCA_mpi_yield_when_idle=1")
    if info:
        setup += (f"; engine cycle time {info.get('cycle_time_ms')} ms, fusion threshold "
                  f"{info.get('fusion_threshold_bytes', 0) / 2**20:g} MiB")
    md = args.markdown
    out = [f"Command: `{command}`  " if md else f"command: {command}",
           f"Setup: {setup}" + ("  " if md else ""), ""]
    if any(launch.kind == "mlp" for launch in main):
        out += [f"MLP: {args.layers} × (Linear({args.width}, {args.width}) + Tanh), MSE loss, SGD "
                f"lr {LEARNING_RATE}, global batch {args.batch} per step (data-parallel ranks / replicas "
                f"each take an equal shard); 2-D grid: 1F1B, M micro-batches per replica's "
                f"{args.batch // args.replicas} rows, uniform balance. {args.warmup} warm-up steps, then "
                f"{args.blocks} blocks × {args.steps} steps per launch, {args.rounds} round(s); steps/s from "
                "the median block (slowest rank after a barrier). fwd+bwd / step() = the slowest rank's "
                "split of a step (median over blocks). Issue's reference: Horovod DistributedOptimizer n=2 "
                f"{ISSUE['horovod_dp_steps']} steps/s, one thread {ISSUE['horovod_one_thread_steps']} "
                f"steps/s; DeepSpeed pipeline 2×2 {ISSUE['deepspeed_grid_steps']} steps/s.", ""]
        out += [render(*mlp_rows(main, args), md, left=2), ""]
    if any(launch.kind == "resnet" for launch in main):
        out += [f"ResNet-50 gradients (161 float32 tensors, 97.5 MiB), op sum, {RESNET_WARMUP} warm-up + "
                f"{args.repeats} timed repetitions, the three calls interleaved, each after a barrier; "
                "time = median of the max over ranks. Breakdown columns (async, max over ranks, median): "
                "the Python submit loop, when the first bucket's ring allreduce started and the last one "
                "ended (from the first submit); cycles / buckets = engine_stats('world') deltas per async "
                "run, (helped) = buckets run by the main thread waiting in handle.wait(); slow rounds = name "
                "gathers.", ""]
        out += [render(*resnet_rows(main), md, left=1), ""]
    if sweep:
        out += ["Engine settings, compared inside one job per column group (each setting alone; per block "
                "and setting: hp.init(config=...), warm-up, timed runs, hp.shutdown(); blocks rotate the "
                f"order). DP: {args.blocks} blocks × {args.steps} steps per setting and round; ResNet: "
                f"{max(1, args.repeats // args.blocks)} async runs (alternating with as many "
                f"grouped_allreduce_) per block; {args.rounds} round(s). × defaults: > 1 is faster for DP "
                "steps/s, < 1 is faster for ms:", "", render(*sweep_rows(sweep, args), md, left=1), ""]
    out.append(f"{'Whole run' if md else 'whole run'}: {total_seconds:.0f} s "
               f"(launches: {sum(sum(launch.seconds) for launch in everything):.0f} s).")
    return "\n".join(out)


def driver_main(args: argparse.Namespace) -> int:
    started_clock = time.perf_counter()
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    main, sweep = plan(args)
    if not main and not sweep:
        raise SystemExit("bench: nothing to run (--no-mlp and --no-resnet, or --sweep-only without a sweep)")
    with tempfile.TemporaryDirectory(prefix="hybridpipe-bench-") as folder:
        index = 0
        for round_ in range(args.rounds if main else 0):
            shift = round_ % len(main)
            for launch in main[shift:] + main[:shift]:
                run_launch(launch, args, Path(folder), index)
                index += 1
        for round_ in range(args.rounds if sweep else 0):
            shift = round_ % len(sweep)
            for launch in sweep[shift:] + sweep[:shift]:
                run_launch(launch, args, Path(folder), index)
                index += 1
    print(report(main, sweep, args, started, time.perf_counter() - started_clock))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp-ranks", type=int, default=2, help="MLP: data-parallel ranks (default 2)")
    parser.add_argument("--grid", default="2x2", help="MLP: stages x replicas of the 2-D run (default 2x2)")
    parser.add_argument("--micro-batches", default="8,4,2",
                        help="MLP 2-D run: micro-batches per replica, one launch each (default 8,4,2)")
    parser.add_argument("--batch", type=int, default=256,
                        help="MLP: global batch rows per step (default 256)")
    parser.add_argument("--width", type=int, default=1024, help="MLP: features per layer (default 1024)")
    parser.add_argument("--layers", type=int, default=16, help="MLP: Linear+Tanh layers (default 16)")
    parser.add_argument("--steps", type=int, default=5, help="MLP: steps per timed block (default 5)")
    parser.add_argument("--blocks", type=int, default=3, help="MLP: timed blocks per launch (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="MLP: untimed steps first (default 3)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="repeat the launches, order rotated (default 2)")
    parser.add_argument("--ranks", default="2,4,8", help="ResNet: rank counts (default 2,4,8)")
    parser.add_argument("--repeats", type=int, default=10, help="ResNet: timed repetitions (default 10)")
    parser.add_argument("--sweep-cycle-ms", default="",
                        help="also run with HYBRIDPIPE_CYCLE_TIME_MS set to each of these (e.g. 0.25,4)")
    parser.add_argument("--sweep-fusion", default="",
                        help="also compare HYBRIDPIPE_FUSION_THRESHOLD at each of these (e.g. 1MiB,16MiB)")
    parser.add_argument("--sweep-env", default="",
                        help="also compare each HYBRIDPIPE_NAME=VALUE of this comma-separated list "
                             "(one at a time; join several with +), e.g. HYBRIDPIPE_SEGMENT_BYTES=1MiB")
    parser.add_argument("--sweep-only", action="store_true", help="run only the engine-settings comparison")
    parser.add_argument("--no-ddp", action="store_true", help="leave out torch DDP")
    parser.add_argument("--no-grid", action="store_true", help="leave out the 2-D (pipeline × data) run")
    parser.add_argument("--no-mlp", action="store_true", help="leave out the MLP throughput benchmark")
    parser.add_argument("--no-resnet", action="store_true", help="leave out the ResNet-50 engine benchmark")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables (for docs/)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds allowed per launch (default 600)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default=BASELINE, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.ranks = int_list(args.ranks, "--ranks")
        args.micro_batches = int_list(args.micro_batches, "--micro-batches")
        stages, replicas = (int(v) for v in args.grid.lower().replace("×", "x").split("x"))
    except (argparse.ArgumentTypeError, ValueError) as error:
        parser.error(str(error) if isinstance(error, argparse.ArgumentTypeError)
                     else f"--grid needs STAGESxREPLICAS such as 2x2 (got {args.grid!r})")
    args.stages, args.replicas = stages, replicas
    args.sweep_cycle_ms = [v.strip() for v in args.sweep_cycle_ms.split(",") if v.strip()]
    args.sweep_fusion = [v.strip() for v in args.sweep_fusion.split(",") if v.strip()]
    args.sweep_env = [v.strip() for v in args.sweep_env.split(",") if v.strip()]
    for setting in args.sweep_env:
        if "=" not in setting or not setting.startswith("HYBRIDPIPE_"):
            parser.error(f"--sweep-env needs HYBRIDPIPE_NAME=VALUE entries (got {setting!r}); the sweep "
                         "changes hp.Config inside one job. For MPI settings, export them and run the "
                         "whole benchmark")
    args.settings = [v for v in args.settings.split(",") if v]
    if not args.worker:
        from hybridpipe.config import Config

        for setting in sweep_settings(args):
            try:
                Config.from_env(dict(part.split("=", 1) for part in setting.split("+")))
            except Exception as error:
                parser.error(str(error))
    for name in ("dp_ranks", "batch", "width", "layers", "steps", "blocks", "rounds", "repeats",
                 "stages", "replicas"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step's loss is reported)")
    for parts, what in ((args.dp_ranks, "--dp-ranks"), (args.replicas, "the grid's replicas")):
        if args.batch % parts:
            parser.error(f"--batch {args.batch} does not split into {parts} equal shards ({what})")
    for m in args.micro_batches:
        if (args.batch // args.replicas) % m:
            parser.error(f"a replica's {args.batch // args.replicas} rows do not split into {m} equal "
                         "micro-batches")
    if args.stages > args.layers:
        parser.error(f"--layers {args.layers} is fewer than the grid's {args.stages} stages")
    if args.worker and not (args.result and args.variant):
        parser.error("--worker needs --result and --variant")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--zero-memory" in argv:  # ZeRO × precision memory and step time: bench/zero_memory.py
        import zero_memory

        return zero_memory.main([a for a in argv if a != "--zero-memory"])
    args = parse_args(argv)
    return worker_main(args) if args.worker else driver_main(args)


if __name__ == "__main__":
    sys.exit(main())

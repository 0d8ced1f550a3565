"""Pipeline benchmark: hybridpipe's six schedules vs torch.distributed.pipelining vs one process.

Usage:
    python bench/pipeline.py [--stages 2,4] [--micro-batches 8] [--batch 256] [--width 1024]
                             [--layers 16] [--steps 5] [--blocks 3] [--rounds 1] [--no-torch]
                             [--no-sleep] [--pipeline-schedules gpipe,1f1b,...] [--busy-neighbours N]
                             [--markdown]

Run plainly, this script is the driver: it starts every variant in a fresh set of processes (a
plain subprocess for the one-process runs, ``mpirun -n P ... --worker`` for the pipelines; the
command comes from ``hybridpipe.launch.mpirun_command``), reads rank 0's JSON result from a
temporary file, and prints the tables. With ``--worker`` it is one rank of one variant.

Two benchmarks:

1. **MLP throughput.** ``--layers`` × (Linear(width, width) + Tanh), MSE loss, SGD, one global
   batch of ``--batch`` rows cut into ``--micro-batches`` micro-batches. Variants, all on the same
   model (layer ``i`` built under seed ``seed + i`` everywhere), the same batch and the same number
   of steps, one thread per process (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``):
     * one process, whole batch (the reference every ratio divides by);
     * one process, the same micro-batches with gradient accumulation (what a pipeline stage runs);
     * min(max P, cores) such one-process runs at once, independent (MPI only lines up their
       blocks): each core's speed when every core is busy, which sets the "ceiling" column —
       P·M/(M+P−1) (capped at the core count) times that per-core speed, over the reference;
     * for each P in ``--stages``: hybridpipe ``PipelineModel`` with each schedule of
       ``--pipeline-schedules`` (default all six: gpipe, 1f1b, interleaved-1f1b with v = 2 chunks per
       rank, zb-h1, and the asynchronous pipedream and 2bw, whose optimizer runs inside the
       pipeline; ``checkpoint="never"``, uniform balance) and ``torch.distributed.pipelining``'s
       counterparts (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
       ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``, the last two with v = 2
       stages per rank; gloo over loopback). torch has no asynchronous schedule.
   A step is forward + backward + ``optimizer.step()``. Each variant runs in its own launch, so
   its peak RSS (``ru_maxrss``) is its own and torch.distributed never shares a process with
   hybridpipe. The first- and last-step losses are reported: equal columns show the variants
   really trained the same model the same way.
2. **Framework overhead with a sleep-emulated model** (``--sleep-*``). Each layer's forward
   sleeps f ms and its backward b ms (a ``torch.autograd.Function``); the tensors are tiny (4
   rows per micro-batch, 16 features), so a stage's compute is known exactly and communication is
   negligible. Sleeping ranks need no CPU, so P=4 on 2 cores is fair here. A layer's backward
   sleeps half on its input's gradient path and half on its weight's, so zero-bubble schedules,
   which ask autograd for the two separately, sleep half in each pass. The "theory" step time is
   the schedule simulated from hybridpipe's schedule data with F and B (one stage's forward and
   backward per micro-batch; a chunk takes 1/v of them; W half of B); pipedream and 2bw never
   drain, so theirs is M·(F + B). The table gives measured / theory (1.00 = no framework overhead),
   the sleeps as actually slept (``time.sleep`` overshoots by tens of µs), the measured bubble
   1 − M·(F + B) slept / step time next to the theory's, and each bubble ÷ hybridpipe 1F1B's. The
   schedules of a framework share one launch, interleaved block by block. For GPipe and 1F1B the
   sleeps' timestamps (perf_counter,
   comparable between processes) give the framework's time per action: from the end of a stage's
   previous action to the first sleep of its next one, when the input was already there ("per
   action") or when it came last from the neighbour ("per hop"). About 2(M + P − 1) actions lie on
   the critical path, so measured − ideal ≈ 2(M + P − 1) × that time.

How it measures (a shared, noisy 2-core machine is the expected case, so it never asserts speed):
  * ``--warmup`` steps per schedule first, then ``--blocks`` blocks of ``--steps`` steps. Each
    block starts after an MPI barrier; its time is the slowest rank's. steps/s = steps / median
    block time (median over all blocks of all ``--rounds``).
  * ``--rounds`` repeats the whole set of launches, the launch order rotated each round, so slow
    phases of the machine do not all fall on one variant.
  * Peak RSS = ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at the end of the launch, per rank
    (MiB); the table shows the largest rank and every rank. "after imports" is the same figure
    taken after torch, MPI and the process group are up but before the model is built.
  * "CPU cores used" = CPU seconds of all ranks (all threads) per second of wall time: how much of
    the machine a variant takes, busy-waiting included.
  * Ranks beyond the available cores run oversubscribed with OMPI_MCA_mpi_yield_when_idle=1.
  * ``--busy-neighbours N`` runs N busy-looping processes beside every launch (a shared machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
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

from _common import command_line, int_list, progress, render, run_worker, start_gloo  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "pipedream", "2bw")
ASYNCHRONOUS = ("pipedream", "2bw")
VIRTUAL_STAGES = 2  # interleaved-1f1b, and torch's interleaved schedules
# torch.distributed.pipelining's schedule for each of ours (None: it has none)
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble", "pipedream": None, "2bw": None}
SEED = 1234
DATA_SEED = 99
LEARNING_RATE = 0.01
SLEEP_WIDTH, SLEEP_ROWS_PER_MICRO_BATCH = 16, 4


def peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


# ------------------------------------------------------------------------------------------ worker

class Worker:
    """One process of one variant. Subclasses set ``self.step_fns`` (schedule -> one training step
    returning the loss or None) and ``barrier`` / ``gather`` for their process group."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch, self.args = torch, args
        from _pipeline_models import layer_class_and_args, make_batch, uniform_balance

        self.layer_cls, self.layer_args = layer_class_and_args(args.model, args.width, *args.sleep_ms)
        self.inputs, self.targets = make_batch(args.batch, args.width, DATA_SEED)
        self.balance = uniform_balance(args.layers, args.stages)
        self.rank, self.size = 0, 1
        self.step_fns: dict[str, Callable[[], float | None]] = {}

    def start_profiles(self) -> None:
        """After the warm-up: begin the executor profiles (``--profile-executor``; hybridpipe only)."""

    def profiles(self) -> dict[str, Any]:
        """Each schedule's executor profile per rank (``--profile-executor``; hybridpipe only)."""
        return {}

    # process-group hooks (one process: trivial)
    def barrier(self) -> None:
        pass

    def allreduce_max(self, values: list[float]) -> list[float]:
        return values

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def loss_to_rank0(self, loss: float | None) -> float | None:
        return loss

    def close(self) -> None:
        pass

    def run(self) -> dict[str, Any]:
        from _pipeline_models import SleepClock, action_gaps

        args = self.args
        rss_start = peak_rss_kib()
        self.build()
        if args.model == "sleep":
            SleepClock.layers = self.balance[min(self.rank, len(self.balance) - 1)]
        names = list(self.step_fns)
        first_loss: dict[str, float | None] = {}
        last_loss: dict[str, float | None] = {}
        for name in names:
            for index in range(args.warmup):
                loss = self.step_fns[name]()
                if index == 0:
                    first_loss[name] = loss
        self.start_profiles()
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        sleeps: dict[str, dict[str, float]] = {name: {"forward_s": 0.0, "forward_calls": 0, "backward_s": 0.0,
                                                      "backward_calls": 0} for name in names}
        events: dict[str, list] = {name: [] for name in names}
        clock = time.perf_counter
        for block in range(args.blocks):
            shift = block % len(names)
            for name in names[shift:] + names[:shift]:
                step = self.step_fns[name]
                SleepClock.reset()
                SleepClock.events = events[name] if args.model == "sleep" else None
                self.barrier()
                start, cpu_start = clock(), time.process_time()
                for _ in range(args.steps):
                    SleepClock.new_step()
                    loss = step()
                times[name].append(clock() - start)
                cpu[name].append(time.process_time() - cpu_start)
                SleepClock.events = None
                for key, value in SleepClock.snapshot().items():
                    sleeps[name][key] += value
                last_loss[name] = loss
                if args.warmup == 0 and name not in first_loss:
                    first_loss[name] = loss
        flat = self.allreduce_max([t for name in names for t in times[name]])
        block_seconds = {name: flat[i * args.blocks:(i + 1) * args.blocks] for i, name in enumerate(names)}
        cpu_total = [sum(column) for column in zip(*self.gather([t for name in names for t in cpu[name]]))]
        cpu_seconds = {name: cpu_total[i * args.blocks:(i + 1) * args.blocks] for i, name in enumerate(names)}
        rss_peak = peak_rss_kib()
        result = {
            "variant": args.variant, "model": args.model, "stages": args.stages, "balance": self.balance,
            "steps_per_block": args.steps,
            "schedules": {name: {"block_seconds": block_seconds[name], "cpu_seconds": cpu_seconds[name],
                                 "first_loss": self.loss_to_rank0(first_loss.get(name)),
                                 "last_loss": self.loss_to_rank0(last_loss.get(name)),
                                 "sleep_per_rank": self.gather(sleeps[name]),
                                 "gaps": (action_gaps(self.gather(events[name]))
                                          if args.model == "sleep" and name in ("gpipe", "1f1b") else {})}
                          for name in names},
            "rss_start_kib": self.gather(rss_start),
            "rss_peak_kib": self.gather(rss_peak),
            "executor_profile": self.profiles(),
        }
        result.update(self.describe())
        return result

    def build(self) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"torch": self.torch.__version__}


class SingleWorker(Worker):
    """One process, one thread: the whole model, whole batch or accumulated micro-batches."""

    def build(self) -> None:
        torch, args = self.torch, self.args
        from torch import nn

        from _pipeline_models import build_layer

        model = nn.Sequential(*[build_layer(i, SEED, self.layer_cls, self.layer_args)
                                for i in range(args.layers)])
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        loss_fn = nn.MSELoss()
        x, y = self.inputs, self.targets
        if args.variant == "single":  # whole batch at once
            def step() -> float:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                return float(loss.detach())
        else:  # single-micro(-copies): gradient accumulation over the pipeline's micro-batches
            xs, ys = torch.tensor_split(x, args.micro_batches), torch.tensor_split(y, args.micro_batches)
            weights = [len(c) / len(x) for c in ys]

            def step() -> float:
                optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for xc, yc, w in zip(xs, ys, weights):
                    loss = loss_fn(model(xc), yc) * w
                    loss.backward()
                    total += float(loss.detach())
                optimizer.step()
                return total
        self.step_fns = {"-": step}


class AloneWorker(Worker):
    """The machine's ceiling for the sleep model: one process runs the actions of one pipeline rank (the last
    stage's layers and the loss) for each schedule, back to back, with no communication and no other rank: per
    micro-batch the forward of each of the rank's chunks (interleaved: v, each its own call on a detached
    input, as between ranks), then the backward chunk by chunk (zb-h1: the input-gradient pass and the
    weight-gradient pass as two autograd calls), and the SGD step after every micro-batch (pipedream) or once
    per step (the others). What that costs beyond the sleeps is what torch and this machine charge per action;
    no pipeline can take less."""

    def build(self) -> None:
        torch, args = self.torch, self.args
        from torch import nn

        from _pipeline_models import build_layer

        per_stage = self.balance[-1]
        first = args.layers - per_stage
        xs = torch.tensor_split(self.inputs, args.micro_batches)
        ys = torch.tensor_split(self.targets, args.micro_batches)
        loss_fn = nn.MSELoss()
        for schedule in args.schedules:
            chunks = VIRTUAL_STAGES if schedule == "interleaved-1f1b" else 1
            layers = [build_layer(first + i, SEED, self.layer_cls, self.layer_args) for i in range(per_stage)]
            size = per_stage // chunks
            parts = [nn.Sequential(*layers[c * size:(c + 1) * size if c < chunks - 1 else per_stage])
                     for c in range(chunks)]
            optimizer = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=LEARNING_RATE)

            def step(parts: list = parts, optimizer: Any = optimizer, schedule: str = schedule) -> float:
                total = 0.0
                for x, y in zip(xs, ys):
                    inputs, outputs, layer_outputs = [], [], []
                    value = x
                    for part in parts:
                        value = value.detach().requires_grad_(True)
                        inputs.append(value)
                        layer_outputs.append([])
                        for layer in part:
                            value = layer(value)
                            layer_outputs[-1].append(value)
                        outputs.append(value)
                    loss = loss_fn(value, y) / len(xs)
                    total += float(loss.detach())
                    grad = None
                    for index in reversed(range(len(parts))):
                        out = loss if grad is None else outputs[index]
                        if schedule == "zb-h1":  # I: input gradients only; W: each layer's weight from its output
                            inner = layer_outputs[index][:-1]
                            found = torch.autograd.grad(out, [inputs[index], *inner], grad, retain_graph=True)
                            grads = [*found[1:], grad if grad is not None else
                                     torch.autograd.grad(out, layer_outputs[index][-1], retain_graph=True)[0]]
                            for layer, layer_out, g in zip(parts[index], layer_outputs[index], grads):
                                params = list(layer.parameters())
                                for parameter, w in zip(params, torch.autograd.grad(layer_out, params, g,
                                                                                     retain_graph=True)):
                                    parameter.grad = w if parameter.grad is None else parameter.grad + w
                            grad_in = found[0]
                        else:
                            out.backward(grad)
                            grad_in = inputs[index].grad
                        grad = grad_in
                    if schedule == "pipedream":
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                if schedule != "pipedream":
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                return total
            self.step_fns[schedule] = step


class MPIWorker(Worker):
    def __init__(self, args: argparse.Namespace) -> None:
        from mpi4py import MPI

        super().__init__(args)
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        if self.size != args.stages:
            raise SystemExit(f"bench worker: started on {self.size} ranks for {args.stages} stages")

    def barrier(self) -> None:
        self.comm.Barrier()

    def allreduce_max(self, values: list[float]) -> list[float]:
        return [max(column) for column in zip(*self.comm.allgather(values))]

    def gather(self, value: Any) -> list[Any]:
        return self.comm.allgather(value)

    def loss_to_rank0(self, loss: float | None) -> float | None:
        # the last stage always knows the loss (hybridpipe gives it to every stage anyway)
        return self.comm.bcast(loss, root=self.size - 1)


class ConcurrentCopiesWorker(MPIWorker):
    """One of several independent one-process runs at once (one per core): what the cores deliver
    together when nothing is shared but the machine (memory bandwidth, caches). MPI only lines up
    the blocks."""

    build = SingleWorker.build


class HybridpipeWorker(MPIWorker):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        import hybridpipe as hp

        self.hp = hp
        self.grid = hp.init(pipeline_stages=args.stages)
        self.models: list[Any] = []
        self.by_schedule: dict[str, Any] = {}

    def start_profiles(self) -> None:
        if self.args.profile_executor:
            for model in self.by_schedule.values():
                model.profile_executor()

    def profiles(self) -> dict[str, Any]:
        if not self.args.profile_executor:
            return {}
        return {schedule: self.gather({"rows": model.executor_profile.rows(),
                                       "between_ms": model.executor_profile.progress * 1e3 / max(
                                           model.executor_profile.steps, 1),
                                       "after_ms": model.executor_profile.tail * 1e3 / max(
                                           model.executor_profile.steps, 1)})
                for schedule, model in self.by_schedule.items()}

    def build(self) -> None:
        torch, args, hp = self.torch, self.args, self.hp
        from torch import nn

        from _pipeline_models import uniform_balance

        specs = [hp.LayerSpec(self.layer_cls, *self.layer_args) for _ in range(args.layers)]
        for schedule in args.schedules:
            if schedule in ASYNCHRONOUS:  # the pipeline applies the optimizer itself, never flushing
                model = hp.PipelineModel(specs, loss_fn=nn.MSELoss(), micro_batches=args.micro_batches,
                                         balance=self.balance, schedule=schedule, checkpoint="never",
                                         seed_layers=SEED, optimizer=lambda p: torch.optim.SGD(p, lr=LEARNING_RATE))
                self.models.append(model)
                self.by_schedule[schedule] = model
                self.step_fns[schedule] = lambda model=model: model.train_step(self.inputs, self.targets)
                continue
            chunks = {"virtual_stages": VIRTUAL_STAGES} if schedule == "interleaved-1f1b" else {}
            balance = uniform_balance(args.layers, args.stages * VIRTUAL_STAGES) if chunks else self.balance
            model = hp.PipelineModel(specs, loss_fn=nn.MSELoss(), micro_batches=args.micro_batches,
                                     balance=balance, schedule=schedule, checkpoint="never",
                                     seed_layers=SEED, **chunks)
            optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
            self.models.append(model)
            self.by_schedule[schedule] = model

            def step(model: Any = model, optimizer: Any = optimizer) -> float:
                optimizer.zero_grad(set_to_none=True)
                loss = model.train_step(self.inputs, self.targets)
                optimizer.step()
                return loss
            self.step_fns[schedule] = step

    def describe(self) -> dict[str, Any]:
        from hybridpipe._ext import describe

        return {"torch": self.torch.__version__, "describe": describe(), "hop_seconds": self.hop_seconds()}

    def hop_seconds(self, repeats: int = 200) -> dict[str, float]:
        """One-way time of a 64-byte message between ranks 0 and 1, medians of ping-pongs: through MPI
        directly (mpi4py on this thread) and through hybridpipe's pipeline path (hybridpipe.comm.p2p after
        hp.init), while the other ranks wait in a barrier. The latter is what each
        transfer on a schedule's critical path costs here."""
        from hybridpipe.comm import p2p
        from hybridpipe.comm.engine import call

        torch = self.torch
        buffer = torch.zeros(16)
        raw = self.comm.Dup()
        ours = call(None, "bench", self.grid.world_comm.Dup)
        times: dict[str, list[float]] = {"mpi": [], "hybridpipe": []}
        for name in times:
            self.comm.Barrier()
            for run in range(repeats + 20):
                start = time.perf_counter()
                if self.rank == 0 and name == "mpi":
                    raw.Send(buffer.numpy(), 1, 0)
                    raw.Recv(buffer.numpy(), 1, 1)
                elif self.rank == 1 and name == "mpi":
                    raw.Recv(buffer.numpy(), 0, 0)
                    raw.Send(buffer.numpy(), 0, 1)
                elif self.rank == 0:
                    p2p.send(buffer, 1, 0, ours)
                    p2p.Receive(1, 2, ours).wait()
                elif self.rank == 1:
                    p2p.Receive(0, 0, ours).wait()
                    p2p.send(buffer, 0, 2, ours)
                else:
                    break
                if run >= 20:
                    times[name].append((time.perf_counter() - start) / 2)
        self.comm.Barrier()
        raw.Free()
        call(None, "bench", ours.Free)
        return {name: statistics.median(values) for name, values in times.items() if values}

    def close(self) -> None:
        for model in self.models:
            model.close()
        self.hp.shutdown()


class TorchPipeliningWorker(MPIWorker):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.dist, self.store = start_gloo(self.comm)

    def build(self) -> None:
        torch, args = self.torch, self.args
        from torch import nn
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        from _pipeline_models import build_layer, stage_range, uniform_balance

        first, last = self.rank == 0, self.rank == self.size - 1
        for schedule in args.schedules:
            cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
            looped = schedule in ("interleaved-1f1b", "zb-h1")  # torch's: v stages per rank, chunk r + k·P
            parts = self.size * VIRTUAL_STAGES if looped else self.size
            balance = uniform_balance(args.layers, parts)
            indices = range(self.rank, parts, self.size) if looped else [self.rank]
            submodules = [nn.Sequential(*[build_layer(i, SEED, self.layer_cls, self.layer_args)
                                          for i in stage_range(balance, index)]) for index in indices]
            stages = [PipelineStage(m, index, parts, torch.device("cpu")) for m, index in zip(submodules, indices)]
            runner = cls(stages if looped else stages[0], args.micro_batches, loss_fn=nn.MSELoss())
            optimizer = torch.optim.SGD([p for m in submodules for p in m.parameters()], lr=LEARNING_RATE)

            def step(runner: Any = runner, optimizer: Any = optimizer) -> float | None:
                optimizer.zero_grad(set_to_none=True)
                loss = None
                if first:
                    runner.step(self.inputs)
                elif last:
                    losses: list = []
                    runner.step(target=self.targets, losses=losses)
                    loss = float(torch.stack([value.detach() for value in losses]).mean())
                else:
                    runner.step()
                optimizer.step()
                return loss
            self.step_fns[schedule] = step

    def close(self) -> None:
        self.comm.Barrier()
        self.dist.destroy_process_group()


def worker_main(args: argparse.Namespace) -> int:
    worker_class = {"single": SingleWorker, "single-micro": SingleWorker, "alone": AloneWorker,
                    "single-micro-copies": ConcurrentCopiesWorker, "hybridpipe": HybridpipeWorker,
                    "torch": TorchPipeliningWorker}[args.variant]
    return run_worker(worker_class(args), args.result)


# ------------------------------------------------------------------------------------------ driver

@dataclass
class Launch:
    """One set of fresh processes running one variant (one or several schedules)."""

    model: str
    variant: str
    stages: int
    schedules: list[str]
    micro_batches: int
    batch: int
    width: int
    layers: int
    results: list[dict[str, Any]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.model} {self.variant} P={self.stages} {'+'.join(self.schedules)}"


def plan(args: argparse.Namespace) -> list[Launch]:
    from hybridpipe.launch import available_cores

    launches = []
    if not args.no_mlp:
        mlp = dict(micro_batches=args.micro_batches, batch=args.batch, width=args.width, layers=args.layers)
        launches.append(Launch("mlp", "single", 1, ["-"], **mlp))
        launches.append(Launch("mlp", "single-micro", 1, ["-"], **mlp))
        copies = min(max(args.stages), available_cores())
        if copies > 1:
            launches.append(Launch("mlp", "single-micro-copies", copies, ["-"], **mlp))
        for p in args.stages:
            for variant in ("hybridpipe",) + (() if args.no_torch else ("torch",)):
                for schedule in variant_schedules(variant, args):
                    launches.append(Launch("mlp", variant, p, [schedule], **mlp))
    if not args.no_sleep:
        m, p = args.sleep_micro_batches, args.sleep_stages
        sleep = dict(micro_batches=m, batch=SLEEP_ROWS_PER_MICRO_BATCH * m, width=SLEEP_WIDTH,
                     layers=args.sleep_layers or VIRTUAL_STAGES * p)
        for variant in ("hybridpipe",) + (() if args.no_torch else ("torch",)):
            launches.append(Launch("sleep", variant, p, variant_schedules(variant, args), **sleep))
        launches.append(Launch("sleep", "alone", p, variant_schedules("hybridpipe", args), **sleep))
    return launches


def variant_schedules(variant: str, args: argparse.Namespace) -> list[str]:
    """The schedules (our names) a framework runs: ours all of --pipeline-schedules, torch the ones it has."""
    return [s for s in args.pipeline_schedules if variant == "hybridpipe" or TORCH_SCHEDULES[s] is not None]


def run_launch(launch: Launch, args: argparse.Namespace, folder: Path, index: int) -> None:
    from hybridpipe.launch import available_cores, mpirun_command

    result_path = folder / f"result-{index}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result_path),
            "--variant", launch.variant, "--model", launch.model, "--stages", str(launch.stages),
            "--schedules", ",".join(launch.schedules), "--micro-batches", str(launch.micro_batches),
            "--batch", str(launch.batch), "--width", str(launch.width), "--layers", str(launch.layers),
            "--steps", str(args.steps), "--blocks", str(args.blocks), "--warmup", str(args.warmup),
            "--sleep-ms", ",".join(str(v) for v in args.sleep_ms)] + (
        ["--profile-executor"] if args.profile_executor else [])
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.update({k: v for k, v in os.environ.items()
                if k.startswith("HYBRIDPIPE_") and k != "HYBRIDPIPE_MPIRUN"})
    if launch.variant in ("single", "single-micro", "alone"):
        command = argv
        child_env = {**os.environ, **env}
    else:
        if launch.stages > available_cores():
            env["OMPI_MCA_mpi_yield_when_idle"] = "1"
        command = mpirun_command(launch.stages, argv, env=env)
        child_env = None
    progress(f"{launch.label}: {shlex.join(command)}")
    started = time.perf_counter()
    neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
                  for _ in range(args.busy_neighbours)]
    try:
        completed = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=sys.stderr, env=child_env,
                                   timeout=args.timeout, check=False)
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    if completed.returncode != 0 or not result_path.exists():
        raise SystemExit(f"bench: {launch.label} failed (exit status {completed.returncode}); "
                         "its output is above")
    result = json.loads(result_path.read_text())
    result_path.unlink()
    launch.results.append(result)
    launch.seconds.append(time.perf_counter() - started)
    steps = result["steps_per_block"]
    shown = ", ".join(f"{name} {steps / statistics.median(blocks):.2f} steps/s "
                      f"(blocks {steps / max(blocks):.2f}..{steps / min(blocks):.2f})"
                      for name in launch.schedules
                      for blocks in [result["schedules"][name]["block_seconds"]])
    progress(f"{launch.label}: {shown} (launch took {launch.seconds[-1]:.0f} s)")


def _blocks(launch: Launch, schedule: str) -> list[float]:
    return [t for r in launch.results for t in r["schedules"][schedule]["block_seconds"]]


def _step_seconds(launch: Launch, schedule: str) -> float:
    steps = launch.results[0]["steps_per_block"]
    return statistics.median(_blocks(launch, schedule)) / steps


def _steps_per_s(launch: Launch, schedule: str) -> float:
    """Global-batch steps per second; concurrent independent copies count together."""
    copies = launch.stages if launch.variant == "single-micro-copies" else 1
    return copies / _step_seconds(launch, schedule)


def _rate_range(launch: Launch, schedule: str) -> str:
    copies = launch.stages if launch.variant == "single-micro-copies" else 1
    steps = launch.results[0]["steps_per_block"]
    blocks = _blocks(launch, schedule)
    return f"{copies * steps / max(blocks):.2f}–{copies * steps / min(blocks):.2f}"


def _cpu_cores(launch: Launch, schedule: str) -> float:
    """CPU seconds of all ranks (all their threads) per second of wall time, median over blocks."""
    return statistics.median(c / t for r in launch.results
                             for c, t in zip(r["schedules"][schedule]["cpu_seconds"],
                                             r["schedules"][schedule]["block_seconds"]))


def _mib(kib: float) -> float:
    return kib / 1024.0


def _rss(launch: Launch, key: str) -> list[float]:
    """Per rank, the largest value over the launch's rounds (MiB)."""
    per_round = [r[key] for r in launch.results]
    return [_mib(max(values)) for values in zip(*per_round)]


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.6f}"


VARIANT_LABELS = {"single": "one process, whole batch",
                  "single-micro": "one process, M micro-batches (accumulated)",
                  "single-micro-copies": "independent one-process copies at once, M micro-batches (together)",
                  "hybridpipe": "hybridpipe", "torch": "torch.distributed.pipelining",
                  "alone": "one rank's actions alone (no communication)"}


def mlp_rows(launches: list[Launch], args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    from hybridpipe.launch import available_cores

    cores = available_cores()
    mlp = [launch for launch in launches if launch.model == "mlp"]
    reference = next((launch for launch in mlp if launch.variant == "single"), None)
    reference_rate = _steps_per_s(reference, "-") if reference else None
    copies = next((launch for launch in mlp if launch.variant == "single-micro-copies"), None)
    per_core = _steps_per_s(copies, "-") / copies.stages if copies else None
    header = ["variant", "P", "schedule", "steps/s", "blocks min–max", "ms/step", "× one process", "ideal ×",
              "ceiling × here", "CPU cores used",
              "peak RSS MiB (max rank)", "per rank", "after imports (max rank)", "loss step 1",
              "loss last step"]
    rows = []
    for launch in mlp:
        for schedule in launch.schedules:
            rate = _steps_per_s(launch, schedule)
            p, m = launch.stages, launch.micro_batches
            pipeline = launch.variant in ("hybridpipe", "torch")
            ideal = f"{min(p * m / (m + p - 1), cores):.2f}" if pipeline else "-"
            # the same, but with each core's speed on micro-batches as measured by the concurrent copies
            ceiling = (f"{min(p * m / (m + p - 1), cores) * per_core / reference_rate:.2f}"
                       if pipeline and per_core and reference_rate else "-")
            peak, start = _rss(launch, "rss_peak_kib"), _rss(launch, "rss_start_kib")
            first = launch.results[0]["schedules"][schedule]
            rows.append([VARIANT_LABELS[launch.variant], str(p), schedule,
                         f"{rate:.2f}", _rate_range(launch, schedule), f"{1e3 / rate:.0f}",
                         f"{rate / reference_rate:.2f}" if reference_rate else "n/a", ideal, ceiling,
                         f"{_cpu_cores(launch, schedule):.2f}",
                         f"{max(peak):.0f}", " / ".join(f"{v:.0f}" for v in peak), f"{max(start):.0f}",
                         _loss(first["first_loss"]),
                         _loss(launch.results[-1]["schedules"][schedule]["last_loss"])])
    return header, rows


def _gap(launch: Launch, schedule: str, kind: str) -> str:
    values = [g for r in launch.results for g in r["schedules"][schedule].get("gaps", {}).get(kind, [])]
    return f"{statistics.median(values) * 1e3:.3f}" if values else "n/a"


def _ratio(measured: float, ideal: float) -> str:
    return f"{measured / ideal:.3f}" if ideal > 0 else "n/a"


def _theory_ms(schedule: str, p: int, m: int, f_ms: float, b_ms: float, hop_ms: float = 0.0) -> float:
    """A step of ``schedule`` on an ideal machine (free framework; each transfer between ranks takes
    ``hop_ms``), from the schedule data: F and B are one stage's forward and backward per
    micro-batch; a chunk of an interleaved schedule takes 1/v of them; a W half of B. The
    asynchronous schedules are timed in steady state (their step once the pipeline is full)."""
    from hybridpipe.pipeline import schedule as sched

    chunks = VIRTUAL_STAGES if schedule == "interleaved-1f1b" else 1
    times = dict(forward_time=f_ms / chunks, backward_time=b_ms / chunks, transfer_time=hop_ms)
    if schedule in ASYNCHRONOUS:
        one = sched.simulate(sched.async_schedule(schedule, p, m, steps=1, flush=False), **times).makespan
        four = sched.simulate(sched.async_schedule(schedule, p, m, steps=4, flush=False), **times).makespan
        return (four - one) / 3
    return sched.simulate(sched.get_schedule(schedule, p, m, chunks), **times).makespan


def _slept_ms(launch: Launch, schedule: str) -> float:
    """M·(F+B) as the sleeps actually lasted (time.sleep overshoots): the busiest stage's sleep per step."""
    per_step = []
    for result in launch.results:
        steps = len(result["schedules"][schedule]["block_seconds"]) * result["steps_per_block"]
        per_step.append(max(rank["forward_s"] + rank["backward_s"]
                            for rank in result["schedules"][schedule]["sleep_per_rank"]) / steps * 1e3)
    return statistics.mean(per_step)


def _hop_ms(launches: list[Launch], kind: str) -> float | None:
    """The median one-way 64-byte hop (ms) measured in the hybridpipe launches ("mpi" or "hybridpipe")."""
    values = [r["hop_seconds"][kind] for launch in launches if launch.variant == "hybridpipe"
              for r in launch.results if kind in r.get("hop_seconds", {})]
    return statistics.median(values) * 1e3 if values else None


def sleep_rows(launches: list[Launch], args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    header = ["framework", "P", "M", "schedule", "ms/step", "theory ms", "measured / theory", "M·(F+B) slept ms",
              "measured / M·(F+B) slept", "bubble measured", "bubble theory", "bubble ÷ hybridpipe 1F1B's",
              "theory with hybridpipe's hop ms", "measured / that", "machine ceiling ms", "measured / ceiling",
              "ceiling / M·(F+B)", "ceiling bubble ÷ ceiling 1F1B's",
              "ms per action, input ready (median)", "ms per hop (median)", "CPU cores used"]
    rows = []
    sleep = [launch for launch in launches if launch.model == "sleep"]
    reference = next((x for x in sleep if x.variant == "hybridpipe" and "1f1b" in x.schedules), None)
    one_f_bubble = (1 - _slept_ms(reference, "1f1b") / (_step_seconds(reference, "1f1b") * 1e3)) if reference else None
    alone = next((x for x in sleep if x.variant == "alone"), None)

    def ceiling(schedule: str, p: int, m: int, f_ms: float, b_ms: float) -> tuple[float, float] | None:
        """The step on this machine with a free network and framework: the schedule's theory with every
        action as slow as it is in one process alone (theory × alone ms / M·(F+B)), and its bubble."""
        if alone is None or schedule not in alone.schedules:
            return None
        alone_ms = _step_seconds(alone, schedule) * 1e3
        step = _theory_ms(schedule, p, m, f_ms, b_ms) * alone_ms / (m * (f_ms + b_ms))
        return step, 1 - _slept_ms(alone, schedule) / step

    for launch in sleep:
        p, m = launch.stages, launch.micro_batches
        per_stage = launch.layers / p
        f_ms, b_ms = (v * per_stage for v in args.sleep_ms)
        base = ceiling("1f1b", p, m, f_ms, b_ms)
        for schedule in launch.schedules:
            step_ms = _step_seconds(launch, schedule) * 1e3
            theory = _theory_ms(schedule, p, m, f_ms, b_ms)
            slept = _slept_ms(launch, schedule)
            bubble = 1 - slept / step_ms
            hop = _hop_ms(sleep, "hybridpipe")
            with_hop = _theory_ms(schedule, p, m, f_ms, b_ms, hop) if hop is not None else None
            top = ceiling(schedule, p, m, f_ms, b_ms)
            alone_row = launch.variant == "alone"
            rows.append([VARIANT_LABELS[launch.variant], str(p), str(m), schedule, f"{step_ms:.1f}",
                         f"{theory:.1f}", _ratio(step_ms, theory), f"{slept:.1f}", _ratio(step_ms, slept),
                         "n/a" if alone_row else f"{bubble:.3f}", f"{1 - m * (f_ms + b_ms) / theory:.3f}",
                         f"{bubble / one_f_bubble:.2f}" if one_f_bubble and not alone_row else "n/a",
                         f"{with_hop:.1f}" if with_hop and not alone_row else "n/a",
                         _ratio(step_ms, with_hop) if with_hop and not alone_row else "n/a",
                         f"{top[0]:.1f}" if top else "n/a", _ratio(step_ms, top[0]) if top and not alone_row else "n/a",
                         _ratio(top[0], m * (f_ms + b_ms)) if top else "n/a",
                         f"{top[1] / base[1]:.2f}" if top and base and base[1] > 0 and schedule not in ASYNCHRONOUS
                         else "n/a",
                         _gap(launch, schedule, "local"), _gap(launch, schedule, "hop"),
                         f"{_cpu_cores(launch, schedule):.2f}"])
    return header, rows


def profile_rows(launches: list[Launch]) -> tuple[list[str], list[list[str]]]:
    """The executor profiles of hybridpipe's launches: per (launch, schedule, action kind) the ranks' mean."""
    header = ["model", "P", "schedule", "action", "per step", "ms each", "wait", "send", "compute", "python",
              "wait cpu"]
    rows = []
    for launch in launches:
        for result in launch.results[-1:]:
            for schedule, ranks in result.get("executor_profile", {}).items():
                kinds = sorted({row["kind"] for rank in ranks for row in rank["rows"]})
                for kind in kinds:
                    mine = [row for rank in ranks for row in rank["rows"] if row["kind"] == kind]
                    mean = {key: statistics.mean(row[key] for row in mine) for key in mine[0] if key != "kind"}
                    rows.append([launch.model, str(launch.stages), schedule, kind, f"{mean['actions_per_step']:.1f}",
                                 f"{mean['ms_per_action']:.3f}", f"{mean['wait_ms']:.3f}", f"{mean['send_ms']:.3f}",
                                 f"{mean['compute_ms']:.3f}", f"{mean['python_ms']:.3f}",
                                 f"{mean['wait_cpu_ms']:.3f}"])
                for key, label in (("between_ms", "between actions"), ("after_ms", "after the last")):
                    rows.append([launch.model, str(launch.stages), schedule, label, "",
                                 f"{statistics.mean(rank[key] for rank in ranks):.3f}", "", "", "", "", ""])
    return header, rows


def report(launches: list[Launch], args: argparse.Namespace, started: str, total_seconds: float) -> str:
    from hybridpipe.launch import available_cores

    command = command_line()
    describe = next((r["describe"] for launch in launches for r in launch.results if "describe" in r), "")
    torch_version = launches[0].results[0]["torch"] if launches else ""
    setup = (f"{started}; {describe}; torch {torch_version}; {available_cores()} CPU cores; one thread per "
             f"process (torch.set_num_threads(1), OMP_NUM_THREADS=1); ranks above the core count "
             f"oversubscribed with OMPI_MCA_mpi_yield_when_idle=1")
    if args.busy_neighbours:
        setup += f"; {args.busy_neighbours} busy-looping Python process(es) running beside every launch"
    method = (f"{args.warmup} warm-up steps, then {args.blocks} blocks × {args.steps} steps per schedule and "
              f"{args.rounds} round(s) of launches; block time = slowest rank after a barrier; steps/s from "
              "the median block; a step = forward + backward + SGD step")
    out = []
    md = args.markdown
    if md:
        out += [f"Command: `{command}`  ", f"Setup: {setup}  ", f"Method: {method}", ""]
    else:
        out += [f"command: {command}", f"setup:   {setup}", f"method:  {method}", ""]
    mlp = [launch for launch in launches if launch.model == "mlp"]
    if mlp:
        first = mlp[0]
        out += [f"MLP: {first.layers} × (Linear({first.width}, {first.width}) + Tanh), MSE loss, SGD lr "
                f"{LEARNING_RATE}, batch {first.batch}, {first.micro_batches} micro-batches, uniform "
                "balance, checkpoint never. ideal × = P·M/(M+P−1), capped at the core count "
                "(micro-batches assumed as fast as the whole batch); ceiling × here = the same with each "
                "core's measured speed on micro-batches while the other cores are busy too (the concurrent "
                "copies' row: steps/s of all copies together ÷ copies); blocks min–max = steps/s of the "
                "slowest and fastest timed block", ""]
        out += [render(*mlp_rows(launches, args), md, left=3), ""]
    sleep = [launch for launch in launches if launch.model == "sleep"]
    if sleep:
        first = sleep[0]
        out += [f"Sleep-emulated model: {first.layers} layers over P={first.stages} stages, each layer's "
                f"forward sleeps {args.sleep_ms[0]:g} ms and backward {args.sleep_ms[1]:g} ms (half for the input "
                "gradient, half for the weight gradient: zero-bubble schedules run them apart); micro-batches "
                f"of {SLEEP_ROWS_PER_MICRO_BATCH}×{SLEEP_WIDTH} floats; F and B = one stage's sleeps per "
                "micro-batch (nominal). theory = the step on an ideal machine, simulated from hybridpipe's schedule data "
                f"(interleaved: v = {VIRTUAL_STAGES} chunks per rank of F/v, B/v; zb-h1: W = B/2; pipedream and "
                "2bw never drain: M·(F+B)); M·(F+B) slept = the busiest rank's sleeps per step as they lasted (each "
                "time.sleep overshoots by tens of µs); bubble = 1 − M·(F+B) slept / step time; torch's interleaved zero-bubble "
                f"schedule runs v = {VIRTUAL_STAGES} chunks per rank and is compared with zb-h1 and its theory; "
                "the schedules of a framework interleaved in one launch. theory with hybridpipe's hop = the same "
                "simulation with every transfer between ranks taking the one-way time of a 64-byte message between "
                "ranks 0 and 1 through hybridpipe's pipeline path (hybridpipe.comm.p2p after hp.init), measured "
                "in the hybridpipe launch while the other ranks wait" + (
                    f": {_hop_ms(sleep, 'hybridpipe'):.3f} ms here, against {_hop_ms(sleep, 'mpi'):.3f} ms through MPI "
                    "directly from the same thread" if _hop_ms(sleep, "hybridpipe") is not None else "") + (
                ". ms per action, input "
                "ready = median time from the end of a stage's previous action to the first sleep of its "
                "next one when that action's input was already there (the framework's own cost per action: "
                "bookkeeping, sends, receives, autograd); ms per hop = the same when the input came last, "
                "from the neighbour (adds the transfer and the waiting rank's wake-up); both from the "
                "sleeps' perf_counter timestamps on all ranks"), ""]
        out += [render(*sleep_rows(launches, args), md, left=4), ""]
    profiled = profile_rows(launches)
    if profiled[1]:
        out += ["Executor profile (--profile-executor, hybridpipe's launches): per action kind, ms per action, the "
                "mean over the pipeline's ranks (a rank that runs no action of a kind is left out of its mean); "
                "python = the action's time that is none of waiting for a receive, posting sends and the chunk's "
                "compute; between actions / after the last = per step", ""]
        out += [render(*profiled, md, left=3), ""]
    out.append(f"{'Whole run' if md else 'whole run'}: {total_seconds:.0f} s "
               f"(launches: {sum(sum(launch.seconds) for launch in launches):.0f} s).")
    return "\n".join(out)


def driver_main(args: argparse.Namespace) -> int:
    started_clock = time.perf_counter()
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    launches = plan(args)
    if not launches:
        raise SystemExit("bench: nothing to run (--no-mlp and --no-sleep)")
    with tempfile.TemporaryDirectory(prefix="hybridpipe-bench-") as folder:
        index = 0
        for round_ in range(args.rounds):
            shift = round_ % len(launches)
            for launch in launches[shift:] + launches[:shift]:
                run_launch(launch, args, Path(folder), index)
                index += 1
    print(report(launches, args, started, time.perf_counter() - started_clock))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="2,4", help="MLP: pipeline stage counts P (default 2,4)")
    parser.add_argument("--micro-batches", type=int, default=8, help="MLP: micro-batches M (default 8)")
    parser.add_argument("--batch", type=int, default=256, help="MLP: global batch rows (default 256)")
    parser.add_argument("--width", type=int, default=1024, help="MLP: features per layer (default 1024)")
    parser.add_argument("--layers", type=int, default=16, help="MLP: Linear+Tanh layers (default 16)")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block (default 5)")
    parser.add_argument("--blocks", type=int, default=3,
                        help="timed blocks per schedule and launch (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per schedule first (default 2)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat every launch this often, order rotated (default 1)")
    parser.add_argument("--sleep-ms", default="5,10",
                        help="sleep model: forward,backward sleep per layer in ms (default 5,10)")
    parser.add_argument("--pipeline-schedules", default=",".join(SCHEDULES),
                        help=f"hybridpipe schedules to run (default all: {','.join(SCHEDULES)}); torch runs its "
                             "counterparts of these")
    parser.add_argument("--sleep-stages", type=int, default=4, help="sleep model: P (default 4)")
    parser.add_argument("--sleep-micro-batches", type=int, default=8, help="sleep model: M (default 8)")
    parser.add_argument("--sleep-layers", type=int, default=0,
                        help=f"sleep model: layers (default {VIRTUAL_STAGES}·P, one per interleaved chunk)")
    parser.add_argument("--no-torch", action="store_true", help="leave out torch.distributed.pipelining")
    parser.add_argument("--no-mlp", action="store_true", help="leave out the MLP throughput benchmark")
    parser.add_argument("--no-sleep", action="store_true",
                        help="leave out the sleep-emulated overhead benchmark")
    parser.add_argument("--busy-neighbours", type=int, default=0,
                        help="run this many busy-looping processes beside every launch, to see how each "
                             "variant copes with a shared machine (default 0)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables (for docs/)")
    parser.add_argument("--profile-executor", action="store_true",
                        help="hybridpipe's launches: print where each action's time goes (wait, send, compute, "
                             "the executor's own Python), the mean over the ranks, per schedule")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds allowed per launch (default 900)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--variant",
                        choices=("single", "single-micro", "single-micro-copies", "hybridpipe", "torch", "alone"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=("mlp", "sleep"), default="mlp", help=argparse.SUPPRESS)
    parser.add_argument("--schedules", default="gpipe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        stages = int_list(args.stages, "--stages")
        sleep_ms = [float(v) for v in str(args.sleep_ms).split(",")]
    except (argparse.ArgumentTypeError, ValueError) as error:
        parser.error(str(error))
    if len(sleep_ms) != 2 or any(v < 0 for v in sleep_ms):
        parser.error(f"--sleep-ms needs two non-negative numbers, forward,backward (got {args.sleep_ms!r})")
    args.sleep_ms = sleep_ms
    args.schedules = [s for s in args.schedules.split(",") if s]
    args.pipeline_schedules = [s for s in args.pipeline_schedules.split(",") if s]
    unknown = [s for s in args.pipeline_schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"--pipeline-schedules: unknown {unknown} (use some of {', '.join(SCHEDULES)})")
    for name in ("micro_batches", "batch", "width", "layers", "steps", "blocks", "rounds", "sleep_stages",
                 "sleep_micro_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.sleep_layers < 0 or args.busy_neighbours < 0:
        parser.error("--warmup, --sleep-layers and --busy-neighbours must be >= 0")
    if args.worker:
        if not (args.result and args.variant):
            parser.error("--worker needs --result and --variant")
        args.stages = stages[0]
        return args
    args.stages = stages
    if args.batch < args.micro_batches:
        parser.error(f"--batch {args.batch} is smaller than --micro-batches {args.micro_batches}")
    if any(p > args.layers for p in stages):
        parser.error(f"--layers {args.layers} is fewer than the largest stage count {max(stages)}")
    if args.sleep_layers and args.sleep_layers < args.sleep_stages:
        parser.error("--sleep-layers must be at least --sleep-stages")
    if not args.no_torch and (any(args.micro_batches < p for p in stages)
                              or args.sleep_micro_batches < args.sleep_stages):
        parser.error("torch's Schedule1F1B needs micro-batches >= stages; raise M or pass --no-torch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker_main(args) if args.worker else driver_main(args)


if __name__ == "__main__":
    sys.exit(main())

"""Allreduce benchmark: hybridpipe vs mpi4py (the MPI library's MPI_Allreduce) vs torch.distributed gloo.

"hybridpipe" is hp.allreduce_ / hp.grouped_allreduce_ as a user calls them: on one host, buffers above
the small-message cutoff go through the shared-memory allreduce. "hybridpipe ring" is the same C++ call
with shared memory switched off (the segmented ring, as between hosts), measured beside it.

Usage:
    python bench/allreduce.py [--ranks 2,4,8] [--sizes 4KiB,256KiB,4MiB,64MiB] [--repeats N] [--markdown]

Run plainly, this script is the driver: for each rank count n it starts itself under
``mpirun -n n ... --worker`` (the command comes from ``hybridpipe.launch.mpirun_command``), reads
rank 0's JSON result from a temporary file, and prints one table. With ``--worker`` it is one rank.

How it measures (a shared, noisy 2-core machine is the expected case, so it never asserts speed):
  * All implementations run in the same job, interleaved: every repetition calls each of them
    once, in a rotating order, so machine noise hits all of them alike.
  * Before each timed call, an MPI barrier; a rank's time is that one call. The time of a
    repetition is the max over ranks (an MPI_Allreduce MAX of the per-rank times, done after the
    loop), and the reported time is the median over repetitions (after warm-up calls).
  * One untimed call per implementation first checks the result (every rank holds rank + 1, the
    sum must be n(n+1)/2); a wrong result is flagged in the table, never hidden.
  * algbw = bytes / time; busbw = algbw · 2(n−1)/n (the bytes each rank must move in a ring
    allreduce, so it is comparable across n and with memcpy bandwidth). GB = 10^9 bytes.
  * Ratio = best peer's time / hybridpipe's time (> 1: hybridpipe is faster).
  * Reference: single-process memcpy bandwidth (numpy copyto of 64 MiB), counting bytes copied.
  * ResNet-50's 161 gradient tensors (25,557,032 float32, bench/resnet50_shapes.py): one
    hp.grouped_allreduce_ against 161 separate mpi4py Allreduce calls and 161 separate gloo
    all_reduce calls; also, for reference, one Allreduce / all_reduce of the same floats already
    held in a single flat buffer (no packing cost — what a framework with persistent flat
    gradient buckets could reach).

Ranks beyond the available cores run oversubscribed with OMPI_MCA_mpi_yield_when_idle=1, so busy
polling ranks yield the core to the rank that has work. Every launch sets OMP_NUM_THREADS=1 and
forwards the HYBRIDPIPE_* variables (fusion threshold, segment size, ...) in force.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # hybridpipe from this checkout when it is not installed

from _common import command_line, launch_env, progress, render, run_worker, start_gloo  # noqa: E402
from resnet50_shapes import RESNET50_PARAMETERS, RESNET50_TENSORS, resnet50_parameter_shapes  # noqa: E402

DEFAULT_RANKS = "2,4,8"
DEFAULT_SIZES = "4KiB,256KiB,4MiB,64MiB"
WARMUP = 2
LARGE_BYTES = 4 * 1024 * 1024  # above this, fewer repetitions by default
REPEATS_SMALL, REPEATS_LARGE = 20, 7
IMPLEMENTATIONS = ("hybridpipe", "hybridpipe_ring", "mpi4py", "gloo")
OURS = ("hybridpipe", "hybridpipe_ring")  # never a peer
RESNET_VARIANTS = (
    ("hybridpipe", "hybridpipe grouped_allreduce_ (161 tensors)"),
    ("hybridpipe_ring", "same, ring (shared memory off)"),
    ("mpi4py", "mpi4py Allreduce × 161 calls"),
    ("gloo", "gloo all_reduce × 161 calls"),
    ("mpi4py_flat", "mpi4py Allreduce × 1 flat buffer (no packing)"),
    ("gloo_flat", "gloo all_reduce × 1 flat tensor (no packing)"),
)
PEERS_161 = ("mpi4py", "gloo")


# ----------------------------------------------------------------------------------------- helpers

def parse_size(text: str) -> int:
    """'4KiB' -> 4096 (same units as HYBRIDPIPE_* settings: KiB/MiB/GiB, kB/MB/GB, bare bytes)."""
    from hybridpipe.config import parse_bytes

    return parse_bytes(text, "--sizes")


def size_label(nbytes: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def repeats_for(nbytes: int, requested: int | None) -> int:
    if requested is not None:
        return requested
    return REPEATS_SMALL if nbytes <= LARGE_BYTES else REPEATS_LARGE


def memcpy_bandwidth(nbytes: int = 64 * 1024 * 1024, repeats: int = 20) -> float:
    """Single-process memcpy bandwidth in GB/s (bytes copied / time), median of repeats."""
    source = np.ones(nbytes // 4, dtype=np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)  # fault the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


# ------------------------------------------------------------------------------------------ worker

class Worker:
    """One rank: sets up hybridpipe, mpi4py and gloo, and times them side by side."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from mpi4py import MPI

        import hybridpipe as hp
        from hybridpipe._ext import describe

        torch.set_num_threads(1)
        self.describe = describe
        self.torch, self.MPI, self.hp = torch, MPI, hp
        hp.init()
        self.comm = MPI.COMM_WORLD
        self.rank, self.n = self.comm.Get_rank(), self.comm.Get_size()
        self.args = args
        self.dist: Any = None
        self.gloo_error = ""
        if not args.no_gloo:
            self._start_gloo()

    def _start_gloo(self) -> None:
        """torch.distributed on gloo over loopback (bench/_common.py); on failure its columns stay empty."""
        try:
            self.dist, self.gloo_store = start_gloo(self.comm, timeout_s=120)
        except RuntimeError as error:
            self.gloo_error = str(error)
            if self.rank == 0:
                progress(f"gloo unavailable, its columns stay empty: {self.gloo_error}")
            return
        if self.rank == 0:
            progress(f"gloo process group up on 127.0.0.1:{self.gloo_store.port} ({self.n} ranks)")

    def close(self) -> None:
        if self.dist is not None:
            self.dist.destroy_process_group()
        self.hp.shutdown()

    # -- the calls under test; each factory returns (call, buffers as numpy views)

    def _hybridpipe(self, count: int) -> tuple[Callable[[], Any], list[np.ndarray]]:
        tensor = self.torch.zeros(count, dtype=self.torch.float32)
        hp = self.hp
        return (lambda: hp.allreduce_(tensor, op=hp.Sum)), [tensor.numpy()]

    def _ring_options(self) -> Any:
        """The options of a direct collective (spinning waits), with the shared-memory path switched off."""
        from hybridpipe._ext import core
        from hybridpipe.comm import context

        config = self.hp.config()  # a fresh object: the cached one serves hp.allreduce_ beside it
        options = context.allreduce_options_for(config, core().spinning_wait(context.wait_policy(config)))
        options.shared_memory = False
        return options

    def _hybridpipe_ring(self, count: int) -> tuple[Callable[[], Any], list[np.ndarray]]:
        """hp.allreduce_'s C++ call (with its agreement header), forced onto the ring: the path every
        allreduce above the small-message cutoff took before the shared-memory allreduce, and the one
        ranks on several hosts take."""
        from hybridpipe._ext import core
        from hybridpipe.comm import context

        tensor = self.torch.zeros(count, dtype=self.torch.float32)
        comm = context.communicator(None, "bench").py2f()
        options, address, sum_code = self._ring_options(), tensor.data_ptr(), int(self.hp.Sum)
        header = [1, count, 0, sum_code, 0]
        auto = core().AllreduceAlgorithm.Auto  # with shared memory off: MPI_Allreduce when small, else the ring
        def call(keep=tensor):  # the closure keeps the tensor (its address is all the call sees) alive
            return core().allreduce(address, address, count, 0, sum_code, comm, options, header, auto)
        return call, [tensor.numpy()]

    def _mpi4py(self, count: int) -> tuple[Callable[[], Any], list[np.ndarray]]:
        array = np.zeros(count, dtype=np.float32)
        comm, in_place, total = self.comm, self.MPI.IN_PLACE, self.MPI.SUM
        return (lambda: comm.Allreduce(in_place, array, op=total)), [array]

    def _gloo(self, count: int) -> tuple[Callable[[], Any], list[np.ndarray]]:
        tensor = self.torch.zeros(count, dtype=self.torch.float32)
        dist = self.dist
        return (lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM)), [tensor.numpy()]

    def _resnet_factories(self) -> dict[str, Callable[[], tuple[Callable[[], Any], list[np.ndarray]]]]:
        torch, hp, comm, MPI = self.torch, self.hp, self.comm, self.MPI
        counts = [math.prod(shape) for _, shape in resnet50_parameter_shapes()]
        shapes = [shape for _, shape in resnet50_parameter_shapes()]

        def grouped():
            tensors = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
            return (lambda: hp.grouped_allreduce_(tensors, op=hp.Sum)), [t.numpy().reshape(-1) for t in tensors]

        def mpi_each():
            arrays = [np.zeros(c, dtype=np.float32) for c in counts]

            def call():
                for a in arrays:
                    comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
            return call, arrays

        def gloo_each():
            tensors = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
            dist = self.dist

            def call():
                for t in tensors:
                    dist.all_reduce(t, op=dist.ReduceOp.SUM)
            return call, [t.numpy().reshape(-1) for t in tensors]

        def grouped_ring():
            from hybridpipe._ext import core
            from hybridpipe.comm import context

            tensors = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
            addresses, dtypes = [t.data_ptr() for t in tensors], [0] * len(tensors)
            comm = context.communicator(None, "bench").py2f()
            options, threshold = self._ring_options(), hp.config().fusion_threshold_bytes

            def call(keep=tensors):  # keeps the tensors behind the addresses alive
                core().grouped_allreduce(addresses, addresses, counts, dtypes, int(hp.Sum), comm, threshold, options)
            return call, [t.numpy().reshape(-1) for t in tensors]

        factories = {"hybridpipe": grouped, "hybridpipe_ring": grouped_ring, "mpi4py": mpi_each,
                     "mpi4py_flat": lambda: self._mpi4py(sum(counts))}
        if self.dist is not None:
            factories["gloo"] = gloo_each
            factories["gloo_flat"] = lambda: self._gloo(sum(counts))
        return factories

    # -- measurement

    def _check(self, name: str, call: Callable[[], Any], buffers: list[np.ndarray]) -> bool:
        """One untimed call with rank + 1 everywhere; True on every rank iff every rank got n(n+1)/2."""
        for b in buffers:
            b[...] = self.rank + 1
        call()
        expected = self.n * (self.n + 1) / 2
        ok = all(bool(np.all(b == expected)) for b in buffers)
        for b in buffers:
            b[...] = 0  # zeros stay zeros: the timed calls never overflow or hit slow paths
        everyone = self.comm.allreduce(int(ok), op=self.MPI.MIN)
        if not everyone and self.rank == 0:
            progress(f"WRONG RESULT from {name} at n={self.n} (expected {expected} everywhere)")
        return bool(everyone)

    def measure(self, calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
        """Median over repeats of the max-over-ranks time of each call, in seconds; interleaved."""
        names = list(calls)
        times = np.zeros((len(names), repeats), dtype=np.float64)
        barrier, clock = self.comm.Barrier, time.perf_counter
        for repetition in range(WARMUP + repeats):
            shift = repetition % len(names)
            for index in [*range(shift, len(names)), *range(shift)]:  # rotate who goes first
                barrier()
                start = clock()
                calls[names[index]]()
                elapsed = clock() - start
                if repetition >= WARMUP:
                    times[index, repetition - WARMUP] = elapsed
        self.comm.Allreduce(self.MPI.IN_PLACE, times, op=self.MPI.MAX)
        return {name: float(np.median(times[i])) for i, name in enumerate(names)}

    def run_case(self, factories: dict[str, Callable[[], tuple[Callable[[], Any], list[np.ndarray]]]],
                 repeats: int) -> dict[str, Any]:
        calls, correct = {}, {}
        for name, factory in factories.items():
            call, buffers = factory()
            correct[name] = self._check(name, call, buffers)
            calls[name] = call
        seconds = self.measure(calls, repeats)
        return {"seconds": seconds, "correct": correct, "repeats": repeats}

    def run(self) -> dict[str, Any]:
        args = self.args
        began = time.perf_counter()
        config = self.hp.config()
        result: dict[str, Any] = {
            "n": self.n,
            "describe": self.describe(),
            "fusion_threshold_bytes": config.fusion_threshold_bytes,
            "segment_bytes": config.segment_bytes,
            "small_message_bytes": config.small_message_bytes,
            "gloo_error": self.gloo_error,
            "sizes": [],
        }
        for nbytes in args.sizes:
            count = nbytes // 4
            factories = {"hybridpipe": lambda c=count: self._hybridpipe(c),
                         "hybridpipe_ring": lambda c=count: self._hybridpipe_ring(c),
                         "mpi4py": lambda c=count: self._mpi4py(c)}
            if self.dist is not None:
                factories["gloo"] = lambda c=count: self._gloo(c)
            case = self.run_case(factories, repeats_for(nbytes, args.repeats))
            case["bytes"] = nbytes
            result["sizes"].append(case)
            if self.rank == 0:
                shown = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in case["seconds"].items())
                progress(f"n={self.n} {size_label(nbytes)}: {shown} "
                         f"({case['repeats']} repeats, {time.perf_counter() - began:.0f} s so far)")
        if not args.no_resnet:
            case = self.run_case(self._resnet_factories(), repeats_for(RESNET50_PARAMETERS * 4, args.repeats))
            case["bytes"] = RESNET50_PARAMETERS * 4
            result["resnet50"] = case
            if self.rank == 0:
                shown = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in case["seconds"].items())
                progress(f"n={self.n} ResNet-50 ({RESNET50_TENSORS} tensors): {shown} "
                         f"({time.perf_counter() - began:.0f} s so far)")
        result["worker_seconds"] = time.perf_counter() - began
        return result


def worker_main(args: argparse.Namespace) -> int:
    return run_worker(Worker(args), args.result)


# ------------------------------------------------------------------------------------------ driver

def launch(n: int, args: argparse.Namespace, result_path: Path) -> dict[str, Any]:
    from hybridpipe.launch import available_cores, mpirun_command

    env = launch_env(n)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result_path),
            "--sizes", ",".join(str(s) for s in args.sizes)]
    if args.repeats is not None:
        argv += ["--repeats", str(args.repeats)]
    if args.no_gloo:
        argv.append("--no-gloo")
    if args.no_resnet:
        argv.append("--no-resnet")
    command = mpirun_command(n, argv, env=env)
    progress(f"n={n}: {shlex.join(command)}")
    started = time.perf_counter()
    # The ranks' stdout goes to our stderr: stdout holds nothing but the table.
    completed = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=sys.stderr, timeout=args.timeout,
                               check=False)
    if completed.returncode != 0 or not result_path.exists():
        raise SystemExit(f"bench: the n={n} run failed (mpirun exit status {completed.returncode}); "
                         f"its ranks' output is above")
    result = json.loads(result_path.read_text())
    result["launch_seconds"] = time.perf_counter() - started
    result["oversubscribed"] = n > available_cores()
    return result


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _busbw(nbytes: int, seconds: float, n: int) -> float:
    return _gbps(nbytes, seconds) * 2 * (n - 1) / n


def _cell_time(case: dict[str, Any], name: str) -> str:
    if name not in case["seconds"]:
        return "n/a"
    text = f"{case['seconds'][name] * 1e3:.3f}"
    return text if case["correct"].get(name, True) else text + " WRONG"


def size_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["n", "size", "hybridpipe ms", "hybridpipe ring ms", "mpi4py ms", "gloo ms", "hybridpipe algbw/busbw GB/s",
              "ring algbw/busbw GB/s", "mpi4py algbw/busbw GB/s", "gloo algbw/busbw GB/s", "best peer",
              "best peer / hybridpipe", "ring / hybridpipe"]
    rows = []
    for result in results:
        n = result["n"]
        for case in result["sizes"]:
            nbytes, seconds = case["bytes"], case["seconds"]
            bandwidths = []
            for name in IMPLEMENTATIONS:
                if name in seconds:
                    bandwidths.append(f"{_gbps(nbytes, seconds[name]):.2f} / {_busbw(nbytes, seconds[name], n):.2f}")
                else:
                    bandwidths.append("n/a")
            peers = {k: v for k, v in seconds.items() if k not in OURS}
            best = min(peers, key=peers.get)
            rows.append([str(n), size_label(nbytes), *(_cell_time(case, k) for k in IMPLEMENTATIONS), *bandwidths,
                         best, f"{peers[best] / seconds['hybridpipe']:.2f}x",
                         f"{seconds['hybridpipe_ring'] / seconds['hybridpipe']:.2f}x"])
    return header, rows


def resnet_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["n", *(label + " ms" for _, label in RESNET_VARIANTS),
              "hybridpipe busbw GB/s", "best 161-call peer / hybridpipe", "best flat / hybridpipe",
              "ring / hybridpipe"]
    rows = []
    for result in results:
        case = result.get("resnet50")
        if case is None:
            continue
        n, seconds, nbytes = result["n"], case["seconds"], case["bytes"]
        hp_time = seconds["hybridpipe"]
        per_call = {k: seconds[k] for k in PEERS_161 if k in seconds}
        flat = {k: seconds[k] for k in ("mpi4py_flat", "gloo_flat") if k in seconds}
        best_call = min(per_call, key=per_call.get)
        best_flat = min(flat, key=flat.get)
        rows.append([str(n), *(_cell_time(case, k) for k, _ in RESNET_VARIANTS),
                     f"{_busbw(nbytes, hp_time, n):.2f}",
                     f"{per_call[best_call] / hp_time:.2f}x ({best_call})",
                     f"{flat[best_flat] / hp_time:.2f}x ({best_flat.replace('_flat', ' flat')})",
                     f"{seconds['hybridpipe_ring'] / hp_time:.2f}x"])
    return header, rows


def report(results: list[dict[str, Any]], memcpy: float, args: argparse.Namespace, started: str,
           total_seconds: float) -> str:
    from hybridpipe.launch import available_cores

    first = results[0]
    command = command_line()
    oversubscribed = [str(r["n"]) for r in results if r["oversubscribed"]]
    setup = (f"{started}; {first['describe']}; {available_cores()} CPU cores (os.cpu_count() {os.cpu_count()}); "
             f"fusion threshold {size_label(first['fusion_threshold_bytes'])}, "
             f"segment {size_label(first['segment_bytes'])}, "
             f"small-message cutoff {size_label(first['small_message_bytes'])}; OMP_NUM_THREADS=1"
             + (f"; n={','.join(oversubscribed)} oversubscribed with OMPI_MCA_mpi_yield_when_idle=1"
                if oversubscribed else ""))
    method = (f"time = median over repeats ({REPEATS_SMALL} for <= 4 MiB, {REPEATS_LARGE} above"
              if args.repeats is None else f"time = median over {args.repeats} repeats") + (
              f", after {WARMUP} warm-up rounds) of the max over ranks of one call after a barrier; "
              "implementations interleaved in one job; float32, op sum; busbw = algbw*2(n-1)/n; GB = 1e9 B; "
              "ratio > 1 = hybridpipe faster")
    gloo_errors = [f"n={r['n']}: {r['gloo_error']}" for r in results if r.get("gloo_error")]
    size_table = render(*size_rows(results), args.markdown)
    resnet = resnet_rows(results)
    out = []
    if args.markdown:
        out += [f"Command: `{command}`  ", f"Setup: {setup}  ", f"Method: {method}  ",
                f"Reference: single-process memcpy (numpy copyto, 64 MiB) **{memcpy:.2f} GB/s**", ""]
        if gloo_errors:
            out += ["gloo unavailable: " + "; ".join(gloo_errors), ""]
        out += [size_table, ""]
        if resnet[1]:
            out += [f"ResNet-50 gradients: {RESNET50_TENSORS} tensors, {RESNET50_PARAMETERS:,} float32 "
                    f"({RESNET50_PARAMETERS * 4 / 2**20:.1f} MiB); "
                    "\"flat\" = the same floats already in one buffer, one call, no packing", "",
                    render(*resnet, True), ""]
        out.append(f"Whole run: {total_seconds:.0f} s.")
    else:
        out += [f"command:   {command}", f"setup:     {setup}", f"method:    {method}",
                f"reference: single-process memcpy (numpy copyto, 64 MiB): {memcpy:.2f} GB/s", ""]
        if gloo_errors:
            out += ["gloo unavailable: " + "; ".join(gloo_errors), ""]
        out += [size_table, ""]
        if resnet[1]:
            out += [f"ResNet-50 gradients: {RESNET50_TENSORS} tensors, {RESNET50_PARAMETERS:,} float32 "
                    f"({RESNET50_PARAMETERS * 4 / 2**20:.1f} MiB); 'flat' = the same floats already in one "
                    "buffer, one call, no packing", render(*resnet, False), ""]
        out.append(f"whole run: {total_seconds:.0f} s")
    return "\n".join(out)


def driver_main(args: argparse.Namespace) -> int:
    started_clock = time.perf_counter()
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    memcpy = memcpy_bandwidth()
    progress(f"single-process memcpy (numpy copyto, 64 MiB): {memcpy:.2f} GB/s")
    results = []
    with tempfile.TemporaryDirectory(prefix="hybridpipe-bench-") as folder:
        for n in args.ranks:
            results.append(launch(n, args, Path(folder) / f"result-n{n}.json"))
            progress(f"n={n} done in {results[-1]['launch_seconds']:.0f} s")
    print(report(results, memcpy, args, started, time.perf_counter() - started_clock))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default=DEFAULT_RANKS, help=f"rank counts to run (default {DEFAULT_RANKS})")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"message sizes in bytes, KiB, MiB (default {DEFAULT_SIZES})")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed repetitions per size (default {REPEATS_SMALL} up to 4 MiB, "
                             f"{REPEATS_LARGE} above); {WARMUP} warm-up rounds come first")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables (for docs/benchmarks.md)")
    parser.add_argument("--no-gloo", action="store_true", help="leave out torch.distributed gloo")
    parser.add_argument("--no-resnet", action="store_true", help="leave out the ResNet-50 gradient benchmark")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per mpirun (default 900)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.ranks = [int(r) for r in str(args.ranks).split(",") if r.strip()]
        args.sizes = [parse_size(s) for s in str(args.sizes).split(",") if s.strip()]
    except ValueError as error:
        parser.error(str(error))
    except Exception as error:  # HybridPipeError from parse_bytes
        parser.error(str(error))
    if not args.ranks or any(r < 1 for r in args.ranks):
        parser.error(f"--ranks needs positive integers (got {args.ranks})")
    if not args.sizes or any(s < 4 or s % 4 for s in args.sizes):
        parser.error("--sizes must be positive multiples of 4 bytes (float32 elements)")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1 (got {args.repeats})")
    if args.worker and not args.result:
        parser.error("--worker needs --result PATH")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker_main(args) if args.worker else driver_main(args)


if __name__ == "__main__":
    sys.exit(main())

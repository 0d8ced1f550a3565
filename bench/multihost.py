"""Allreduce across hosts: hierarchical vs flat ring vs the MPI library, on emulated hosts with a rate-limited link.

Two emulated hosts (network namespaces on a bridge, ``hybridpipe.testing.emulated_hosts``) × 2 ranks,
each host's outbound link limited by tc (tbf) to each rate asked for (default 1 Gbit/s and 10 Gbit/s).
In one job per rate, interleaved repetition by repetition:

* **64 MiB allreduce** (float32 sum over world): the hierarchical allreduce, hybridpipe's flat ring
  (the same C++ call forced to each algorithm), and mpi4py's ``Allreduce`` (the MPI library's own).
* **ResNet-50's 161 gradients through the engine** (``hp.allreduce_async_`` per tensor, then
  ``synchronize``, as ``DistributedOptimizer`` does), with ``HYBRIDPIPE_HIERARCHICAL=1`` and ``=0``
  (the engine's setting is fixed per ``hp.init``: the job alternates blocks of repetitions, re-initing
  hybridpipe in between), against 161 mpi4py ``Allreduce`` calls.

Usage:
    sudo python bench/multihost.py [--rates 1gbit,10gbit] [--repeats 5] [--markdown]

Every MPI call, the library's included, runs on hybridpipe's communication thread (``engine.call``),
the one thread that makes MPI calls across hosts (docs/sharp_bits.md). A repetition's time is the
slowest rank's (a barrier before it); the table gives the median over repetitions after one warm-up.
The first call of each implementation is checked (every rank contributes rank + 1).

The physical limit: after each host reduces its own ranks' data, each host must receive every
element's partial sum or result from the other, so at least S bytes cross the link each way: time ≥
S / rate ("ceiling" column: that bound over the measured time). A flat ring over 4 packed ranks
sends 2·(n−1)/n·S = 1.5·S through the one rank whose neighbour is on the other host; the
hierarchical one sends S, half through each local rank. busbw = S·2(n−1)/n / time (GB = 10^9 B).
"""

from __future__ import annotations

import argparse
import json
import math
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

from _common import command_line, progress, render  # noqa: E402
from resnet50_shapes import resnet50_parameter_shapes  # noqa: E402

BIG = 64 * 1024 * 1024  # bytes


class Worker:
    """One rank: runs every implementation, interleaved; rank 0 returns the times."""

    def __init__(self, repeats: int) -> None:
        import torch
        from mpi4py import MPI

        import hybridpipe as hp

        self.torch, self.MPI, self.hp, self.repeats = torch, MPI, hp, repeats
        self.rank, self.size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size

    def timed(self, comm: Any, function: Callable[[], Any]) -> float:
        from hybridpipe.comm.engine import call

        call(None, "barrier", comm.Barrier)
        start = time.perf_counter()
        function()
        return time.perf_counter() - start

    def slowest(self, comm: Any, times: list[float]) -> list[float]:
        from hybridpipe.comm.engine import call

        array = np.array(times)
        call(None, "max", lambda: comm.Allreduce(self.MPI.IN_PLACE, array, op=self.MPI.MAX))
        return array.tolist()

    def big(self) -> dict[str, Any]:
        """64 MiB: hierarchical, flat ring and the MPI library, interleaved."""
        from hybridpipe._ext import core
        from hybridpipe.comm import context
        from hybridpipe.comm.engine import call

        hp, MPI = self.hp, self.MPI
        hp.init()
        comm = context.communicator(None, "bench")
        library = call(None, "dup", comm.Dup)
        count = BIG // 4
        array = np.zeros(count, dtype=np.float32)
        address, comm_f = array.ctypes.data, comm.py2f()
        options = context.allreduce_options_for(hp.config(), context.wait_policy(hp.config()))
        algorithms = core().AllreduceAlgorithm

        def ours(algorithm):
            return lambda: call(None, "allreduce", lambda: core().allreduce(address, address, count, 0, 0, comm_f,
                                                                           options, [], algorithm))
        implementations = {
            "hierarchical": ours(algorithms.Hierarchical),
            "flat ring": ours(algorithms.Ring),
            "MPI library": lambda: call(None, "Allreduce", lambda: library.Allreduce(MPI.IN_PLACE, array)),
        }
        times: dict[str, list[float]] = {name: [] for name in implementations}
        checked: dict[str, bool] = {}
        names = list(implementations)
        for repetition in range(self.repeats + 1):
            for offset in range(len(names)):
                name = names[(repetition + offset) % len(names)]
                array.fill(self.rank + 1)
                seconds = self.timed(library, implementations[name])
                if repetition == 0:  # warm-up, and the check
                    checked[name] = bool(np.all(array == self.size * (self.size + 1) / 2))
                else:
                    times[name].append(seconds)
        result = {name: self.slowest(library, values) for name, values in times.items()}
        ok = call(None, "ok", lambda: library.allreduce(all(checked.values()), op=MPI.LAND))
        call(None, "free", library.Free)
        hp.shutdown()
        return {"times": result, "checked": ok, "bytes": BIG}

    def resnet(self) -> dict[str, Any]:
        """ResNet-50's 161 gradients through the engine, hierarchical on and off, and 161 library calls."""
        from hybridpipe.comm import context
        from hybridpipe.comm.engine import call

        torch, hp, MPI = self.torch, self.hp, self.MPI
        shapes = [shape for _, shape in resnet50_parameter_shapes()]
        tensors = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        arrays = [t.numpy().reshape(-1) for t in tensors]
        total = sum(t.numel() for t in tensors) * 4
        times: dict[str, list[float]] = {"hierarchical": [], "flat ring": [], "MPI library": []}
        checked = True
        blocks = 2  # ABAB: noise on the machine hits both settings alike
        per_block = max(1, math.ceil(self.repeats / blocks))
        for block in range(blocks):
            for setting, name in (("1", "hierarchical"), ("0", "flat ring")):
                hp.init(config=hp.Config(hierarchical=setting))
                comm = context.communicator(None, "bench")
                library = call(None, "dup", comm.Dup)
                def engine():
                    handles = [hp.allreduce_async_(t, name=f"g{i}", op=hp.Sum) for i, t in enumerate(tensors)]
                    for handle in handles:
                        hp.synchronize(handle)

                def each():
                    for a in arrays:
                        library.Allreduce(MPI.IN_PLACE, a)
                runs = {name: engine}
                if name == "hierarchical":  # the library's calls do not depend on the setting
                    runs["MPI library"] = lambda: call(None, "Allreduce x161", each)
                measured: dict[str, list[float]] = {label: [] for label in runs}
                for repetition in range(per_block + 1):
                    for label, function in runs.items():
                        for a in arrays:
                            a.fill(self.rank + 1)
                        seconds = self.timed(library, function)
                        if repetition == 0:  # warm-up (a fresh init), and the check
                            checked = checked and all(np.all(a == self.size * (self.size + 1) / 2) for a in arrays)
                        else:
                            measured[label].append(seconds)
                for label, values in measured.items():
                    times[label].extend(self.slowest(library, values))
                call(None, "free", library.Free)
                hp.shutdown()
        return {"times": times, "checked": checked, "bytes": total}

    def run(self) -> dict[str, Any]:
        return {"64 MiB allreduce": self.big(), "ResNet-50, 161 gradients": self.resnet(),
                "ranks": self.size}


def worker_main(args: argparse.Namespace) -> int:
    worker = Worker(args.repeats)
    result = worker.run()
    if worker.rank == 0:
        Path(args.result).write_text(json.dumps(result))
    return 0


def run_rate(rate: str, args: argparse.Namespace) -> dict[str, Any]:
    from hybridpipe.testing.emulated_hosts import EmulatedHosts

    with tempfile.TemporaryDirectory() as scratch, EmulatedHosts(2, rate=rate) as hosts:
        result_path = Path(scratch) / "result.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result_path),
                "--repeats", str(args.repeats)]
        command = hosts.mpirun_command(2, argv, env={"OMP_NUM_THREADS": "1"})
        progress(f"{rate}: 2 emulated hosts x 2 ranks")
        finished = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        if finished.returncode != 0 or not result_path.exists():
            raise SystemExit(f"the job at {rate} failed (exit {finished.returncode}):\n"
                             f"{finished.stdout[-3000:]}{finished.stderr[-3000:]}")
        return json.loads(result_path.read_text())


def link_bytes_per_second(rate: str) -> float:
    from hybridpipe.testing.emulated_hosts import rate_bits_per_second

    return rate_bits_per_second(rate) / 8


def table(results: dict[str, dict[str, Any]], markdown: bool) -> str:
    header = ["link", "workload", "implementation", "median s", "busbw GB/s", "link GB/s", "ceiling",
              "hier. speed-up"]
    rows = []
    for rate, result in results.items():
        link = link_bytes_per_second(rate)
        n = result["ranks"]
        for workload in ("64 MiB allreduce", "ResNet-50, 161 gradients"):
            entry = result[workload]
            medians = {name: statistics.median(values) for name, values in entry["times"].items() if values}
            floor = entry["bytes"] / link  # every byte crosses each way at least once
            for name, seconds in medians.items():
                busbw = entry["bytes"] * 2 * (n - 1) / n / seconds / 1e9
                speedup = medians["hierarchical"] / seconds if name != "hierarchical" else None
                rows.append([rate, workload, name + ("" if entry["checked"] else " (WRONG RESULT)"),
                             f"{seconds:.3f}", f"{busbw:.3f}", f"{link / 1e9:.3f}", f"{floor / seconds:.0%}",
                             "" if speedup is None else f"{1 / speedup:.2f}x"])
    return render(header, rows, markdown, left=3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="1gbit,10gbit", help="link rates (tc units), comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per implementation")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)
    results = {rate: run_rate(rate, args) for rate in args.rates.split(",") if rate.strip()}
    print(f"# {command_line()}")
    print("2 emulated hosts x 2 ranks; 'hier. speed-up' = this row's time / hierarchical's (> 1: hierarchical "
          "is faster); ceiling = (bytes / link rate) / time")
    print(table(results, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())

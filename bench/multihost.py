"""Allreduce across hosts: hierarchical vs flat ring vs the MPI library, on emulated hosts with a rate-limited link.

Two emulated hosts (network namespaces on a bridge, ``hybridpipe.testing.emulated_hosts``) × 2 ranks,
each host's outbound link limited by tc (tbf) to each rate asked for (default 1 Gbit/s and 10 Gbit/s).
In one job per rate, in interleaved rounds (``--rounds``, each ``--repeats`` repetitions of every row in a
rotating order):

* **64 MiB allreduce** (float32 sum over world): the hierarchical allreduce (as configured, and in one chunk:
  its steps one after the other), hybridpipe's flat ring (the same C++ call forced to each algorithm), and
  mpi4py's ``Allreduce`` (the MPI library's own). ``--variants`` adds hierarchical rows with other
  AllreduceOptions; ``--step-two`` a row of the transfer between hosts alone (each local rank's half of the
  buffer over a ring with its peer on the other host: what the hierarchical allreduce cannot beat).
* **ResNet-50's 161 gradients through the engine** (``hp.allreduce_async_`` per tensor, then
  ``synchronize``, as ``DistributedOptimizer`` does), with ``HYBRIDPIPE_HIERARCHICAL=1`` (in chunks as
  configured, and in one: ``HYBRIDPIPE_HIERARCHICAL_CHUNK=0``) and ``=0``
  (the engine's setting is fixed per ``hp.init``: each round re-inits hybridpipe once per setting),
  against 161 mpi4py ``Allreduce`` calls.

Usage:
    sudo python bench/multihost.py [--rates 1gbit,10gbit] [--rounds 5] [--repeats 3] [--workloads 64mib,resnet]
                                   [--variants 'hierarchical_chunk_bytes=1MiB;segment_bytes=1MiB'] [--step-two]

HYBRIDPIPE_* variables of this shell reach the ranks. Every MPI call, the library's included, runs on
hybridpipe's communication thread (``engine.call``), the one thread that makes MPI calls across hosts
(docs/sharp_bits.md). A repetition's time is the slowest rank's (a barrier before it); the table gives the
median over all repetitions after one warm-up, and the hierarchical allreduce's speed-up over each row as the
median over rounds of each round's ratio of medians, with its spread (bench/_common.py's round_ratio). The
warm-up call of each implementation is checked (every rank contributes rank + 1).

The physical limit: after each host reduces its own ranks' data, each host must receive every
element's partial sum or result from the other, so at least S bytes cross the link each way: time ≥
S / rate ("ceiling" column: that bound over the measured time; TCP/IP headers take 4.4 % of each 1514-byte
frame, so about 96 % is the most a transfer over TCP can show). A flat ring over 4 packed ranks
sends 2·(n−1)/n·S = 1.5·S through the one rank whose neighbour is on the other host; the
hierarchical one sends S, half through each local rank. busbw = S·2(n−1)/n / time (GB = 10^9 B).
"""

from __future__ import annotations

import argparse
import json
import os
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

from _common import command_line, format_ratio, progress, render, round_ratio  # noqa: E402
from resnet50_shapes import resnet50_parameter_shapes  # noqa: E402

BIG = 64 * 1024 * 1024  # bytes


class Worker:
    """One rank: runs every implementation, interleaved; rank 0 returns the times."""

    def __init__(self, rounds: int, repeats: int, variants: dict[str, dict[str, int]]) -> None:
        import torch
        from mpi4py import MPI

        import hybridpipe as hp

        self.torch, self.MPI, self.hp, self.rounds, self.repeats = torch, MPI, hp, rounds, repeats
        self.variants = variants
        self.step_two = False
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
        """64 MiB: hierarchical (pipelined, and in one chunk), flat ring and the MPI library, interleaved in rounds."""
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

        def varied(**fields):
            chosen = context.allreduce_options_for(hp.config(), context.wait_policy(hp.config()))
            for field, value in fields.items():
                setattr(chosen, field, value)
            return chosen

        def ours(algorithm, chosen=options):
            return lambda: call(None, "allreduce", lambda: core().allreduce(address, address, count, 0, 0, comm_f,
                                                                           chosen, [], algorithm))
        implementations = {
            "hierarchical": ours(algorithms.Hierarchical),
            "hierarchical, one chunk": ours(algorithms.Hierarchical, varied(hierarchical_chunk_bytes=0)),
            **{f"hierarchical, {label}": ours(algorithms.Hierarchical, varied(**fields))
               for label, fields in self.variants.items()},
            "flat ring": ours(algorithms.Ring),
            "MPI library": lambda: call(None, "Allreduce", lambda: library.Allreduce(MPI.IN_PLACE, array)),
        }
        if self.step_two:  # the hierarchical allreduce's transfer between hosts alone: no step inside a host
            local = call(None, "split", lambda: library.Split_type(MPI.COMM_TYPE_SHARED))
            pieces = call(None, "split", lambda: library.Split(local.rank, self.rank))
            half, piece_f = count // local.size, pieces.py2f()
            piece_address = address + local.rank * half * 4
            implementations["step 2 alone (ring per piece)"] = lambda: call(None, "pieces", lambda: core().allreduce(
                piece_address, piece_address, half, 0, 0, piece_f, options, [], algorithms.Ring))
        names = list(implementations)
        rounds: dict[str, list[list[float]]] = {name: [] for name in names}
        checked: dict[str, bool] = {}
        for name in names:  # warm-up, and the check
            array.fill(self.rank + 1)
            self.timed(library, implementations[name])
            checked[name] = name.startswith("step 2") or bool(np.all(array == self.size * (self.size + 1) / 2))
        for round_index in range(self.rounds):
            times: dict[str, list[float]] = {name: [] for name in names}
            for repetition in range(self.repeats):
                for offset in range(len(names)):
                    name = names[(round_index + repetition + offset) % len(names)]
                    array.fill(self.rank + 1)
                    times[name].append(self.timed(library, implementations[name]))
            for name in names:
                rounds[name].append(self.slowest(library, times[name]))
        ok = call(None, "ok", lambda: library.allreduce(all(checked.values()), op=MPI.LAND))
        call(None, "free", library.Free)
        hp.shutdown()
        return {"rounds": rounds, "times": {name: sum(r, []) for name, r in rounds.items()}, "checked": ok,
                "bytes": BIG}

    def resnet(self) -> dict[str, Any]:
        """ResNet-50's 161 gradients through the engine, hierarchical on and off, and 161 library calls."""
        from hybridpipe.comm import context
        from hybridpipe.comm.engine import call

        torch, hp, MPI = self.torch, self.hp, self.MPI
        shapes = [shape for _, shape in resnet50_parameter_shapes()]
        tensors = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        arrays = [t.numpy().reshape(-1) for t in tensors]
        total = sum(t.numel() for t in tensors) * 4
        settings = (({"hierarchical": "1"}, "hierarchical"), ({"hierarchical": "0"}, "flat ring"),
                    ({"hierarchical": "1", "hierarchical_chunk_bytes": 0}, "hierarchical, one chunk"))
        rounds: dict[str, list[list[float]]] = {name: [] for _, name in settings}
        rounds["MPI library"] = []
        checked = True
        for _ in range(self.rounds):  # a round: each setting in turn (ABAB: noise hits both alike)
            for setting, name in settings:
                hp.init(config=hp.Config(**setting))
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
                for repetition in range(self.repeats + 1):
                    for label, function in runs.items():
                        for a in arrays:
                            a.fill(self.rank + 1)
                        seconds = self.timed(library, function)
                        if repetition == 0:  # warm-up (a fresh init), and the check
                            checked = checked and all(np.all(a == self.size * (self.size + 1) / 2) for a in arrays)
                        else:
                            measured[label].append(seconds)
                for label, values in measured.items():
                    rounds[label].append(self.slowest(library, values))
                call(None, "free", library.Free)
                hp.shutdown()
        return {"rounds": rounds, "times": {name: sum(r, []) for name, r in rounds.items()}, "checked": checked,
                "bytes": total}

    def run(self, workloads: list[str]) -> dict[str, Any]:
        result: dict[str, Any] = {"ranks": self.size}
        if "64mib" in workloads:
            result["64 MiB allreduce"] = self.big()
        if "resnet" in workloads:
            result["ResNet-50, 161 gradients"] = self.resnet()
        return result


def parse_variants(text: str) -> dict[str, dict[str, int]]:
    """``a=1MiB,b=8;c=0`` -> {"a=1MiB,b=8": {"a": 1048576, "b": 8}, "c=0": {"c": 0}}."""
    from hybridpipe.config import parse_bytes

    variants = {}
    for variant in filter(None, (v.strip() for v in text.split(";"))):
        pairs = [pair.split("=", 1) for pair in variant.split(",")]
        variants[variant] = {key.strip(): parse_bytes(value, key) for key, value in pairs}
    return variants


def worker_main(args: argparse.Namespace) -> int:
    worker = Worker(args.rounds, args.repeats, parse_variants(args.variants))
    worker.step_two = args.step_two
    result = worker.run(args.workloads.split(","))
    if worker.rank == 0:
        Path(args.result).write_text(json.dumps(result))
    return 0


def run_rate(rate: str, args: argparse.Namespace) -> dict[str, Any]:
    from hybridpipe.testing.emulated_hosts import EmulatedHosts

    with tempfile.TemporaryDirectory() as scratch, EmulatedHosts(2, rate=rate) as hosts:
        result_path = Path(scratch) / "result.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result_path),
                "--rounds", str(args.rounds), "--repeats", str(args.repeats), "--workloads", args.workloads,
                "--variants", args.variants,
                *(["--step-two"] if args.step_two else [])]
        env = {"OMP_NUM_THREADS": "1"}
        env.update({k: v for k, v in os.environ.items() if k.startswith("HYBRIDPIPE_") and k != "HYBRIDPIPE_MPIRUN"})
        command = hosts.mpirun_command(2, argv, env=env)
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
            if workload not in result:
                continue
            entry = result[workload]
            ours = entry["rounds"]["hierarchical"]
            medians = {name: statistics.median(values) for name, values in entry["times"].items() if values}
            floor = entry["bytes"] / link  # every byte crosses each way at least once
            for name, seconds in medians.items():
                busbw = entry["bytes"] * 2 * (n - 1) / n / seconds / 1e9
                speedup = None if name == "hierarchical" else round_ratio(entry["rounds"][name], ours)
                rows.append([rate, workload, name + ("" if entry["checked"] else " (WRONG RESULT)"),
                             f"{seconds:.3f}", f"{busbw:.3f}", f"{link / 1e9:.3f}", f"{floor / seconds:.0%}",
                             "" if speedup is None else format_ratio(*speedup, len(ours))])
    return render(header, rows, markdown, left=3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="1gbit,10gbit", help="link rates (tc units), comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (a ratio per round)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per implementation and round")
    parser.add_argument("--workloads", default="64mib,resnet", help="64mib, resnet or both, comma-separated")
    parser.add_argument("--variants", default="", help="more rows: the hierarchical allreduce with these "
                        "AllreduceOptions, e.g. 'hierarchical_chunk_bytes=1MiB;segment_bytes=1MiB,receive_window=8'")
    parser.add_argument("--step-two", action="store_true", help="one more row: the transfer between hosts "
                        "alone (each local rank's half of the buffer over a ring with its peer on the other host)")
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

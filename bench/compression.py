"""Allreduce with compression: plain float32 vs hp.Compression.fp16 vs bf16, on one host and across emulated hosts.

One job per setting: ``local:N`` (N ranks on this host, shared memory) or ``RATE:N`` (2 emulated hosts,
``hybridpipe.testing.emulated_hosts``, N ranks in all, each host's outbound link limited by tc to RATE;
``unlimited:N``: the same hosts with no limit, where the cores, not the link, set the time). Each
job runs ``hp.allreduce(tensor, op=hp.Average, compression=...)`` of float32 tensors of each size, the
implementations interleaved within each of ``--rounds`` rounds (rotating which goes first); a time is the
slowest rank's (a barrier before each call), a round's value the median of its ``--repeats``. On one host the
table adds ``fp16.forced`` (the ring with the conversions, shared memory skipped): what compression would cost
there.

Columns: the medians over rounds; ``fp16 x`` / ``bf16 x`` = plain's time / the compressed one's, the median over
rounds of each round's ratio (both from the same round) with its spread. ``link`` = the link's ceiling: the
bytes that must cross between the hosts each way (the buffer, once, after each host reduced its own ranks),
over the rate: plain float32 / 16-bit values. Nothing crosses a link on one host. ``most fp16 x``: with an
``unlimited:N`` job of as many ranks in the run, the largest ratio the machine allows: plain's time over the
larger of the 16-bit link time and fp16's time with no limit (the emulated hosts share this machine's cores:
what both hosts' ranks, helper threads and kernel network stacks compute takes that long at any link rate).

Usage:
    sudo python bench/compression.py [--settings local:2,1gbit:2,1gbit:4,10gbit:2,10gbit:4]
        [--sizes 4,16,64,256] [--rounds 5] [--repeats 1] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # hybridpipe from this checkout when it is not installed

from _common import command_line, format_ratio, launch_env, progress, render, round_ratio  # noqa: E402

MIB = 1024 * 1024


class Worker:
    """One rank: every size, the implementations interleaved; rank 0 returns the times."""

    def __init__(self, sizes: list[int], rounds: int, repeats: int) -> None:
        import hybridpipe as hp

        self.hp, self.sizes, self.rounds, self.repeats = hp, sizes, rounds, repeats
        hp.init()
        self.rank, self.size = hp.rank(), hp.size()
        from hybridpipe.comm import context

        self.comm = context.communicator(None, "bench")
        self.one_host = len(set(self.comm.allgather(__import__("socket").gethostname()))) == 1

    def implementations(self) -> dict[str, Any]:
        compression = self.hp.Compression
        chosen = {"plain": compression.none, "fp16": compression.fp16, "bf16": compression.bf16}
        if self.one_host:
            chosen["fp16.forced"] = compression.fp16.forced
        return chosen

    def timed(self, tensor: Any, compression: Any) -> float:
        from hybridpipe.comm.engine import call

        call(None, "barrier", self.comm.Barrier)
        start = time.perf_counter()
        self.hp.allreduce(tensor, op=self.hp.Average, compression=compression)
        seconds = time.perf_counter() - start
        return call(None, "slowest", lambda: self.comm.allreduce(seconds, op=__import__("mpi4py").MPI.MAX))

    def run(self) -> dict[str, Any]:
        import torch

        results: dict[str, Any] = {}
        chosen = self.implementations()
        names = list(chosen)
        for mib in self.sizes:
            tensor = torch.randn(mib * MIB // 4, generator=torch.Generator().manual_seed(self.rank))
            for name in names:  # warm-up: workspaces, shared-memory segments, TCP connections
                self.timed(tensor, chosen[name])
            rounds: dict[str, list[list[float]]] = {name: [] for name in names}
            for round_index in range(self.rounds):
                times: dict[str, list[float]] = {name: [] for name in names}
                for _ in range(self.repeats):
                    for offset in range(len(names)):
                        name = names[(round_index + offset) % len(names)]
                        times[name].append(self.timed(tensor, chosen[name]))
                for name in names:
                    rounds[name].append(times[name])
            results[str(mib)] = rounds
            if self.rank == 0:
                progress(f"  {mib} MiB done")
        return {"ranks": self.size, "rounds": results}

    def close(self) -> None:
        self.hp.shutdown()


def run_setting(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    rate, ranks = setting.split(":")
    ranks_count = int(ranks)
    with tempfile.TemporaryDirectory() as scratch:
        result_path = Path(scratch) / "result.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result_path),
                "--sizes", args.sizes, "--rounds", str(args.rounds), "--repeats", str(args.repeats)]
        env = launch_env(ranks_count)
        progress(f"{setting}: {ranks_count} ranks" + ("" if rate == "local" else f", 2 emulated hosts at {rate}"))
        if rate == "local":
            from hybridpipe.launch import find_mpirun

            command = [find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-n", ranks]
            command += [part for key, value in env.items() for part in ("-x", f"{key}={value}")] + argv
            finished = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        else:
            from hybridpipe.testing.emulated_hosts import EmulatedHosts

            with EmulatedHosts(2, rate=None if rate == "unlimited" else rate) as hosts:
                command = hosts.mpirun_command(ranks_count // 2, argv, env=env)
                finished = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        if finished.returncode != 0 or not result_path.exists():
            raise SystemExit(f"the job {setting} failed (exit {finished.returncode}):\n"
                             f"{finished.stdout[-3000:]}{finished.stderr[-3000:]}")
        return json.loads(result_path.read_text())


def table(results: dict[str, dict[str, Any]], markdown: bool) -> str:
    from hybridpipe.testing.emulated_hosts import rate_bits_per_second

    header = ["setting", "size", "plain ms", "fp16 ms", "bf16 ms", "fp16 x", "bf16 x", "link ms (f32 / 16-bit)",
              "fp16.forced ms", "most fp16 x"]
    unlimited = {(result["ranks"], mib): statistics.median(statistics.median(r) for r in rounds["fp16"]) * 1e3
                 for setting, result in results.items() if setting.startswith("unlimited:")
                 for mib, rounds in result["rounds"].items()}
    rows = []
    for setting, result in results.items():
        rate = setting.split(":")[0]
        for mib, rounds in result["rounds"].items():
            medians = {name: statistics.median(statistics.median(r) for r in values) * 1e3
                       for name, values in rounds.items()}
            link = "" if rate in ("local", "unlimited") else (
                f"{int(mib) * MIB / (rate_bits_per_second(rate) / 8) * 1e3:.0f} / "
                f"{int(mib) * MIB / 2 / (rate_bits_per_second(rate) / 8) * 1e3:.0f}")
            ratios = {name: format_ratio(*round_ratio(rounds["plain"], rounds[name]), len(rounds["plain"]))
                      for name in ("fp16", "bf16")}
            forced = f"{medians['fp16.forced']:.1f}" if "fp16.forced" in medians else ""
            most = ""
            if link and (result["ranks"], mib) in unlimited:
                floor = max(int(mib) * MIB / 2 / (rate_bits_per_second(rate) / 8) * 1e3, unlimited[result["ranks"], mib])
                most = f"{medians['plain'] / floor:.2f}"
            rows.append([f"{setting} ({result['ranks']} ranks)", f"{mib} MiB", f"{medians['plain']:.1f}",
                         f"{medians['fp16']:.1f}", f"{medians['bf16']:.1f}", ratios["fp16"], ratios["bf16"], link,
                         forced, most])
    return render(header, rows, markdown, left=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="local:2,1gbit:2,1gbit:4,10gbit:2,10gbit:4",
                        help="local:RANKS, RATE:RANKS (2 emulated hosts) or unlimited:RANKS (2 hosts, no limit), comma-separated")
    parser.add_argument("--sizes", default="4,16,64,256", help="MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (a ratio per round)")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per implementation and round")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per job")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker = Worker([int(s) for s in args.sizes.split(",")], args.rounds, args.repeats)
        try:
            result = worker.run()
            if worker.rank == 0:
                Path(args.result).write_text(json.dumps(result))
        finally:
            worker.close()
        return 0
    results = {setting: run_setting(setting, args) for setting in args.settings.split(",") if setting.strip()}
    print(f"# {command_line()}")
    print(table(results, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())

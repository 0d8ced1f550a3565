"""Point-to-point latency benchmark: hybridpipe's pipeline transport vs mpi4py vs torch.distributed gloo.

A pipeline hop is one small message from a stage to its neighbour, usually after the neighbour has
been computing for a while. This measures that: ranks 0 and 1 ping-pong a tensor, and after each
reply rank 1 pauses (``--pause-ms``, a sleep standing in for compute) before it takes the next ping,
so the ping waits for it as an activation waits for a busy stage. The pause is a sleep or, as a stage's
is, compute (``--pause-kinds``): rank 1 then computes right after handing its reply to the transport, as a
stage does after sending an activation or a gradient, and on a rank bound to one core (mpirun's default
when the ranks fit the cores) a reply the transport had to queue to the communication thread (it was in
MPI) is only posted when that thread gets the core.

Usage:
    python bench/p2p.py [--pause-ms 0,5] [--pause-kinds sleep,compute] [--bytes 256,65536] [--iterations 200]
                        [--blocks 5] [--markdown]

Run plainly, this script is the driver: it starts itself under ``mpirun -n 2 ... --worker`` (the
command comes from ``hybridpipe.launch.mpirun_command``) and prints one table from rank 0's JSON.

How it measures (a shared, noisy 2-core machine is the expected case, so it never asserts speed):
  * Implementations, all in the same job and interleaved in blocks of ``--iterations`` round trips
    with a rotating order, so machine noise hits them alike:
      - "hybridpipe": ``hybridpipe.comm.p2p.send`` / ``Receive`` after ``hp.init()``, as the pipeline
        executor uses them (a receive for the neighbour's error message posted all along, watched by every
        wait; the calling thread makes the MPI calls under the communication lock, or the engine's
        communication thread when it holds it);
      - "mpi4py": ``comm.Send`` / ``comm.Recv`` of the tensor's numpy view, on a communicator of its own
        (the MPI library alone: the floor for MPI);
      - "gloo": ``torch.distributed.send`` / ``recv`` over loopback TCP;
      - "C++ floor" (not a peer: hybridpipe's own ceiling): hybridpipe's C++ transfers alone, as a hop makes them
        (``hybridpipe._C.isend_copy`` of the tensor behind a 64-byte header, ``irecv_message`` into the receive
        buffer, ``wait_for`` with the job's wait policy: the same polite wait), without the Python of ``send`` /
        ``Receive`` around them. hybridpipe − C++ floor is what the Python of two hops costs;
      - "least Python" (not a peer either): the C++ floor plus the least Python a hop can run around it (the
        header packed from the tensor's shape, the received data viewed as a tensor): the floor of any
        Python transport built on these calls.
  * Rank 0 times each round trip; rank 1 times each pause as it actually slept (``time.sleep``
    overshoots). Reported: the median over the round trips of (round trip − the pause that fell inside
    it), i.e. the cost of two hops, and each implementation's ratio to the fastest peer.
  * The first block of each implementation is warm-up and not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (SPREAD_LIMIT, command_line, format_ratio, int_list, launch_env, progress, render,  # noqa: E402
                     round_ratio, run_worker, start_gloo)

IMPLEMENTATIONS = ("hybridpipe", "mpi4py", "gloo", "C++ floor", "least Python")
#: a hop's binary header as hybridpipe.comm.p2p lays it out (kind, dtype code, dimensions, requires_grad, shape)
HEADER = struct.Struct("<BBBB4x7q")
RATIOS = ("mpi4py", "gloo", "C++ floor")
TARGETED = ("hybridpipe", "C++ floor", "least Python")  # checked against the target: hybridpipe and its floors


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from mpi4py import MPI

        import hybridpipe as hp

        torch.set_num_threads(1)
        self.args, self.torch, self.hp = args, torch, hp
        hp.init()
        self.world = MPI.COMM_WORLD
        self.rank = self.world.Get_rank()
        if self.world.Get_size() != 2:
            raise SystemExit("bench/p2p.py runs on exactly 2 ranks")
        self.mpi_comm = self.world.Dup()  # mpi4py's own messages
        self.p2p_comm = self.world.Dup()  # hybridpipe's
        self.floor_comm = self.world.Dup()  # its C++ transfers alone
        from hybridpipe import running
        from hybridpipe._ext import core
        from hybridpipe.comm import p2p

        self.core, self.policy, self.floor_handle = core(), running.current_or_none().wait, self.floor_comm.py2f()
        self.capacity, self.empty_header = p2p.MESSAGE_CAPACITY, bytes(HEADER.size)

        # as a stage does: a receive for the neighbour's error message stays posted, and waits watch it
        self.errors = [p2p.receive_error(1 - self.rank, self.p2p_comm)]
        self.dist, self.store = start_gloo(self.world)
        self.tag = 0

    def close(self) -> None:
        self.dist.destroy_process_group()
        self.mpi_comm.Free()
        for error in self.errors:
            error.cancel()
        self.p2p_comm.Free()
        self.floor_comm.Free()
        self.hp.shutdown()

    # one round trip from rank 0's side; rank 1 answers, then pauses
    def exchange(self, name: str, tensor: Any) -> None:
        from hybridpipe.comm import p2p

        peer = 1 - self.rank
        if name == "hybridpipe":
            self.tag = (self.tag + 2) % 30000
            if self.rank == 0:
                p2p.send(tensor, peer, self.tag, self.p2p_comm)
                p2p.Receive(peer, self.tag, self.p2p_comm).wait(abort=self.errors)
            else:
                got = p2p.Receive(peer, self.tag, self.p2p_comm).wait(abort=self.errors)
                p2p.send(got, peer, self.tag, self.p2p_comm)
        elif name in ("C++ floor", "least Python"):
            self.floor_exchange(tensor, peer, name == "least Python")
        elif name == "mpi4py":
            view = tensor.numpy()
            if self.rank == 0:
                self.mpi_comm.Send(view, dest=peer)
                self.mpi_comm.Recv(view, source=peer)
            else:
                self.mpi_comm.Recv(view, source=peer)
                self.mpi_comm.Send(view, dest=peer)
        else:
            if self.rank == 0:
                self.dist.send(tensor, peer)
                self.dist.recv(tensor, peer)
            else:
                self.dist.recv(tensor, peer)
                self.dist.send(tensor, peer)

    def floor_exchange(self, tensor: Any, peer: int, python: bool) -> None:
        """hybridpipe's C++ transfers of a hop each way; with ``python``, also the least Python a hop can run around
        them (the header packed from the tensor, the received data viewed as a tensor)."""
        if self.rank == 0:
            self.floor_post(tensor, peer, python)
            self.floor_take(tensor, peer, python)
        else:
            self.floor_post(self.floor_take(tensor, peer, python), peer, python)

    def floor_post(self, tensor: Any, peer: int, python: bool) -> None:
        dims = tensor.dim()
        header = HEADER.pack(0, 0, dims, tensor.requires_grad, *tensor.shape, *(0,) * (7 - dims)) if python \
            else self.empty_header
        self.core.isend_copy(header, tensor.data_ptr(), tensor.nbytes, peer, 0, self.floor_handle)

    def floor_take(self, tensor: Any, peer: int, python: bool) -> Any:
        request, buffer = self.core.irecv_message(self.capacity, peer, 0, self.floor_handle)
        request.wait_for(-1.0, self.policy)
        if not python:
            return tensor
        del buffer[request.received_bytes:]
        _, _, dims, _, *shape = HEADER.unpack_from(buffer)
        flat = self.torch.frombuffer(buffer, dtype=self.torch.float32, offset=HEADER.size)
        return flat if dims == 1 else flat.view(shape[:dims])

    def block(self, name: str, tensor: Any, pause_s: float, kind: str) -> list[float]:
        """``iterations`` round trips; returns (rank 0) the round trips less the pause inside each."""
        iterations = self.args.iterations
        times, pauses = [], []
        before = self.core.transfer_counts()
        self.world.Barrier()
        for _ in range(iterations):
            start = time.perf_counter()
            self.exchange(name, tensor)
            if self.rank == 0:
                times.append(time.perf_counter() - start)
            elif pause_s:
                slept = time.perf_counter()
                if kind == "sleep":
                    time.sleep(pause_s)
                else:  # compute on this rank's core until the pause is over
                    a = self.torch.ones(64, 64)
                    while time.perf_counter() - slept < pause_s:
                        a = self.torch.tanh(a @ a * 0.01)
                pauses.append(time.perf_counter() - slept)
            else:
                pauses.append(0.0)
        after = self.core.transfer_counts()
        if name == "hybridpipe":  # both ranks' transfers, and those queued to the communication thread
            posted = [after[key] - before[key] for key in ("posted_here", "posted_by_driver")]
            self.queued = [total + self.world.allreduce(value) for total, value in zip(self.queued, posted)]
        pauses = self.world.bcast(pauses, root=1)
        # rank 1's pause after reply i delays round trip i + 1 (the first has none inside it)
        return [t - p for t, p in zip(times[1:], pauses[:-1])] if self.rank == 0 else []

    def run(self) -> dict[str, Any]:
        results = []
        for nbytes in self.args.bytes:
            tensor = self.torch.zeros(max(1, nbytes // 4))
            for pause_ms, kind in pause_cases(self.args):
                samples: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
                rounds: dict[str, list[list[float]]] = {name: [] for name in IMPLEMENTATIONS}
                self.queued = [0, 0]
                for round_index in range(self.args.blocks + 1):
                    shift = round_index % len(IMPLEMENTATIONS)
                    for name in IMPLEMENTATIONS[shift:] + IMPLEMENTATIONS[:shift]:
                        got = self.block(name, tensor, pause_ms / 1e3, kind)
                        if round_index > 0:
                            samples[name] += got
                            rounds[name].append(got)
                if self.rank == 0:
                    medians = {name: statistics.median(values) for name, values in samples.items()}
                    results.append({"bytes": nbytes, "pause_ms": pause_ms, "pause": kind, "seconds": medians,
                                    "rounds": rounds, "p90": statistics.quantiles(samples["hybridpipe"], n=10)[-1],
                                    "posted": self.queued})
                    shown = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in medians.items())
                    progress(f"{nbytes} B, pause {pause_ms} ms ({kind}): {shown}")
        return {"cases": results}


def pause_cases(args: argparse.Namespace) -> list[tuple[float, str]]:
    """(pause ms, kind) in order; a pause of 0 once, whatever the kinds."""
    return [(pause, kind) for pause in args.pause_ms for kind in (args.pause_kinds if pause else args.pause_kinds[:1])]


def launch(args: argparse.Namespace, result_path: Path) -> dict[str, Any]:
    from hybridpipe.launch import mpirun_command

    env = launch_env(2)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result_path),
            "--pause-ms", ",".join(str(p) for p in args.pause_ms), "--pause-kinds", ",".join(args.pause_kinds), "--bytes", ",".join(str(b) for b in args.bytes),
            "--iterations", str(args.iterations), "--blocks", str(args.blocks)]
    command = mpirun_command(2, argv, env=env)
    progress(shlex.join(command))
    completed = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=sys.stderr, timeout=args.timeout,
                               check=False)
    if completed.returncode != 0 or not result_path.exists():
        raise SystemExit(f"bench: the run failed (mpirun exit status {completed.returncode}); its output is above")
    return json.loads(result_path.read_text())


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    from hybridpipe._ext import describe

    header = ["bytes", "pause ms", "pause", *(f"{name} ms" for name in IMPLEMENTATIONS),
              *(f"hybridpipe / {peer}" for peer in RATIOS), "≤ 2 × mpi4py + 0.02 ms",
              *(f"{name} ≤ target" for name in TARGETED[1:]), "hybridpipe p90 ms", "queued to the thread"]
    rows = []
    for case in result["cases"]:
        s, rounds = case["seconds"], case["rounds"]
        ratios = {peer: round_ratio(rounds["hybridpipe"], rounds[peer]) for peer in RATIOS}
        target = 2 * s["mpi4py"] + 20e-6
        rows.append([str(case["bytes"]), str(case["pause_ms"]), case["pause"] if case["pause_ms"] else "",
                     *(f"{s[name] * 1e3:.3f}" for name in IMPLEMENTATIONS),
                     *(format_ratio(*ratios[peer], len(rounds["hybridpipe"])) for peer in RATIOS),
                     *(f"{'yes' if s[name] <= target else 'no'}" + (f" ({target * 1e3:.3f} ms)" if name == "hybridpipe"
                                                                    else "") for name in TARGETED),
                     f"{case['p90'] * 1e3:.3f}", f"{case['posted'][1]} of {sum(case['posted'])}"])
    setup = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {describe()}; "
             f"{os.cpu_count()} CPU cores; 2 ranks; {args.iterations} round trips × {args.blocks} blocks per cell")
    md = args.markdown
    lines = [f"Command: `{command_line()}`" + ("  " if md else ""), f"Setup: {setup}" + ("  " if md else ""),
             "Cells: median of (round trip − the pause inside it) = two hops; ratio > 1: hybridpipe is slower; a ratio "
             f"is the median over the rounds of each round's ratio of medians, UNSTABLE where its rounds spread by "
             f"more than {SPREAD_LIMIT:.0%}; queued to the thread: of hybridpipe's transfers (both ranks, the timed "
             "rounds and the warm-up), those the communication thread posted because it held the lock", "",
             render(header, rows, md, left=3)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pause-ms", default="0,5", type=lambda t: [float(v) for v in t.split(",") if v.strip()],
                        help="rank 1's pause after each reply, in ms (default 0,5)")
    parser.add_argument("--pause-kinds", default="sleep,compute",
                        type=lambda t: [v.strip() for v in t.split(",") if v.strip()],
                        help="what rank 1 does in its pause: sleep and/or compute (default sleep,compute)")
    parser.add_argument("--bytes", default="256,65536", type=lambda t: int_list(t, "--bytes"),
                        help="message sizes in bytes (default 256,65536)")
    parser.add_argument("--iterations", type=int, default=100, help="round trips per block (default 100)")
    parser.add_argument("--blocks", type=int, default=5,
                        help="timed rounds, each a block of every implementation in rotating order (default 5)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for the mpirun (default 600)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(p < 0 for p in args.pause_ms) or not args.pause_ms:
        parser.error(f"--pause-ms needs non-negative numbers (got {args.pause_ms})")
    if not args.pause_kinds or set(args.pause_kinds) - {"sleep", "compute"}:
        parser.error(f"--pause-kinds takes sleep and/or compute (got {args.pause_kinds})")
    if args.iterations < 2 or args.blocks < 1:
        parser.error(f"--iterations must be >= 2 and --blocks >= 1 (got {args.iterations}, {args.blocks})")
    if args.worker and not args.result:
        parser.error("--worker needs --result PATH")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(Worker(args), args.result)
    with tempfile.TemporaryDirectory(prefix="hybridpipe-bench-p2p-") as scratch:
        result = launch(args, Path(scratch) / "result.json")
    print(report(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pieces the benchmark drivers share: progress lines, argument and table helpers, the worker
entry, the command line for the report, torch.distributed on gloo over loopback beside MPI, and the run's
record in bench/results/.

A driver run with ``--markdown`` (the tables the docs show) also writes ``bench/results/<bench>-<UTC time>.json``
when it ends: the tables it printed, its command line and the machine (:func:`machine`), one file per run.
``HYBRIDPIPE_BENCH_RESULTS=DIR`` writes there instead, ``=0`` not at all."""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} needs comma-separated integers (got {text!r})") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{what} needs positive integers (got {text!r})")
    return values


RESULTS = Path(__file__).resolve().parent / "results"
_rendered: list[dict[str, Any]] = []  # the tables this run printed, for its record


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, GPU, MPI, torch, Python."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), "")
    memory = next((int(line.split()[1]) * 1024 for line in _read("/proc/meminfo").splitlines()
                   if line.startswith("MemTotal:")), 0)
    described: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": memory,
                                 "python": sys.version.split()[0], "host": os.uname().nodename}
    torch = sys.modules.get("torch")
    if torch is not None:
        described["torch"] = torch.__version__
        if torch.cuda.is_available():
            described["gpu"] = torch.cuda.get_device_name(0)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        described["mpi"] = mpi.Get_library_version().splitlines()[0].strip()
    return described


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def save_run(bench: str, tables: list[dict[str, Any]], where: Path | None = None) -> Path:
    """Writes one run's record (``bench/results/<bench>-<UTC time>.json``); returns its path."""
    now = datetime.datetime.now(datetime.timezone.utc)
    folder = where or RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{bench}-{now.strftime('%Y-%m-%dT%H%M%SZ')}.json"
    record = {"bench": bench, "date": now.isoformat(timespec="seconds"), "command": command_line(),
              "machine": machine(), "tables": tables}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def _save_rendered() -> None:
    setting = os.environ.get("HYBRIDPIPE_BENCH_RESULTS", "")
    if not _rendered or "--markdown" not in sys.argv or setting == "0":
        return
    path = save_run(Path(sys.argv[0]).stem, _rendered, Path(setting) if setting else None)
    print(f"(this run's record: {path})", file=sys.stderr)


atexit.register(_save_rendered)


def render(header: list[str], rows: list[list[str]], markdown: bool, left: int = 2) -> str:
    """A Markdown or plain-text table; the first ``left`` columns are left-aligned, the rest right. Every table
    is also kept for the run's record (see the module's docstring)."""
    _rendered.append({"header": list(header), "rows": [list(row) for row in rows]})
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if i < left else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def command_line() -> str:
    """This process's command line for the report, the interpreter relative to the working directory."""
    here = Path.cwd()
    python = sys.executable
    if Path(python).is_relative_to(here):
        python = str(Path(python).relative_to(here))
    return shlex.join([python, *sys.argv])


def launch_env(ranks: int) -> dict[str, str]:
    """The environment of a benchmark's mpirun of ``ranks`` ranks: one thread per process, this shell's
    HYBRIDPIPE_* settings, and yielding MPI waits when the ranks outnumber the cores."""
    from hybridpipe.launch import available_cores

    env = {"OMP_NUM_THREADS": "1"}
    env.update({k: v for k, v in os.environ.items() if k.startswith("HYBRIDPIPE_") and k != "HYBRIDPIPE_MPIRUN"})
    if ranks > available_cores():
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    return env


def run_worker(worker: Any, result_path: str) -> int:
    """Runs one rank's worker; rank 0 writes the JSON result the driver reads; always closes it."""
    try:
        result = worker.run()
        if worker.rank == 0:
            Path(result_path).write_text(json.dumps(result, indent=1))
    finally:
        worker.close()
    return 0


def start_gloo(comm: Any, timeout_s: float = 300.0, address: str = "127.0.0.1") -> tuple[Any, Any]:
    """Initializes torch.distributed's gloo process group over the ranks of the mpi4py ``comm``.

    Rank 0 opens the rendezvous store itself on port 0 (the kernel picks a free port, so no other
    process can take it between choosing and binding) without waiting for the others, then
    broadcasts the port over MPI. ``address``: where rank 0's store listens (loopback by default: then gloo's
    sockets stay on ``lo`` unless GLOO_SOCKET_IFNAME says otherwise; across emulated hosts, host 0's address).
    Returns ``(torch.distributed, store)``; keep the store alive.

    Raises:
        RuntimeError: on every rank, naming the failing ranks, when gloo could not start on one of
            them (the caller decides whether its columns stay empty or the launch fails).
    """
    import torch.distributed as dist

    if address == "127.0.0.1":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    rank, size = comm.Get_rank(), comm.Get_size()
    store, port, error = None, 0, ""
    if rank == 0:
        try:
            store = dist.TCPStore(address, 0, size, True, timeout=timeout, wait_for_workers=False)
            port = store.port
        except Exception as exc:  # noqa: BLE001 — reported to every rank below
            error = f"rank 0 could not open a TCPStore on {address} ({exc})"
    port = comm.bcast(port, root=0)
    if port:
        try:
            if store is None:
                store = dist.TCPStore(address, port, size, False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 — reported to every rank below
            error = f"rank {rank}: gloo init on {address}:{port} failed ({exc})"
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise RuntimeError("; ".join(errors))
    return dist, store


def timed_steps(model: Any, optimizer: Any, inputs: Any, targets: Any, count: int) -> list[float]:
    """Seconds of each of ``count`` training steps of a PipelineModel (zero_grad, train_step, step), every rank
    leaving a barrier before each, so that a step's time is the pipeline's, not a late start's."""
    import hybridpipe as hp

    times = []
    for _ in range(count):
        hp.barrier()
        started = time.perf_counter()
        optimizer.zero_grad()
        model.train_step(inputs, targets)
        optimizer.step()
        times.append(time.perf_counter() - started)
    return times


#: A ratio whose rounds spread wider than this (max − min over the median) is flagged as not holding.
SPREAD_LIMIT = 0.25


def round_ratio(numerator_rounds: list[list[float]], denominator_rounds: list[list[float]]) -> tuple[float, float]:
    """The median over rounds of each round's ratio of medians, and its spread ((max − min) / median of the rounds'
    ratios). The rounds ran interleaved (both sides in each), so a spell of a slow machine hits both sides of a
    round's ratio alike; the spread says whether the ratio holds from round to round."""
    import statistics

    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(numerator_rounds, denominator_rounds)
              if a and b and statistics.median(b) > 0]
    if not ratios:
        return float("nan"), float("nan")
    middle = statistics.median(ratios)
    return middle, (max(ratios) - min(ratios)) / middle if middle else float("inf")


def format_ratio(ratio: float, spread: float, rounds: int) -> str:
    """``1.23 (±9 % over 5 rounds)``, flagged when the spread is over :data:`SPREAD_LIMIT`."""
    text = f"{ratio:.2f} (spread {spread:.0%} over {rounds} rounds)"
    return text + (" UNSTABLE" if spread > SPREAD_LIMIT else "")

"""GPU allreduce benchmark: CUDA tensors through hybridpipe (the staged route: device → host → reduce → device,
in segments whose copies overlap the reduction; and, where the MPI library moves device memory, the cuda-aware
route) beside torch.distributed's gloo on the same CUDA tensors, the same hybridpipe allreduce on host tensors,
and the device↔host copies alone, in one job (and MPI_Allreduce on device memory, where the library takes it;
and, where every rank has a GPU of its own, hybridpipe's NCCL through cupy and torch.distributed's NCCL).
The MPI columns run with HYBRIDPIPE_GPU_ALLREDUCE=mpi, so that NCCL, where it is there, does not run them.

Usage (each rank uses GPU local_rank mod the visible GPUs; ranks may share one):
    mpirun -n 2 python bench/gpu.py [--sizes 4KiB,256KiB,4MiB,64MiB,256MiB] [--repeats 10] [--markdown]
                                    [--ring-segments 1GiB,16MiB]

How it measures: every repetition calls each implementation once, in a rotating order, after an MPI barrier;
a repetition's time is the max over ranks, the reported time the median over repetitions (after a warm-up
call that also checks the result: every rank holds rank + 1, the sum must be n(n+1)/2). busbw = bytes / time ·
2(n−1)/n, GB = 10^9 bytes. "copies" is one device→host plus one host→device copy of the buffer, the least a
staged allreduce adds to the host one: the "staged ceiling" is host allreduce + copies, and the last column
is that ceiling's time over hybridpipe's staged time (1.0: staging costs nothing beyond the copies; above 1.0:
the copies overlap the reduction).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import hybridpipe as hp  # noqa: E402
from hybridpipe.config import parse_bytes  # noqa: E402


@contextlib.contextmanager
def route(cuda_aware_mpi: str, gpu_allreduce: str = "mpi", ring_segment: int | None = None):
    """Runs the block with HYBRIDPIPE_CUDA_AWARE_MPI set to ``cuda_aware_mpi`` (1: cuda-aware, 0: staged) and
    HYBRIDPIPE_GPU_ALLREDUCE to ``gpu_allreduce`` (``mpi`` by default: where each rank has a GPU of its own and cupy
    brings NCCL, ``auto`` would run every column's allreduce on NCCL); ``ring_segment``: the device ring's segment
    (HYBRIDPIPE_DEVICE_RING_SEGMENT_BYTES) if not the configured one."""
    from hybridpipe.comm import context

    ctx = context.current("bench")
    saved = ctx.config
    ctx.config = dataclasses.replace(saved, cuda_aware_mpi=cuda_aware_mpi, gpu_allreduce=gpu_allreduce,
                                     device_ring_segment_bytes=ring_segment or saved.device_ring_segment_bytes)
    try:
        yield
    finally:
        ctx.config = saved


def timed(function, comm: MPI.Comm) -> float:
    comm.Barrier()
    start = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4KiB,256KiB,4MiB,64MiB,256MiB")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--ring-segments", default="",
                        help="more cuda-aware columns, one per device-ring segment size (e.g. 1GiB,16MiB: "
                             "HYBRIDPIPE_DEVICE_RING_SEGMENT_BYTES), beside the configured one")
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore", message="hybridpipe stages")
    grid = hp.init()
    comm, n, rank = MPI.COMM_WORLD, grid.size, grid.rank
    gloo = None
    try:
        import torch.distributed as dist

        port = comm.bcast(29500 + os.getpid() % 1000 if rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
        gloo = dist
    except Exception as error:  # noqa: BLE001 — reported, the other columns still run
        if rank == 0:
            print(f"torch.distributed gloo unavailable: {error}")
    # NCCL (hybridpipe's through cupy, and torch's as its peer) needs a GPU of its own per rank
    places = comm.allgather(hp.comm.device.gpu_place(torch.cuda.current_device()))
    use_nccl, no_nccl = hp.comm.device.nccl_decision("auto", places)
    torch_nccl = None
    if gloo is not None and len({place[1:] for place in places}) == n and torch.distributed.is_nccl_available():
        torch_nccl = gloo.new_group(backend="nccl")
    if rank == 0 and not use_nccl:
        print(f"no hybridpipe NCCL column: {no_nccl}")
    expected = n * (n + 1) / 2
    rows = []
    for text in args.sizes.split(","):
        size = parse_bytes(text)
        count = size // 4
        on_gpu = torch.full((count,), float(rank + 1), device="cuda")
        on_host = torch.full((count,), float(rank + 1))
        pinned = torch.empty(count, pin_memory=True)

        def staged():
            on_gpu.fill_(rank + 1)
            with route("0"):
                hp.allreduce_(on_gpu, op=hp.Sum)

        def cuda_aware():
            on_gpu.fill_(rank + 1)
            with route("1"):
                hp.allreduce_(on_gpu, op=hp.Sum)

        def host():
            on_host.fill_(rank + 1)
            hp.allreduce_(on_host, op=hp.Sum)

        def copies():
            pinned.copy_(on_gpu)
            on_gpu.copy_(pinned)

        def gloo_cuda():
            on_gpu.fill_(rank + 1)
            gloo.all_reduce(on_gpu)

        def nccl():
            on_gpu.fill_(rank + 1)
            with route("0", "nccl"):
                hp.allreduce_(on_gpu, op=hp.Sum)

        def torch_nccl_cuda():
            on_gpu.fill_(rank + 1)
            gloo.all_reduce(on_gpu, group=torch_nccl)

        columns = {"hybridpipe staged (cuda)": staged, "hybridpipe (host)": host, "copies d2h+h2d": copies}
        def library():
            on_gpu.fill_(rank + 1)
            torch.cuda.synchronize()
            memory = MPI.buffer.fromaddress(on_gpu.data_ptr(), on_gpu.numel() * 4)
            comm.Allreduce(MPI.IN_PLACE, [memory, MPI.FLOAT], op=MPI.SUM)

        def segmented(segment: int):
            def run():
                on_gpu.fill_(rank + 1)
                with route("1", ring_segment=segment):
                    hp.allreduce_(on_gpu, op=hp.Sum)
            return run

        if hp.comm.device.mpi_cuda_support() == 1:
            columns["hybridpipe cuda-aware (cuda)"] = cuda_aware
            for segment_text in filter(None, args.ring_segments.split(",")):
                columns[f"cuda-aware, ring segment {segment_text} (cuda)"] = segmented(parse_bytes(segment_text))
            columns["MPI_Allreduce (cuda memory)"] = library
        if gloo is not None:
            columns["torch gloo (cuda)"] = gloo_cuda
        if use_nccl:
            columns["hybridpipe nccl (cuda)"] = nccl
        if torch_nccl is not None:
            columns["torch nccl (cuda)"] = torch_nccl_cuda
        checks = {}
        for name, function in columns.items():
            function()
            torch.cuda.synchronize()
            if name != "copies d2h+h2d":
                value = on_gpu if "cuda" in name else on_host
                checks[name] = bool(torch.all(value == expected).item())
        times: dict[str, list[float]] = {name: [] for name in columns}
        names = list(columns)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                times[name].append(timed(columns[name], comm))
        medians = {name: statistics.median(values) for name, values in times.items()}
        rows.append((text, size, medians, checks))
        on_gpu = on_host = pinned = None  # freed before the next size's buffers
    if rank == 0:
        ring_segment = hp.comm.context.current("bench").config.device_ring_segment_bytes
        names = list(rows[0][2])
        factor = 2 * (n - 1) / n
        print(f"{n} ranks, {torch.cuda.device_count()} visible GPU(s) ({torch.cuda.get_device_name(0)}); "
              f"{hp.comm.device.describe()}; device ring segment {ring_segment >> 20} MiB; median of {args.repeats}, "
              "busbw GB/s (ms)")
        header = ["size", *names, "staged ceiling / staged"]
        separator = " | " if args.markdown else "  "
        lines = [header]
        for text, size, medians, checks in rows:
            cells = [text]
            for name in names:
                seconds = medians[name]
                bandwidth = size / seconds / 1e9 * (1 if name.startswith("copies") else factor)
                flag = "" if checks.get(name, True) else " WRONG"
                cells.append(f"{bandwidth:.2f} ({seconds * 1e3:.2f}){flag}")
            ceiling = medians["hybridpipe (host)"] + medians["copies d2h+h2d"]
            cells.append(f"{ceiling / medians['hybridpipe staged (cuda)']:.2f}")
            lines.append(cells)
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        for index, line in enumerate(lines):
            text = separator.join(cell.ljust(width) for cell, width in zip(line, widths))
            print(f"| {text} |" if args.markdown else text)
            if args.markdown and index == 0:
                print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        print("copies column: bytes / time of one d2h + one h2d copy (pinned host buffer)")
    if gloo is not None:
        gloo.destroy_process_group()
    hp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

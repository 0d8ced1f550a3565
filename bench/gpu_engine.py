"""The engine's allreduce_async_ of many CUDA tensors (Horovod's per-gradient path): each bucket packed on the GPU
by one kernel each way (a build with the CUDA kernels; reduced in device memory with a CUDA-aware MPI, else
through pinned host memory, one copy each way) against a copy down and up per tensor (what an extension built
without nvcc does), alternating round by round in one job.

Usage (a CUDA GPU; ranks may share one):
    mpirun -n 2 python bench/gpu_engine.py

A round submits every tensor of a set with hp.allreduce_async_, then waits for all; its time is the max over
ranks; the first two rounds are warm-up; the reported time is the median of 15 rounds per variant. The
per-tensor variant is reached by switching off hybridpipe.collectives.allreduce's check for the CUDA kernels in this
process (a benchmark's reach into the module, not an API). Every round's result is checked.
"""
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import hybridpipe as hp  # noqa: E402
from hybridpipe.collectives import allreduce as engine  # noqa: E402

if not torch.cuda.is_available() or not hp.cuda_built():
    sys.exit("bench/gpu_engine.py needs a CUDA GPU and the extension built with its CUDA kernels (nvcc)")

hp.init(pipeline_stages=1)
comm = MPI.COMM_WORLD
rank = hp.rank()
shapes = {"64 small (1-4 KiB)": [256 + 8 * i for i in range(64)],
          "64 mixed (4 KiB-1 MiB)": [1024 * (1 + (i * 37) % 256) for i in range(64)],
          "200 tiny (bias-sized)": [64 + i for i in range(200)]}
real = engine._device_fusion
for label, counts in shapes.items():
    tensors = [torch.full((n,), float(rank + 1), device="cuda") for n in counts]
    times = {"packed on the GPU": [], "per-tensor staging": []}
    for round_ in range(32):
        variant = list(times)[round_ % 2]
        engine._device_fusion = real if variant == "packed on the GPU" else (lambda: False)
        for t in tensors:
            t.fill_(rank + 1)
        torch.cuda.synchronize()
        comm.Barrier()
        start = time.perf_counter()
        handles = [hp.allreduce_async_(t, name=f"{label}.{i}", op=hp.Sum) for i, t in enumerate(tensors)]
        for h in handles:
            hp.synchronize(h)
        torch.cuda.synchronize()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        ok = all(bool(torch.all(t == sum(range(1, hp.size() + 1))).item()) for t in tensors)
        if round_ >= 2:
            times[variant].append(elapsed)
        if not ok:
            print(f"WRONG result: {label}, {variant}", file=sys.stderr)
    engine._device_fusion = real
    if rank == 0:
        medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{label}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items()) +
              f"; staging / packed = {medians['per-tensor staging'] / medians['packed on the GPU']:.2f}")
if rank == 0:
    stats = hp.engine_stats("world")
    print(f"packed buckets: {stats['cuda_buckets']} (in device memory, a CUDA-aware MPI: "
          f"{stats['cuda_aware_buckets']}), their kernels and copies: {stats['cuda_launches']}")
hp.shutdown()

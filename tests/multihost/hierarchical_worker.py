"""One rank of tests/test_multihost.py's hierarchical allreduce cases: world spans 2 emulated hosts
(2 + 2 or 3 + 1 ranks). Every dtype and op through hp.allreduce, hp.grouped_allreduce and the
engine (allreduce_async_) against numpy; the hierarchy's call count proves which path ran, and with
HYBRIDPIPE_HIERARCHICAL=0 the flat ring must run instead (worker.py's part "flat" calls main after
setting it). Prints "rank R ok: LABEL".
"""

import os
import sys

import numpy as np
import torch
from mpi4py import MPI

import compression_checks  # beside this file
import hybridpipe as hp
from hybridpipe._ext import core
from hybridpipe.comm import context
from hybridpipe.comm.engine import call

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = {"Sum": hp.Sum, "Average": hp.Average, "Min": hp.Min, "Max": hp.Max}
COUNT = 50_021  # above the small-message cutoff for every dtype; not a multiple of the pieces


def contribution(dtype, count, rank, salt):
    generator = np.random.default_rng([rank, count, salt])
    if dtype.is_floating_point:
        values = generator.standard_normal(count) * 4
        return torch.from_numpy(values).to(dtype)
    return torch.from_numpy(generator.integers(-1000, 1000, count)).to(dtype)


def expected(dtype, count, size, salt, op):
    stacked = np.stack([contribution(dtype, count, r, salt).double().numpy() for r in range(size)])
    if op == "Sum":
        return stacked.sum(0)
    if op == "Average":
        total = stacked.sum(0)
        return total / size if dtype.is_floating_point else np.trunc(total / size)
    return stacked.min(0) if op == "Min" else stacked.max(0)


def check(got, dtype, count, size, salt, op, what):
    want = expected(dtype, count, size, salt, op)
    got = got.double().numpy()
    if not dtype.is_floating_point or op in ("Min", "Max"):
        np.testing.assert_array_equal(got, want, err_msg=f"{what} {dtype} {op}")
    else:  # float sums in another order; half types rounded after each level
        tolerance = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * 4 * size, err_msg=f"{what} {dtype} {op}")


def chunked(comm, rank, size, salt):
    """The hierarchical allreduce forced, in small chunks (a pipeline of many chunks, with the helper thread) and
    in one: every dtype and op equals numpy, on odd counts and counts below the number of pieces; float32 and
    int64 sums are bitwise the same in both (two hosts: each element's additions happen in the same order)."""
    from hybridpipe.comm.buffers import dtype_code

    def run(tensor, op, chunk_bytes):
        options = context.allreduce_options_for(hp.config())
        options.hierarchical_chunk_bytes = chunk_bytes
        address = tensor.data_ptr()
        call(None, "chunked", lambda: core().allreduce(address, address, tensor.numel(), dtype_code(tensor), int(op),
                                                       comm.py2f(), options, [], core().AllreduceAlgorithm.Hierarchical))
        return tensor

    info = lambda: core().hierarchy_info(comm.py2f())  # noqa: E731 (cached: no communication)
    for count in (COUNT, 2_999, 1):
        for dtype in DTYPES:
            for name, op in OPS.items():
                salt += 1
                before = info()["pipelined_chunks"]
                got = run(contribution(dtype, count, rank, salt), op, 4096)
                check(got, dtype, count, size, salt, name, f"chunked {count}")
                if count == COUNT:
                    assert info()["pipelined_chunks"] - before > 10, (before, info())
                    whole = run(contribution(dtype, count, rank, salt), op, 0)
                    if name == "Sum" and dtype in (torch.float32, torch.int64):
                        assert torch.equal(got, whole), (dtype, name, (got != whole).sum())


def main(layout_text: str, label: str = "hierarchical") -> int:
    hp.init()
    world = MPI.COMM_WORLD
    size = world.size
    layout = [int(n) for n in layout_text.split("+")]
    flat = os.environ.get("HYBRIDPIPE_HIERARCHICAL") == "0"
    comm = context.communicator(None, "test")
    info = call(None, "hierarchy", lambda: core().hierarchy_info(comm.py2f()))
    assert info["ranks_per_host"] == layout and info["hosts"] == 2 and info["pieces"] == max(layout), info
    assert info["useful"], info

    def calls():
        return core().hierarchy_info(comm.py2f())["calls"]  # cached now: no communication

    salt = 0
    for dtype in DTYPES:
        for name, op in OPS.items():
            salt += 1
            before = calls()
            got = hp.allreduce(contribution(dtype, COUNT, world.rank, salt), op=op)
            check(got, dtype, COUNT, size, salt, name, "allreduce")
            assert calls() == before + (0 if flat else 1), (dtype, name, before, calls())
    # grouped (fused buckets) and the engine's buckets, float32 and int64 sums
    for dtype in (torch.float32, torch.int64):
        salt += 1
        counts = [COUNT, 7, 20_000, 1]
        before = calls()
        got = hp.grouped_allreduce([contribution(dtype, n, world.rank, salt + i) for i, n in enumerate(counts)],
                                   op=hp.Sum)
        for i, (n, tensor) in enumerate(zip(counts, got)):
            check(tensor, dtype, n, size, salt + i, "Sum", "grouped_allreduce")
        assert (calls() > before) != flat, (before, calls())
        salt += len(counts)
        tensors = [contribution(dtype, n, world.rank, salt + i) for i, n in enumerate(counts)]
        handles = [hp.allreduce_async_(t, name=f"h{salt}.{i}", op=hp.Sum) for i, t in enumerate(tensors)]
        for handle in handles:
            hp.synchronize(handle)
        for i, (n, tensor) in enumerate(zip(counts, tensors)):
            check(tensor, dtype, n, size, salt + i, "Sum", "engine")
        salt += len(counts)
    if not flat:
        chunked(comm, world.rank, size, salt)
    compression_checks.check(comm, world.rank, size)
    print(f"rank {world.rank} ok: {label} on {MPI.Get_processor_name()}", flush=True)
    hp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""Compression across emulated hosts (hierarchical_worker.py runs it in each of its launches: 2 + 2 and 3 + 1
ranks hierarchical, 2 + 2 flat): hp.allreduce with hp.Compression.fp16 / bf16 for every op, and the engine's
allreduce_async_ with a wire format, stay within the wire dtype's rounding of the float32 result, agree on every
rank, and the ring's bytes between hosts are about half of float32's."""

import numpy as np
import torch

import hybridpipe as hp
from hybridpipe._ext import core
from hybridpipe.comm.engine import call
from hybridpipe.data_parallel.compression import wire_for

OPS = {"Sum": hp.Sum, "Average": hp.Average, "Min": hp.Min, "Max": hp.Max}
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
COUNT = 400_009


def contribution(rank, salt, count=COUNT):
    generator = np.random.default_rng([rank, salt, count, 35])
    return torch.from_numpy(generator.standard_normal(count) * 3 + generator.integers(-2, 3, count) * 1000.5).float()


def excess(got, size, salt, op, unit):
    """How far ``got`` lies outside the rounding bound (<= 0: inside): each element's error at most
    size * unit * the sum of the magnitudes (a partial sum rounded at each hop, the result once)."""
    stacked = torch.stack([contribution(r, salt).double() for r in range(size)])
    scale = stacked.abs().sum(0) * size
    want = {"Sum": stacked.sum(0), "Average": stacked.sum(0) / size, "Min": stacked.min(0).values,
            "Max": stacked.max(0).values}[op]
    if op == "Average":
        scale = scale / size
    return ((got.double() - want).abs() - scale * unit).max().item()


def check(comm, rank, size):
    """Every op and wire dtype through hp.allreduce, and one engine allreduce; raises AssertionError."""
    def total_sent(before):  # bytes the ring and the library handed to MPI, all ranks together
        return call(None, "sent", lambda: comm.allreduce(core().wire_bytes_sent() - before))

    salt = 0
    for wire in ("fp16", "bf16"):
        for name, op in OPS.items():
            salt += 1
            before = core().wire_bytes_sent()
            plain = hp.allreduce(contribution(rank, salt), op=op)
            plain_bytes = total_sent(before)
            before = core().wire_bytes_sent()
            got = hp.allreduce(contribution(rank, salt), op=op, compression=getattr(hp.Compression, wire))
            compressed_bytes = total_sent(before)
            assert excess(got, size, salt, name, UNIT[wire]) <= 1e-6, (wire, name)
            assert not torch.equal(got, plain), (wire, name)
            everyone = hp.allgather(got.reshape(1, -1))
            assert all(torch.equal(row, everyone[0]) for row in everyone), (wire, name)
            assert compressed_bytes < 0.6 * plain_bytes, (wire, name, compressed_bytes, plain_bytes)
    salt += 1
    tensor = contribution(rank, salt)
    hp.allreduce_async_(tensor, name="compression.engine", op=hp.Average,
                        wire=wire_for(hp.Compression.fp16, tensor, hp.Average)).wait()
    assert excess(tensor, size, salt, "Average", UNIT["fp16"]) <= 1e-6

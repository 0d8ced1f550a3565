"""Compression inside the ring (hp.Compression.fp16 / bf16) on 2 ranks of one host: ``.forced`` runs the ring
with the wire dtype (each segment rounded as it is sent, accumulated in float32), the plain spelling leaves
the shared-memory path to reduce float32 as it is, and custom compressors keep Horovod's whole-tensor path.
Every op (Sum, Average, Min, Max) through hp.allreduce (the ring, and the MPI library for small tensors), hp.grouped_allreduce, the engine
(hp.allreduce_async_) and DistributedOptimizer: within the wire dtype's rounding of the float32 result,
the same on every rank, and half the ring's bytes. The paths across hosts (flat ring and hierarchical) are
checked on emulated hosts (tests/multihost/compression_checks.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe._ext import core
from hybridpipe.errors import MismatchError

pytestmark = pytest.mark.mpi(ranks=[2], timeout=180, shared=True)
torch.set_num_threads(1)

N, R = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank
OPS = {"Sum": hp.Sum, "Average": hp.Average, "Min": hp.Min, "Max": hp.Max}
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}  # the wire dtype's unit roundoff
COUNT = 100_003  # above the small-message cutoff (the ring runs), odd


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hp.init()
    yield
    hp.shutdown()


def contribution(rank: int, salt: int, count: int = COUNT) -> torch.Tensor:
    """float32 values with more mantissa than the wire dtypes keep, some of them large."""
    generator = np.random.default_rng([rank, salt, count])
    return torch.from_numpy(generator.standard_normal(count) * 3 + generator.integers(-2, 3, count) * 1000.5).float()


def reference(salt: int, op: str, count: int = COUNT) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 result of ``op`` over every rank's contribution, and each element's rounding bound for a wire
    unit of 1: the sum of the magnitudes (a partial sum rounded at each of the N - 1 hops and the result once)."""
    stacked = torch.stack([contribution(r, salt, count).double() for r in range(N)])
    scale = stacked.abs().sum(0) * N
    if op == "Sum":
        return stacked.sum(0), scale
    if op == "Average":
        return stacked.sum(0) / N, scale / N
    return (stacked.min(0).values if op == "Min" else stacked.max(0).values), scale


def within(got: torch.Tensor, salt: int, op: str, unit: float) -> tuple[bool, float]:
    want, scale = reference(salt, op, got.numel())
    excess = ((got.double() - want).abs() - scale * unit).max().item()
    return excess <= 1e-6, excess


def same_everywhere(tensor: torch.Tensor) -> bool:
    everyone = hp.allgather(tensor.reshape(1, -1))
    return all(torch.equal(row, everyone[0]) for row in everyone)


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_forced_compression_rounds_within_the_wire_dtype_for_every_op_and_halves_the_ring_bytes(wire):
    compression = getattr(hp.Compression, wire)
    results, sent = {}, {}
    for salt, (name, op) in enumerate(OPS.items()):
        for spelling in ("plain", "forced"):
            before = core().wire_bytes_sent()
            chosen = compression.forced if spelling == "forced" else hp.Compression.none
            results[name, spelling] = hp.allreduce(contribution(R, salt), op=op, compression=chosen)
            sent[name, spelling] = core().wire_bytes_sent() - before
        results[name, "small"] = hp.allreduce(contribution(R, salt, 999), op=op, compression=compression.forced)
    agreed = {name: same_everywhere(results[name, "forced"]) for name in OPS}
    with ranks_agree():
        for salt, name in enumerate(OPS):
            got = results[name, "forced"]
            assert got.dtype == torch.float32 and agreed[name], name
            ok, excess = within(got, salt, name, UNIT[wire])
            assert ok, (name, excess)
            assert not torch.equal(got, results[name, "plain"]), name  # it was rounded
            ok, excess = within(results[name, "small"], salt, name, UNIT[wire])  # the MPI library path
            assert ok, (name, "small", excess)
            # the plain one went through shared memory (no ring bytes); the forced ring moves 2-byte values
            assert sent[name, "plain"] == 0, (name, sent)
            assert abs(sent[name, "forced"] - 2 * (N - 1) / N * COUNT * 2) <= 4 * N, (name, sent)


def test_on_one_host_the_plain_spelling_reduces_float32_through_shared_memory():
    """hp.Compression.fp16 between ranks of one host: no conversion, the float32 result bit for bit."""
    salt = 10
    plain = hp.allreduce(contribution(R, salt), op=hp.Average)
    before = core().wire_bytes_sent()
    compressed = hp.allreduce(contribution(R, salt), op=hp.Average, compression=hp.Compression.fp16)
    bf16 = hp.grouped_allreduce([contribution(R, salt)], op=hp.Average, compression=hp.Compression.bf16)[0]
    sent = core().wire_bytes_sent() - before
    with ranks_agree():
        assert torch.equal(compressed, plain) and torch.equal(bf16, plain)
        assert sent == 0, sent


def test_grouped_and_engine_paths_compress_float32_and_leave_other_dtypes_to_compress():
    """A grouped list mixing float32 (the ring converts it) and float64 (compress() converts it, as before), and
    the engine's allreduce_async_ with a wire format: within the rounding bounds; the float64 one is fp16-exact."""
    salt = 20
    tensors = [contribution(R, salt), contribution(R, salt + 1, 5000).double(), contribution(R, salt + 2, 300)]
    grouped = hp.grouped_allreduce(tensors, op=hp.Sum, compression=hp.Compression.fp16.forced)
    from hybridpipe.data_parallel.compression import wire_for

    engine_input = contribution(R, salt + 3)
    wire = wire_for(hp.Compression.bf16.forced, engine_input, hp.Max)
    hp.allreduce_async_(engine_input, name="compressed.engine", op=hp.Max, wire=wire).wait()
    with ranks_agree():
        assert within(grouped[0], salt, "Sum", UNIT["fp16"])[0]
        assert grouped[1].dtype == torch.float64 and within(grouped[1], salt + 1, "Sum", UNIT["fp16"])[0]
        assert within(grouped[2], salt + 2, "Sum", UNIT["fp16"])[0]
        assert within(engine_input, salt + 3, "Max", UNIT["bf16"])[0]
        assert str(wire) == " wire=bfloat16 (on one host too)"


def test_distributed_optimizer_averages_within_the_wire_rounding_and_custom_compressors_keep_working():
    torch.manual_seed(0)
    original = torch.nn.Linear(256, 512)  # 128 Ki weights: the ring, not the MPI library
    inputs = torch.randn(8, 256, generator=torch.Generator().manual_seed(100 + R))
    gradients = {}
    for label, compression in (("local", None), ("plain", hp.Compression.none), ("one host", hp.Compression.fp16),
                               ("forced", hp.Compression.fp16.forced), ("custom", HalfCompressor())):
        model = copy.deepcopy(original)
        if compression is not None:
            optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                                named_parameters=model.named_parameters(), compression=compression)
        model(inputs).pow(2).sum().backward()
        if compression is not None:
            optimizer.synchronize()
        gradients[label] = model.weight.grad.clone()
    plain = gradients["plain"]
    bound = hp.allreduce(gradients["local"].abs(), op=hp.Sum) * N * UNIT["fp16"] + 1e-6
    with ranks_agree():
        assert torch.equal(gradients["one host"], plain)  # shared memory: float32 as it is
        for label in ("forced", "custom"):
            error = (gradients[label] - plain).abs()
            assert error.max() > 0, label
            assert (error <= bound).all(), (label, (error - bound).max())


class HalfCompressor:
    """A Horovod-style compressor of its own: the whole tensor in float16, as Horovod's FP16Compressor."""

    def compress(self, tensor):
        return tensor.half(), tensor.dtype

    def decompress(self, tensor, ctx):
        return tensor.to(ctx)


def test_ranks_that_disagree_on_the_compression_fail_on_every_rank():
    compression = hp.Compression.fp16.forced if R == 0 else hp.Compression.bf16.forced
    with pytest.raises(MismatchError, match="wire=") as direct:
        hp.allreduce(contribution(R, 30), compression=compression)
    from hybridpipe.data_parallel.compression import wire_for

    tensor = contribution(R, 31)
    handle = hp.allreduce_async_(tensor, name="compressed.mismatch", wire=wire_for(compression, tensor, hp.Average))
    with pytest.raises(MismatchError, match="wire=") as engine:
        handle.wait()
    with ranks_agree():
        assert "float16" in str(direct.value) and "bfloat16" in str(engine.value)

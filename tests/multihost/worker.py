"""One rank of tests/test_multihost.py: 4 ranks on 2 emulated hosts (network namespaces), 2 stages.

Checks that the shared-memory allreduce serves exactly the communicators whose ranks share a host
(the others take the ring over TCP), and that every path reduces correctly.

The arguments name the parts to run, in order, in this one process (a launch on the emulated hosts
costs 10-15 s of start-up here, so tests/test_multihost.py runs its block-placement cases in one):

* ``default``: every group's direct collectives first, then every group's engine traffic.
* ``interleaved``: each group's direct collectives right after the previous group's engine traffic.
  That order stalled for minutes over Open MPI's TCP transport while each engine group had a thread
  of its own and direct collectives ran on the calling thread (docs/sharp_bits.md); with one
  communication thread it passes, and is a test.
* ``flat`` (always last): after hp.shutdown(), with HYBRIDPIPE_HIERARCHICAL=0 set before hp.init() reads it,
  hierarchical_worker.py's 2 + 2 checks (the hierarchy is never used, the values are the same).

Prints "rank R ok: PART ..." after each part. No argument means ``default``; ``--interleaved`` (as
docs/sharp_bits.md writes it) means ``interleaved``.
"""

import os
import sys

import numpy as np
import torch
from mpi4py import MPI

import hybridpipe as hp
from hybridpipe._ext import core
from hybridpipe.comm import context
from hybridpipe.comm.engine import call


def contribution(seed, count, rank):
    return torch.from_numpy(np.random.default_rng([seed, rank, count]).standard_normal(count))


def main(parts: list[str]) -> int:
    unknown = set(parts) - {"default", "interleaved", "flat"}
    assert parts and not unknown, f"parts: default, interleaved, flat (got {parts})"
    grid = hp.init(pipeline_stages=2)
    world = MPI.COMM_WORLD
    hosts = call(None, 'hosts', lambda: world.allgather(MPI.Get_processor_name()))
    assert len(set(hosts)) == 2, f"expected two emulated hosts, got {hosts}"
    for part in parts:
        if part == "flat":
            continue
        collectives_and_engine(interleaved=part == "interleaved", hosts=hosts)
        print(f"rank {world.rank} ok: {part}: stage {grid.stage} replica {grid.replica} on {hosts[world.rank]}",
              flush=True)
    hp.shutdown()
    if "flat" in parts:
        import hierarchical_worker  # beside this file

        os.environ["HYBRIDPIPE_HIERARCHICAL"] = "0"  # read by the next hp.init (Config.from_env)
        hierarchical_worker.main("2+2", label="flat")
    return 0


def collectives_and_engine(interleaved: bool, hosts: list[str]) -> None:
    world = MPI.COMM_WORLD
    options = context.allreduce_options_for(hp.config())
    groups = {}
    # direct collectives of every group first, then the engine's (unless interleaved)
    for label in ("world", "data", "pipe"):
        comm = context.communicator(label, "test")
        members = call(label, 'members', lambda: comm.allgather(world.rank))
        one_host = len({hosts[m] for m in members}) == 1
        groups[label] = (comm, one_host)
        info = call(label, 'info', lambda: core().shared_memory_info(comm.py2f(), options))
        assert info["available"] == one_host, (label, members, hosts, info)
        if not one_host:
            assert info["reason"] == f"its {comm.size} ranks are not all on one host", info
        for count in (5, 1000, 300_007):
            tensors = [contribution(count, count, r) for r in range(comm.size)]
            got = hp.allreduce(tensors[comm.rank].float(), op=hp.Average, group=label)
            want = torch.stack(tensors).mean(0).numpy()
            np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-6)
        if interleaved:
            engine_traffic(label, comm, one_host)
    if not interleaved:
        for label, (comm, one_host) in groups.items():
            engine_traffic(label, comm, one_host)


def engine_traffic(label, comm, one_host):
    """Six tensors through the engine on group `label`, checked; the segment is used iff one host."""
    before = hp.engine_stats(label)
    tensors = [[contribution(50 + i, 20_000 * (i + 1), r) for r in range(comm.size)] for i in range(6)]
    mine = [t[comm.rank].clone() for t in tensors]
    handles = [hp.allreduce_async_(t, name=f"{label}.{i}", op=hp.Sum, group=label) for i, t in enumerate(mine)]
    for handle in handles:
        hp.synchronize(handle)
    for group, got in zip(tensors, mine):
        np.testing.assert_allclose(got.numpy(), torch.stack(group).sum(0).numpy(), rtol=1e-12, atol=1e-12)
    after = hp.engine_stats(label)
    streamed = after["shared_memory"] - before["shared_memory"]
    assert (streamed > 0) == one_host, (label, one_host, before, after)


if __name__ == "__main__":
    sys.exit(main([part.removeprefix("--") for part in sys.argv[1:]] or ["default"]))

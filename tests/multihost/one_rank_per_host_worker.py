"""One rank of tests/test_multihost.py's one-rank-per-host case: world spans 2 emulated hosts with 1 rank on
each, and the hierarchical allreduce is forced (HYBRIDPIPE_HIERARCHICAL=1's path): one piece, carried over
all the ranks, in one chunk and in a pipeline of chunks; Sum, Min and Max of an odd count equal numpy.
Prints "rank R ok".
"""

import sys

import numpy as np
from mpi4py import MPI

import hybridpipe as hp
from hybridpipe._ext import core
from hybridpipe.comm import context
from hybridpipe.comm.engine import call


def main() -> int:
    hp.init()
    comm = context.communicator(None, "test")
    rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    count = 300_001
    for chunk_bytes in (0, 4096, 2 << 20):
        for op, reduce in ((hp.Sum, np.sum), (hp.Min, np.min), (hp.Max, np.max)):
            data = [np.random.default_rng([r, int(op), chunk_bytes]).standard_normal(count).astype(np.float32)
                    for r in range(size)]
            x = data[rank].copy()
            options = context.allreduce_options_for(hp.config())
            options.hierarchical_chunk_bytes = chunk_bytes
            call(None, "forced", lambda: core().allreduce(x.ctypes.data, x.ctypes.data, count, 0, int(op), comm.py2f(),
                                                          options, [], core().AllreduceAlgorithm.Hierarchical))
            np.testing.assert_allclose(x, reduce(np.stack(data), axis=0), rtol=1e-6, atol=1e-5, err_msg=f"{op}")
    info = call(None, "hierarchy", lambda: core().hierarchy_info(comm.py2f()))
    assert info["pieces"] == 1 and info["ranks_per_host"] == [1, 1] and info["pipelined_chunks"] > 100, info
    print(f"rank {rank} ok", flush=True)
    hp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Grid + allreduce demo: every rank prints its (stage, replica); rank 0 prints a bus-bandwidth table.

Run: mpirun -n 4 python examples/allreduce_demo.py --stages 2     (or `make demo`)
"""

import argparse
import time

import torch

import hybridpipe as hp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages (world size must be a multiple)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    grid = hp.init(pipeline_stages=args.stages)
    line = (f"rank {grid.rank}: stage {grid.stage} of {grid.pipeline_stages}, replica {grid.replica} of "
            f"{grid.data_replicas}, local rank {hp.local_rank()} of {hp.local_size()}")
    lines = grid.world_comm.gather(line, root=0)  # hybridpipe's communicators are mpi4py communicators
    if hp.rank() == 0:
        print("\n".join(lines) + "\n\nrank grid:\n" + grid.table())

    # Check: the sum of every rank's rank, over the world and over each stage's replicas.
    total = hp.allreduce(torch.tensor([float(hp.rank())]), op=hp.Sum).item()
    stage_total = hp.allreduce(torch.tensor([float(hp.rank())]), op=hp.Sum, group="data").item()
    expected_stage = sum(grid.rank_of(grid.stage, r) for r in range(grid.data_replicas))
    assert total == hp.size() * (hp.size() - 1) / 2 and stage_total == expected_stage
    if hp.rank() == 0:
        print(f"\nallreduce check passed (world sum {total:.0f}, stage-0 data-group sum {stage_total:.0f})")
        print(f"\n{'size':>10} {'group':>6} {'ranks':>5} {'median ms':>10} {'busbw GB/s':>11}")
    for group, ranks in (("world", hp.size()), ("data", grid.data_replicas)):
        for size_bytes in (4 << 10, 256 << 10, 4 << 20, 64 << 20):
            tensor = torch.ones(size_bytes // 4)
            times = []
            for _ in range(args.repeats):
                hp.barrier()
                start = time.perf_counter()
                hp.allreduce_(tensor, op=hp.Sum, group=group)
                times.append(time.perf_counter() - start)
            worst = hp.allreduce(torch.tensor(sorted(times)[len(times) // 2]), op=hp.Max).item()
            busbw = size_bytes / worst * 2 * (ranks - 1) / ranks / 1e9 if ranks > 1 else float("nan")
            if hp.rank() == 0:
                print(f"{size_bytes >> 10:>8}Ki {group:>6} {ranks:>5} {worst * 1e3:>10.3f} {busbw:>11.2f}")
    if hp.rank() == 0:
        print("\n(a demo, not a benchmark: see bench/allreduce.py for side-by-side numbers)")
    hp.shutdown()


if __name__ == "__main__":
    main()

"""Stages with their own replica counts (PipeDream's "3-1") against uniform grids and pure data parallelism, on a
VGG-like CNN: convolutions heavy in compute and light in parameters, a fully connected head light in compute and
heavy in parameters. Every configuration trains the same model on the same global batch in the same
processes, rounds rotating which goes first; each round's ratio to pure data parallelism is taken in that round.

Usage:
    mpirun -n 4 python bench/stage_replicas.py [--global-batch 32] [--steps 6] [--rounds 5] [--json FILE]

Configurations on N ranks: "N" (data parallelism: every rank the whole model, a quarter of the batch, the head's
gradients allreduced), uniform P × D grids (1F1B), and the non-uniform ones where the head's stage has one rank
("(N-1)-1": the convolutions replicated, the head's weights never allreduced), each with the balance that cuts
before the head. With --predict, the planner's prediction of each (the profile measured here first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import hybridpipe as hp

sys.path.insert(0, str(Path(__file__).resolve().parent))


def vgg_like(seed: int = 0) -> list[nn.Module]:
    """Five 3×3 convolutions (32, 32 | 64, 64 | 128 channels, 2×2 max-pools between) on 32×32 images, then a
    2048-2048-1024-10 head: ~0.2 M convolution parameters doing ~80 % of the work, ~6.3 M head parameters (25 MB)."""
    torch.manual_seed(seed)

    def conv(a: int, b: int) -> list[nn.Module]:
        return [nn.Conv2d(a, b, 3, padding=1), nn.ReLU()]

    return [*conv(3, 32), *conv(32, 32), nn.MaxPool2d(2), *conv(32, 64), *conv(64, 64), nn.MaxPool2d(2),
            *conv(64, 128), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10)]


HEAD = 14  # index of the first Linear: every configuration with two stages cuts there


def configurations(size: int) -> list[tuple[str, dict]]:
    """(name, how to build it) for ``size`` ranks."""
    out = [(str(size), {"stages": 1})]
    for stages in range(2, size + 1):
        if size % stages == 0:
            out.append((f"{stages}x{size // stages}", {"stages": stages}))
    if size > 2:
        out.append((f"{size - 1}-1", {"replicas": [size - 1, 1]}))
    return out


def balance_for(stages: int, layers: int) -> list[int]:
    """Cut before the head for two stages; for more, the convolutions split evenly and the head last."""
    if stages == 1:
        return [layers]
    front = [HEAD // (stages - 1) + (1 if i < HEAD % (stages - 1) else 0) for i in range(stages - 1)]
    return [*front, layers - HEAD]


def build(spec: dict, global_batch: int, micro_batches: int) -> tuple:
    grid = hp.init(stage_replicas=spec["replicas"]) if "replicas" in spec else hp.init(pipeline_stages=spec["stages"])
    layers = vgg_like()
    if grid.pipeline_stages == 1:
        model = nn.Sequential(*layers)
        optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                            named_parameters=model.named_parameters())
        batch = global_batch // grid.data_replicas
    else:
        model = hp.PipelineModel(layers, loss_fn=nn.functional.cross_entropy, micro_batches=micro_batches,
                                 balance=balance_for(grid.pipeline_stages, len(layers)), schedule="1f1b")
        optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                            named_parameters=model.named_parameters())
        batch = global_batch if not grid.uniform else global_batch // grid.data_replicas
    return grid, model, optimizer, batch


def step(grid, model, optimizer, inputs, targets) -> None:
    optimizer.zero_grad()
    if grid.pipeline_stages == 1:
        nn.functional.cross_entropy(model(inputs), targets).backward()
    else:
        model.train_step(inputs, targets)
    optimizer.step()


def measure(spec: dict, global_batch: int, micro_batches: int, steps: int) -> float:
    grid, model, optimizer, batch = build(spec, global_batch, micro_batches)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(batch, 3, 32, 32, generator=generator)
    targets = torch.randint(0, 10, (batch,), generator=generator)
    for _ in range(2):
        step(grid, model, optimizer, inputs, targets)
    times = []
    for _ in range(steps):
        grid.world_comm.Barrier()
        started = time.perf_counter()
        step(grid, model, optimizer, inputs, targets)
        grid.world_comm.Barrier()
        times.append(time.perf_counter() - started)
    if isinstance(model, hp.PipelineModel):
        model.close()
    hp.shutdown()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=6, help="pipelines' micro-batches (default 6)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", help="comma-separated configuration names")
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    torch.set_num_threads(1)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    chosen = configurations(size)
    if options.only:
        wanted = options.only.split(",")
        chosen = [c for c in chosen if c[0] in wanted]
    times: dict[str, list[float]] = {name: [] for name, _ in chosen}
    ratios: dict[str, list[float]] = {name: [] for name, _ in chosen}
    for round_index in range(options.rounds):
        order = chosen[round_index % len(chosen):] + chosen[:round_index % len(chosen)]
        this_round = {}
        for name, spec in order:
            this_round[name] = measure(spec, options.global_batch, options.micro_batches, options.steps)
            times[name].append(this_round[name])
        base = this_round.get(chosen[0][0])
        for name in this_round:
            if base:
                ratios[name].append(base / this_round[name])
        if rank == 0:
            print(f"round {round_index}: " + ", ".join(f"{n} {t * 1e3:.0f} ms" for n, t in this_round.items()),
                  flush=True)
    if rank == 0:
        print(f"\n{size} ranks, VGG-like CNN, global batch {options.global_batch}, pipelines 1F1B with "
              f"{options.micro_batches} micro-batches; speed-up over data parallelism ({chosen[0][0]}) is the median "
              "of the rounds' ratios")
        print(f"{'configuration':<14} {'step ms':>9} {'speed-up':>9} {'range':>13}")
        for name, _ in chosen:
            values = ratios[name] or [float("nan")]
            print(f"{name:<14} {statistics.median(times[name]) * 1e3:9.1f} {statistics.median(values):9.3f} "
                  f"{min(values):6.3f}-{max(values):.3f}")
        if options.json:
            Path(options.json).write_text(json.dumps({"ranks": size, "times": times, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()

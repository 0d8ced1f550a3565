"""The cost of handing hp.PipelineModel a module instead of a layer list: the same GPT-like model (train_lm.py's
Embedding, Blocks and Head) given as a list of layers and as one nn.Module whose forward loops over them,
split at the same places, trained the same steps in the same processes, rounds alternating.

Usage:
    mpirun -n 2 python bench/split_module.py [--layers 8] [--dim 128] [--seq-len 64] [--batch 32]
                                             [--micro-batches 4] [--steps 10] [--rounds 5]

Prints each variant's median step time over the rounds (each round's time is the median of its steps),
and the module / layers ratio, round by round and overall. The split module's extra work per micro-batch
and stage: its forward's glue replayed up to its last unit, one dispatch per unit call, and a dict of
crossing values instead of one tensor.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

import hybridpipe as hp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import timed_steps  # noqa: E402

_spec = importlib.util.spec_from_file_location("train_lm", Path(__file__).resolve().parent.parent / "examples" / "train_lm.py")
train_lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_lm)


class GPTLike(nn.Module):
    """train_lm's layers as a model is usually written: one module, its blocks in a ModuleList."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embedding = layers[0]
        self.blocks = nn.ModuleList(layers[1:-1])
        self.head = layers[-1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from mpi4py import MPI

    grid = hp.init(pipeline_stages=MPI.COMM_WORLD.Get_size())
    stages = grid.pipeline_stages

    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        return [train_lm.Embedding(256, args.dim, args.seq_len)] + \
            [train_lm.Block(args.dim, args.heads) for _ in range(args.layers)] + [train_lm.Head(args.dim, 256)]

    count = args.layers + 2
    balance = [count // stages + (1 if s < count % stages else 0) for s in range(stages)]
    starts = [sum(balance[:s]) for s in range(1, stages)]
    names = [("blocks." + str(i - 1)) if 0 < i < count - 1 else "head" for i in starts]
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (args.batch, args.seq_len), generator=generator)
    targets = torch.randint(0, 256, (args.batch, args.seq_len), generator=generator)
    sample = ids[:args.batch // args.micro_batches]
    models = {
        "layers": hp.PipelineModel(layers(), loss_fn=train_lm.lm_loss, micro_batches=args.micro_batches,
                                   balance=balance),
        "module": hp.PipelineModel(GPTLike(layers()), loss_fn=train_lm.lm_loss, micro_batches=args.micro_batches,
                                   sample=sample, split=names),
    }
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    if hp.rank() == 0:
        print(models["module"].split_report())
    times: dict[str, list[float]] = {k: [] for k in models}
    ratios = []
    for round_index in range(args.rounds):
        for name in (("layers", "module") if round_index % 2 == 0 else ("module", "layers")):
            model, optimizer = models[name], optimizers[name]
            steps = timed_steps(model, optimizer, ids, targets, args.steps + 1)
            times[name].append(statistics.median(steps[1:]))
        ratios.append(times["module"][-1] / times["layers"][-1])
        if hp.rank() == 0:
            print(f"round {round_index}: layers {times['layers'][-1] * 1e3:.1f} ms, module "
                  f"{times['module'][-1] * 1e3:.1f} ms, module / layers {ratios[-1]:.3f}", flush=True)
    if hp.rank() == 0:
        layers_ms = statistics.median(times["layers"]) * 1e3
        module_ms = statistics.median(times["module"]) * 1e3
        print(f"\n{stages} stages, {args.layers} blocks of width {args.dim}, batch {args.batch} x {args.seq_len} in "
              f"{args.micro_batches} micro-batches, 1f1b: layers {layers_ms:.1f} ms, module {module_ms:.1f} ms "
              f"per step; module / layers {module_ms / layers_ms:.3f} (median of the rounds' ratios "
              f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f})")
    for model in models.values():
        model.close()
    hp.shutdown()


if __name__ == "__main__":
    main()

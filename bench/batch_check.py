"""The cost of the batch-agreement check (HYBRIDPIPE_CHECK_BATCHES): the demo's model (examples/train_lm.py's
defaults: 4 blocks of width 96, 16 sequences of 64 tokens per replica, 4 micro-batches, 1f1b) trained with the check
on and off, on the same model in the same processes, rounds alternating which goes first.

Usage:
    mpirun -n 4 python bench/batch_check.py [--stages 2] [--steps 20] [--rounds 7]

Prints each round's median step time with the check on and off and their ratio, the median of the ratios, the
check's own work measured alone (fingerprinting one step's inputs and targets, median of 2000) and measured where it
runs (every fingerprint and comparison inside the checked steps, timed on rank 0): the cost the ratio cannot resolve
below this machine's round-to-round noise. The check folds the sender's fingerprint into the
first activation message of each step from each chunk (no extra message), so the fingerprint is all it adds.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

import hybridpipe as hp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import timed_steps  # noqa: E402

_spec = importlib.util.spec_from_file_location("train_lm", Path(__file__).resolve().parent.parent / "examples" / "train_lm.py")
train_lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_lm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    torch.set_num_threads(1)
    args = train_lm.parse_args(["--no-progress"])
    grid = hp.init(pipeline_stages=options.stages)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=generator)
    targets = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=generator)
    model = hp.PipelineModel(train_lm.build_layers(args), loss_fn=train_lm.lm_loss, micro_batches=args.micro_batches,
                             schedule=args.schedule, seed_layers=args.seed, balance="uniform")
    optimizer = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr),
                                        named_parameters=model.named_parameters())
    from hybridpipe.pipeline.batch_check import fingerprint

    alone = []
    for _ in range(2000):
        started = time.perf_counter()
        fingerprint(ids, targets)
        alone.append(time.perf_counter() - started)
    fingerprint_s = statistics.median(alone)
    # the check's work where it runs (cold caches, inside the step): every fingerprint and comparison timed
    from hybridpipe.pipeline import model as model_module, stage as stage_module
    spent = [0.0, 0]

    def timed(function):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started
                spent[1] += 1
        return run

    model_module.fingerprint = timed(model_module.fingerprint)
    stage_module.compare = timed(stage_module.compare)
    checked_steps = 0
    times: dict[bool, list[float]] = {True: [], False: []}
    ratios = []
    timed_steps(model, optimizer, ids, targets, 3)  # warm-up
    spent[:] = [0.0, 0]
    for round_index in range(options.rounds):
        for checked in ((True, False) if round_index % 2 == 0 else (False, True)):
            model.check_batches = checked
            steps = timed_steps(model, optimizer, ids, targets, options.steps)
            times[checked].append(statistics.median(steps))
            checked_steps += options.steps if checked else 0
        ratios.append(times[True][-1] / times[False][-1])
        if hp.rank() == 0:
            print(f"round {round_index}: on {times[True][-1] * 1e3:.1f} ms, off {times[False][-1] * 1e3:.1f} ms, "
                  f"on / off {ratios[-1]:.3f}", flush=True)
    if hp.rank() == 0:
        on, off = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        print(f"\n{grid.pipeline_stages} stages x {grid.data_replicas} replicas, the demo's model: check on {on:.1f} ms, "
              f"off {off:.1f} ms per step; on / off {statistics.median(ratios):.3f} (median of the rounds' ratios, "
              f"range {min(ratios):.3f}-{max(ratios):.3f}); the fingerprint alone {fingerprint_s * 1e6:.0f} us per "
              f"step = {fingerprint_s * 1e3 / off * 100:.2f} % of a step (the check's whole added work); inside the "
              f"steps, on rank 0: {spent[0] / max(checked_steps, 1) * 1e6:.0f} us per step in {spent[1]} fingerprints "
              f"and comparisons = {spent[0] / max(checked_steps, 1) * 1e3 / off * 100:.2f} % of a step")
    model.close()
    hp.shutdown()


if __name__ == "__main__":
    main()

"""A rank that dies inside hp.elastic.run (tests/test_elastic_inprocess.py): a float64 MLP, data parallelism over
fixed global mini-batches that hp.elastic.ElasticSampler(batch_size=GLOBAL_BATCH) shares out over the ranks there
are, a commit after every step. Rank $KILL_RANK SIGKILLs itself inside step $KILL_STEP, before its gradients'
allreduce; the survivors go on with the epoch's next mini-batches. At the end rank 0 writes its parameters (and the
steps' record) to OUT."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch

import hybridpipe as hp

STEPS, GLOBAL_BATCH, FEATURES, SEED = 8, 12, 6, 3


def dataset(rows: int = STEPS * GLOBAL_BATCH, features: int = FEATURES, seed: int = 1000,
            target: Any = torch.sin) -> torch.utils.data.TensorDataset:
    """``rows`` float64 samples of ``features`` (seeded), each one's target ``target`` of its sum (this job's and
    the pipeline job's, tests/faults/elastic_pipeline.py)."""
    inputs = torch.randn(rows, features, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.utils.data.TensorDataset(inputs, target(inputs.sum(dim=1, keepdim=True)))


def global_batch(step: int, data: Any = None, batch: int = GLOBAL_BATCH, seed: int = SEED) -> tuple[Any, Any]:
    """Mini-batch ``step`` of the epoch as one process takes it: ``batch`` consecutive indices of the permutation
    seeded with ``seed`` (what ElasticSampler(seed=seed, batch_size=batch) shares out at epoch 0)."""
    data = dataset() if data is None else data
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    chosen = order[step * batch:(step + 1) * batch]
    inputs, targets = data.tensors
    return inputs[chosen], targets[chosen]


def replay(model: torch.nn.Module, batch_of: Any, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """``steps`` steps of ``model`` in one process on ``batch_of(step)`` (SGD with momentum, MSE): what a job's
    survivors must end with."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        inputs, targets = batch_of(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return model.state_dict()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def main() -> None:
    kill_rank, kill_step = int(os.environ["KILL_RANK"]), int(os.environ["KILL_STEP"])
    hp.init()
    model = make_model()
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters())
    data = dataset()
    sampler = hp.elastic.ElasticSampler(data, seed=SEED, batch_size=GLOBAL_BATCH)  # this rank's share of each
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    state = hp.elastic.TorchState(model, optimizer, sampler=sampler, step=0)
    sizes = []

    @hp.elastic.run
    def train(state: hp.elastic.TorchState) -> None:
        for index, (inputs, targets) in enumerate(loader):  # after a reset: the epoch's rest, cut for the new size
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            if hp.size() == 3 and hp.rank() == kill_rank and state.step == kill_step:
                with open(os.environ["OUT"] + ".killed", "w") as out:  # mpirun may drop what is printed now
                    out.write(f"{time.time():.6f}")
                print(f"rank {kill_rank}: killing itself in step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
            sizes.append(hp.size())
            if hp.rank() == 0:
                print(f"step {state.step} done on {hp.size()} ranks at {time.time():.6f}", flush=True)
            state.sampler.record_batch(index, GLOBAL_BATCH)
            state.step += 1
            state.commit()

    train(state)
    if hp.rank() == 0:
        torch.save({"parameters": {k: v.clone() for k, v in model.state_dict().items()}, "sizes": sizes},
                   os.environ["OUT"])
    print(f"survivor done: rank {hp.rank()} of {hp.size()}", flush=True)
    hp.shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()

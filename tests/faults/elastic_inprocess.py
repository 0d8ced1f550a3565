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

import torch

import hybridpipe as hp

STEPS, GLOBAL_BATCH, FEATURES = 8, 12, 6


SEED = 3


def dataset() -> torch.utils.data.TensorDataset:
    inputs = torch.randn(STEPS * GLOBAL_BATCH, FEATURES, generator=torch.Generator().manual_seed(1000),
                         dtype=torch.float64)
    return torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mini-batch ``step`` of the epoch as one process takes it: consecutive indices of the seeded permutation."""
    order = torch.randperm(STEPS * GLOBAL_BATCH, generator=torch.Generator().manual_seed(SEED))
    inputs, targets = dataset().tensors
    chosen = order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
    return inputs[chosen], targets[chosen]


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

"""A rank that dies inside hp.elastic.run (tests/test_elastic_inprocess.py): a float64 MLP, data parallelism over a
fixed global batch split by hp.rank() / hp.size(), a commit after every step. Rank $KILL_RANK SIGKILLs itself inside
step $KILL_STEP, before its gradients' allreduce; the survivors go on. At the end rank 0 writes its parameters (and
the steps' record) to OUT."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import hybridpipe as hp

STEPS, GLOBAL_BATCH, FEATURES = 8, 12, 6


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(GLOBAL_BATCH, FEATURES, generator=generator, dtype=torch.float64)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def main() -> None:
    kill_rank, kill_step = int(os.environ["KILL_RANK"]), int(os.environ["KILL_STEP"])
    hp.init()
    model = make_model()
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters())
    state = hp.elastic.TorchState(model, optimizer, step=0)
    sizes = []

    @hp.elastic.run
    def train(state: hp.elastic.TorchState) -> None:
        while state.step < STEPS:
            inputs, targets = global_batch(state.step)
            share = GLOBAL_BATCH // hp.size()  # the global batch stays the same whatever the size
            mine = slice(hp.rank() * share, (hp.rank() + 1) * share)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine])
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

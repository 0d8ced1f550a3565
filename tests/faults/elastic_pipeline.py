"""A pipeline rank that dies inside hp.elastic.run (tests/test_elastic_inprocess.py): a float64 MLP as a 2 x 2 grid
(two stages, two replicas), GPipe ($SCHEDULE: another) with 2 micro-batches, fixed global mini-batches drawn through
hp.elastic.ElasticSampler(batch_size=GLOBAL_BATCH), a commit after every step. Rank $KILL_RANK SIGKILLs itself inside
step $KILL_STEP (a comma list: ranks 2 and 3 are a host's, replica 1 of both stages); the survivors go on as the grid
that is left (rank 3 lost: 2-1; ranks 2 and 3: one replica of each stage) in the same processes. At the end every
survivor writes its stage's parameters to OUT.<rank>."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import elastic_inprocess  # the data-parallel job beside this file: its dataset and mini-batch helpers
import hybridpipe as hp

STEPS, GLOBAL_BATCH, FEATURES, SEED = 8, 8, 5, 4


def dataset() -> torch.utils.data.TensorDataset:
    return elastic_inprocess.dataset(STEPS * GLOBAL_BATCH, FEATURES, seed=2000, target=torch.cos)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mini-batch ``step`` of the epoch as one process takes it."""
    return elastic_inprocess.global_batch(step, dataset(), GLOBAL_BATCH, SEED)


def layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(FEATURES, 6).double(), torch.nn.Tanh(), torch.nn.Linear(6, 6).double(), torch.nn.Tanh(),
            torch.nn.Linear(6, 1).double()]


def main() -> None:
    kill_ranks, kill_step = [int(rank) for rank in os.environ["KILL_RANK"].split(",")], int(os.environ["KILL_STEP"])
    if os.environ.get("HYBRIDPIPE_RESTART", "0") != "0":  # hybridpipe-run --restarts started it again: no new kill
        kill_ranks = []
    hp.init(pipeline_stages=2)
    model = hp.PipelineModel(layers(), balance=[2, 3], micro_batches=2, schedule=os.environ.get("SCHEDULE", "gpipe"),
                             loss_fn=torch.nn.functional.mse_loss)
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters())
    data = dataset()
    sampler = hp.elastic.ElasticSampler(data, seed=SEED, batch_size=GLOBAL_BATCH)  # what train_step takes here
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    state = hp.elastic.TorchState(model, optimizer, sampler=sampler, step=0)
    grids = []

    @hp.elastic.run
    def train(state: hp.elastic.TorchState) -> None:
        for index, (inputs, targets) in enumerate(loader):
            optimizer.zero_grad()
            if hp.size() == 4 and state.step == kill_step:
                hp.barrier(group="world")  # the ranks to kill leave it together: none learns of another's death first
            if hp.size() == 4 and hp.rank() in kill_ranks and state.step == kill_step:
                with open(f"{os.environ['OUT']}.killed{hp.rank()}", "w") as out:
                    out.write(f"{time.time():.6f}")
                print(f"rank {hp.rank()}: killing itself in step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            model.train_step(inputs, targets)
            optimizer.step()
            grids.append(hp.grid().config)
            if hp.rank() == 0:
                print(f"step {state.step} done on {hp.grid().config} at {time.time():.6f}", flush=True)
            state.sampler.record_batch(index, GLOBAL_BATCH)
            state.step += 1
            state.commit()

    train(state)
    torch.save({"stage": hp.grid().stage, "grids": grids,
                "parameters": {k: v.clone() for k, v in model.state_dict().items()}},
               f"{os.environ['OUT']}.{hp.rank()}")
    print(f"survivor done: rank {hp.rank()} of {hp.size()}, stage {hp.grid().stage}", flush=True)
    hp.shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()

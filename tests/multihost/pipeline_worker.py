"""One rank of tests/test_multihost.py's hybrid training across hosts: 4 ranks on 2 emulated hosts
placed round-robin (ranks 0, 2 on one host, 1, 3 on the other), 2 stages × 2 replicas, so every
pipeline spans both hosts (its activations and gradients cross the TCP link) while each stage's
data group stays inside one host. Trains with GPipe and 1F1B and checks the parameters against one
process on the same global batches. Prints "rank R ok".
"""

import sys

import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hp
from hybridpipe._ext import core
from hybridpipe.comm.engine import call

STEPS, PER_REPLICA = 6, 16


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 3))


def global_batches(replicas: int):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(replicas * PER_REPLICA, 6, generator=generator),
             torch.randint(0, 3, (replicas * PER_REPLICA,), generator=generator)) for _ in range(STEPS)]


def reference(batches) -> dict[str, torch.Tensor]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for inputs, targets in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    return {f"layers.{name}": p.detach() for name, p in model.named_parameters()}


def main() -> int:
    grid = hp.init(pipeline_stages=2)
    world = MPI.COMM_WORLD
    hosts = call(None, "hosts", lambda: world.allgather(MPI.Get_processor_name()))
    pipeline = [hosts[grid.rank_of(stage, grid.replica)] for stage in range(2)]
    data = [hosts[grid.rank_of(grid.stage, replica)] for replica in range(2)]
    assert len(set(pipeline)) == 2 and len(set(data)) == 1, f"placement: hosts {hosts}, grid\n{grid}"
    assert core().transfers_driven(), "the communication thread should make the pipeline's MPI calls"
    batches = global_batches(grid.data_replicas)
    expected = reference(batches)
    rows = slice(grid.replica * PER_REPLICA, (grid.replica + 1) * PER_REPLICA)
    for schedule in ("gpipe", "1f1b"):
        model = hp.PipelineModel(mlp(), loss_fn=nn.CrossEntropyLoss(), micro_batches=4, balance="uniform",
                                 schedule=schedule)
        optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                            named_parameters=model.named_parameters())
        for inputs, targets in batches:
            optimizer.zero_grad()
            model.train_step(inputs[rows], targets[rows])
            optimizer.step()
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(parameter.detach(), expected[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{schedule} {name}: {m}")
        model.close()
    print(f"rank {world.rank} ok: stage {grid.stage} replica {grid.replica} on {hosts[world.rank]}", flush=True)
    hp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of the fault tests on emulated hosts (tests/test_faults.py): 2 stages × 2 replicas train
an MLP (pipeline transfers and data-parallel allreduces every step) until killed. FAULT=kill|stop
makes rank FAULT_RANK SIGKILL / SIGSTOP itself at step FAULT_STEP; otherwise the test cuts a link.
Prints "rank R on HOST" at the start and "step N" on rank 0 every 10 steps."""

import os
import signal

import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hp

grid = hp.init(pipeline_stages=2)
print(f"rank {hp.rank()} on {MPI.Get_processor_name()}", flush=True)
torch.manual_seed(0)
model = hp.PipelineModel(nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)),
                         loss_fn=nn.CrossEntropyLoss(), micro_batches=4, balance="uniform")
optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                    named_parameters=model.named_parameters())
fault, fault_rank, fault_step = os.environ.get("FAULT", ""), int(os.environ.get("FAULT_RANK", "-1")), \
    int(os.environ.get("FAULT_STEP", "5"))
for step in range(1_000_000):
    if step == fault_step and hp.rank() == fault_rank and fault in ("kill", "stop"):
        print(f"rank {fault_rank}: {fault} at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    optimizer.zero_grad()
    model.train_step(torch.randn(32, 8), torch.randint(0, 4, (32,)))
    optimizer.step()
    if step % 10 == 0 and hp.rank() == 0:
        print(f"step {step}", flush=True)

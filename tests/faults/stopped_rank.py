"""One rank of tests/test_faults.py: rank 1 stops itself (SIGSTOP) right after hp.init; rank 0 submits
an allreduce and waits. Rank 0's communication thread must warn, then abort the job."""

import os
import signal

import torch

import hybridpipe as hp

hp.init(config=hp.Config(stall_check_seconds=1.0, stall_shutdown_seconds=4.0))
if hp.rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
print(f"rank {hp.rank()} waiting", flush=True)
hp.allreduce_async_(torch.ones(3), name="never-completes").wait()
print("unreachable: the allreduce completed", flush=True)

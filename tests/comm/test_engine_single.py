"""The background engine of a job of one process (``python train.py``, no mpirun): its communication thread
sleeps between submissions instead of spinning through empty cycles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

#: One process, no mpirun: hp.init, an allreduce (the thread has worked once), then 1.5 s idle; per thread the CPU
#: ticks of the idle time, and the allreduce submitted after it.
SCRIPT = textwrap.dedent("""
    import json, os, time
    import torch
    import hybridpipe as hp
    hp.init()
    assert hp.allreduce(torch.ones(3), op=hp.Sum).tolist() == [1.0, 1.0, 1.0]
    def ticks():
        out = {}
        for task in os.listdir("/proc/self/task"):
            fields = open(f"/proc/self/task/{task}/stat").read().rsplit(")", 1)[1].split()
            out[task] = int(fields[11]) + int(fields[12])
        return out
    before, started = ticks(), time.monotonic()
    time.sleep(1.5)
    after, seconds = ticks(), time.monotonic() - started
    busiest = max(after[t] - before.get(t, 0) for t in after) / os.sysconf("SC_CLK_TCK") / seconds
    woken = hp.allreduce_async_(torch.full((2,), 2.0), name="after_idle", op=hp.Sum).wait().tolist()
    print(json.dumps({"busiest": busiest, "woken": woken}))
    hp.shutdown()
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread CPU times from /proc (Linux)")
def test_one_process_engine_sleeps_while_idle():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # spinning, the communication thread takes a whole core (1.0); asleep between cycles, next to nothing
    assert result["busiest"] < 0.25, result
    assert result["woken"] == [2.0, 2.0]

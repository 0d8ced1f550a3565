"""The cross-host stall without hybridpipe: pure mpi4py, 4 ranks on 2 emulated hosts, 2 x 2 grid.

Variants (environment variables), each run 12-20 times under
``python -m hybridpipe.testing.emulated_hosts run --hosts 2 --ranks-per-host 2 -x THREADS=1 -- python THIS``:

* ``THREADS=1``: one background thread per communicator (world, data, pipe), each negotiating with a
  nonblocking allreduce tested with 100 us sleeps and running rings of Isend/Irecv when the main thread
  hands it work; the main thread makes blocking allreduces on other communicators. The old engine's
  shape. With Open MPI 5.0 some runs stall for 20-140 s or more; with MPICH none did.
* ``THREADS=1 LOCK=1``: the same with one lock around every MPI call (never two threads inside MPI at
  once). Stalls too: the cause is not two threads inside the library at the same moment.
* ``THREADS=1 ONE=1``: one background thread drives all three communicators in a fixed order.
* ``THREADS=0 [SLEEP=1 NEGOTIATE=1]``: the main thread does all of it (with the same sleeps and
  negotiations). No stall.

Prints one line per phase and rank; a stalled run never prints ``done`` (run it under ``timeout``).
The measured counts are in docs/sharp_bits.md.
"""
import os, threading, time
import numpy as np
from mpi4py import MPI
world = MPI.COMM_WORLD
rank, size = world.rank, world.size
stage, replica = rank % 2, rank // 2
comms = {"world": world.Dup(), "data": world.Split(stage, replica), "pipe": world.Split(replica, stage)}
direct = {k: c.Dup() for k, c in comms.items()}
THREADS = int(os.environ.get("THREADS", "1"))
def log(*a): print(f"[{rank} {time.monotonic():.2f}]", *a, flush=True)

GATE = threading.Lock() if os.environ.get("LOCK") else None
import contextlib
def gate():
    return GATE if GATE is not None else contextlib.nullcontext()
def test_until(reqs, sleep):
    while True:
        with gate():
            if MPI.Request.Testall(reqs): return
        if sleep: time.sleep(100e-6)

def ring(comm, n, sleep):
    r, s = comm.rank, comm.size
    buf = np.ones(n)
    seg = 32768  # 256 KiB of float64
    out = [buf[i:i+seg].copy() for i in range(0, n, seg)]
    inn = [np.empty_like(o) for o in out]
    for step in range(2 * (s - 1)):
        reqs = []
        for a, b in zip(out, inn):
            with gate():
                reqs.append(comm.Irecv(b, source=(r - 1) % s, tag=step))
                reqs.append(comm.Isend(a, dest=(r + 1) % s, tag=step))
        test_until(reqs, sleep)

class Worker(threading.Thread):
    def __init__(self, label):
        super().__init__(daemon=True); self.label = label; self.comm = comms[label]
        self.jobs = []; self.cv = threading.Condition(); self.stop = False; self.done = 0
    def run(self):
        while True:
            with self.cv:
                self.cv.wait(timeout=0.001 if self.jobs else 0.05)   # idle cycle
                jobs, self.jobs = self.jobs, []
                stop = self.stop
            flag = np.array([stop and not jobs], dtype=np.int64); out = np.empty_like(flag)
            with gate():
                req = self.comm.Iallreduce(flag, out, op=MPI.MIN)   # "negotiation"; stop when all agree
            test_until([req], True)
            agreed_stop = out[0] == 1
            for n in jobs:
                ring(self.comm, n, True)
            with self.cv:
                self.done += len(jobs); self.cv.notify_all()
            if agreed_stop: return
    def submit_and_wait(self, n, k):
        with self.cv:
            target = self.done + k
            self.jobs += [n] * k; self.cv.notify_all()
            while self.done < target: self.cv.wait()

workers = {}
class OneWorker(Worker):
    """one thread drives every group: negotiates on each comm in a fixed order, then runs jobs"""
    def run(self):
        while True:
            with self.cv:
                self.cv.wait(timeout=0.001 if self.jobs else 0.05)
                jobs, self.jobs = self.jobs, []
                stop = self.stop
            for label, comm in comms.items():
                mine = [n for (l, n) in jobs if l == label]
                flag = np.array([stop and not jobs], dtype=np.int64); out = np.empty_like(flag)
                test_until([comm.Iallreduce(flag, out, op=MPI.MIN)], True)
                agreed_stop = out[0] == 1
                for n in mine: ring(comm, n, True)
            with self.cv:
                self.done += len(jobs); self.cv.notify_all()
            if agreed_stop: return
class Front:
    def __init__(self, w, label): self.w, self.label = w, label
    def submit_and_wait(self, n, k): self.w.submit_and_wait((self.label, n), k)
if THREADS == 1 and os.environ.get("ONE"):
    one = OneWorker("world"); one.start()
    workers = {k: Front(one, k) for k in comms}
elif THREADS:
    workers = {k: Worker(k) for k in comms}
    for w in workers.values(): w.start()
for it in range(int(os.environ.get("ITERS", "3"))):
    for label in ("world", "data", "pipe"):
        a = np.ones(300_007); b = np.empty_like(a)
        if GATE is not None:
            with gate(): req = direct[label].Iallreduce(a, b)
            test_until([req], False)
        else:
            direct[label].Allreduce(a, b)
        log(it, label, "direct done")
        if THREADS:
            workers[label].submit_and_wait(120_000, 3)
        else:
            slp = bool(os.environ.get("SLEEP"))
            for _ in range(3):
                if os.environ.get("NEGOTIATE"):
                    for c in comms.values():
                        f = np.zeros(1, dtype=np.int64); o = np.empty_like(f)
                        test_until([c.Iallreduce(f, o, op=MPI.MIN)], slp)
                ring(comms[label], 120_000, slp)
        log(it, label, "engine done")
real = [one] if os.environ.get("ONE") else list(workers.values())
for w in real:
    with w.cv: w.stop = True; w.cv.notify_all()
for w in real: w.join()
log("done")

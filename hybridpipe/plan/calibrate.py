"""``python -m hybridpipe.plan calibrate``: measure this job's links and save them as the planner's cluster.

Run it under the launcher that will run the training, on the same hosts::

    hybridpipe-run -np 8 python -m hybridpipe.plan calibrate --output cluster.json

Design reasons:

* It measures the paths the training uses, not MPI alone: point-to-point messages go through
  ``hybridpipe.comm.p2p`` (the pipeline's transfers, on the communication thread), allreduces
  through ``hp.allreduce`` (the ring, shared memory or hierarchical path the engine picks).
* Latency and bandwidth come from a least-squares fit of ``time = α + bytes / β`` over message
  sizes from 8 bytes to 4 MiB (medians of repeats): α is the latency, β the bandwidth. A ping-pong
  between world ranks 0 and 1 gives the inside-a-host link; between rank 0 and the first rank of
  another host, the link between hosts (when the job spans hosts).
* The ring allreduce's fit (``time = a + bytes · b``) is kept too, for the group sizes in the job.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from hybridpipe.errors import HybridPipeError
from hybridpipe.plan.cost import Cluster

__all__ = ["calibrate", "fit", "load_cluster", "SIZES"]

SIZES = [8, 1024, 16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024]


def fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least squares of ``seconds = a + sizes · b`` with ``a, b >= 0``; returns ``(a, b)``."""
    x, y = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        return float(max(y.min(), 0.0)), 0.0
    if intercept < 0:
        return 0.0, float((x * y).sum() / (x * x).sum())
    return float(intercept), float(slope)


def _ping_pong(comm: Any, peer: int, me: int, repeats: int) -> list[float]:
    """One-way times per size between ``me`` and ``peer`` (half the round trip), medians."""
    from hybridpipe.comm import p2p

    times = []
    for size in SIZES:
        payload = torch.zeros(size // 4, dtype=torch.float32)
        runs = []
        for run in range(repeats + 2):
            started = time.perf_counter()
            if me < peer:
                p2p.send(payload, peer, 0, comm).wait()
                p2p.Receive(peer, 2, comm).wait()
            else:
                p2p.Receive(peer, 0, comm).wait()
                p2p.send(payload, peer, 2, comm).wait()
            if run >= 2:
                runs.append((time.perf_counter() - started) / 2)
        times.append(statistics.median(runs))
    return times


def calibrate(repeats: int = 9) -> dict[str, Any]:
    """Measures the running job's links (collective: every rank calls it after ``hp.init``)."""
    import hybridpipe as hp
    from hybridpipe import runtime
    from hybridpipe.comm.engine import call
    from hybridpipe.launch import available_cores

    state = runtime._require("calibrate")
    world = state.grid.world_comm
    size, rank = world.size, world.rank
    hosts = call(None, "calibrate", lambda: world.allgather(runtime.local_rank() == 0))
    host_starts = [r for r, first in enumerate(hosts) if first]
    result: dict[str, Any] = {"format": "hybridpipe-cluster-1", "ranks": size, "ranks_per_host": runtime.local_size(),
                              "cores_per_host": available_cores(), "sizes": SIZES}
    comm = call(None, "calibrate", world.Dup)
    try:
        pairs = []
        if size > 1 and runtime.local_size() > 1:
            pairs.append(("intra", 0, 1))
        if len(host_starts) > 1:
            pairs.append(("inter", 0, host_starts[1]))
        for label, a, b in pairs:
            if rank in (a, b):
                times = _ping_pong(comm, b if rank == a else a, rank, repeats)
                if rank == a:
                    latency, per_byte = fit(SIZES, times)
                    result[f"{label}_p2p_seconds"] = times
                    result[f"{label}_latency_us"] = latency * 1e6
                    result[f"{label}_gbps"] = 8 / per_byte / 1e9 if per_byte > 0 else 0.0
            call(None, "calibrate", comm.Barrier)
        reduce_times = []
        for nbytes in SIZES:
            tensor = torch.ones(max(nbytes // 4, 1))
            runs = []
            for run in range(repeats + 2):
                call(None, "calibrate", comm.Barrier)
                started = time.perf_counter()
                hp.allreduce_(tensor, op=hp.Sum)
                if run >= 2:
                    runs.append(time.perf_counter() - started)
            reduce_times.append(statistics.median(runs))
        if rank == 0:
            a, b = fit(SIZES, reduce_times)
            result["allreduce_seconds"] = reduce_times
            result["allreduce_alpha_us"] = a * 1e6
            result["allreduce_gbps"] = 8 / b / 1e9 if b > 0 else 0.0
    finally:
        call(None, "calibrate", comm.Free)
    return call(None, "calibrate", lambda: world.bcast(result if rank == 0 else None, root=0))


def load_cluster(path: str, memory_per_rank: float = 0.0, ranks: int | None = None) -> Cluster:
    """A :class:`Cluster` from a calibration file (``ranks`` overrides its rank count, e.g. to plan for
    more hosts of the same kind)."""
    with open(path) as file:
        data = json.load(file)
    if data.get("format") != "hybridpipe-cluster-1":
        raise HybridPipeError(f"{path} is not a hybridpipe calibration (python -m hybridpipe.plan calibrate)")
    intra = data.get("intra_gbps") or data.get("allreduce_gbps") or 40.0
    latency = data.get("intra_latency_us", data.get("allreduce_alpha_us", 20.0))
    return Cluster(ranks=ranks or int(data["ranks"]), ranks_per_host=int(data["ranks_per_host"]),
                   cores_per_host=int(data.get("cores_per_host", 0)), intra_host_gbps=float(intra),
                   inter_host_gbps=float(data.get("inter_gbps") or intra), latency_us=float(latency),
                   memory_per_rank=memory_per_rank)

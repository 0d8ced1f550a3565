"""Pieces the benchmark drivers share: torch.distributed on gloo over loopback beside MPI."""

from __future__ import annotations

import datetime
import os
from typing import Any


def start_gloo(comm: Any, timeout_s: float = 300.0) -> tuple[Any, Any]:
    """Initializes torch.distributed's gloo process group over the ranks of the mpi4py ``comm``.

    Rank 0 opens the rendezvous store itself on port 0 (the kernel picks a free port, so no other
    process can take it between choosing and binding) without waiting for the others, then
    broadcasts the port over MPI. Returns ``(torch.distributed, store)``; keep the store alive.

    Raises:
        RuntimeError: on every rank, naming the failing ranks, when gloo could not start on one of
            them (the caller decides whether its columns stay empty or the launch fails).
    """
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    rank, size = comm.Get_rank(), comm.Get_size()
    store, port, error = None, 0, ""
    if rank == 0:
        try:
            store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
            port = store.port
        except Exception as exc:  # noqa: BLE001 — reported to every rank below
            error = f"rank 0 could not open a TCPStore on 127.0.0.1 ({exc})"
    port = comm.bcast(port, root=0)
    if port:
        try:
            if store is None:
                store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 — reported to every rank below
            error = f"rank {rank}: gloo init on 127.0.0.1:{port} failed ({exc})"
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise RuntimeError("; ".join(errors))
    return dist, store

"""Recording side of the timeline (see hybridpipe.timeline for the format and the tools).

Kept apart from the analysis so that the package imports it without importing matplotlib code,
and so that ``python -m hybridpipe.timeline`` runs a module the package has not imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["enabled", "span", "record", "start_timeline", "stop_timeline"]

_active: _Recorder | None = None


class _Recorder:
    def __init__(self, path: str, rank: int) -> None:
        self.path, self.rank = Path(path), rank
        self.part = Path(f"{path}.rank{rank}.part")
        self.part.parent.mkdir(parents=True, exist_ok=True)
        self.part.write_text("")
        self.t0 = time.monotonic()
        self.events: list[tuple] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.writer = threading.Thread(target=self._write_loop, name="hybridpipe-timeline", daemon=True)
        self.writer.start()

    def add(self, name: str, category: str, track: str, start: float, end: float, args: dict | None) -> None:
        with self.lock:
            self.events.append((name, category, track, start, end, args))

    def _flush(self) -> None:
        with self.lock:
            events, self.events = self.events, []
        if not events:
            return
        lines = []
        for name, category, track, start, end, args in events:
            event = {"name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": track,
                     "ts": round((start - self.t0) * 1e6, 3), "dur": round(max(end - start, 0.0) * 1e6, 3)}
            if args:
                event["args"] = args
            lines.append(json.dumps(event))
        with open(self.part, "a") as handle:
            handle.write("\n".join(lines) + "\n")

    def _write_loop(self) -> None:
        while not self.stop.wait(0.5):
            self._flush()

    def close(self) -> None:
        self.stop.set()
        self.writer.join()
        self._flush()


def enabled() -> bool:
    """Whether this process records a timeline."""
    return _active is not None


def record(name: str, category: str, track: str, start: float, end: float, args: dict | None = None) -> None:
    """Adds a finished span (``time.monotonic()`` seconds) to this rank's track ``track``."""
    recorder = _active
    if recorder is not None:
        recorder.add(name, category, track, start, end, args)


@contextlib.contextmanager
def span(name: str, category: str, track: str = "compute", **args: Any) -> Iterator[None]:
    """Records the enclosed block as one span (does nothing when the timeline is off)."""
    if _active is None:
        yield
        return
    start = time.monotonic()
    try:
        yield
    finally:
        _active.add(name, category, track, start, time.monotonic(), args or None)


def _start(path: str, grid: Any) -> None:
    """Called by hp.init when HYBRIDPIPE_TIMELINE is set (after a barrier: a common time zero)."""
    global _active
    from .comm.engine import call  # the engine is running: its thread makes the MPI calls

    call(None, "timeline", grid.world_comm.Barrier)
    _active = _Recorder(path, grid.rank)


def _stop(grid: Any, engine_events: dict[str, list]) -> None:
    """Called by hp.shutdown: writes the engine's events, closes, and rank 0 merges the parts."""
    global _active
    recorder, _active = _active, None
    if recorder is None:
        return
    for group, events in engine_events.items():
        for event in events:
            if event.start < recorder.t0:  # e.g. the timeline's own start-up barrier, run by the engine
                continue
            args = {"bytes": event.bytes, "tensors": event.tensors} if event.bytes else None
            recorder.add(event.phase, "engine", f"engine {group}", event.start, event.end, args)
    recorder.close()
    from .comm.engine import call  # on the communication thread while it runs (hp.stop_timeline)

    call(None, "timeline", grid.world_comm.Barrier)
    if grid.rank == 0:
        events = [e for r in range(grid.size) for e in _header_of(r, grid)]
        for r in range(grid.size):
            part = Path(f"{recorder.path}.rank{r}.part")
            if part.exists():
                events += [json.loads(line) for line in part.read_text().splitlines() if line.strip()]
                part.unlink()
        temporary = recorder.path.with_name(f".{recorder.path.name}.tmp")
        temporary.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                         "otherData": {"producer": "hybridpipe",
                                                       "pipeline_stages": grid.pipeline_stages,
                                                       "data_replicas": grid.data_replicas}}))
        os.replace(temporary, recorder.path)
    call(None, "timeline", grid.world_comm.Barrier)


def start_timeline(file_path: str | os.PathLike, mark_cycles: bool = False) -> None:
    """Starts recording this job's Chrome trace into ``file_path`` (Horovod's ``hvd.start_timeline``).

    Collective: every rank calls it with the same path. The trace is the one ``HYBRIDPIPE_TIMELINE``
    writes (docs/timeline.md): pipeline actions, optimizer steps, every collective's run on the
    communication thread, and the engine's phases when ``HYBRIDPIPE_TIMELINE`` was set at ``hp.init``
    (the engine records them only then). A timeline already recording is stopped (written) first.

    Args:
        file_path: where rank 0 writes the merged trace at :func:`stop_timeline` (or ``hp.shutdown``).
        mark_cycles: accepted for Horovod's signature; the engine's "negotiate" events already mark its
            cycles when it records.

    Raises:
        NotInitializedError: before ``hp.init()``.
    """
    from .comm import context

    state = context.current("start_timeline")
    if _active is not None:
        stop_timeline()
    _start(os.fspath(file_path), state.grid)


def stop_timeline() -> None:
    """Stops the timeline and writes it (collective; nothing happens when none is recording)."""
    from .comm import context

    state = context.current("stop_timeline")
    if _active is not None:
        _stop(state.grid, state.events())


def _header_of(rank: int, grid: Any) -> list[dict]:
    stage, replica = grid.place_of(rank)
    return [{"ph": "M", "name": "process_name", "pid": rank,
             "args": {"name": f"rank {rank} (stage {stage}, replica {replica})"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}]



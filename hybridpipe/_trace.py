"""Recording side of the timeline (see hybridpipe.timeline for the format and the tools).

Kept apart from the analysis so that the package imports it without importing matplotlib code,
and so that ``python -m hybridpipe.timeline`` runs a module the package has not imported. The recorder
belongs to the running job (its ``timeline``), so hp.shutdown drops it with the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import running

__all__ = ["enabled", "span", "record", "start", "stop"]


def _recorder() -> Recorder | None:
    """The running job's recorder, or None (no job, or no timeline)."""
    job = running.current_or_none()
    return None if job is None else job.timeline


class Recorder:
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
    return _recorder() is not None


def record(name: str, category: str, track: str, start: float, end: float, args: dict | None = None) -> None:
    """Adds a finished span (``time.monotonic()`` seconds) to this rank's track ``track``."""
    recorder = _recorder()
    if recorder is not None:
        recorder.add(name, category, track, start, end, args)


@contextlib.contextmanager
def span(name: str, category: str, track: str = "compute", **args: Any) -> Iterator[None]:
    """Records the enclosed block as one span (does nothing when the timeline is off)."""
    recorder = _recorder()
    if recorder is None:
        yield
        return
    start = time.monotonic()
    try:
        yield
    finally:
        recorder.add(name, category, track, start, time.monotonic(), args or None)


def start(job: Any, path: str, barrier: Callable[[], None]) -> None:
    """Starts recording ``job``'s timeline into ``path`` after ``barrier()`` (every rank's: a common time zero);
    called by hp.init when HYBRIDPIPE_TIMELINE is set and by hp.start_timeline, with a barrier run on the
    engine's thread."""
    barrier()
    job.timeline = Recorder(path, job.grid.rank)


def stop(job: Any, engine_events: dict[str, list], barrier: Callable[[], None]) -> None:
    """Called by hp.shutdown and hp.stop_timeline: writes the engine's events, closes ``job``'s recorder, and
    rank 0 merges the parts, between two ``barrier()`` calls of every rank."""
    recorder, job.timeline = job.timeline, None
    if recorder is None:
        return
    grid = job.grid
    for group, events in engine_events.items():
        for event in events:
            if event.start < recorder.t0:  # e.g. the timeline's own start-up barrier, run by the engine
                continue
            args = {"bytes": event.bytes, "tensors": event.tensors} if event.bytes else None
            recorder.add(event.phase, "engine", f"engine {group}", event.start, event.end, args)
    recorder.close()
    barrier()
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
    barrier()


def _header_of(rank: int, grid: Any) -> list[dict]:
    stage, replica = grid.place_of(rank)
    return [{"ph": "M", "name": "process_name", "pid": rank,
             "args": {"name": f"rank {rank} (stage {stage}, replica {replica})"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}]



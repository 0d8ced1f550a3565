"""PipeDream's planner on PipeDream's own per-layer profiles: stages with their own replica counts ("15-1").

A dynamic program over the profile's layer chain × workers chooses contiguous stages and a replica count
for each, on a two-level cluster (servers of G GPUs; intra- and inter-server bandwidth), and compares the
best pipeline with pure data parallelism over all workers. ``python -m hybridpipe.plan --pipedream-profile``
is its command line; docs/planner.md ("PipeDream's profiles") states the cost model and its assumptions.

Why its own module: the profiles (msr-fiddle/pipedream's ``graph.txt`` converted to JSON, see
bench/data/pipedream/README.md in the repository) carry only per-layer forward / backward times, output bytes and parameter
bytes at one batch size, and the configurations searched here (a replica count per stage, PipeDream's
asynchronous round-robin pipeline) are not the uniform stages × replicas grid that search.py simulates.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from hybridpipe.errors import GridError, PipeDreamProfileError

# Two values within this relative distance are equal (floating-point noise of the same sums in another order).
TIE_TOLERANCE = 1e-9

# Plans predicted within this fraction of the fastest count as equally fast; the one sending the fewest bytes
# wins among them (optimize()): the model's communication times are its least certain part.
DEFAULT_TOLERANCE = 0.10

# How a replicated stage's allreduce overlaps its compute (see _Costs.table and docs/planner.md).
OVERLAPS = ("none", "layer", "stage")
DEFAULT_OVERLAP = "none"


@dataclasses.dataclass(frozen=True)
class Layer:
    """One node of the profile, in seconds and bytes at the profiled batch."""

    node_id: str
    description: str
    forward_seconds: float
    backward_seconds: float
    activation_bytes: float
    parameter_bytes: float


@dataclasses.dataclass(frozen=True)
class PipeDreamProfile:
    """A PipeDream profile: the layers in the chain's order (input nodes set apart) and the bytes that
    cross each cut of the chain.

    ``cut_bytes[p]`` is the output of every layer before position ``p`` that a layer at ``p`` or later
    consumes (for a chain: the one boundary tensor; for ResNet's and GNMT's branches also the skip or
    encoder tensors still needed behind the cut, as PipeDream's augmented antichains count them).
    ``cut_bytes[0]`` and ``cut_bytes[n]`` are 0.

    Example:
        >>> profile = PipeDreamProfile.load("bench/data/pipedream/vgg16.json")
        >>> len(profile.layers), profile.batch
        (40, 128)
    """

    model: str
    path: str
    batch: int
    layers: tuple[Layer, ...]
    input_ids: tuple[str, ...]
    cut_bytes: tuple[float, ...]

    @classmethod
    def load(cls, path: str | Path) -> "PipeDreamProfile":
        """Reads one of bench/data/pipedream/*.json (fields: nodes, edges, chain, profiled_batch_size).

        Raises:
            PipeDreamProfileError: the file is missing, not JSON, or lacks a field (named in the message).
        """
        path = Path(path)
        if not path.is_file():
            raise PipeDreamProfileError(f"no PipeDream profile at {str(path)!r} (pass one of the JSON files of "
                                        "bench/data/pipedream/ in the repository, e.g. "
                                        "bench/data/pipedream/vgg16.json)")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise PipeDreamProfileError(f"{path} is not a JSON PipeDream profile ({error})") from error
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "<dict>") -> "PipeDreamProfile":
        """Builds a profile from the JSON fields (``nodes``, ``edges``, ``chain``, ``profiled_batch_size``).

        Times are milliseconds in the file (PipeDream's units) and seconds here.

        Raises:
            PipeDreamProfileError: a field is missing, a node unknown, or ``chain`` not a topological order.
        """
        try:
            nodes = {node["id"]: node for node in data["nodes"]}
            edges = [(source, target) for source, target in data["edges"]]
            chain = list(data.get("chain") or [node["id"] for node in data["nodes"]])
            batch = int(data.get("profiled_batch_size") or 0)
            for node in nodes.values():
                for field in ("forward_ms", "backward_ms", "activation_bytes", "parameter_bytes"):
                    float(node[field])
        except (KeyError, TypeError, ValueError) as error:
            raise PipeDreamProfileError(f"{path}: missing or malformed field {error} (expected nodes with id, desc, "
                                        "forward_ms, backward_ms, activation_bytes, parameter_bytes; edges; chain; "
                                        "profiled_batch_size, as in bench/data/pipedream/README.md)") from error
        if batch <= 0:
            raise PipeDreamProfileError(f"{path}: profiled_batch_size must be a positive integer (got "
                                        f"{data.get('profiled_batch_size')!r})")
        unknown = sorted({node for edge in edges for node in edge} - nodes.keys()) + sorted(set(chain) - nodes.keys())
        if unknown or sorted(chain) != sorted(nodes):
            raise PipeDreamProfileError(f"{path}: chain and edges must name each node once (unknown or missing: "
                                        f"{unknown or sorted(set(nodes) - set(chain))})")
        predecessors: dict[str, set[str]] = {node: set() for node in nodes}
        for source, target in edges:
            predecessors[target].add(source)
        # PipeDream's optimizer zeroes its sources named Input* (data loading) and pins them to stage 0.
        inputs = tuple(node for node in chain
                       if not predecessors[node] and str(nodes[node].get("desc", "")).startswith("Input"))
        order = [node for node in chain if node not in inputs]
        position = {node: index for index, node in enumerate(order)}
        for source, target in edges:
            if source in position and target in position and position[source] >= position[target]:
                raise PipeDreamProfileError(f"{path}: chain is not a topological order (edge {source} -> {target} "
                                            "goes backwards); list the nodes so that every edge points forward")
        if not order:
            raise PipeDreamProfileError(f"{path}: no layers besides the input nodes")
        # A layer's output crosses every cut between it and its last consumer.
        crossing = np.zeros(len(order) + 2)
        last_use = {node: position[node] for node in order}
        for source, target in edges:
            if source in position and target in position:
                last_use[source] = max(last_use[source], position[target])
        for node in order:
            if last_use[node] > position[node]:
                size = float(nodes[node]["activation_bytes"])
                crossing[position[node] + 1] += size
                crossing[last_use[node] + 1] -= size
        cut_bytes = np.cumsum(crossing)[: len(order) + 1]
        cut_bytes[0] = 0.0
        layers = tuple(Layer(node, str(nodes[node].get("desc", "")), float(nodes[node]["forward_ms"]) / 1e3,
                             float(nodes[node]["backward_ms"]) / 1e3, float(nodes[node]["activation_bytes"]),
                             float(nodes[node]["parameter_bytes"])) for node in order)
        return cls(str(data.get("model") or Path(path).stem), path, batch, layers, inputs,
                   tuple(float(value) for value in cut_bytes))


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """Servers of ``gpus_per_server`` GPUs; bandwidths in bytes per second (one link, one direction).

    Example:
        >>> Hierarchy(servers=4, gpus_per_server=4, intra_bandwidth=10e9, inter_bandwidth=1.25e9).workers
        16
    """

    servers: int
    gpus_per_server: int
    intra_bandwidth: float
    inter_bandwidth: float

    def __post_init__(self) -> None:
        for name in ("servers", "gpus_per_server"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise GridError(f"{name} must be a positive integer (got {value!r}; pass e.g. {flag} 4)")
        for name in ("intra_bandwidth", "inter_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                flag = "--" + name.replace("_", "-")
                raise GridError(f"{name} must be a positive number of bytes per second (got {value!r}; pass e.g. "
                                f"{flag} 10e9 for 10 GB/s)")

    @property
    def workers(self) -> int:
        return self.servers * self.gpus_per_server

    def servers_spanned(self, first: int, count: int) -> int:
        """How many servers workers ``first`` ... ``first + count - 1`` (filled server by server) occupy."""
        return (first + count - 1) // self.gpus_per_server - first // self.gpus_per_server + 1

    def bandwidth(self, servers: int) -> float:
        return self.intra_bandwidth if servers == 1 else self.inter_bandwidth


def allreduce_seconds(parameter_bytes: float, replicas: int, bandwidth: float) -> float:
    """A ring allreduce of ``parameter_bytes`` among ``replicas``: 2 (r - 1) / r × bytes / bandwidth."""
    return 0.0 if replicas <= 1 else 2.0 * (replicas - 1) / replicas * parameter_bytes / bandwidth


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a PipeDream configuration: layers ``first`` ... ``last - 1`` of the chain on workers
    ``first_worker`` ... ``first_worker + replicas - 1``. ``compute_seconds`` and ``allreduce_seconds`` are one
    replica's per minibatch it handles; ``seconds`` is the stage's time per minibatch of the pipeline (its
    replicas take turns); ``allreduce_bytes`` and ``input_bytes`` (activations forward, gradients back across
    the cut before it, over ``input_link``, in ``input_seconds``) are per minibatch of the pipeline."""

    first: int
    last: int
    replicas: int
    first_worker: int
    servers: int
    node_ids: tuple[str, ...]
    compute_seconds: float
    parameter_bytes: float
    allreduce_seconds: float
    allreduce_bytes: float
    input_bytes: float
    input_seconds: float
    input_link: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class PipeDreamPlan:
    """The configuration chosen, the fastest found (the same unless another within ``tolerance`` sends fewer
    bytes) and data parallelism over all workers, each as stages with their times per minibatch."""

    profile: PipeDreamProfile
    hierarchy: Hierarchy
    minibatch: float
    overlap: str
    tolerance: float
    stages: tuple[Stage, ...]
    fastest: tuple[Stage, ...]
    data_parallel: Stage
    searched_seconds: float = 0.0

    @property
    def stage_replicas(self) -> list[int]:
        return [stage.replicas for stage in self.stages]

    @property
    def config(self) -> str:
        """As PipeDream prints it: "16" (data parallel), "straight" (no stage replicated), else "15-1"."""
        return configuration_name(self.stage_replicas)

    @property
    def seconds(self) -> float:
        """Time per minibatch in steady state: the slowest stage or cut."""
        return pipeline_seconds(self.stages)

    @property
    def data_parallel_seconds(self) -> float:
        return self.data_parallel.seconds

    @property
    def predicted_speedup_over_dp(self) -> float:
        return self.data_parallel_seconds / self.seconds

    @property
    def bytes_per_minibatch(self) -> float:
        return sum(stage.allreduce_bytes + stage.input_bytes for stage in self.stages)

    @property
    def bottleneck(self) -> str:
        """What sets the pace: "stage 0" or "the cut before stage 1"."""
        return bottleneck(self.stages)

    def to_json(self) -> dict[str, Any]:
        stage_nodes = [list(stage.node_ids) for stage in self.stages]
        stage_nodes[0] = list(self.profile.input_ids) + stage_nodes[0]
        return {
            "config": self.config,
            "stage_replicas": self.stage_replicas,
            "stages": stage_nodes,
            "predicted_speedup_over_dp": self.predicted_speedup_over_dp,
            "seconds_per_minibatch": self.seconds,
            "data_parallel_seconds_per_minibatch": self.data_parallel_seconds,
            "bytes_per_minibatch": self.bytes_per_minibatch,
            "data_parallel_bytes_per_minibatch": self.data_parallel.allreduce_bytes,
            "bottleneck": self.bottleneck,
            "minibatch": self.minibatch,
            "servers": self.hierarchy.servers,
            "gpus_per_server": self.hierarchy.gpus_per_server,
            "intra_bandwidth": self.hierarchy.intra_bandwidth,
            "inter_bandwidth": self.hierarchy.inter_bandwidth,
            "overlap": self.overlap,
            "tolerance": self.tolerance,
            "fastest": {"config": configuration_name([stage.replicas for stage in self.fastest]),
                        "stage_replicas": [stage.replicas for stage in self.fastest],
                        "layer_ranges": [[stage.first, stage.last] for stage in self.fastest],
                        "seconds_per_minibatch": pipeline_seconds(self.fastest),
                        "bytes_per_minibatch": sum(stage.allreduce_bytes + stage.input_bytes
                                                   for stage in self.fastest)},
            "stage_details": [{**dataclasses.asdict(stage), "node_ids": nodes}
                              for stage, nodes in zip(self.stages, stage_nodes)],
            "profile": self.profile.path,
            "searched_seconds": self.searched_seconds,
        }


def pipeline_seconds(stages: tuple[Stage, ...]) -> float:
    return max(max(stage.seconds, stage.input_seconds) for stage in stages)


def bottleneck(stages: tuple[Stage, ...]) -> str:
    slowest = pipeline_seconds(stages)
    for index, stage in enumerate(stages):
        if stage.seconds >= slowest * (1 - TIE_TOLERANCE):
            return f"stage {index}"
    index = max(range(len(stages)), key=lambda index: stages[index].input_seconds)
    return f"the cut before stage {index}"


def configuration_name(stage_replicas: list[int]) -> str:
    if len(stage_replicas) == 1:
        return str(stage_replicas[0])
    if all(replicas == 1 for replicas in stage_replicas):
        return "straight"
    return "-".join(str(replicas) for replicas in stage_replicas)


class _Costs:
    """Per-minibatch costs of every contiguous run of layers on every placement, as arrays."""

    def __init__(self, profile: PipeDreamProfile, hierarchy: Hierarchy, minibatch: float, overlap: str) -> None:
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAPS)} (got {overlap!r})")
        scale = minibatch / profile.batch
        workers, layers = hierarchy.workers, len(profile.layers)
        self.profile, self.hierarchy, self.overlap = profile, hierarchy, overlap
        layer_compute = np.array([(layer.forward_seconds + layer.backward_seconds) * scale for layer in profile.layers])
        layer_parameters = np.array([layer.parameter_bytes for layer in profile.layers])
        self.compute = np.concatenate(([0.0], np.cumsum(layer_compute)))
        self.parameters = np.concatenate(([0.0], np.cumsum(layer_parameters)))
        self.cut_bytes = 2.0 * np.asarray(profile.cut_bytes) * scale  # forward activations + their gradients
        # ring allreduce bytes each replica sends per minibatch of the stage, per parameter byte: 2 (r-1) / r
        self.ring = np.array([0.0] + [2.0 * (r - 1) / r for r in range(1, workers + 1)])
        # spans_servers[first, r]: 1 when workers first .. first+r-1 are on more than one server
        self.spans_servers = np.zeros((workers + 1, workers + 1), dtype=np.int64)
        for first in range(workers):
            for replicas in range(1, workers - first + 1):
                self.spans_servers[first, replicas] = int(hierarchy.servers_spanned(first, replicas) > 1)
        # stage_seconds[r, spans, i, j]: layers i .. j-1 on r replicas (inside one server / across servers)
        self.stage_seconds = np.full((workers + 1, 2, layers + 1, layers + 1), math.inf)
        for replicas in range(1, workers + 1):
            for spans, bandwidth in ((0, hierarchy.intra_bandwidth), (1, hierarchy.inter_bandwidth)):
                reduce = self.ring[replicas] / bandwidth * layer_parameters
                if overlap == "layer":
                    busy = np.concatenate(([0.0], np.cumsum(np.maximum(layer_compute, reduce))))
                    total = busy[None, :] - busy[:, None]
                else:
                    compute = self.compute[None, :] - self.compute[:, None]
                    reduced = np.concatenate(([0.0], np.cumsum(reduce)))
                    reduced = reduced[None, :] - reduced[:, None]
                    total = np.maximum(compute, reduced) if overlap == "stage" else compute + reduced
                total = total / replicas
                total[np.tril_indices(layers + 1)] = math.inf  # empty or reversed runs
                self.stage_seconds[replicas, spans] = total
        # cut_seconds_per_byte[used, r_before, r_after]: the stage before the cut on workers used-r_before ..
        # used-1, the one after on used .. used+r_after-1
        self.cut_seconds_per_byte = np.full((workers + 1, workers + 1, workers + 1), math.inf)
        for used in range(1, workers):
            for before in range(1, used + 1):
                for after in range(1, workers - used + 1):
                    self.cut_seconds_per_byte[used, before, after] = self._cut_per_byte((used - before, before),
                                                                                        (used, after))[0]

    def _cut_per_byte(self, before: tuple[int, int], after: tuple[int, int]) -> tuple[float, str]:
        """Inside one server the replica pairs' transfers run in parallel (min of the two replica counts);
        across servers each server's link carries its share (min of the servers each side spans)."""
        g = self.hierarchy.gpus_per_server
        if before[0] // g == (after[0] + after[1] - 1) // g:
            return 1.0 / (self.hierarchy.intra_bandwidth * min(before[1], after[1])), "intra"
        links = min(self.hierarchy.servers_spanned(*before), self.hierarchy.servers_spanned(*after))
        return 1.0 / (self.hierarchy.inter_bandwidth * links), "inter"

    def stage(self, start: int, end: int, first_worker: int, replicas: int) -> float:
        return float(self.stage_seconds[replicas, self.spans_servers[first_worker, replicas], start, end])

    def stage_bytes(self, start: int, end: int, replicas: int) -> float:
        """Bytes the stage's allreduce sends per minibatch, all replicas together: 2 (r-1) / r × parameters."""
        return float(self.ring[replicas] * (self.parameters[end] - self.parameters[start]))

    def cut(self, position: int, before: tuple[int, int], after: tuple[int, int]) -> tuple[float, str]:
        """Seconds per minibatch to send the activations forward and their gradients back across the cut at
        ``position`` between workers ``before`` = (first, count) and ``after``, and the link ("intra"/"inter")."""
        per_byte, link = self._cut_per_byte(before, after)
        return float(self.cut_bytes[position] * per_byte), link


Bounds = list[tuple[int, int, int, int]]  # per stage: first layer, end layer, first worker, replicas


def _search(costs: _Costs, limit: float | None, max_replicas: int) -> tuple[float, Bounds]:
    """The dynamic program. ``limit`` None: minimise the pipeline's time per minibatch (its slowest stage or
    cut). Else: among pipelines whose every stage and cut takes at most ``limit``, minimise the bytes sent per
    minibatch (allreduces and cuts). Ties (within TIE_TOLERANCE) go to fewer stages, then to the first found.

    Stages get at most ``max_replicas`` replicas each (data parallelism on every worker is always a candidate).

    ``value[j, m, r]``: the best pipeline of layers 0 .. j-1 on workers 0 .. m-1 whose last stage has ``r``
    replicas (workers m-r .. m-1); ``came_start`` / ``came_replicas``: where that last stage starts and the
    replicas of the stage before it.
    """
    workers, layers = costs.hierarchy.workers, len(costs.profile.layers)
    shape = (layers + 1, workers + 1, workers + 1)
    value, stages = np.full(shape, math.inf), np.zeros(shape, dtype=np.int64)
    came_start, came_replicas = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    parameters = costs.parameters
    for replicas in sorted({*range(1, min(max_replicas, workers) + 1), workers}):
        seconds = costs.stage_seconds[replicas, costs.spans_servers[0, replicas], 0, 1:]
        if replicas == workers:
            seconds = np.where(np.arange(1, layers + 1) == layers, seconds, math.inf)
        if limit is None:
            value[1:, replicas, replicas] = seconds
        else:
            sent = costs.ring[replicas] * parameters[1:]
            value[1:, replicas, replicas] = np.where(seconds <= limit, sent, math.inf)
        stages[1:, replicas, replicas] = 1
    for start in range(1, layers):
        ends = np.arange(start + 1, layers + 1)
        for used in range(1, workers):
            before = value[start, used, 1:used + 1]
            if not np.isfinite(before).any():
                continue
            after = np.arange(1, min(workers - used, max_replicas) + 1)
            # (r_before, r_after): the pipeline up to and across this cut
            cut = costs.cut_bytes[start] * costs.cut_seconds_per_byte[used, 1:used + 1, 1:len(after) + 1]
            if limit is None:
                across = np.maximum(before[:, None], cut)
            else:
                across = np.where(cut <= limit, before[:, None] + costs.cut_bytes[start], math.inf)
            lowest = across.min(axis=0)
            near = across <= lowest * (1 + TIE_TOLERANCE)
            pick = np.argmin(np.where(near, stages[start, used, 1:used + 1][:, None], np.iinfo(np.int64).max), axis=0)
            pace = across[pick, np.arange(len(after))]
            count = stages[start, used, 1:used + 1][pick] + 1
            seconds = costs.stage_seconds[after[:, None], costs.spans_servers[used, after][:, None], start, ends[None, :]]
            if limit is None:
                candidate = np.maximum(pace[:, None], seconds)
            else:
                sent = costs.ring[after][:, None] * (parameters[ends] - parameters[start])[None, :]
                candidate = np.where(seconds <= limit, pace[:, None] + sent, math.inf)
            current = value[ends[None, :], (used + after)[:, None], after[:, None]]
            current_count = stages[ends[None, :], (used + after)[:, None], after[:, None]]
            with np.errstate(invalid="ignore"):
                close = np.abs(candidate - current) <= TIE_TOLERANCE * np.minimum(candidate, current)
            wins = np.isfinite(candidate) & np.where(close, count[:, None] < current_count, candidate < current)
            rows, columns = np.nonzero(wins)
            if len(rows):
                target = (ends[columns], used + after[rows], after[rows])
                value[target] = candidate[rows, columns]
                stages[target] = count[rows]
                came_start[target] = start
                came_replicas[target] = pick[rows] + 1
    best, best_count, last = math.inf, 0, 0
    for replicas in range(workers, 0, -1):  # data parallelism (r = workers) first: it wins ties
        if _better(value[layers, workers, replicas], stages[layers, workers, replicas], best, best_count):
            best, best_count, last = value[layers, workers, replicas], stages[layers, workers, replicas], replicas
    if best == math.inf:
        raise GridError("no configuration fits (this is a bug: data parallelism always does)")
    bounds: Bounds = []
    end, used, replicas = layers, workers, last
    while True:
        start, previous = int(came_start[end, used, replicas]), int(came_replicas[end, used, replicas])
        bounds.append((start, end, used - replicas, replicas))
        if start == 0:
            break
        end, used, replicas = start, used - replicas, previous
    bounds.reverse()
    return float(best), bounds


def _better(value: float, stages: int, best: float, best_stages: int) -> bool:
    if value == math.inf:
        return False
    if best == math.inf:
        return True
    if abs(value - best) <= TIE_TOLERANCE * min(value, best):
        return stages < best_stages
    return value < best


def optimize(profile: PipeDreamProfile, hierarchy: Hierarchy, global_batch: int | None = None,
             overlap: str = DEFAULT_OVERLAP, tolerance: float = DEFAULT_TOLERANCE,
             straight: bool = False) -> PipeDreamPlan:
    """The PipeDream configuration of ``profile`` on ``hierarchy``, with data parallelism beside it.

    Two passes of one dynamic program over (layers of the chain so far, workers used, replicas of the last
    stage). Workers are placed in stage order, server after server, so a stage's replicas span the servers
    its worker range covers: inside one server its allreduce and its cuts use the intra-server bandwidth,
    else the inter-server one. Every stage count and every replica count per stage is searched.

    1. The fastest pipeline: least time per minibatch of its slowest stage or cut.
    2. Among pipelines within ``tolerance`` of it, the one that sends the fewest bytes per minibatch
       (allreduces and cuts); then fewer stages; then the first found (earlier cuts, fewer workers before a
       cut, fewer replicas on the stage before it). Data parallelism wins every remaining tie.

    Args:
        profile: the layers and their costs at ``profile.batch``.
        hierarchy: servers, GPUs per server and the two bandwidths.
        global_batch: samples per round over all workers; each minibatch (one worker's) is
            ``global_batch / workers`` samples, times and activations scaled linearly from the profile's batch.
            Default: the profiled batch per worker, as PipeDream's optimizer takes it.
        overlap: how a replicated stage's allreduce overlaps its compute: "layer" (default: each layer's
            allreduce hides behind its own compute when that is longer: sum of max(compute, allreduce) per
            layer), "stage" (the paper's max(compute, allreduce) for the whole stage) or "none" (their sum, as
            PipeDream's optimizer code adds them).
        tolerance: relative; plans predicted within it of the fastest count as equally fast.

    Raises:
        GridError: the global batch is not a positive multiple of the worker count, or tolerance < 0.
    """
    import time

    started = time.perf_counter()
    workers = hierarchy.workers
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise GridError(f"tolerance must be a number >= 0 (got {tolerance!r}; pass e.g. --tolerance 0.05)")
    if global_batch is None:
        minibatch = float(profile.batch)
    else:
        if global_batch < workers or global_batch % workers:
            fix = max(workers, round(global_batch / workers) * workers)
            raise GridError(f"global batch {global_batch} must be a positive multiple of the {workers} workers "
                            f"({hierarchy.servers} servers × {hierarchy.gpus_per_server} GPUs; pass --global-batch "
                            f"{fix})")
        minibatch = global_batch / workers
    costs = _Costs(profile, hierarchy, minibatch, overlap)
    max_replicas = 1 if straight else workers
    fastest_seconds, fastest_bounds = _search(costs, None, max_replicas)
    data_parallel = _stage(costs, [(0, len(profile.layers), 0, workers)], 0)
    # Never slower than data parallelism: the baseline every configuration is compared with.
    limit = min(fastest_seconds * (1 + tolerance), max(data_parallel.seconds, fastest_seconds))
    _, bounds = _search(costs, limit * (1 + TIE_TOLERANCE), max_replicas)
    fastest = tuple(_stage(costs, fastest_bounds, index) for index in range(len(fastest_bounds)))
    chosen = tuple(_stage(costs, bounds, index) for index in range(len(bounds)))
    return PipeDreamPlan(profile, hierarchy, minibatch, overlap, tolerance, chosen, fastest, data_parallel,
                         time.perf_counter() - started)


def _stage(costs: _Costs, bounds: Bounds, index: int) -> Stage:
    start, end, first_worker, replicas = bounds[index]
    hierarchy = costs.hierarchy
    servers = hierarchy.servers_spanned(first_worker, replicas)
    parameters = float(costs.parameters[end] - costs.parameters[start])
    if index:
        previous = bounds[index - 1]
        input_seconds, link = costs.cut(start, (previous[2], previous[3]), (first_worker, replicas))
    else:
        input_seconds, link = 0.0, ""
    return Stage(first=start, last=end, replicas=replicas, first_worker=first_worker, servers=servers,
                 node_ids=tuple(layer.node_id for layer in costs.profile.layers[start:end]),
                 compute_seconds=float(costs.compute[end] - costs.compute[start]), parameter_bytes=parameters,
                 allreduce_seconds=allreduce_seconds(parameters, replicas, hierarchy.bandwidth(servers)),
                 allreduce_bytes=costs.stage_bytes(start, end, replicas),
                 input_bytes=float(costs.cut_bytes[start]) if index else 0.0,
                 input_seconds=input_seconds, input_link=link, seconds=costs.stage(start, end, first_worker, replicas))


def _megabytes(value: float) -> str:
    return f"{value / 1e6:,.1f} MB"


def _milliseconds(value: float) -> str:
    return f"{value * 1e3:,.1f} ms"


def _kinds(layers: tuple[Layer, ...]) -> str:
    """"13 Conv2d, 13 ReLU, 5 MaxPool2d": the layers' types by count, most first (then first seen)."""
    counts: dict[str, int] = {}
    for layer in layers:
        kind = layer.description.split("(", 1)[0].strip() or "?"
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items(), key=lambda item: -item[1]))


def _workers(stage: Stage, hierarchy: Hierarchy) -> str:
    last = stage.first_worker + stage.replicas - 1
    first_server, last_server = stage.first_worker // hierarchy.gpus_per_server, last // hierarchy.gpus_per_server
    workers = f"worker {last}" if stage.replicas == 1 else f"workers {stage.first_worker}-{last}"
    servers = f"server {first_server}" if first_server == last_server else f"servers {first_server}-{last_server}"
    return f"{workers} ({servers})"


def _describe_stage(plan: PipeDreamPlan, index: int, stage: Stage) -> list[str]:
    profile, hierarchy = plan.profile, plan.hierarchy
    layers = profile.layers[stage.first:stage.last]
    link = "intra-server" if stage.servers == 1 else "inter-server"
    replicas = f"{stage.replicas} replica{'s' if stage.replicas > 1 else ''}"
    lines = [f"  stage {index}: {replicas} on {_workers(stage, hierarchy)}, {len(layers)} layers "
             f"{layers[0].node_id} .. {layers[-1].node_id} ({_kinds(layers)})"]
    if index == 0 and profile.input_ids:
        lines[0] += f"; input nodes {', '.join(profile.input_ids)} load the data here"
    if stage.replicas > 1:
        reduce = (f"allreduce of {_megabytes(stage.parameter_bytes)} of parameters over an {link} ring of "
                  f"{stage.replicas} in {_milliseconds(stage.allreduce_seconds)}")
    else:
        reduce = f"no allreduce ({_megabytes(stage.parameter_bytes)} of parameters stay on one GPU)"
    lines.append(f"      compute {_milliseconds(stage.compute_seconds)} per minibatch, {reduce} -> "
                 f"{_milliseconds(stage.seconds)} per minibatch of the pipeline")
    return lines


def explain(plan: PipeDreamPlan) -> str:
    """The readable report of ``python -m hybridpipe.plan --pipedream-profile``: the configuration, each
    stage's layers, replicas, compute and communication, each cut, and what it saves against data parallelism."""
    profile, hierarchy = plan.profile, plan.hierarchy
    batch = ("the profile's" if plan.minibatch == profile.batch
             else f"global batch {plan.minibatch * hierarchy.workers:g} / {hierarchy.workers}")
    servers = f"{hierarchy.servers} server{'s' if hierarchy.servers > 1 else ''}"
    lines = [f"PipeDream configuration for {profile.model} ({profile.path}) on {servers} × "
             f"{hierarchy.gpus_per_server} GPUs: intra-server {hierarchy.intra_bandwidth / 1e9:g} GB/s, inter-server "
             f"{hierarchy.inter_bandwidth / 1e9:g} GB/s; minibatch {plan.minibatch:g} samples per worker ({batch})",
             "",
             f"config {plan.config}: {len(plan.stages)} stage{'s' if len(plan.stages) > 1 else ''}, replicas "
             f"{plan.stage_replicas}; predicted {plan.predicted_speedup_over_dp:.2f}× the throughput of data "
             f"parallelism ({hierarchy.workers})"]
    for index, stage in enumerate(plan.stages):
        if index:
            left, right = profile.layers[stage.first - 1], profile.layers[stage.first]
            lines.append(f"  cut between {left.node_id} ({left.description.split('(', 1)[0]}) and {right.node_id} "
                         f"({right.description.split('(', 1)[0]}): {_megabytes(stage.input_bytes)} per minibatch "
                         f"(activations forward + gradients back) over {stage.input_link}-server links in "
                         f"{_milliseconds(stage.input_seconds)}")
        lines += _describe_stage(plan, index, stage)
    lines.append(f"  pipeline: {_milliseconds(plan.seconds)} per minibatch ({plan.bottleneck} is the slowest), "
                 f"{plan.minibatch / plan.seconds:,.0f} samples/s")
    data_parallel = plan.data_parallel
    link = "intra-server" if data_parallel.servers == 1 else "inter-server"
    if len(plan.stages) == 1:
        lines.append(f"  (this is data parallelism: no pipeline is predicted more than {plan.tolerance:.0%} faster, "
                     "and none within that sends fewer bytes)")
    else:
        lines += ["", f"data parallelism ({hierarchy.workers}): each worker computes "
                      f"{_milliseconds(data_parallel.compute_seconds)} per minibatch, then all {hierarchy.workers} allreduce "
                      f"{_megabytes(data_parallel.parameter_bytes)} over an {link} ring in "
                      f"{_milliseconds(data_parallel.allreduce_seconds)} -> {_milliseconds(data_parallel.seconds)} per "
                      f"minibatch, {plan.minibatch / data_parallel.seconds:,.0f} samples/s"]
    if len(plan.stages) > 1:
        reduced = sum(stage.allreduce_bytes for stage in plan.stages)
        cuts = sum(stage.input_bytes for stage in plan.stages)
        unreplicated = sum(stage.parameter_bytes for stage in plan.stages if stage.replicas == 1)
        lines.append(f"communication against data parallelism, per minibatch, all workers together: allreduces send "
                     f"{_megabytes(reduced)} instead of {_megabytes(data_parallel.allreduce_bytes)}, the cuts "
                     f"{_megabytes(cuts)}; {_megabytes(unreplicated)} of parameters are never allreduced "
                     f"({_megabytes(data_parallel.allreduce_bytes - reduced - cuts)} saved)")
    fastest = plan.fastest
    if [(stage.first, stage.last, stage.replicas) for stage in fastest] != \
            [(stage.first, stage.last, stage.replicas) for stage in plan.stages]:
        cuts = ", ".join(profile.layers[stage.first].node_id for stage in fastest[1:]) or "none"
        sent = sum(stage.allreduce_bytes + stage.input_bytes for stage in fastest)
        lines.append(f"the fastest found was {configuration_name([stage.replicas for stage in fastest])} (stages "
                     f"starting at {cuts}), {_milliseconds(pipeline_seconds(fastest))} per minibatch, sending "
                     f"{_megabytes(sent)}; within the tolerance ({plan.tolerance:.0%}) the configuration above "
                     f"sends the fewest bytes ({_megabytes(plan.bytes_per_minibatch)})")
    lines.append(f"model: overlap={plan.overlap} (see docs/planner.md), searched in {plan.searched_seconds:.2f} s")
    return "\n".join(lines)

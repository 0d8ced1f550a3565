"""Pipeline schedules as data: per-rank lists of actions, a validator, a simulator and a renderer.

Design reasons:

* A schedule is a plain ``list[list[Action]]`` indexed by pipeline rank. The stage executor is
  one loop over its rank's list, so every schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble,
  PipeDream's asynchronous ones) is a pure function that can be tested, printed and validated
  without MPI.
* An action names a **virtual stage** (a chunk of consecutive layers). With ``v`` virtual stages
  per rank there are ``V = v·P`` chunks and chunk ``c`` lives on rank ``stage_to_rank(c, P) =
  c mod P`` (Megatron's interleaving: rank ``r`` holds chunks ``r, r + P, …``). With ``v = 1``
  chunk and rank are the same number, as before.
* Sends and receives are not actions. They follow from the data flow, so the executor derives
  them: a forward of chunk ``c > 0`` first receives its activation from chunk ``c - 1``; a forward
  of ``c < V - 1`` sends its output to ``c + 1``; a backward (``B``, or its input half ``I``) of
  ``c < V - 1`` first receives the output gradient from ``c + 1``, and one of ``c > 0`` then sends
  the input gradient to ``c - 1``. Keeping them implicit means a schedule cannot pair them wrongly.
* Kinds: ``F`` forward, ``B`` backward, or the backward split in two as in the zero-bubble
  schedules: ``I`` (gradients of the chunk's input: what the previous chunk waits for) then
  ``W`` (gradients of the weights: nobody waits for it, so it fills bubbles). ``U`` applies the
  optimizer to a chunk's parameters (asynchronous schedules update inside the pipeline).
* The validator simulates exactly those semantics (receives block, sends are buffered), so
  "validate passes" means "the executor cannot deadlock on this schedule".
* Asynchronous schedules (``pipedream``, ``2bw``) never flush: each ``train_step`` runs one
  *segment* of an endless per-rank stream (:class:`AsyncStream`), and ``flush()`` runs the drain.
  :func:`async_schedule` concatenates segments into an ordinary schedule for validation,
  simulation and rendering.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridpipe.errors import ScheduleError

__all__ = [
    "ActionKind",
    "Action",
    "Schedule",
    "TimedAction",
    "replica_schedule",
    "replica_streams",
    "Timeline",
    "simulate_shared",
    "SCHEDULE_NAMES",
    "SCHEDULES",
    "REPLICA_SCHEDULES",
    "ScheduleSpec",
    "spec",
    "SYNCHRONOUS",
    "ASYNCHRONOUS",
    "stage_to_rank",
    "gpipe",
    "one_f_one_b",
    "interleaved_one_f_one_b",
    "zero_bubble_h1",
    "forward_only",
    "AsyncStream",
    "async_schedule",
    "canonical_name",
    "get_schedule",
    "validate",
    "simulate",
    "peak_in_flight",
    "render",
]


class ActionKind(enum.Enum):
    """What a stage does with one micro-batch."""

    FORWARD = "F"
    BACKWARD = "B"          # input and weight gradients in one pass
    BACKWARD_INPUT = "I"    # input gradients only (zero-bubble); its W follows later
    BACKWARD_WEIGHT = "W"   # weight gradients of a micro-batch whose I ran
    UPDATE = "U"            # optimizer step of the chunk (asynchronous schedules)


_GRADIENT_KINDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)  # send the input gradient back
_ACTION_PATTERN = re.compile(r"^\s*(\d+)([A-Za-z])(\d+)\s*$")


def stage_to_rank(stage: int, ranks: int) -> int:
    """The pipeline rank that runs (virtual) stage ``stage`` when there are ``ranks`` ranks."""
    return stage % ranks


@dataclass(frozen=True)
class Action:
    """One step of one rank: run ``kind`` on micro-batch ``micro_batch`` of (virtual) stage ``stage``.

    ``stage`` is the chunk of layers (virtual stage) the action runs; rank
    ``stage_to_rank(stage, P)`` runs it. Micro-batches are numbered within a ``train_step`` for
    synchronous schedules, and from 0 since the model was built for asynchronous ones.

    Example:
        >>> Action(2, ActionKind.FORWARD, 5)
        Action('2F5')
        >>> str(Action.parse("1B3"))
        '1B3'
    """

    stage: int
    kind: ActionKind
    micro_batch: int

    @property
    def chunk(self) -> int:
        """The virtual stage (same as ``stage``)."""
        return self.stage

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.micro_batch}"

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the ``str()`` form, e.g. ``"2F5"`` → stage 2, forward, micro-batch 5.

        Raises:
            ScheduleError: ``text`` is not ``<stage><kind letter><micro_batch>``.
        """
        match = _ACTION_PATTERN.match(text)
        valid_letters = ", ".join(kind.value for kind in ActionKind)
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r} (expected <stage><kind><micro_batch> like '2F5', "
                f"kind one of {valid_letters})"
            )
        stage, letter, micro_batch = match.groups()
        try:
            kind = ActionKind(letter.upper())
        except ValueError:
            raise ScheduleError(
                f"unknown action kind {letter!r} in {text!r} (use one of {valid_letters})"
            ) from None
        return cls(int(stage), kind, int(micro_batch))


Schedule = list[list[Action]]
"""Per-rank action lists: ``schedule[r]`` is what pipeline rank ``r`` executes, in order."""


def _check_sizes(stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
    if stages < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ScheduleError(
            f"a schedule needs stages >= 1, micro_batches >= 1 and virtual_stages >= 1 "
            f"(got stages {stages}, micro_batches {micro_batches}, virtual_stages {virtual_stages})"
        )


def _forward(stage: int, micro_batch: int) -> Action:
    return Action(stage, ActionKind.FORWARD, micro_batch)


def _backward(stage: int, micro_batch: int) -> Action:
    return Action(stage, ActionKind.BACKWARD, micro_batch)


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe: every stage runs all forwards 0..M-1, then all backwards M-1..0.

    Backwards run in reverse micro-batch order, as in GPipe: the last micro-batch's
    activations are the freshest (with ``checkpoint="except_last"`` they are still stored), and
    because every stage uses the same order, stage ``s`` only ever waits for the gradient that
    stage ``s + 1`` produces next — the schedule is deadlock-free (``validate`` proves it).
    Each stage holds all ``M`` micro-batches' activations at its peak.

    Args:
        stages: Number of pipeline stages ``P``.
        micro_batches: Number of micro-batches ``M``.

    Returns:
        ``P`` action lists, each ``[sF0, ..., sF(M-1), sB(M-1), ..., sB0]``.
    """
    _check_sizes(stages, micro_batches)
    return [
        [_forward(s, m) for m in range(micro_batches)]
        + [_backward(s, m) for m in reversed(range(micro_batches))]
        for s in range(stages)
    ]


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """PipeDream-Flush (1F1B): warm-up forwards, then alternate one forward / one backward.

    Stage ``s`` runs ``warmup = min(P - s - 1, M)`` forwards, then ``M - warmup`` steady
    pairs "forward m+warmup, backward m", then the ``warmup`` remaining backwards. Backwards
    run in micro-batch order 0..M-1. At most ``warmup + 1 <= P - s`` micro-batches are in
    flight on stage ``s`` (forward done, backward not yet), independent of ``M`` — stage 0
    holds ``P``, the last stage 1. The bubble equals GPipe's; the memory does not grow with M.

    Args:
        stages: Number of pipeline stages ``P``.
        micro_batches: Number of micro-batches ``M``.

    Returns:
        ``P`` action lists; for ``P=4, M=8`` stage 0 is
        ``0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7``.
    """
    _check_sizes(stages, micro_batches)
    schedule: Schedule = []
    for s in range(stages):
        warmup = min(stages - s - 1, micro_batches)
        actions = [_forward(s, m) for m in range(warmup)]
        for m in range(micro_batches - warmup):
            actions.append(_forward(s, m + warmup))
            actions.append(_backward(s, m))
        actions.extend(_backward(s, m) for m in range(micro_batches - warmup, micro_batches))
        schedule.append(actions)
    return schedule


def replica_schedule(name: str, stage_replicas: Sequence[int], micro_batches: int) -> dict[tuple[int, int], list[Action]]:
    """The action lists of a grid whose stages have their own replica counts (``hp.init(stage_replicas=...)``),
    keyed by ``(stage, replica)``: replica ``r`` of stage ``s`` runs micro-batches ``m ≡ r (mod R_s)``.

    ``"gpipe"``: its micro-batches' forwards, then their backwards in reverse (GPipe's lists, each replica's
    share). ``"1f1b"``: 1F1B over its own micro-batches with room for ``ceil((R_s + ... + R_{P-1}) / R_s)`` in
    flight — the micro-batches the stages from ``s`` on work on at once, shared by ``R_s`` replicas (PipeDream's
    NOAM for the input stage); with one replica per stage, exactly :func:`one_f_one_b`. (Taking a uniform 1F1B
    list's share instead would leave a replicated stage one micro-batch in flight per replica: a bubble each.)
    """
    counts = list(stage_replicas)
    if name not in REPLICA_SCHEDULES:
        raise ScheduleError(f"schedule {name!r} does not run on stages with their own replica counts; use "
                            f"{' or '.join(map(repr, REPLICA_SCHEDULES))}")
    _check_sizes(len(counts), micro_batches)
    lists = {}
    for s, count in enumerate(counts):
        room = -(-sum(counts[s:]) // count)
        for r in range(count):
            mine = list(range(r, micro_batches, count))
            if name == "gpipe":
                actions = [_forward(s, m) for m in mine] + [_backward(s, m) for m in reversed(mine)]
            else:
                warmup = min(room - 1, len(mine))
                actions = [_forward(s, m) for m in mine[:warmup]]
                for index, m in enumerate(mine[:len(mine) - warmup]):
                    actions += [_forward(s, mine[index + warmup]), _backward(s, m)]
                actions += [_backward(s, m) for m in mine[len(mine) - warmup:]]
            lists[(s, r)] = actions
    return lists


def interleaved_one_f_one_b(stages: int, micro_batches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): rank ``r`` holds chunks ``r, r + P, …, r + (v-1)·P``.

    Micro-batches go through the chunks in groups of ``P``: a rank forwards micro-batches
    ``0..P-1`` through its first chunk, then the same ones through its second chunk, and so on,
    then the next group; backwards take the groups in the same order with the chunks reversed.
    Rank ``r`` warms up with ``2·(P - r - 1) + (v - 1)·P`` forwards, then alternates one forward
    and one backward, then drains. Each chunk holds ``1/v`` of the rank's layers, so forwards and
    backwards are ``v`` times shorter and the bubble shrinks to ``(P - 1) / (v·M)`` of a step:
    ``1/v`` of 1F1B's, for ``v`` times the point-to-point messages.

    Args:
        stages: Number of pipeline ranks ``P``.
        micro_batches: ``M``, a multiple of ``P`` (Megatron's grouping).
        virtual_stages: ``v`` chunks per rank (``v = 1`` is plain 1F1B).

    Raises:
        ScheduleError: ``M`` is not a multiple of ``P`` (the message names the nearest valid values).
    """
    _check_sizes(stages, micro_batches, virtual_stages)
    if virtual_stages == 1:
        return one_f_one_b(stages, micro_batches)
    if micro_batches % stages:
        lower, upper = (micro_batches // stages) * stages, (micro_batches // stages + 1) * stages
        valid = f"{lower} or {upper}" if lower else f"{upper}"
        raise ScheduleError(
            f"interleaved-1f1b sends micro-batches through the chunks in groups of the {stages} pipeline "
            f"ranks, so micro_batches must be a multiple of {stages} (got {micro_batches}; use {valid})"
        )
    group = stages * virtual_stages
    total = micro_batches * virtual_stages

    def chunk_and_batch(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % group) // stages
        return (chunk if forward else virtual_stages - 1 - chunk), (k // group) * stages + k % stages

    schedule: Schedule = []
    for rank in range(stages):
        def action(k: int, forward: bool) -> Action:
            chunk, m = chunk_and_batch(k, forward)
            kind = ActionKind.FORWARD if forward else ActionKind.BACKWARD
            return Action(chunk * stages + rank, kind, m)

        warmup = total if micro_batches == stages else min(total, 2 * (stages - rank - 1) + (virtual_stages - 1) * stages)
        actions = [action(k, True) for k in range(warmup)]
        for k in range(total - warmup):
            actions.append(action(warmup + k, True))
            actions.append(action(k, False))
        actions.extend(action(k, False) for k in range(total - warmup, total))
        schedule.append(actions)
    return schedule


def zero_bubble_h1(stages: int, micro_batches: int) -> Schedule:
    """ZB-H1 (zero-bubble pipeline parallelism, handcrafted schedule 1).

    Each backward is split into ``I`` (the input gradient, which the previous stage waits for)
    and ``W`` (the weight gradient, which nobody waits for). The order is 1F1B's for ``F`` and
    ``I``; the ``W`` passes are postponed to fill the time a stage would wait: the last stage
    delays its first ``W`` until it has ``P`` micro-batches in flight, so the input gradients
    travel back through the pipeline without waiting for weight gradients, and the drain at the
    end is filled with the postponed ``W`` passes. A micro-batch holds activations from its ``F``
    to its ``W``; no stage holds more than ``P`` at once, 1F1B's peak (its first stage).

    The order is built by list-scheduling with equal ``F``, ``I`` and ``W`` times (each stage
    prefers a forward, then an input gradient, then a weight gradient, within those memory
    limits); its bubble is about a third of 1F1B's when ``M >= 2·P``.
    """
    _check_sizes(stages, micro_batches)
    lists: Schedule = [[] for _ in range(stages)]
    done: dict[tuple[ActionKind, int, int], int] = {}
    forwarded, input_done, weight_done = [0] * stages, [0] * stages, [0] * stages
    time, remaining = 0, 3 * stages * micro_batches
    never = 1 << 60
    while remaining:
        chosen: list[Action | None] = []
        for s in range(stages):
            m_forward, m_input = forwarded[s], input_done[s]
            if (m_forward < micro_batches and m_forward - weight_done[s] < stages
                    and m_forward - m_input < stages - s
                    and (s == 0 or done.get((ActionKind.FORWARD, s - 1, m_forward), never) <= time)):
                chosen.append(_forward(s, m_forward))
            elif (m_input < m_forward and done.get((ActionKind.FORWARD, s, m_input), never) <= time
                  and (s == stages - 1
                       or done.get((ActionKind.BACKWARD_INPUT, s + 1, m_input), never) <= time)):
                chosen.append(Action(s, ActionKind.BACKWARD_INPUT, m_input))
            elif weight_done[s] < m_input:
                chosen.append(Action(s, ActionKind.BACKWARD_WEIGHT, weight_done[s]))
            else:
                chosen.append(None)
        for s, action in enumerate(chosen):
            if action is None:
                continue
            lists[s].append(action)
            done[(action.kind, s, action.micro_batch)] = time + 1
            remaining -= 1
            if action.kind is ActionKind.FORWARD:
                forwarded[s] += 1
            elif action.kind is ActionKind.BACKWARD_INPUT:
                input_done[s] += 1
            else:
                weight_done[s] += 1
        time += 1
    return lists


def forward_only(stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Forwards of every micro-batch through every chunk and no backward (inference, ``predict``).

    Rank ``r`` runs its chunks in order, each over all micro-batches. Validate it with
    ``validate(..., require_backward=False)``.
    """
    _check_sizes(stages, micro_batches, virtual_stages)
    return [[_forward(chunk * stages + s, m) for chunk in range(virtual_stages) for m in range(micro_batches)]
            for s in range(stages)]


class AsyncStream:
    """One rank's endless action stream for an asynchronous schedule (``"pipedream"``, ``"2bw"``).

    The stream is 1F1B that never flushes: rank ``s`` keeps up to ``P - s`` micro-batches in
    flight (forward done, backward not), forwarding the next one whenever it has room and
    running the oldest backward otherwise. Micro-batches are numbered from 0 since the stream
    began. ``"pipedream"`` follows every backward with an update (``U``) of the stage;
    ``"2bw"`` updates once per mini-batch, after the backward of its last micro-batch.

    With ``replicas`` (stages with their own replica counts, ``"pipedream"`` only): the stream of replica
    ``replica`` of a stage with ``replicas`` replicas, which runs micro-batches ``replica, replica +
    replicas, ...`` with room for ``room`` of them in flight; each ``U`` is one round of the stage (its
    replicas' updates meet in one allreduce: the round's ``replicas`` micro-batches averaged).

    :meth:`segment` is one ``train_step``: it runs until the next forward would need a
    micro-batch that has not been given yet. :meth:`drain` is ``flush()``: the backwards (and
    updates) of everything in flight.
    """

    def __init__(self, name: str, stages: int, stage: int, micro_batches: int, replicas: int = 1, replica: int = 0,
                 room: int | None = None) -> None:
        if name not in ASYNCHRONOUS:
            raise ScheduleError(f"{name!r} is not an asynchronous schedule (use one of {', '.join(ASYNCHRONOUS)})")
        _check_sizes(stages, micro_batches)
        self.name, self.stages, self.stage, self.micro_batches = name, stages, stage, micro_batches
        self.replicas, self.replica = replicas, replica
        self.in_flight_limit = stages - stage if room is None else room
        self.next_forward = 0   # of this replica's micro-batches: the next one's position (micro_batch() is its id)
        self.next_backward = 0

    def micro_batch(self, position: int) -> int:
        """The id of this replica's ``position``-th micro-batch."""
        return position * self.replicas + self.replica

    def _backward(self) -> list[Action]:
        m = self.micro_batch(self.next_backward)
        self.next_backward += 1
        actions = [_backward(self.stage, m)]
        if SCHEDULES[self.name].update_every_micro_batch or (m + 1) % self.micro_batches == 0:
            actions.append(Action(self.stage, ActionKind.UPDATE, m))
        return actions

    def segment(self, available: int) -> list[Action]:
        """The actions of one ``train_step`` after which micro-batches ``< available`` exist."""
        actions: list[Action] = []
        while True:
            if self.next_forward - self.next_backward < self.in_flight_limit:
                if self.micro_batch(self.next_forward) >= available:
                    return actions
                actions.append(_forward(self.stage, self.micro_batch(self.next_forward)))
                self.next_forward += 1
            else:
                actions.extend(self._backward())

    def drain(self) -> list[Action]:
        """The backwards (and updates) of every micro-batch in flight."""
        actions: list[Action] = []
        while self.next_backward < self.next_forward:
            actions.extend(self._backward())
        return actions

    @property
    def next_forward_id(self) -> int:
        """The id of the next micro-batch this replica will forward (2BW's version rule)."""
        return self.micro_batch(self.next_forward)


def replica_streams(name: str, stage_replicas: Sequence[int], micro_batches: int) -> dict[tuple[int, int], AsyncStream]:
    """The asynchronous streams of a grid whose stages have their own replica counts, keyed by ``(stage, replica)``:
    each replica with room for ``ceil((R_s + ... + R_{P-1}) / R_s)`` micro-batches in flight (as
    :func:`replica_schedule`'s 1F1B). ``"pipedream"`` only, and ``micro_batches`` a multiple of every count (each
    ``train_step`` then brings whole rounds)."""
    counts = list(stage_replicas)
    if name not in ASYNCHRONOUS or not SCHEDULES[name].stage_replicas:
        raise ScheduleError(f"schedule {name!r} does not run on stages with their own replica counts; the asynchronous "
                            "one that does is 'pipedream'")
    uneven = [c for c in counts if micro_batches % c]
    if uneven:
        raise ScheduleError(f"'pipedream' on stages with replica counts {counts} needs micro_batches a multiple of "
                            f"every count (each update averages one micro-batch from each replica of the stage); "
                            f"{micro_batches} is not a multiple of {uneven[0]}: use e.g. "
                            f"{math.lcm(*counts) * max(1, micro_batches // math.lcm(*counts))}")
    return {(s, r): AsyncStream(name, len(counts), s, micro_batches, replicas=count, replica=r,
                                room=-(-sum(counts[s:]) // count))
            for s, count in enumerate(counts) for r in range(count)}


def async_schedule(name: str, stages: int, micro_batches: int, steps: int = 2, flush: bool = True) -> Schedule:
    """``steps`` train_steps (``M`` new micro-batches each) of an asynchronous schedule, then the
    drain of ``flush()`` if ``flush``, as one ordinary schedule (to validate, simulate, render)."""
    streams = [AsyncStream(name, stages, s, micro_batches) for s in range(stages)]
    schedule: Schedule = [[] for _ in range(stages)]
    for step in range(steps):
        for s, stream in enumerate(streams):
            schedule[s] += stream.segment((step + 1) * micro_batches)
    if flush:
        for s, stream in enumerate(streams):
            schedule[s] += stream.drain()
    return schedule


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule is, declared once: the model checks its options against it, the planner searches and
    costs by it, the docs and the compatibility table list it.

    Attributes:
        name: Its name (``schedule=``).
        build: ``build(stages, micro_batches)`` → the action lists (asynchronous ones: two steps and a flush).
        asynchronous: Never flushes; updates inside the pipeline (``optimizer=``), trains differently from one
            process (tested against a replay).
        chunks_per_rank: Takes ``virtual_stages >= 2`` chunks of layers per rank (interleaved).
        split_backward: Splits each backward into ``I`` (input gradients) and a later ``W`` (weight gradients).
        stage_replicas: Runs on stages with their own replica counts (``hp.init(stage_replicas=...)``).
        vertical_sync: Takes PipeDream's ``vertical_sync=True``.
        update_every_micro_batch: (asynchronous) an update after each micro-batch's backward; otherwise one per
            mini-batch of ``M`` micro-batches.
        weight_versions: (asynchronous) the weight versions pipeline rank ``r`` of ``P`` keeps at most, as
            ``weight_versions(P, r)``.
        min_micro_batches: The fewest micro-batches it takes on ``P`` stages, as ``min_micro_batches(P)``.
        summary: One line for tables.
    """

    name: str
    build: Callable[..., Schedule]
    asynchronous: bool = False
    chunks_per_rank: bool = False
    split_backward: bool = False
    stage_replicas: bool = False
    vertical_sync: bool = False
    update_every_micro_batch: bool = False
    weight_versions: Callable[[int, int], int] = lambda stages, rank: 1
    min_micro_batches: Callable[[int], int] = lambda stages: 1
    summary: str = ""


SCHEDULES: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec("gpipe", gpipe, stage_replicas=True,
                 summary="all forwards, then all backwards: holds every micro-batch's activations"),
    ScheduleSpec("1f1b", one_f_one_b, stage_replicas=True,
                 summary="PipeDream-Flush: one forward, one backward; holds at most P micro-batches"),
    ScheduleSpec("interleaved-1f1b", interleaved_one_f_one_b, chunks_per_rank=True,
                 summary="1F1B over v chunks per rank: a bubble v times smaller, v times the hops"),
    ScheduleSpec("zb-h1", zero_bubble_h1, split_backward=True,
                 summary="zero bubble: weight gradients (W) deferred into the bubble"),
    ScheduleSpec("pipedream", lambda stages, micro_batches: async_schedule("pipedream", stages, micro_batches),
                 asynchronous=True, stage_replicas=True, vertical_sync=True, update_every_micro_batch=True,
                 weight_versions=lambda stages, rank: stages - rank,
                 summary="asynchronous, weight stashing: an update after every micro-batch"),
    ScheduleSpec("2bw", lambda stages, micro_batches: async_schedule("2bw", stages, micro_batches),
                 asynchronous=True, weight_versions=lambda stages, rank: 2,
                 min_micro_batches=lambda stages: max(1, stages - 1),
                 summary="asynchronous, double-buffered weights: an update per mini-batch"),
)}
"""The schedules a ``PipelineModel`` runs, by name (``"forward"``, predict's own, is not one of them)."""

SYNCHRONOUS = tuple(name for name, spec in SCHEDULES.items() if not spec.asynchronous)
"""Schedules that flush every step: the parameters after a step equal one process's."""
ASYNCHRONOUS = tuple(name for name, spec in SCHEDULES.items() if spec.asynchronous)
"""Schedules that never flush and update inside the pipeline (PipeDream's weight stashing, 2BW)."""
REPLICA_SCHEDULES = tuple(name for name, spec in SCHEDULES.items() if spec.stage_replicas and not spec.asynchronous)
"""The synchronous schedules of stages with their own replica counts (:func:`replica_schedule`)."""

SCHEDULE_NAMES: dict[str, Callable[..., Schedule]] = {
    **{name: spec.build for name, spec in SCHEDULES.items()},
    "one_f_one_b": one_f_one_b,
    "forward": forward_only,
}
"""Names accepted by :func:`get_schedule`, mapped to their schedule functions."""


def spec(name: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of schedule ``name`` (aliases accepted; an unknown name raises ScheduleError)."""
    key = canonical_name(name)
    if key not in SCHEDULES:
        raise ScheduleError(f"{key!r} is not a training schedule (use one of {', '.join(map(repr, SCHEDULES))})")
    return SCHEDULES[key]


def canonical_name(name: str) -> str:
    """``name`` lower-cased, with the aliases ``one_f_one_b`` → ``1f1b`` and ``_`` → ``-`` mapped.

    Raises:
        ScheduleError: an unknown name (the message lists the valid ones).
    """
    key = name.strip().lower() if isinstance(name, str) else None
    if key is not None and key not in SCHEDULE_NAMES:
        key = key.replace("_", "-")
    if key == "one-f-one-b":
        key = "1f1b"
    if key not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown schedule {name!r} (use one of {', '.join(map(repr, SCHEDULES))})")
    return key


def get_schedule(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Build a schedule by name: ``"gpipe"``, ``"1f1b"`` (or ``"one_f_one_b"``),
    ``"interleaved-1f1b"``, ``"zb-h1"``, ``"forward"``, or (two steps and a flush of)
    ``"pipedream"`` / ``"2bw"``.

    The result is not validated here; the executor calls :func:`validate` before running it.

    Raises:
        ScheduleError: ``name`` is unknown (the message lists the valid names), the sizes are not
            positive, ``virtual_stages > 1`` for a schedule without chunks, or the schedule's own
            condition on the sizes fails.
    """
    key = canonical_name(name)
    _check_sizes(stages, micro_batches, virtual_stages)
    if key in SCHEDULES and SCHEDULES[key].chunks_per_rank:
        if virtual_stages < 2:
            raise ScheduleError(f"{key} needs virtual_stages >= 2 (chunks per rank); with 1 it is schedule='1f1b'")
        return SCHEDULES[key].build(stages, micro_batches, virtual_stages)
    if key == "forward":
        return forward_only(stages, micro_batches, virtual_stages)
    if virtual_stages != 1:
        raise ScheduleError(f"schedule {key!r} runs one chunk per rank (got virtual_stages={virtual_stages}); "
                            "use schedule='interleaved-1f1b' for several")
    return SCHEDULE_NAMES[key](stages, micro_batches)



@dataclass(frozen=True)
class TimedAction:
    """An action placed in time by :func:`simulate`."""

    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """The result of :func:`simulate`: when each rank ran each action.

    Attributes:
        stages: Per-rank executed actions with start/end times, in execution order.
        makespan: Time at which the last action ends.
        blocked: Per rank, the action it is stuck on when the schedule deadlocks (``None``
            for ranks that finished); all ``None`` for a runnable schedule.
        tail_ends: :func:`simulate_shared` with ``tails``: when each rank's work after its last action ended
            (empty otherwise).
    """

    stages: list[list[TimedAction]]
    makespan: float
    blocked: list[Action | None]
    tail_ends: list[float] = field(default_factory=list)

    @property
    def deadlocked(self) -> bool:
        """Whether some rank could not finish its list."""
        return any(action is not None for action in self.blocked)

    @property
    def busy_time(self) -> list[float]:
        """Per-rank total compute time."""
        return [sum(item.end - item.start for item in items) for items in self.stages]

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction of the ``ranks × makespan`` area: GPipe has ``(P-1)/(M+P-1)``."""
        area = len(self.stages) * self.makespan
        return 0.0 if area == 0 else 1.0 - sum(self.busy_time) / area


_GRADIENT = "gradient"  # key kind: the input gradient of (stage, micro-batch) exists (after B or I)


def _virtual_stages(schedule: Schedule) -> int:
    return max([a.stage + 1 for actions in schedule for a in actions] + [len(schedule)])


def _dependency(action: Action, last_stage: int) -> list[tuple[int, ActionKind | str, int]]:
    """What ``action`` waits for, as (stage, kind, micro_batch) keys."""
    stage, m = action.stage, action.micro_batch
    if action.kind is ActionKind.FORWARD:
        return [(stage - 1, ActionKind.FORWARD, m)] if stage > 0 else []
    if action.kind in _GRADIENT_KINDS:
        needs: list[tuple[int, ActionKind | str, int]] = [(stage, ActionKind.FORWARD, m)]
        if stage < last_stage:
            needs.append((stage + 1, _GRADIENT, m))
        return needs
    if action.kind is ActionKind.BACKWARD_WEIGHT:
        return [(stage, ActionKind.BACKWARD_INPUT, m)]
    return []  # UPDATE: runs in list order


Duration = float | Callable[[Action], float]
"""A time for every action of a kind, or a function of the action (e.g. per-stage times)."""


def _timed(value: Duration) -> Callable[[Action], float]:
    """A duration as a function of the action."""
    return value if callable(value) else (lambda action, value=float(value): value)


def _durations_by_kind(forward_time: Duration, backward_time: Duration, weight_time: Duration | None,
                       update_time: Duration) -> dict[ActionKind, Callable[[Action], float]]:
    """:func:`simulate`'s duration of each kind of action (an ``I`` is the backward less its ``W``)."""
    forward, backward = _timed(forward_time), _timed(backward_time)
    weight = (lambda action: backward(action) / 2) if weight_time is None else _timed(weight_time)
    return {ActionKind.FORWARD: forward, ActionKind.BACKWARD: backward,
            ActionKind.BACKWARD_INPUT: lambda action: backward(action) - weight(action),
            ActionKind.BACKWARD_WEIGHT: weight, ActionKind.UPDATE: _timed(update_time)}


def simulate(schedule: Schedule, forward_time: Duration = 1.0, backward_time: Duration = 2.0,
             weight_time: Duration | None = None, update_time: Duration = 0.0,
             transfer_time: Duration = 0.0, placement: Callable[[int, int], int] | None = None,
             together: Callable[[int, Action], tuple[Any, int] | None] | None = None,
             resume: float = 0.0) -> Timeline:
    """Run ``schedule`` on an idealised machine: fixed compute times, free communication.

    A rank runs its actions in order; each starts when the rank is free and its inputs exist
    (the previous chunk's forward of that micro-batch; for a backward, this chunk's forward and
    the next chunk's input gradient; for a ``W``, this chunk's ``I``). A deadlocked schedule is
    not an error here: the timeline stops and ``blocked`` names where each rank is stuck.

    Args:
        schedule: Per-rank action lists.
        forward_time: Duration of one forward of one chunk.
        backward_time: Duration of one full backward (``B``) of one chunk.
        weight_time: Duration of a ``W``; an ``I`` takes ``backward_time - weight_time``
            (default: half of ``backward_time`` each).
        update_time: Duration of a ``U``.
        transfer_time: Time for the value an action needs to arrive from another rank (an
            activation for a forward, a gradient for a backward), given the receiving action;
            nothing for values from the same rank.

        placement: Which list runs (stage, micro-batch), for a schedule whose lists are not one per
            pipeline rank: the replicas of stages with their own replica counts, each list holding its
            micro-batches (default: the pipeline rank of the stage, :func:`stage_to_rank`).
        together: For an action that several lists run as one collective (the ``U`` of a replicated stage's
            replicas: one allreduce), ``(key, count)``: it starts on all ``count`` lists when the last of
            them is ready for it; None for the others.
        resume: Time added to an action whose rank was idle before it, waiting for an input (a rank resuming
            after a wait: its caches cold); not to the rank's first action.

    Each time may also be a function of the action (the planner gives every stage its own).

    Returns:
        The :class:`Timeline`.
    """
    durations = _durations_by_kind(forward_time, backward_time, weight_time, update_time)
    transfer = _timed(transfer_time)
    placement, last_stage = _placement(schedule, placement)
    finished: dict[tuple[int, ActionKind | str, int], float] = {}
    gathered: dict[Any, dict[int, float]] = {}  # together's key -> the lists ready for it, and when
    placed: list[list[TimedAction]] = [[] for _ in schedule]
    free_at = [0.0] * len(schedule)
    position = [0] * len(schedule)
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                needs = _dependency(action, last_stage)
                if any(key not in finished for key in needs):
                    break
                start = _all_ready(together, gathered, rank, action, max(
                    [free_at[rank]] + _arrivals(needs, finished, action, rank, placement, transfer)))
                if start is None:
                    break
                end = start + durations[action.kind](action) + _resumed(resume, position[rank], start, free_at[rank])
                _record(finished, action, end)
                placed[rank].append(TimedAction(action, start, end))
                free_at[rank] = end
                position[rank] += 1
                progress = True
    blocked = [
        actions[position[rank]] if position[rank] < len(actions) else None
        for rank, actions in enumerate(schedule)
    ]
    return Timeline(placed, max(free_at, default=0.0), blocked)


def _placement(schedule: Schedule, placement: Callable[[int, int], int] | None
               ) -> tuple[Callable[[int, int], int], int]:
    """:func:`simulate`'s ``placement`` (the default: the pipeline rank of the stage) and the last stage."""
    if placement is not None:
        return placement, max((a.stage for actions in schedule for a in actions), default=0)
    ranks = len(schedule)
    return (lambda stage, micro_batch: stage_to_rank(stage, ranks)), _virtual_stages(schedule) - 1


def simulate_shared(schedule: Schedule, speed: Callable[[Sequence[int]], Sequence[float]],
                    forward_time: Duration = 1.0, backward_time: Duration = 2.0, weight_time: Duration | None = None,
                    update_time: Duration = 0.0, transfer_time: Duration = 0.0,
                    placement: Callable[[int, int], int] | None = None,
                    together: Callable[[int, Action], tuple[Any, int] | None] | None = None,
                    tails: Sequence[float] = (), resume: float = 0.0) -> Timeline:
    """:func:`simulate` where lists share processors: an action's time is the work it does at speed 1, and a list
    runs at ``speed(running)[k]`` while the lists ``running`` (ascending) compute, ``k`` its place among them
    (ranks sharing a host's cores: two ranks computing on one core each go at half speed, one computing alone
    while its neighbour waits goes at full speed). Transfers take their time whatever computes. Time-ordered:
    at each moment every list that can start does, then the clock moves to the next end of an action or
    arrival of a value. ``tails``: work each list does after its last action (e.g. a rank's gradient reductions and
    optimizer step), sharing the processors as its actions do; ``tail_ends`` says when each ended. ``resume``: an
    action started after its list idled does that much more work (seconds at speed 1). Other arguments and the result as
    :func:`simulate`'s (``makespan``: the last action's end, tails not counted)."""
    durations = _durations_by_kind(forward_time, backward_time, weight_time, update_time)
    transfer = _timed(transfer_time)
    placement, last_stage = _placement(schedule, placement)
    finished: dict[tuple[int, ActionKind | str, int], float] = {}
    gathered: dict[Any, dict[int, float]] = {}
    placed: list[list[TimedAction]] = [[] for _ in schedule]
    position = [0] * len(schedule)
    running: dict[int, list] = {}  # list -> [action (None: its tail), start, work left]
    tail_ends = [0.0] * len(schedule) if tails else []
    idle_since = [0.0] * len(schedule)  # when each list's last action ended
    now = 0.0
    while True:
        arrival = _start_ready(schedule, position, running, finished, gathered, now, last_stage, placement,
                               transfer, durations, together, idle_since, resume)
        if not running and arrival == math.inf:
            break
        lists = sorted(running)
        rates = dict(zip(lists, speed(lists)))
        then = min([arrival] + [now + running[i][2] / rates[i] for i in lists])
        step, now = then - now, then
        for i in lists:
            item = running[i]
            item[2] -= rates[i] * step
            if item[2] <= 1e-12 * max(1.0, now):
                action = item[0]
                del running[i]
                if action is None:
                    tail_ends[i] = now
                    continue
                _record(finished, action, now)
                placed[i].append(TimedAction(action, item[1], now))
                position[i] += 1
                idle_since[i] = now
                if tails and position[i] == len(schedule[i]):
                    running[i] = [None, now, tails[i]]
    blocked = [actions[position[i]] if position[i] < len(actions) else None for i, actions in enumerate(schedule)]
    return Timeline(placed, max((items[-1].end for items in placed if items), default=0.0), blocked, tail_ends)


def _start_ready(schedule: Schedule, position: list[int], running: dict[int, list],
                 finished: dict[tuple[int, ActionKind | str, int], float], gathered: dict[Any, dict[int, float]],
                 now: float, last_stage: int, placement: Callable[[int, int], int], transfer: Callable[[Action], float],
                 durations: dict[ActionKind, Callable[[Action], float]],
                 together: Callable[[int, Action], tuple[Any, int] | None] | None,
                 idle_since: list[float], resume: float) -> float:
    """:func:`simulate_shared`'s starts at ``now``: every idle list whose next action's inputs are there (and, for
    a collective, whose partners are all ready) starts it (``resume`` more work after the list idled since
    ``idle_since``). Returns when the next awaited value arrives."""
    arrival = math.inf
    started = True
    while started:
        started = False
        for rank, actions in enumerate(schedule):
            if rank in running or position[rank] >= len(actions):
                continue
            action = actions[position[rank]]
            needs = _dependency(action, last_stage)
            if any(key not in finished for key in needs):
                continue
            ready = max(_arrivals(needs, finished, action, rank, placement, transfer), default=now)
            if ready > now:
                arrival = min(arrival, ready)
                continue
            if _all_ready(together, gathered, rank, action, now) is None:
                continue
            running[rank] = [action, now,
                             durations[action.kind](action) + _resumed(resume, position[rank], now, idle_since[rank])]
            started = True
    return arrival


def _resumed(resume: float, position: int, start: float, idle_since: float) -> float:
    """The simulators' ``resume`` for an action starting at ``start`` on a list free since ``idle_since``: all of it
    where the list idled in between (not before its first action), else nothing."""
    return resume if resume > 0 and position > 0 and start > idle_since * (1 + 1e-12) + 1e-15 else 0.0


def _record(finished: dict[tuple[int, ActionKind | str, int], float], action: Action, end: float) -> None:
    """The simulators' note that ``action`` ended at ``end`` (and, for a B or an I, that its input gradient exists)."""
    finished.setdefault((action.stage, action.kind, action.micro_batch), end)
    if action.kind in _GRADIENT_KINDS:
        finished.setdefault((action.stage, _GRADIENT, action.micro_batch), end)


def _arrivals(needs: list[tuple[int, ActionKind | str, int]], finished: dict[tuple[int, ActionKind | str, int], float],
              action: Action, rank: int, placement: Callable[[int, int], int],
              transfer: Callable[[Action], float]) -> list[float]:
    """When each value ``action`` needs is on list ``rank``: made there, or made elsewhere and sent."""
    return [finished[key] + (transfer(action) if placement(key[0], key[2]) != rank else 0.0) for key in needs]


def _all_ready(together: Callable[[int, Action], tuple[Any, int] | None] | None, gathered: dict[Any, dict[int, float]],
               rank: int, action: Action, ready_at: float) -> float | None:
    """When ``action`` may start on list ``rank``, ready at ``ready_at``: for an action several lists run as one
    collective (``together``), None until the last of them is ready, then when that was; else ``ready_at``."""
    group = together(rank, action) if together is not None else None
    if group is None:
        return ready_at
    waiting = gathered.setdefault(group[0], {})
    waiting.setdefault(rank, ready_at)
    return max(waiting.values()) if len(waiting) >= group[1] else None


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches (per chunk) holding activations at once on one rank's list: from the
    forward to the backward (``B``), or to the weight gradient (``W``) when it is split."""
    in_flight: set[tuple[int, int]] = set()
    peak = 0
    for action in actions:
        key = (action.stage, action.micro_batch)
        if action.kind is ActionKind.FORWARD:
            in_flight.add(key)
            peak = max(peak, len(in_flight))
        elif action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            in_flight.discard(key)
    return peak


def render(schedule: Schedule, forward_time: int = 1, backward_time: int = 2) -> str:
    """A time × rank table of :func:`simulate`'s timeline; idle slots show ``.``.

    Each column is one time unit, so with the defaults a backward fills two cells (an ``I`` or a
    ``W`` one each). With several chunks per rank a cell also names the chunk (``F3.1``: forward
    of micro-batch 3 through the rank's second chunk). An update (``U``, no time) marks the end of
    the action before it with ``*``. Ranks that deadlock end with a "blocked at" note.

    Example (``render(gpipe(2, 2))``)::

        time     0  1  2  3  4  5  6  7  8
        stage 0 F0 F1  .  .  . B1 B1 B0 B0
        stage 1  . F0 F1 B1 B1 B0 B0  .  .
    """
    timeline = simulate(schedule, float(forward_time), float(backward_time))
    ranks = len(schedule)
    chunks = _virtual_stages(schedule) > ranks
    slots = int(round(timeline.makespan))
    cells = [["."] * slots for _ in schedule]
    for rank, items in enumerate(timeline.stages):
        last_cell = None
        for item in items:
            if item.action.kind is ActionKind.UPDATE:  # zero time: a mark on the action before it
                if last_cell is not None and not cells[rank][last_cell].endswith("*"):
                    cells[rank][last_cell] += "*"
                continue
            label = f"{item.action.kind.value}{item.action.micro_batch}"
            if chunks:
                label += f".{item.action.stage // ranks}"
            for t in range(int(round(item.start)), int(round(item.end))):
                cells[rank][t] = label
                last_cell = t
    width = max([2, len(str(max(slots - 1, 0)))] + [len(c) for row in cells for c in row])
    name_width = len(f"stage {ranks - 1}")
    lines = ["time".ljust(name_width) + "".join(f" {t:>{width}}" for t in range(slots))]
    for rank, row in enumerate(cells):
        line = f"stage {rank}".ljust(name_width) + "".join(f" {cell:>{width}}" for cell in row)
        if timeline.blocked[rank] is not None:
            line += f"  <- blocked at {timeline.blocked[rank]}"
        lines.append(line)
    return "\n".join(lines)


def _fail(problem: str, schedule: Schedule) -> ScheduleError:
    return ScheduleError(f"{problem}\n{render(schedule)}")


def validate(
    schedule: Schedule, stages: int, micro_batches: int, *, virtual_stages: int = 1,
    require_backward: bool = True
) -> None:
    """Check a schedule before it runs; raise with the rendered table if it is wrong.

    Checks: one list per rank; each action sits on the list of the rank that holds its chunk
    (``stage_to_rank``), with a micro-batch in ``0..M-1``; every (chunk, micro-batch) has exactly
    one forward and, if ``require_backward``, one backward — a ``B``, or an ``I`` and a later
    ``W`` — (otherwise at most one), forward first; and a simulation under blocking receives /
    buffered sends finishes every list (no deadlock).

    Args:
        schedule: Per-rank action lists.
        stages: Expected number of pipeline ranks ``P``.
        micro_batches: Expected number of micro-batches ``M``.
        virtual_stages: Chunks per rank ``v`` (``v·P`` chunks in all).
        require_backward: Whether every micro-batch must also have a backward on every chunk.

    Raises:
        ScheduleError: naming the first problem found, followed by ``render(schedule)``.
    """
    _check_sizes(stages, micro_batches, virtual_stages)
    if len(schedule) != stages:
        raise ScheduleError(
            f"schedule has {len(schedule)} stage lists but the pipeline has {stages} stages "
            f"(build it with stages={stages})"
        )
    chunks = stages * virtual_stages
    kinds_of: dict[tuple[int, int], set] = {(a.stage, a.micro_batch): set() for actions in schedule for a in actions}
    for rank, actions in enumerate(schedule):
        seen: dict[tuple[int, ActionKind, int], int] = {}
        for index, action in enumerate(actions):
            _check_action(schedule, rank, index, action, stages, virtual_stages, micro_batches, seen, kinds_of)
        _check_complete(schedule, rank, stages, chunks, micro_batches, kinds_of, require_backward)
    _check_no_deadlock(schedule, chunks, kinds_of)


def _check_action(schedule: Schedule, rank: int, index: int, action: Action, stages: int, virtual_stages: int,
                  micro_batches: int, seen: dict[tuple[int, ActionKind, int], int],
                  kinds_of: dict[tuple[int, int], set]) -> None:
    """:func:`validate`'s checks of one action at ``index`` of ``rank``'s list, in order; records its kind."""
    chunks = stages * virtual_stages
    if not 0 <= action.stage < chunks:
        raise _fail(f"action {action} names stage {action.stage} outside 0..{chunks - 1} "
                    f"({stages} ranks × {virtual_stages} virtual stages)", schedule)
    if stage_to_rank(action.stage, stages) != rank:
        raise _fail(f"action {action} is on stage {rank}'s list (position {index}); "
                    f"move it to stage {stage_to_rank(action.stage, stages)}'s list", schedule)
    if not 0 <= action.micro_batch < micro_batches:
        raise _fail(f"action {action} names micro-batch {action.micro_batch} outside "
                    f"0..{micro_batches - 1} (micro_batches {micro_batches})", schedule)
    key = (action.stage, action.kind, action.micro_batch)
    if key in seen:
        raise _fail(f"action {action} appears twice on stage {rank} (positions {seen[key]} and {index})", schedule)
    seen[key] = index
    kinds = kinds_of[(action.stage, action.micro_batch)]
    m = action.micro_batch
    if action.kind in _GRADIENT_KINDS and ActionKind.FORWARD not in kinds:
        raise _fail(f"backward {action} comes before forward {_forward(action.stage, m)} "
                    f"on stage {rank} (position {index})", schedule)
    if action.kind is ActionKind.BACKWARD_WEIGHT and ActionKind.BACKWARD_INPUT not in kinds:
        raise _fail(f"weight gradient {action} comes before its input gradient "
                    f"{Action(action.stage, ActionKind.BACKWARD_INPUT, m)} (position {index})", schedule)
    if {action.kind} | kinds >= {ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT}:
        raise _fail(f"micro-batch {m} of stage {action.stage} has both a full backward B and an "
                    f"input gradient I (position {index}); use one or the other", schedule)
    kinds.add(action.kind)


def _check_complete(schedule: Schedule, rank: int, stages: int, chunks: int, micro_batches: int,
                    kinds_of: dict[tuple[int, int], set], require_backward: bool) -> None:
    """Every micro-batch of each of ``rank``'s chunks has its forward, and its backward (``I`` then ``W``)."""
    for stage in range(rank, chunks, stages):
        for m in range(micro_batches):
            kinds = kinds_of.get((stage, m), set())
            if ActionKind.FORWARD not in kinds:
                raise _fail(f"stage {rank} has no forward {_forward(stage, m)}", schedule)
            if ActionKind.BACKWARD_INPUT in kinds and ActionKind.BACKWARD_WEIGHT not in kinds:
                raise _fail(f"stage {rank} has no weight gradient "
                            f"{Action(stage, ActionKind.BACKWARD_WEIGHT, m)} after its "
                            f"{Action(stage, ActionKind.BACKWARD_INPUT, m)}", schedule)
            if require_backward and not kinds & set(_GRADIENT_KINDS):
                raise _fail(f"stage {rank} has no backward {_backward(stage, m)}", schedule)


def _check_no_deadlock(schedule: Schedule, chunks: int, kinds_of: dict[tuple[int, int], set]) -> None:
    """A simulation under blocking receives / buffered sends finishes every list; else names who waits for what."""
    timeline = simulate(schedule)
    if not timeline.deadlocked:
        return
    done = {(item.action.stage, item.action.kind, item.action.micro_batch)
            for items in timeline.stages for item in items}

    def name(key: tuple[int, ActionKind | str, int]) -> str:
        stage, kind, m = key
        if kind == _GRADIENT:  # the kind the schedule uses for that backward
            used = kinds_of.get((stage, m), set()) & set(_GRADIENT_KINDS)
            kind = next(iter(used), ActionKind.BACKWARD)
        return str(Action(stage, kind, m))

    stuck = ", ".join(
        f"stage {rank} waits at {action} for "
        + " and ".join(name(key) for key in _dependency(action, chunks - 1)
                       if key not in done and not (key[1] == _GRADIENT and any(
                           (key[0], k, key[2]) in done for k in _GRADIENT_KINDS)))
        for rank, action in enumerate(timeline.blocked)
        if action is not None
    )
    raise _fail(f"schedule deadlocks under blocking receives ({stuck})", schedule)

"""Pipeline schedules as data: per-stage lists of forward/backward actions, a validator and a renderer.

Design reasons:

* A schedule is a plain ``list[list[Action]]`` indexed by stage. The stage executor is one loop
  over its list, so every schedule (GPipe, 1F1B, later interleaved or recompute variants) is a
  pure function that can be tested, printed and validated without MPI.
* Sends and receives are not actions. They follow from the data flow, so the executor derives
  them: a forward on stage ``s > 0`` first receives its activation from ``s - 1``; a forward on
  ``s < P - 1`` then sends its output to ``s + 1``; a backward on ``s < P - 1`` first receives
  the gradient from ``s + 1``; a backward on ``s > 0`` then sends the input gradient to ``s - 1``.
  Keeping them implicit means a schedule cannot pair them wrongly.
* The validator simulates exactly those semantics (receives block, sends are buffered), so
  "validate passes" means "the executor cannot deadlock on this schedule".
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass

from hybridpipe.errors import ScheduleError

__all__ = [
    "ActionKind",
    "Action",
    "Schedule",
    "TimedAction",
    "Timeline",
    "SCHEDULE_NAMES",
    "gpipe",
    "one_f_one_b",
    "forward_only",
    "get_schedule",
    "validate",
    "simulate",
    "peak_in_flight",
    "render",
]


class ActionKind(enum.Enum):
    """What a stage does with one micro-batch. New kinds (e.g. recompute) get a new letter."""

    FORWARD = "F"
    BACKWARD = "B"


_ACTION_PATTERN = re.compile(r"^\s*(\d+)([A-Za-z])(\d+)\s*$")


@dataclass(frozen=True)
class Action:
    """One step of one stage: run ``kind`` on micro-batch ``micro_batch`` on stage ``stage``.

    Example:
        >>> Action(2, ActionKind.FORWARD, 5)
        Action('2F5')
        >>> str(Action.parse("1B3"))
        '1B3'
    """

    stage: int
    kind: ActionKind
    micro_batch: int

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
"""Per-stage action lists: ``schedule[s]`` is what stage ``s`` executes, in order."""


def _check_sizes(stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(
            f"a schedule needs stages >= 1 and micro_batches >= 1 "
            f"(got stages {stages}, micro_batches {micro_batches})"
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


def forward_only(stages: int, micro_batches: int) -> Schedule:
    """Forwards 0..M-1 on every stage and no backward (inference, ``predict``).

    Validate it with ``validate(..., require_backward=False)``.
    """
    _check_sizes(stages, micro_batches)
    return [[_forward(s, m) for m in range(micro_batches)] for s in range(stages)]


SCHEDULE_NAMES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "one_f_one_b": one_f_one_b,
    "forward": forward_only,
}
"""Names accepted by :func:`get_schedule`, mapped to their schedule functions."""


def get_schedule(name: str, stages: int, micro_batches: int) -> Schedule:
    """Build a schedule by name: ``"gpipe"``, ``"1f1b"`` (or ``"one_f_one_b"``), ``"forward"``.

    The result is not validated here; the executor calls :func:`validate` before running it.

    Raises:
        ScheduleError: ``name`` is unknown (the message lists the valid names), or the sizes
            are not positive.
    """
    function = SCHEDULE_NAMES.get(name.strip().lower()) if isinstance(name, str) else None
    if function is None:
        raise ScheduleError(
            f"unknown schedule {name!r} (use one of {', '.join(map(repr, SCHEDULE_NAMES))})"
        )
    return function(stages, micro_batches)


@dataclass(frozen=True)
class TimedAction:
    """An action placed in time by :func:`simulate`."""

    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """The result of :func:`simulate`: when each stage ran each action.

    Attributes:
        stages: Per-stage executed actions with start/end times, in execution order.
        makespan: Time at which the last action ends.
        blocked: Per stage, the action it is stuck on when the schedule deadlocks (``None``
            for stages that finished); all ``None`` for a runnable schedule.
    """

    stages: list[list[TimedAction]]
    makespan: float
    blocked: list[Action | None]

    @property
    def deadlocked(self) -> bool:
        """Whether some stage could not finish its list."""
        return any(action is not None for action in self.blocked)

    @property
    def busy_time(self) -> list[float]:
        """Per-stage total compute time."""
        return [sum(item.end - item.start for item in items) for items in self.stages]

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction of the ``stages × makespan`` area: GPipe has ``(P-1)/(M+P-1)``."""
        area = len(self.stages) * self.makespan
        return 0.0 if area == 0 else 1.0 - sum(self.busy_time) / area


def _dependency(stage: int, action: Action, last_stage: int) -> list[tuple[int, ActionKind, int]]:
    """What ``action`` on ``stage`` waits for, as (stage, kind, micro_batch) keys."""
    m = action.micro_batch
    if action.kind is ActionKind.FORWARD:
        return [(stage - 1, ActionKind.FORWARD, m)] if stage > 0 else []
    needs = [(stage, ActionKind.FORWARD, m)]
    if stage < last_stage:
        needs.append((stage + 1, ActionKind.BACKWARD, m))
    return needs


def simulate(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0) -> Timeline:
    """Run ``schedule`` on an idealised machine: fixed compute times, free communication.

    A stage runs its actions in order; each starts when the stage is free and its inputs exist
    (the previous stage's forward of that micro-batch; for a backward, this stage's forward and
    the next stage's backward of it). A deadlocked schedule is not an error here: the timeline
    stops and ``blocked`` names where each stage is stuck.

    Args:
        schedule: Per-stage action lists.
        forward_time: Duration of one forward on one stage.
        backward_time: Duration of one backward on one stage.

    Returns:
        The :class:`Timeline`.
    """
    durations = {ActionKind.FORWARD: forward_time, ActionKind.BACKWARD: backward_time}
    last_stage = len(schedule) - 1
    finished: dict[tuple[int, ActionKind, int], float] = {}
    placed: list[list[TimedAction]] = [[] for _ in schedule]
    free_at = [0.0] * len(schedule)
    position = [0] * len(schedule)
    progress = True
    while progress:
        progress = False
        for stage, actions in enumerate(schedule):
            while position[stage] < len(actions):
                action = actions[position[stage]]
                needs = _dependency(stage, action, last_stage)
                if any(key not in finished for key in needs):
                    break
                start = max([free_at[stage]] + [finished[key] for key in needs])
                end = start + durations[action.kind]
                finished.setdefault((stage, action.kind, action.micro_batch), end)
                placed[stage].append(TimedAction(action, start, end))
                free_at[stage] = end
                position[stage] += 1
                progress = True
    blocked = [
        actions[position[stage]] if position[stage] < len(actions) else None
        for stage, actions in enumerate(schedule)
    ]
    return Timeline(placed, max(free_at, default=0.0), blocked)


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward is done and backward is not, over one stage's list."""
    in_flight: set[int] = set()
    peak = 0
    for action in actions:
        if action.kind is ActionKind.FORWARD:
            in_flight.add(action.micro_batch)
            peak = max(peak, len(in_flight))
        elif action.kind is ActionKind.BACKWARD:
            in_flight.discard(action.micro_batch)
    return peak


def render(schedule: Schedule, forward_time: int = 1, backward_time: int = 2) -> str:
    """A time × stage table of :func:`simulate`'s timeline; idle slots show ``.``.

    Each column is one time unit, so with the defaults a backward fills two cells. Stages that
    deadlock end with a "blocked at" note.

    Example (``render(gpipe(2, 2))``)::

        time     0  1  2  3  4  5  6  7  8
        stage 0 F0 F1  .  .  . B1 B1 B0 B0
        stage 1  . F0 F1 B1 B1 B0 B0  .  .
    """
    timeline = simulate(schedule, float(forward_time), float(backward_time))
    slots = int(timeline.makespan)
    cells = [["."] * slots for _ in schedule]
    for stage, items in enumerate(timeline.stages):
        for item in items:
            label = f"{item.action.kind.value}{item.action.micro_batch}"
            for t in range(int(item.start), int(item.end)):
                cells[stage][t] = label
    width = max([2, len(str(max(slots - 1, 0)))] + [len(c) for row in cells for c in row])
    name_width = len(f"stage {len(schedule) - 1}")
    lines = ["time".ljust(name_width) + "".join(f" {t:>{width}}" for t in range(slots))]
    for stage, row in enumerate(cells):
        line = f"stage {stage}".ljust(name_width) + "".join(f" {cell:>{width}}" for cell in row)
        if timeline.blocked[stage] is not None:
            line += f"  <- blocked at {timeline.blocked[stage]}"
        lines.append(line)
    return "\n".join(lines)


def _fail(problem: str, schedule: Schedule) -> ScheduleError:
    return ScheduleError(f"{problem}\n{render(schedule)}")


def validate(
    schedule: Schedule, stages: int, micro_batches: int, *, require_backward: bool = True
) -> None:
    """Check a schedule before it runs; raise with the rendered table if it is wrong.

    Checks: one list per stage; each action sits on its own stage's list with a micro-batch
    in ``0..M-1``; every (stage, micro-batch) has exactly one forward and, if
    ``require_backward``, exactly one backward (otherwise at most one), forward first; and a
    simulation under blocking receives / buffered sends finishes every list (no deadlock).

    Args:
        schedule: Per-stage action lists.
        stages: Expected number of stages ``P``.
        micro_batches: Expected number of micro-batches ``M``.
        require_backward: Whether every micro-batch must also have a backward on every stage.

    Raises:
        ScheduleError: naming the first problem found, followed by ``render(schedule)``.
    """
    _check_sizes(stages, micro_batches)
    if len(schedule) != stages:
        raise ScheduleError(
            f"schedule has {len(schedule)} stage lists but the pipeline has {stages} stages "
            f"(build it with stages={stages})"
        )
    for stage, actions in enumerate(schedule):
        seen: dict[tuple[ActionKind, int], int] = {}
        for index, action in enumerate(actions):
            if action.stage != stage:
                raise _fail(
                    f"action {action} is on stage {stage}'s list (position {index}); "
                    f"move it to stage {action.stage}'s list",
                    schedule,
                )
            if not 0 <= action.micro_batch < micro_batches:
                raise _fail(
                    f"action {action} names micro-batch {action.micro_batch} outside "
                    f"0..{micro_batches - 1} (micro_batches {micro_batches})",
                    schedule,
                )
            key = (action.kind, action.micro_batch)
            if key in seen:
                raise _fail(
                    f"action {action} appears twice on stage {stage} "
                    f"(positions {seen[key]} and {index})",
                    schedule,
                )
            seen[key] = index
            if action.kind is ActionKind.BACKWARD and (ActionKind.FORWARD, action.micro_batch) not in seen:
                raise _fail(
                    f"backward {action} comes before forward {_forward(stage, action.micro_batch)} "
                    f"on stage {stage} (position {index})",
                    schedule,
                )
        for m in range(micro_batches):
            if (ActionKind.FORWARD, m) not in seen:
                raise _fail(f"stage {stage} has no forward {_forward(stage, m)}", schedule)
            if require_backward and (ActionKind.BACKWARD, m) not in seen:
                raise _fail(f"stage {stage} has no backward {_backward(stage, m)}", schedule)
    timeline = simulate(schedule)
    if timeline.deadlocked:
        done = {
            (stage, item.action.kind, item.action.micro_batch)
            for stage, items in enumerate(timeline.stages)
            for item in items
        }
        stuck = ", ".join(
            f"stage {stage} waits at {action} for "
            + " and ".join(
                str(Action(*key))
                for key in _dependency(stage, action, stages - 1)
                if key not in done
            )
            for stage, action in enumerate(timeline.blocked)
            if action is not None
        )
        raise _fail(f"schedule deadlocks under blocking receives ({stuck})", schedule)

"""Tests of hybridpipe.pipeline.schedule: generators, validator, simulator, renderer."""

from __future__ import annotations

import pytest

from hybridpipe.errors import ScheduleError
from hybridpipe.pipeline import schedule as sched
from hybridpipe.pipeline.schedule import Action, ActionKind


def labels(actions: list[Action]) -> str:
    return " ".join(map(str, actions))


def parse_all(text: str) -> list[Action]:
    return [Action.parse(word) for word in text.split(" ")]


def test_action_str_and_parse_round_trip() -> None:
    action = Action(2, ActionKind.FORWARD, 5)
    assert str(action) == "2F5"
    assert str(Action(2, ActionKind.BACKWARD, 15)) == "2B15"
    assert Action.parse("2F5") == action
    assert Action.parse(" 10b3 ") == Action(10, ActionKind.BACKWARD, 3)
    with pytest.raises(ScheduleError, match="'2X5'.*F, B"):
        Action.parse("2X5")
    with pytest.raises(ScheduleError, match="cannot parse"):
        Action.parse("F5")


@pytest.mark.parametrize("stages", range(1, 9))
def test_gpipe_and_1f1b_validate_and_bound_memory(stages: int) -> None:
    for micro_batches in range(1, 17):
        for build in (sched.gpipe, sched.one_f_one_b):
            plan = build(stages, micro_batches)
            sched.validate(plan, stages, micro_batches)
        gpipe_plan = sched.gpipe(stages, micro_batches)
        one_f_plan = sched.one_f_one_b(stages, micro_batches)
        for s in range(stages):
            assert sched.peak_in_flight(gpipe_plan[s]) == micro_batches
            assert sched.peak_in_flight(one_f_plan[s]) == min(stages - s, micro_batches)
        forward_plan = sched.forward_only(stages, micro_batches)
        sched.validate(forward_plan, stages, micro_batches, require_backward=False)
        with pytest.raises(ScheduleError, match="no backward"):
            sched.validate(forward_plan, stages, micro_batches)


def test_hand_checked_p4_m8() -> None:
    one_f = sched.one_f_one_b(4, 8)
    assert labels(one_f[0]) == (
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    )
    assert labels(one_f[2]) == (
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7"
    )
    assert labels(one_f[3]) == (
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"
    )
    gp = sched.gpipe(4, 8)
    assert labels(gp[1]) == (
        "1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 1B7 1B6 1B5 1B4 1B3 1B2 1B1 1B0"
    )


def test_get_schedule_names() -> None:
    assert sched.get_schedule("gpipe", 3, 4) == sched.gpipe(3, 4)
    assert sched.get_schedule("1F1B", 3, 4) == sched.one_f_one_b(3, 4)
    assert sched.get_schedule("one_f_one_b", 3, 4) == sched.one_f_one_b(3, 4)
    assert sched.get_schedule("forward", 3, 4) == sched.forward_only(3, 4)
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zero_bubble'.*'gpipe', '1f1b'.*'zb-h1'"):
        sched.get_schedule("zero_bubble", 3, 4)
    assert sched.get_schedule("ZB_H1", 3, 4) == sched.zero_bubble_h1(3, 4)
    assert sched.get_schedule("interleaved_1f1b", 2, 4, 2) == sched.interleaved_one_f_one_b(2, 4, 2)
    with pytest.raises(ScheduleError, match="needs virtual_stages >= 2"):
        sched.get_schedule("interleaved-1f1b", 2, 4)
    with pytest.raises(ScheduleError, match="'1f1b' runs one chunk per rank.*interleaved-1f1b"):
        sched.get_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="stages 0, micro_batches 4"):
        sched.gpipe(0, 4)


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 4, 16])
def test_bubble_fraction_matches_formula(stages: int, micro_batches: int) -> None:
    expected = (stages - 1) / (micro_batches + stages - 1)
    for build in (sched.gpipe, sched.one_f_one_b):
        timeline = sched.simulate(build(stages, micro_batches), forward_time=1.0, backward_time=2.0)
        assert timeline.bubble_fraction == pytest.approx(expected)
        assert timeline.makespan == pytest.approx(3.0 * (micro_batches + stages - 1))
        assert not timeline.deadlocked


def test_simulate_places_actions_on_dependencies() -> None:
    timeline = sched.simulate(sched.gpipe(2, 2), forward_time=1.0, backward_time=2.0)
    stage_1 = [(str(t.action), t.start, t.end) for t in timeline.stages[1]]
    assert stage_1 == [("1F0", 1, 2), ("1F1", 2, 3), ("1B1", 3, 5), ("1B0", 5, 7)]
    stage_0_backward = [(str(t.action), t.start) for t in timeline.stages[0][2:]]
    assert stage_0_backward == [("0B1", 5), ("0B0", 7)]
    assert timeline.busy_time == [6.0, 6.0]


def _spans(timeline: sched.Timeline) -> list[list[tuple[str, float, float]]]:
    return [[(str(t.action), round(t.start, 9), round(t.end, 9)) for t in items] for items in timeline.stages]


@pytest.mark.parametrize("name,stages,micro_batches", [("gpipe", 2, 4), ("1f1b", 4, 8), ("zb-h1", 3, 6),
                                                        ("interleaved-1f1b", 2, 4)])
def test_simulate_shared_at_full_speed_is_simulate(name: str, stages: int, micro_batches: int) -> None:
    plan = sched.get_schedule(name, stages, micro_batches, 2 if name == "interleaved-1f1b" else 1)
    times = dict(forward_time=lambda a: 1.0 + 0.25 * a.stage, backward_time=2.0, transfer_time=0.1)
    shared = sched.simulate_shared(plan, lambda running: [1.0] * len(running), **times)
    assert _spans(shared) == _spans(sched.simulate(plan, **times))


def test_simulate_shared_with_replicas_and_their_collective_update() -> None:
    """Stages with their own replica counts (3-1, PipeDream): the lists, the placement of each micro-batch and the
    replicas' joint update as :func:`simulate` runs them."""
    counts, m = [3, 1], 6
    places = [(0, 0), (0, 1), (0, 2), (1, 0)]
    where = {place: index for index, place in enumerate(places)}
    streams = sched.replica_streams("pipedream", counts, m)
    lists = [streams[place].segment(m) + streams[place].drain() for place in places]
    times = dict(placement=lambda s, b: where[(s, b % counts[s])], update_time=0.5,
                 together=lambda rank, a: ((a.stage, a.micro_batch // counts[a.stage]), counts[a.stage])
                 if a.kind is sched.ActionKind.UPDATE else None)
    shared = sched.simulate_shared(lists, lambda running: [1.0] * len(running), **times)
    assert not shared.deadlocked and _spans(shared) == _spans(sched.simulate(lists, **times))


def test_an_action_its_rank_starts_after_a_wait_takes_the_resume_time_longer() -> None:
    """GPipe, 2 stages, 2 micro-batches, ``resume`` 0.5: stage 0 idles from 2 to 5 waiting for 1B1's gradient, so
    its B1 takes 2.5; everything else starts on a rank that was busy up to it (or is its first action) and takes its
    time. The shared-cores simulation at full speed says the same."""
    timeline = sched.simulate(sched.gpipe(2, 2), forward_time=1.0, backward_time=2.0, resume=0.5)
    assert _spans(timeline) == [[("0F0", 0, 1), ("0F1", 1, 2), ("0B1", 5, 7.5), ("0B0", 7.5, 9.5)],
                                [("1F0", 1, 2), ("1F1", 2, 3), ("1B1", 3, 5), ("1B0", 5, 7)]]
    shared = sched.simulate_shared(sched.gpipe(2, 2), lambda running: [1.0] * len(running), forward_time=1.0,
                                   backward_time=2.0, resume=0.5)
    assert _spans(shared) == _spans(timeline)
    assert sched.simulate(sched.gpipe(2, 2), forward_time=1.0, backward_time=2.0).makespan == 9.0  # without: 0B1 5-7


def test_simulate_shared_slows_only_what_computes_at_once() -> None:
    """Two stages on one core (each goes at half speed while both compute), GPipe, 2 micro-batches: stage 0's F1
    runs beside stage 1's F0 (both 1 of work: 1-3), B0 of stage 1 beside B1 of stage 0 (2 each: 6-10); the rest
    alone, at full speed."""
    half = sched.simulate_shared(sched.gpipe(2, 2), lambda running: [1.0 / len(running)] * len(running),
                                 forward_time=1.0, backward_time=2.0)
    assert _spans(half) == [[("0F0", 0, 1), ("0F1", 1, 3), ("0B1", 6, 10), ("0B0", 10, 12)],
                            [("1F0", 1, 3), ("1F1", 3, 4), ("1B1", 4, 6), ("1B0", 6, 10)]]
    assert half.makespan == 12
    blocked = sched.simulate_shared([[Action(0, ActionKind.BACKWARD, 0)]], lambda running: [1.0] * len(running))
    assert blocked.deadlocked and blocked.blocked == [Action(0, ActionKind.BACKWARD, 0)]


def test_simulate_shared_runs_each_lists_tail_after_its_last_action() -> None:
    """Work after a list's last action (a rank's reductions and optimizer step) shares the processor too: stage 0's
    tail of 2 runs beside stage 1's forward (1) at half speed, 1-3, then alone, 3-4; stage 1's tail of 0 ends with
    its forward. The makespan stays the last action's end."""
    timeline = sched.simulate_shared(sched.forward_only(2, 1), lambda running: [1.0 / len(running)] * len(running),
                                     forward_time=1.0, tails=[2.0, 0.0])
    assert _spans(timeline) == [[("0F0", 0, 1)], [("1F0", 1, 3)]]
    assert timeline.tail_ends == pytest.approx([4.0, 3.0]) and timeline.makespan == 3
    assert sched.simulate_shared(sched.forward_only(2, 1), lambda running: [1.0] * len(running)).tail_ends == []


def test_render_shows_bubbles() -> None:
    table = sched.render(sched.gpipe(2, 2))
    assert table.splitlines() == [
        "time     0  1  2  3  4  5  6  7  8",
        "stage 0 F0 F1  .  .  . B1 B1 B0 B0",
        "stage 1  . F0 F1 B1 B1 B0 B0  .  .",
    ]
    table = sched.render(sched.one_f_one_b(4, 8))
    assert table.splitlines()[1].split()[2:8] == ["F0", "F1", "F2", "F3", ".", "."]
    assert len(table.splitlines()) == 5


def corrupted(plan: list[list[Action]], stage: int, edit) -> list[list[Action]]:
    copy = [list(actions) for actions in plan]
    copy[stage] = edit(copy[stage])
    return copy


def test_missing_backward_is_reported_with_table() -> None:
    plan = corrupted(sched.one_f_one_b(3, 4), 1, lambda a: [x for x in a if str(x) != "1B2"])
    with pytest.raises(ScheduleError) as error:
        sched.validate(plan, 3, 4)
    message = str(error.value)
    assert "stage 1 has no backward 1B2" in message
    assert sched.render(plan) in message
    assert "stage 0" in message and "time" in message


def test_backward_before_forward_is_reported() -> None:
    def swap(actions: list[Action]) -> list[Action]:
        i, j = actions.index(Action.parse("2F1")), actions.index(Action.parse("2B1"))
        actions[i], actions[j] = actions[j], actions[i]
        return actions

    plan = corrupted(sched.one_f_one_b(3, 4), 2, swap)
    with pytest.raises(ScheduleError, match="backward 2B1 comes before forward 2F1") as error:
        sched.validate(plan, 3, 4)
    assert sched.render(plan) in str(error.value)


def test_swapped_order_deadlock_is_reported() -> None:
    # 1F1B for P=2, M=2 with both stages' middle pairs swapped: stage 0 waits for the
    # gradient of micro-batch 0 before forwarding 1, stage 1 waits for micro-batch 1's
    # activation before its backward of 0 — a cycle under blocking receives.
    plan = [
        parse_all("0F0 0B0 0F1 0B1"),
        parse_all("1F0 1F1 1B0 1B1"),
    ]
    with pytest.raises(ScheduleError) as error:
        sched.validate(plan, 2, 2)
    message = str(error.value)
    assert "deadlocks" in message
    assert "stage 0 waits at 0B0 for 1B0" in message
    assert "stage 1 waits at 1F1 for 0F1" in message
    assert sched.render(plan) in message
    assert "<- blocked at 1F1" in message
    timeline = sched.simulate(plan)
    assert timeline.deadlocked and [str(a) for a in timeline.blocked] == ["0B0", "1F1"]


def test_structural_errors() -> None:
    plan = sched.gpipe(2, 2)
    with pytest.raises(ScheduleError, match="has 2 stage lists but the pipeline has 3"):
        sched.validate(plan, 3, 2)
    wrong_list = corrupted(plan, 0, lambda a: [Action.parse("1F0")] + a[1:])
    with pytest.raises(ScheduleError, match="1F0 is on stage 0's list"):
        sched.validate(wrong_list, 2, 2)
    duplicate = corrupted(plan, 1, lambda a: a + [a[0]])
    with pytest.raises(ScheduleError, match="1F0 appears twice on stage 1"):
        sched.validate(duplicate, 2, 2)
    out_of_range = corrupted(plan, 0, lambda a: a + [Action.parse("0F7")])
    with pytest.raises(ScheduleError, match="micro-batch 7 outside 0..1"):
        sched.validate(out_of_range, 2, 2)


def test_peak_in_flight_counts_forward_minus_backward() -> None:
    actions = parse_all("0F0 0F1 0B0 0F2 0F3 0B1 0B2 0B3")
    assert sched.peak_in_flight(actions) == 3
    assert sched.peak_in_flight([]) == 0


# ------------------------------------------------------------------ interleaved 1F1B, ZB-H1, asynchronous streams


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("virtual_stages", [2, 3])
def test_interleaved_validates_and_shrinks_the_bubble_by_v(stages: int, virtual_stages: int) -> None:
    for micro_batches in range(stages, 4 * stages + 1, stages):
        plan = sched.interleaved_one_f_one_b(stages, micro_batches, virtual_stages)
        sched.validate(plan, stages, micro_batches, virtual_stages=virtual_stages)
        for rank, actions in enumerate(plan):
            assert {a.stage for a in actions} == set(range(rank, stages * virtual_stages, stages))
        if stages > 1:  # each chunk holds 1/v of the rank's layers
            bubble = sched.simulate(plan, 1 / virtual_stages, 2 / virtual_stages).makespan - 3 * micro_batches
            one_f = sched.simulate(sched.one_f_one_b(stages, micro_batches), 1, 2).makespan - 3 * micro_batches
            assert bubble == pytest.approx(one_f / virtual_stages)


def test_interleaved_order_and_errors() -> None:
    plan = sched.interleaved_one_f_one_b(2, 4, 2)
    assert labels(plan[0]) == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    assert sched.render(plan).splitlines()[1].split()[2:5] == ["F0.0", "F1.0", "F0.1"]
    with pytest.raises(ScheduleError, match=r"micro_batches must be a multiple of 3 \(got 4; use 3 or 6\)"):
        sched.interleaved_one_f_one_b(3, 4, 2)
    wrong = [list(actions) for actions in plan]
    wrong[0][2] = Action(3, ActionKind.FORWARD, 0)
    with pytest.raises(ScheduleError, match="0F3|3F0 is on stage 0's list.*move it to stage 1's list"):
        sched.validate(wrong, 2, 4, virtual_stages=2)


@pytest.mark.parametrize("stages", range(1, 7))
def test_zero_bubble_h1_validates_bounds_memory_and_cuts_the_bubble(stages: int) -> None:
    for micro_batches in range(1, 17):
        plan = sched.zero_bubble_h1(stages, micro_batches)
        sched.validate(plan, stages, micro_batches)
        for actions in plan:
            assert sched.peak_in_flight(actions) <= min(stages, micro_batches)  # 1F1B's first stage
            assert [a.kind for a in actions].count(ActionKind.BACKWARD_WEIGHT) == micro_batches
        if stages > 1 and micro_batches >= stages:
            bubble = sched.simulate(plan, 1, 2).makespan - 3 * micro_batches
            one_f = sched.simulate(sched.one_f_one_b(stages, micro_batches), 1, 2).makespan - 3 * micro_batches
            assert bubble <= 0.5 * one_f


def test_zero_bubble_h1_hand_checked_p4_m8() -> None:
    plan = sched.zero_bubble_h1(4, 8)
    assert labels(plan[3]) == ("3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 "
                               "3W4 3W5 3W6 3W7")
    assert sched.render(plan).splitlines()[4].split()[2:9] == [".", ".", ".", "F0", "I0", "F1", "I1"]


def test_split_backward_errors_are_named() -> None:
    plan = sched.zero_bubble_h1(2, 2)
    no_w = [[a for a in actions if str(a) != "1W1"] for actions in plan]
    with pytest.raises(ScheduleError, match="stage 1 has no weight gradient 1W1 after its 1I1"):
        sched.validate(no_w, 2, 2)
    early_w = [list(actions) for actions in plan]
    early_w[1].remove(Action.parse("1W0"))
    early_w[1].insert(0, Action.parse("1W0"))
    with pytest.raises(ScheduleError, match="weight gradient 1W0 comes before its input gradient 1I0"):
        sched.validate(early_w, 2, 2)
    both = [list(actions) for actions in sched.one_f_one_b(2, 2)]
    both[1].append(Action.parse("1I0"))
    with pytest.raises(ScheduleError, match="has both a full backward B and an input gradient I"):
        sched.validate(both, 2, 2)


@pytest.mark.parametrize("name", ["pipedream", "2bw"])
def test_asynchronous_streams_never_flush_and_update_as_specified(name: str) -> None:
    for stages in range(1, 5):
        for micro_batches in range(1, 6):
            streams = [sched.AsyncStream(name, stages, s, micro_batches) for s in range(stages)]
            for step in range(3):
                segments = [stream.segment((step + 1) * micro_batches) for stream in streams]
                for s, (stream, segment) in enumerate(zip(streams, segments)):
                    forwards = [a.micro_batch for a in segment if a.kind is ActionKind.FORWARD]
                    assert forwards == list(range(step * micro_batches, (step + 1) * micro_batches))
                    in_flight = stream.next_forward - stream.next_backward
                    assert in_flight == min(stages - s - 1, (step + 1) * micro_batches)  # never flushed
                    for i, action in enumerate(segment):
                        if action.kind is ActionKind.BACKWARD:
                            update = i + 1 < len(segment) and segment[i + 1].kind is ActionKind.UPDATE
                            last_of_batch = (action.micro_batch + 1) % micro_batches == 0
                            assert update == (name == "pipedream" or last_of_batch)
            plan = sched.async_schedule(name, stages, micro_batches, steps=3)
            sched.validate(plan, stages, 3 * micro_batches)
            updates = [[a for a in actions if a.kind is ActionKind.UPDATE] for actions in plan]
            assert all(len(u) == (3 * micro_batches if name == "pipedream" else 3) for u in updates)


def test_pipedream_steady_state_has_no_bubble() -> None:
    stages, micro_batches, steps = 4, 8, 6
    timeline = sched.simulate(sched.async_schedule("pipedream", stages, micro_batches, steps=steps))
    work = 3 * micro_batches * steps
    # fill and drain once for the whole run, not once per step as with a flush
    assert timeline.makespan == pytest.approx(work + 3 * (stages - 1))


def replicated_grids(most: int):
    """Every composition of 2..``most`` ranks into 2 or more stages' replica counts: (counts, each rank's (stage,
    replica), the rank of each (stage, replica))."""
    from brute_force import compositions
    from hybridpipe.runtime import layout, rank_of_place

    for ranks in range(2, most + 1):
        for stages in range(2, ranks + 1):
            for counts in compositions(ranks, stages):
                yield counts, layout(counts), rank_of_place(counts)


def test_replica_schedules_run_every_micro_batch_once_and_never_deadlock():
    """Stages with their own replica counts: every composition of up to 6 ranks, M = 1..10: each micro-batch's
    forward and backward once on replica m mod R_s, the simulation never blocks, 1F1B keeps at most
    ceil((R_s + ... + R_{P-1}) / R_s) micro-batches in flight per replica, and one replica per stage is 1F1B."""
    for counts, places, where in replicated_grids(6):
        for m in range(1, 11):
            for name in ("gpipe", "1f1b"):
                lists = sched.replica_schedule(name, counts, m)
                for (s, r), actions in lists.items():
                    mine = [b for b in range(m) if b % counts[s] == r]
                    assert sorted(a.micro_batch for a in actions if a.kind is sched.ActionKind.FORWARD) == mine
                    assert sorted(a.micro_batch for a in actions if a.kind is sched.ActionKind.BACKWARD) == mine
                    if name == "1f1b":
                        room = -(-sum(counts[s:]) // counts[s])
                        assert sched.peak_in_flight(actions) <= room
                timeline = sched.simulate([lists[p] for p in places],
                                          placement=lambda s, b: where[(s, b % counts[s])])
                assert all(blocked is None for blocked in timeline.blocked), (counts, m, name)
    straight = sched.replica_schedule("1f1b", [1, 1, 1, 1], 8)
    assert [straight[(s, 0)] for s in range(4)] == sched.one_f_one_b(4, 8)
    with pytest.raises(sched.ScheduleError, match="'zb-h1' does not run on stages with their own replica counts"):
        sched.replica_schedule("zb-h1", [3, 1], 4)


def test_replica_streams_of_pipedream_never_deadlock_with_rounds_as_one_collective():
    """PipeDream on stages with their own replica counts: every composition of up to 6 ranks, M one or two rounds of
    every count, 1-3 train_steps and a flush: each replica forwards and backwards its own micro-batches once and
    updates once per round, and the simulation, each round's updates one collective of the stage's replicas,
    never blocks."""
    import math

    for counts, places, where in replicated_grids(6):
        for m in sorted({math.lcm(*counts), 2 * math.lcm(*counts)}):
            if m > 24:
                continue
            for steps in (1, 3):
                streams = sched.replica_streams("pipedream", counts, m)
                lists = {place: [] for place in places}
                for step in range(steps):
                    for place in places:
                        lists[place] += streams[place].segment((step + 1) * m)
                for place in places:
                    lists[place] += streams[place].drain()
                for (s, r), actions in lists.items():
                    mine = [b for b in range(steps * m) if b % counts[s] == r]
                    assert [a.micro_batch for a in actions if a.kind is sched.ActionKind.FORWARD] == mine
                    assert [a.micro_batch for a in actions if a.kind is sched.ActionKind.UPDATE] == mine
                timeline = sched.simulate(
                    [lists[p] for p in places], placement=lambda s, b: where[(s, b % counts[s])],
                    together=lambda rank, a: ((a.stage, a.micro_batch // counts[a.stage]), counts[a.stage])
                    if a.kind is sched.ActionKind.UPDATE else None)
                assert all(blocked is None for blocked in timeline.blocked), (counts, m, steps)
    with pytest.raises(sched.ScheduleError, match="4 is not a multiple of 3: use e.g. 3"):
        sched.replica_streams("pipedream", [3, 1], 4)
    with pytest.raises(sched.ScheduleError, match="'2bw' does not run on stages with their own replica counts"):
        sched.replica_streams("2bw", [3, 1], 3)

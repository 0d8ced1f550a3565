"""The background engine under a real mpirun: async allreduce by name, negotiation, caching, fusion,
mismatch and stall reporting, independent groups."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn
from mpi4py import MPI

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.config import Config
from hybridpipe.errors import HybridPipeError, MismatchError

pytestmark = pytest.mark.mpi(ranks=[2], long_ranks=[4], timeout=300, shared=True)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size


@pytest.fixture
def grid():
    hp.shutdown()
    yield hp.init()
    hp.shutdown()


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def value(rank: int, index: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(count, dtype=torch.float64) % 7 + rank + index
    return base.to(dtype)


@pytest.mark.parametrize("op", [hp.Sum, hp.Average, hp.Min, hp.Max])
def test_names_not_call_order_match_tensors(grid, op):
    sizes = [1, 3, 1000, 70_000, 300_000]  # below and above the small-message cutoff and fusion buckets
    names = [f"{dtype}-{count}" for dtype in DTYPES for count in sizes]
    tensors = {f"{dtype}-{count}": value(RANK, i, count, dtype)
               for i, (dtype, count) in enumerate((d, c) for d in DTYPES for c in sizes)}
    order = list(np.random.default_rng(RANK).permutation(names))  # a different order on every rank
    handles = {name: hp.allreduce_async_(tensors[name], name=name, op=op) for name in order}
    for i, (dtype, count) in enumerate((d, c) for d in DTYPES for c in sizes):
        name = f"{dtype}-{count}"
        everyone = np.stack([value(r, i, count, torch.float64).numpy() for r in range(SIZE)])
        expected = {hp.Sum: everyone.sum(0), hp.Average: everyone.mean(0), hp.Min: everyone.min(0),
                    hp.Max: everyone.max(0)}[op]
        if not dtype.is_floating_point and op == hp.Average:
            expected = np.trunc(expected)
        result = hp.synchronize(handles[name])
        with ranks_agree(what=name):
            assert result is tensors[name]
            tolerance = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
            np.testing.assert_allclose(result.double().numpy(), expected, rtol=tolerance, err_msg=name)


def test_copy_variant_numpy_and_non_contiguous(grid):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() + RANK  # not contiguous
    handle = hp.allreduce_async(t, name="t", op=hp.Sum)
    a = np.full(5, RANK + 1, dtype=np.int64)
    handle_a = hp.allreduce_async_(a, name="a", op=hp.Max)
    result = handle.wait()
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * SIZE + sum(range(SIZE))
    assert torch.equal(result, expected)
    assert torch.equal(t, torch.arange(12, dtype=torch.float32).reshape(3, 4).t() + RANK)  # input untouched
    assert handle_a.wait() is a and (a == SIZE).all()
    assert hp.poll(handle) and handle.poll()


def test_steady_state_needs_no_name_gathering(grid):
    tensors = {f"grad.{i}": torch.ones(100 * (i + 1)) for i in range(20)}
    order = list(tensors) if RANK % 2 else list(reversed(tensors))
    for step in range(6):
        if step == 1:
            after_first = hp.engine_stats("world")
        handles = [hp.allreduce_async_(tensors[name], name=name) for name in order]
        for h in handles:
            h.wait()
    stats = hp.engine_stats("world")
    assert stats["slow_rounds"] == after_first["slow_rounds"], "names were gathered again after the first step"
    assert stats["tensors"] - after_first["tensors"] == 5 * 20
    assert stats["buckets"] < stats["tensors"]  # fused


def test_mismatch_raises_on_every_rank_and_the_engine_goes_on(grid):
    bad = torch.ones(4 + (RANK == 1))
    handle = hp.allreduce_async_(bad, name="bad", op=hp.Sum)
    with pytest.raises(MismatchError, match=r"'bad' on group 'world': ranks disagree \(rank 0: count=4 "
                                            r"dtype=float32 op=Sum; rank 1: count=5"):
        handle.wait()
    good = torch.ones(3)
    assert torch.equal(hp.allreduce_async_(good, name="bad", op=hp.Sum).wait(), torch.full((3,), float(SIZE)))


def test_duplicate_in_flight_name_and_bad_arguments(grid):
    t = torch.ones(3)
    handle = hp.allreduce_async_(t, name="dup")
    with pytest.raises(ValueError, match="'dup' is already in flight"):  # Horovod's type
        hp.allreduce_async_(torch.ones(3), name="dup")
    handle.wait()
    with pytest.raises(TypeError, match="takes a torch.Tensor or numpy.ndarray, got list"):
        hp.allreduce_async_([1, 2], name="x")
    with pytest.raises(TypeError, match="dtype torch.uint8 cannot be reduced"):
        hp.allreduce_async_(torch.ones(2, dtype=torch.uint8), name="u8")
    with pytest.raises(ValueError, match="unknown group 'rows'"):
        hp.allreduce_async_(torch.ones(2), name="g", group="rows")


def test_unnamed_calls_get_deterministic_names(grid):
    handles = [hp.allreduce_async_(torch.full((2,), float(i)), op=hp.Sum) for i in range(3)]
    assert [h.wait()[0].item() for h in handles] == [0.0, SIZE * 1.0, SIZE * 2.0]
    assert all(h.name.startswith("allreduce_async_.noname.") for h in handles)


def test_names_count_from_init_so_a_new_session_agrees_whatever_the_last_one_did(grid):
    """Unnamed calls, DistributedOptimizers and tied models are named by their number in the session. A
    session where rank 0 made one more of each (no communication needed to make them) used to leave every
    later session's names one apart between the ranks, so their collectives waited for each other forever
    (a test file run after such a file in the same process, an elastic re-init). Numbers now restart at
    hp.init."""
    from hybridpipe.comm import context

    if RANK == 0:
        context.unnamed("allreduce_async_")
        hp.DistributedOptimizer(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))
    hp.shutdown()
    hp.init()
    handle = hp.allreduce_async_(torch.ones(2), op=hp.Sum)
    assert hp.allgather_object(handle.name) == [handle.name] * SIZE
    assert torch.equal(handle.wait(), torch.full((2,), float(SIZE)))
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    model(torch.full((1, 2), float(RANK))).sum().backward()
    optimizer.step()  # the ranks' has-gradient agreements carry the same name: it completes
    assert hp.allgather_object(optimizer._hp_prefix) == [optimizer._hp_prefix] * SIZE
    assert torch.allclose(model.weight.grad, torch.full((1, 2), (SIZE - 1) / 2))  # averaged over the ranks


def test_stall_warning_names_the_missing_ranks(capfd):
    hp.shutdown()
    hp.init(config=Config(stall_check_seconds=1.0))
    try:
        t = torch.ones(2)
        if RANK == 0:
            handle = hp.allreduce_async_(t, name="late", op=hp.Sum)
            WORLD.barrier()  # the others have not submitted it yet
            deadline = time.monotonic() + 30
            while hp.engine_stats("world")["stall_warnings"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            for other in range(1, SIZE):
                WORLD.send("go", dest=other)
        else:
            WORLD.barrier()
            WORLD.recv(source=0)
            handle = hp.allreduce_async_(t, name="late", op=hp.Sum)
        assert torch.equal(handle.wait(), torch.full((2,), float(SIZE)))
        if RANK == 0:
            err = capfd.readouterr().err
            assert "allreduce 'late' on group 'world' has waited" in err
            missing = ", ".join(str(r) for r in range(1, SIZE))
            assert f"ranks [0] of the group submitted it, ranks [{missing}] did not" in err
            assert hp.engine_stats("world")["stall_warnings"] == 1
    finally:
        hp.shutdown()


def test_groups_progress_independently():
    """On a 2-stage grid, stage 0's data-group reduction completes while stage 1's ranks are blocked
    waiting for it: the engine must not tie the groups together (that would deadlock here)."""
    if SIZE < 4:
        pytest.skip("needs a 2 x 2 grid")
    hp.shutdown()
    grid = hp.init(pipeline_stages=2)
    try:
        t = torch.full((1000,), float(grid.replica))
        if grid.stage == 0:
            reduced = hp.allreduce_async_(t, name="w", op=hp.Sum, group="data").wait()
            grid.pipe_comm.send("stage 0 done", dest=1)
        else:
            assert grid.pipe_comm.recv(source=0) == "stage 0 done"
            reduced = hp.allreduce_async_(t, name="w", op=hp.Sum, group="data").wait()
        assert torch.equal(reduced, torch.full((1000,), float(sum(range(grid.data_replicas)))))
        # several groups at once, in different orders
        a, b, c = torch.ones(5), torch.ones(6), torch.ones(7)
        calls = [(a, "data"), (b, "pipe"), (c, "world")]
        handles = [hp.allreduce_async_(x, name=f"multi.{g}", op=hp.Sum, group=g)
                   for x, g in (calls if grid.rank % 2 else calls[::-1])]
        for h in handles:
            h.wait()
        assert a[0] == grid.data_replicas and b[0] == grid.pipeline_stages and c[0] == SIZE
    finally:
        hp.shutdown()


def test_user_communicator_group(grid):
    split = WORLD.Split(color=RANK % 2, key=RANK)
    try:
        result = hp.allreduce_async_(torch.ones(3), name="user", op=hp.Sum, group=split).wait()
        assert torch.equal(result, torch.full((3,), float(split.size)))
    finally:
        hp.shutdown()  # frees hybridpipe's duplicate before the user's communicator
        split.Free()


def test_stall_shutdown_stops_the_group_on_every_rank():
    hp.shutdown()
    hp.init(config=Config(stall_check_seconds=0.5, stall_shutdown_seconds=1.5))
    try:
        if RANK == 0:
            handle = hp.allreduce_async_(torch.ones(2), name="never", op=hp.Sum)
            with pytest.raises(HybridPipeError, match=r"'never' waited [\d.]+ s .* \(only ranks \[0\] did\); "
                                                      r"stall_shutdown_seconds=1.5"):
                handle.wait()
        WORLD.barrier()
        time.sleep(0.2)
        with pytest.raises(HybridPipeError, match="stopped after an error"):  # on every rank
            hp.allreduce_async_(torch.ones(2), name="after", op=hp.Sum)
    finally:
        hp.shutdown()  # still a clean, collective stop


def _thread_nice_values() -> dict[int, int]:
    import os

    values = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as stat:
            values[int(tid)] = int(stat.read().rsplit(")", 1)[1].split()[16])  # field 19: nice
    return values


@pytest.mark.parametrize("nice, spin_us", [(19, 50.0), (0, -1.0)])
def test_engine_thread_priority_and_wait_policy(nice, spin_us):
    """The engine's threads run `engine_nice` levels below the process; both wait policies (polite
    and MPI's own spinning wait) reduce correctly."""
    if not __import__("sys").platform.startswith("linux"):
        pytest.skip("thread priorities are set on Linux only")
    hp.shutdown()
    hp.init(config=Config(engine_nice=nice, wait_spin_us=spin_us))
    try:
        tensor = torch.full((300_000,), float(RANK + 1))  # above the small-message cutoff: the ring
        hp.allreduce_async_(tensor, name="nice", op=hp.Sum).wait()
        assert torch.equal(tensor, torch.full((300_000,), float(SIZE * (SIZE + 1) // 2)))
        values = _thread_nice_values()
        niced = [tid for tid, value in values.items() if value == 19]
        assert len(niced) >= 1 if nice == 19 else not niced, values
        assert values[__import__("os").getpid()] == 0  # the main thread keeps its priority
    finally:
        hp.shutdown()


def test_direct_collectives_beside_tensors_in_flight(grid):
    """While this process has tensors on the engine, direct collectives wait politely (MPI_Iallreduce
    and the polite wait instead of a spinning MPI_Allreduce): same results, mismatches still raise."""
    big = torch.full((1 << 20,), float(RANK + 1))  # 4 MiB on the engine, reduced meanwhile
    handle = hp.allreduce_async_(big, name="in.flight", op=hp.Sum)
    from hybridpipe.comm import context

    assert bool(context.current("test").in_flight)
    total = SIZE * (SIZE + 1) / 2
    small = hp.allreduce(torch.full((10,), float(RANK + 1)), op=hp.Sum)  # the library's allreduce
    ring = hp.allreduce(torch.full((100_000,), float(RANK + 1)), op=hp.Sum)  # the ring
    grouped = hp.grouped_allreduce([torch.full((3,), float(RANK)), torch.ones(70_000)], op=hp.Sum)
    assert torch.equal(small, torch.full((10,), total)) and torch.equal(ring, torch.full((100_000,), total))
    assert torch.equal(grouped[0], torch.full((3,), float(SIZE * (SIZE - 1) // 2)))
    assert torch.equal(grouped[1], torch.full((70_000,), float(SIZE)))
    with pytest.raises(MismatchError):
        hp.allreduce(torch.ones(4 if RANK == 0 else 5), op=hp.Sum)
    assert torch.equal(handle.wait(), torch.full((1 << 20,), total))
    assert not bool(context.current("test").in_flight)


def test_direct_collectives_when_only_some_ranks_have_tensors_in_flight(grid):
    """Whether tensors are in flight is each rank's own state; the direct collectives must make
    matching MPI calls either way (a blocking MPI_Allreduce does not match an MPI_Iallreduce: this
    hung before they were made the same)."""
    from hybridpipe.comm import context

    handle = hp.allreduce_async_(torch.full((8,), float(RANK)), name="some.in.flight", op=hp.Sum)
    if RANK == 0:
        handle.wait()
    assert bool(context.current("test").in_flight) == (RANK != 0)
    small = hp.allreduce(torch.full((10,), float(RANK + 1)), op=hp.Sum)
    hp.barrier()
    assert torch.equal(small, torch.full((10,), SIZE * (SIZE + 1) / 2))
    assert torch.equal(handle.wait(), torch.full((8,), float(SIZE * (SIZE - 1) // 2)))


@pytest.mark.parametrize("help_", [True, False])
def test_waiting_thread_runs_the_buckets(help_):
    """With waiters_help, the thread blocked in wait() runs the buckets' allreduces (counted in
    engine_stats()['helped']); without it the engine thread does; both reduce correctly."""
    hp.shutdown()
    hp.init(config=Config(waiters_help=help_))
    try:
        before = hp.engine_stats("world")
        for step in range(3):
            tensors = [torch.full((count,), float(RANK + step)) for count in (300_000, 1 << 20, 5, 70_000)]
            handles = [hp.allreduce_async_(t, name=f"help.{i}", op=hp.Sum) for i, t in enumerate(tensors)]
            for t, h in zip(tensors, handles):
                assert torch.equal(h.wait(), torch.full_like(t, float(SIZE * (SIZE - 1) // 2 + SIZE * step)))
        after = hp.engine_stats("world")
        buckets, helped = after["buckets"] - before["buckets"], after["helped"] - before["helped"]
        assert buckets >= 6  # the two large tensors alone, the small ones fused
        assert (helped >= 1) if help_ else (helped == 0), (buckets, helped)
    finally:
        hp.shutdown()


def test_idle_groups_go_quiet_and_wake_on_submit(grid):
    """A group with nothing to do negotiates only once per quiet cycle (25 ms) after a few idle
    cycles (instead of once every cycle_time_ms), and a submission wakes it at once."""
    time.sleep(0.6)
    first = {group: hp.engine_stats(group)["cycles"] for group in ("world", "data")}
    time.sleep(0.6)
    quiet = {group: hp.engine_stats(group)["cycles"] - first[group] for group in ("world", "data")}
    assert all(cycles <= 40 for cycles in quiet.values()), quiet  # 0.6 s / 25 ms = 24; 0.5 ms cycles: ~1000
    result = hp.allreduce_async_(torch.ones(4), name="wake", op=hp.Sum, group="data").wait()
    assert torch.equal(result, torch.full((4,), float(SIZE)))


def test_waiters_help_while_two_groups_are_busy():
    """Buckets of two groups in flight, each rank waiting on them in its own order: a waiting thread
    runs only its own group's allreduces (when any waiter ran any group's, ranks that each ran the
    other group's bucket first waited on each other forever)."""
    if SIZE < 4:
        pytest.skip("needs a 2 x 2 grid")
    hp.shutdown()
    grid = hp.init(pipeline_stages=2)
    try:
        for step in range(5):
            world = torch.full((400_000,), float(RANK + step))
            data = torch.full((300_000,), float(grid.replica + step))
            handles = [hp.allreduce_async_(world, name="two.world", op=hp.Sum, group="world"),
                       hp.allreduce_async_(data, name="two.data", op=hp.Sum, group="data")]
            for h in handles if (RANK + step) % 2 else handles[::-1]:
                h.wait()
            assert torch.equal(world, torch.full((400_000,), float(SIZE * (SIZE - 1) // 2 + SIZE * step)))
            replicas = grid.data_replicas
            assert torch.equal(data, torch.full((300_000,), float(replicas * (replicas - 1) // 2 + replicas * step)))
    finally:
        hp.shutdown()


def test_prepared_allreduce_checks_once_and_takes_the_whole_path_for_anything_else(grid):
    """hp.DistributedOptimizer's per-gradient submission (PreparedAllreduce): the first call is checked in full,
    the next ones of the same kind go to the engine at once with the same result; another dtype, size, layout, op
    or job takes the whole path again, and a refused argument still fails on every rank."""
    from hybridpipe.collectives.allreduce import PreparedAllreduce

    prepared = PreparedAllreduce("prepared.grad")
    assert not prepared.checked
    for step in range(3):  # the first call checked, the next two direct
        value = torch.full((5,), float(RANK + 1 + step))
        assert prepared(value, op=hp.Sum).wait() is value
        assert torch.equal(value, torch.full((5,), float(sum(r + 1 + step for r in range(SIZE)))))
        assert prepared.checked
    averaged = torch.full((5,), float(RANK))
    prepared(averaged, op=hp.Average, postscale_factor=2.0).wait()  # other options: checked again
    assert torch.allclose(averaged, torch.full((5,), 2.0 * (SIZE - 1) / 2))
    wide = torch.full((5,), float(RANK), dtype=torch.float64)  # another dtype: the whole path, then kept
    prepared(wide, op=hp.Sum).wait()
    assert wide.dtype == torch.float64 and torch.equal(wide, torch.full((5,), float(sum(range(SIZE))),
                                                                        dtype=torch.float64))
    strided = (torch.arange(10.0) + RANK)[::2]  # not contiguous: the whole path (in place through a copy)
    prepared(strided, op=hp.Sum).wait()
    assert not prepared.checked
    assert not strided.is_contiguous() and torch.equal(strided, torch.arange(10.0)[::2] * SIZE + sum(range(SIZE)))
    prepared(torch.ones(5, dtype=torch.float64), op=hp.Sum).wait()
    assert prepared.checked
    hp.shutdown()
    hp.init()  # a new job: its first call is checked again
    assert not prepared.checked
    again = torch.ones(5, dtype=torch.float64)
    assert torch.equal(prepared(again, op=hp.Sum).wait(), torch.full((5,), float(SIZE), dtype=torch.float64))
    prepared(torch.ones(5), op=hp.Sum).wait()
    assert prepared.checked
    if RANK == 0:  # a bad argument on one rank: refused there, and the others' call fails naming it
        with pytest.raises(TypeError, match="prescale_factor must be a number"):
            prepared(torch.ones(5), op=hp.Sum, prescale_factor="2")
    else:
        with pytest.raises(MismatchError, match="prescale_factor must be a number"):
            prepared(torch.ones(5), op=hp.Sum).wait()


def test_prepared_allreduce_repeat_goes_direct_only_for_the_kept_kind(grid):
    """PreparedAllreduce.repeat (the optimizer's hand-off of each gradient after the first step): the last call's
    options again, straight to the engine, while the tensor is of the checked kind; None (the caller makes the
    whole call) before any check, for another dtype, size, layout or memory order, and in a new job."""
    from hybridpipe.collectives.allreduce import PreparedAllreduce

    prepared = PreparedAllreduce("repeat.grad")
    assert prepared.repeat(torch.ones(5)) is None  # nothing checked yet
    first = torch.full((5,), float(RANK))
    prepared(first, op=hp.Average, postscale_factor=2.0).wait()
    for step in range(2):  # the kept options (Average, postscale 2) with no argument passed again
        value = torch.full((5,), float(RANK + step))
        handle = prepared.repeat(value)
        assert handle is not None and handle.wait() is value
        assert torch.allclose(value, torch.full((5,), 2.0 * ((SIZE - 1) / 2 + step)))
    refused = [torch.ones(5, dtype=torch.float64), torch.ones(6), torch.arange(10.0)[::2],
               torch.ones(5).to_sparse(), torch.view_as_real(torch.ones(5, dtype=torch.complex64))[:, 0]]
    for tensor in refused:
        assert prepared.repeat(tensor) is None, tensor
    hp.shutdown()
    hp.init()  # the next job: checked again first
    assert prepared.repeat(torch.ones(5)) is None
    again = torch.ones(5)
    prepared(again, op=hp.Sum).wait()
    assert torch.equal(again, torch.full((5,), float(SIZE)))
    assert prepared.checked
    follow = torch.full((5,), 3.0)
    prepared.repeat(follow).wait()
    assert torch.equal(follow, torch.full((5,), 3.0 * SIZE))

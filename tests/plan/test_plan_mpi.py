"""The planner under mpirun: hp.auto plans for the running job, re-makes the grid as planned, and the model
and optimizer it returns train like one process on the global batch; calibrate measures the job's links; the
memory estimates match the bytes each stage really has in use. Checks run in ranks_agree blocks after the
collectives they check, so a check failing on one rank fails both there."""

from __future__ import annotations

import ctypes
import gc
import statistics
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import hybridpipe as hp
from agree import ranks_agree
from held_state import assert_as_held, holding
from hybridpipe.plan.auto import auto
from hybridpipe.plan.search import Plan
from hybridpipe.plan.verify import rechecked

pytestmark = pytest.mark.mpi(ranks=[2], timeout=300, shared=True)

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hp.init()
    yield
    hp.shutdown()


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]


def global_batches(steps: int = 3, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(size, 8, generator=generator), torch.randint(0, 4, (size,), generator=generator))
            for _ in range(steps)]


@pytest.mark.parametrize("given", [None, "pipeline", "zero=2 plan", "zero=1 search"])
def test_auto_builds_what_it_planned_and_trains_like_one_process(given):
    plan, zero = None, None
    if given == "pipeline":
        plan = Plan(stages=2, replicas=1, balance=[2, 3], micro_batches=4, schedule="1f1b", checkpoint="never",
                    step_seconds=0.0, samples_per_second=0.0, memory_bytes_per_rank=0.0, global_batch=8)
    elif given == "zero=2 plan":
        plan = Plan(stages=1, replicas=2, balance=[5], micro_batches=2, schedule="1f1b", checkpoint="never",
                    step_seconds=0.0, samples_per_second=0.0, memory_bytes_per_rank=0.0, global_batch=8, zero=2)
    elif given == "zero=1 search":
        zero = 1  # every plan with replicas shards at ZeRO-1
    sample = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    model, opt = auto(layers(), nn.CrossEntropyLoss(), sample, global_batch=8,
                      optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), plan=plan, zero=zero)
    try:
        grid = hp.grid()
        with ranks_agree(what="as planned"):
            assert (grid.pipeline_stages, grid.data_replicas) == (model.plan.stages, model.plan.replicas)
            assert model.balance == model.plan.balance and model.micro_batches == model.plan.micro_batches
            assert getattr(opt, "zero", 0) == model.plan.zero  # the optimizer shards as planned
            if plan is not None:
                assert model.plan is plan and grid.pipeline_stages == plan.stages
            if zero is not None:
                assert model.plan.zero == (zero if model.plan.replicas > 1 else 0)
        reference = nn.Sequential(*layers())
        reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        with ranks_agree(what="after training"):
            for inputs, targets in global_batches():
                shard = slice(grid.replica * 8 // grid.data_replicas, (grid.replica + 1) * 8 // grid.data_replicas)
                opt.zero_grad()
                model.train_step(inputs[shard], targets[shard])
                opt.step()
                reference_opt.zero_grad()
                nn.CrossEntropyLoss()(reference(inputs), targets).backward()
                reference_opt.step()
            expected = {f"layers.{name}": p for name, p in reference.named_parameters()}
            for name, parameter in model.named_parameters():
                torch.testing.assert_close(parameter, expected[name], rtol=1e-5, atol=1e-6)
    finally:
        model.close()


def test_calibrate_measures_the_links_and_the_planner_reads_them(tmp_path_factory):
    import json

    from hybridpipe import runtime
    from hybridpipe.plan import calibrate as calibration
    from hybridpipe.plan.calibrate import SIZES, calibrate, load_cluster

    if hp.grid().pipeline_stages != 1:  # an hp.auto test before may have left its plan's pipeline grid
        runtime.regrid("calibrate", pipeline_stages=1)
    with ranks_agree():
        windows, calibration.CONTENTION_WINDOWS = calibration.CONTENTION_WINDOWS, 16  # the values, not their accuracy
        try:
            result = calibrate(repeats=3)
        finally:
            calibration.CONTENTION_WINDOWS = windows
        assert result["ranks"] == hp.size() and result["ranks_per_host"] == hp.local_size()
        assert len(result["intra_p2p_seconds"]) == len(SIZES) and all(t > 0 for t in result["intra_p2p_seconds"])
        assert len(result["allreduce_seconds"]) == len(SIZES)
        assert result["intra_latency_us"] >= 0 and result["intra_gbps"] > 0 and result["allreduce_gbps"] > 0
        assert "inter_gbps" not in result  # one host
        path = tmp_path_factory.mktemp("cluster") / "cluster.json"
        path.write_text(json.dumps(result))
        cluster = load_cluster(str(path), ranks=8)
        assert cluster.ranks == 8 and cluster.ranks_per_host == result["ranks_per_host"]
        assert cluster.intra_host_gbps == pytest.approx(result["intra_gbps"])
        assert cluster.latency_us == pytest.approx(result["intra_latency_us"])
        assert result["compute_contention"] >= 1.0 and cluster.compute_contention == result["compute_contention"]
        # ZeRO's step, measured on the job's ranks (a 2-rank grid and up)
        assert result["zero1_us_per_mib"] >= 0 and result["zero2_us_per_mib"] >= 0
        assert result["zero3_us_per_mib"] > 0  # its gathers: a step of ZeRO-3 is never free
        assert cluster.zero_step_us_per_mib == tuple(result[f"zero{level}_us_per_mib"] for level in (1, 2, 3))
        assert result["data_parallel_us_per_mib"] >= 0
        assert cluster.data_parallel_us_per_mib == result["data_parallel_us_per_mib"]
        assert 0 < result["waiting_load"] < 1  # a waiting rank's polite wait: some CPU, far from a core's worth
        assert cluster.waiting_load == result["waiting_load"]


def test_the_contention_windows_barrier_holds_every_rank_until_the_last_arrives_and_sleeps_meanwhile():
    import resource
    import time

    from mpi4py import MPI

    from hybridpipe.plan.calibrate import sleeping_barrier

    comm = MPI.COMM_WORLD.Dup()
    rank = comm.rank
    try:
        comm.Barrier()
        if rank == 1:
            time.sleep(0.3)  # arrives last
        cpu = resource.getrusage(resource.RUSAGE_THREAD)
        entered = time.monotonic()  # one clock for every process of this host
        sleeping_barrier(comm)
        left = time.monotonic()
        after = resource.getrusage(resource.RUSAGE_THREAD)
        times = comm.allgather((entered, left))
    finally:
        comm.Free()
    with ranks_agree():
        assert left >= max(arrived for arrived, _ in times)  # held until the last rank arrived
        if rank == 0:
            waited = left - entered
            assert waited > 0.1
            # and slept meanwhile: MPI's own barrier would have spun for the whole wait
            assert (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime) < 0.5 * waited


def _marker_pass(folder, rank: int, others: list[int]) -> Callable[[], None]:
    """A pass of 4 ms alone that takes 16 ms while another rank's pass runs (it sees the other's marker file): a
    contention of 4 the measurement must find, whatever the cores do with a sleep."""
    import time

    def run() -> None:
        mine = folder / f"busy-{rank}"
        mine.touch()
        time.sleep(0.004)
        if any((folder / f"busy-{other}").exists() for other in others):
            time.sleep(0.012)
        mine.unlink()

    return run


@pytest.mark.parametrize("passes", ["every rank", "rank 0 only"])
def test_model_contention_is_the_slowest_ranks_pass_together_over_its_pass_alone(tmp_path_factory, passes):
    from hybridpipe import runtime
    from hybridpipe.plan.calibrate import host_cores, model_contention

    comm = hp.grid().world_comm
    folder = tmp_path_factory.getbasetemp().parent / "model-contention"  # one folder for both ranks of this host
    folder.mkdir(exist_ok=True)
    comm.Barrier()
    rank = comm.Get_rank()
    others = [r for r in range(comm.Get_size()) if r != rank]
    run = _marker_pass(folder, rank, others) if passes == "every rank" or rank == 0 else None
    value, pairs = model_contention(comm, run, seconds=1.0)
    every = comm.allgather((value, pairs))
    sharing = max(1.0, runtime.local_size() / host_cores())
    with ranks_agree(what=passes):
        assert len(set(every)) == 1  # one value on every rank: one plan everywhere
        if passes == "every rank":
            assert pairs >= 2 * comm.Get_size()  # every rank alone twice at least
            assert 2.5 <= value * sharing <= 4.6, value  # 16 ms together over 4 alone
        else:
            assert pairs >= 2
            assert value < 1.4, value  # nobody else computes: rank 0 as fast as alone


def _resuming_pass(extra: float) -> Callable[[], None]:
    """A pass of 3 ms that takes ``extra`` seconds more when it starts more than 1 ms after the last one ended (as
    after a wait for another rank): a cost of resuming the measurement must find, whatever the cores do."""
    import time

    last = [0.0]

    def run() -> None:
        time.sleep(0.003 + (extra if time.perf_counter() - last[0] > 0.001 else 0.0))
        last[0] = time.perf_counter()

    return run


@pytest.mark.parametrize("extra_ms", [0.0, 4.0])
def test_model_resume_is_a_pass_after_a_wait_less_a_pass_back_to_back(extra_ms):
    from hybridpipe.plan.calibrate import model_resume

    comm = hp.grid().world_comm
    value, rounds = model_resume(comm, _resuming_pass(extra_ms / 1e3), seconds=0.3)
    every = comm.allgather((value, rounds))
    with ranks_agree(what=f"{extra_ms} ms"):
        assert len(set(every)) == 1  # one value on every rank: one plan everywhere
        assert rounds >= 3
        assert extra_ms * 1e3 - 600 <= value <= extra_ms * 1e3 + 1500, value  # microseconds
    alone, none = model_resume(comm, _resuming_pass(0.004) if comm.Get_rank() == 0 else None, seconds=0.3)
    with ranks_agree(what="one rank with a pass"):
        assert (alone, none) == (0.0, 0)  # nobody to wait for: nothing measured


def test_measured_contention_puts_the_model_back_and_a_failing_pass_keeps_the_clusters_value():
    from hybridpipe.plan.auto import measured_contention, one_pass

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    before = holding(module)
    inputs, targets = torch.randn(16, 8), torch.randint(0, 4, (16,))
    run = one_pass(module, inputs, nn.CrossEntropyLoss(), targets, layered=False)
    comm = hp.grid().world_comm
    value = measured_contention(comm, [module], run)

    def failing() -> None:
        if comm.Get_rank() == 1:
            raise RuntimeError("out of memory, for the test")
        run()

    failed = measured_contention(comm, [module], failing)
    with ranks_agree():
        assert value is not None and value >= 1.0
        assert failed is None  # on every rank, and no rank left waiting
        assert_as_held(module, before)  # batch norm's statistics, the weights and the gradients as they were


def test_auto_plans_on_the_contention_it_measured_on_the_model(monkeypatch, capfd):
    """With verify (the default), the cluster the search plans on has the ranks' contention measured on the model
    (the same on every rank), and rank 0 prints it beside the cluster's own."""
    import re

    from hybridpipe import runtime
    from hybridpipe.plan.calibrate import host_cores

    seen = _clusters_searched(monkeypatch)
    sample = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    model, _ = auto(layers(), nn.CrossEntropyLoss(), sample, global_batch=8, verify_plans=1,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    shared = runtime.local_size() > host_cores()
    try:
        printed = capfd.readouterr().out
        every = hp.grid().world_comm.allgather(seen[0].compute_contention)
        resumes = hp.grid().world_comm.allgather(seen[0].resume_us)
        with ranks_agree():
            assert len(set(resumes)) == 1 and resumes[0] >= 0.0  # measured on the model, planned on everywhere
            if hp.rank() == 0:
                found = re.search(r"hp.auto measured a pass right after a wait on the model in [0-9.]+ s: "
                                  r"\+ ([0-9]+) µs", printed)
                assert found, printed
                assert float(found.group(1)) == pytest.approx(resumes[0], abs=0.5)
            assert len(set(every)) == 1 and every[0] >= 1.0
            assert seen[0].memory_contention == 0.0  # the defaults' 0 stays 0 (no streaming term)
            if shared:  # ranks outnumber cores: the cluster's value (the default 1) is planned on, and said
                assert every[0] == 1.0
                assert hp.rank() != 0 or "a host's ranks outnumber its cores" in printed, printed
            elif hp.rank() == 0:
                found = re.search(r"hp.auto measured the ranks computing at once on the model in [0-9.]+ s: "
                                  r"x ([0-9.]+) \(the cluster's own: x 1\)", printed)
                assert found, printed
                assert float(found.group(1)) == pytest.approx(every[0], rel=5e-3)
    finally:
        model.close()


class _MallocInfo(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use() -> Callable[[], int]:
    """Bytes the process has malloc'ed and not freed (heap and mmapped blocks): the tensors alive on the
    CPU, without the resident pages of MPI's shared memory or of freed heap."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallocInfo
    except (OSError, AttributeError):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return in_use


class _Wide(nn.Module):
    """Linear + Tanh, wide enough that its weights and activations dwarf everything else."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_memory_estimates_are_within_20_percent_of_measured_peaks(schedule):
    """Each stage's peak of bytes in use over two Adam steps (sampled every half millisecond, from before
    the model is built) against the planner's estimate: parameters, gradients, Adam's moments, and the
    larger of the activations the schedule holds and the optimizer step's temporaries."""
    from hybridpipe.plan import Candidate, Cluster, predict, profile

    in_use = _malloc_in_use()
    width, batch, micro_batches = 1024, 1024, 8
    adam = lambda params: torch.optim.Adam(params, lr=1e-4)  # noqa: E731
    hp.shutdown()
    hp.init(pipeline_stages=2)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch, width, generator=generator)
    targets = torch.randn(batch, width, generator=generator)
    measured_profile = profile([_Wide(width) for _ in range(4)], inputs[:batch // micro_batches], nn.MSELoss(),
                               targets[:batch // micro_batches], repeats=1, warmup=0, optimizer=adam)
    predicted = predict(measured_profile, Cluster(ranks=2), Candidate(2, 1, (2, 2), micro_batches, schedule),
                        batch).memory_bytes_per_rank[hp.grid().stage]
    def build() -> hp.PipelineModel:
        return hp.PipelineModel([hp.LayerSpec(_Wide, width) for _ in range(4)], nn.MSELoss(),
                                micro_batches=micro_batches, balance=[2, 2], schedule=schedule, seed_layers=0)

    warm = build()  # the runtime's own buffers (MPI's free lists grow with the first messages) come first
    warm.train_step(inputs, targets)
    warm.close()
    del warm
    gc.collect()
    peak, sampling = [0], threading.Event()

    def sample() -> None:
        while not sampling.wait(0.0005):
            peak[0] = max(peak[0], in_use())

    before = in_use()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = build()
    try:
        optimizer = adam(list(model.parameters()))
        for _ in range(3):
            optimizer.zero_grad(set_to_none=False)
            model.train_step(inputs, targets)
            optimizer.step()
        sampling.set()
        sampler.join()
        measured = max(peak[0], in_use()) - before
    finally:
        sampling.set()
        model.close()
        hp.shutdown()
        hp.init()
    with ranks_agree():
        assert abs(predicted - measured) <= 0.2 * measured, (
            f"stage {hp.rank()}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")


BUILT: list[int] = []


class _Counted(nn.Linear):
    """A Linear that records its construction (which rank built which layer)."""

    def __init__(self, index: int, width: int) -> None:
        super().__init__(width, width)
        BUILT.append(index)


def test_auto_profiles_a_layer_list_a_slice_per_rank_without_building_it_whole():
    """hp.auto's profile of LayerSpecs: each rank builds only its slice (6 layers, 2 ranks: 3 each), and the
    merged profile describes every layer as one process's profile does (sizes exactly; times measured)."""
    from hybridpipe.errors import PartitionError
    from hybridpipe.plan.auto import profile_in_turns
    from hybridpipe.plan.profile import Profile, profile

    width = 12
    specs = [hp.LayerSpec(_Counted, i, width) for i in range(6)]
    sample = (torch.randn(4, width), torch.randn(4, width))
    BUILT.clear()
    measured = profile_in_turns(specs, sample, nn.MSELoss(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                                hp.grid().world_comm)
    rank = hp.rank()
    with ranks_agree(what="the slices"):  # (the others wait there for rank 0's profile)
        assert BUILT == ([0, 1, 2] if rank == 0 else [3, 4, 5]), BUILT
        merged = Profile.from_json(measured)  # on every rank
        whole = profile([_Counted(i, width) for i in range(6)], sample[0], nn.MSELoss(), sample[1])
        assert [layer.name for layer in merged.layers] == [layer.name for layer in whole.layers]
        assert [(layer.parameter_bytes, layer.output_bytes) for layer in merged.layers] == \
            [(layer.parameter_bytes, layer.output_bytes) for layer in whole.layers]
        assert merged.loss_ms > 0 and all(layer.forward_ms > 0 for layer in merged.layers)
    # a slice that fails to build fails every rank with its own exception's type, naming the layers and the rank
    bad = specs[:3] + [hp.LayerSpec(nn.Linear, width + 1, width)] + specs[4:]
    try:
        profile_in_turns(bad, sample, nn.MSELoss(), None, hp.grid().world_comm)
        failed = None
    except Exception as error:  # noqa: BLE001 - the test looks at it
        failed = error
    with ranks_agree(what="a slice that fails to build"):
        assert type(failed) is PartitionError and "mat1 and mat2" in str(failed), repr(failed)
        assert "hp.auto: profiling layers 3-5 (profiled on world rank 1)" in failed.__notes__, failed.__notes__


class Sleepy(nn.Module):
    """Sleeps 3 ms per call, whatever the micro-batch: a pipeline of many micro-batches pays it per micro-batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.003)
        return x


@pytest.mark.parametrize("budget", [60.0, 0.0])
def test_verify_keeps_the_fastest_measured_plan_not_a_planted_prediction(monkeypatch, capfd, budget):
    """A planted cost-model error: the 2-stage GPipe plan with 8 micro-batches is predicted 1000x faster than the
    model says, so the search ranks it first. It pays Sleepy's 3 ms on 8 micro-batches a step where data
    parallelism pays it once: measured, it is not kept. With no time budget only the first plan is measured (and
    kept): the others are reported unmeasured."""
    from hybridpipe.plan import search, verify

    real, real_bound = search.predict, search.step_lower_bound

    def planted_on(candidate) -> bool:
        return candidate.stages == 2 and candidate.micro_batches == 8 and candidate.schedule == "gpipe"

    def planted(profile, cluster, candidate, *args, **kwargs):
        prediction = real(profile, cluster, candidate, *args, **kwargs)
        if planted_on(candidate):
            prediction.step_seconds /= 1000
        return prediction

    monkeypatch.setattr(search, "predict", planted)
    monkeypatch.setattr(search, "step_lower_bound", lambda profile, cluster, candidate, *args: (
        0.0 if planted_on(candidate) else real_bound(profile, cluster, candidate, *args)))
    passes: list[tuple[str, list[float]]] = []  # every trial: (its plan, its timed steps)
    real_trial = verify._trial

    def recorded(plan, *args):
        passes.append((plan.describe(), real_trial(plan, *args)))
        return passes[-1][1]

    monkeypatch.setattr(verify, "_trial", recorded)
    torch.manual_seed(0)
    model_layers = [Sleepy(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    sample = (torch.randn(1, 8), torch.randint(0, 4, (1,)))
    model, opt = auto(model_layers, nn.CrossEntropyLoss(), sample, global_batch=8, verify_seconds=budget,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    try:
        rows = model.plan.verification
        printed = capfd.readouterr().out
        first = {}
        for described, times in passes:
            first.setdefault(described, times)
        again = {i for i, row in enumerate(rows) if [d for d, _ in passes].count(row["plan"]) == 2}
        expected = rechecked([dict(row, measured_seconds=statistics.median(first[row["plan"]]) if row["plan"] in first
                                   else None) for row in rows])
        with ranks_agree(what="verified"):
            assert "2 stages × 1 replicas, gpipe, M=8" in rows[0]["plan"]  # the planted plan, predicted best
            assert len(rows) == 3 and len({row["plan"] for row in rows}) == 3  # verify_plans=3, distinct
            assert any(row["plan"].startswith("1 stages") for row in rows)  # a plan on the other grid
            assert [row["kept"] for row in rows].count(True) == 1
            kept = next(row for row in rows if row["kept"])
            assert model.plan.measured_seconds == kept["measured_seconds"]
            assert model.plan.predicted_seconds == model.plan.step_seconds == kept["predicted_seconds"]
            assert model.plan.lower_bound_seconds > 0
            if budget:
                assert not rows[0]["kept"] and (model.plan.stages, model.plan.replicas) == (1, 2)
                assert rows[0]["measured_seconds"] >= 8 * 0.003 > kept["measured_seconds"]
                # a runner-up measured within RECHECK_MARGIN of the fastest: both measured twice as long
                assert again == set(expected) and len(passes) == 3 + len(expected)
                assert all(row["steps"] == (10 if i in again else 5) for i, row in enumerate(rows))
            else:
                assert rows[0]["kept"]
                assert all(row["measured_seconds"] is None and row["steps"] == 0 for row in rows[1:])
            if hp.rank() == 0:
                assert "hp.auto measured" in printed and ("not measured" in printed) == (not budget)
        # training goes on measuring: this rank's median step, start to start, after 2 warm-up steps
        inputs = sample[0].repeat(8 // model.plan.replicas, 1)
        targets = sample[1].repeat(8 // model.plan.replicas)
        verified = model.plan.measured_seconds
        for _ in range(6):
            opt.zero_grad()
            model.train_step(inputs, targets)
            opt.step()
        with ranks_agree(what="measured in training"):
            assert model.plan.measured_seconds != verified  # 3 training steps measured
            assert model.plan.measured_seconds >= 0.003  # Sleepy's sleep at least once a step
    finally:
        model.close()


def _clusters_searched(monkeypatch) -> list:
    """The clusters hp.auto's search is called with, in order (the search itself runs as before)."""
    from hybridpipe.plan import auto as auto_module

    seen = []
    real = auto_module.search

    def recording(profile, cluster, *args, **kwargs):
        seen.append(cluster)
        return real(profile, cluster, *args, **kwargs)

    monkeypatch.setattr(auto_module, "search", recording)
    return seen


def test_auto_calibrate_plans_on_the_links_it_measured_in_the_job(monkeypatch, capfd):
    """hp.auto(calibrate=True) without a cluster: calibrate's measurements, made in the job (every rank gets rank
    0's), are the cluster the search plans on, and rank 0 says how long they took."""
    from hybridpipe.plan import calibrate as calibration

    monkeypatch.setattr(calibration, "CONTENTION_WINDOWS", 16)  # the values, not their accuracy
    seen = _clusters_searched(monkeypatch)
    sample = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    model, _ = auto(layers(), nn.CrossEntropyLoss(), sample, global_batch=8, verify=False, calibrate=True,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    try:
        printed = capfd.readouterr().out
        with ranks_agree(what="calibrated"):
            (cluster,) = seen
            assert cluster.ranks == hp.size() and cluster.action_overhead_us > 0 and cluster.compute_contention >= 1
            assert cluster.data_parallel_us_per_mib > 0 and cluster.waiting_load > 0
            every = hp.grid().world_comm.allgather((cluster.action_overhead_us, cluster.compute_contention))
            assert len(set(every)) == 1  # rank 0's measurements on every rank: the same plan everywhere
            if hp.rank() == 0:
                assert f"hp.auto calibrated the job's {hp.size()} ranks in " in printed, printed
    finally:
        model.close()


def test_verify_skips_a_plan_the_runtime_refuses_and_keeps_a_measured_one(monkeypatch, capfd):
    """A plan whose model cannot be built (here every 2-stage plan refused, as the runtime refuses tied weights on
    stages with their own replica counts) is reported 'not built' with its error on every rank, and a plan that
    was measured is kept."""
    from hybridpipe.errors import HybridPipeError
    from hybridpipe.plan import auto as auto_module

    real = auto_module._built

    def refusing(layers_, loss_fn, optimizer, plan, arguments):
        if plan.stages == 2:
            raise HybridPipeError("refused for the test")
        return real(layers_, loss_fn, optimizer, plan, arguments)

    monkeypatch.setattr(auto_module, "_built", refusing)
    monkeypatch.setattr(auto_module, "search", lambda *args, **kwargs: auto_module.plans(*args, count=3, **kwargs)[
        [p.stages for p in auto_module.plans(*args, count=3, **kwargs)].index(2)])  # the refused plan first
    sample = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    model, _ = auto(layers(), nn.CrossEntropyLoss(), sample, global_batch=8, verify_seconds=0.0,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    try:
        rows = model.plan.verification
        printed = capfd.readouterr().out
        with ranks_agree(what="refused plan skipped"):
            assert rows[0]["error"] == "refused for the test" and rows[0]["measured_seconds"] is None
            assert model.plan.stages == 1 and model.plan.measured_seconds > 0
            assert sum(row["kept"] for row in rows) == 1
            if hp.rank() == 0:
                assert "not built (refused for the test)" in printed, printed
    finally:
        model.close()


@pytest.mark.parametrize("runner_up", [[10.5, 9.0], [20.0]])
def test_verify_measures_a_close_runner_up_again_and_keeps_the_faster_over_both_passes(monkeypatch, runner_up):
    """Scripted trials (ms per timed step, one entry per pass): the first pass puts the runner-up 5 % behind, within
    RECHECK_MARGIN, so both run again, runner-up first, and the median over both passes decides (here the runner-up,
    which one noisy pass would have lost). A runner-up 2x behind is not measured again."""
    from hybridpipe.plan import verify
    from hybridpipe.plan.cost import Cluster
    from hybridpipe.plan.models import model_profile
    from hybridpipe.plan.search import plans

    candidates = plans(model_profile("vgg16", "v100"), Cluster(ranks=2), 64, count=3)
    script = {candidates[0].describe(): [10.0, 12.0], candidates[1].describe(): runner_up,
              candidates[2].describe(): [30.0]}
    order = []

    def scripted(plan, build, sample, steps, started, budget):
        order.append(plan.describe())
        return [script[plan.describe()][order.count(plan.describe()) - 1] / 1e3] * steps

    monkeypatch.setattr(verify, "_trial", scripted)
    kept, _ = verify.measure_plans(candidates, lambda plan: None, (torch.zeros(1), torch.zeros(1)), 5, 60.0)
    rows = kept.verification
    names = [p.describe() for p in candidates]
    with ranks_agree(what="re-measured"):
        if len(runner_up) == 2:
            assert order == names + [names[1], names[0]]
            assert kept is candidates[1] and [row["steps"] for row in rows] == [10, 10, 5]
            assert rows[0]["measured_seconds"] == pytest.approx(0.011) and kept.measured_seconds == pytest.approx(
                0.00975)
        else:
            assert order == names and kept is candidates[0] and [row["steps"] for row in rows] == [5, 5, 5]
            assert kept.measured_seconds == pytest.approx(0.010)
        assert [row["kept"] for row in rows].count(True) == 1


def test_rechecked_names_the_runner_up_then_the_fastest_only_when_close():
    def rows(*seconds):
        return [{"measured_seconds": s} for s in seconds]

    assert rechecked(rows(0.010, 0.0105, 0.03)) == [1, 0]
    assert rechecked(rows(0.03, 0.0105, 0.010)) == [1, 2]
    assert rechecked(rows(0.010, 0.0111, None)) == []  # 11 % behind: past RECHECK_MARGIN
    assert rechecked(rows(0.010, None, None)) == [] and rechecked(rows(None, None)) == []

"""The executor's profile (HYBRIDPIPE_PROFILE_EXECUTOR / model.profile_executor()) under a real mpirun: on two
stages of layers that sleep a known time, every action is counted, the chunk's compute holds the sleeps, the
first stage's forwards post sends and the second's wait for them (and send the gradients back), and the parts add up to the action's time.
The layers also burn a known amount of the thread's CPU time: the profile's CPU columns hold it and not the
sleeps, and no part's CPU exceeds its wall time."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.config import Config
from hybridpipe.pipeline.executor_profile import ExecutorProfile

pytestmark = pytest.mark.mpi(ranks=[2], timeout=120, shared=True)

torch.set_num_threads(1)
SLEEP_S, CPU_S, MICRO, STEPS = 0.004, 0.001, 4, 2


class Sleepy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        began = time.thread_time()
        while time.thread_time() - began < CPU_S:  # CPU time, not wall time: a descheduled spin burns on
            pass
        return self.linear(x)


def batches():
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(STEPS)]


def test_the_profile_counts_every_action_and_names_where_its_time_went():
    hp.shutdown()
    hp.init(pipeline_stages=2, config=Config(profile_executor=True))
    torch.manual_seed(0)
    model = hp.PipelineModel([Sleepy(), Sleepy()], loss_fn=nn.MSELoss(), micro_batches=MICRO)
    try:
        profile = model.executor_profile
        for inputs, targets in batches():
            model.train_step(inputs, targets)
        with ranks_agree():
            assert isinstance(profile, ExecutorProfile) and profile.steps == STEPS
            forward, backward = profile.kinds["F"], profile.kinds["B"]
            assert forward.count == backward.count == MICRO * STEPS and set(profile.kinds) == {"F", "B"}
            assert forward.compute >= MICRO * STEPS * SLEEP_S  # the sleeps are the chunk's compute
            for cost in (forward, backward):
                assert cost.seconds >= cost.wait + cost.send + cost.compute - 1e-6 and cost.python >= 0
            if model.stage == 0:  # it sends activations and waits for none; its backwards send nothing
                assert forward.send > 0 and forward.wait == 0 and backward.send == 0
            else:  # it waits for activations and sends none; its backwards send the gradients back
                assert forward.wait > 0 and forward.send == 0 and backward.send > 0
            assert profile.progress > 0 and profile.tail > 0
            # the thread's CPU: the spins are in the forward's compute, the sleeps are not; nothing beats its wall
            assert MICRO * STEPS * CPU_S <= forward.compute_cpu <= forward.compute - MICRO * STEPS * SLEEP_S / 2
            for cost in (forward, backward):
                for part in ("wait", "send", "compute"):
                    assert 0 <= getattr(cost, part + "_cpu") <= getattr(cost, part) + 1e-4, (part, cost)
            assert 0 < profile.cores("compute") <= 1.01 and 0 <= profile.cores("wait") <= 1.01
            text = str(profile)
            assert f"executor profile over {STEPS} steps" in text and "python" in text
            assert f"cores while waiting {profile.cores('wait'):.2f}" in text and "compute cpu" in text
            rows = {row["kind"]: row for row in profile.rows()}
            assert rows["F"]["actions_per_step"] == MICRO
            assert rows["F"]["ms_per_action"] == pytest.approx(forward.seconds * 1e3 / forward.count)
            assert rows["F"]["compute_cpu_ms"] == pytest.approx(forward.compute_cpu * 1e3 / forward.count)
        fresh = model.profile_executor()
        model.train_step(*batches()[0])
        with ranks_agree(what="reset and off"):
            assert fresh is not profile and fresh.steps == 1 and fresh.kinds["F"].count == MICRO
            assert model.profile_executor(False) is None and model.executor_profile is None
    finally:
        model.close()
        hp.shutdown()


def test_the_profile_is_off_unless_asked():
    hp.shutdown()
    hp.init(pipeline_stages=2)
    model = hp.PipelineModel([Sleepy(), Sleepy()], loss_fn=nn.MSELoss(), micro_batches=MICRO)
    try:
        model.train_step(*batches()[0])
        with ranks_agree():
            assert model.executor_profile is None
            assert Config.from_env({"HYBRIDPIPE_PROFILE_EXECUTOR": "1"}).profile_executor
    finally:
        model.close()
        hp.shutdown()

"""HYBRIDPIPE_AUTOTUNE under a real mpirun: the coordinate search runs its 11 trials, every rank ends on the
same (fusion threshold, cycle time) — the fastest trial's — the log holds every trial, and training
during the search still equals one process (changing the threshold never mixes buckets across ranks)."""

from __future__ import annotations

import csv

import pytest
import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe.comm import autotune, context
from hybridpipe.config import Config

pytestmark = pytest.mark.mpi(ranks=[2], timeout=180, shared=True)

torch.set_num_threads(1)


def test_autotune_agrees_on_the_fastest_setting_and_training_stays_exact(tmp_path_factory):
    log = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("tune") / "autotune.csv") if MPI.COMM_WORLD.rank == 0
                               else None)
    hp.shutdown()
    hp.init(config=Config(autotune=True, autotune_log=log, autotune_warmup_samples=1,
                          autotune_steps_per_sample=2))
    try:
        trials = len(autotune.FUSION_THRESHOLDS) + len(autotune.CYCLE_TIMES_MS) - 1
        steps = 1 + 1 + 2 + (trials - 1) * 3 + 2  # first step, warm-up, trials (+1 unmeasured step each), after
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
        reference = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
        reference.load_state_dict(model.state_dict())
        optimizer = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                            named_parameters=model.named_parameters())
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randn(2 * 8, 8, generator=generator), torch.randn(2 * 8, 4, generator=generator)
            mine = slice(hp.rank() * 8, (hp.rank() + 1) * 8)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            optimizer.step()
            reference_optimizer.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            reference_optimizer.step()
        tuner = context.current("test").slot_or_none(autotune.Autotuner)
        in_effect = context.current("test").engine.tuning()
        everyone = hp.allgather_object((tuner.done, tuner.chosen, tuple(in_effect), len(tuner.trials)))
    finally:
        hp.shutdown()
    with ranks_agree():  # (the others wait there for rank 0's checks of the log)
        assert len(set(everyone)) == 1, everyone  # the same choice, in effect, on every rank
        done, chosen, in_effect, count = everyone[0]
        assert done and count == trials and in_effect == chosen
        fastest = min(tuner.trials, key=lambda t: t["step_seconds"])
        assert chosen == (fastest["fusion_threshold_bytes"], fastest["cycle_time_ms"])
        assert {t["fusion_threshold_bytes"] for t in tuner.trials if t["phase"] == "fusion"} == \
            set(autotune.FUSION_THRESHOLDS)
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(parameter, dict(reference.named_parameters())[name], rtol=1e-5, atol=1e-6)
        if MPI.COMM_WORLD.rank == 0:
            with open(log, newline="") as stream:
                rows = list(csv.DictReader(stream))
            assert list(rows[0]) == autotune.COLUMNS
            assert len(rows) == trials + 1 and rows[-1]["trial"] == "chosen"
            assert int(rows[-1]["fusion_threshold_bytes"]) == chosen[0]
            assert float(rows[-1]["cycle_time_ms"]) == chosen[1]


@ranks_agree()
def test_autotune_settings_are_checked():
    with pytest.raises(hp.errors.HybridPipeError, match="autotune_steps_per_sample=0 must be >= 1"):
        Config(autotune_steps_per_sample=0).validated()
    assert Config.from_env({"HYBRIDPIPE_AUTOTUNE": "1", "HYBRIDPIPE_AUTOTUNE_LOG": "/tmp/x.csv"}).autotune_log == \
        "/tmp/x.csv"

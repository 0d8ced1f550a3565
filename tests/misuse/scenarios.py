"""The MPI half of tests/misuse/test_misuse.py: runs the named cases one after the other in this launch, each
between its own hp.init and hp.shutdown, and prints one line per case and rank:
``MISUSE {"case": ..., "rank": ..., "error": type or null, "message": ..., "seconds": ..., "stderr": ...}``
(``seconds``: from the start of the mistake to the error, or to the end of this rank's part; ``stderr``: what
hybridpipe wrote there meanwhile, e.g. stall warnings).

Launched as ``hybridpipe-run -np 2 --stages 2 python tests/misuse/scenarios.py CASE ...``."""

from __future__ import annotations

import io
import json
import sys
import time
import warnings

import torch
from torch import nn

import hybridpipe as hp


def small_pipeline() -> hp.PipelineModel:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return hp.PipelineModel(layers, loss_fn=nn.CrossEntropyLoss(), micro_batches=4, balance="uniform")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def stages_overridden() -> None:
    """hybridpipe-run --stages 2, but the script asks hp.init for 1 stage."""
    hp.init(pipeline_stages=1)


def stage_shut_down_mid_step() -> None:
    """The last stage goes on to hp.shutdown() while the others call train_step."""
    hp.init()
    model = small_pipeline()
    model.train_step(*batch())
    if hp.grid().is_last_stage:
        hp.shutdown()
        return
    model.train_step(*batch())


def stage_silent_past_timeout() -> None:
    """The last stage makes no train_step call for 2 s; stage 0 warns after stall_check_seconds (0.5 s) and raises
    past its timeout (1.5 s)."""
    hp.init(config=hp.Config(stall_check_seconds=0.5, timeout_seconds=1.5))
    model = small_pipeline()
    model.train_step(*batch())
    if hp.grid().is_last_stage:
        time.sleep(2.0)
        return
    model.train_step(*batch())


CASES = {case.__name__: case for case in (stages_overridden, stage_shut_down_mid_step, stage_silent_past_timeout)}


def run(name: str) -> dict:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.rank
    captured = io.StringIO()
    stderr, sys.stderr = sys.stderr, captured
    error: BaseException | None = None
    started = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            CASES[name]()
    except Exception as failure:  # the mistake's error is the outcome
        error = failure
    finally:
        seconds = time.monotonic() - started
        sys.stderr = stderr
    hp.shutdown()
    text = captured.getvalue() + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
    return {"case": name, "rank": rank, "error": type(error).__name__ if error else None,
            "message": str(error) if error else "", "seconds": round(seconds, 2), "stderr": text}


if __name__ == "__main__":
    for case in sys.argv[1:]:
        print("MISUSE " + json.dumps(run(case)), flush=True)

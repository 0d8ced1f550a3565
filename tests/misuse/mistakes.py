"""The table of user mistakes: what each one looks like (symptom), why it happens (cause), what to do (fix),
and what hybridpipe must do about it on every rank (the error type and a pattern of its message, the time).

tests/misuse/test_misuse.py makes every mistake and checks the outcome; docs/troubleshooting.md is generated
from this table (``python tests/misuse/mistakes.py --write``; a test checks that the page is up to date).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"


@dataclass(frozen=True)
class Mistake:
    """One mistake and what must follow it.

    Attributes:
        name: a case of tests/misuse/scenarios.py (``ranks`` > 0) or a function of test_misuse.py (``ranks`` 0).
        topic: the section of docs/troubleshooting.md.
        title: its heading there.
        symptom: what the user sees (Markdown).
        cause: what the user did, and why it goes wrong.
        fix: what to do.
        errors: per rank (0 for a local case), ``(exception type name or None, regex its message must match)``.
        stderr: per rank, a regex what hybridpipe wrote to stderr (and warnings) must match.
        seconds: the most each rank may take, from the start of the case to the error.
        ranks: the launch's ranks (0: runs in the test's own process).
        seen: public reports of the same mistake in other projects.
        before: a case of scenarios.py run first, in a launch of its own that it ends (a rank killed); the
            mistake's case then runs in another launch. Only under ``make test-long`` (HYBRIDPIPE_LONG_TESTS=1).
    """

    name: str
    topic: str
    title: str
    symptom: str
    cause: str
    fix: str
    errors: dict[int, tuple[str | None, str]]
    stderr: dict[int, str] = field(default_factory=dict)
    seconds: float = 30.0
    ranks: int = 0
    seen: tuple[str, ...] = ()
    before: str = ""


LAUNCH, MODEL, DATA, CALLS, NUMBERS, CHECKPOINTS, PLANNER = (
    "Launching and hp.init", "Building the model", "Data and batches", "Calls that differ between ranks",
    "NaN and inf", "Checkpoints", "Profiling and the planner")
TOPICS = (LAUNCH, MODEL, DATA, CALLS, NUMBERS, CHECKPOINTS, PLANNER)

UNEVEN = r"the ranks made different numbers of collective calls.*call hp.join\(\) on a rank that runs out of data"
SHUT_DOWN = r"rank 1 \(stage 1\) has shut down \(hp.shutdown\) while this rank \(rank 0, stage 0\) waits for .*" \
            r"the ranks of a pipeline must make the same train_step / predict calls.*grid.replica"
TIMED_OUT = r"this rank \(rank 0, stage 0\) waited \d+ s for .* from rank 1 \(stage 1\) " \
            r"\(HYBRIDPIPE_TIMEOUT_SECONDS=1.5\): it is stopped, dead, or not making the same train_step.*raise " \
            r"HYBRIDPIPE_TIMEOUT_SECONDS"
SHARD_BY_REPLICA = r"Shard the data by replica, not by rank: DistributedSampler\(dataset, " \
                   r"num_replicas=grid.data_replicas, rank=grid.replica\)"
FORWARDED = r"stage {stage} \(rank {stage} of the pipeline\) raised {error}: "
AGREE = r"every rank must build it with the same layers and settings"


def _everyone(error: str, pattern: str, ranks: int = 2) -> dict[int, tuple[str | None, str]]:
    return {rank: (error, pattern) for rank in range(ranks)}


def _raiser_and_forwarded(stage: int, error: str, pattern: str) -> dict[int, tuple[str | None, str]]:
    """``stage`` raises ``error``; the other stage of the 2-stage pipeline gets it forwarded (RemoteError)."""
    other = 1 - stage
    return {stage: (error, pattern), other: ("RemoteError", FORWARDED.format(stage=stage, error=error) + pattern)}


MISTAKES = [
    # ------------------------------------------------------------------ launching
    Mistake(
        "stages_overridden", LAUNCH, "`hybridpipe-run --stages` is ignored",
        symptom="On rank 0: `UserWarning: hp.init(pipeline_stages=1) overrides HYBRIDPIPE_PIPELINE_STAGES=2 (what "
                "hybridpipe-run --stages 2 sets): the job runs 1 stage(s) × 2 replica(s) ...`",
        cause="The script passes `pipeline_stages=` to `hp.init`, which wins over the launcher's `--stages`.",
        fix="Call `hp.init()` without `pipeline_stages` to follow `--stages`, or launch with the script's value.",
        errors={rank: (None, "") for rank in range(2)},
        stderr={0: r"UserWarning: hp.init\(pipeline_stages=1\) overrides HYBRIDPIPE_PIPELINE_STAGES=2 \(what "
                   r"`hybridpipe-run --stages 2` sets\).*call hp.init\(\) without pipeline_stages"},
        seconds=10, ranks=2),
    Mistake(
        "stages_differ_per_rank", LAUNCH, "Ranks ask `hp.init` for different grids",
        symptom="`GridError: ranks passed different pipeline_stages to hp.init (rank 0: 1, rank 1: 2)` on every rank.",
        cause="`pipeline_stages` comes from something that differs between ranks (a per-host config file, an "
              "environment variable set on some nodes).",
        fix="Pass the same `pipeline_stages` on every rank, or none and launch with `hybridpipe-run --stages P`.",
        errors=_everyone("GridError", r"ranks passed different pipeline_stages to hp.init \(rank 0: 1, rank 1: 2\); "
                                      r"every rank must call hp.init with the same pipeline_stages"),
        seconds=10, ranks=2),
    Mistake(
        "world_not_divisible", LAUNCH, "The ranks do not fill the stages",
        symptom="`GridError: world size 2 is not divisible by pipeline_stages 3 (pass -np 3 or --stages 2)`.",
        cause="Every pipeline needs `pipeline_stages` ranks, so the number of ranks must be a multiple of it.",
        fix="What the message proposes: a multiple of the stages as `-np`, or a divisor of `-np` as the stages.",
        errors=_everyone("GridError", r"world size 2 is not divisible by pipeline_stages 3 \(pass -np 3 or "
                                      r"--stages 2\)"),
        seconds=10, ranks=2),
    Mistake(
        "init_twice_other_grid", LAUNCH, "`hp.init` called again with another grid",
        symptom="`GridError: hybridpipe is already initialized with pipeline_stages=2 on 2 ranks; "
                "hp.init(pipeline_stages=1) asks for another grid (call hp.shutdown() first)`.",
        cause="A second `hp.init` (often from a library or a notebook cell run twice) asks for other stages. "
              "`hp.init` again with the same grid is harmless: it returns the grid.",
        fix="Call `hp.init` once, or `hp.shutdown()` before asking for another grid.",
        errors=_everyone("GridError", r"already initialized with pipeline_stages=2 on 2 ranks; "
                                      r"hp.init\(pipeline_stages=1\) asks for another grid \(call hp.shutdown\(\) "
                                      r"first\)"),
        seconds=10, ranks=2),
    Mistake(
        "bad_env_stages", LAUNCH, "`HYBRIDPIPE_PIPELINE_STAGES` is not a number",
        symptom="`GridError: HYBRIDPIPE_PIPELINE_STAGES='two' is not an integer (set it to the number of pipeline "
                "stages, e.g. 2, or pass hp.init(pipeline_stages=...))`, before MPI is touched.",
        cause="The variable (which `hybridpipe-run --stages` sets) was set by hand to something else.",
        fix="A positive integer, or unset it and pass `hp.init(pipeline_stages=...)`.",
        errors={0: ("GridError", r"HYBRIDPIPE_PIPELINE_STAGES='two' is not an integer \(set it to the number of "
                                 r"pipeline stages, e.g. 2")}),
    Mistake(
        "bad_env_value", LAUNCH, "A `HYBRIDPIPE_*` setting has a value it cannot take",
        symptom="At `hp.init`: `UsageError: HYBRIDPIPE_TIMEOUT_SECONDS='5m' is not a number of seconds >= 0 "
                "(0 turns it off)` (each setting names its variable, the value and what it accepts).",
        cause="A unit or a word where a number is expected (`5m`, `4XB`, `yes please`).",
        fix="The form the message gives: seconds as a number, sizes as `4MiB` / `256KiB` / bytes, switches as 1 or 0.",
        errors={0: ("UsageError", r"HYBRIDPIPE_TIMEOUT_SECONDS='5m' is not a number of seconds >= 0")}),
    Mistake(
        "ranks_not_multiple_of_stages", LAUNCH, "`hybridpipe-run -np` is not a multiple of `--stages`",
        symptom="`hybridpipe-run: error: -np 3 is not a multiple of --stages 2 (the grid is stages × replicas; "
                "e.g. -np 2)`, before anything starts.",
        cause="A grid of P stages × R replicas needs P × R ranks.",
        fix="`-np` a multiple of `--stages` (or leave `-np` out with `-H`/`--hostfile`: it is then the hosts' slots, "
            "rounded down to a multiple of the stages).",
        errors={0: ("SystemExit", "")},
        stderr={0: r"-np 3 is not a multiple of --stages 2 \(the grid is stages × replicas; e\.g\. -np 2\)"}),
    Mistake(
        "hostfile_missing_host", LAUNCH, "A hostfile names a host that does not exist",
        symptom="`hybridpipe-run: error: host 'nosuchhost.invalid' (hosts line 2) does not resolve (...): correct "
                "the name, or remove the host and lower -np` (before: an ssh or daemon failure from mpirun).",
        cause="A typo in the hostfile or `-H`, or a node that left the cluster's DNS.",
        fix="Correct the name, or remove the line (and lower `-np`).",
        errors={0: ("UsageError", r"host 'nosuchhost.invalid' \(\S*hosts line 2\) does not resolve \(.*\): "
                                       r"correct the name, or remove the host and lower -np")},
        seen=("https://github.com/horovod/horovod/issues/951",)),
    Mistake(
        "hostfile_without_slots", LAUNCH, "A hostfile line gives no slot count",
        symptom="`UsageError: hosts line 1 ('node1') gives no slot count: write 'node1 slots=N' (or 'name:N' "
                "for MPICH), or pass -np`.",
        cause="Without slots Open MPI uses each node's core count, which `hybridpipe-run` cannot see, so it cannot "
              "count the ranks or check that pipelines stay on one node.",
        fix="`node1 slots=4` (Open MPI) or `node1:4` (MPICH) on every line, or pass `-np`.",
        errors={0: ("UsageError", r"hosts line 1 \('node1'\) gives no slot count: write 'node1 slots=N'")}),
    # ------------------------------------------------------------------ the model
    Mistake(
        "model_before_init", MODEL, "The model is built before `hp.init`",
        symptom="`NotInitializedError: hp.PipelineModel() was called before hp.init(); call hp.init() first` (the "
                "same for `hp.DistributedOptimizer`, `hp.rank()` and the collectives).",
        cause="`hp.init()` creates the grid that tells each rank which stage it builds.",
        fix="Call `hp.init()` first, at the top of the script.",
        errors={0: ("NotInitializedError", r"hp.PipelineModel\(\) was called before hp.init\(\); call hp.init\(\) "
                                           r"first")}),
    Mistake(
        "zero3_meta_not_materialized", MODEL, "A model built on the meta device runs before `opt.materialize`",
        symptom="`UsageError: DistributedOptimizer(zero=3): 2 parameters were built on the meta device and have no "
                "values yet: call opt.materialize(module) first`, at the first forward.",
        cause="Under `torch.device(\"meta\")` parameters have shapes but no values; `zero=3` keeps them as shards "
              "that `opt.materialize(model)` fills, module by module.",
        fix="Call `opt.materialize(model)` (seeded alike on every rank) after wrapping the optimizer with `zero=3`.",
        errors={0: ("UsageError", r"zero=3\): \d+ parameters were built on the meta device and have no values yet: "
                                  r"call opt.materialize\(module\) first")}),
    Mistake(
        "layer_count_differs", MODEL, "The model differs between ranks",
        symptom="`MismatchError: PipelineModel: ranks disagree on layers, balance (rank 0: layers=4, ...; rank 1: "
                "layers=5, ...); every rank must build it with the same layers and settings`, on every rank.",
        cause="Each rank built its own variant (a config read per host, a code path on `hp.rank()`); each rank "
              "builds only its stage, so they must agree on the whole.",
        fix="Build the same model on every rank.",
        errors=_everyone("MismatchError", r"PipelineModel: ranks disagree on layers, balance \(rank 0: layers=4.*rank "
                                          r"1: layers=5.*" + AGREE),
        seconds=10, ranks=2),
    Mistake(
        "parameter_shapes_differ", MODEL, "Parameters of different shapes on different ranks",
        symptom="`MismatchError: hp.broadcast_: ranks disagree (rank 0: ... shape=(4,) ... name='Parameter.bias'; "
                "rank 1: ... shape=(5,) ...)` on every rank (before: a hang, or silently wrong values).",
        cause="Data parallel ranks built models of different sizes, then `hp.broadcast_parameters` (or the "
              "optimizer's allreduce) sends tensors that do not match.",
        fix="Build the same model on every rank; the message names the first parameter that differs.",
        errors=_everyone("MismatchError", r"hp.broadcast_: ranks disagree \(rank 0: .*shape=\(4,\).*rank 1: "
                                          r".*shape=\(5,\).*every rank must pass the same"),
        seconds=10, ranks=2,
        seen=("https://github.com/horovod/horovod/issues/336", "https://github.com/NVIDIA/nccl/issues/1417")),
    Mistake(
        "micro_batches_differ", MODEL, "`micro_batches` differs between ranks",
        symptom="`MismatchError: PipelineModel: ranks disagree on micro_batches (rank 0: micro_batches=4; rank 1: "
                "micro_batches=2)` on every rank.",
        cause="The stages would run schedules of different lengths and wait for micro-batches never sent.",
        fix="The same `micro_batches` on every rank.",
        errors=_everyone("MismatchError", r"ranks disagree on micro_batches \(rank 0: micro_batches=4; rank 1: "
                                          r"micro_batches=2\); " + AGREE),
        seconds=10, ranks=2),
    Mistake(
        "schedule_differs", MODEL, "The schedule differs between ranks",
        symptom="`MismatchError: PipelineModel: ranks disagree on schedule (rank 0: schedule='gpipe'; rank 1: "
                "schedule='1f1b')` on every rank.",
        cause="The stages would send and wait in different orders.",
        fix="The same `schedule=` on every rank.",
        errors=_everyone("MismatchError", r"ranks disagree on schedule \(rank 0: schedule='gpipe'; rank 1: "
                                          r"schedule='1f1b'\); " + AGREE),
        seconds=10, ranks=2),
    Mistake(
        "unknown_schedule", MODEL, "An unknown schedule name",
        symptom="`ScheduleError: unknown schedule '1f1c' (use one of 'gpipe', '1f1b', ...)`.",
        cause="A misspelt `schedule=`.",
        fix="One of the names the message lists (`\"one_f_one_b\"` and `_` for `-` are accepted too).",
        errors={0: ("ScheduleError", r"unknown schedule '1f1c' \(use one of 'gpipe', '1f1b'")}),
    Mistake(
        "balance_wrong_sum", MODEL, "`balance` does not add up to the layers",
        symptom="`PartitionError: balance [1, 1] sums to 2 but the model has 4 layers (make the counts sum to 4, "
                "e.g. [2, 2])` on every rank.",
        cause="A hand-written balance left over from another model, or a layer added since.",
        fix="Counts that sum to the number of layers, or `balance=\"parameters\"` / `\"time\"` to have them chosen.",
        errors=_everyone("PartitionError", r"balance \[1, 1\] sums to 2 but the model has 4 layers \(make the counts "
                                           r"sum to 4, e\.g\. \[2, 2\]\)"),
        seconds=10, ranks=2),
    Mistake(
        "train_step_without_loss", MODEL, "`train_step` on a model built without a loss",
        symptom="`UsageError: train_step needs a loss: build the PipelineModel with loss_fn=...` on every rank.",
        cause="`hp.PipelineModel(layers)` without `loss_fn=`: the last stage cannot start the backward pass.",
        fix="`hp.PipelineModel(layers, loss_fn=nn.CrossEntropyLoss(), ...)` (a model used only for `predict` "
            "needs none).",
        errors=_everyone("UsageError", r"train_step needs a loss: build the PipelineModel with loss_fn="),
        seconds=10, ranks=2),
    Mistake(
        "model_used_after_shutdown", MODEL, "The model is used after `hp.shutdown()`",
        symptom="`NotInitializedError: PipelineModel.train_step: the hp.init() this model was built under has ended "
                "(hp.shutdown() was called); ...` on every rank (before: a raw `ValueError` from the transport, or a "
                "step run on freed communicators).",
        cause="`hp.shutdown()` frees the communicators the model's stages talk over (a `finally:` around the "
              "wrong loop, or a shutdown before evaluation).",
        fix="Call `hp.shutdown()` after the last `train_step` / `predict`, or build the model again after a new "
            "`hp.init()`.",
        errors=_everyone("NotInitializedError", r"PipelineModel.train_step: the hp.init\(\) this model was built "
                                                r"under has ended.*call hp.shutdown\(\) only after the last "
                                                r"train_step"),
        seconds=10, ranks=2),
    # ------------------------------------------------------------------ data
    Mistake(
        "batches_differ_per_stage", DATA, "The loss stays at chance: the stages were given different batches",
        symptom="Every stage raises at the first `train_step`: `MismatchError: stage 1 was given a different batch "
                "than stage 0 of its pipeline (inputs: same shapes, different values; ...): every stage of a pipeline "
                "must get the same batch ...` (before: the loss stayed at chance, e.g. 2.303 for 10 classes, or the "
                "loss function complained that input and target batch sizes differ).",
        cause="The data was sharded by rank (`DistributedSampler(num_replicas=hp.size(), rank=hp.rank())`, as "
              "Horovod scripts do), so the last stage pairs one batch's activations with another batch's targets.",
        fix="Shard by replica: `DistributedSampler(dataset, num_replicas=grid.data_replicas, rank=grid.replica)`. "
            "The check carries a fingerprint of the batch (shapes, two sampled sums) in the first activation "
            "message of each step, so it adds no message; `HYBRIDPIPE_CHECK_BATCHES=0` or "
            "`model.check_batches = False` turns it off.",
        errors=_raiser_and_forwarded(1, "MismatchError", r"stage 1 was given a different batch than stage 0 of its "
                                                         r"pipeline \(inputs: same shapes, different values.*"
                                                         + SHARD_BY_REPLICA),
        seconds=10, ranks=2),
    Mistake(
        "uneven_batches_per_replica", DATA, "One replica has fewer batches than the others",
        symptom="`PeerShutDownError: hp.allreduce_async_: rank 1 has shut down (hp.shutdown) while this rank "
                "(rank 0) waits for it in a collective on group 'data' (...): the ranks made different numbers of "
                "collective calls ...` on the ranks that had more batches, at once (before: the classic Horovod hang "
                "at the end of an epoch).",
        cause="Each replica reads its own shard and the shards hold different numbers of batches; the rank that "
              "ran out left its loop while the others still wait for its gradients.",
        fix="Give every replica the same number of batches (`DataLoader(..., drop_last=True)`, or a sampler that "
            "pads), or call `hp.join()` on a rank that runs out of data: it then takes part in the others' "
            "allreduces with zeros until every rank has joined.",
        errors={0: ("PeerShutDownError", r"rank 1 has shut down \(hp.shutdown\) while this rank \(rank 0\) waits for "
                                         r"it in a collective on group 'data'.*" + UNEVEN),
                1: (None, "")},
        seconds=20, ranks=2,
        seen=("https://github.com/horovod/horovod/issues/3980", "https://github.com/horovod/horovod/issues/118",
              "https://github.com/NVIDIA-Merlin/NVTabular/issues/1320")),
    Mistake(
        "dataset_shorter_than_batch", DATA, "A batch smaller than `micro_batches`",
        symptom="`UsageError: batch size 3 is smaller than micro_batches 4 (use a batch of at least 4 samples "
                "or micro_batches <= 3; a dataset shorter than one batch, or a short last batch, gives such a batch: "
                "DataLoader(..., drop_last=True))`.",
        cause="The dataset is shorter than one batch, or its last batch is short, and a pipeline splits each batch "
              "into `micro_batches` parts.",
        fix="`DataLoader(..., drop_last=True)`, a batch size that divides the dataset, or fewer micro-batches.",
        errors={0: ("UsageError", r"batch size 3 is smaller than micro_batches 4 .*drop_last=True")}),
    Mistake(
        "empty_batch", DATA, "An empty batch",
        symptom="`UsageError: the batch is empty (0 samples; micro_batches 4): the data loader gave an empty "
                "batch, ...` (before: `... or micro_batches <= 0`).",
        cause="A shard with no samples (more replicas than samples, a filter that removed everything).",
        fix="Check the dataset's length and its sharding over `grid.data_replicas`.",
        errors={0: ("UsageError", r"the batch is empty \(0 samples; micro_batches 4\).*check the dataset's "
                                       r"length")}),
    # ------------------------------------------------------------------ calls
    Mistake(
        "stage_shut_down_mid_step", CALLS, "A rank waits for a stage that has shut down",
        symptom="`hp.PeerShutDownError` within a second on the rank that waited: `rank 1 (stage 1) has shut down "
                "(hp.shutdown) while this rank (rank 0, stage 0) waits for its activation gradient of micro-batch "
                "0: ...`; the ranks of the pipeline that waited for *that* rank get `RemoteError: stage 0 (rank 0 of "
                "the pipeline) raised PeerShutDownError: ...` (before: the job hung for ever, one rank waiting for an "
                "activation gradient, the other in `hp.shutdown()`).",
        cause="The ranks of a pipeline made different numbers of `train_step` / `predict` calls: one left its loop "
              "early and called `hp.shutdown()`, which tells the other stages of its pipeline that it is leaving. "
              "Usually the data: each rank had its own shard and one ran out first.",
        fix="Give every stage of a pipeline the same batches: shard by `grid.replica` over `grid.data_replicas` "
            "(README, \"a first program\"), so that every rank makes the same calls.",
        errors={0: ("PeerShutDownError", SHUT_DOWN), 1: (None, "")}, seconds=10, ranks=2),
    Mistake(
        "stage_silent_past_timeout", CALLS, "A pipeline wait warns, then times out",
        symptom="On stderr after `HYBRIDPIPE_STALL_CHECK_SECONDS` (default 60 s): `hybridpipe WARNING: this rank "
                "(rank 0, stage 0, host node1) has waited 60.0 s for ... from rank 1 (stage 1) ...`, then past "
                "`HYBRIDPIPE_TIMEOUT_SECONDS` (default 300 s) `hp.WaitTimeoutError` naming the same rank.",
        cause="The neighbour stage did not send what this rank waits for: it is stopped or dead, it makes other "
              "calls (fewer `train_step` calls, a collective only some ranks make), or it is only slow (it alone "
              "saves a checkpoint or evaluates).",
        fix="Make every rank of a pipeline make the same calls. If the neighbour is legitimately busy for that "
            "long, raise `HYBRIDPIPE_TIMEOUT_SECONDS` (0 waits for ever).",
        errors={0: ("WaitTimeoutError", TIMED_OUT), 1: (None, "")},
        stderr={0: r"hybridpipe WARNING: this rank \(rank 0, stage 0, host \S+\) has waited 0.\d s for .* from rank 1 "
                   r"\(stage 1\) \(HYBRIDPIPE_STALL_CHECK_SECONDS=0.5\)"},
        seconds=10, ranks=2),
    Mistake(
        "collective_on_some_ranks", CALLS, "A collective called on some ranks only",
        symptom="`PeerShutDownError: hp.allreduce: rank 1 has shut down (hp.shutdown) while this rank (rank 0) waits "
                "for it in a collective on group 'world' (...)` at once; while the other rank is still running, the "
                "stall warning names the ranks that did not submit it (`hybridpipe WARNING: allreduce '...' on "
                "group 'world' has waited 60.0 s: ranks [0] of the group submitted it, ranks [1] did not`) and "
                "`HYBRIDPIPE_STALL_SHUTDOWN_SECONDS` turns that into an error (before: a hang).",
        cause="A collective inside `if hp.rank() == 0:` (a metric, a log, an evaluation on rank 0 only): the other "
              "ranks never make the call.",
        fix="Make the collective on every rank of its group and guard only the printing; evaluate on every rank.",
        errors={0: ("PeerShutDownError", r"hp.allreduce: rank 1 has shut down \(hp.shutdown\) while this rank "
                                         r"\(rank 0\) waits for it in a collective on group 'world'.*" + UNEVEN),
                1: (None, "")},
        seconds=10, ranks=2,
        seen=("https://github.com/huggingface/transformers/pull/1081",
              "https://github.com/horovod/horovod/issues/2640")),
    Mistake(
        "collective_shapes_differ", CALLS, "A collective with different shapes on different ranks",
        symptom="`MismatchError: hp.allreduce: ranks disagree (rank 0: shape=(3,) ...; rank 1: shape=(4,) ...); every "
                "rank must pass the same shape, dtype and op` on every rank.",
        cause="Per-rank tensor sizes (variable-length data, a per-rank vocabulary).",
        fix="Pad to a common shape, or use `hp.allgather`, which takes different first dimensions.",
        errors=_everyone("MismatchError", r"hp.allreduce: ranks disagree \(rank 0: shape=\(3,\).*rank 1: "
                                          r"shape=\(4,\).*every rank must pass the same shape, dtype and op"),
        seconds=10, ranks=2,
        seen=("https://github.com/NVIDIA/nccl/issues/1417",)),
    Mistake(
        "train_step_vs_predict", CALLS, "One stage trains while another evaluates",
        symptom="`MismatchError: stage 1 called predict while stage 0 of its pipeline called train_step (the same "
                "step): every stage of a pipeline must make the same train_step / predict calls in the same order` "
                "on every stage (before: \"a different batch\", which was misleading).",
        cause="Evaluation guarded by a rank or stage test (`if hp.rank() == 0: evaluate()`).",
        fix="Call `predict` (and `train_step`) on every rank of the pipeline; guard only the printing.",
        errors=_raiser_and_forwarded(1, "MismatchError", r"stage 1 called predict while stage 0 of its pipeline called "
                                                         r"train_step .*every stage of a pipeline must make the same "
                                                         r"train_step / predict calls"),
        seconds=10, ranks=2,
        seen=("https://github.com/horovod/horovod/issues/3781",)),
    Mistake(
        "stage_raised_under_python_m", CALLS, "A stage fails with an exception while another waits for it",
        symptom="Under `python -m hybridpipe`, the failing rank prints its traceback, and the stage waiting for it "
                "raises `PeerShutDownError: rank 1 (stage 1) failed with an uncaught exception (its traceback is in "
                "its output) while this rank (rank 0, stage 0) waits for ...: fix the error that rank reports` before "
                "the job is aborted (before: the others were killed without a word).",
        cause="A bug (here a `KeyError`) on one rank only.",
        fix="Fix the error of the rank named; run job scripts as `mpirun ... python -m hybridpipe train.py` (or "
            "`hybridpipe-run ... python -m hybridpipe train.py`) so that one rank's exception ends the job.",
        errors={0: ("PeerShutDownError", r"rank 1 \(stage 1\) failed with an uncaught exception \(its traceback is "
                                         r"in its output\) while this rank \(rank 0, stage 0\) waits for its "
                                         r"activation gradient.*fix the error that rank reports")},
        seconds=10, ranks=2),
    Mistake(
        "stage_raised_in_plain_script", CALLS, "A stage fails with an exception in a plain script",
        symptom="Without `python -m hybridpipe`: the failing rank prints its traceback; at interpreter exit its "
                "`hp.shutdown` tells the stages waiting for it, which raise `PeerShutDownError: rank 1 (stage 1) "
                "failed with an uncaught exception (its traceback is in its output) while this rank (rank 0, stage 0) "
                "waits for ...`, and the job ends with the failing rank's exit code (before: \"has shut down\" and a "
                "fix about uneven data).",
        cause="A bug on one rank only, in a script run as `mpirun ... python train.py`.",
        fix="Fix the error of the rank named. (Python sets `sys.last_value` before the `atexit` hook that runs "
            "`hp.shutdown`; the case calls that hook as the interpreter does, in the shared launch.)",
        errors={0: ("PeerShutDownError", r"rank 1 \(stage 1\) failed with an uncaught exception \(its traceback is "
                                         r"in its output\) while this rank \(rank 0, stage 0\) waits for its "
                                         r"activation gradient.*fix the error that rank reports"),
                1: (None, "")},
        seconds=10, ranks=2),
    Mistake(
        "rank_raised_during_collective", CALLS, "A rank fails with an exception while others wait in a collective",
        symptom="`PeerShutDownError: hp.allreduce: rank 1 failed with an uncaught exception (its traceback is in its "
                "output) while this rank (rank 0) waits for it in a collective on group 'world' (...): fix the error "
                "that rank reports` (under `python -m hybridpipe` before the job is aborted; in a plain script when "
                "the failing rank's `hp.shutdown` runs at exit).",
        cause="A bug on one rank while the others are in `hp.allreduce`, `hp.DistributedOptimizer`'s `step()` or "
              "any other collective.",
        fix="Fix the error of the rank named (its traceback is in its output).",
        errors={0: ("PeerShutDownError", r"hp.allreduce: rank 1 failed with an uncaught exception \(its traceback is "
                                         r"in its output\) while this rank \(rank 0\) waits for it in a collective "
                                         r"on group 'world' \('[^']+'\): fix the error that rank reports")},
        seconds=10, ranks=2),
    Mistake(
        "forgot_zero_grad", CALLS, "Gradients grow from step to step: `zero_grad` is missing",
        symptom="No error: the second `train_step` adds its gradients to the first's (here, on the same batch, "
                "exactly twice as large); the loss then behaves as with a growing learning rate.",
        cause="As in PyTorch, `train_step` accumulates into `.grad` (this is what gradient accumulation relies on).",
        fix="`optimizer.zero_grad()` before each `train_step` (or after each `optimizer.step()`).",
        errors={rank: (None, "") for rank in range(2)}, seconds=10, ranks=2),
    # ------------------------------------------------------------------ NaN and inf
    Mistake(
        "nan_in_inputs", NUMBERS, "NaN in the inputs",
        symptom="With `HYBRIDPIPE_CHECK_FINITE=1`: `NonFiniteError: the batch's inputs hold non-finite values (NaN at "
                "[1, 2] of a (2, 8) float32 tensor; micro-batch 1, seen by stage 0, before any layer): ...` on stage "
                "0, forwarded to the others (without it: a NaN loss, and NaN weights after the next step).",
        cause="A sample with a NaN or inf (a missing value, a division by zero in preprocessing).",
        fix="Clean the data (drop or repair such samples, e.g. `torch.nan_to_num`). The check costs a test per "
            "layer output and is off by default: turn it on to find where NaN comes from.",
        errors=_raiser_and_forwarded(0, "NonFiniteError", r"the batch's inputs hold non-finite values \(NaN at "
                                                          r"\[1, 2\] of a \(2, 8\) float32 tensor; micro-batch 1, "
                                                          r"seen by stage 0, before any layer\): clean the data"),
        seconds=10, ranks=2,
        seen=("https://github.com/deepspeedai/DeepSpeed/issues/324",)),
    Mistake(
        "non_finite_in_a_layer", NUMBERS, "NaN or inf first appears in a layer",
        symptom="With `HYBRIDPIPE_CHECK_FINITE=1`: `NonFiniteError: stage 1: non-finite values first appear in the "
                "output of layer layers.3 (Log): NaN at [0, 0] ... (micro-batch 0; its input was finite): ...` on "
                "the stage that holds the layer, forwarded to the others.",
        cause="A layer overflows or divides by zero (here `log` of negative values); with fp16, also a too large "
              "learning rate or loss scale.",
        fix="Guard the layer (`log(x + eps)`, clamp), lower the learning rate, clip gradients, or use bf16 instead "
            "of fp16.",
        errors=_raiser_and_forwarded(1, "NonFiniteError", r"stage 1: non-finite values first appear in the output of "
                                                          r"layer layers.3 \(Log\): NaN at .*\(micro-batch 0; its "
                                                          r"input was finite\)"),
        seconds=10, ranks=2,
        seen=("https://github.com/NVIDIA-NeMo/Speech/issues/5928",)),
    # ------------------------------------------------------------------ checkpoints
    Mistake(
        "checkpoint_of_another_model", CHECKPOINTS, "Loading a checkpoint of another model",
        symptom="`CheckpointError: loading the checkpoint failed: ... shapes differ (layers.0.weight: (16, 8) saved, "
                "(32, 8) here; ...): it was saved from another model (other sizes); build the model it was saved "
                "from, or load another checkpoint` on every rank.",
        cause="The directory holds a checkpoint of another configuration (another width, another layer count).",
        fix="Build the model the checkpoint was saved from, or point to the right directory.",
        errors=_everyone("CheckpointError", r"shapes differ \(layers.0.weight: \(16, 8\) saved, \(32, 8\) here.*it was "
                                            r"saved from another model"),
        seconds=15, ranks=2),
    Mistake(
        "checkpoint_truncated", CHECKPOINTS, "A checkpoint file is truncated",
        symptom="`CheckpointError: loading the checkpoint failed: .../stage-1.pt is truncated or not a hybridpipe "
                "checkpoint file (...): load an earlier checkpoint (the directory's other step-* checkpoints), or "
                "save this one again` on every rank.",
        cause="A copy that did not finish, or a file cut off by a quota.",
        fix="Load an earlier `step-*` checkpoint of the directory, or save again.",
        errors=_everyone("CheckpointError", r"stage-1.pt is truncated or not a hybridpipe checkpoint file .*load an "
                                            r"earlier checkpoint"),
        seconds=15, ranks=2),
    Mistake(
        "checkpoint_disk_full", CHECKPOINTS, "The disk fills up while saving",
        symptom="`CheckpointError: stage 1 could not write its file: OSError: [Errno 28] No space left on device (the "
                "disk is full: free space or save to another directory); nothing of the earlier checkpoints was "
                "touched (`latest` still names the last complete one)` on every rank; the partial file is removed "
                "and the previous checkpoint still loads.",
        cause="The checkpoint directory's file system is full (or over quota).",
        fix="Free space or save elsewhere; `hp.resume` / `hp.load_checkpoint(directory)` go on from the last complete "
            "checkpoint.",
        errors=_everyone("CheckpointError", r"stage 1 could not write its file: OSError: \[Errno 28\] No space left on "
                                            r"device \(the disk is full: free space or save to another directory\); "
                                            r"nothing of the earlier checkpoints was touched"),
        seconds=15, ranks=2,
        seen=("https://github.com/facebookresearch/metaseq/issues/53",
              "https://github.com/NVIDIA-NeMo/Automodel/pull/3390")),
    Mistake(
        "checkpoint_save_interrupted", CHECKPOINTS, "A rank was killed while saving",
        symptom="`hp.resume` goes on from the previous checkpoint; loading the interrupted one by name raises "
                "`CheckpointError: .../step-00000002 has no manifest.json: the save did not finish (use the previous "
                "checkpoint, or the directory's latest)` on every rank.",
        cause="A checkpoint is complete once rank 0 wrote its manifest and moved `latest` to it; a rank killed "
              "before leaves a directory without a manifest.",
        fix="Resume from the directory (`hp.resume(directory, ...)`), which follows `latest`; delete the incomplete "
            "`step-*` directory when convenient.",
        errors=_everyone("CheckpointError", r"step-00000002 has no manifest.json: the save did not finish \(use the "
                                            r"previous checkpoint"),
        seconds=15, ranks=2),
    Mistake(
        "checkpoint_rank_killed_while_saving", CHECKPOINTS, "A rank is killed while saving (a real kill)",
        symptom="The job ends (the launcher stops the other ranks); the next run's `hp.resume` goes on from the "
                "previous checkpoint, as in the case above, whatever partial files the killed save left.",
        cause="A rank dies (out of memory, a node failure, a pre-emption) in the middle of `hp.save_checkpoint`.",
        fix="Nothing beyond resuming from the directory; the incomplete `step-*` directory can be deleted. "
            "(Tested with a real `os._exit` in `make test-long`.)",
        errors=_everyone("CheckpointError", r"step-00000002 has no manifest.json: the save did not finish"),
        seconds=60, ranks=2, before="kill_rank_1_while_saving"),
    # ------------------------------------------------------------------ planner
    Mistake(
        "inplace_layer_profiled", PLANNER, "In-place layers (`nn.ReLU(inplace=True)`) and profiling",
        symptom="None now (before: `balance=\"time\"`, the planner's profile or `python -m hybridpipe.plan` failed "
                "with `a leaf Variable that requires grad is being used in an in-place operation`).",
        cause="Profiling feeds each layer a leaf that requires grad, which an in-place layer may not modify; a stage "
              "whose first layer works in place had the same problem with its received activation.",
        fix="Nothing to do: each layer is profiled on a copy of its input (made outside the timing), and such a "
            "stage gets a copy of its received activation.",
        errors={0: (None, "")}),
    Mistake(
        "layer_fails_while_profiling", PLANNER, "A layer fails on the profiling sample",
        symptom="`PartitionError: profiling layer 0 (Linear) on the sample failed: RuntimeError: ...: check that the "
                "layers, called in order, accept the sample and each other's outputs`.",
        cause="`balance=\"time\"` runs every layer on `sample_input`; a layer does not accept what it gets.",
        fix="A sample shaped like one micro-batch of the real inputs; layers whose sizes chain.",
        errors={0: ("PartitionError", r"profiling layer 0 \(Linear\) on the sample failed: RuntimeError: .*"
                                      r"check that the layers")}),
    Mistake(
        "plan_cli_user_errors", PLANNER, "`python -m hybridpipe.plan` fails on the model",
        symptom="`hybridpipe.plan: importing 'model.py' failed: ...`, `hybridpipe.plan: model.py:factory() must "
                "return (layers, loss_fn, sample), got tuple of 2`, or `hybridpipe.plan: profiling layer 0 (Linear) "
                "on the sample failed: ...` (exit 2, no traceback).",
        cause="The `MODULE:FACTORY` given does not import, does not return `(layers, loss_fn, sample)` with "
              "`sample(n)` returning `(inputs, targets)`, or its layers do not run on the sample.",
        fix="What the message names; `python -c 'import MODULE'` shows where an import fails.",
        errors={0: (None, "")}),
]

HEADER = """\
# Troubleshooting

<!-- Generated from tests/misuse/mistakes.py (python tests/misuse/mistakes.py --write): edit the table there. -->

Symptom → cause → fix, for the mistakes users make most. Each entry is a case of the table `MISTAKES` in
`tests/misuse/mistakes.py`: `tests/misuse/test_misuse.py` makes the mistake (under a real `mpirun` when it
needs several ranks) and checks on every rank the error type, that its message names the cause and the
fix, and the time it takes; a test checks that this page is what the table gives.

Most of them break one rule: **every rank makes the same hybridpipe calls, with the same arguments, in the
same order** — every stage of a pipeline the same `train_step` / `predict` calls on the same batch, every
rank of a group the same collectives. hybridpipe checks what it can where it costs nothing (the model's
settings when it is built, each collective's shapes in its negotiation, a fingerprint of each batch in the
first activation message of a step) and raises on every rank, naming every rank's values. A rank that
leaves (`hp.shutdown()`, or an exception under `python -m hybridpipe`) tells the ranks that may wait for it,
which then raise `PeerShutDownError` at once; any other wait warns after `HYBRIDPIPE_STALL_CHECK_SECONDS` and
ends in an error after `HYBRIDPIPE_TIMEOUT_SECONDS`.
"""


def _link(url: str) -> str:
    parts = url.rstrip("/").split("/")
    return f"[{parts[3]}/{parts[4]}#{parts[6]}]({url})"


def render(mistakes: list[Mistake] = MISTAKES) -> str:
    """docs/troubleshooting.md for ``mistakes``."""
    out = [HEADER]
    for topic in TOPICS:
        entries = [m for m in mistakes if m.topic == topic]
        if not entries:
            continue
        out.append(f"\n## {topic}\n")
        for mistake in entries:
            out.append(f"\n### {mistake.title}\n\n**Symptom.** {mistake.symptom}\n\n**Cause.** {mistake.cause}\n\n"
                       f"**Fix.** {mistake.fix}\n")
            if mistake.seen:
                out.append(f"\nSeen elsewhere: {', '.join(_link(url) for url in mistake.seen)}.\n")
    return "".join(out)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/misuse/mistakes.py --write   (regenerates docs/troubleshooting.md)")
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(MISTAKES)} mistakes)")

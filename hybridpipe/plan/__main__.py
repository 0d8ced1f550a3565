"""``python -m hybridpipe.plan``: profile a model (or load a profile) and print the best plan for a cluster.

Usage:
    python -m hybridpipe.plan MODULE:FACTORY --sample-batch 32 --global-batch 256 --ranks 8 \\
        [--ranks-per-host 4] [--cores-per-host 0] [--intra-host-gbps 40] [--inter-host-gbps 10] \\
        [--latency-us 20] [--memory-per-rank 16GiB] [--optimizer-state-factor 2] [--asynchronous] \\
        [--zero auto|0|1|2] [--precision fp32|bf16|fp16] [--save-profile profile.json] [--explain]
    python -m hybridpipe.plan --profile profile.json --global-batch 256 --ranks 8 ...
    python -m hybridpipe.plan ... --cluster cluster.json        # links as measured by calibrate
    python -m hybridpipe.plan --model gpt3-1.3b --gpu h100 --ranks 64      # a built-in model, from its FLOPs
    python -m hybridpipe.plan --simulate --model gpt3-1.3b --gpu h100 --gpus-per-host 8 \\
        --intra-host-gbps 900*8 --inter-host-gbps 8*400 --latency-us 5 [--sizes 8:1024] [--scaling weak] \\
        [--global-batch 64] [--plot scaling.png] [--markdown] [--json]  # the best plan at 8 ... 1024 GPUs
    python -m hybridpipe.plan --simulate --data-parallel-only --model vgg16 --gpu p100 --gpus-per-host 4 \\
        --inter-host-gbps 25 --batch-per-gpu 64 [--hierarchical-allreduce] [--json]   # Horovod's benchmark
    python -m hybridpipe.plan --simulate --pipeline-only --model transformer24 --gpu p100 --gpus-per-host 8 \\
        --sizes 2,4,8 --micro-batches 32                                   # GPipe's Table 3
    python -m hybridpipe.plan --simulate --profile profile.json --global-batch 256 --gpus-per-host 8 ...
    hybridpipe-run -np 8 python -m hybridpipe.plan calibrate --output cluster.json
    python -m hybridpipe.plan --pipedream-profile bench/data/pipedream/vgg16.json --servers 4 --gpus-per-server 4 \\
        --intra-bandwidth 10e9 --inter-bandwidth 1.25e9 [--global-batch 1024] [--json]   # PipeDream's "15-1"

``MODULE:FACTORY`` names a function (``MODULE`` importable, or a path to a .py file) that returns
``(layers, loss_fn, sample)``: the layers as ``hp.PipelineModel`` takes them (built modules) or any
``nn.Module`` (profiled by its unit calls; the plan then says ``split=``), the loss, and ``sample(n)``
giving ``(inputs, targets)`` of ``n`` samples (a module's inputs: a tensor, a tuple, or a dict of keyword
arguments). The profile runs in this one process; the plan is for ``--ranks`` ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

from hybridpipe.config import parse_bytes
from hybridpipe.errors import HybridPipeError, NotSupportedError, UsageError
from hybridpipe.pipeline import schedule as sched
from hybridpipe.plan.cost import PRECISION_BYTES, ZERO_LEVELS, Cluster
from hybridpipe.plan.module_profile import CUTS_KEY, ModuleLayers, is_module, profile_module, split_of
from hybridpipe.plan.profile import Profile, profile
from hybridpipe.plan import models
from hybridpipe.plan.models import ACCELERATORS, MODELS
from hybridpipe.plan.search import CHECKPOINT_CHOICES, SYNCHRONOUS_CHOICES, Plan, format_bytes, plan
from hybridpipe.plan.simulate import (DEFAULT_SIZES, Engine, data_parallel_scaling, grid_comparison, parse_sizes,
                                      pipeline_scaling, plot_scaling, render_data_parallel, render_grids,
                                      render_pipeline, render_scaling, scaling)


def load_factory(spec: str):
    """The function ``MODULE:FACTORY`` names (``MODULE`` a module name or a .py path)."""
    if ":" not in spec:
        raise UsageError(f"expected MODULE:FACTORY (e.g. examples/train_lm.py:planner_model), got {spec!r}")
    module_name, function = spec.rsplit(":", 1)
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.exists():
                raise UsageError(f"no such file {module_name!r}")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            sys.path.insert(0, str(path.resolve().parent))
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except HybridPipeError:
        raise
    except Exception as error:  # the user's module: its own error, named, never a raw traceback
        raise UsageError(f"importing {module_name!r} failed: {type(error).__name__}: {error} (run "
                         f"`python -c 'import {Path(module_name).stem}'` to see where)") from error
    factory = getattr(module, function, None)
    if not callable(factory):
        raise UsageError(f"{module_name} has no function {function!r}")
    return factory


def profile_factory_model(spec: str, sample_batch: int) -> tuple[Profile, ModuleLayers | None]:
    """Profiles the model that ``MODULE:FACTORY`` returns on ``sample_batch`` samples; also the module's
    :class:`ModuleLayers` when the factory returns a module (not a layer list), for its split report.

    Raises:
        UsageError: the factory, its ``sample`` or the model failed (the message names which and why).
    """
    factory = load_factory(spec)
    try:
        made = factory()
    except Exception as error:
        raise UsageError(f"{spec}() raised {type(error).__name__}: {error}") from error
    if not isinstance(made, (tuple, list)) or len(made) != 3:
        raise UsageError(f"{spec}() must return (layers, loss_fn, sample), got "
                         f"{type(made).__name__}{f' of {len(made)}' if isinstance(made, (tuple, list)) else ''}")
    layers, loss_fn, sample = made
    try:
        inputs, targets = sample(sample_batch)
    except Exception as error:
        raise UsageError(f"sample({sample_batch}) of {spec} must return (inputs, targets); it raised "
                         f"{type(error).__name__}: {error}") from error
    try:
        if is_module(layers):
            return profile_module(layers, inputs, loss_fn, targets)
        return profile(layers, inputs, loss_fn, targets), None
    except HybridPipeError:
        raise
    except (RuntimeError, TypeError, ValueError, IndexError, AttributeError, KeyError) as error:
        what = ("its forward on sample({0})[0]" if is_module(layers)
                else "its layers, called in order on sample({0}),").format(sample_batch)
        raise UsageError(f"profiling {spec} failed: {type(error).__name__}: {error} (do {what} and "
                         "loss_fn(output, targets) run?)") from error


def render(best: Plan, args: argparse.Namespace, layers: ModuleLayers | None = None,
           profile: Profile | None = None) -> str:
    built = (f"  model = hp.PipelineModel(module, loss_fn, sample=<one micro-batch of inputs>, "
             f"**{best.model_arguments()!r})" if best.split is not None
             else f"  model = hp.PipelineModel(layers, loss_fn, **{best.model_arguments()!r})")
    lines = [
        f"plan for {args.ranks} ranks, global batch {args.global_batch}:",
        f"  {best.describe()}",
        f"  predicted step {best.step_seconds * 1e3:.1f} ms, {best.samples_per_second:.1f} samples/s, "
        f"{format_bytes(best.memory_bytes_per_rank)} on the busiest rank",
        "",
        "run it:",
        (f"  hybridpipe-run --stage-replicas {','.join(map(str, best.stage_replicas))} python YOUR_SCRIPT.py   "
         "# every rank is fed the whole global batch" if best.stage_replicas else
         f"  hybridpipe-run -np {args.ranks} --stages {best.stages} python YOUR_SCRIPT.py"),
        built,
    ]
    if best.zero:
        lines.append(f"  opt = hp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), "
                     f"zero={best.zero})")
    if best.stage_replicas and profile is not None:
        lines += ["", f"the grid {best.config}: where its stages are and what they send"]
        lines += ["  " + line for line in best.communication(profile)]
    if args.explain and best.alternatives:
        lines += ["", "next best, and why each lost:"]
        width = max(len(label) for label, _ in best.alternatives)
        lines += [f"  {label.ljust(width)}  {reason}" for label, reason in best.alternatives]
    if args.explain and layers is not None:
        lines += ["", "the split (hp.PipelineModel's split_report() for it; bytes on the profiled sample):"]
        lines += ["  " + line for line in layers.report(best.balance, best.stages).splitlines()]
    elif args.explain and best.split is not None:
        lines += ["", "the split's report needs the module: plan from MODULE:FACTORY instead of --profile"]
    return "\n".join(lines)


def calibrate_main(argv: list[str]) -> int:
    """``calibrate``: measure the job's links (under mpirun) and write them as JSON on rank 0."""
    parser = argparse.ArgumentParser(prog="python -m hybridpipe.plan calibrate",
                                     description="Measure this job's point-to-point and allreduce links.")
    parser.add_argument("--output", default="cluster.json", help="where rank 0 writes the result (JSON)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    import json

    import hybridpipe as hp
    from hybridpipe.plan.calibrate import calibrate, transfer_overhead

    hp.init()
    try:
        result = calibrate(args.repeats)
        per_host = hp.local_size()
        if per_host > 1 and "action_overhead_us" in result:  # one pipeline per host: the hand-offs' cost
            hp.shutdown()
            hp.init(pipeline_stages=per_host)
            result["transfer_overhead_us"] = transfer_overhead(result["action_overhead_us"],
                                                               result["intra_latency_us"], args.repeats)
        if hp.rank() == 0:
            with open(args.output, "w") as file:
                json.dump(result, file, indent=1)
            links = ", ".join(f"{key} {result[key]:.3g}" for key in (
                "intra_latency_us", "intra_gbps", "inter_latency_us", "inter_gbps", "allreduce_alpha_us",
                "allreduce_gbps", "action_overhead_us", "transfer_overhead_us", "compute_contention") if key in result)
            print(f"{result['ranks']} ranks, {result['ranks_per_host']} per host, {result['cores_per_host']} cores: "
                  f"{links} -> {args.output}")
    finally:
        hp.shutdown()
    return 0


def rate(text: str) -> float:
    """A number, or a product of numbers such as ``900*8`` (900 GB/s in Gbit/s)."""
    try:
        value = 1.0
        for factor in str(text).split("*"):
            value *= float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or a product such as 900*8") from None
    return value


def _build_cluster(args: argparse.Namespace, ranks: int, memory: float) -> Cluster:
    """The described cluster: ``--cluster`` (calibrated), else the flags, with the accelerator's host as the
    default for flags not given when a built-in model is simulated."""
    if args.cluster:
        from hybridpipe.plan.calibrate import load_cluster

        return load_cluster(args.cluster, memory_per_rank=memory, ranks=ranks)
    host = ACCELERATORS[args.gpu] if args.gpu else None
    defaults = {"ranks_per_host": host.per_host if host else 0,
                "intra_host_gbps": host.intra_host_gbps if host else 40.0,
                "inter_host_gbps": host.inter_host_gbps if host else 10.0,
                "latency_us": host.latency_us if host else 20.0}
    links = {name: getattr(args, name) if getattr(args, name) is not None else default
             for name, default in defaults.items()}
    return Cluster(ranks=ranks, cores_per_host=args.cores_per_host, memory_per_rank=memory,
                   action_overhead_us=args.action_overhead_us, **links)


def describe_cluster(cluster: Cluster) -> str:
    per_host = f"{cluster.ranks_per_host} per host" if cluster.ranks_per_host else "all on one host"
    memory = f", {format_bytes(cluster.memory_per_rank)} each" if cluster.memory_per_rank else ", no memory limit"
    overhead = f", {cluster.action_overhead_us:g} µs per pipeline action" if cluster.action_overhead_us else ""
    return (f"{per_host}, {cluster.intra_host_gbps:g} Gbit/s inside a host, {cluster.inter_host_gbps:g} Gbit/s "
            f"between hosts, {cluster.latency_us:g} µs latency{memory}{overhead}")


def _json_lines(rows: list[dict]) -> str:
    import json

    return "\n".join(json.dumps(row) for row in rows)


def data_parallel_main(args: argparse.Namespace, model_profile: Profile, cluster: Cluster, sizes: list[int]) -> str:
    """``--simulate --data-parallel-only``: every GPU a replica of ``--batch-per-gpu`` samples, gradients reduced
    during the backward as Horovod does (:func:`hybridpipe.plan.simulate.data_parallel_scaling`)."""
    engine = Engine(hierarchical=args.hierarchical_allreduce,
                    gpu_variation=Engine.gpu_variation if args.gpu_variation is None else args.gpu_variation)
    memory_tbps = ACCELERATORS[args.gpu].memory_tbps if args.model else 0.0
    rows = data_parallel_scaling(model_profile, cluster, sizes, args.batch_per_gpu, engine, memory_tbps)
    if args.json:
        return _json_lines([row.to_json() for row in rows])
    source = (f"{args.model} on {args.gpu} ({model_profile.note.rsplit('; ', 1)[-1]})" if args.model
              else f"the profile {args.profile or args.factory} (measured on {model_profile.device})")
    reduction = ("hierarchical (inside each host, then between hosts)" if engine.hierarchical
                 else "one NCCL ring through every GPU")
    lines = [f"predicted data-parallel scaling of {source}", f"cluster: {describe_cluster(cluster)}",
             f"weak scaling: {args.batch_per_gpu} samples per GPU; gradients reduced during the backward: "
             f"{engine.cycle_ms:g} ms cycle, {engine.fusion_bytes / 2**20:g} MiB fusion buffer, {reduction}; "
             f"GPUs {engine.gpu_variation:.0%} apart in speed (the slowest sets the pace)", "",
             render_data_parallel(rows, markdown=args.markdown)]
    return "\n".join(lines)


def pipeline_main(args: argparse.Namespace, model_profile: Profile, cluster: Cluster, sizes: list[int]) -> str:
    """``--simulate --pipeline-only``: each size one pipeline of that many stages, GPipe's schedule and
    re-materialization, ``--micro-batches`` of ``--global-batch``."""
    rows = pipeline_scaling(model_profile, cluster, sizes, args.global_batch, args.micro_batches)
    if args.json:
        return _json_lines([row.to_json() for row in rows])
    return "\n".join([f"predicted pipeline scaling of {args.model or args.profile or args.factory} "
                      f"(one replica, gpipe, checkpoint always, {args.micro_batches} micro-batches of "
                      f"{args.global_batch / args.micro_batches:g})", f"cluster: {describe_cluster(cluster)}", "",
                      render_pipeline(rows, markdown=args.markdown)])


def simulate_main(args: argparse.Namespace, model_profile: Profile, memory: float, schedules: tuple[str, ...]) -> str:
    """``--simulate``: the best plan at each size of ``--sizes``, as a table (and a plot with ``--plot``), or
    one JSON object per size with ``--json``."""
    sizes = parse_sizes(args.sizes)
    cluster = _build_cluster(args, sizes[0], memory)
    if args.data_parallel_only:
        return data_parallel_main(args, model_profile, cluster, sizes)
    if args.pipeline_only:
        return pipeline_main(args, model_profile, cluster, sizes)
    if args.compare_grids:
        return grids_main(args, model_profile, cluster, sizes, schedules)
    started = time.perf_counter()
    rows = scaling(model_profile, cluster, sizes, args.global_batch, weak=args.scaling == "weak",
                   schedules=schedules, checkpoints=CHECKPOINT_CHOICES,
                   optimizer_state_factor=args.optimizer_state_factor, zero_levels=zero_levels(args.zero),
                   precision=args.precision)
    elapsed = time.perf_counter() - started
    if args.json:  # the one-GPU plan is the reference (or the first size that has a plan, taken as linear)
        one = scaling(model_profile, dataclasses.replace(cluster, ranks=1), [1],
                      max(1, args.global_batch // sizes[0]) if args.scaling == "weak" else args.global_batch,
                      weak=False, schedules=schedules, checkpoints=CHECKPOINT_CHOICES,
                      optimizer_state_factor=args.optimizer_state_factor, zero_levels=zero_levels(args.zero),
                      precision=args.precision)[0]
        base = next((row for row in rows if row.plan is not None), None)
        per_gpu = (one.plan.samples_per_second if one.plan is not None
                   else base.plan.samples_per_second / base.ranks if base is not None else None)
        objects = []
        for row in rows:
            rate = row.plan.samples_per_second if row.plan is not None else None
            speedup = rate / per_gpu if rate is not None and per_gpu else None
            objects.append({"gpus": row.ranks, "global_batch": row.global_batch, "samples_per_second": rate,
                            "speedup_over_one_gpu": speedup, "efficiency": speedup / row.ranks if speedup else None,
                            "baseline": "1 GPU" if one.plan is not None else f"{base.ranks} GPUs as linear"
                            if base is not None else None,
                            "plan": row.plan.describe() if row.plan is not None else None,
                            "problem": row.problem or None})
        return _json_lines(objects)
    source = (f"{args.model} on {args.gpu} at {args.efficiency:g} of its peak" if args.model
              else f"the profile {args.profile or args.factory} (measured on {model_profile.device})")
    batch = (f"weak scaling: global batch {args.global_batch} at {sizes[0]} GPUs, growing with them"
             if args.scaling == "weak" else f"strong scaling: global batch {args.global_batch} at every size")
    sample = "sequences" if args.model and MODELS[args.model].kind == "transformer" else "samples"
    lines = [f"predicted scaling of {source}", f"cluster: {describe_cluster(cluster)}", batch, "",
             render_scaling(rows, markdown=args.markdown, sample=sample), "",
             f"searched {len(sizes)} sizes in {elapsed:.1f} s"]
    if args.plot:
        plot_scaling({args.model or "profile": rows}, args.plot, f"{source}; {batch}", sample)
        lines.append(f"plot: {args.plot}")
    return "\n".join(lines)


def grids_main(args: argparse.Namespace, model_profile: Profile, cluster: Cluster, sizes: list[int],
               schedules: tuple[str, ...]) -> str:
    """``--simulate --compare-grids``: at each size, the best data-parallel, uniform and own-replica-count plans."""
    rows = grid_comparison(model_profile, cluster, sizes, args.global_batch, weak=args.scaling == "weak",
                           schedules=schedules, checkpoints=CHECKPOINT_CHOICES,
                           optimizer_state_factor=args.optimizer_state_factor, zero_levels=zero_levels(args.zero),
                           precision=args.precision)
    if args.json:
        return _json_lines([{"gpus": row.ranks, "global_batch": row.global_batch, **{
            kind.replace("-", "_"): ({"config": best.config, "plan": best.describe(), "step_seconds": best.step_seconds,
                                      "speedup_over_dp": row.speedup(kind)} if best is not None else None)
            for kind, best in row.plans.items()}} for row in rows])
    source = (f"{args.model} on {args.gpu} at {args.efficiency:g} of its peak" if args.model
              else f"the profile {args.profile or args.factory}")
    sample = "sequences" if args.model and MODELS[args.model].kind == "transformer" else "samples"
    return "\n".join([f"best grid of each kind for {source}", f"cluster: {describe_cluster(cluster)}", "",
                      render_grids(rows, markdown=args.markdown, sample=sample)])


def pipedream_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--pipedream-profile``: PipeDream's per-stage replica counts for one of its published profiles."""
    from hybridpipe.plan import pipedream

    missing = [flag for flag, value in (("--servers", args.servers), ("--gpus-per-server", args.gpus_per_server),
                                        ("--intra-bandwidth", args.intra_bandwidth),
                                        ("--inter-bandwidth", args.inter_bandwidth)) if value is None]
    if missing:
        parser.error(f"--pipedream-profile needs {', '.join(missing)} (e.g. --servers 4 --gpus-per-server 4 "
                     "--intra-bandwidth 10e9 --inter-bandwidth 1.25e9 for the paper's Cluster-A, bytes per second)")
    others = [flag for flag, given in (("MODULE:FACTORY", args.factory), ("--profile", args.profile),
                                       ("--model", args.model), ("--ranks", args.ranks is not None),
                                       ("--simulate", args.simulate)) if given]
    if others:
        parser.error(f"--pipedream-profile plans from its own profile and cluster flags; leave out {', '.join(others)}")
    try:
        profile = pipedream.PipeDreamProfile.load(args.pipedream_profile)
        hierarchy = pipedream.Hierarchy(args.servers, args.gpus_per_server, args.intra_bandwidth, args.inter_bandwidth)
        best = pipedream.optimize(profile, hierarchy, args.global_batch, overlap=args.overlap,
                                  tolerance=args.tolerance, straight=args.straight)
    except HybridPipeError as error:
        print(f"hybridpipe.plan: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(best.to_json()))
    else:
        print(pipedream.explain(best))
    return 0


def zero_levels(choice: str) -> tuple[int, ...]:
    """``--zero``: "auto" lets the planner choose among 0, 1 and 2; a level forces it where there are replicas."""
    return ZERO_LEVELS if choice == "auto" else (int(choice),)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        return calibrate_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m hybridpipe.plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _source_arguments(parser)
    _simulate_arguments(parser)
    _cluster_arguments(parser)
    _pipedream_arguments(parser)
    args = parser.parse_args(argv)
    if args.pipedream_profile:
        return pipedream_main(args, parser)
    _check_arguments(parser, args)
    try:
        planned = _plan_or_simulate(args)
    except (HybridPipeError, ValueError, OSError) as error:
        print(f"hybridpipe.plan: {error}", file=sys.stderr)
        return 2
    if planned is not None:
        print(render(*planned))
    return 0


def _source_arguments(parser: argparse.ArgumentParser) -> None:
    """What to plan for: a model to profile, a saved profile or a built-in model."""
    parser.add_argument("factory", nargs="?", help="MODULE:FACTORY returning (layers, loss_fn, sample)")
    parser.add_argument("--profile", help="a saved profile (JSON) instead of profiling")
    parser.add_argument("--model", choices=list(MODELS), help="a built-in model costed from its FLOPs instead of "
                                                              "a profile (with --gpu, --efficiency)")
    parser.add_argument("--gpu", choices=list(ACCELERATORS), help="the accelerator of --model (default h100); "
                        "also the default host: GPUs per host, links, memory")
    parser.add_argument("--efficiency", type=float, default=0.5,
                        help="--model: fraction of the accelerator's peak the layers reach (default 0.5)")
    parser.add_argument("--call-overhead-us", type=float, default=50.0,
                        help="--model: a layer's fixed time per forward call, µs (backward: twice; default 50)")
    parser.add_argument("--save-profile", help="write the measured profile here (JSON)")
    parser.add_argument("--sample-batch", type=int, default=32, help="micro-batch size to profile (default 32)")
    parser.add_argument("--global-batch", type=int, help="samples per step over all replicas (--model: default "
                                                         "the published batch)")


def _simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """--ranks, or --simulate and the shapes of its sizes."""
    parser.add_argument("--ranks", type=int, help="processes in the job (not with --simulate)")
    parser.add_argument("--simulate", action="store_true",
                        help="predict throughput and scaling efficiency at each of --sizes ranks")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"--simulate: FIRST:LAST (powers of two) or a list (default {DEFAULT_SIZES})")
    parser.add_argument("--scaling", choices=["weak", "strong"], default="weak",
                        help="--simulate: weak grows the global batch with the ranks (from --global-batch at the "
                             "first size), strong keeps it (default weak)")
    parser.add_argument("--data-parallel-only", action="store_true",
                        help="--simulate: one stage, every GPU a replica (Horovod's setting), weak scaling from "
                             "--batch-per-gpu; gradients reduced during the backward with Horovod's cycle and "
                             "fusion buffer over NCCL's ring (--model: times from the GPU's published throughput "
                             "on that network where there is one)")
    parser.add_argument("--batch-per-gpu", type=int, default=None,
                        help="--data-parallel-only: samples per GPU per step (default: --global-batch / the first "
                             "size)")
    parser.add_argument("--hierarchical-allreduce", action="store_true",
                        help="--data-parallel-only: reduce inside each host, then between hosts (default: one ring "
                             "through every GPU, as NCCL 2 in Horovod's 2018 runs)")
    parser.add_argument("--gpu-variation", type=float, default=None,
                        help="--data-parallel-only: spread of GPU speeds as a fraction of the median (default 0.08, "
                             "Sinha et al. SC'22); the slowest GPU sets the pace")
    parser.add_argument("--compare-grids", action="store_true",
                        help="--simulate: at each size the best data-parallel plan, the best uniform grid and the best "
                             "grid with its own replica count per stage (hp.init(stage_replicas=)), with speed-ups")
    parser.add_argument("--pipeline-only", action="store_true",
                        help="--simulate: each size one pipeline of that many stages (GPipe's setting: gpipe "
                             "schedule, re-materialization, --micro-batches)")
    parser.add_argument("--micro-batches", type=int, default=32,
                        help="--pipeline-only: micro-batches per step (default 32, GPipe's Table 3)")
    parser.add_argument("--plot", help="--simulate: write a PNG of throughput and efficiency here")
    parser.add_argument("--markdown", action="store_true", help="--simulate: print the table as Markdown")


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster's links, cores and memory, and the search's options."""
    parser.add_argument("--cluster", help="links measured by `calibrate` (JSON); --ranks may differ from it")
    parser.add_argument("--ranks-per-host", "--gpus-per-host", dest="ranks_per_host", type=int, default=None,
                        help="default: all on one host (--gpu: its host's count)")
    parser.add_argument("--cores-per-host", type=int, default=0,
                        help="cores that compute per host (default 0: at least one per rank)")
    parser.add_argument("--intra-host-gbps", type=rate, default=None,
                        help="Gbit/s between ranks of a host (default 40; --gpu: its host's; 900*8 is 900 GB/s)")
    parser.add_argument("--inter-host-gbps", type=rate, default=None,
                        help="a host's network, Gbit/s (default 10; --gpu: its host's, e.g. 8*400)")
    parser.add_argument("--latency-us", type=rate, default=None, help="one message's latency (default 20)")
    parser.add_argument("--action-overhead-us", type=float, default=0.0,
                        help="the framework's own time per pipeline action, µs (default 0)")
    parser.add_argument("--memory-per-rank", default=None,
                        help="e.g. 16GiB (default 0: no limit; --gpu: its memory)")
    parser.add_argument("--optimizer-state-factor", type=float, default=None,
                        help="optimizer state bytes per parameter byte: SGD 0, momentum 1, Adam 2 (default 2; "
                             "--model in 16 bits: 6, Adam's fp32 master weights and moments)")
    parser.add_argument("--asynchronous", action="store_true", help="also consider pipedream and 2bw")
    parser.add_argument("--zero", choices=["auto", *map(str, ZERO_LEVELS)], default="auto",
                        help="ZeRO level of hp.DistributedOptimizer where a stage has replicas: auto (default) "
                             "lets the planner choose (0 unless sharding is faster or needed to fit)")
    parser.add_argument("--precision", choices=list(PRECISION_BYTES), default=None,
                        help="hp.PipelineModel(precision=): bf16 / fp16 halve the activations stored and sent "
                             "(default: the profile's, fp32 when measured; --model: the model's)")
    parser.add_argument("--explain", action="store_true", help="list the next best candidates and why they lost")


def _pipedream_arguments(parser: argparse.ArgumentParser) -> None:
    """--pipedream-profile and its cluster (PipeDream's optimizer, replica counts per stage)."""
    pipedream = parser.add_argument_group(
        "PipeDream's profiles", "--pipedream-profile FILE.json (bench/data/pipedream/): PipeDream's optimizer with a replica "
        "count per stage (\"15-1\") on servers of GPUs; with --servers, --gpus-per-server, --intra-bandwidth, "
        "--inter-bandwidth (bytes per second) and optionally --global-batch (default: the profiled batch per GPU)")
    pipedream.add_argument("--pipedream-profile", metavar="FILE.json", help="a PipeDream profile (JSON)")
    pipedream.add_argument("--servers", type=int, help="servers in the cluster")
    pipedream.add_argument("--gpus-per-server", type=int, help="GPUs in each server")
    pipedream.add_argument("--intra-bandwidth", type=rate, metavar="BYTES_PER_S",
                           help="between GPUs of a server, bytes per second (e.g. 10e9)")
    pipedream.add_argument("--inter-bandwidth", type=rate, metavar="BYTES_PER_S",
                           help="between servers, bytes per second (e.g. 1.25e9 for 10 Gbit/s)")
    pipedream.add_argument("--json", action="store_true", help="print the plan as one line of JSON (--simulate: one "
                           "line per size, each an object with gpus, samples_per_second, speedup_over_one_gpu, "
                           "efficiency)")
    pipedream.add_argument("--overlap", choices=["none", "layer", "stage"], default="none",
                           help="a replicated stage's allreduce against its compute: none (added, as PipeDream's "
                                "optimizer; default), layer (each layer's hides behind its own compute), stage "
                                "(max of the two, the paper's formula)")
    pipedream.add_argument("--tolerance", type=float, default=0.10,
                           help="plans within this fraction of the fastest count as equal; the one sending the "
                                "fewest bytes wins (default 0.10)")
    pipedream.add_argument("--straight", action="store_true", help="no stage replicated (PipeDream's "
                                                                    "--straight_pipeline)")


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations of arguments that cannot work end here, naming the fix (parser.error exits 2)."""
    sources = [name for name, given in (("MODULE:FACTORY", args.factory), ("--profile", args.profile),
                                        ("--model", args.model)) if given]
    if len(sources) != 1:
        parser.error("give one of MODULE:FACTORY (to profile), --profile FILE or --model NAME"
                     + (f" (got {' and '.join(sources)})" if sources else ""))
    if not args.simulate and args.ranks is None:
        parser.error("--ranks is required (or --simulate to plan for each of --sizes)")
    if args.simulate and args.ranks is not None:
        parser.error("--simulate plans for each of --sizes; leave out --ranks (e.g. --sizes 8:1024)")
    if (args.data_parallel_only or args.pipeline_only) and not args.simulate:
        parser.error("--data-parallel-only and --pipeline-only shape --simulate's sizes; add --simulate")
    if args.data_parallel_only and args.pipeline_only:
        parser.error("give one of --data-parallel-only (every GPU a replica) and --pipeline-only (every GPU a stage)")
    if args.batch_per_gpu is not None and not args.data_parallel_only:
        parser.error("--batch-per-gpu is for --data-parallel-only (otherwise give --global-batch)")
    if args.gpu and not args.model:
        parser.error("--gpu costs a built-in --model; a profile carries its own times (describe the cluster "
                     "with --gpus-per-host, --intra-host-gbps, --inter-host-gbps, --memory-per-rank)")
    if args.model:
        args.gpu = args.gpu or "h100"
        if args.global_batch is None:
            args.global_batch = MODELS[args.model].global_batch
    if args.global_batch is None:
        parser.error("--global-batch is required with a profile")


def _plan_or_simulate(args: argparse.Namespace) -> tuple[Plan, argparse.Namespace, Any, Profile] | None:
    """Profiles (or loads, or models) the model, then plans for --ranks (returns what :func:`render` takes) or
    prints --simulate's table (returns None)."""
    layers = None
    if args.data_parallel_only and args.batch_per_gpu is None:
        args.batch_per_gpu = max(1, args.global_batch // parse_sizes(args.sizes)[0])
    if args.model:
        measured = (args.data_parallel_only and MODELS[args.model].kind != "transformer"
                    and models.published_seconds_per_image(args.model, args.gpu) is not None)
        model_profile = models.model_profile(args.model, args.gpu, args.efficiency, args.call_overhead_us,
                                             measured=measured)
    elif args.profile:
        model_profile = Profile.load(args.profile)
    else:
        model_profile, layers = profile_factory_model(args.factory, args.sample_batch)
    if args.save_profile:
        model_profile.save(args.save_profile)
    if args.memory_per_rank is not None:
        memory = parse_bytes(args.memory_per_rank, "--memory-per-rank")
    else:
        memory = ACCELERATORS[args.gpu].memory_bytes if args.gpu else 0
    if args.optimizer_state_factor is None:
        args.optimizer_state_factor = (models.OPTIMIZER_STATE_FACTOR[MODELS[args.model].precision]
                                       if args.model else 2.0)
    module = CUTS_KEY in model_profile.extra
    if module and args.asynchronous:
        raise NotSupportedError(f"--asynchronous: pipedream and 2bw are not yet supported for a module split by "
                                f"hp.PipelineModel (this profile is of a {model_profile.extra.get('module', 'module')}"
                                "); leave --asynchronous out, or hand in a layer list")
    schedules = SYNCHRONOUS_CHOICES + (sched.ASYNCHRONOUS if args.asynchronous else ())
    if args.simulate:
        print(simulate_main(args, model_profile, memory, schedules))
        return None
    cluster = _build_cluster(args, args.ranks, memory)
    best = plan(model_profile, cluster, args.global_batch, schedules=schedules, checkpoints=CHECKPOINT_CHOICES,
                optimizer_state_factor=args.optimizer_state_factor, zero_levels=zero_levels(args.zero),
                precision=args.precision)
    if module:
        best = dataclasses.replace(best, split=split_of(model_profile.extra[CUTS_KEY], best.balance))
    return best, args, layers, model_profile


if __name__ == "__main__":
    sys.exit(main())

"""``python -m hybridpipe.plan``: profile a model (or load a profile) and print the best plan for a cluster.

Usage:
    python -m hybridpipe.plan MODULE:FACTORY --sample-batch 32 --global-batch 256 --ranks 8 \\
        [--ranks-per-host 4] [--cores-per-host 0] [--intra-host-gbps 40] [--inter-host-gbps 10] \\
        [--latency-us 20] [--memory-per-rank 16GiB] [--optimizer-state-factor 2] [--asynchronous] \\
        [--save-profile profile.json] [--explain]
    python -m hybridpipe.plan --profile profile.json --global-batch 256 --ranks 8 ...
    python -m hybridpipe.plan ... --cluster cluster.json        # links as measured by calibrate
    hybridpipe-run -np 8 python -m hybridpipe.plan calibrate --output cluster.json

``MODULE:FACTORY`` names a function (``MODULE`` importable, or a path to a .py file) that returns
``(layers, loss_fn, sample)``: the layers as ``hp.PipelineModel`` takes them (built modules), the
loss, and ``sample(n)`` giving ``(inputs, targets)`` of ``n`` samples. The profile runs in this one
process; the plan is for ``--ranks`` ranks.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from hybridpipe.config import parse_bytes
from hybridpipe.errors import HybridPipeError
from hybridpipe.plan.cost import Cluster
from hybridpipe.plan.profile import Profile, profile
from hybridpipe.plan.search import CHECKPOINT_CHOICES, SYNCHRONOUS_CHOICES, Plan, plan


def load_factory(spec: str):
    """The function ``MODULE:FACTORY`` names (``MODULE`` a module name or a .py path)."""
    if ":" not in spec:
        raise HybridPipeError(f"expected MODULE:FACTORY (e.g. examples/train_lm.py:planner_model), got {spec!r}")
    module_name, function = spec.rsplit(":", 1)
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.exists():
            raise HybridPipeError(f"no such file {module_name!r}")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader)
        sys.path.insert(0, str(path.resolve().parent))
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    factory = getattr(module, function, None)
    if not callable(factory):
        raise HybridPipeError(f"{module_name} has no function {function!r}")
    return factory


def render(best: Plan, args: argparse.Namespace) -> str:
    lines = [
        f"plan for {args.ranks} ranks, global batch {args.global_batch}:",
        f"  {best.describe()}",
        f"  predicted step {best.step_seconds * 1e3:.1f} ms, {best.samples_per_second:.1f} samples/s, "
        f"{best.memory_bytes_per_rank / 2**20:.1f} MiB on the busiest rank",
        "",
        "run it:",
        f"  hybridpipe-run -np {args.ranks} --stages {best.stages} python YOUR_SCRIPT.py",
        f"  model = hp.PipelineModel(layers, loss_fn, **{best.model_arguments()!r})",
    ]
    if args.explain and best.alternatives:
        lines += ["", "next best, and why each lost:"]
        width = max(len(label) for label, _ in best.alternatives)
        lines += [f"  {label.ljust(width)}  {reason}" for label, reason in best.alternatives]
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
    from hybridpipe.plan.calibrate import calibrate

    hp.init()
    try:
        result = calibrate(args.repeats)
        if hp.rank() == 0:
            with open(args.output, "w") as file:
                json.dump(result, file, indent=1)
            links = ", ".join(f"{key} {result[key]:.3g}" for key in (
                "intra_latency_us", "intra_gbps", "inter_latency_us", "inter_gbps", "allreduce_alpha_us",
                "allreduce_gbps") if key in result)
            print(f"{result['ranks']} ranks, {result['ranks_per_host']} per host, {result['cores_per_host']} cores: "
                  f"{links} -> {args.output}")
    finally:
        hp.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        return calibrate_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m hybridpipe.plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("factory", nargs="?", help="MODULE:FACTORY returning (layers, loss_fn, sample)")
    parser.add_argument("--profile", help="a saved profile (JSON) instead of profiling")
    parser.add_argument("--save-profile", help="write the measured profile here (JSON)")
    parser.add_argument("--sample-batch", type=int, default=32, help="micro-batch size to profile (default 32)")
    parser.add_argument("--global-batch", type=int, required=True, help="samples per step over all replicas")
    parser.add_argument("--ranks", type=int, required=True, help="processes in the job")
    parser.add_argument("--cluster", help="links measured by `calibrate` (JSON); --ranks may differ from it")
    parser.add_argument("--ranks-per-host", type=int, default=0, help="default: all on one host")
    parser.add_argument("--cores-per-host", type=int, default=0,
                        help="cores that compute per host (default 0: at least one per rank)")
    parser.add_argument("--intra-host-gbps", type=float, default=40.0)
    parser.add_argument("--inter-host-gbps", type=float, default=10.0)
    parser.add_argument("--latency-us", type=float, default=20.0)
    parser.add_argument("--memory-per-rank", default="0", help="e.g. 16GiB (default 0: no limit)")
    parser.add_argument("--optimizer-state-factor", type=float, default=2.0,
                        help="optimizer state bytes per parameter byte: SGD 0, momentum 1, Adam 2 (default 2)")
    parser.add_argument("--asynchronous", action="store_true", help="also consider pipedream and 2bw")
    parser.add_argument("--explain", action="store_true", help="list the next best candidates and why they lost")
    args = parser.parse_args(argv)
    try:
        if args.profile:
            model_profile = Profile.load(args.profile)
        elif args.factory:
            layers, loss_fn, sample = load_factory(args.factory)()
            inputs, targets = sample(args.sample_batch)
            model_profile = profile(layers, inputs, loss_fn, targets)
        else:
            parser.error("give MODULE:FACTORY to profile, or --profile FILE")
        if args.save_profile:
            model_profile.save(args.save_profile)
        memory = parse_bytes(args.memory_per_rank, "--memory-per-rank")
        if args.cluster:
            from hybridpipe.plan.calibrate import load_cluster

            cluster = load_cluster(args.cluster, memory_per_rank=memory, ranks=args.ranks)
        else:
            cluster = Cluster(ranks=args.ranks, ranks_per_host=args.ranks_per_host,
                              cores_per_host=args.cores_per_host, intra_host_gbps=args.intra_host_gbps,
                              inter_host_gbps=args.inter_host_gbps, latency_us=args.latency_us,
                              memory_per_rank=memory)
        schedules = SYNCHRONOUS_CHOICES + (("pipedream", "2bw") if args.asynchronous else ())
        best = plan(model_profile, cluster, args.global_batch, schedules=schedules, checkpoints=CHECKPOINT_CHOICES,
                    optimizer_state_factor=args.optimizer_state_factor)
    except (HybridPipeError, ValueError, OSError) as error:
        print(f"hybridpipe.plan: {error}", file=sys.stderr)
        return 2
    print(render(best, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

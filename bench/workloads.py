"""Real workloads, side by side: each named workload (bench/_workloads.py) trained to its target under every
configuration of hybridpipe and of its peers, on one host or on two emulated hosts with a rate-limited link.

Usage:
    python bench/workloads.py [--workloads gpt2,llama,vgg,lstm] [--settings local:4,1gbit:2x2,10gbit:2x2]
        [--configs dp,2x2,3-1,pipedream,2bw,auto,ddp] [--max-steps N] [--max-seconds S] [--eval-every K]
        [--quick] [--json FILE] [--markdown] [--plot DIR]
    python bench/workloads.py --from-json FILE [--markdown] [--plot DIR]   # the table and plots of an earlier run

Configurations (4 ranks): ``dp`` hybridpipe data parallelism (1 stage x 4 replicas, ``hp.DistributedOptimizer``);
``2x2`` 2 stages x 2 replicas, 1F1B, 4 micro-batches; ``3-1`` stages with their own replica counts
(``stage_replicas=[3, 1]``, 1F1B, 6 micro-batches); ``pipedream`` and ``2bw`` the asynchronous schedules on 2 x 2
(layer-list workloads only: they take no tied weights and no module); ``auto`` whatever ``hp.auto`` chooses (its
predicted step is reported); ``ddp`` torch ``DistributedDataParallel`` over gloo, launched by mpirun (no torchrun),
its rendezvous on 127.0.0.1 (on host 0's address across emulated hosts). FSDP2, DeepSpeed and
torch.distributed.pipelining go into :data:`PEERS` beside ``ddp``.

Every configuration builds the same model from the same seed and trains on the same global batch of each step
(each replica its slice; a ``3-1`` grid every rank the whole batch); the held-out split is evaluated every
``--eval-every`` steps, on the full model's output (``PipelineModel.predict`` for pipelines), and the run stops at
the target, ``--max-steps`` or ``--max-seconds`` of training (the JSON line says which). Settings: ``local:4``
(4 ranks on this host) and ``RATE:2x2`` (two emulated hosts x 2 ranks, each host's link limited to RATE by tc;
needs root, hybridpipe.testing.emulated_hosts).

One JSON line per configuration on stdout (and in ``--json FILE``), then the table. Reported: throughput (tokens or
samples per second of training time: evaluation excluded), peak RSS of each rank, bytes sent between hosts per step
(emulated settings: the hosts' own interface counters, read around each training step), the training time and steps
to the target, the last validation metric (and validation loss), and the planner's prediction where there is one.
``curve`` holds ``[step, training seconds, metric, validation loss]`` at every evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # hybridpipe from this checkout when it is not installed

from _common import command_line, launch_env, progress, render, start_gloo  # noqa: E402

RANKS = 4
HYBRIDPIPE = ("dp", "2x2", "3-1", "pipedream", "2bw", "auto")
PEERS = ("ddp",)  # later: "fsdp2", "deepspeed", "pipelining" — a Runner class each, named in RUNNERS
CONFIGS = HYBRIDPIPE + PEERS
LINK_ENV = "HYBRIDPIPE_WORKLOADS_LINK"  # the emulated hosts' interface whose counters give the bytes between hosts
GLOO_ADDRESS_ENV = "HYBRIDPIPE_WORKLOADS_GLOO_ADDRESS"  # where DDP's rendezvous listens across emulated hosts


def applicable(workload: Any, config: str) -> str:
    """Why ``config`` does not run ``workload`` ("" when it does)."""
    if config in ("pipedream", "2bw") and workload.is_module:
        return "asynchronous schedules take layer lists without tied weights"
    if config == "3-1" and workload.tied:
        return "weights tied across stages do not run on stage_replicas grids"
    return ""


# ------------------------------------------------------------------------------------------ runners (one rank)

class HybridRunner:
    """hybridpipe: data parallelism, a pipeline grid, stage replica counts or hp.auto's plan."""

    def __init__(self, config: str, workload: Any, quick: bool) -> None:
        from torch import nn

        import hybridpipe as hp

        self.hp, self.workload, self.pipeline = hp, workload, config != "dp"
        self.predicted: dict[str, Any] = {}
        model = workload.build()
        if config == "dp":
            self.grid = hp.init(pipeline_stages=1)
            self.model = model if workload.is_module else nn.Sequential(*model)
            self.optimizer = hp.DistributedOptimizer(workload.optimizer(self.model.parameters()),
                                                     named_parameters=self.model.named_parameters())
            self.part, self.parts = self.grid.replica, self.grid.data_replicas
            return
        if config == "auto":
            self._auto(model, quick)
            return
        self.grid = hp.init(stage_replicas=[3, 1]) if config == "3-1" else hp.init(pipeline_stages=2)
        micro_batches = 6 if config == "3-1" else 4
        schedule = config if config in ("pipedream", "2bw") else "1f1b"
        options: dict[str, Any] = {"micro_batches": micro_batches, "schedule": schedule}
        if workload.is_module:
            inputs, _ = workload.batch(0)
            options["sample"] = inputs[: max(1, workload.global_batch // (2 * micro_batches))]
        else:
            options["balance"] = [workload.cut, len(model) - workload.cut]
        if schedule != "1f1b":
            options["optimizer"] = workload.optimizer
        self.model = hp.PipelineModel(model, workload.loss_fn, **options)
        self.optimizer = None if schedule != "1f1b" else hp.DistributedOptimizer(
            workload.optimizer(list(self.model.parameters())), named_parameters=self.model.named_parameters())
        self.part, self.parts = (0, 1) if not self.grid.uniform else (self.grid.replica, self.grid.data_replicas)

    def _auto(self, model: Any, quick: bool) -> None:
        hp, workload = self.hp, self.workload
        hp.init()
        inputs, targets = workload.batch(0)
        sample = (inputs[: max(1, workload.global_batch // 8)], targets[: max(1, workload.global_batch // 8)])
        self.model, self.optimizer = hp.auto(model, workload.loss_fn, sample, workload.global_batch,
                                             workload.optimizer, verify=not quick, verify_seconds=20.0)
        self.grid, plan = hp.grid(), self.model.plan
        self.part, self.parts = (0, 1) if plan.stage_replicas else (self.grid.replica, plan.replicas)
        self.predicted = {"plan": plan.describe(), "predicted_step_s": plan.step_seconds,
                          "predicted_per_s": workload.global_batch * workload.units_per_sample / plan.step_seconds}

    @property
    def rank(self) -> int:
        return self.grid.rank

    def step(self, inputs: Any, targets: Any) -> None:
        size = inputs.shape[0] // self.parts
        inputs, targets = (t[self.part * size:(self.part + 1) * size] for t in (inputs, targets))
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        if self.pipeline:
            self.model.train_step(inputs, targets)
        else:
            self.workload.loss_fn(self.model(inputs), targets).backward()
        if self.optimizer is not None and not getattr(self.model, "asynchronous", False):
            self.optimizer.step()

    def output(self, inputs: Any) -> Any:
        """The model's output on the held-out inputs (every rank calls it; rank 0's is whole)."""
        import torch

        with torch.no_grad():
            if not self.pipeline:
                return self.model(inputs) if self.rank == 0 else None
            self.model.flush()
            return self.model.predict(inputs)

    def broadcast(self, value: Any) -> Any:
        return self.hp.broadcast_object(value, root_rank=0, group="world")

    def gather(self, value: Any) -> list:
        return self.hp.allgather_object(value, group="world")

    def close(self) -> None:
        if self.pipeline:
            self.model.close()
        self.hp.shutdown()


class DDPRunner:
    """torch DistributedDataParallel over gloo, one process per mpirun rank."""

    def __init__(self, config: str, workload: Any, quick: bool) -> None:
        from mpi4py import MPI
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel

        self.comm, self.workload, self.predicted = MPI.COMM_WORLD, workload, {}
        self.dist, self._store = _start_gloo(self.comm)
        model = workload.build()
        self.module = model if workload.is_module else nn.Sequential(*model)
        self.model = DistributedDataParallel(self.module)
        self.optimizer = workload.optimizer(self.model.parameters())
        self.rank, self.parts = self.comm.Get_rank(), self.comm.Get_size()

    def step(self, inputs: Any, targets: Any) -> None:
        size = inputs.shape[0] // self.parts
        inputs, targets = (t[self.rank * size:(self.rank + 1) * size] for t in (inputs, targets))
        self.optimizer.zero_grad()
        self.workload.loss_fn(self.model(inputs), targets).backward()
        self.optimizer.step()

    def output(self, inputs: Any) -> Any:
        import torch

        with torch.no_grad():
            return self.module(inputs) if self.rank == 0 else None

    def broadcast(self, value: Any) -> Any:
        return self.comm.bcast(value, root=0)

    def gather(self, value: Any) -> list:
        return self.comm.allgather(value)

    def close(self) -> None:
        self.dist.destroy_process_group()


RUNNERS = {**{name: HybridRunner for name in HYBRIDPIPE}, "ddp": DDPRunner}


def _start_gloo(comm: Any) -> tuple[Any, Any]:
    """gloo over loopback; across emulated hosts, on host 0's address (bench/_common.py's start_gloo)."""
    return start_gloo(comm, address=os.environ.get(GLOO_ADDRESS_ENV) or "127.0.0.1")


# ------------------------------------------------------------------------------------------ the training loop

def link_bytes() -> int:
    """Bytes this host has sent on the emulated network (its interface's counter); 0 on one host."""
    link = os.environ.get(LINK_ENV)
    if not link:
        return 0
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == link:
            return int(counters.split()[8])
    return 0


def _progress_bar(step: int, limit: int, value: float, workload: Any) -> None:
    done = int(20 * min(1.0, step / max(1, limit)))
    print(f"\r  [{'#' * done}{'.' * (20 - done)}] step {step}/{limit} val {workload.metric} {value:.4f} "
          f"(target {workload.target})", end="", file=sys.stderr, flush=True)


def train(runner: Any, workload: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Trains until the target, the step cap or the time cap; rank 0's numbers (RSS and bytes from every rank)."""
    valid_inputs, valid_targets = workload.validation
    steps, seconds, sent, curve, stop = 0, 0.0, 0, [], ""
    value = loss = float("nan")
    while not stop:
        inputs, targets = workload.batch(steps)
        before, started = link_bytes(), time.perf_counter()
        runner.step(inputs, targets)
        seconds += time.perf_counter() - started
        sent += link_bytes() - before
        steps += 1
        if steps % args.eval_every and steps < args.max_steps:
            continue
        output = runner.output(valid_inputs)
        if runner.rank == 0:
            value, loss = workload.evaluate(output, valid_targets), float(workload.loss_fn(output, valid_targets))
            curve.append([steps, round(seconds, 4), value, loss])
            stop = ("target" if workload.reached(value) else "max_steps" if steps >= args.max_steps
                    else "max_seconds" if seconds >= args.max_seconds else "")
            _progress_bar(steps, args.max_steps, value, workload)
        stop, seconds = runner.broadcast((stop, seconds))
    if runner.rank == 0:
        print(file=sys.stderr)
    places = runner.gather((socket.gethostname(), sent, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    per_host: dict[str, int] = {}
    for host, host_sent, _ in places:  # the lowest rank of each host reads its host's counter
        per_host.setdefault(host, host_sent)
    units = steps * workload.global_batch * workload.units_per_sample
    return {"stopped_by": stop, "reached_target": stop == "target", "steps": steps, "train_seconds": seconds,
            "final_metric": value, "metric": workload.metric, "target": workload.target, "final_validation_loss": loss,
            "seconds_to_target": seconds if stop == "target" else None,
            "steps_to_target": steps if stop == "target" else None,
            f"{workload.unit}_per_s": units / seconds if seconds else None, "unit": workload.unit,
            "peak_rss_bytes": [rss for _, _, rss in places],
            "inter_host_bytes_per_step": sum(per_host.values()) / steps if os.environ.get(LINK_ENV) else None,
            "curve": curve, **runner.predicted}


def worker_main(args: argparse.Namespace) -> int:
    import torch

    from _workloads import workload as named

    torch.set_num_threads(1)
    chosen = named(args.workload, args.quick)
    runner = RUNNERS[args.config](args.config, chosen, args.quick)
    try:
        result = train(runner, chosen, args)
        if runner.rank == 0:
            Path(args.result).write_text(json.dumps(result))
    finally:
        runner.close()
    return 0


# ------------------------------------------------------------------------------------------ the driver

def parse_setting(text: str) -> tuple[str, str | None]:
    """``local:4`` -> ("local:4", None); ``1gbit:2x2`` -> ("1gbit:2x2", "1gbit")."""
    where, _, shape = text.partition(":")
    if where == "local" and shape == str(RANKS):
        return text, None
    if shape == "2x2" and where:
        return text, where
    raise SystemExit(f"unknown setting {text!r}: use local:{RANKS} or RATE:2x2 (e.g. 1gbit:2x2, 10gbit:2x2)")


def worker_argv(workload: str, config: str, result: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--workload", workload, "--config", config,
            "--result", str(result), "--max-steps", str(args.max_steps), "--max-seconds", str(args.max_seconds),
            "--eval-every", str(args.eval_every), *(["--quick"] if args.quick else [])]


def launch(command: list[str], result: Path, timeout: float) -> dict[str, Any]:
    """Runs one configuration's job (its output on this process's stderr); its rank 0's result, or the failure."""
    started = time.perf_counter()
    try:
        finished = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=sys.stderr, timeout=timeout, check=False)
        code = finished.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    if code != 0 or not result.exists():
        return {"error": f"the job failed (exit status {code}); its output is above"}
    return {**json.loads(result.read_text()), "job_seconds": time.perf_counter() - started}


def run_setting(setting: str, rate: str | None, args: argparse.Namespace, emit: Any) -> list[dict[str, Any]]:
    from _workloads import workload as named

    from hybridpipe.launch import mpirun_command

    hosts = None
    if rate:
        from hybridpipe.testing.emulated_hosts import EmulatedHosts, EmulatedHostsError

        try:
            hosts = EmulatedHosts(2, rate=rate).up()
        except EmulatedHostsError as error:
            progress(f"{setting}: skipped, emulated hosts are not available here ({error})")
            return [emit({"setting": setting, "skipped": f"emulated hosts not available: {error}"})]
    records = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for name in args.workloads:
                chosen = named(name, args.quick)
                for config in args.configs:
                    record = {"setting": setting, "workload": name, "config": config, "model": chosen.describe}
                    why_not = applicable(chosen, config)
                    if why_not:
                        records.append(emit({**record, "skipped": why_not}))
                        continue
                    progress(f"{setting}: {name}, {config}")
                    result = Path(scratch) / f"{name}-{config}.json"
                    argv = worker_argv(name, config, result, args)
                    env = launch_env(RANKS)
                    if hosts is None:
                        command = mpirun_command(RANKS, argv, env=env)
                    else:
                        env.update({LINK_ENV: hosts.bridge, GLOO_ADDRESS_ENV: hosts.addresses[0],
                                    "GLOO_SOCKET_IFNAME": hosts.bridge})
                        command = hosts.mpirun_command(2, argv, env=env)
                    records.append(emit({**record, **launch(command, result, args.timeout)}))
    finally:
        if hosts is not None:
            hosts.down()
    return records


def _number(value: Any, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table(records: list[dict[str, Any]], markdown: bool) -> str:
    header = ["setting", "workload", "config", "throughput", "peak RSS MiB (max rank)", "inter-host MB/step",
              "steps", "train s", "to target s", "final metric", "stopped by", "planner's prediction"]
    rows = []
    for r in records:
        if "workload" not in r:
            continue
        if "skipped" in r or "error" in r:
            rows.append([r["setting"], r["workload"], r["config"], *[""] * 7, r.get("skipped") or "FAILED", ""])
            continue
        unit = r["unit"]
        predicted = (f"{r['plan']}: {r['predicted_per_s']:.0f} {unit}/s" if "plan" in r else "")
        sent = r["inter_host_bytes_per_step"]
        rows.append([r["setting"], r["workload"], r["config"], f"{r[f'{unit}_per_s']:.0f} {unit}/s",
                     f"{max(r['peak_rss_bytes']) / 2**20:.0f}", "" if sent is None else f"{sent / 1e6:.2f}",
                     str(r["steps"]), f"{r['train_seconds']:.1f}", _number(r["seconds_to_target"], 1),
                     f"{r['metric']} {r['final_metric']:.4f} (target {r['target']})", r["stopped_by"], predicted])
    return render(header, rows, markdown, left=3)


def plot(records: list[dict[str, Any]], folder: Path) -> list[Path]:
    """One PNG per workload: the validation metric against training seconds, one line per setting and
    configuration (the records' ``curve``); matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in dict.fromkeys(r["workload"] for r in records if r.get("curve")):
        figure, axes = pyplot.subplots(figsize=(7, 4.5))
        runs = [r for r in records if r.get("workload") == name and r.get("curve")]
        settings = list(dict.fromkeys(r["setting"] for r in runs))  # a line style per setting, a colour per config
        colours = {config: f"C{i}" for i, config in enumerate(CONFIGS)}
        for r in runs:
            axes.plot([point[1] for point in r["curve"]], [point[2] for point in r["curve"]], marker=".",
                      color=colours[r["config"]], linestyle=("-", "--", ":", "-.")[settings.index(r["setting"]) % 4],
                      label=f"{r['setting']} {r['config']}")
        axes.axhline(runs[0]["target"], color="grey", linestyle="--", linewidth=1, label="target")
        axes.set(xlabel="training seconds", ylabel=f"validation {runs[0]['metric']}", title=runs[0]["model"])
        axes.legend(fontsize="x-small", ncol=2)
        figure.tight_layout()
        path = folder / f"workloads-{name}.png"
        figure.savefig(path, dpi=100)
        pyplot.close(figure)
        written.append(path)
    return written


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="gpt2,llama,vgg,lstm", help="comma-separated (default: all four)")
    parser.add_argument("--settings", default="local:4", help="local:4, 1gbit:2x2, 10gbit:2x2 (comma-separated)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--max-steps", type=int, default=None, help="step cap (default 2000; --quick 60)")
    parser.add_argument("--max-seconds", type=float, default=None, help="training-time cap (default 900; --quick 60)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default 50; "
                        "--quick 5)")
    parser.add_argument("--quick", action="store_true", help="tiny models and loose targets: a smoke run")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per job (default: 2 x --max-seconds "
                        "+ 120)")
    parser.add_argument("--json", help="also write the JSON lines to this file")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--plot", metavar="DIR", help="also draw workloads-<workload>.png here (matplotlib)")
    parser.add_argument("--from-json", metavar="FILE", help="run nothing: the table (and --plot) of the JSON lines "
                        "of an earlier run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.max_steps = args.max_steps or (60 if args.quick else 2000)
    args.max_seconds = args.max_seconds or (60.0 if args.quick else 900.0)
    args.eval_every = args.eval_every or (5 if args.quick else 50)
    args.timeout = args.timeout or 2 * args.max_seconds + 120
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown} (use {', '.join(CONFIGS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.from_json:
        records = [json.loads(line) for line in Path(args.from_json).read_text().splitlines() if line.strip()]
        print(table(records, args.markdown))
        for path in plot(records, Path(args.plot)) if args.plot else []:
            progress(f"wrote {path}")
        return 0
    settings = [parse_setting(s) for s in args.settings.split(",") if s]
    lines = open(args.json, "w") if args.json else None

    def emit(record: dict[str, Any]) -> dict[str, Any]:
        text = json.dumps(record)
        print(text, flush=True)
        if lines:
            print(text, file=lines, flush=True)
        return record

    try:
        records = [r for setting, rate in settings for r in run_setting(setting, rate, args, emit)]
    finally:
        if lines:
            lines.close()
    print(f"\n# {command_line()}")
    print(f"{RANKS} ranks per configuration; throughput over training time (evaluation excluded); "
          "'to target s': training seconds until the evaluation that reached the target")
    print(table(records, args.markdown))
    for path in plot(records, Path(args.plot)) if args.plot else []:
        progress(f"wrote {path}")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())

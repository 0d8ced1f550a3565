"""ZeRO-3 on a transformers Llama of over 200 M parameters, 4 ranks, AdamW fp32: memory and step time per rank,
side by side with torch FSDP2 (``fully_shard``, gloo) in the same run.

Usage:
    python bench/zero3_llama.py [--configs hp-z0-1x4,hp-z3-1x4,fsdp2-1x4,hp-z2-2x2,hp-z3-2x2] [--steps 3]
                                [--hidden 1024] [--layers 12] [--intermediate 2816] [--vocab 32000]
                                [--seq-len 128] [--batch 2] [--markdown]
    python bench/zero3_llama.py --quick     # a 10 M-parameter Llama, one timed step: does every peer run

Configurations (each its own ``mpirun`` of 4 ranks, the same model configuration, batches and optimizer):

* ``hp-z0-1x4``: hybridpipe data parallelism, ``zero=0``, the model built whole on every rank;
* ``hp-z3-1x4``: ``zero=3``, the model built on the meta device and ``opt.materialize(model)``;
* ``fsdp2-1x4``: torch FSDP2, ``fully_shard`` per decoder layer and the root, built on the meta device,
  ``to_empty`` and the model's own initialisation;
* ``hp-z2-2x2`` / ``hp-z3-2x2``: 2 pipeline stages (the module split, GPipe, 2 micro-batches) × 2 replicas,
  ``zero=2`` / ``zero=3``.

Each rank reports the peak resident memory twice: over the training steps alone (Linux's ``VmHWM``, reset
through ``/proc/self/clear_refs`` once the model and optimizer are built) and over the whole process
(``ru_maxrss``, the build included); the step time is the median over the timed steps of the slowest rank. The
table shows the worst rank of each launch and the ratios the issue names. Nothing is asserted: run it on an idle
machine (``python bench/guard.py -- ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import command_line, progress, render  # noqa: E402

CONFIGS = ("hp-z0-1x4", "hp-z3-1x4", "fsdp2-1x4", "hp-z2-2x2", "hp-z3-2x2")


def llama(args: argparse.Namespace, meta: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq_len, use_cache=False,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    return LlamaForCausalLM(config)


def initialise(model) -> None:
    """The model's own initialisation, module by module in ``modules()`` order (what opt.materialize does)."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(False)):
                model._init_weights(module)


def lm_loss(output, targets):
    import torch

    logits = output.logits if hasattr(output, "logits") else output
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def peak_since_reset() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def batches(args: argparse.Namespace, replica: int):
    import torch

    generator = torch.Generator().manual_seed(replica)
    return [torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=generator)
            for _ in range(args.steps + 1)]


def hybridpipe_run(args: argparse.Namespace, zero: int, stages: int):
    """(step function, replica, parameter count, slowest-of-ranks reduction) for a hybridpipe configuration."""
    import torch

    import hybridpipe as hp

    grid = hp.init(pipeline_stages=stages)
    if stages == 1:
        model = llama(args, meta=zero == 3)
        count = sum(p.numel() for p in model.parameters())
        optimizer = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                            named_parameters=model.named_parameters(), zero=zero)
        if zero == 3:
            optimizer.materialize(model)

        def step(ids):
            optimizer.zero_grad()
            lm_loss(model(input_ids=ids[:, :-1]), ids[:, 1:]).backward()
            optimizer.step()
    else:
        module = llama(args, meta=False)
        count = sum(p.numel() for p in module.parameters())
        sample = {"input_ids": torch.zeros(1, args.seq_len, dtype=torch.long)}
        model = hp.PipelineModel(module, sample=sample, loss_fn=lm_loss, micro_batches=2, split="auto",
                                 schedule="gpipe")
        del module
        optimizer = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                            named_parameters=model.named_parameters(), zero=zero)

        def step(ids):
            optimizer.zero_grad()
            model.train_step({"input_ids": ids[:, :-1]}, ids[:, 1:])
            optimizer.step()

    def slowest(values: list[float]) -> list[float]:
        return hp.allreduce(torch.tensor(values, dtype=torch.float64), op=hp.Max, group="world").tolist()

    def everyone(mine: dict) -> list[dict]:
        return hp.allgather_object(mine, group="world")

    return step, grid.replica, count, slowest, everyone, grid.rank


def fsdp2_run(args: argparse.Namespace):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
    model = llama(args, meta=True)
    count = sum(p.numel() for p in model.parameters())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    initialise(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids):
        optimizer.zero_grad()
        lm_loss(model(input_ids=ids[:, :-1]), ids[:, 1:]).backward()
        optimizer.step()

    def slowest(values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def everyone(mine: dict) -> list[dict]:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return gathered

    return step, rank, count, slowest, everyone, rank


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    config = args.config_one
    if config.startswith("fsdp2"):
        step, replica, count, slowest, everyone, rank = fsdp2_run(args)
    else:
        zero = int(config.split("-")[1][1:])
        stages = int(config.split("-")[2].split("x")[0])
        step, replica, count, slowest, everyone, rank = hybridpipe_run(args, zero, stages)
    build_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reset_peak()
    times = []
    for index, ids in enumerate(batches(args, replica)):
        start = time.perf_counter()
        step(ids)
        if index >= 1:
            times.append(time.perf_counter() - start)
    mine = {"rank": rank, "train_peak": peak_since_reset(), "process_peak": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "build_peak": build_peak}
    ranks = everyone(mine)
    step_s = statistics.median(slowest(times))
    if rank == 0:
        Path(args.result).write_text(json.dumps({"ranks": ranks, "step_s": step_s, "parameters": count}))
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, config: str, folder: Path) -> dict:
    from hybridpipe.launch import mpirun_command

    result = folder / f"{config}.json"
    command = mpirun_command(4, [sys.executable, __file__, "--worker", "--config-one", config, "--result",
                                 str(result), *sys.argv[1:]],
                             env={"OMP_NUM_THREADS": "1", "OMPI_MCA_mpi_yield_when_idle": "1",
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr).strip().splitlines()[-8:]}
    return json.loads(result.read_text())


def mib(value: float) -> str:
    return f"{value / 2 ** 20:.0f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.intermediate, args.vocab, args.seq_len, args.steps = 128, 2, 256, 32000, 32, 1
    if args.worker:
        return worker(args)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for config in args.configs.split(","):
            progress(f"{config}")
            results[config] = launch(args, config, Path(folder))
    header = ["configuration", "train peak MiB", "process peak MiB", "step s", "train peak ratio", "step ratio"]
    base = {"hp-z3-1x4": "hp-z0-1x4", "fsdp2-1x4": "hp-z0-1x4", "hp-z3-2x2": "hp-z2-2x2"}
    rows, count = [], None
    for config, result in results.items():
        if "error" in result:
            rows.append([config, "failed: " + " / ".join(result["error"][-2:]), "", "", "", ""])
            continue
        count = result["parameters"]
        train = max(r["train_peak"] for r in result["ranks"])
        process = max(r["process_peak"] for r in result["ranks"])
        other = results.get(base.get(config, ""), {})
        ratio = step = "-"
        if other and "error" not in other:
            ratio = f"{train / max(r['train_peak'] for r in other['ranks']):.3f} of {base[config]}"
            step = f"{result['step_s'] / other['step_s']:.3f} of {base[config]}"
        rows.append([config, mib(train), mib(process), f"{result['step_s']:.2f}", ratio, step])
    print(f"# ZeRO-3: transformers Llama, {count or '?'} parameters (hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}), sequence {args.seq_len}, batch {args.batch} per replica, AdamW fp32, 4 ranks; "
          "the worst rank of each launch")
    print(f"# {command_line()}")
    print(render(header, rows, args.markdown))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"which to run (default {','.join(CONFIGS)})")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per launch, after one untimed (default 3)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per replica per step (default 2)")
    parser.add_argument("--quick", action="store_true", help="a small Llama and one timed step")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config-one", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())

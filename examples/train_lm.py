r"""Train a small GPT-style byte-level language model with pipeline × data parallelism.

    mpirun -n 4 python examples/train_lm.py --stages 2        # 2 stages × 2 replicas
    mpirun -n 1 python examples/train_lm.py                   # one process, same script
    make demo                                                 # the 2 × 2 run above, set up for you
    hybridpipe-run -np 4 --stages 2 --restarts 2 --checkpoint-dir ckpt python examples/train_lm.py \
        --save-every 50                                       # relaunched after a failure, resumed

The corpus is real text available offline: by default the Python standard library's own source
files on this machine (or ``--data FILE``), read as bytes (vocabulary 256). The first 90 % is for
training, the last 10 % for validation.

The output head's matrix is the token embedding's (``hp.TiedLayerSpec``): with several stages the
first and the last each hold a copy, and their gradients are summed every step; ``--no-tie`` gives the
head its own weight.

Each step, every data replica draws its own random windows (seeded by step and replica), and the
stages of one pipeline draw the same ones — so every stage sees the same batch and the replicas
see different shards, without a sampler. The global batch is replicas × --batch-size sequences.
Because a batch depends only on the step (and the grid), a resumed run sees the batches the
interrupted one would have seen; with the random generators restored from the checkpoint, dropout
continues too, and a restart on the same grid ends with the weights of an uninterrupted run.

Test hook: ``HYBRIDPIPE_TEST_KILL_AT_STEP=K`` makes the last rank kill itself (SIGKILL) at the start
of step K, on the first attempt only (``HYBRIDPIPE_RESTART`` unset or 0): the failure the restart
tests recover from.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

import hybridpipe as hp
from hybridpipe.checkpoint import CHECKPOINT_DIR_ENV, RESTART_ENV, saved_balance

KILL_AT_STEP_ENV = "HYBRIDPIPE_TEST_KILL_AT_STEP"  # test hook: see the module docstring


# ------------------------------------------------------------------ data


def load_corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    """Bytes of ``path``, or of the standard library's .py files (sorted, concatenated)."""
    if path:
        data = Path(path).read_bytes()[:max_bytes]
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for file in sorted(root.rglob("*.py")):
            if "site-packages" in file.parts or "test" in file.parts:
                continue
            try:
                text = file.read_bytes()
            except OSError:
                continue
            chunks.append(text)
            total += len(text)
            if total >= max_bytes:
                break
        data = b"\n".join(chunks)[:max_bytes]
    if len(data) < 10_000:
        raise SystemExit(f"corpus too small ({len(data)} bytes): pass --data FILE with more text")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def sample_batch(data: torch.Tensor, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - length - 1, (batch,), generator=generator)
    windows = torch.stack([data[s:s + length + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


# ------------------------------------------------------------------ model: a list of layers


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        for table in (self.tokens, self.positions):  # GPT-2's scale: as the (tied) head, logits start near 0
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, dim)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_layers(args: argparse.Namespace) -> list[hp.LayerSpec]:
    """The model as LayerSpecs: each rank builds only its own stage's layers. The output head's matrix
    is the token embedding's (one weight, a copy on each of the two stages; --no-tie: two weights)."""
    if getattr(args, "no_tie", False):
        first, last = hp.LayerSpec(Embedding, 256, args.dim, args.seq_len), hp.LayerSpec(Head, args.dim, 256)
    else:
        first = hp.TiedLayerSpec("tokens", Embedding, 256, args.dim, args.seq_len, tied_weight_attr="tokens.weight")
        last = hp.TiedLayerSpec("tokens", Head, args.dim, 256, tied_weight_attr="out.weight")
    return [first] + [hp.LayerSpec(Block, args.dim, args.heads, args.dropout) for _ in range(args.layers)] + [last]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device))


def auto_model(args: argparse.Namespace, train_data: torch.Tensor) -> hp.PipelineModel:
    """--auto: hp.auto profiles the layers on world rank 0, plans for this world and re-makes the grid;
    args then describe the plan (per-replica batch, micro-batches, schedule, checkpoint)."""
    world = hp.size()
    global_batch = args.global_batch or args.batch_size * world
    sample = sample_batch(train_data, args.batch_size, args.seq_len, seed=args.seed)
    model, _ = hp.auto(build_layers(args), lm_loss, sample=sample, global_batch=global_batch, optimizer=None,
                       seed_layers=args.seed, precision=args.precision)
    plan = model.plan
    args.batch_size, args.micro_batches = global_batch // plan.replicas, plan.micro_batches
    args.schedule, args.checkpoint = plan.schedule, plan.checkpoint
    if hp.rank() == 0:
        print(f"hp.auto plan for {world} ranks, global batch {global_batch}: {plan.describe()}; predicted "
              f"{plan.step_seconds * 1e3:.1f} ms per step", flush=True)
    return model


# ------------------------------------------------------------------ training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages P (world size must be a multiple); default: "
                             "$HYBRIDPIPE_PIPELINE_STAGES (set by hybridpipe-run --stages), else 1")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--checkpoint", default="never", choices=["never", "except_last", "always"])
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                        help="ZeRO stage inside each stage's data group: 1 shards AdamW's state, 2 also the "
                             "gradients, 3 also the parameters")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="autocast dtype of every stage (fp16: with the loss scaler all ranks agree on)")
    parser.add_argument("--auto", action="store_true",
                        help="let hp.auto choose stages × replicas, balance, micro-batches, schedule and "
                             "checkpoint for this world (ignores --stages, --micro-batches, --schedule, --checkpoint)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="--auto: sequences per step over all replicas (default: --batch-size × world size)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per replica per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=96)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout after attention and MLP")
    parser.add_argument("--no-tie", action="store_true",
                        help="give the output head its own weight (default: it is the token embedding's, tied "
                             "across the first and last stage)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--data", help="a text file (default: the Python standard library sources)")
    parser.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus size cap")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write the trained weights (one ordinary state_dict) to this file")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where each stage computes: cuda = GPU local_rank mod GPUs (hp.init's placement), "
                             "auto = that GPU where CUDA is available, else the CPU")
    parser.add_argument("--no-progress", action="store_true", help="print lines instead of a progress bar")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="write a sharded checkpoint to --checkpoint-dir every N steps (and at the end)")
    parser.add_argument("--checkpoint-dir", default=os.environ.get(CHECKPOINT_DIR_ENV) or "checkpoints",
                        help=f"default: ${CHECKPOINT_DIR_ENV} (set by hybridpipe-run --checkpoint-dir), "
                             "else ./checkpoints")
    parser.add_argument("--resume", nargs="?", const="auto", metavar="DIR",
                        help="continue from the latest checkpoint in DIR (any grid); with no DIR or `auto`, "
                             "from --checkpoint-dir if it holds one, else from scratch (the default when "
                             f"${CHECKPOINT_DIR_ENV} is set)")
    args = parser.parse_args(argv)
    if args.resume is None and os.environ.get(CHECKPOINT_DIR_ENV):
        args.resume = "auto"
    return args


def stage_device(choice: str) -> torch.device | None:
    """--device as PipelineModel's device= (None: hybridpipe's placement, a GPU where there is one)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False)")
    if choice == "cpu":
        return torch.device("cpu")
    return None


def validation_loss(model: hp.PipelineModel, data: torch.Tensor, args: argparse.Namespace, grid: hp.Grid) -> float:
    model.eval()
    total = 0.0
    for index in range(args.val_batches):
        inputs, targets = sample_batch(data, args.batch_size, args.seq_len,
                                       seed=10**9 + index * grid.data_replicas + grid.replica)
        total += float(lm_loss(model.predict(inputs), targets))
    model.train()
    mean = torch.tensor([total / args.val_batches], dtype=torch.float64)
    return float(hp.allreduce(mean, op=hp.Average, group="data")[0])


def save_weights(model: hp.PipelineModel, path: str, grid: hp.Grid, optimizer=None) -> None:
    """Gathers replica 0's stages on world rank 0 and writes one state_dict keyed like nn.Sequential (ZeRO-3: the
    stage's parameters gathered first, by every replica)."""
    whole = getattr(optimizer, "full_parameters", contextlib.nullcontext)
    with whole():
        mine = {name.removeprefix("layers."): t.detach().cpu().clone() for name, t in model.state_dict().items()}
    if grid.replica != 0:
        return
    pieces = grid.pipe_comm.gather(mine, root=0)
    if grid.stage == 0:
        state = {key: value for piece in pieces for key, value in piece.items()}
        torch.save(state, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    grid = hp.init(pipeline_stages=args.stages)
    leader = grid.rank == 0
    restart = int(os.environ.get(RESTART_ENV) or 0)
    torch.manual_seed(args.seed * 1_000_003 + grid.rank)  # dropout: a stream of its own per rank
    resume_from = args.checkpoint_dir if args.resume == "auto" else args.resume
    # the saved partition, when the stage count is the same: each rank then gets its own generator
    # states back (a profiled balance="time" could come out different after a restart)
    balance = saved_balance(resume_from, grid.pipeline_stages) if resume_from else None
    corpus = load_corpus(args.data, args.max_bytes)
    split = int(0.9 * len(corpus))
    train_data, val_data = corpus[:split], corpus[split:]
    micro = max(1, args.batch_size // args.micro_batches)
    sample, _ = sample_batch(train_data, micro, args.seq_len, seed=args.seed)
    if args.auto:  # the planner chooses the grid (hp.init is re-made), balance, micro-batches and schedule
        model = auto_model(args, train_data)
        grid = hp.grid()
    else:
        model = hp.PipelineModel(build_layers(args), loss_fn=lm_loss, micro_batches=args.micro_batches,
                                 schedule=args.schedule, checkpoint=args.checkpoint, sample_input=sample,
                                 seed_layers=args.seed, balance=balance, precision=args.precision,
                                 device=stage_device(args.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01) \
        if any(True for _ in model.parameters()) else None
    if optimizer is not None:
        optimizer = hp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), zero=args.zero)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
    if leader:
        print(f"hybridpipe {hp.__version__}: {grid.size} ranks = {grid.pipeline_stages} stages × "
              f"{grid.data_replicas} replicas; corpus {len(corpus):,} bytes "
              f"({'--data ' + args.data if args.data else 'Python standard library sources'})")
        print(grid.table())
        print(model.balance_report)
        print(f"global batch {args.batch_size * grid.data_replicas} × {args.seq_len} tokens, "
              f"{args.micro_batches} micro-batches, schedule {args.schedule}, checkpoint {args.checkpoint}, "
              f"precision {args.precision}, zero {args.zero}")
        sys.stdout.flush()
    first_step = 0
    if args.resume:
        if args.resume == "auto":  # an empty or missing directory: start from scratch
            state = hp.resume(args.checkpoint_dir, model, optimizer)
            checkpoint_path, first_step, extra = state.checkpoint, state.step, state.extra
        else:  # a directory named by hand must hold a checkpoint
            info = hp.load_checkpoint(args.resume, model, optimizer)
            checkpoint_path, first_step, extra = args.resume, info["step"], info["extra"]
        if optimizer is not None and "scheduler" in extra:
            scheduler.load_state_dict(extra["scheduler"])
        if leader and checkpoint_path:
            print(f"resumed from {checkpoint_path} at step {first_step} (restart {restart})")
        elif leader:
            print(f"no checkpoint in {args.checkpoint_dir}: starting at step 0 (restart {restart})")
    if leader and os.environ.get(CHECKPOINT_DIR_ENV) and not args.save_every:
        print(f"warning: ${CHECKPOINT_DIR_ENV} is set but --save-every is 0: a restart would start over",
              flush=True)
    kill_at = int(os.environ.get(KILL_AT_STEP_ENV) or -1) if restart == 0 else -1
    initial = validation_loss(model, val_data, args, grid)
    if leader:
        print(f"validation loss at step {first_step}: {initial:.3f} (uniform guess: {math.log(256):.3f})")

    def checkpoint(step: int) -> None:
        extra = {"scheduler": scheduler.state_dict()} if optimizer is not None else {}
        path = hp.save_checkpoint(args.checkpoint_dir, model, optimizer, step=step, extra=extra)
        if leader and progress is None:
            print(f"checkpoint {path}", flush=True)

    progress = None
    if leader and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=first_step, unit="step", dynamic_ncols=True)
    tokens_per_step = args.batch_size * grid.data_replicas * args.seq_len
    start = time.perf_counter()
    for step in range(first_step, args.steps):
        if step == kill_at and grid.rank == grid.size - 1:
            print(f"test hook {KILL_AT_STEP_ENV}: rank {grid.rank} kills itself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = sample_batch(train_data, args.batch_size, args.seq_len,
                                       seed=args.seed * 1_000_003 + step * grid.data_replicas + grid.replica)
        if optimizer is not None:
            optimizer.zero_grad()
        model.measure_activations = step == first_step  # for the memory report: one step is enough
        loss = model.train_step(inputs, targets)
        if optimizer is not None:
            if model.scaler is not None:  # fp16: every rank skips the same overflowing steps
                model.scaler.step(optimizer)
                model.scaler.update()
            else:
                optimizer.step()
            scheduler.step()
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            checkpoint(step + 1)
        if leader:
            rate = tokens_per_step * (step + 1 - first_step) / (time.perf_counter() - start)
            if progress is not None:
                progress.set_postfix(loss=f"{loss:.3f}", tokens_per_s=f"{rate:,.0f}")
                progress.update()
            elif step % 20 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss:.3f}  {rate:,.0f} tokens/s", flush=True)
    if progress is not None:
        progress.close()
    if args.save_every:
        checkpoint(args.steps)
    elapsed = time.perf_counter() - start
    memory = model.memory_report(optimizer)  # collective: every rank's parameters, gradients, state, activations
    final = validation_loss(model, val_data, args, grid)
    if leader:
        print(memory)
        print(f"validation loss after {args.steps} steps: {final:.3f} (before: {initial:.3f}); "
              f"{tokens_per_step * (args.steps - first_step) / elapsed:,.0f} tokens/s over {elapsed:.1f} s")
    if args.save:
        save_weights(model, args.save, grid, optimizer)
        if leader:
            print(f"saved the weights to {args.save}")
    model.close()
    hp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

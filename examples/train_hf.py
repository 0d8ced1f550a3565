r"""Train a transformers model, as transformers writes it, over pipeline × data parallelism.

    hybridpipe-run -np 4 --stages 2 python examples/train_hf.py --model gpt2     # 2 stages × 2 replicas
    mpirun -n 2 python examples/train_hf.py --model llama --stages 2             # 2 stages
    make demo-hf                                                                # the first line, set up for you

The model is built from a small config (no download) and handed to ``hp.PipelineModel`` whole: no layer
list, no re-derived masks or positions; the output head's tie to the embedding is found and kept. The
language models (gpt2, llama, bert, t5) read the Python standard library's sources as bytes (vocabulary
256; BERT learns to fill in masked bytes, T5 to continue a window); the vision models (vit, resnet)
learn a synthetic task (which quadrant of the image is brightest). Needs ``pip install transformers``.
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch
from torch.nn import functional as F

import hybridpipe as hp

LANGUAGE = ("gpt2", "llama", "bert", "t5")


def build(name: str, layers: int, width: int, sequence: int):
    import transformers

    transformers.logging.set_verbosity_error()
    heads = max(width // 32, 2)
    common = dict(vocab_size=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=sequence,
                                         use_cache=False, **common)
        return transformers.GPT2LMHeadModel(config)
    if name == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=4 * width,
                                          num_attention_heads=heads, num_key_value_heads=heads,
                                          max_position_embeddings=sequence, use_cache=False, **common)
        return transformers.LlamaForCausalLM(config)
    if name == "bert":
        config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=4 * width,
                                         num_attention_heads=heads, max_position_embeddings=sequence,
                                         vocab_size=256, pad_token_id=0)
        return transformers.BertForMaskedLM(config)
    if name == "t5":
        config = transformers.T5Config(num_layers=layers // 2, num_decoder_layers=layers // 2, d_model=width,
                                       d_kv=width // heads, d_ff=4 * width, num_heads=heads, vocab_size=256,
                                       use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        return transformers.T5ForConditionalGeneration(config)
    if name == "vit":
        config = transformers.ViTConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=4 * width,
                                        num_attention_heads=heads, image_size=16, patch_size=4, num_labels=4)
        return transformers.ViTForImageClassification(config)
    if name == "resnet":
        config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 64][:max(layers // 2, 2)],
                                           depths=[1] * max(layers // 2, 2), layer_type="basic", num_labels=4)
        return transformers.ResNetForImageClassification(config)
    raise SystemExit(f"unknown --model {name!r}: one of {', '.join(LANGUAGE + ('vit', 'resnet'))}")


def corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for file in sorted(root.rglob("*.py")):
        if "site-packages" in file.parts or "test" in file.parts:
            continue
        chunks.append(file.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batches(name: str, data: torch.Tensor | None, size: int, sequence: int, step: int, replica: int):
    """(inputs, targets) of one replica at one step: the same on every stage of a pipeline."""
    generator = torch.Generator().manual_seed(1000 * step + replica)
    if name in ("vit", "resnet"):
        side = 16 if name == "vit" else 32
        images = torch.randn(size, 3, side, side, generator=generator)
        labels = torch.randint(0, 4, (size,), generator=generator)
        half = side // 2
        for i, label in enumerate(labels.tolist()):
            row, column = divmod(label, 2)
            images[i, :, row * half:(row + 1) * half, column * half:(column + 1) * half] += 1.5
        return {"pixel_values": images}, labels
    starts = torch.randint(0, len(data) - 2 * sequence - 1, (size,), generator=generator)
    windows = torch.stack([data[s:s + sequence + 1] for s in starts.tolist()])
    if name == "bert":
        ids = windows[:, :sequence].clone()
        masked = torch.rand(ids.shape, generator=generator) < 0.15
        targets = torch.where(masked, ids, torch.full_like(ids, -100))
        ids[masked] = 1  # the mask token
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, targets
    if name == "t5":
        follow = torch.stack([data[s + sequence:s + 2 * sequence] for s in starts.tolist()])
        decoder_inputs = torch.cat([torch.zeros(size, 1, dtype=torch.long), follow[:, :-1]], dim=1)
        return {"input_ids": windows[:, :sequence], "decoder_input_ids": decoder_inputs}, follow
    return {"input_ids": windows[:, :sequence]}, windows[:, 1:]


def loss_of(name: str):
    def loss(output, targets):
        logits = output.logits
        if name in ("vit", "resnet"):
            return F.cross_entropy(logits, targets)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2", help=", ".join(LANGUAGE + ("vit", "resnet")))
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages (default: hybridpipe-run's)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="per replica")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    grid = hp.init(pipeline_stages=args.stages) if args.stages else hp.init()
    torch.manual_seed(0)  # the same initial weights on every rank
    module = build(args.model, args.layers, args.width, args.sequence)
    data = corpus() if args.model in LANGUAGE else None
    sample, _ = batches(args.model, data, args.batch_size // args.micro_batches, args.sequence, -1, 0)
    model = hp.PipelineModel(module, loss_fn=loss_of(args.model), micro_batches=args.micro_batches,
                             schedule=args.schedule, sample=sample, split="auto")
    if hp.rank() == 0:
        print(f"{args.model}: {grid.pipeline_stages} stages × {grid.data_replicas} replicas")
        print(model.split_report(), flush=True)
    optimizer = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr),
                                        named_parameters=model.named_parameters())
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        inputs, targets = batches(args.model, data, args.batch_size, args.sequence, step, grid.replica)
        optimizer.zero_grad()
        losses.append(model.train_step(inputs, targets))
        optimizer.step()
        if hp.rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {sum(losses[-10:]) / len(losses[-10:]):.3f}  "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    if hp.rank() == 0:
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        print(f"loss {first:.3f} -> {last:.3f}")
    model.close()
    hp.shutdown()


if __name__ == "__main__":
    main()

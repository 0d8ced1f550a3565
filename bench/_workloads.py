"""The named workloads of ``bench/workloads.py``: each a model built from a fixed seed, its real data (what ships
with the packages the project already uses), a global batch per step, a held-out split and the metric and target
it trains to.

* ``gpt2``: transformers ``GPT2LMHeadModel`` (6 blocks of width 256, 4 heads, tied head), byte-level (vocabulary
  256) on the Python standard library's own sources (examples/train_lm.py's ``load_corpus``), AdamW; the metric
  is the validation loss (nats per byte).
* ``llama``: transformers ``LlamaForCausalLM`` of the same size (SwiGLU MLP 512 wide, rotary positions, untied
  head), the same corpus, batches and metric.
* ``vgg``: bench/stage_replicas.py's VGG-like CNN (five 3x3 convolutions, a 2048-2048-1024-10 head) on
  scikit-learn's digits (8x8, up-sampled to 32x32, three channels), 20 % held out (stratified); Adam (plain
  SGD does not move this batch-norm-free stack from its start in a few hundred steps); the metric is the
  validation accuracy.
* ``lstm``: a GNMT-like stack of LSTM layers (an embedding, four LSTM layers 256 wide with residual connections
  from the third on, as GNMT has, and a byte head), next-byte prediction on the same corpus; Adam; the metric is
  the validation loss.

The corpus's last 10 % is the held-out split of the byte workloads. ``quick=True`` builds tiny versions (a few
thousand to a few hundred thousand parameters) with loose targets, so that every configuration finishes in
seconds: a smoke run, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

WORKLOADS = ("gpt2", "llama", "vgg", "lstm")
VOCAB = 256  # bytes


@dataclasses.dataclass
class Workload:
    """One workload: how to build its model, feed it and judge it (the same on every rank)."""

    name: str
    build: Callable[[], Any]  # a fresh model from the fixed seed: a list of layers or one nn.Module
    is_module: bool  # one nn.Module (split by its unit calls) rather than a layer list
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step -> the global batch of that step
    validation: tuple[torch.Tensor, torch.Tensor]
    metric: str  # "loss" (lower is better) or "accuracy" (higher is better)
    target: float
    global_batch: int
    unit: str  # what the throughput counts: "tokens" or "samples"
    units_per_sample: int
    cut: int  # layer lists: layers on the first of two stages (a cut before the head / mid-stack)
    describe: str
    tied: bool = False  # weights shared between layers that two stages hold (GPT-2's embedding and head)

    def reached(self, value: float) -> bool:
        return value >= self.target if self.metric == "accuracy" else value <= self.target

    def evaluate(self, output: Any, targets: torch.Tensor) -> float:
        """The metric of the model's ``output`` on the held-out ``targets``."""
        if self.metric == "accuracy":
            return float((logits_of(output).argmax(-1) == targets).float().mean())
        return float(self.loss_fn(output, targets))


def logits_of(output: Any) -> torch.Tensor:
    """A transformers ``ModelOutput`` (or its dict / tuple form) or a tensor, as the logits."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, dict):
        return output["logits"]
    return output[0]


def _sequence_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(output).flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------------------------------ data

_corpus_cache: dict[int, torch.Tensor] = {}


def corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's sources as bytes (examples/train_lm.py's ``load_corpus``)."""
    if max_bytes not in _corpus_cache:
        from train_lm import load_corpus

        _corpus_cache[max_bytes] = load_corpus(None, max_bytes)
    return _corpus_cache[max_bytes]


def _byte_data(max_bytes: int, length: int, global_batch: int, validation: int):
    from train_lm import sample_batch

    data = corpus(max_bytes)
    split = int(len(data) * 0.9)
    train, held_out = data[:split], data[split:]
    return (lambda step: sample_batch(train, global_batch, length, 1000 + step)), sample_batch(held_out, validation,
                                                                                                length, 7)


def _digits(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(digits.target, dtype=torch.long)
    train, held_out = train_test_split(list(range(len(labels))), test_size=0.2, random_state=0,
                                       stratify=digits.target)
    return images[train], labels[train], images[held_out], labels[held_out]


# ------------------------------------------------------------------------------------------ models

def _seeded(build: Callable[[], Any]) -> Callable[[], Any]:
    def seeded() -> Any:
        torch.manual_seed(0)
        return build()

    return seeded


def _gpt2(layers: int, width: int, heads: int, length: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=VOCAB,
                                      n_positions=length, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      use_cache=False, bos_token_id=0, eos_token_id=0))


def _llama(layers: int, width: int, heads: int, length: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width,
                                        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=VOCAB,
                                        max_position_embeddings=length, attention_dropout=0.0, use_cache=False,
                                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0))


def vgg_tiny() -> list[nn.Module]:
    """bench/stage_replicas.py's VGG-like CNN with every width divided by 4 (the same 19 layers, the head at the
    same index): the quick run's version."""
    def conv(a: int, b: int) -> list[nn.Module]:
        return [nn.Conv2d(a, b, 3, padding=1), nn.ReLU()]

    return [*conv(3, 8), *conv(8, 8), nn.MaxPool2d(2), *conv(8, 16), *conv(16, 16), nn.MaxPool2d(2),
            *conv(16, 32), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)]


class LSTMLayer(nn.Module):
    """One layer of GNMT's stack: an LSTM over the sequence, with a residual connection where GNMT has one."""

    def __init__(self, width: int, residual: bool) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        return x + y if self.residual else y


def gnmt_like(depth: int, width: int) -> list[nn.Module]:
    """An embedding, ``depth`` LSTM layers (residual from the third on) and a byte head."""
    return [nn.Embedding(VOCAB, width), *(LSTMLayer(width, i >= 2) for i in range(depth)), nn.Linear(width, VOCAB)]


# ------------------------------------------------------------------------------------------ the four

def _language(name: str, quick: bool) -> Workload:
    layers, width, heads, length = (2, 64, 2, 32) if quick else (6, 256, 4, 128)
    global_batch = 24 if quick else 48
    batch, validation = _byte_data(400_000 if quick else 4_000_000, length, global_batch, 48 if quick else 96)
    builder = _gpt2 if name == "gpt2" else _llama
    lr = 3e-3 if quick else 1e-3
    return Workload(
        name=name, build=_seeded(lambda: builder(layers, width, heads, length)), is_module=True,
        loss_fn=_sequence_loss, optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
        batch=batch, validation=validation, metric="loss", target=4.0 if quick else 2.0, global_batch=global_batch,
        unit="tokens", units_per_sample=length, cut=0, tied=name == "gpt2",
        describe=f"transformers {'GPT2LMHeadModel' if name == 'gpt2' else 'LlamaForCausalLM'}, {layers} layers x "
                 f"{width}, {length} bytes, batch {global_batch}")


def _vgg(quick: bool) -> Workload:
    from stage_replicas import HEAD, vgg_like

    train_x, train_y, held_x, held_y = _digits(32)
    global_batch = 24 if quick else 48

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 + step)
        chosen = torch.randint(0, len(train_y), (global_batch,), generator=generator)
        return train_x[chosen], train_y[chosen]

    return Workload(
        name="vgg", build=_seeded(vgg_tiny if quick else lambda: vgg_like(0)), is_module=False,
        loss_fn=F.cross_entropy, optimizer=lambda params: torch.optim.Adam(params, lr=2e-3 if quick else 1e-3),
        batch=batch, validation=(held_x[:348], held_y[:348]), metric="accuracy", target=0.5 if quick else 0.95,
        global_batch=global_batch, unit="samples", units_per_sample=1, cut=HEAD,
        describe=f"VGG-like CNN{' (widths / 4)' if quick else ''}, digits 32x32, batch {global_batch}")


def _lstm(quick: bool) -> Workload:
    depth, width, length = (2, 32, 32) if quick else (4, 256, 64)
    global_batch = 24 if quick else 48
    batch, validation = _byte_data(400_000 if quick else 4_000_000, length, global_batch, 48 if quick else 96)
    return Workload(
        name="lstm", build=_seeded(lambda: gnmt_like(depth, width)), is_module=False, loss_fn=_sequence_loss,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2 if quick else 2e-3), batch=batch,
        validation=validation, metric="loss", target=3.2 if quick else 2.0, global_batch=global_batch,
        unit="tokens", units_per_sample=length, cut=1 + math.ceil(depth / 2),
        describe=f"GNMT-like LSTM stack, {depth} layers x {width}, {length} bytes, batch {global_batch}")


def workload(name: str, quick: bool = False) -> Workload:
    """The workload ``name`` (one of :data:`WORKLOADS`), tiny with ``quick``."""
    if name in ("gpt2", "llama"):
        return _language(name, quick)
    if name == "vgg":
        return _vgg(quick)
    if name == "lstm":
        return _lstm(quick)
    raise SystemExit(f"unknown workload {name!r} (use one of {', '.join(WORKLOADS)})")

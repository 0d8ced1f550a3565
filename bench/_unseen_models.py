"""Models no term of the planner's cost model was fitted or checked on before its predictions were judged on them
(``bench/planner_validation.py --models gelu,wide,deep,gpt2``; docs/planner.md says which models are held out).

Each builder returns ``(layers or module, loss_fn, batch(n, seed) -> (inputs, targets), optimizer factory,
global batch)``, the same on every rank (seeded).

* ``gelu``: ten ``Linear(384) + GELU`` blocks and a 10-class head, cross-entropy, SGD, batch 128: the model a new
  user tried first (the planner once predicted 1.75-2.7x too fast on it).
* ``wide``: three ``Linear(2048) + ReLU`` blocks and a head, batch 64, SGD with momentum: few, heavy layers (large
  gradients to reduce, small activations).
* ``deep``: 32 ``Linear(96) + Tanh`` blocks and a head, batch 256, SGD: many cheap layers, where the per-call costs
  (the framework's, autograd's) weigh more than the arithmetic.
* ``gpt2``: a transformers ``GPT2LMHeadModel`` (4 blocks of width 128, 4 heads, vocabulary 512, 64 tokens,
  tied head) handed in as one module and split by its unit calls, AdamW, batch 16 sequences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

UNSEEN = ("gelu", "wide", "deep", "gpt2")
MODULES = {"gpt2"}
VOCAB, SEQUENCE = 512, 64


def _classes(width: int, classes: int = 10):
    def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(n, width, generator=generator), torch.randint(0, classes, (n,), generator=generator)

    return batch


def _mlp(width: int, depth: int, activation: type[nn.Module]) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), activation()) for _ in range(depth)] + [nn.Linear(width, 10)]


def _lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQUENCE, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQUENCE + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def build(name: str) -> tuple[Any, Any, Any, Any, int]:
    """``name``'s ``(layers or module, loss_fn, batch, optimizer factory, global batch)``."""
    if name == "gelu":
        return (_mlp(384, 10, nn.GELU), F.cross_entropy, _classes(384),
                lambda params: torch.optim.SGD(params, lr=0.01), 128)
    if name == "wide":
        return (_mlp(2048, 3, nn.ReLU), F.cross_entropy, _classes(2048),
                lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9), 64)
    if name == "deep":
        return (_mlp(96, 32, nn.Tanh), F.cross_entropy, _classes(96),
                lambda params: torch.optim.SGD(params, lr=0.01), 256)
    if name == "gpt2":
        return (_gpt2(), _lm_loss, _tokens, lambda params: torch.optim.AdamW(params, lr=1e-3), 16)
    raise ValueError(f"unknown unseen model {name!r} (use one of {', '.join(UNSEEN)})")

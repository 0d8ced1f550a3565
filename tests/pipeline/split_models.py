"""Models for the split-module tests: transformers models from small configs (float64, dropout 0), and
hand-written ones (a U-Net with skips, a block applied twice, a keyword-only forward returning a dict, a
forward that branches on an activation). Each factory returns ``(module, batch(n, seed), loss_fn)``, where
``batch`` gives ``(inputs, targets)`` for ``n`` samples."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 48
SEQUENCE = 12


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n, SEQUENCE), generator=torch.Generator().manual_seed(seed))


def _lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def gpt2(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config), lambda n, seed: ({"input_ids": _ids(n, seed)}, _ids(n, seed + 1)), _lm_loss


def llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config), lambda n, seed: ({"input_ids": _ids(n, seed)}, _ids(n, seed + 1)), _lm_loss


def bert(layers: int = 4):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(num_hidden_layers=layers, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=0)
    torch.manual_seed(0)

    def batch(n: int, seed: int):
        ids = _ids(n, seed)
        mask = torch.ones_like(ids)
        mask[:, -3:] = 0  # padding at the end of every sequence
        mask[0, :] = 1
        return {"input_ids": ids, "attention_mask": mask}, _ids(n, seed + 1)

    return BertForMaskedLM(config), batch, _lm_loss


def t5(layers: int = 2):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(num_layers=layers, num_decoder_layers=layers, d_model=16, d_kv=8, d_ff=32, num_heads=2,
                      vocab_size=VOCAB, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=1)
    torch.manual_seed(0)

    def batch(n: int, seed: int):
        return {"input_ids": _ids(n, seed), "decoder_input_ids": _ids(n, seed + 2)}, _ids(n, seed + 1)

    return T5ForConditionalGeneration(config), batch, _lm_loss


def vit(layers: int = 4):
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(num_hidden_layers=layers, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                       image_size=8, patch_size=4, num_channels=3, num_labels=5, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)

    def batch(n: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(n, 3, 8, 8, generator=generator)}, \
            torch.randint(0, 5, (n,), generator=generator)

    return ViTForImageClassification(config), batch, _classification_loss


def resnet(layers: int = 2):
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1] * layers, layer_type="basic",
                          num_labels=5, num_channels=3)
    torch.manual_seed(0)

    def batch(n: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(n, 3, 16, 16, generator=generator)}, \
            torch.randint(0, 5, (n,), generator=generator)

    return ResNetForImageClassification(config), batch, _classification_loss


def _classification_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output["logits"] if isinstance(output, dict) else output
    return F.cross_entropy(logits.float(), targets)


# ------------------------------------------------------------------ hand-written


class _Conv(nn.Module):
    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(inputs, outputs, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x))


class UNet(nn.Module):
    """Two levels down, two up: the encoder's outputs are used by the decoder blocks (skips across stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList([_Conv(2, 4), _Conv(4, 8)])
        self.middle = _Conv(8, 8)
        self.up = nn.ModuleList([_Conv(16, 4), _Conv(8, 4)])
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.avg_pool2d(x, 2)
        x = self.middle(x)
        for block in self.up:
            x = F.interpolate(x, scale_factor=2.0)
            x = block(torch.cat([x, skips.pop()], dim=1))
        return self.head(x)


def unet():
    torch.manual_seed(0)

    def batch(n: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(n, 2, 8, 8, generator=generator), torch.randint(0, 3, (n, 8, 8), generator=generator)

    return UNet(), batch, lambda output, targets: F.cross_entropy(output, targets)


class SharedLoop(nn.Module):
    """One block applied twice, in a loop, between two others: its weight is used on two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for block in self.blocks:
            x = torch.tanh(self.shared(x))
            x = torch.tanh(block(x))
        return self.head(x)


def shared_loop():
    torch.manual_seed(0)

    def batch(n: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)

    return SharedLoop(), batch, lambda output, targets: F.cross_entropy(output, targets)


class KeywordDict(nn.Module):
    """A keyword-only forward with a mask, returning a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 5)

    def forward(self, *, tokens: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        x = self.embed(tokens) * scale
        weights = mask.unsqueeze(-1).to(x.dtype)
        for layer in self.layers:
            x = x + torch.tanh(layer(x)) * weights
        pooled = (self.norm(x) * weights).sum(1) / weights.sum(1)
        return {"logits": self.out(pooled), "pooled": pooled}


def keyword_dict():
    torch.manual_seed(0)

    def batch(n: int, seed: int):
        ids = _ids(n, seed)
        mask = (ids % 5 != 0).long()
        mask[:, 0] = 1
        return {"tokens": ids, "mask": mask, "scale": 0.5}, \
            torch.randint(0, 5, (n,), generator=torch.Generator().manual_seed(seed + 1))

    return KeywordDict(), batch, _classification_loss


class Branching(nn.Module):
    """Branches in Python on an activation's value: cannot be cut between the branch and what it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        x = self.layers[1](x)
        if x.mean() > 0:
            x = -x
        x = self.layers[2](x)
        return self.layers[3](x)


MODELS: dict[str, Callable[[], tuple[nn.Module, Any, Any]]] = {
    "gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5, "vit": vit, "resnet": resnet,
    "unet": unet, "shared_loop": shared_loop, "keyword_dict": keyword_dict,
}

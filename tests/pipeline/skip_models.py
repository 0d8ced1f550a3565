"""Models with skip connections for the skip tests (not a test file): a projection stashed early, added back late."""

from __future__ import annotations

import torch
from torch import nn

import hybridpipe as hp

WIDTH, CLASSES = 8, 4


@hp.skippable(stash=["residual"])
class StashProjection(nn.Module):
    """Passes x on and stashes a projection of it (its weight trains only through the skip's gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.projection = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hp.stash("residual", self.projection(x))
        return x


@hp.skippable(pop=["residual"])
class AddBack(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + hp.pop("residual")


@hp.skippable(stash=["inner"])
class StashInner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hp.stash("inner", x * 0.5)
        return x


@hp.skippable(pop=["inner"])
class PopInner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) + hp.pop("inner")


def skip_model(seed: int = 0) -> nn.Sequential:
    """11 layers: the stash at layer 2, the pop at layer 9 (balance [3, 8] or [3, 2, 2, 4] puts them on the first
    and the last stage), and a skip inside the last stage (layers 7 and 8)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), StashProjection(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         StashInner(), PopInner(), AddBack(), nn.Linear(WIDTH, CLASSES))

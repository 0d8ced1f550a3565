"""A model for ``python -m hybridpipe.plan``: the benchmarks' MLP (16 × (Linear(1024, 1024) + Tanh)).

    python -m hybridpipe.plan examples/plan_mlp.py:build --sample-batch 32 --global-batch 256 --ranks 8 \
        --ranks-per-host 4 --explain

``build()`` returns what the planner needs: the layers (as ``hp.PipelineModel`` takes them), the
loss, and ``sample(n)`` giving ``(inputs, targets)`` of ``n`` samples.
"""

import torch
from torch import nn


def build(width: int = 1024, depth: int = 16):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]

    def sample(n: int):
        return torch.randn(n, width), torch.randn(n, width).clamp_(-0.9, 0.9)

    return layers, nn.MSELoss(), sample

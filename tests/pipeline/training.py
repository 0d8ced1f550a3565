"""Helpers shared by the pipeline MPI tests (not a test file)."""

from __future__ import annotations

import torch

import hybridpipe as hp


def train_pipeline(model: hp.PipelineModel, data, lr: float = 0.1) -> list[float]:
    """SGD over ``data`` with ``model.train_step``; returns the losses."""
    parameters = list(model.parameters())  # a stage may hold only parameter-free layers (Tanh)
    optimizer = torch.optim.SGD(parameters, lr=lr) if parameters else None
    losses = []
    for inputs, targets in data:
        if optimizer:
            optimizer.zero_grad()
        losses.append(model.train_step(inputs, targets))
        if optimizer:
            optimizer.step()
    return losses

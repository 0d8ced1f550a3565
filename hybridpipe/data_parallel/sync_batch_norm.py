"""SyncBatchNorm: batch normalization whose batch statistics are those of the whole group's batch (Horovod's).

In training, each rank computes per-channel ``[count, sum, sum of squares]`` of its own batch; one
differentiable allreduce (``op=hp.Sum``) of them gives every rank the statistics of the concatenation of
all ranks' batches, so ``SyncBatchNorm`` over ranks holding ``b`` rows each normalizes exactly as
``torch.nn.BatchNorm*d`` over the global batch of ``n·b`` rows. The backward pass goes through the same
allreduce (its gradient is the allreduce of the gradient), so the input gradients are those of the sum
of the ranks' losses, as in one process on the global batch. Running statistics are updated with the
global mean and the global unbiased variance. Ranks may hold different numbers of rows (even none).

Design reason: Horovod gathers per-rank means and variances with CUDA-only torch kernels
(``batch_norm_gather_stats_with_counts``); sums and counts reduce with one allreduce on any device and
keep the arithmetic visible. Statistics are accumulated in float64 so that ``E[x²] − E[x]²`` does not
cancel badly for inputs far from zero.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 — torch's convention
from torch.nn.modules.batchnorm import _BatchNorm

from ..collectives.allreduce import allreduce
from ..collectives.common import Sum
from ..comm import context

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the batch of every rank of a group (Horovod's ``hvd.SyncBatchNorm``).

    Takes ``torch.nn.BatchNorm*d``'s arguments and inputs of any of their shapes ``(N, C, ...)``. In
    ``eval()`` mode (or without batch statistics) it is plain batch normalization with the running
    statistics, no communication. Every rank of the group must call it in training mode the same number
    of times (it is a collective).

    Args:
        num_features: ``C``.
        eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm1d``.
        process_set: a hp.ProcessSet (default: every rank); ``group``: hybridpipe's spelling ("data" for the
            replicas of a pipeline stage).

    Example:
        >>> bn = hp.SyncBatchNorm(16)              # instead of nn.BatchNorm2d(16)
        >>> y = bn(torch.randn(8, 16, 4, 4))        # normalized with every rank's 8 rows
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: Any = None, group: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.group = context.resolve_group(group, process_set, "SyncBatchNorm")

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 — torch's name
        if input.dim() < 2:
            raise ValueError(f"hp.SyncBatchNorm expects an input of shape (N, C, ...) with at least 2 dimensions "
                             f"(got {input.dim()}D of shape {tuple(input.shape)})")
        if input.shape[1] != self.num_features:
            raise ValueError(f"hp.SyncBatchNorm({self.num_features}) got {input.shape[1]} channels "
                             f"(input shape {tuple(input.shape)})")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        self._check_input_dim(input)
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        channels = self.num_features
        rows = input.transpose(0, 1).reshape(channels, -1).to(torch.float64)  # (C, N·spatial)
        local = torch.cat([torch.full((1,), float(rows.shape[1]), dtype=torch.float64, device=input.device),
                           rows.sum(1), (rows * rows).sum(1)])
        total = allreduce(local, op=Sum, name="SyncBatchNorm.stats", group=self.group)
        count = total[0].detach()
        if float(count) <= 1:
            raise ValueError(f"hp.SyncBatchNorm: expected more than 1 value per channel over all ranks in training "
                             f"(got {int(count)}; input shape here {tuple(input.shape)})")
        mean = total[1:1 + channels] / count
        variance = (total[1 + channels:] / count - mean * mean).clamp_min(0.0)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = variance * (count / (count - 1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        shape = (1, channels) + (1,) * (input.dim() - 2)
        scale = torch.rsqrt(variance + self.eps).to(input.dtype).reshape(shape)
        output = (input - mean.to(input.dtype).reshape(shape)) * scale
        if self.affine:
            output = output * self.weight.reshape(shape) + self.bias.reshape(shape)
        return output


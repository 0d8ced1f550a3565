"""fp16 training through the pipeline: a dynamic loss scaler whose skip decision every rank shares.

``hp.PipelineModel(..., precision="fp16")`` runs every stage's forward (and re-computation, and the
loss) under ``torch.autocast`` in float16 and multiplies each micro-batch's loss by the current
scale before its backward, so the gradients of every stage come out scaled. ``model.scaler`` (a
:class:`LossScaler`) then works like ``torch.amp.GradScaler``::

    loss = model.train_step(x, y)
    model.scaler.step(opt)        # average over replicas, unscale, agree on inf/nan, step unless found
    model.scaler.update()         # halve the scale after a skipped step, double it after N good ones

and with clipping (unscale first, so the norm is the true one)::

    model.scaler.unscale_(opt)
    hp.clip_grad_norm_(model, 1.0)
    model.scaler.step(opt)
    model.scaler.update()

Why agreed: an overflow usually happens on one stage (or one replica) only. If that rank alone
skipped its step, the stages would hold parameters of different steps. ``unscale_`` therefore ends
with one allreduce (max) of a found-inf flag over every rank of the job, so all stages and replicas
skip the same steps and keep the same scale.
"""

from __future__ import annotations

from typing import Any

import torch

from ..collectives.allreduce import allreduce_nograd
from ..collectives.common import Max
from ..errors import UsageError

__all__ = ["LossScaler"]


class LossScaler:
    """Dynamic loss scaling agreed by every stage and replica (``torch.amp.GradScaler``'s rule).

    Args:
        init_scale: the first scale (2**16, as torch's).
        growth_factor: multiplies the scale after ``growth_interval`` steps in a row without inf/nan.
        backoff_factor: multiplies the scale after a step with inf/nan (which is skipped).
        growth_interval: see ``growth_factor``.
        group: the ranks that agree (default ``"world"``: every stage and replica).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group: Any = "world") -> None:
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"LossScaler needs init_scale > 0, growth_factor > 1 and 0 < backoff_factor < 1 (got "
                             f"{init_scale}, {growth_factor}, {backoff_factor})")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"LossScaler growth_interval must be a positive int (got {growth_interval!r})")
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = growth_interval
        self.group = group
        # the gradients it unscales are averaged over this many replicas (a PipelineModel sets its grid's data
        # replicas): each replica's losses are scaled by scale / replicas, so that every micro-batch's backward
        # carries the values one process would on the global batch (the same overflows), and unscaling the
        # average multiplies by replicas / scale
        self.replicas = 1
        self._growth_tracker = 0
        self._unscaled = False
        self._found_inf: bool | None = None
        self.skipped_steps = 0

    def get_scale(self) -> float:
        """The scale: the next ``train_step`` multiplies its losses by it (divided by ``replicas``)."""
        return self._scale

    @property
    def loss_multiplier(self) -> float:
        """What each replica's losses are multiplied by: ``scale / replicas`` (see ``replicas``)."""
        return self._scale / self.replicas

    @property
    def scale(self) -> float:
        return self._scale

    @staticmethod
    def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        if getattr(optimizer, "zero", 0):
            return list(optimizer.shard_gradients())
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Averages the gradients over replicas (a DistributedOptimizer's ``synchronize()``), divides them by
        the scale, and agrees with every rank whether some gradient anywhere is inf/nan. Returns it."""
        if self._unscaled:
            raise UsageError("LossScaler.unscale_() was already called since the last update(): call it "
                             "once per step, before clipping")
        if callable(getattr(optimizer, "synchronize", None)) and not getattr(optimizer, "synchronized", True):
            optimizer.synchronize()
        inverse = torch.tensor(1.0 / self.loss_multiplier, dtype=torch.float32)
        found = False
        with torch.no_grad():
            for grad in self._gradients(optimizer):
                grad.mul_(inverse.to(grad.dtype) if grad.dtype != torch.float32 else inverse)
                if not found and not bool(torch.isfinite(grad).all()):
                    found = True
        flag = torch.tensor([1 if found else 0], dtype=torch.int32)
        self._found_inf = bool(allreduce_nograd(flag, op=Max, group=self.group)[0])
        self._unscaled = True
        return self._found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscales (unless ``unscale_`` ran this step) and steps ``optimizer`` unless some rank found an
        inf/nan gradient. Returns whether it stepped (the same on every rank)."""
        if not self._unscaled:
            self.unscale_(optimizer)
        if self._found_inf:
            if hasattr(optimizer, "synchronized"):
                optimizer.synchronized = False
            self.skipped_steps += 1
            return False
        if callable(getattr(optimizer, "skip_synchronize", None)):
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        return True

    def update(self) -> None:
        """After ``step``: halves the scale when the step was skipped, grows it after ``growth_interval``
        good steps in a row."""
        if self._found_inf is None:
            raise UsageError("LossScaler.update() before step(): call model.scaler.step(opt) first")
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._unscaled, self._found_inf = False, None

    def state_dict(self) -> dict[str, Any]:
        """The scale, the growth rule and its progress, and the count of skipped steps: what a checkpoint
        saves (``hp.save_checkpoint`` does, for ``model.scaler``) so that a resumed run scales as an
        uninterrupted one."""
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "growth_tracker": self._growth_tracker,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` (``skipped_steps`` may be missing: 0)."""
        needed = ("scale", "growth_factor", "backoff_factor", "growth_interval", "growth_tracker")
        missing = [key for key in needed if key not in state]
        if missing:
            raise UsageError(f"LossScaler.load_state_dict: the state lacks {missing} (got keys "
                             f"{sorted(state)}): pass what LossScaler.state_dict() returned")
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._unscaled, self._found_inf = False, None

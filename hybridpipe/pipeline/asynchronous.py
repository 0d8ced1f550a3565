"""Weight versions for the asynchronous schedules: PipeDream's weight stashing and PipeDream-2BW.

Design reasons:

* A *version* of a stage's weights is the number of optimizer updates the stage had applied.
  :class:`WeightStash` keeps read-only copies (snapshots) of the versions that a micro-batch in
  flight used or that a future forward may still ask for, and drops every other one.
* A forward runs the chunk's module with a snapshot's tensors in place of its parameters
  (``torch.func.functional_call``), so the autograd graph refers to the snapshot. Updates change
  the live parameters in place while micro-batches are in flight, and each backward still
  differentiates at exactly the weights its forward used. After a backward the snapshot's
  gradients are added to the live parameters' ``.grad``, which the update consumes.
* Which version a forward uses is the policy:

  - ``"pipedream"``: the newest (the stage's current weights); with ``vertical_sync`` the one
    the first stage used for that micro-batch, which travels with the activation;
  - ``"2bw"``: micro-batch ``m`` of mini-batch ``t = m // M`` uses ``max(t - 1, 0)`` — the
    double-buffered weights of PipeDream-2BW, one update behind (counted from the last
    :meth:`WeightStash.restart`, i.e. a loaded checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hybridpipe import running
from hybridpipe.errors import InternalError, UsageError
from hybridpipe.gradient_sync import drivers_of

__all__ = ["WeightStash", "install_step_guard"]


class _Snapshot:
    """One version of a chunk's parameters, as leaf tensors that gradients accumulate into."""

    def __init__(self, version: int, parameters: dict[str, nn.Parameter]) -> None:
        self.version = version
        self.tensors = {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in parameters.items()}


class WeightStash:
    """The weight versions of one chunk of an asynchronous pipeline.

    Args:
        module: The chunk's layers.
        policy: ``"pipedream"`` or ``"2bw"``.
        vertical_sync: PipeDream's vertical sync (``policy="pipedream"`` only).
        micro_batches: ``M`` (``2bw``: micro-batches per mini-batch).
    """

    def __init__(self, module: nn.Module, policy: str, vertical_sync: bool, micro_batches: int) -> None:
        self.module, self.policy, self.vertical_sync, self.micro_batches = module, policy, vertical_sync, micro_batches
        self.parameters = dict(module.named_parameters())
        self.version = 0
        self._snapshots: dict[int, _Snapshot] = {}
        self._users: dict[int, int] = {}  # version -> micro-batches in flight that use it
        self._floor = 0  # no future forward asks for a version below this
        self.peak_versions = 0
        self._base_version, self._base_micro_batch = 0, 0  # 2BW counts mini-batches from here
        self._take()

    def restart(self, next_micro_batch: int) -> None:
        """The live weights were replaced (a checkpoint was loaded) with nothing in flight: they are
        the only version now, and 2BW's mini-batches count again from ``next_micro_batch``."""
        if self._users:
            raise UsageError("cannot restart the weight versions while micro-batches are in flight: "
                             "call model.flush() first")
        self._snapshots.clear()
        self._base_version, self._base_micro_batch = self.version, next_micro_batch
        self._floor = self.version
        self._take()

    # ------------------------------------------------------------------ versions

    def _take(self) -> None:
        self._snapshots[self.version] = _Snapshot(self.version, self.parameters)
        self.peak_versions = max(self.peak_versions, len(self._snapshots))

    def forward_version(self, micro_batch: int, carried: int | None) -> int:
        """The version the forward of ``micro_batch`` uses (``carried``: the first stage's, when
        the activation brought one)."""
        if self.policy == "2bw":
            version = self._base_version + max((micro_batch - self._base_micro_batch) // self.micro_batches - 1, 0)
        elif self.vertical_sync and carried is not None:
            version = carried
        else:
            version = self.version
        if version not in self._snapshots:
            raise InternalError(
                f"weight version {version} for micro-batch {micro_batch} is no longer kept (this stage is at "
                f"version {self.version}, keeps {sorted(self._snapshots)}); this is a bug in hybridpipe's "
                "asynchronous schedule, please report it"
            )
        self._floor = max(self._floor, version)
        return version

    def acquire(self, version: int) -> dict[str, torch.Tensor]:
        """The tensors of ``version`` for a forward; held until :meth:`release`."""
        self._users[version] = self._users.get(version, 0) + 1
        return self._snapshots[version].tensors

    def release(self, version: int) -> None:
        """After a micro-batch's backward: adds the gradients of ``version``'s tensors to the live
        parameters' ``.grad`` and lets the version go when nothing needs it any more."""
        for name, tensor in self._snapshots[version].tensors.items():
            if tensor.grad is None:
                continue
            live = self.parameters[name]
            if live.grad is None:
                live.grad = tensor.grad
            else:
                live.grad.add_(tensor.grad)
            tensor.grad = None
        self._users[version] -= 1
        if not self._users[version]:
            del self._users[version]
        self._prune()

    def updated(self, next_forward: int) -> None:
        """The live parameters were just updated: version + 1 (``next_forward``: the id of the next
        micro-batch this stage will forward, for 2BW's rule)."""
        self.version += 1
        if self.policy == "2bw":
            batch = (next_forward - self._base_micro_batch) // self.micro_batches
            self._floor = max(self._floor, self._base_version + batch - 1)
        elif not self.vertical_sync:
            self._floor = self.version
        self._prune()  # before the copy: a version nothing needs is gone before the new one exists
        self._take()

    def _prune(self) -> None:
        for version in [v for v in self._snapshots if v < self._floor and v not in self._users]:
            del self._snapshots[version]

    @property
    def kept(self) -> list[int]:
        """Versions held now."""
        return sorted(self._snapshots)

    def call(self, version_tensors: dict[str, torch.Tensor]) -> Callable[[Any], Any]:
        """The chunk's forward with ``version_tensors`` in place of its parameters."""
        return lambda x: torch.func.functional_call(self.module, version_tensors, (x,))


class StepGuard:
    """The job's optimizer step hook of the asynchronous pipelines (a slot of the running job: hp.shutdown closes
    it, which removes the hook)."""

    def __init__(self) -> None:
        self.hook = register_optimizer_step_pre_hook(_step_guard)

    def close(self) -> None:
        self.hook.remove()


def install_step_guard() -> None:
    """Makes ``step()`` of any optimizer over an asynchronous pipeline's parameters raise, unless the
    pipeline itself calls it (a ``U`` action): a second update would break the weight versions. Installed once
    per job (the running job's :class:`StepGuard` slot; hp.shutdown removes it)."""
    running.current("PipelineModel").slot(StepGuard, StepGuard)


def _step_guard(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    job = running.current_or_none()
    if job is None:
        return
    drivers = drivers_of(job).live()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            driver = drivers_of(job).runner_of(parameter, drivers)  # the pipeline that runs it (gradient_sync.py)
            if driver is None or driver.updates_itself is None:
                continue
            if driver.updating is optimizer:
                return
            raise UsageError(
                f"schedule {driver.updates_itself!r} updates the weights inside the pipeline (the optimizer given "
                "as optimizer= steps after each scheduled update): do not call step() yourself; "
                "model.train_step(x, y) trains, model.flush() applies what is still in flight")

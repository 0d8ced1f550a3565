"""The stage executor: runs one stage's action list, moving values between stage processes over MPI.

Design reasons:

* One loop over the stage's list of :class:`~hybridpipe.pipeline.schedule.Action`. Sends and
  receives follow from the data flow (see ``schedule.py``): a forward on stage ``s > 0`` takes
  its input from ``s - 1``, a forward on ``s < P - 1`` sends its output to ``s + 1``; a backward
  on ``s < P - 1`` takes the output gradient from ``s + 1`` and one on ``s > 0`` sends the input
  gradient to ``s - 1``.
* Overlap: every receive of a step (header first, see ``comm/p2p.py``) is posted when the step
  starts, payload receives are posted as soon as a header is in (each action polls), and no
  send is waited for before the end of the step.
* Tags: micro-batch ``m`` uses ``4·(m mod 4096)`` for activations and ``+2`` for gradients (each
  message takes two tags). MPI matches messages of one (source, tag) in order, so tags may wrap.
* Re-materialization: a micro-batch that is not stored runs its forward under ``no_grad`` and
  keeps only its input and the RNG state; its backward re-runs the forward with the RNG state
  restored (same dropout masks) and then back-propagates. Outputs of such a forward are marked
  "requires grad" for the next stage when they are floating point, as torch.utils.checkpoint
  does; a gradient that comes back as ``None`` is skipped.
* Failure: an exception on one stage is sent to its neighbours on a dedicated error tag; every
  wait also watches those, so the neighbours raise :class:`~hybridpipe.comm.p2p.RemoteError`
  and forward it, and the whole pipeline raises instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hybridpipe import _trace as timeline
from hybridpipe.comm import p2p
from hybridpipe.errors import HybridPipeError
from hybridpipe.pipeline.microbatch import iter_tensors, map_tensors
from hybridpipe.pipeline.schedule import Action, ActionKind

__all__ = ["CHECKPOINT_MODES", "PipelineBroken", "StageExecutor", "StepResult"]

CHECKPOINT_MODES = ("never", "except_last", "always")
_TAG_PERIOD = 4096
_RESULT_TAG = 4 * _TAG_PERIOD  # loss / predict output from the last stage to every stage
_backward_phase: str | None = None
"""While a stage runs a backward: "partial" (more micro-batches' backwards follow in this step) or
"final" (the step's last backward on this stage: gradients become final as it runs). None otherwise.
Gradient hooks (DistributedOptimizer) read it to start a parameter's allreduce at the right time."""


class PipelineBroken(HybridPipeError):
    """The pipeline failed in an earlier step; its message queues are in an unknown state."""


def _forward_tag(micro_batch: int) -> int:
    return 4 * (micro_batch % _TAG_PERIOD)


def _backward_tag(micro_batch: int) -> int:
    return 4 * (micro_batch % _TAG_PERIOD) + 2


class _RngState:
    """CPU (and current CUDA device) RNG state, to replay a forward with the same dropout masks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def replay(self) -> Any:
        devices = [self.device] if self.device.type == "cuda" else []
        context = torch.random.fork_rng(devices=devices, enabled=True)
        state = self

        class _Replay:
            def __enter__(self_inner) -> None:
                context.__enter__()
                torch.set_rng_state(state.cpu)
                if state.cuda is not None:
                    torch.cuda.set_rng_state(state.cuda, state.device)

            def __exit__(self_inner, *exc: Any) -> Any:
                return context.__exit__(*exc)

        return _Replay()


class StepResult:
    """What one executed step left behind (for the caller and for tests)."""

    def __init__(self) -> None:
        self.loss = 0.0                 # weighted mean loss (last stage; then sent to all)
        self.outputs: list[Any] = []    # last stage, forward-only: per micro-batch outputs
        self.peak_stored = 0            # most micro-batches whose activations were held at once
        self.recomputed = 0             # forwards re-run during backward
        self.last_backward_finished = 0.0  # time.monotonic() when this stage's last backward ended


class StageExecutor:
    """Runs one stage of a pipeline.

    Args:
        module: This stage's layers as one callable module (called with one argument).
        stage: This stage's index ``s``.
        stages: ``P``.
        comm: The pipeline's communicator (rank ``s`` = stage ``s``), private to this executor.
        device: Where this stage computes.
    """

    def __init__(self, module: nn.Module, stage: int, stages: int, comm: Any, device: torch.device) -> None:
        self.module, self.stage, self.stages, self.comm, self.device = module, stage, stages, comm, device
        self.first, self.last = stage == 0, stage == stages - 1
        self._errors = [p2p.receive_error(peer, comm) for peer in self._neighbours()]
        self._broken: str | None = None
        self._sends: list[p2p.Send] = []
        self._steps = 0

    def _neighbours(self) -> list[int]:
        return [peer for peer in (self.stage - 1, self.stage + 1) if 0 <= peer < self.stages]

    # ------------------------------------------------------------------ messaging helpers

    def _send(self, value: Any, dest: int, tag: int) -> None:
        self._sends.append(p2p.send(value, dest, tag, self.comm))

    def _receive(self, source: int, tag: int, requires_grad: bool) -> p2p.Receive:
        return p2p.Receive(source, tag, self.comm, device=self.device, requires_grad=requires_grad)

    def _drain_sends(self) -> None:
        """Waits for this step's sends while watching for a neighbour's failure."""
        for send in self._sends:
            send.wait(abort=self._errors)
        self._sends = []

    def close(self) -> None:
        """Withdraws the error receives (call before the communicator is freed)."""
        for error in self._errors:
            error.cancel()
        self._errors = []

    # ------------------------------------------------------------------ running a step

    def run(
        self,
        actions: Sequence[Action],
        micro_batches: int,
        inputs: Sequence[Any] | None,
        targets: Sequence[Any] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        weights: Sequence[float] | None = None,
        checkpoint: str = "never",
        train: bool = True,
    ) -> StepResult:
        """Executes ``actions`` for one mini-batch; every stage of the pipeline must call it.

        Args:
            actions: This stage's action list (validated by the caller).
            micro_batches: ``M``.
            inputs: Stage 0: the ``M`` input micro-batches (ignored elsewhere).
            targets: Last stage, training: the ``M`` target micro-batches.
            loss_fn: Last stage, training: ``loss_fn(output, target)`` → scalar mean loss.
            weights: Last stage, training: micro-batch weights (size / batch size).
            checkpoint: "never", "except_last" or "always".
            train: False for a forward-only step (``predict``): outputs are collected on the last
                stage and sent to every stage, no gradients.

        Returns:
            A :class:`StepResult`; ``loss`` (training) and ``outputs`` (forward-only) are the same
            on every stage.
        """
        if self._broken is not None:
            raise PipelineBroken(f"this pipeline failed in an earlier step ({self._broken}); build a new "
                                 "PipelineModel (and new communicators) to go on")
        self._steps += 1
        try:
            with timeline.span("train_step" if train else "predict", "step", index=self._steps):
                return self._run(actions, micro_batches, inputs, targets, loss_fn, weights, checkpoint, train)
        except BaseException as error:
            self._fail(error)
            raise

    def _fail(self, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        self._broken = text
        came_from = getattr(error, "source", None)
        if isinstance(error, p2p.RemoteError):
            text = str(error)
        else:
            text = f"stage {self.stage} (rank {self.comm.rank} of the pipeline) raised {text}"
        # the sends are dropped, not waited for: each keeps its buffers until MPI is done with them
        for peer in self._neighbours():
            if peer != came_from:
                p2p.send_error(text, self.stage, peer, self.comm)
        self._sends = []

    def _wait(self, receive: p2p.Receive, what: str = "value") -> Any:
        if not timeline.enabled():
            return receive.wait(abort=self._errors)
        start = time.monotonic()
        try:
            return receive.wait(abort=self._errors)
        finally:
            timeline.record(f"wait {what}", "recv", "p2p", start, time.monotonic(), {"from": receive.source})

    def _run(self, actions: Sequence[Action], micro_batches: int, inputs: Sequence[Any] | None,
             targets: Sequence[Any] | None, loss_fn: Any, weights: Sequence[float] | None, checkpoint: str,
             train: bool) -> StepResult:
        global _backward_phase
        result = StepResult()
        forward_in: dict[int, p2p.Receive] = {}
        backward_in: dict[int, p2p.Receive] = {}
        if not self.first:
            forward_in = {m: self._receive(self.stage - 1, _forward_tag(m), train) for m in range(micro_batches)}
        if train and not self.last:
            backward_in = {m: self._receive(self.stage + 1, _backward_tag(m), False) for m in range(micro_batches)}
        stored: dict[int, tuple] = {}
        outputs: list[Any] = [None] * micro_batches
        last_backward = max((i for i, a in enumerate(actions) if a.kind is ActionKind.BACKWARD), default=-1)

        def progress() -> None:
            # Post payload receives for headers that arrived meanwhile. Headers open in posting order,
            # so each direction stops at its first header not yet in: O(arrived) per action, not O(M).
            for pending in (forward_in, backward_in):
                for receive in pending.values():
                    receive.poll()
                    if not receive.opened:
                        break
            # (a neighbour's error is seen by the next wait, which watches the error receives)

        for index, action in enumerate(actions):
            progress()
            m = action.micro_batch
            if action.kind is ActionKind.FORWARD:
                x = self._move(inputs[m]) if self.first else self._wait(forward_in.pop(m), f"activation {m}")
                forward_start = time.monotonic()
                if not train:
                    with torch.no_grad():
                        y = self.module(x)
                    if self.last:
                        outputs[m] = y
                    else:
                        self._send(y, self.stage + 1, _forward_tag(m))
                    timeline.record(f"F{m}", "forward", "compute", forward_start, time.monotonic(),
                                    {"stage": self.stage, "micro_batch": m})
                    continue
                keep_graph = checkpoint == "never" or (checkpoint == "except_last" and m == micro_batches - 1)
                if keep_graph:
                    y = self.module(x)
                    if self.last:
                        loss = loss_fn(y, self._move(targets[m]))
                        result.loss += float(loss.detach()) * weights[m]
                        stored[m] = ("graph", x, loss * weights[m])
                    else:
                        stored[m] = ("graph", x, y)
                        self._send(y, self.stage + 1, _forward_tag(m))
                else:
                    rng = _RngState(self.device)
                    with torch.no_grad():
                        y = self.module(x)
                        if self.last:
                            result.loss += float(loss_fn(y, self._move(targets[m]))) * weights[m]
                    stored[m] = ("recompute", x, rng)
                    if not self.last:
                        self._send_marked(y, m)
                result.peak_stored = max(result.peak_stored, len(stored))
                timeline.record(f"F{m}", "forward", "compute", forward_start, time.monotonic(),
                                {"stage": self.stage, "micro_batch": m})
            else:
                kind, x, saved = stored.pop(m)
                backward_start = time.monotonic()
                if kind == "recompute":
                    result.recomputed += 1
                    with timeline.span(f"R{m}", "recompute", stage=self.stage, micro_batch=m), saved.replay(), \
                            torch.enable_grad():
                        y = self.module(x)
                        saved = loss_fn(y, self._move(targets[m])) * weights[m] if self.last else y
                if self.last:
                    roots, root_grads = [saved], [None]
                else:
                    grads = self._wait(backward_in.pop(m), f"gradient {m}")
                    backward_start = time.monotonic()  # the wait is on the p2p track, R<m> before it
                    roots, root_grads = [], []
                    for tensor, grad in zip(iter_tensors(saved), grads):
                        if grad is not None and tensor.requires_grad:
                            roots.append(tensor)
                            root_grads.append(grad)
                if roots:
                    _backward_phase = "final" if index == last_backward else "partial"
                    try:
                        torch.autograd.backward(roots, root_grads)
                    finally:
                        _backward_phase = None
                    result.last_backward_finished = time.monotonic()
                timeline.record(f"B{m}", "backward", "compute", backward_start, time.monotonic(),
                                {"stage": self.stage, "micro_batch": m})
                if not self.first:
                    input_grads = [t.grad if t.requires_grad else None for t in iter_tensors(x)]
                    self._send(input_grads, self.stage - 1, _backward_tag(m))
                del x, saved
        if stored:
            raise HybridPipeError(f"stage {self.stage}: micro-batches {sorted(stored)} had a forward but no "
                                  "backward in this schedule")
        self._share_result(result, outputs, train)
        self._drain_sends()
        return result

    def _send_marked(self, y: Any, m: int) -> None:
        """Sends a no-grad forward's output with floating tensors marked as requiring grad."""
        marked = map_tensors(y, lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t)
        self._send(marked, self.stage + 1, _forward_tag(m))

    def _move(self, value: Any) -> Any:
        return map_tensors(value, lambda t: t.to(self.device) if t.device != self.device else t)

    def _share_result(self, result: StepResult, outputs: list[Any], train: bool) -> None:
        """The last stage sends the loss (training) or the outputs (forward-only) to every stage."""
        if self.stages == 1:
            result.outputs = outputs
            return
        if self.last:
            payload = result.loss if train else outputs
            for peer in range(self.stages - 1):
                self._send(payload, peer, _RESULT_TAG)
            result.outputs = outputs if not train else []
        else:
            value = self._wait(self._receive(self.stages - 1, _RESULT_TAG, False))
            if train:
                result.loss = float(value)
            else:
                result.outputs = list(value)

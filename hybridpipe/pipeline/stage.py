"""The stage executor: runs one pipeline rank's action list, moving values between ranks over MPI.

Design reasons:

* A rank holds one or more *chunks* (virtual stages, see ``schedule.py``): chunk ``c`` runs on
  rank ``c mod P``. The executor runs its rank's list of
  :class:`~hybridpipe.pipeline.schedule.Action` with one handler per kind — forward, backward,
  input gradient (``I``), weight gradient (``W``), update (``U``) — over a small
  :class:`_Step` object that holds what one ``run`` was given. Sends and receives follow from the
  data flow: a forward of chunk ``c > 0`` takes its input from chunk ``c - 1``, one of
  ``c < V - 1`` sends its output to ``c + 1``; a backward of ``c < V - 1`` takes the output
  gradient from ``c + 1`` and one of ``c > 0`` sends the input gradient to ``c - 1``.
* State survives ``run``: what a forward stored waits for its backward in ``self._stored``, so a
  schedule that never flushes (PipeDream, 2BW) runs one segment per ``train_step``.
* Overlap: every receive a run needs (header first, see ``comm/p2p.py``) is posted when the run
  starts, payload receives are posted as soon as a header is in (each action polls), and no send
  is waited for before the end of the run.
* Tags: chunk ``c``'s micro-batch ``m`` uses ``4·(k·T + m mod T)`` for activations and ``+2``
  for gradients, where ``k = c // P`` is the receiving chunk's index on its rank and
  ``T = 4096 // v`` (each message takes two tags). MPI matches messages of one (source, tag) in
  order, so tags may wrap.
* Gradient syncs (``hybridpipe/gradient_sync.py``): each chunk is a :class:`~hybridpipe.gradient_sync.Unit`
  of ``self.gradient_syncs``, the driver that data parallelism registers with. Every forward of a chunk runs
  inside its ``forward`` pair of calls and every ``B``, ``I`` or ``W`` inside its ``backward`` pair, ``last``
  when it is the chunk's last ``B`` or ``W`` of the run: a gradient accumulated then is final, so
  ``hp.DistributedOptimizer`` starts a parameter's allreduce during the last micro-batch's backward and not
  before. It is state of this executor's chunks, not of the process or the parameters, so several pipelines can
  coexist. A parameter whose gradient is completed after the run (a weight tied across stages, summed by
  ``PipelineModel.train_step``; :meth:`StageExecutor.defer_gradients`) is never final in a backward.
* Re-materialization: a micro-batch that is not stored runs its forward under ``no_grad`` and
  keeps only its input and the RNG state; its backward re-runs the forward with the RNG state
  restored (same dropout masks) and then back-propagates. Outputs of such a forward are marked
  "requires grad" for the next chunk when they are floating point, as torch.utils.checkpoint
  does; a gradient that comes back as ``None`` is skipped.
* Split backward (``I`` then ``W``, zero-bubble schedules): during the forward the outputs of
  the chunk's *splittable* layers are recorded — ``nn.Linear``, ``nn.Conv1d/2d/3d``,
  ``nn.Embedding``, ``nn.LayerNorm``, ``nn.GroupNorm`` (their forward uses only their own
  parameters), and any module with ``hybridpipe_split_backward = True``. ``I`` back-propagates
  into the chunk's input, those recorded outputs and the parameters of every other layer (those
  are *fused*: their weight gradients come in ``I``), keeping the graph. ``W`` then runs, per
  recorded call, autograd from that output's gradient into that layer's own parameters only —
  for a Linear one matrix product — so gradient hooks fire as for a plain backward.
* Failure: an exception on one rank is sent to its neighbours on a dedicated error tag; every
  wait also watches those, so the neighbours raise :class:`~hybridpipe.comm.p2p.RemoteError`
  and forward it, and the whole pipeline raises instead of hanging.
"""

from __future__ import annotations

import collections
import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hybridpipe import _trace as timeline
from hybridpipe.comm import p2p
from hybridpipe.errors import PipelineBroken, RanksLostError, ScheduleError, UsageError
from hybridpipe.gradient_sync import SyncDriver, Unit
from hybridpipe.pipeline import finite
from hybridpipe.pipeline.asynchronous import WeightStash
from hybridpipe.pipeline.batch_check import compare
from hybridpipe.pipeline.executor_profile import ExecutorProfile
from hybridpipe.pipeline.inplace import first_layer_works_in_place
from hybridpipe.pipeline.microbatch import iter_tensors, map_tensors
from hybridpipe.pipeline.schedule import Action, ActionKind, stage_to_rank
from hybridpipe.pipeline.skip import SkipContext, SkipRoute, skip_context
from hybridpipe.registry import RECOMPUTE_MODES

__all__ = ["CHECKPOINT_MODES", "PipelineBroken", "StageExecutor", "StepResult", "splittable",
           "input_gradient_targets", "weight_gradients", "deferred_parameters", "split_summary"]

CHECKPOINT_MODES = tuple(RECOMPUTE_MODES)
_TAG_PERIOD = 4096
_RESULT_TAG = 4 * _TAG_PERIOD  # loss / predict output from the last stage to every stage
_SKIP_TAG_BASE = _RESULT_TAG + 4  # skip connections: 4 tags (value, its gradient; header and payload each) per slot
_SKIP_SLOTS = 3900  # (name, micro-batch) slots below p2p.ERROR_TAG: micro-batch ids modulo 3900 // names
_BATCH_MARK = "__hybridpipe_batch_fingerprint__"  # an activation message carrying the sender's batch fingerprint


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
    """What one executed run left behind (for the caller and for tests)."""

    def __init__(self) -> None:
        self.loss = 0.0                 # weighted loss of this run's micro-batches (last stage; sent to all)
        self.losses: dict[int, float] = {}  # per finished micro-batch: its mean loss (same on every rank)
        self.outputs: list[Any] = []    # forward-only: per micro-batch outputs (same on every rank)
        self.peak_stored = 0            # most micro-batches (per chunk) whose activations were held at once
        self.recomputed = 0             # forwards re-run during backward
        self.last_backward_finished = 0.0  # time.monotonic() when this rank's last backward ended
        self.versions: list[tuple[int, int, int]] = []  # (micro-batch, forward version, backward version)
        self.actions: list[Action] = []  # the actions run, in the order they ran (tests compare the schedule)


class _Chunk:
    """One virtual stage held by this rank."""

    def __init__(self, module: nn.Module, stage: int, chunks: int, ranks: int) -> None:
        self.module, self.stage = module, stage
        self.index = stage // ranks          # position among this rank's chunks
        self.first, self.last = stage == 0, stage == chunks - 1
        # what the gradient syncs are told about (gradient_sync.py)
        self.unit = Unit(stage, module.parameters(), module)
        self.stash: WeightStash | None = None  # asynchronous schedules
        self.splittable: list[nn.Module] = []  # split backward: layers whose W is deferred
        self.recording: list[tuple[nn.Module, list[torch.Tensor], list[int]]] | None = None
        self.fused_layers: set[str] = set()  # split backward: layers whose weight gradients came in I
        self.deferred_ids: set[int] = set()  # split backward: parameters whose weight gradients came in W
        self.owners: Mapping[int, int] = {}  # split backward: how many of the chunk's modules own each parameter
        self.compiled: list[str] = []  # split backward: layers inside torch.compile (the chunk is not split)
        # a split module's chunk is called with the micro-batch's inputs too (every rank of a pipeline has them)
        self.takes_batch = bool(getattr(module, "hybridpipe_takes_batch", False))
        # its first layer works in place (nn.ReLU(inplace=True)): it gets a copy of its input (pipeline/inplace.py)
        self.copies_input = first_layer_works_in_place(module)


@dataclass
class _Stored:
    """What a forward left for the backward of one (chunk, micro-batch)."""

    x: Any                          # the chunk's input
    saved: Any = None               # graph: the output (or the weighted loss); recompute: the RNG state
    recompute: bool = False
    loss: float | None = None       # last chunk: the micro-batch's mean loss
    version: int | None = None      # asynchronous: the weight version the forward used
    weights: dict[str, torch.Tensor] | None = None
    skips_in: dict[str, Any] = field(default_factory=dict)   # skip connections received from earlier chunks
    skips_out: dict[str, Any] = field(default_factory=dict)  # stashed here for later chunks (with their graph)
    calls: list[tuple[nn.Module, list[torch.Tensor], list[int]]] = field(default_factory=list)  # split backward
    deferred: set[int] | None = None  # split backward: the parameters W differentiates (deferred_parameters)
    batch: Any = None               # the micro-batch's inputs, for a chunk that takes them (split modules)


@dataclass
class _Step:
    """What one ``run`` was given, and what it produced."""

    inputs: Mapping[int, Any]
    targets: Mapping[int, Any]
    loss_fn: Any
    weights: Mapping[int, float]
    keep_graph: set[tuple[int, int]]
    train: bool
    final: dict[int, int]           # chunk -> index of its last B/W in the list
    result: StepResult = field(default_factory=StepResult)
    forward_in: dict[tuple[int, int], p2p.Receive] = field(default_factory=dict)
    backward_in: dict[tuple[int, int], p2p.Receive] = field(default_factory=dict)
    skip_in: dict[tuple[str, int], p2p.Receive] = field(default_factory=dict)       # (name, m): the value
    skip_grad_in: dict[tuple[str, int], p2p.Receive] = field(default_factory=dict)  # (name, m): its gradient
    outputs: dict[int, Any] = field(default_factory=dict)


class StageExecutor:
    """Runs one rank of a pipeline.

    Args:
        modules: This rank's chunks (virtual stages) as ``{stage: module}``; each module is called
            with one argument. With one chunk per rank, ``{rank: module}``.
        rank: This rank's index ``r`` in the pipeline.
        ranks: ``P``.
        comm: The pipeline's communicator (rank ``r`` = pipeline rank ``r``), private to this executor.
        device: Where this rank computes.
        virtual_stages: ``v``, chunks per rank (``v·P`` chunks in all).
        replica_ranks: A grid whose stages have their own replica counts (``hp.init(stage_replicas=...)``):
            for each pipeline rank ``r``, the ranks of ``comm`` holding its replicas; micro-batch ``m`` of
            pipeline rank ``r`` runs on ``replica_ranks[r][m % len(replica_ranks[r])]`` (PipeDream's
            round-robin), and each rank is given only its own micro-batches' actions. Default: one
            replica each, pipeline rank ``r`` being rank ``r`` of ``comm``.
    """

    def __init__(self, modules: Mapping[int, nn.Module] | nn.Module, rank: int, ranks: int, comm: Any,
                 device: torch.device, virtual_stages: int = 1,
                 replica_ranks: Sequence[Sequence[int]] | None = None) -> None:
        if isinstance(modules, nn.Module):
            modules = {rank: modules}
        self.rank, self.ranks, self.device = rank, ranks, device
        self._use_comm(comm, replica_ranks)
        self.virtual_stages = virtual_stages
        self.total_chunks = ranks * virtual_stages
        self.chunks = {stage: _Chunk(module, stage, self.total_chunks, ranks) for stage, module in modules.items()}
        #: the driver of the gradient syncs registered for this rank's parameters: one unit per chunk
        self.gradient_syncs = SyncDriver(chunk.unit for chunk in self.chunks.values())
        # a parameter two of this rank's chunks share (a weight tied within the rank, interleaved) is complete
        # only after both chunks' last backwards: its reduction waits for the run's end, as tied weights' do
        held = collections.Counter(id(p) for chunk in self.chunks.values() for p in chunk.module.parameters())
        shared = [p for chunk in self.chunks.values() for p in chunk.module.parameters() if held[id(p)] > 1]
        if shared:
            self.defer_gradients(shared)
        self.first = 0 in self.chunks
        self.last = self.total_chunks - 1 in self.chunks
        self._tag_period = _TAG_PERIOD // virtual_stages
        self._errors = self._error_receives()
        self._broken: str | None = None
        self._sends: list[p2p.Send] = []
        self._stored: dict[tuple[int, int], _Stored] = {}
        self._steps = 0
        self.on_update: Callable[[int, int], None] | None = None  # (stage, micro-batch) for U actions
        self.carry_versions = False  # asynchronous vertical sync: activations carry the weight version
        self.carry_losses = False  # asynchronous: gradients carry their micro-batch's loss
        # batch_check.fingerprint of this run's batch, carried by each chunk's first activation message (None: off)
        self.batch_print: tuple | None = None
        self._print_pending: set[int] = set()  # chunks whose first activation message of the run is not sent yet
        self.check_finite = False  # NaN / inf in inputs, layer outputs and losses raise (pipeline/finite.py)
        #: a context manager factory each run is executed inside (PipelineModel.measure_activations: its meter's hooks)
        self.around_run: Callable[[], Any] | None = None
        self.autocast: torch.dtype | None = None  # mixed precision: forwards (and losses) under torch.autocast
        self.loss_scale = 1.0  # fp16: each loss is multiplied by it before its backward (the scaler's scale)
        self.skips: dict[str, SkipRoute] = {}  # skip connections (hybridpipe.pipeline.skip), see use_skips
        self.profile: ExecutorProfile | None = None  # where each action's time goes (executor_profile.py)
        self._skip_period = _SKIP_SLOTS

    # ------------------------------------------------------------------ set-up

    @property
    def stage(self) -> int:
        """This rank's first chunk (= its rank)."""
        return self.rank

    def _peer(self, stage: int, micro_batch: int) -> int:
        """The rank of ``comm`` that runs micro-batch ``micro_batch`` of (virtual) stage ``stage``."""
        replicas = self.replica_ranks[stage_to_rank(stage, self.ranks)]
        return replicas[micro_batch % len(replicas)]

    def _neighbours(self) -> list[int]:
        """The ranks of ``comm`` this rank exchanges activations or gradients with (every replica of the
        neighbouring stages)."""
        peers = set()
        for chunk in self.chunks.values():
            if not chunk.first:
                peers.update(self.replica_ranks[stage_to_rank(chunk.stage - 1, self.ranks)])
            if not chunk.last:
                peers.update(self.replica_ranks[stage_to_rank(chunk.stage + 1, self.ranks)])
        peers.discard(self.comm_rank)
        return sorted(peers)

    def use_weight_stash(self, policy: str, vertical_sync: bool, micro_batches: int) -> None:
        """Asynchronous schedules: each chunk keeps weight versions (see asynchronous.py)."""
        for chunk in self.chunks.values():
            chunk.stash = WeightStash(chunk.module, policy, vertical_sync, micro_batches)
        self.carry_versions = vertical_sync
        self.carry_losses = True

    def use_skips(self, routes: Mapping[str, SkipRoute]) -> None:
        """Skip connections: each route's tensor goes from its stashing chunk's rank straight to its popping
        chunk's, and its gradient straight back (tags of their own, one slot per name and micro-batch)."""
        self.skips = dict(routes)
        if routes:
            self._skip_period = _SKIP_SLOTS // len(routes)
            if self._skip_period < 64:
                raise UsageError(f"{len(routes)} skip connections are more than a pipeline carries "
                                 f"(at most {_SKIP_SLOTS // 64}); stash fewer names (e.g. a tuple under one)")

    def _skips_into(self, chunk: int) -> list[SkipRoute]:
        return [r for r in self.skips.values() if r.pop_chunk == chunk and r.stash_chunk != chunk]

    def _skips_from(self, chunk: int) -> list[SkipRoute]:
        return [r for r in self.skips.values() if r.stash_chunk == chunk and r.pop_chunk != chunk]

    def _skip_tag(self, route: SkipRoute, micro_batch: int, gradient: bool) -> int:
        return _SKIP_TAG_BASE + 4 * (route.index * self._skip_period + micro_batch % self._skip_period) + \
            (2 if gradient else 0)

    def defer_gradients(self, parameters: Sequence[torch.Tensor]) -> None:
        """These parameters' gradients are completed after each run (tied weights, summed across stages
        by the caller): never final in a backward (:meth:`hybridpipe.gradient_sync.Unit.defer`)."""
        for chunk in self.chunks.values():
            chunk.unit.defer(parameters)

    def split_backward(self) -> None:
        """Zero-bubble schedules: defer the weight gradients of the splittable layers to ``W``."""
        for chunk in self.chunks.values():
            chunk.splittable = [m for m in chunk.module.modules() if splittable(m)]
            chunk.owners = collections.Counter(id(p) for m in chunk.module.modules() for p in m.parameters(recurse=False))
            compiled = compiled_layers(chunk.module, chunk.module.modules())
            if compiled:
                # a compiled region's backward is one opaque function that may not be kept for a later W
                # (retain_graph; AOT autograd's donated buffers): this chunk's backward is not split
                chunk.compiled = sorted(_owners(chunk, [p for m in compiled for p in m.parameters(recurse=False)]))
                chunk.splittable = []
                warnings.warn(f"schedule 'zb-h1', chunk {chunk.stage}: it holds torch.compile'd layers "
                              f"({', '.join(chunk.compiled[:4])}{', ...' if len(chunk.compiled) > 4 else ''}), whose "
                              "backward cannot be split, so this chunk computes its weight gradients with the input "
                              "gradients (as 1F1B does) and the bubble W would fill stays; compile only modules "
                              "without Linear/Embedding/LayerNorm/convolution layers to keep the split. "
                              "model.split_backward_report() shows it", stacklevel=3)
            for layer in chunk.splittable:
                layer.register_forward_hook(self._recorder(chunk))

    @staticmethod
    def _recorder(chunk: _Chunk) -> Callable:
        def record(layer: nn.Module, args: tuple, output: Any) -> None:
            # while torch.compile traces, the outputs are not the ones autograd will see: record nothing, so
            # the layer's weight gradients come in I (the split cannot reach inside a compiled region)
            if chunk.recording is not None and not torch.compiler.is_compiling():
                outputs = [t for t in iter_tensors(output) if t.requires_grad]
                if outputs:
                    chunk.recording.append((layer, outputs, [t._version for t in outputs]))

        return record

    # ------------------------------------------------------------------ messaging helpers

    def _tag(self, stage: int, micro_batch: int, gradient: bool) -> int:
        """Tag of a message to chunk ``stage`` (its activation, or its output gradient)."""
        return 4 * ((stage // self.ranks) * self._tag_period + micro_batch % self._tag_period) + (2 if gradient else 0)

    def _send(self, value: Any, dest_stage: int, micro_batch: int, gradient: bool) -> None:
        if not gradient and dest_stage - 1 in self._print_pending:  # the run's first activation from that chunk
            self._print_pending.discard(dest_stage - 1)
            value = (_BATCH_MARK, self.batch_print, value)
        dest = self._peer(dest_stage, micro_batch)
        began, cpu = (time.perf_counter(), time.thread_time()) if self.profile is not None else (0.0, 0.0)
        self._sends.append(p2p.send(value, dest, self._tag(dest_stage, micro_batch, gradient), self.comm))
        if self.profile is not None:
            self.profile.add("send", time.perf_counter() - began, time.thread_time() - cpu)

    def _receive(self, source: int, tag: int, requires_grad: bool) -> p2p.Receive:
        return p2p.Receive(source, tag, self.comm, device=self.device, requires_grad=requires_grad)

    def _drain_sends(self) -> None:
        """Waits for this run's sends while watching for a neighbour's failure."""
        for send in self._sends:
            send.wait(abort=self._errors)
        self._sends = []

    def rebind(self, comm: Any, replica_ranks: Sequence[Sequence[int]] | None = None) -> None:
        """Goes on over ``comm``, the pipeline communicator of the job the survivors of lost ranks started
        (hp.elastic.run), with ``replica_ranks`` as in the constructor: the same chunks and units, other peers.
        What the failed step left (its sends, stored activations, the broken mark) is dropped with the old job."""
        self._use_comm(comm, replica_ranks)
        self._errors = self._error_receives()
        self._broken, self._sends, self._stored, self._print_pending = None, [], {}, set()
        for chunk in self.chunks.values():
            chunk.unit.in_backward, chunk.unit.split_backward = None, False

    def _use_comm(self, comm: Any, replica_ranks: Sequence[Sequence[int]] | None) -> None:
        """The communicator and who holds each pipeline rank's replicas in it (see the constructor)."""
        self.comm, self.comm_rank = comm, comm.Get_rank()
        self.replica_ranks = [list(r) for r in replica_ranks] if replica_ranks is not None else \
            [[r] for r in range(self.ranks)]

    def _error_receives(self) -> list[p2p.Receive]:
        """A posted receive for an error message from each neighbour (passed as ``abort=`` to waits)."""
        return [p2p.receive_error(peer, self.comm) for peer in self._neighbours()]

    def close(self) -> None:
        """Withdraws the error receives and forgets the unopened ones (call before the communicator is freed)."""
        for error in self._errors:
            error.cancel()
        self._errors = []
        p2p.forget(self.comm)

    @property
    def in_flight(self) -> list[tuple[int, int]]:
        """(stage, micro-batch) pairs whose forward ran and whose backward did not."""
        return sorted(self._stored)

    # ------------------------------------------------------------------ running

    def run(
        self,
        actions: Sequence[Action],
        micro_batches: int,
        inputs: Sequence[Any] | Mapping[int, Any] | None,
        targets: Sequence[Any] | Mapping[int, Any] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        weights: Sequence[float] | Mapping[int, float] | None = None,
        checkpoint: str = "never",
        train: bool = True,
    ) -> StepResult:
        """Executes ``actions``; every rank of the pipeline must call it with its own list.

        Args:
            actions: This rank's action list (validated by the caller).
            micro_batches: ``M`` (micro-batches given to this run).
            inputs: First chunk's rank: the input micro-batches, a list (ids 0..M-1) or a mapping
                from micro-batch id (ignored elsewhere).
            targets: Last chunk's rank, training: the target micro-batches, likewise.
            loss_fn: Last chunk's rank, training: ``loss_fn(output, target)`` → scalar mean loss.
            weights: Last chunk's rank, training: each micro-batch's loss weight.
            checkpoint: "never", "except_last" (every forward recomputes except each chunk's last
                forward of the run) or "always".
            train: False for a forward-only run (``predict``): outputs are collected on the last
                chunk's rank and sent to every rank, no gradients.

        Returns:
            A :class:`StepResult`; ``loss``/``losses`` (training) and ``outputs`` (forward-only) are
            the same on every rank.
        """
        if self._broken is not None:
            raise PipelineBroken(f"this pipeline failed in an earlier step ({self._broken}); build a new "
                                 "PipelineModel (and new communicators) to go on")
        self._steps += 1
        self._print_pending = set(self.chunks) if self.batch_print is not None else set()
        step = self._prepare(actions, inputs, targets, loss_fn, weights, checkpoint, train)
        try:
            with timeline.span("train_step" if train else "predict", "step", index=self._steps), \
                    (self.around_run() if self.around_run is not None else contextlib.nullcontext()):
                self._run(actions, step)
            return step.result
        except BaseException as error:
            self._fail(error)
            raise

    @staticmethod
    def _indexed(values: Sequence[Any] | Mapping[int, Any] | None) -> Mapping[int, Any]:
        if values is None:
            return {}
        return values if isinstance(values, Mapping) else dict(enumerate(values))

    def _prepare(self, actions: Sequence[Action], inputs: Any, targets: Any, loss_fn: Any, weights: Any,
                 checkpoint: str, train: bool) -> _Step:
        last_forward: dict[int, int] = {}
        final: dict[int, int] = {}
        for index, action in enumerate(actions):
            if action.kind is ActionKind.FORWARD:
                last_forward[action.stage] = action.micro_batch
            elif action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                final[action.stage] = index
        if checkpoint == "never":
            keep = {(a.stage, a.micro_batch) for a in actions if a.kind is ActionKind.FORWARD}
        elif checkpoint == "except_last":
            keep = set(last_forward.items())
        else:
            keep = set()
        return _Step(self._indexed(inputs), self._indexed(targets), loss_fn, self._indexed(weights), keep,
                     train, final)

    def _fail(self, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        self._broken = text
        if isinstance(error, RanksLostError):  # every survivor learns of it from its own engine; the old
            self._sends = []                  # communicators are being revoked: nothing to tell the neighbours
            return
        came_from = getattr(error, "source", None)
        if isinstance(error, p2p.RemoteError):
            text = str(error)
        else:
            text = f"stage {self.rank} (rank {self.comm.rank} of the pipeline) raised {text}"
        # the sends are dropped, not waited for: each keeps its buffers until MPI is done with them
        for peer in self._neighbours():
            if peer != came_from:
                p2p.send_error(text, self.comm_rank, peer, self.comm)
        self._sends = []

    def _wait(self, receive: p2p.Receive, what: str = "value") -> Any:
        kind, _, micro_batch = what.rpartition(" ")
        described = {"activation": "its activation of micro-batch", "gradient": "its activation gradient of "
                     "micro-batch"}.get(kind, f"{kind} of micro-batch") + f" {micro_batch}" if kind else \
            "the step's losses (or outputs) from the last stage"
        if not timeline.enabled() and self.profile is None:
            return receive.wait(abort=self._errors, what=described)
        start, began, cpu = time.monotonic(), time.perf_counter(), time.thread_time()
        try:
            return receive.wait(abort=self._errors, what=described)
        finally:
            if self.profile is not None:
                self.profile.add("wait", time.perf_counter() - began, time.thread_time() - cpu)
            timeline.record(f"wait {what}", "recv", "p2p", start, time.monotonic(), {"from": receive.source})

    def _post_receives(self, actions: Sequence[Action], step: _Step) -> None:
        for action in actions:
            chunk = self.chunks[action.stage]
            m = action.micro_batch
            if action.kind is ActionKind.FORWARD and not chunk.first:
                step.forward_in[(action.stage, m)] = self._receive(
                    self._peer(action.stage - 1, m), self._tag(action.stage, m, False), step.train)
            elif action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and not chunk.last:
                step.backward_in[(action.stage, m)] = self._receive(
                    self._peer(action.stage + 1, m), self._tag(action.stage, m, True), False)
            if action.kind is ActionKind.FORWARD:
                for route in self._skips_into(action.stage):
                    step.skip_in[(route.name, m)] = self._receive(
                        self._peer(route.stash_chunk, m), self._skip_tag(route, m, False), step.train)
            elif action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
                for route in self._skips_from(action.stage):
                    step.skip_grad_in[(route.name, m)] = self._receive(
                        self._peer(route.pop_chunk, m), self._skip_tag(route, m, True), False)

    def _progress(self, step: _Step) -> None:
        # Post payload receives for headers that arrived meanwhile. Headers open in posting order,
        # so each direction stops at its first header not yet in: O(arrived) per action, not O(M).
        for pending in (step.forward_in, step.backward_in):
            for receive in pending.values():
                receive.poll()
                if not receive.opened:
                    break
        # (a neighbour's error is seen by the next wait, which watches the error receives)

    def _run(self, actions: Sequence[Action], step: _Step) -> None:
        self._post_receives(actions, step)
        handlers = {
            ActionKind.FORWARD: self._forward,
            ActionKind.BACKWARD: self._backward,
            ActionKind.BACKWARD_INPUT: self._backward,
            ActionKind.BACKWARD_WEIGHT: self._weight,
            ActionKind.UPDATE: self._update,
        }
        profile = self.profile
        for index, action in enumerate(actions):
            if profile is None:
                self._progress(step)
                handlers[action.kind](step, self.chunks[action.stage], action, index)
            else:
                began = time.perf_counter()
                self._progress(step)
                profile.progress += time.perf_counter() - began
                began = profile.begin(action.kind.value)
                handlers[action.kind](step, self.chunks[action.stage], action, index)
                profile.end(began)
            step.result.actions.append(action)
        began = time.perf_counter()
        self._end_run(step)
        if profile is not None:
            profile.tail += time.perf_counter() - began
            profile.steps += 1

    def _end_run(self, step: _Step) -> None:
        """After the last action: leftovers refused, the result shared and the sends drained (synchronous)."""
        synchronous = all(chunk.stash is None for chunk in self.chunks.values())
        if synchronous and step.train and self._stored:
            leftover = ", ".join(f"{stage}:{m}" for stage, m in sorted(self._stored))
            self._stored.clear()
            raise ScheduleError(f"stage {self.rank}: micro-batches (chunk:micro-batch) {leftover} had a forward "
                                "but no backward in this schedule")
        if synchronous or not step.train:
            self._share_result(step)
            self._drain_sends()
        else:  # never flushed: no step-end exchange; sends complete as their receivers come to them
            self._sends = [send for send in self._sends if not send.test()]

    def drain(self) -> None:
        """Waits for every send still in flight (asynchronous schedules leave them between runs)."""
        self._drain_sends()

    # ------------------------------------------------------------------ handlers

    def _move(self, value: Any) -> Any:
        return map_tensors(value, lambda t: t.to(self.device) if t.device != self.device else t)

    def _forward(self, step: _Step, chunk: _Chunk, action: Action, index: int) -> None:
        m = action.micro_batch
        carried = None
        if chunk.first:
            x = self._move(step.inputs[m])
        else:
            x = self._wait(step.forward_in.pop((chunk.stage, m)), f"activation {m}")
            if isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], str) and x[0] == _BATCH_MARK:
                _, theirs, x = x
                if self.batch_print is not None:
                    compare(self.batch_print, theirs, chunk.stage, chunk.stage - 1)
            if self.carry_versions:
                carried, x = x
        stored = _Stored(x)
        if chunk.takes_batch:
            stored.batch = x if chunk.first else self._move(step.inputs[m])
        for route in self._skips_into(chunk.stage):
            stored.skips_in[route.name] = self._wait(step.skip_in.pop((route.name, m)), f"skip {route.name} {m}")
        start = time.monotonic()
        forward = chunk.module
        if chunk.stash is not None and step.train:
            stored.version = chunk.stash.forward_version(m, carried)
            stored.weights = chunk.stash.acquire(stored.version)
            forward = chunk.stash.call(stored.weights)
        if not step.train:
            with torch.no_grad():
                y = self._call(forward, x, chunk, stored, m)
            if chunk.last:
                step.outputs[m] = y
            else:
                y = self._boundary(y)
                self._send((carried, y) if self.carry_versions else y, chunk.stage + 1, m, False)
        elif (chunk.stage, m) in step.keep_graph:
            chunk.recording = stored.calls if chunk.splittable else None
            try:
                y = self._call(forward, x, chunk, stored, m)
            finally:
                chunk.recording = None
            if chunk.last:
                loss = self._loss(step, y, m)
                stored.loss = float(loss.detach())
                stored.saved = loss * (step.weights[m] * self.loss_scale)
            else:
                stored.saved = y = self._boundary(y)
                self._send_forward(chunk, m, stored, y, marked=False)
        else:
            stored.recompute, stored.saved = True, _RngState(self.device)
            with torch.no_grad():
                y = self._call(forward, x, chunk, stored, m)
                if chunk.last:
                    stored.loss = float(self._loss(step, y, m))
            if not chunk.last:
                self._send_forward(chunk, m, stored, self._boundary(y), marked=True)
        for route in self._skips_from(chunk.stage):  # straight to the popping chunk's rank
            value = stored.skips_out[route.name]
            if stored.recompute:  # stashed without a graph: the popping chunk must still return its gradient
                value = map_tensors(value, lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t)
            self._sends.append(p2p.send(value, self._peer(route.pop_chunk, m),
                                        self._skip_tag(route, m, False), self.comm))
        if stored.recompute or not step.train:
            stored.skips_out = {}  # the backward's recompute stashes them again, with their graph
        if step.train:
            if chunk.last and not self.carry_losses:
                step.result.losses[m] = stored.loss
            self._stored[(chunk.stage, m)] = stored
            step.result.peak_stored = max(step.result.peak_stored, len(self._stored))
        timeline.record(f"F{m}", "forward", "compute", start, time.monotonic(),
                        {"stage": chunk.stage, "micro_batch": m})

    def _call(self, forward: Callable[[Any], Any], x: Any, chunk: _Chunk, stored: _Stored, m: int) -> Any:
        """A chunk's forward, under autocast when the pipeline runs in mixed precision, with its skip
        connections: ``hp.pop`` finds ``stored.skips_in``, ``hp.stash`` for a later chunk fills ``stored.skips_out``.
        With ``check_finite``, NaN / inf in the inputs or a layer's output raise here, before anything is sent."""
        context = SkipContext(routes=self.skips, chunk=chunk.stage, incoming=stored.skips_in)
        if chunk.copies_input:
            x = map_tensors(x, torch.clone)
        if self.check_finite and chunk.first:
            finite.check_inputs(x, chunk.stage, m)
        arguments = (x, stored.batch) if chunk.takes_batch else (x,)
        watch = finite.watching(chunk.module) if self.check_finite else contextlib.nullcontext([])
        with skip_context(context), watch as found, self.gradient_syncs.forward(chunk.unit), self._computing():
            if self.autocast is None:
                y = forward(*arguments)
            else:
                with torch.autocast(self.device.type, dtype=self.autocast):
                    y = forward(*arguments)
        if self.check_finite:
            finite.check_output(found, y, chunk.stage, m)
        missing = [r.name for r in self._skips_from(chunk.stage) if r.name not in context.outgoing]
        if missing:
            raise UsageError(f"chunk {chunk.stage}'s forward did not hp.stash {missing} (declared by "
                             "@hp.skippable on its layers): stash every declared name on every call")
        stored.skips_out = context.outgoing
        return y

    def _computing(self) -> Any:
        """Times the ``with`` body as the running action's compute (when profiling)."""
        return _Clock(self.profile, "compute") if self.profile is not None else contextlib.nullcontext()

    def _loss(self, step: _Step, y: Any, m: int) -> torch.Tensor:
        target = self._move(step.targets[m])
        with self._computing():
            if self.autocast is None:
                loss = step.loss_fn(y, target)
            else:
                with torch.autocast(self.device.type, dtype=self.autocast):
                    loss = step.loss_fn(y, target)
        if self.check_finite:
            finite.check_loss(loss, self.total_chunks - 1, m)
        return loss

    def _boundary(self, y: Any) -> Any:
        """A chunk's output as it leaves for the next chunk: in mixed precision, float32 tensors in the
        autocast dtype (half the bytes on the wire; the gradient comes back in it too)."""
        if self.autocast is None:
            return y
        return map_tensors(y, lambda t: t.to(self.autocast) if t.dtype == torch.float32 else t)

    def _send_forward(self, chunk: _Chunk, m: int, stored: _Stored, y: Any, marked: bool) -> None:
        if marked:  # a no-grad forward's output, marked as requiring grad for the next chunk
            y = map_tensors(y, lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t)
        # vertical sync: the version the first chunk used (every chunk used it) travels along
        self._send((stored.version, y) if self.carry_versions else y, chunk.stage + 1, m, False)

    def _recompute(self, step: _Step, chunk: _Chunk, m: int, stored: _Stored) -> Any:
        step.result.recomputed += 1
        forward = chunk.module if stored.weights is None else chunk.stash.call(stored.weights)
        chunk.recording = stored.calls if chunk.splittable else None
        try:
            with timeline.span(f"R{m}", "recompute", stage=chunk.stage, micro_batch=m), stored.saved.replay(), \
                    torch.enable_grad():
                y = self._call(forward, stored.x, chunk, stored, m)
                return self._loss(step, y, m) * (step.weights[m] * self.loss_scale) if chunk.last else self._boundary(y)
        finally:
            chunk.recording = None

    def _backward(self, step: _Step, chunk: _Chunk, action: Action, index: int) -> None:
        """A full backward (``B``), or the input-gradient half (``I``) of a split one."""
        m = action.micro_batch
        key = (chunk.stage, m)
        stored = self._stored[key]
        # the syncs hear of the whole backward, a re-materialized forward included (an I is never the last)
        with self.gradient_syncs.backward(chunk.unit, last=step.final.get(chunk.stage) == index,
                                          split=action.kind is not ActionKind.BACKWARD):
            loss, roots, root_grads, start = self._backward_roots(step, chunk, stored, m)
            popped = [stored.skips_in[route.name] for route in self._skips_into(chunk.stage)]
            inputs = [t for t in iter_tensors(stored.x) if t.requires_grad] + \
                [t for t in iter_tensors(popped) if t.requires_grad]
            if roots:
                with self._computing():
                    if action.kind is ActionKind.BACKWARD:
                        torch.autograd.backward(roots, root_grads)
                    else:
                        self._input_gradients(chunk, stored, roots, root_grads, inputs)
                step.result.last_backward_finished = time.monotonic()
        timeline.record(f"{action.kind.value}{m}", "backward", "compute", start, time.monotonic(),
                        {"stage": chunk.stage, "micro_batch": m})
        if self.carry_losses:  # the loss of m travels back with its gradients
            step.result.losses[m] = loss
        for route in self._skips_into(chunk.stage):  # straight back to the stashing chunk's rank
            tensor = stored.skips_in[route.name]
            grad = tensor.grad if isinstance(tensor, torch.Tensor) and tensor.requires_grad else None
            self._sends.append(p2p.send([grad], self._peer(route.stash_chunk, m),
                                        self._skip_tag(route, m, True), self.comm))
        if not chunk.first:
            input_grads = [t.grad if t.requires_grad else None for t in iter_tensors(stored.x)]
            self._send((loss, input_grads) if self.carry_losses else input_grads, chunk.stage - 1, m,
                       True)
        if action.kind is ActionKind.BACKWARD:
            self._finish(step, chunk, key, stored)
        else:
            stored.x = stored.saved = None  # what W needs is in stored.calls (and their graph)

    def _backward_roots(self, step: _Step, chunk: _Chunk, stored: _Stored, m: int) -> tuple[Any, list, list, float]:
        """A backward's (loss, roots, their gradients, when its compute began): the re-computed or stored output
        with the gradient from the next chunk (the weighted loss on the last), and the skips' gradients."""
        start = time.monotonic()
        saved = self._recompute(step, chunk, m, stored) if stored.recompute else stored.saved
        loss = stored.loss
        if chunk.last:
            roots, root_grads = [saved], [None]
        else:
            grads = self._wait(step.backward_in.pop((chunk.stage, m)), f"gradient {m}")
            if self.carry_losses:
                loss, grads = grads
            start = time.monotonic()  # the wait is on the p2p track, R<m> before it
            roots, root_grads = [], []
            for tensor, grad in zip(iter_tensors(saved), grads):
                if grad is not None and tensor.requires_grad:
                    roots.append(tensor)
                    root_grads.append(grad)
        for route in self._skips_from(chunk.stage):  # the popping chunk's gradient of what was stashed here
            [grad] = self._wait(step.skip_grad_in.pop((route.name, m)), f"skip gradient {route.name} {m}")
            tensor = stored.skips_out[route.name]
            if grad is not None and tensor.requires_grad:
                roots.append(tensor)
                root_grads.append(grad)
        return loss, roots, root_grads, start

    def _input_gradients(self, chunk: _Chunk, stored: _Stored, roots: list, root_grads: list,
                         inputs: list[torch.Tensor]) -> None:
        """``I``: gradients into the chunk's input, the recorded outputs of splittable layers and the
        parameters of the other layers (accumulated into their ``.grad``); the graph stays for ``W``."""
        usable = []
        for layer, outputs, versions in stored.calls:
            if [t._version for t in outputs] == versions:
                usable.append((layer, outputs))
            else:  # modified in place after the layer (e.g. ReLU(inplace=True)): not separable
                chunk.fused_layers.add(_layer_name(chunk, layer) + " (output modified in place)")
        stored.calls = usable
        stored.deferred = deferred_parameters(usable, chunk.owners)
        fused, targets = input_gradient_targets(inputs, chunk.module.parameters(), usable, stored.deferred)
        chunk.deferred_ids |= stored.deferred
        if fused:
            chunk.fused_layers.update(_owners(chunk, fused))
        if targets:
            # never the last backward: the syncs leave fused layers' gradients to DistributedOptimizer.synchronize()
            torch.autograd.backward(roots, root_grads, inputs=targets, retain_graph=bool(usable))

    def _weight(self, step: _Step, chunk: _Chunk, action: Action, index: int) -> None:
        """``W``: the deferred weight gradients of one micro-batch, layer call by layer call."""
        m = action.micro_batch
        key = (chunk.stage, m)
        stored = self._stored[key]
        start = time.monotonic()
        with self.gradient_syncs.backward(chunk.unit, last=step.final.get(chunk.stage) == index, split=True), \
                self._computing():
            weight_gradients(stored.calls, stored.deferred)
        timeline.record(f"W{m}", "backward", "compute", start, time.monotonic(),
                        {"stage": chunk.stage, "micro_batch": m})
        self._finish(step, chunk, key, stored)

    def _finish(self, step: _Step, chunk: _Chunk, key: tuple[int, int], stored: _Stored) -> None:
        del self._stored[key]
        if stored.version is not None:
            chunk.stash.release(stored.version)
            step.result.versions.append((key[1], stored.version, stored.version))

    def _update(self, step: _Step, chunk: _Chunk, action: Action, index: int) -> None:
        if self.on_update is None:
            raise UsageError("this schedule updates inside the pipeline (U actions) but the executor has "
                             "no optimizer: build the PipelineModel with optimizer=")
        start = time.monotonic()
        self.on_update(chunk.stage, action.micro_batch)
        timeline.record(f"U{action.micro_batch}", "optimizer", "compute", start, time.monotonic(),
                        {"stage": chunk.stage, "micro_batch": action.micro_batch})

    # ------------------------------------------------------------------ results

    def _share_result(self, step: _Step) -> None:
        """The last chunk's rank (each of its replicas, with their micro-batches) sends the losses (training) or
        the outputs (forward-only) to every rank."""
        result = step.result
        merged: dict[int, Any] = {}
        if self.last:
            merged = dict(result.losses) if step.train else dict(step.outputs)
            for peer in range(self.comm.Get_size()):
                if peer != self.comm_rank:
                    self._sends.append(p2p.send(merged, peer, _RESULT_TAG, self.comm))
        for source in self.replica_ranks[self.ranks - 1]:
            if source != self.comm_rank:
                merged.update(self._wait(self._receive(source, _RESULT_TAG, False)))
        if step.train:
            result.losses = {int(m): float(v) for m, v in merged.items()}
            result.loss = sum(loss * step.weights.get(m, 0.0) for m, loss in result.losses.items()) \
                if step.weights else 0.0
        else:
            result.outputs = [merged[m] for m in sorted(merged)]


class _Clock:
    """Adds the time of a ``with`` body to one part of the running action's cost."""

    def __init__(self, profile: ExecutorProfile, part: str) -> None:
        self.profile, self.part = profile, part

    def __enter__(self) -> None:
        self.began, self.cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: Any) -> None:
        self.profile.add(self.part, time.perf_counter() - self.began, time.thread_time() - self.cpu)


_SPLITTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.LayerNorm, nn.GroupNorm)


def deferred_parameters(calls: list[tuple[nn.Module, list[torch.Tensor]]], owners: Mapping[int, int]) -> set[int]:
    """The ids of the parameters whose gradients ``W`` may compute alone: owned by one module of the chunk
    (``owners``: id -> how many of its modules own the parameter), called once. A weight tied between two
    layers of one chunk (an embedding and its head) or a layer called twice would not do: autograd from one
    call's outputs into the weight would also run through the other use upstream, counting it twice. Such
    weights get their gradients in ``I`` (fused)."""
    calls_of = collections.Counter(id(p) for layer, _ in calls for p in layer.parameters(recurse=False))
    return {key for key, count in calls_of.items() if count == 1 and owners.get(key, 0) <= 1}


def split_summary(chunk: _Chunk) -> tuple[list[str], list[str]]:
    """``split_backward_report``'s names for a chunk: the layers whose weight gradients came in ``W`` (before any
    step: the splittable ones) and those fused into ``I`` (a compiled one marked so)."""
    compiled = set(chunk.compiled)
    fused = sorted(f"{name} (inside torch.compile)" if name in compiled else name for name in chunk.fused_layers)
    if not chunk.deferred_ids:
        return sorted(f"{name} ({type(m).__name__})" for name, m in chunk.module.named_modules()
                      if m in chunk.splittable), fused
    deferred = _owners(chunk, [p for p in chunk.module.parameters() if id(p) in chunk.deferred_ids])
    return sorted(deferred - chunk.fused_layers), fused


def input_gradient_targets(inputs: list[torch.Tensor], parameters: Iterable[nn.Parameter],
                           calls: list[tuple[nn.Module, list[torch.Tensor]]],
                           deferred: set[int] | None = None) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """What the input half (``I``) of a split backward differentiates, given the recorded ``calls`` of splittable
    layers (``(layer, its outputs)``): ``(fused, targets)`` — the parameters not ``deferred`` (default: those no
    recorded call owns; see :func:`deferred_parameters`), whose gradients come in ``I``, and the inputs, those
    parameters and the outputs of the calls whose layers hold deferred ones."""
    if deferred is None:
        deferred = {id(p) for layer, _ in calls for p in layer.parameters(recurse=False)}
    fused = [p for p in parameters if p.requires_grad and id(p) not in deferred]
    outputs = [t for layer, outputs in calls if any(id(p) in deferred for p in layer.parameters(recurse=False))
               for t in outputs]
    return fused, list(inputs) + fused + outputs


def weight_gradients(calls: list[tuple[nn.Module, list[torch.Tensor]]], deferred: set[int] | None = None) -> None:
    """The weight half (``W``) of a split backward: per recorded call, autograd from its outputs' gradients (left by
    ``I``) into that layer's own ``deferred`` parameters (default: all); the graph is freed after the last."""
    for position, (layer, outputs) in enumerate(calls):
        pairs = [(t, t.grad) for t in outputs if t.grad is not None]
        parameters = [p for p in layer.parameters(recurse=False)
                      if p.requires_grad and (deferred is None or id(p) in deferred)]
        if pairs and parameters:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], inputs=parameters,
                                    retain_graph=position < len(calls) - 1)


def splittable(module: nn.Module) -> bool:
    """Whether ``module``'s weight gradients can be deferred: it owns parameters, and it is one of the
    layer types whose forward uses only those (not overridden) or declares so."""
    if not any(True for _ in module.parameters(recurse=False)):
        return False
    if getattr(module, "hybridpipe_split_backward", False):
        return True
    return any(isinstance(module, cls) and type(module).forward is cls.forward for cls in _SPLITTABLE)


def _layer_name(chunk: _Chunk, layer: nn.Module) -> str:
    for name, module in chunk.module.named_modules():
        if module is layer:
            return name or type(layer).__name__
    return type(layer).__name__


def compiled_layers(module: nn.Module, layers: Iterable[nn.Module]) -> list[nn.Module]:
    """Those of ``layers`` that run inside a compiled region of ``module``: under a ``torch.compile`` wrapper
    or a module compiled in place (``module.compile()``)."""
    wanted = {id(layer) for layer in layers}
    found: dict[int, nn.Module] = {}

    def visit(node: nn.Module, compiled: bool) -> None:
        compiled = compiled or isinstance(node, torch._dynamo.eval_frame.OptimizedModule) or \
            getattr(node, "_compiled_call_impl", None) is not None
        if compiled and id(node) in wanted:
            found[id(node)] = node
        for child in node.children():
            visit(child, compiled)

    visit(module, False)
    return list(found.values())


def _owners(chunk: _Chunk, parameters: list[torch.Tensor]) -> set[str]:
    """Names of the modules that directly own ``parameters``."""
    wanted = {id(p) for p in parameters}
    return {f"{name} ({type(module).__name__})" for name, module in chunk.module.named_modules()
            for p in module.parameters(recurse=False) if id(p) in wanted}

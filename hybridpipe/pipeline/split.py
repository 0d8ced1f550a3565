"""Any ``nn.Module`` cut into pipeline chunks at module boundaries, running the module's own ``forward``.

Design reasons (docs/pipeline.md, "Bring your own model", has the user's side):

* **Units.** A sample forward records which submodules are called, in order. The *units* are the
  modules a cut may fall between: a module in a ``ModuleList``/``ModuleDict``/``Sequential`` (a block),
  a module with parameters of its own (an embedding, a head, ViT's embeddings with their class token),
  or a leaf with parameters. Modules above them (``GPT2Model``, ``T5Stack``) are *expanded*; modules
  without parameters (dropout, activations, rotary tables) are *glue*. Each call of a unit is a *unit
  call*; the calls are cut into contiguous chunks (pipeline stages, or virtual stages).
* **Every chunk runs the module's own forward, eagerly,** with the batch inputs every rank of a
  pipeline already has: its own unit calls compute, the calls of earlier chunks return values received
  from the previous chunk (or placeholders), and it stops (:class:`_ChunkDone`, a ``BaseException`` so
  that a model's ``except Exception`` does not swallow it) right after its last unit call. So the glue
  between units -- position ids, attention masks, rotary tables, ``hidden = inputs_embeds +
  position_embeds`` -- is recomputed on every chunk from the inputs and the received values; nothing of
  it is re-derived by hand, and Python control flow on shapes or settings runs as written. Graph capture
  (torch.export / fx) is not needed, so what breaks it (data-dependent Python, lifted constants) does
  not break this.
* **What crosses a cut** is found by tracing provenance during the sample forward: a
  ``TorchFunctionMode`` tags every tensor with the unit outputs it was computed from. A unit call's
  inputs (and whatever it reads inside), and the module's final output, *need* those unit outputs on
  its chunk; they travel from chunk to chunk until the last chunk that needs them. Glue that merely
  *touches* a unit output (its shape, or arithmetic whose result no later unit needs) gets a zero
  placeholder of the right shape, whose shape travels in the message header. Everything else of an
  earlier chunk is ``None``.
* **Refused, not wrong.** A Python read of an activation's value in the glue (``if x.sum() > 0``) would
  be replayed on later chunks from a value they do not hold: refused at construction, naming the value,
  the unit that computed it, the line, and a fix. A call sequence that differs from the sample's at run
  time (data-dependent control flow) raises, naming the call.
* **Names stay the module's own**: the module is kept whole on every rank; the units of other ranks keep
  their structure with parameters and buffers on the meta device (no memory), so attribute reads in the
  glue still work and ``state_dict`` lists only this rank's tensors, under their own names.
* **Ties**: a parameter held by units called on different pipeline ranks (an output head tied to the
  embedding, a block applied on two stages, T5's shared embedding) is a tie, handed to
  :class:`~hybridpipe.pipeline.tied.TiedWeights` like those of layer lists.
* **Calls are dispatched by class, not by patching instances**: each unit's class is swapped for a
  subclass whose ``__call__`` asks the chunk being run, as ``torch.nn.utils.parametrize`` does; outside a
  pipeline run it calls the module as usual.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from hybridpipe.errors import SplitError

__all__ = ["SplitError", "SplitPlan", "SplitChunk", "trace_module", "as_call"]

_TAG = "_hybridpipe_sources"
_EMPTY: frozenset[int] = frozenset()
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
#: Tensor functions that read only metadata: a placeholder of the right shape, dtype and device serves.
_METADATA = {
    "size", "dim", "ndimension", "numel", "nelement", "__len__", "stride", "is_floating_point", "is_complex",
    "element_size", "is_contiguous", "get_device", "storage_offset", "is_signed", "__get__", "data_ptr",
}


class _ChunkDone(BaseException):
    """Raised after a chunk's last unit call: the rest of the forward belongs to later chunks."""


_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("hybridpipe_split_run", default=None)


def as_call(inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for a module call from a batch as ``train_step`` receives it: a dict is keyword
    arguments, a tuple (or list) positional arguments, anything else the one argument."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _tags(value: Any) -> frozenset[int]:
    found: frozenset[int] = _EMPTY
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            tags = getattr(leaf, _TAG, None)
            if tags:
                found = found | tags
    return found


_LIBRARIES = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep
                   for module in (torch, contextlib, sys.modules[__name__.split(".")[0]]))


def _user_line() -> str:
    """The innermost line of the stack outside torch and hybridpipe (where a model's code read a value)."""
    for frame in reversed(traceback.extract_stack()):
        if not os.path.abspath(frame.filename).startswith(_LIBRARIES):
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "unknown line"


# ------------------------------------------------------------------------------------------ the trace


@dataclass
class UnitCall:
    """One call of a unit in the sample forward."""

    index: int
    module: nn.Module
    name: str                      # the module's qualified name
    needs: frozenset[int]          # sources its inputs (and reads inside it) were computed from
    spec: Any = None               # treespec of its output
    leaves: list[Any] = field(default_factory=list)  # per output leaf: a source id (int) for a tensor, else the value
    seconds: float = 0.0           # forward time in the sample forward


@dataclass
class _Read:
    position: int
    sources: frozenset[int]
    what: str
    line: str


@dataclass
class Trace:
    """What the sample forward showed: the unit calls in order, the glue's touches and value reads, and the
    sources of the final output."""

    calls: list[UnitCall]
    source_call: dict[int, int]            # source id -> index of the call that produced it
    source_meta: dict[int, tuple[tuple[int, ...], torch.dtype]]
    touches: list[tuple[int, frozenset[int]]]  # (position, sources) of glue that touches unit outputs
    reads: list[_Read]                     # glue reading an activation's value in Python
    output_sources: frozenset[int]
    output: Any                            # the unsplit module's output on the sample
    unit_outputs: dict[int, Any]           # call index -> its output on the sample (for verify)


class _Provenance(TorchFunctionMode):
    def __init__(self, tracer: "_Tracer") -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.tracer.quiet:  # the tracer's own bookkeeping, not the model's
            return out
        tags = _tags((args, kwargs))
        if tags:
            tracer = self.tracer
            if tracer.inside is not None:
                tracer.inside_reads |= tags
            else:
                name = getattr(func, "__name__", "")
                leaves = pytree.tree_leaves(out)
                if name in _METADATA or any(isinstance(leaf, torch.Tensor) for leaf in leaves) or out is None:
                    tracer.touches.append((tracer.position, tags))
                else:
                    tracer.reads.append(_Read(tracer.position, tags, name, _user_line()))
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    try:
                        setattr(leaf, _TAG, (getattr(leaf, _TAG, None) or _EMPTY) | tags)
                    except (AttributeError, RuntimeError):
                        pass
        return out


class _Tracer:
    """Runs the sample forward once with unit calls recorded and provenance traced."""

    def __init__(self, root: nn.Module, units: set[int]) -> None:
        self.root = root
        self.units = units
        self.names = {id(m): n for n, m in root.named_modules(remove_duplicate=True)}
        self.calls: list[UnitCall] = []
        self.inside: UnitCall | None = None
        self.inside_reads: frozenset[int] = _EMPTY
        self.touches: list[tuple[int, frozenset[int]]] = []
        self.reads: list[_Read] = []
        self.source_call: dict[int, int] = {}
        self.source_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self.unit_outputs: dict[int, Any] = {}
        self.quiet = False  # while the hooks below look at tensors

    @property
    def position(self) -> int:
        return len(self.calls)

    def run(self, args: tuple, kwargs: dict) -> Trace:
        handles = []
        for module in self.root.modules():
            if id(module) in self.units:
                handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
                handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        try:
            with _Provenance(self):
                output = self.root(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return Trace(self.calls, self.source_call, self.source_meta, self.touches, self.reads, _tags(output),
                     output, self.unit_outputs)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.inside is not None:  # a unit called inside another unit: part of that one
            return
        call = UnitCall(len(self.calls), module, self.names.get(id(module), type(module).__name__),
                        _tags((args, kwargs)))
        call.seconds = time.perf_counter()
        self.inside, self.inside_reads = call, _EMPTY

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        call = self.inside
        if call is None or call.module is not module:
            return
        self.quiet = True
        try:
            self._record(call, output)
        finally:
            self.quiet = False

    def _record(self, call: UnitCall, output: Any) -> None:
        call.seconds = time.perf_counter() - call.seconds
        call.needs = call.needs | self.inside_reads
        self.inside = None
        leaves, call.spec = pytree.tree_flatten(output)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                source = len(self.source_call)
                self.source_call[source] = call.index
                self.source_meta[source] = (tuple(leaf.shape), leaf.dtype)
                call.leaves.append(source)
            else:
                call.leaves.append(leaf)
        self.calls.append(call)
        self.unit_outputs[call.index] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), output)
        # retag: after this call, its outputs stand for themselves
        tagged = []
        for leaf, source in zip(leaves, call.leaves):
            if isinstance(leaf, torch.Tensor):
                if any(leaf is t for t in tagged):  # the same tensor twice in one output
                    continue
                setattr(leaf, _TAG, frozenset((source,)))
                tagged.append(leaf)


def find_units(root: nn.Module, args: tuple, kwargs: dict) -> list[nn.Module]:
    """The modules the sample forward calls that a cut may fall between (see the module docstring), in the
    order of their first call."""
    parents: dict[int, nn.Module] = {}
    for module in root.modules():
        for child in module.children():
            parents.setdefault(id(child), module)
    called: list[nn.Module] = []
    children_called: dict[int, list[nn.Module]] = {}
    stack: list[nn.Module] = []

    def pre(module: nn.Module, _args: Any) -> None:
        if stack:
            children_called.setdefault(id(stack[-1]), []).append(module)
        stack.append(module)
        called.append(module)

    def post(module: nn.Module, _args: Any, _output: Any) -> None:
        if stack and stack[-1] is module:
            stack.pop()

    handles = []
    for module in root.modules():
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.no_grad():
            root(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()

    units: list[nn.Module] = []
    seen: set[int] = set()

    def has_parameters(module: nn.Module) -> bool:
        return any(True for _ in module.parameters())

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        own = any(p is not None for p in module._parameters.values())
        inner = children_called.get(id(module), [])
        parent = parents.get(id(module))
        if module is not root and (own or not inner or isinstance(parent, _CONTAINERS)):
            if has_parameters(module):
                units.append(module)
            return
        for child in inner:
            visit(child)

    visit(root)
    return units


@contextlib.contextmanager
def eval_mode(root: nn.Module) -> Iterator[None]:
    """``root`` in eval mode (dropout off, BatchNorm's running statistics used) for the block; every module's own
    mode restored afterwards."""
    modes = [(m, m.training) for m in root.modules()]
    root.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def trace_module(root: nn.Module, inputs: Any) -> tuple[list[nn.Module], Trace]:
    """The units of ``root`` and the provenance trace of one forward on ``inputs`` (one micro-batch), in eval
    mode: deterministic (dropout off), so that verify can compare outputs."""
    args, kwargs = as_call(inputs)
    with eval_mode(root):
        units = find_units(root, args, kwargs)
        if not units:
            raise SplitError(f"{type(root).__name__} calls no submodule with parameters on the sample: there is "
                             "nothing to split (pass an nn.Sequential or a list of layers instead)")
        with torch.no_grad():
            trace = _Tracer(root, {id(m) for m in units}).run(args, kwargs)
    return units, trace


# ------------------------------------------------------------------------------------------ the plan


class SplitPlan:
    """Which unit calls run on which chunk, what crosses each cut, and the refusals.

    Args:
        root: the module.
        units: its units (:func:`find_units`).
        trace: the sample forward's trace.
        boundaries: ``chunks + 1`` call indices: chunk ``c`` runs calls ``boundaries[c]`` to
            ``boundaries[c + 1] - 1``.
        ranks: pipeline ranks (chunk ``c`` runs on rank ``c mod ranks``).
    """

    def __init__(self, root: nn.Module, units: list[nn.Module], trace: Trace, boundaries: Sequence[int],
                 ranks: int) -> None:
        self.root, self.units, self.trace = root, units, trace
        self.boundaries = list(boundaries)
        self.chunks = len(self.boundaries) - 1
        self.ranks = ranks
        calls = trace.calls
        self.call_chunk = [0] * len(calls)
        for chunk in range(self.chunks):
            for index in range(self.boundaries[chunk], self.boundaries[chunk + 1]):
                self.call_chunk[index] = chunk
        self.last_call = [self.boundaries[c + 1] - 1 for c in range(self.chunks)]
        self.unit_index = {id(m): i for i, m in enumerate(units)}
        self.names = {id(m): n for n, m in root.named_modules(remove_duplicate=True)}
        source_chunk = {s: self.call_chunk[k] for s, k in trace.source_call.items()}
        self.source_chunk = source_chunk
        last = self.chunks - 1
        needed: list[set[int]] = [set() for _ in range(self.chunks)]
        for call in calls:
            needed[self.call_chunk[call.index]].update(call.needs)
        needed[last].update(trace.output_sources)
        touched: list[set[int]] = [set() for _ in range(self.chunks)]
        for position, sources in trace.touches:
            for chunk in range(self.chunks):
                if chunk == last or position <= self.last_call[chunk]:
                    touched[chunk].update(sources)
        self._refuse_reads()
        #: per chunk c: the sources it receives from chunk c - 1 (values) and whose shapes only it receives
        self.receives: list[list[int]] = []
        self.shapes_in: list[list[int]] = []
        for chunk in range(self.chunks):
            later_needed = set().union(*needed[chunk:])
            later_touched = set().union(*touched[chunk:])
            values = sorted(s for s in later_needed if source_chunk[s] < chunk)
            self.receives.append(values)
            self.shapes_in.append(sorted(s for s in later_touched if source_chunk[s] < chunk and s not in values))
        self.chunk_modules: list[list[nn.Module]] = []
        for chunk in range(self.chunks):
            modules: list[nn.Module] = []
            for call in calls[self.boundaries[chunk]:self.boundaries[chunk + 1]]:
                if all(call.module is not m for m in modules):
                    modules.append(call.module)
            self.chunk_modules.append(modules)

    # -- refusals

    def _refuse_reads(self) -> None:
        last = self.chunks - 1
        for read in self.trace.reads:
            for source in sorted(read.sources):
                chunk = self.source_chunk[source]
                if chunk == last:
                    continue
                call = self.trace.calls[self.trace.source_call[source]]
                later = [c.name for c in self.trace.calls[self.boundaries[chunk + 1]:]][:1]
                raise SplitError(
                    f"the forward reads the value of an activation in Python (Tensor.{read.what} at {read.line}): "
                    f"it was computed by {call.name} (call {call.index}, chunk {chunk}), and every later chunk "
                    f"(from {later[0] if later else 'the next'}) replays that line without holding it. A branch "
                    "on an activation cannot cross a cut: split so that the read comes after the last cut (e.g. "
                    f"put {call.name} and what follows the read on the last stage), or move the branch into a "
                    "module so that it is part of one unit")

    # -- queries

    def calls_of(self, chunk: int) -> range:
        return range(self.boundaries[chunk], self.boundaries[chunk + 1])

    def local_modules(self, rank: int) -> list[nn.Module]:
        """The units called by the chunks of pipeline rank ``rank`` (each once)."""
        found: list[nn.Module] = []
        for chunk in range(rank, self.chunks, self.ranks):
            for module in self.chunk_modules[chunk]:
                if all(module is not m for m in found):
                    found.append(module)
        return found

    def crossing(self, chunk: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """What chunk ``chunk`` receives: ``(description, shape on the sample, dtype)`` per value."""
        described = []
        for source in self.receives[chunk]:
            call = self.trace.calls[self.trace.source_call[source]]
            position = call.leaves.index(source)
            shape, dtype = self.trace.source_meta[source]
            suffix = f"[{position}]" if len(call.leaves) > 1 else ""
            described.append((f"{call.name}{suffix}", shape, dtype))
        return described


# ------------------------------------------------------------------------------------------ running


class _Run:
    """One chunk's forward in progress: the values it holds by source id."""

    def __init__(self, plan: SplitPlan, chunk: int, values: dict[int, torch.Tensor],
                 shapes: dict[int, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self.plan, self.chunk, self.values, self.shapes, self.device = plan, chunk, values, shapes, device
        self.next = 0
        self.depth = 0
        self.output: Any = None

    def call(self, module: nn.Module, original: Any, args: tuple, kwargs: dict) -> Any:
        if self.depth:  # inside a unit: its own business
            return original(module, *args, **kwargs)
        plan = self.plan
        index = self.next
        calls = plan.trace.calls
        if index >= len(calls) or calls[index].module is not module:
            expected = calls[index].name if index < len(calls) else "no further unit call"
            raise SplitError(
                f"chunk {self.chunk}: unit call {index} is {plan.names.get(id(module), type(module).__name__)}, but "
                f"the sample forward made {expected} there: the forward's control flow depends on the batch, so "
                "the split made from the sample does not hold; give a sample that takes the same path, or keep "
                "the branching inside one module")
        self.next += 1
        chunk = plan.call_chunk[index]
        call = calls[index]
        if chunk != self.chunk:
            return self._substitute(call)
        self.depth += 1
        try:
            output = original(module, *args, **kwargs)
        finally:
            self.depth -= 1
        leaves = pytree.tree_leaves(output)
        for leaf, source in zip(leaves, call.leaves):
            if isinstance(leaf, torch.Tensor) and isinstance(source, int):
                self.values[source] = leaf
        if index == plan.last_call[self.chunk] and self.chunk != plan.chunks - 1:
            raise _ChunkDone()
        return output

    def _substitute(self, call: UnitCall) -> Any:
        leaves = []
        for source in call.leaves:
            if not isinstance(source, int):
                leaves.append(source)
            elif source in self.values:
                leaves.append(self.values[source])
            elif source in self.shapes:
                shape, dtype = self.shapes[source]
                leaves.append(torch.zeros(shape, dtype=dtype, device=self.device))
            else:
                leaves.append(None)
        return pytree.tree_unflatten(leaves, call.spec)


_DISPATCHING: dict[type, type] = {}


def _dispatching_class(cls: type) -> type:
    """``cls`` with a ``__call__`` that asks the chunk being run (see the module docstring)."""
    if getattr(cls, "_hybridpipe_unit", False):
        return cls
    made = _DISPATCHING.get(cls)
    if made is None:
        original = cls.__call__

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            run = _ACTIVE.get()
            if run is None:
                return original(self, *args, **kwargs)
            return run.call(self, original, args, kwargs)

        made = type(cls.__name__, (cls,), {"__call__": __call__, "_hybridpipe_unit": True,
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _DISPATCHING[cls] = made
    return made


def install_dispatch(units: Sequence[nn.Module]) -> None:
    """Makes every unit's calls go through the chunk being run."""
    for module in units:
        module.__class__ = _dispatching_class(type(module))


def release_remote(root: nn.Module, keep: Sequence[nn.Module], units: Sequence[nn.Module], last_rank: bool) -> None:
    """Puts every parameter and buffer of ``root`` on the meta device (no memory) that no unit in ``keep`` holds,
    except tensors of no unit at all (modules the forward never calls): those stay on the last rank."""
    kept = {id(t) for m in keep for t in (*m.parameters(), *m.buffers())}
    of_units = {id(t) for m in units for t in (*m.parameters(), *m.buffers())}
    inside_units = {id(m) for unit in units for m in unit.modules()}

    def release(tensor: torch.Tensor) -> bool:
        return id(tensor) not in kept and tensor.device.type != "meta" and (id(tensor) in of_units or not last_rank)

    for module in root.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is not None and release(parameter):
                module._parameters[name] = nn.Parameter(torch.empty_like(parameter, device="meta"),
                                                        requires_grad=parameter.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and release(buffer) and (id(buffer) in of_units or id(module) in inside_units):
                module._buffers[name] = torch.empty_like(buffer, device="meta")


class SplitChunk(nn.Module):
    """One chunk of a split module, as the stage executor runs it: ``forward(received, batch)``.

    ``received`` is what the previous chunk sent (``{"values": {source: tensor}, "shapes": {source:
    (shape, dtype)}}``; on chunk 0 the batch itself), ``batch`` the micro-batch's inputs, which every
    rank of the pipeline holds. Returns what the next chunk receives, or on the last chunk the module's
    own output.
    """

    hybridpipe_takes_batch = True

    def __init__(self, plan: SplitPlan, chunk: int, device: torch.device) -> None:
        super().__init__()
        object.__setattr__(self, "plan", plan)
        self.chunk = chunk
        self.units = nn.ModuleList(plan.chunk_modules[chunk])  # registered: its parameters are this chunk's
        object.__setattr__(self, "device", device)
        self.keep_values = False  # verify: keep the last forward's values (see unit_output)
        self.last_values: dict[int, torch.Tensor] = {}

    def unit_output(self, index: int) -> Any:
        """Unit call ``index``'s output in the last forward run with ``keep_values`` (its structure rebuilt)."""
        call = self.plan.trace.calls[index]
        leaves = [self.last_values.get(s) if isinstance(s, int) else s for s in call.leaves]
        return pytree.tree_unflatten(leaves, call.spec)

    def forward(self, received: Any, batch: Any) -> Any:
        plan = self.plan
        if self.chunk == 0:
            values: dict[int, torch.Tensor] = {}
            shapes: dict[int, Any] = {}
        else:
            values = dict(received["values"])
            shapes = dict(received["shapes"])
        run = _Run(plan, self.chunk, values, shapes, self.device)
        args, kwargs = as_call(batch)
        token = _ACTIVE.set(run)
        try:
            output = plan.root(*args, **kwargs)
        except _ChunkDone:
            output = None
        finally:
            _ACTIVE.reset(token)
        if self.keep_values:
            self.last_values = values
        if self.chunk == plan.chunks - 1:
            if run.next != len(plan.trace.calls):
                raise SplitError(f"the forward made {run.next} unit calls where the sample forward made "
                                 f"{len(plan.trace.calls)}: its control flow depends on the batch")
            return output
        following = self.chunk + 1
        missing = [s for s in plan.receives[following] if s not in values]
        if missing:
            raise SplitError(f"chunk {self.chunk} did not produce {len(missing)} value(s) chunk {following} needs "
                             f"(sources {missing[:5]}): the forward's control flow depends on the batch")
        meta = {}
        for source in plan.shapes_in[following]:
            if source in values:
                tensor = values[source]
                meta[source] = (tuple(tensor.shape), tensor.dtype)
            elif source in shapes:
                meta[source] = shapes[source]
        return {"values": {s: values[s] for s in plan.receives[following]}, "shapes": meta}


# ------------------------------------------------------------------------------------------ choosing cuts


def boundaries_from_names(trace: Trace, names: Sequence[str], chunks: int) -> list[int]:
    """Call indices where chunks begin, from qualified module names (``"transformer.h.6"``): a chunk begins at
    the first unit call at or inside that module."""
    if len(names) != chunks - 1:
        raise SplitError(f"split lists {len(names)} module names, but {chunks} chunks need {chunks - 1} (each name "
                         f"is where a new chunk begins): e.g. split={[c.name for c in _spread(trace, chunks)]}")
    starts = [0]
    for name in names:
        if not isinstance(name, str):
            raise SplitError(f"split names must be qualified module names (str), got {name!r}")
        found = next((c.index for c in trace.calls if c.name == name or c.name.startswith(name + ".")), None)
        if found is None:
            units = sorted({c.name for c in trace.calls}, key=lambda n: next(c.index for c in trace.calls
                                                                              if c.name == n))
            raise SplitError(f"split point {name!r} is not a unit the forward calls (nor contains one); the units, "
                             f"in call order, are {units[:40]}{' ...' if len(units) > 40 else ''}")
        starts.append(found)
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise SplitError(f"split points {list(names)} begin chunks at unit calls {starts[1:]}: they must be in call "
                         "order, each after the previous, so that every chunk has at least one unit call")
    return starts + [len(trace.calls)]


def _spread(trace: Trace, chunks: int) -> list[UnitCall]:
    count = len(trace.calls)
    return [trace.calls[(count * c) // chunks] for c in range(1, chunks)]


def boundaries_from_costs(costs: Sequence[float], chunks: int) -> list[int]:
    """Call indices where chunks begin, minimising the most expensive chunk (exact, contiguous)."""
    from hybridpipe.pipeline.partition import partition_by_weights

    if len(costs) < chunks:
        raise SplitError(f"the forward makes {len(costs)} unit calls, fewer than the {chunks} chunks asked for: use "
                         "fewer stages (or virtual stages)")
    balance = partition_by_weights(list(costs), chunks)
    starts = [0]
    for count in balance:
        starts.append(starts[-1] + count)
    return starts


def profile_calls(root: nn.Module, units: list[nn.Module], trace: Trace, inputs: Any, repeats: int = 3) -> list[float]:
    """Forward + backward milliseconds of each unit call, measured on the sample: the forward of each call
    timed by hooks (median of ``repeats``), the backward estimated as twice the forward."""
    args, kwargs = as_call(inputs)
    samples: list[list[float]] = [[] for _ in trace.calls]
    state = {"index": 0, "start": 0.0, "depth": 0}
    unit_ids = {id(m) for m in units}

    def pre(module: nn.Module, _args: Any) -> None:
        if state["depth"] == 0:
            state["start"] = time.perf_counter()
        state["depth"] += 1

    def post(module: nn.Module, _args: Any, _output: Any) -> None:
        state["depth"] -= 1
        if state["depth"] == 0:
            index = state["index"]
            if index < len(samples):
                samples[index].append(time.perf_counter() - state["start"])
            state["index"] += 1

    handles = []
    for module in root.modules():
        if id(module) in unit_ids:
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
    buffers = [(b, b.clone()) for b in root.buffers()]  # eval mode leaves them alone; restored all the same
    try:
        with eval_mode(root), torch.no_grad():
            for _ in range(repeats + 1):
                state["index"] = 0
                root(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    costs = []
    for values in samples:
        values = sorted(values[1:]) or [0.0]
        costs.append(3000.0 * values[len(values) // 2])
    return costs


def parameter_places(plan: SplitPlan) -> Iterator[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Every parameter of the units, with each ``(unit, name inside it)`` holding it."""
    places: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for unit in plan.units:
        for name, parameter in unit.named_parameters(remove_duplicate=False):
            entry = places.setdefault(id(parameter), (parameter, []))
            if all(m is not unit or n != name for m, n in entry[1]):
                entry[1].append((unit, name))
    yield from places.values()


def describe_bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


# ------------------------------------------------------------------------------------------ set-up


@dataclass
class PreparedSplit:
    """A module split for one rank of the pipeline: the plan, and what ``PipelineModel`` needs of it."""

    plan: SplitPlan
    balance: list[int]               # unit calls per chunk
    call_parameters: list[int]       # parameters of each unit call's module (for the balance report)
    costs: list[float] | None        # profiled ms per unit call ("auto")
    ties: list[Any]                  # hybridpipe.pipeline.tied.Tie, across ranks
    tied_names: list[tuple[str, ...]]
    local: list[nn.Module]           # the units this rank calls
    built: dict[str, nn.Module]      # str(unit index) -> unit, for TiedWeights


def is_meta(root: nn.Module) -> bool:
    """Whether any of ``root``'s parameters or buffers is on the meta device (built under
    ``torch.device("meta")``: shapes only)."""
    return any(t.device.type == "meta" for t in (*root.parameters(), *root.buffers()))


def prepare(root: nn.Module, sample: Any, split: Any, chunks: int, ranks: int, rank: int,
            from_rank_zero: Any, device: torch.device | None = None) -> PreparedSplit:
    """Traces ``root`` on ``sample``, chooses the cuts (``split="auto"``: profiled on world rank 0 and shared
    by ``from_rank_zero(function)``, which runs ``function`` there and returns its result everywhere, or raises
    its exception everywhere; or a
    list of module names), finds the ties, releases other ranks' units and installs the dispatch. A module on
    the meta device is traced there, cut by parameter counts for "auto", and this rank's units (and the glue's
    buffers) are then materialized on ``device`` (:func:`materialize`)."""
    meta = is_meta(root)
    try:
        with _materialized_while_called(root) if meta else contextlib.nullcontext():
            units, trace = trace_module(root, sample)
    except SplitError:
        raise
    except Exception as error:
        if not meta:
            raise
        raise SplitError(f"tracing the meta-device {type(root).__name__} (each module materialized on the CPU "
                         f"while it is called) failed ({type(error).__name__}: {error}): its forward uses a "
                         "module's tensors outside that module's call; build the module on the CPU (or load it), "
                         "then hand it over") from error
    costs = None
    if isinstance(split, str):
        if split != "auto":
            raise SplitError(f"split={split!r}: use 'auto' (cut by profiled time) or a list of the qualified module "
                             "names at which a new stage begins, e.g. split=['model.layers.4']")

        if meta:  # nothing to time yet: parameters stand for time
            boundaries = boundaries_from_costs([float(sum(p.numel() for p in c.module.parameters()))
                                                for c in trace.calls], chunks)
        else:
            try:
                costs = from_rank_zero(lambda: profile_calls(root, units, trace, sample))
            except Exception as error:  # the same on every rank; its own type stays the cause
                raise SplitError(f'split="auto": profiling the module on world rank 0 failed '
                                 f"({type(error).__name__}: {error})") from error
            boundaries = boundaries_from_costs(costs, chunks)
    elif isinstance(split, (list, tuple)):
        boundaries = boundaries_from_names(trace, list(split), chunks)
    else:
        raise SplitError(f"split must be 'auto' or a list of module names, got {type(split).__name__}")
    plan = SplitPlan(root, units, trace, boundaries, ranks)
    balance = [boundaries[c + 1] - boundaries[c] for c in range(chunks)]
    call_parameters = [sum(p.numel() for p in call.module.parameters()) for call in trace.calls]
    ties, tied_names = _ties(plan)
    local = plan.local_modules(rank)
    built = {str(plan.unit_index[id(m)]): m for m in local}
    release_remote(root, local, units, last_rank=rank == ranks - 1)
    if meta:
        materialize(root, plan, local, device or torch.device("cpu"))
    install_dispatch(units)
    return PreparedSplit(plan, balance, call_parameters, costs, ties, tied_names, local, built)


@contextlib.contextmanager
def _materialized_while_called(root: nn.Module) -> Iterator[None]:
    """While active, each module whose own parameters or buffers are on the meta device gets them on the CPU,
    initialized by the module's own initialization, for the length of each of its calls (so a trace of a meta
    model holds one module's tensors at a time)."""
    initialize = getattr(root, "_init_weights", None)
    saved: dict[int, list[tuple[dict, str, torch.Tensor]]] = {}

    def pre(module: nn.Module, _args: Any) -> None:
        slots = []
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is not None and tensor.device.type == "meta":
                    slots.append((table, name, tensor))
                    empty = torch.empty_like(tensor, device="cpu")
                    table[name] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) \
                        else empty
        if slots:
            saved.setdefault(id(module), []).append(slots)
            with torch.no_grad(), torch.random.fork_rng():
                if initialize is not None:
                    initialize(module)
                elif callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()

    def post(module: nn.Module, _args: Any, _output: Any) -> None:
        stack = saved.get(id(module))
        if stack:
            for table, name, tensor in stack.pop():
                table[name] = tensor

    handles = []
    for module in root.modules():
        if any(t is not None and t.device.type == "meta"
               for t in (*module._parameters.values(), *module._buffers.values())):
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def materialize(root: nn.Module, plan: SplitPlan, local: Sequence[nn.Module], device: torch.device) -> None:
    """Allocates on ``device`` the meta tensors of this rank's units and of the glue (modules outside every unit,
    which every rank runs), keeping ties (one new tensor per old one), and initializes them with the module's own
    initialization: transformers' ``_init_weights`` on each module where the root has it, else each module's
    ``reset_parameters``. Unit ``i`` is initialized under seed ``torch.initial_seed() + i``, so every replica of a
    stage starts from the same weights whatever else ran before."""
    of_units = {id(m) for unit in plan.units for m in unit.modules()}
    wanted = {id(t) for unit in local for t in (*unit.parameters(), *unit.buffers())}
    glue = [m for m in root.modules() if id(m) not in of_units]
    for module in glue:
        wanted.update(id(t) for t in (*module._parameters.values(), *module._buffers.values()) if t is not None)
    made: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for slots, parameter in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in list(slots.items()):
                if tensor is None or tensor.device.type != "meta" or id(tensor) not in wanted:
                    continue
                new = made.get(id(tensor))
                if new is None:
                    empty = torch.empty_like(tensor, device=device)
                    new = nn.Parameter(empty, requires_grad=tensor.requires_grad) if parameter else empty
                    made[id(tensor)] = new
                slots[name] = new
    initialize = getattr(root, "_init_weights", None)
    base = torch.initial_seed()
    groups = [(plan.unit_index[id(u)], list(u.modules())) for u in local] + [(len(plan.units), glue)]
    with torch.no_grad():
        for index, modules in groups:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed((base + index) % (2 ** 63))
                for module in modules:
                    if initialize is not None:
                        initialize(module)
                    elif callable(getattr(module, "reset_parameters", None)):
                        module.reset_parameters()


def load_weights(model_state: dict[str, torch.Tensor], weights: Any) -> list[str]:
    """Copies into ``model_state`` (this rank's tensors by name) what ``weights`` holds of them: a state_dict, or the
    path of a safetensors file, of which only these tensors are read. Returns the names it did not hold."""
    missing = []
    with torch.no_grad():
        if isinstance(weights, (str, os.PathLike)):
            from safetensors import safe_open

            with safe_open(os.fspath(weights), framework="pt") as file:
                present = set(file.keys())
                for name, target in model_state.items():
                    if name in present:
                        target.copy_(file.get_tensor(name))
                    else:
                        missing.append(name)
        else:
            for name, target in model_state.items():
                if name in weights:
                    target.copy_(weights[name])
                else:
                    missing.append(name)
    return missing


def _ties(plan: SplitPlan) -> tuple[list[Any], list[tuple[str, ...]]]:
    from hybridpipe.pipeline.tied import Tie

    chunks_of: dict[int, list[int]] = {}
    for call in plan.trace.calls:
        chunks_of.setdefault(id(call.module), []).append(plan.call_chunk[call.index])
    names_of: dict[int, list[str]] = {}
    for name, parameter in plan.root.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    ties, names = [], []
    for parameter, holders in parameter_places(plan):
        places, chunk_list, ranks, labels = [], [], [], []
        for unit, name in holders:
            by_rank: dict[int, int] = {}
            for chunk in chunks_of.get(id(unit), []):
                by_rank.setdefault(chunk % plan.ranks, chunk)
            for holder, chunk in sorted(by_rank.items()):
                places.append((plan.unit_index[id(unit)], name))
                chunk_list.append(chunk)
                ranks.append(holder)
                labels.append(f"{plan.names.get(id(unit), type(unit).__name__)}.{name}")
        if len(set(ranks)) > 1:
            ties.append(Tie(None, tuple(places), tuple(chunk_list), tuple(ranks), tuple(labels)))
            names.append(tuple(names_of.get(id(parameter), labels)))
    return ties, names


def move_local(root: nn.Module, device: torch.device) -> None:
    """Moves every parameter and buffer of ``root`` that is not on the meta device to ``device`` (parameters
    keep their identity, so ties hold)."""
    for module in root.modules():
        for parameter in module._parameters.values():
            if parameter is not None and parameter.device.type != "meta" and parameter.device != device:
                parameter.data = parameter.data.to(device)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type != "meta" and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def first_difference(expected: Any, got: Any, rtol: float, atol: float) -> str | None:
    """Where two outputs (nested tensors) differ beyond the tolerance, as text; None when they agree."""
    left, left_spec = pytree.tree_flatten(expected)
    right, right_spec = pytree.tree_flatten(got)
    if len(left) != len(right):
        return f"the outputs have different structures ({left_spec} vs {right_spec})"
    for position, (a, b) in enumerate(zip(left, right)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape:
                return f"output leaf {position}: shape {tuple(b.shape)} instead of {tuple(a.shape)}"
            b = b.to(a.device, a.dtype)
            if not torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
                worst = float((a.double() - b.double()).abs().max())
                return f"output leaf {position} {tuple(a.shape)}: largest difference {worst:.3g}"
    return None


def report(plan: SplitPlan, balance: Sequence[int], costs: Sequence[float] | None, stages: int) -> str:
    """Each chunk's units, parameters, profiled time, and the values crossing into it."""
    lines = []
    for chunk in range(plan.chunks):
        calls = [plan.trace.calls[i] for i in plan.calls_of(chunk)]
        names = []
        for call in calls:
            if not names or names[-1][0] != call.name:
                names.append([call.name, 1])
            else:
                names[-1][1] += 1
        listing = ", ".join(n if k == 1 else f"{n} (×{k})" for n, k in names)
        modules = plan.chunk_modules[chunk]
        parameters = sum(p.numel() for m in modules for p in _real(m.parameters()))
        shapes_params = sum(p.numel() for m in modules for p in m.parameters())
        ms = f", {sum(costs[i] for i in plan.calls_of(chunk)):.2f} ms forward+backward" if costs else ""
        lines.append(f"chunk {chunk} (stage {chunk % stages}): {len(calls)} unit calls, "
                     f"{max(parameters, shapes_params):,} parameters{ms}")
        lines.append(f"  units: {listing}")
        crossing = plan.crossing(chunk)
        if chunk:
            if crossing:
                total = sum(_numel(shape) * _itemsize(dtype) for _, shape, dtype in crossing)
                lines.append(f"  receives {len(crossing)} value(s), {describe_bytes(total)} per micro-batch on the "
                             "sample:")
                for label, shape, dtype in crossing:
                    lines.append(f"    {label}: {tuple(shape)} {str(dtype).replace('torch.', '')} "
                                 f"({describe_bytes(_numel(shape) * _itemsize(dtype))})")
            else:
                lines.append("  receives nothing (all it needs is recomputed from the batch)")
            if plan.shapes_in[chunk]:
                lines.append(f"  and the shapes of {len(plan.shapes_in[chunk])} more (placeholders for glue)")
    return "\n".join(lines)


def _real(parameters: Any) -> Iterator[torch.Tensor]:
    return (p for p in parameters if p.device.type != "meta")


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

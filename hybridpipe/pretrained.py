"""Hugging Face folders in and out of a pipeline: ``hp.save_pretrained(model, path)`` and
``hp.load_pretrained(model, path)``.

A folder is what ``transformers``' ``save_pretrained`` writes and ``AutoModel*.from_pretrained`` reads: the model's
``config.json`` and its weights as safetensors, one ``model.safetensors`` or several shards listed in
``model.safetensors.index.json`` (``weight_map``: tensor name -> file). The names are the module's own: a
``hp.PipelineModel`` built from a module keeps them (``transformer.h.3.attn.c_attn.weight``).

Design reasons:

* **Each stage writes its own shard.** Replica 0 of stage ``s`` writes ``model-<s+1>-of-<P>.safetensors`` with the
  tensors of its stage that no lower stage holds (a weight tied across stages, such as GPT-2's embedding and head,
  is written once, under the name the lower stage holds, as ``transformers`` itself saves tied weights); world rank
  0 writes the index and ``config.json`` (the split module's ``config``). Nothing is gathered on one rank.
* **Each rank reads only its tensors** (safetensors opens a file lazily and reads one tensor at a time), and a name
  the folder lacks is taken from another name of its tie (a head saved only as the embedding).
* **Collective and agreed**: every rank calls both; a failure on any rank (a missing tensor, a shape that differs, a
  full disk) raises on every rank (:class:`~hybridpipe.errors.CheckpointError`), and nothing is loaded anywhere
  unless every rank found all of its tensors. ZeRO-3's freed parameters are gathered for the moment they are copied
  (``optimizer=``), and what is loaded goes into its shards.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from . import runtime
from .comm.agree import agree_on_failure
from .comm.engine import call
from .errors import CheckpointError, UsageError

__all__ = ["save_pretrained", "load_pretrained", "INDEX_NAME", "SINGLE_NAME"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _whole(optimizer: Any, writeback: bool = False) -> Any:
    if getattr(optimizer, "zero", 0) == 3:
        return optimizer.full_parameters(writeback=writeback)
    return contextlib.nullcontext()


def _shard_name(stage: int, stages: int) -> str:
    return SINGLE_NAME if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def _own_tensors(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """This rank's state, each storage once (a tie within the rank keeps its first name), copied to the host."""
    seen: set[int] = set()
    mine: dict[str, torch.Tensor] = {}
    with _whole(optimizer):
        for name, tensor in model.state_dict().items():
            key = tensor.untyped_storage().data_ptr() + tensor.storage_offset() if tensor.numel() else id(tensor)
            if key in seen:
                continue
            seen.add(key)
            mine[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return mine


def save_pretrained(model: Any, path: str | os.PathLike, optimizer: Any = None, config: Any = None) -> Path:
    """Writes ``model`` (a ``hp.PipelineModel``, on any grid) as a Hugging Face folder that
    ``AutoModel*.from_pretrained(path)`` loads; collective over the world.

    Args:
        model: the pipeline (each stage writes its own shard; see the module docstring).
        path: the folder (created).
        optimizer: its ``hp.DistributedOptimizer`` when ``zero=3`` (the freed parameters are gathered to be
            written); otherwise not needed.
        config: what ``config.json`` is written from (anything with ``save_pretrained(path)``); default: the split
            module's ``config`` (a transformers model's), none for a layer list.

    Returns:
        The folder's path.
    """
    from safetensors.torch import save_file

    grid = runtime.job("save_pretrained").grid
    target = Path(path)
    stage, stages = getattr(model, "stage", 0), getattr(model, "stages", 1)
    mine = _own_tensors(model, optimizer)
    world = grid.world_comm
    held = call(None, "save_pretrained", lambda: world.allgather((stage, grid.replica, sorted(mine))))
    lower = {name for s, r, names in held if s < stage and r == 0 for name in names}
    written = {name: tensor for name, tensor in mine.items() if name not in lower}
    shard = _shard_name(stage, stages)
    config = config if config is not None else getattr(getattr(model, "module", None), "config", None)

    def write() -> None:  # (no collective inside: a rank that fails here must not leave the others waiting)
        if grid.replica == 0:
            save_file(written, str(target / shard), metadata={"format": "pt"})
        if grid.rank == 0 and config is not None:
            config.save_pretrained(str(target))

    what = f"save_pretrained({target})"
    agree_on_failure(world, _failing_as_checkpoint(lambda: target.mkdir(parents=True, exist_ok=True), what), root=0,
                     what="save_pretrained")
    agree_on_failure(world, _failing_as_checkpoint(write, what), what="save_pretrained")
    sizes = {name: (shard, t.numel() * t.element_size()) for name, t in written.items()}
    files = call(None, "save_pretrained", lambda: world.allgather((grid.replica, sizes)))
    if grid.rank == 0 and stages > 1:
        weight_map = {name: place[0] for replica, entries in files if replica == 0 for name, place in entries.items()}
        total = sum(place[1] for replica, entries in files if replica == 0 for place in entries.values())
        (target / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                                     "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    call(None, "save_pretrained", world.Barrier)  # the index is there when any rank returns
    return target


def _failing_as_checkpoint(function: Any, what: str) -> Any:
    def run() -> Any:
        try:
            return function()
        except OSError as error:
            raise CheckpointError(f"{what}: {error}") from error
    return run


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / INDEX_NAME
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / SINGLE_NAME
    if not single.exists():
        raise CheckpointError(f"{folder} holds neither {INDEX_NAME} nor {SINGLE_NAME}: not a Hugging Face folder "
                              "(save one with hp.save_pretrained or transformers' save_pretrained)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as opened:
        return {name: SINGLE_NAME for name in opened.keys()}


def _read_own(model: Any, folder: Path, optimizer: Any) -> dict[str, torch.Tensor]:
    """The tensors of this rank's state from ``folder``, each read alone (a name missing there: another of its tie's)."""
    from safetensors import safe_open

    weight_map = _weight_map(folder)
    aliases = {name: tie for tie in getattr(model, "tied_parameter_names", ()) for name in tie}
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(optimizer, "zero", 0) == 3:
        shapes.update({k: v for k, v in optimizer.parameter_shapes(
            {id(p): n for n, p in model.named_parameters()}).items() if k in shapes})
    found: dict[str, torch.Tensor] = {}
    missing, wrong = [], []
    opened: dict[str, Any] = {}
    with contextlib.ExitStack() as files:
        for name, shape in shapes.items():
            source = next((n for n in (name, *aliases.get(name, ())) if n in weight_map), None)
            if source is None:
                missing.append(name)
                continue
            file = weight_map[source]
            if file not in opened:
                opened[file] = files.enter_context(safe_open(str(folder / file), framework="pt"))
            tensor = opened[file].get_tensor(source)
            if tuple(tensor.shape) != shape:
                wrong.append(f"{name}: {tuple(tensor.shape)} in {file}, {shape} here")
            found[name] = tensor
    if missing or wrong:
        raise CheckpointError(f"load_pretrained({folder}): " + "; ".join(
            ([f"{len(missing)} tensors this stage needs are not in the folder (e.g. {missing[:3]})"] if missing else [])
            + ([f"shapes differ ({'; '.join(wrong[:3])})"] if wrong else []))
            + ": was it saved from the same model and configuration?")
    return found


def load_pretrained(model: Any, path: str | os.PathLike, optimizer: Any = None) -> dict[str, Any]:
    """Loads a Hugging Face folder (``config.json`` plus ``model.safetensors`` or its sharded index) into ``model``'s
    stages, each rank reading only its own tensors; collective over the world. Nothing is loaded on any rank unless
    every rank found all of its tensors with their shapes.

    Args:
        model: a ``hp.PipelineModel`` built from the same model (the names are the module's own).
        path: the folder.
        optimizer: its ``hp.DistributedOptimizer`` when ``zero=3`` (what is loaded goes into its shards).

    Returns:
        ``{"tensors": how many this rank loaded, "files": the folder's weight files}``.

    Raises:
        CheckpointError: not a folder of weights, tensors missing or of other shapes (named), on every rank.
    """
    grid = runtime.job("load_pretrained").grid
    folder = Path(path)
    if not hasattr(model, "state_dict"):
        raise UsageError(f"load_pretrained: {type(model).__name__} is not a model (pass the hp.PipelineModel)")
    found = agree_on_failure(grid.world_comm, lambda: _read_own(model, folder, optimizer), what="load_pretrained")
    with _whole(optimizer, writeback=True), torch.no_grad():
        model.load_state_dict(found, strict=True)
    return {"tensors": len(found), "files": sorted(set(_weight_map(folder).values()))}

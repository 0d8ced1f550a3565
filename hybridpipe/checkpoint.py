"""Sharded checkpoints that reshard: save on one grid, load on any other; resume after a restart.

Layout of ``DIR`` (every write atomic: a temporary file, then ``os.replace``)::

    DIR/step-00000100/stage-0.pt      # stage 0's layers: parameters, buffers, optimizer state,
    DIR/step-00000100/stage-1.pt      #   and the RNG states of that stage's ranks
    DIR/step-00000100/manifest.json   # written after every stage file is complete
    DIR/latest                        # "step-00000100", replaced last

Everything is keyed by the ORIGINAL layer index and parameter name (``layers.7.weight``), never by
stage, so a checkpoint saved with 2 stages × 2 replicas loads into 4 × 1, 1 × 1 or another balance:
each rank reads the manifest and only the files of the saved stages that hold some of its layers,
and keeps its own. Optimizer state (e.g. AdamW's moments and step) follows its parameter. One
replica per stage (replica 0) writes. A process killed during a save leaves ``latest`` pointing to
the previous, complete checkpoint.

The fp16 loss scaler's state (``model.scaler``: scale, growth progress, skipped steps) is the same on
every rank; every stage file carries a copy, so any rank of any grid restores it from the files it reads.
Checkpoints without it (fp32, or older) still load and leave the scaler as it is.

Random generators (torch CPU and CUDA, ``random``, numpy; see :mod:`hybridpipe.rng_state`) are saved
per rank, keyed by (stage, replica). On load, a rank whose partition is the saved one (same stage
count and balance) gets the state of the same (stage, replica) back, so dropout continues exactly;
any other rank (the layers moved, or a replica that did not exist) is re-seeded from a seed derived
from the saved states it read and its new grid position: deterministic, and distinct per rank.

Files are read with ``torch.load(weights_only=True)``. ``python -m hybridpipe.checkpoint
consolidate DIR OUT.pt`` writes one ordinary ``state_dict`` for single-process inference.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from . import rng_state, runtime
from .comm.agree import Failure
from .comm.engine import call
from .errors import CheckpointError, UsageError

__all__ = ["CheckpointError", "ResumeInfo", "save_checkpoint", "load_checkpoint", "resume", "consolidate",
           "latest_checkpoint", "saved_balance", "CHECKPOINT_DIR_ENV", "RESTART_ENV"]

FORMAT = 1  # files without RNG states (written before they were saved) are format 1 too, and load

#: Set by ``hybridpipe-run --checkpoint-dir DIR`` on every rank: where the job saves and resumes.
CHECKPOINT_DIR_ENV = "HYBRIDPIPE_CHECKPOINT_DIR"
#: Set by ``hybridpipe-run --restarts N`` on every rank: 0 on the first attempt, then 1, 2, ...
RESTART_ENV = "HYBRIDPIPE_RESTART"


class _RankError:
    """One rank's failure in a checkpoint step: the message every rank's CheckpointError lists, and the exception
    itself (sent to the others with its type, as :class:`hybridpipe.comm.agree.Failure`), which becomes the
    CheckpointError's cause on every rank."""

    def __init__(self, message: str, exc: BaseException) -> None:
        self.message, self.exc = message, exc
        self.failure = Failure.of(exc, runtime.rank())

    def __reduce__(self) -> Any:  # what travels: the message and the failure, not the live exception
        return (_sent, (self.message, self.failure))


def _sent(message: str, failure: Failure) -> Any:
    error = _RankError.__new__(_RankError)
    error.message, error.exc, error.failure = message, None, failure
    return error


def _raise_gathered(gathered: list[Any], text: Any, what: str, own: _RankError | None) -> None:
    """Raises CheckpointError(``text(sorted messages)``) on every rank if some rank's entry of ``gathered`` is a
    :class:`_RankError`, caused by this rank's ``own`` exception or else by the lowest failing rank's (its type
    kept)."""
    failed = [entry for entry in gathered if isinstance(entry, _RankError)]
    if not failed:
        return
    cause = own.exc if own is not None and own.exc is not None else failed[0].failure.exception(what)
    raise CheckpointError(text(sorted({entry.message for entry in failed}))) from cause


def _atomic_save(obj: Any, path: Path) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(obj, temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
    except BaseException:
        temporary.unlink(missing_ok=True)  # a partial file would only take the space a retry needs
        raise
    os.replace(temporary, path)


def _write_failed(exc: BaseException) -> str:
    """Why a checkpoint file could not be written, and what to do."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        text += " (the disk is full: free space or save to another directory)"
    return text + "; nothing of the earlier checkpoints was touched (`latest` still names the last complete one)"


def _atomic_write_text(text: str, path: Path) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _optimizer_state_by_name(model: Any, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"state": {}, "param_groups": []}
    names = {id(p): name for name, p in model.named_parameters()}
    state = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    position = 0
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if id(parameter) not in names:
                raise UsageError("the optimizer holds a parameter that is not in the model: checkpoint an "
                                 "optimizer over model.parameters()")
            index_to_name[position] = names[id(parameter)]
            position += 1
    by_name = {index_to_name[index]: value for index, value in state["state"].items()}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "param_names": [index_to_name[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": by_name, "param_groups": groups}


def _names(model: Any) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _zero_manifest(optimizer: Any, stage: int) -> dict[str, Any]:
    """The stage file's optimizer entry for a ZeRO optimizer: its hyper-parameters and the shard files."""
    size = optimizer.zero_replicas
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"state": {}, "param_groups": groups,
            "zero": {"level": optimizer.zero, "replicas": size,
                     "files": [f"stage-{stage}.optimizer-{r}-of-{size}.pt" for r in range(size)]}}


def assemble_zero_shards(pieces_by_rank: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every replica's ZeRO ``sharded_state_by_name()['state']`` (one per owner) -> whole tensors per name."""
    shapes: dict[str, tuple] = {}
    for saved in pieces_by_rank:
        shapes.update(saved.get("shapes", {}))
    whole: dict[str, dict[str, Any]] = {}
    for saved in pieces_by_rank:
        for name, entry in saved["state"].items():
            target = whole.setdefault(name, {})
            for key, value in entry.items():
                if isinstance(value, list):
                    shape = shapes[name]
                    numel = 1
                    for d in shape:
                        numel *= d
                    tensor = target.get(key)
                    if tensor is None:
                        tensor = target[key] = torch.zeros(numel, dtype=value[0][1].dtype if value else torch.float32)
                    for start, piece in value:
                        if tensor.dtype != piece.dtype:
                            tensor = target[key] = tensor.to(piece.dtype)
                        tensor[start:start + piece.numel()].copy_(piece)
                else:
                    target[key] = value
    for name, entry in whole.items():
        for key, value in list(entry.items()):
            if torch.is_tensor(value) and value.dim() == 1 and name in shapes and value.numel() > 0 \
                    and value.numel() == _numel(shapes[name]) and tuple(shapes[name]) != (value.numel(),):
                entry[key] = value.reshape(shapes[name])
    return whole


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _whole(optimizer: Any, writeback: bool = False) -> Any:
    """A ZeRO-3 optimizer's parameters gathered whole for a ``with`` body (the model's state saved or loaded);
    nothing for the others, whose parameters are whole."""
    if getattr(optimizer, "zero", 0) == 3:
        return optimizer.full_parameters(writeback=writeback)
    return contextlib.nullcontext()


def is_pipeline(model: Any) -> bool:
    """Whether ``model`` is split into pipeline stages (a PipelineModel): each stage holds its own layers."""
    return hasattr(model, "layers_of_stage")


def _gather_rng_states(model: Any, grid: runtime.Grid) -> list[dict] | None:
    """Every rank's generator states, on the rank that writes the file they go into (else None).

    A pipeline stage's file holds the states of that stage's replicas (gathered over ``data``); a
    plain module's single file, written by rank 0, holds every rank's (gathered over the world).
    """
    mine = {"stage": grid.stage, "replica": grid.replica, **rng_state.capture()}
    if is_pipeline(model):
        return call("data", "save_checkpoint", lambda: grid.data_comm.gather(mine, root=0))
    return call(None, "save_checkpoint", lambda: grid.world_comm.gather(mine, root=0))


def save_checkpoint(directory: str | os.PathLike, model: Any, optimizer: torch.optim.Optimizer | None = None,
                    step: int = 0, extra: dict | None = None, scaler: Any = None) -> Path:
    """Saves this grid's model (a PipelineModel or nn.Module), optimizer, fp16 loss scaler and every
    rank's random generator states; collective over the world.

    Args:
        directory: the checkpoint directory (created).
        model: a ``hp.PipelineModel`` (each stage saves its layers) or a plain module (rank 0 saves).
        optimizer: the (Distributed)Optimizer over ``model.parameters()``, or None (an asynchronous
            PipelineModel: its own ``model.optimizer``; its in-flight micro-batches are flushed first).
        step: the training step, part of the checkpoint's name.
        extra: small picklable-by-torch values (ints, floats, strings, tensors) to restore with it.
        scaler: the ``hp.LossScaler`` to save (its scale, growth progress and skipped steps); None: the
            model's own (``model.scaler``, a PipelineModel with ``precision="fp16"``), if any.

    Returns:
        The path of the written checkpoint (``DIR/step-XXXXXXXX``).
    """
    grid = runtime.job("save_checkpoint").grid
    if callable(getattr(model, "flush", None)):
        model.flush()  # asynchronous pipeline schedules: apply what is in flight first
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    scaler = _scaler(model, scaler)
    root = Path(directory)
    name = f"step-{int(step):08d}"
    target = root / name
    stage = getattr(model, "stage", 0)
    stages = getattr(model, "stages", 1)
    error: _RankError | None = None
    if grid.rank == 0:
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = _RankError(f"cannot create {target}: {exc}", exc)
    created = call(None, "save_checkpoint", lambda: grid.world_comm.bcast(error, root=0))
    _raise_gathered([created], "; ".join, "save_checkpoint", error)
    error = None
    rng_states = _gather_rng_states(model, grid)  # captured before anything below could draw
    writer = grid.replica == 0 and (stages > 1 or grid.stage == 0)
    sharded = getattr(optimizer, "zero", 0) > 0
    if sharded:  # ZeRO: every replica writes its own shard of the optimizer state
        try:
            shard_file = f"stage-{stage}.optimizer-{optimizer.zero_rank}-of-{optimizer.zero_replicas}.pt"
            _atomic_save({"format": FORMAT, "model": {}, "zero": optimizer.sharded_state_by_name(_names(model))},
                         target / shard_file)
        except Exception as exc:  # every rank must learn of it
            error = _RankError(f"stage {stage} replica {grid.replica} could not write its optimizer shard: "
                               f"{_write_failed(exc)}", exc)
    with _whole(optimizer):  # (collective over the stage's replicas)
        weights = {k: v.detach().cpu() for k, v in model.state_dict().items()} if writer else {}
    if writer and not error:
        try:
            payload = {
                "format": FORMAT,
                "stage": stage,
                "layers": list(model.layers_of_stage(stage)) if is_pipeline(model) else None,
                "model": weights,
                "optimizer": (_zero_manifest(optimizer, stage) if sharded
                              else _optimizer_state_by_name(model, optimizer)),
                "step": int(step),
                "extra": extra or {},
                "rng": rng_states,
            }
            if scaler is not None:  # the same on every rank (it is agreed): every stage file carries it
                payload["scaler"] = scaler.state_dict()
            _atomic_save(payload, target / f"stage-{stage}.pt")
        except Exception as exc:  # every rank must learn of it
            error = _RankError(f"stage {stage} could not write its file: {_write_failed(exc)}", exc)
    _raise_gathered(call(None, "save_checkpoint", lambda: grid.world_comm.allgather(error)), "; ".join,
                    "save_checkpoint", error)
    if grid.rank == 0:
        manifest = {"format": FORMAT, "step": int(step), "stages": stages,
                    "balance": list(getattr(model, "balance", [])),
                    "files": [f"stage-{s}.pt" for s in range(stages)],
                    "grid": {"pipeline_stages": grid.pipeline_stages, "data_replicas": grid.data_replicas}}
        _atomic_write_text(json.dumps(manifest, indent=1), target / "manifest.json")
        _atomic_write_text(name + "\n", root / "latest")
    call(None, "save_checkpoint", grid.world_comm.Barrier)
    return target


def _scaler(model: Any, scaler: Any) -> Any:
    """The loss scaler a checkpoint saves or restores: the one passed, else the model's fp16 one, or None."""
    return scaler if scaler is not None else getattr(model, "scaler", None)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (what ``latest`` names), or None."""
    pointer = Path(directory) / "latest"
    if not pointer.exists():
        return None
    return Path(directory) / pointer.read_text().strip()


def _read_manifest(checkpoint: Path) -> dict:
    try:
        manifest = json.loads((checkpoint / "manifest.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint} has no manifest.json: the save did not finish (use the previous "
                              "checkpoint, or the directory's `latest`)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{checkpoint}/manifest.json is not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint} has format {manifest.get('format')!r}; this hybridpipe reads "
                              f"format {FORMAT}")
    return manifest


def _read_file(path: Path) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as exc:
        raise CheckpointError(f"{path} is truncated or not a hybridpipe checkpoint file "
                              f"({type(exc).__name__}: {exc}): load an earlier checkpoint (the directory's "
                              "other step-* checkpoints), or save this one again") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "model" not in payload:
        raise CheckpointError(f"{path} is not a hybridpipe checkpoint file")
    return payload


def _resolve(directory: str | os.PathLike) -> Path:
    path = Path(directory)
    if (path / "manifest.json").exists() or any(path.glob("stage-*.pt")):
        return path  # one checkpoint (an unfinished one is refused by _read_manifest)
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"no checkpoint in {path} (no `latest` file and no manifest.json)")
    return latest


def _load_all(checkpoint: Path) -> tuple[dict, list[dict]]:
    manifest = _read_manifest(checkpoint)
    return manifest, [_read_file(checkpoint / name) for name in manifest["files"]]


def _files_needed(manifest: dict, model: Any) -> list[str]:
    """The saved stage files that hold some layer of this rank's stage, in stage order.

    A plain module, or a checkpoint whose manifest has no per-stage balance (a plain module's),
    needs every file."""
    files, balance = list(manifest["files"]), list(manifest.get("balance") or [])
    if not is_pipeline(model) or len(balance) != len(files):
        return files
    own = model.layers_of_stage(model.stage)
    needed, start = [], 0
    for name, count in zip(files, balance):
        if start < own.stop and own.start < start + count:
            needed.append(name)
        start += count
    return needed


def _restore_rng(manifest: dict, payloads: list[dict], model: Any, grid: runtime.Grid) -> str:
    """Sets this rank's generators from the checkpoint (rule in the module docstring); returns
    "restored", "reseeded" or "not saved"."""
    entries = [entry for payload in payloads for entry in (payload.get("rng") or [])]
    if not entries:
        return "not saved"
    saved_stages = manifest.get("grid", {}).get("pipeline_stages")
    same_partition = (saved_stages == grid.pipeline_stages
                      and list(manifest.get("balance") or []) == list(getattr(model, "balance", [])))
    if same_partition:
        for entry in entries:
            if (entry["stage"], entry["replica"]) == (grid.stage, grid.replica):
                rng_state.restore(entry)
                return "restored"
    first = sorted(payloads[0].get("rng") or entries, key=lambda e: (e["stage"], e["replica"]))
    reference = first[grid.replica % len(first)]
    rng_state.reseed(rng_state.derive_seed(reference, grid.pipeline_stages, grid.data_replicas, grid.stage,
                                           grid.replica, int(manifest["step"])))
    return "reseeded"


def _prepare(checkpoint: Path, manifest: dict, payloads: list[dict], model: Any,
             optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """Checks the files against the model; returns (model state to load, optimizer state or None)."""
    tensors: dict[str, torch.Tensor] = {}
    optimizer_state: dict[str, Any] = {}
    groups: list[dict] = []
    for payload in payloads:
        tensors.update(payload["model"])
        optimizer_state.update(payload["optimizer"]["state"])
        groups = groups or payload["optimizer"]["param_groups"]
        zero = payload["optimizer"].get("zero")
        if zero and optimizer is not None:  # saved sharded: every owner's pieces make the whole tensors
            shards = []
            for name in zero["files"]:
                shard = _read_file(checkpoint / name)
                if "zero" not in shard:
                    raise CheckpointError(f"{checkpoint / name} is not a ZeRO optimizer shard")
                shards.append(shard["zero"])
            optimizer_state.update(assemble_zero_shards(shards))
    own = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    if getattr(optimizer, "zero", 0) == 3:  # its parameters are freed between uses: the layout has their shapes
        own.update({key: shape for key, shape in optimizer.parameter_shapes(_names(model)).items() if key in own})
    missing = [key for key in own if key not in tensors]
    if missing:
        raise CheckpointError(f"{checkpoint} lacks {len(missing)} entries this model needs "
                              f"(e.g. {missing[:3]}); was it saved from the same model?")
    wrong = [f"{key}: {tuple(tensors[key].shape)} saved, {own[key]} here" for key in own
             if tuple(tensors[key].shape) != own[key]]
    if wrong:
        raise CheckpointError(f"{checkpoint}: shapes differ ({'; '.join(wrong[:3])}): it was saved from another "
                              "model (other sizes); build the model it was saved from, or load another checkpoint")
    if optimizer is None:
        return {key: tensors[key] for key in own}, None
    # a tied weight's state may be saved under another of its names (a grid where one rank held both)
    aliases = {name: tie for tie in getattr(model, "tied_parameter_names", ()) for name in tie}
    if getattr(optimizer, "zero", 0) > 0:  # keeps its own pieces of the whole tensors (any saved D / level)
        for tie in dict.fromkeys(map(tuple, aliases.values())):
            saved_as = next((name for name in tie if name in optimizer_state), None)
            for name in tie if saved_as is not None else ():
                optimizer_state.setdefault(name, optimizer_state[saved_as])
        return {key: tensors[key] for key in own}, {"zero": (optimizer_state, groups)}
    names = {id(p): name for name, p in model.named_parameters()}
    current = optimizer.state_dict()
    position, state = 0, {}
    for index, group in enumerate(optimizer.param_groups):
        for parameter in group["params"]:
            name = names.get(id(parameter))
            saved_as = next((alias for alias in (name, *aliases.get(name, ())) if alias in optimizer_state), None)
            if saved_as is not None:
                state[position] = optimizer_state[saved_as]
            position += 1
        if index < len(groups):  # hyper-parameters (lr after a scheduler, betas, ...)
            current["param_groups"][index].update(
                {k: v for k, v in groups[index].items() if k not in ("param_names", "params")})
    current["state"] = state
    return {key: tensors[key] for key in own}, current


def _raise_on_any(grid: runtime.Grid, error: _RankError | None, what: str) -> None:
    _raise_gathered(call(None, "load_checkpoint", lambda: grid.world_comm.allgather(error)),
                    lambda errors: f"{what} failed: " + " | ".join(errors), "load_checkpoint", error)


def load_checkpoint(directory: str | os.PathLike, model: Any, optimizer: torch.optim.Optimizer | None = None,
                    restore_rng: bool = True, scaler: Any = None) -> dict:
    """Restores ``model`` (and ``optimizer``, the fp16 loss scaler, and the random generators) from a
    checkpoint saved on any grid; collective over the world.

    Each rank reads the manifest and the files of the saved stages that hold its layers (all files
    for a plain module). Nothing is changed on any rank unless every rank's files check out.

    Args:
        directory: a checkpoint directory's parent (its ``latest`` is used) or one checkpoint.
        model: a ``hp.PipelineModel`` or plain module, as given to :func:`save_checkpoint`.
        optimizer: the optimizer over ``model.parameters()``, or None (an asynchronous PipelineModel:
            its own ``model.optimizer``).
        restore_rng: set the random generators from the checkpoint (see the module docstring for
            the rule when the grid differs); False leaves them alone.
        scaler: the ``hp.LossScaler`` to restore; None: the model's own (``model.scaler``), if any. A
            checkpoint without scaler state (saved in fp32, or by an older hybridpipe) leaves it as it
            is, with a warning on rank 0.

    Returns:
        ``{"step": int, "extra": dict, "rng": str}``: the checkpoint's step, the ``extra`` that
        stage 0 saved, and what happened to the random generators: ``"restored"`` (this rank's
        saved states), ``"reseeded"`` (other grid or partition: a seed derived from the saved
        states), ``"not saved"`` (a checkpoint from before RNG states were saved: generators left
        alone, with a warning on rank 0) or ``"skipped"`` (``restore_rng=False``).

    Raises:
        CheckpointError: missing, incomplete, truncated or foreign files; parameters missing or of
            another shape (names and shapes given).
    """
    grid = runtime.job("load_checkpoint").grid
    if callable(getattr(model, "flush", None)):
        model.flush()  # asynchronous pipeline schedules: nothing may be in flight when the weights change
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    scaler = _scaler(model, scaler)
    error: _RankError | None = None
    checkpoint, manifest, payloads, prepared = None, None, [], None
    try:
        checkpoint = _resolve(directory)
        manifest = _read_manifest(checkpoint)
        payloads = [_read_file(checkpoint / name) for name in _files_needed(manifest, model)]
        prepared = _prepare(checkpoint, manifest, payloads, model, optimizer)
    except Exception as exc:
        error = _RankError(f"{type(exc).__name__}: {exc}", exc)
    # rank 0 (stage 0, replica 0) always reads stage-0.pt: its ``extra`` travels with the error check
    shared = call(None, "load_checkpoint", lambda: grid.world_comm.allgather(
        (error, payloads[0].get("extra", {}) if grid.rank == 0 and payloads and not error else None)))
    _raise_gathered([e for e, _ in shared], lambda errors: "loading the checkpoint failed: " + " | ".join(errors),
                    "load_checkpoint", error)
    assert checkpoint is not None and manifest is not None and prepared is not None
    rng = "skipped"
    saved_scaler = next((payload["scaler"] for payload in payloads if "scaler" in payload), None)
    try:
        model_state, optimizer_state = prepared
        with _whole(optimizer, writeback=True):
            model.load_state_dict(model_state, strict=True)
        if optimizer is not None and "zero" in optimizer_state:
            optimizer.load_full_state_by_name(*optimizer_state["zero"], names=_names(model))
        elif optimizer is not None:
            optimizer.load_state_dict(optimizer_state)
        if callable(getattr(model, "restart_weight_versions", None)):
            model.restart_weight_versions()
        if scaler is not None and saved_scaler is not None:
            scaler.load_state_dict(saved_scaler)
        if restore_rng:
            rng = _restore_rng(manifest, payloads, model, grid)
    except Exception as exc:
        error = _RankError(f"{type(exc).__name__}: {exc}", exc)
    _raise_on_any(grid, error, "restoring the checkpoint")
    if rng == "not saved" and grid.rank == 0:
        warnings.warn(f"{checkpoint} holds no random generator states (saved by an older hybridpipe): they "
                      "are not restored, so dropout and other random draws do not continue as in the saved "
                      "run", stacklevel=2)
    if scaler is not None and saved_scaler is None and grid.rank == 0:
        warnings.warn(f"{checkpoint} holds no loss-scaler state (saved without precision='fp16', or by an "
                      f"older hybridpipe): the scaler keeps its scale {scaler.get_scale()}; a run resumed from "
                      "it may skip steps the saved run did not", stacklevel=2)
    return {"step": int(manifest["step"]), "extra": shared[0][1] or {}, "rng": rng}


# ---------------------------------------------------------------------- resuming


@dataclasses.dataclass(frozen=True)
class ResumeInfo:
    """What :func:`resume` found.

    Attributes:
        step: the step to continue from: the checkpoint's step, or 0 when nothing was loaded.
        extra: the ``extra`` saved with the checkpoint (empty when nothing was loaded).
        checkpoint: the checkpoint loaded (``DIR/step-XXXXXXXX``), or None: start from scratch.
        rng: what happened to the random generators (see :func:`load_checkpoint`); "" when nothing
            was loaded.

    Example:
        >>> state = hp.resume("ckpt", model, optimizer)
        >>> for step in range(state.step, steps): ...
    """

    step: int = 0
    extra: dict = dataclasses.field(default_factory=dict)
    checkpoint: Path | None = None
    rng: str = ""

    @property
    def resumed(self) -> bool:
        """True when a checkpoint was loaded."""
        return self.checkpoint is not None


def _spans(ranks: list[int]) -> str:
    parts, start = [], ranks[0]
    for previous, current in zip(ranks, ranks[1:] + [None]):
        if current != previous + 1:
            parts.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ",".join(parts)


def _agreed_latest(directory: str | os.PathLike | None, function: str) -> tuple[Path | None, dict | None]:
    """The checkpoint every rank finds in ``directory`` (None: there is none) and its manifest;
    collective over the world. Ranks that find different ones raise CheckpointError on every rank."""
    grid = runtime.job(function).grid
    error: _RankError | None = None
    found, manifest = None, None
    try:
        if directory is None:
            directory = os.environ.get(CHECKPOINT_DIR_ENV, "")
            if not directory:
                raise CheckpointError(f"no directory given and ${CHECKPOINT_DIR_ENV} is not set: pass the "
                                      "checkpoint directory, or launch with `hybridpipe-run --checkpoint-dir "
                                      "DIR`")
        path = Path(directory)
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"{path} is a file, not a checkpoint directory")
        found = path if (path / "manifest.json").exists() else latest_checkpoint(path)
        if found is not None:
            manifest = _read_manifest(found)
    except Exception as exc:
        error = _RankError(f"{type(exc).__name__}: {exc}", exc)
    seen = call(None, function, lambda: grid.world_comm.allgather((error, found.name if found else None)))
    _raise_gathered([e for e, _ in seen], lambda errors: f"hp.{function}: " + " | ".join(errors), function, error)
    names = {name for _, name in seen}
    if len(names) > 1:
        ranks_by_name = {name: [rank for rank, (_, seen_name) in enumerate(seen) if seen_name == name]
                         for name in sorted(names, key=str)}
        listing = "; ".join(f"{name or 'no checkpoint'} on rank(s) {_spans(ranks)}"
                            for name, ranks in ranks_by_name.items())
        raise CheckpointError(f"hp.{function}: ranks see different checkpoints in {directory} ({listing}): "
                              "every rank must see the same directory (on several hosts, a shared file "
                              "system)")
    return found, manifest


def resume(directory: str | os.PathLike | None, model: Any, optimizer: torch.optim.Optimizer | None = None,
           restore_rng: bool = True, scaler: Any = None) -> ResumeInfo:
    """Continues from the latest complete checkpoint in ``directory``, if there is one; collective.

    Loads it with :func:`load_checkpoint` (any grid: the checkpoint reshards) when there is one;
    an empty or missing directory means "start from scratch". Every rank must find the same
    checkpoint: ranks that see different ones (e.g. node-local directories) raise on every rank.

    Args:
        directory: where the job saves its checkpoints; None: ``$HYBRIDPIPE_CHECKPOINT_DIR`` (set
            by ``hybridpipe-run --checkpoint-dir``).
        model: a ``hp.PipelineModel`` or plain module.
        optimizer: the optimizer over ``model.parameters()``, or None.
        restore_rng: restore (or re-seed) the random generators, see :func:`load_checkpoint`.
        scaler: the loss scaler to restore (default ``model.scaler``), see :func:`load_checkpoint`.

    Returns:
        A :class:`ResumeInfo`: ``step`` to continue from (0 and ``checkpoint=None`` when starting
        from scratch), the checkpoint's ``extra``, and what happened to the generators.

    Raises:
        CheckpointError: ranks see different checkpoints, or the latest one is damaged (on every
            rank).

    Example:
        >>> state = hp.resume("ckpt", model, optimizer)
        >>> if state.resumed:
        ...     scheduler.load_state_dict(state.extra["scheduler"])
        >>> for step in range(state.step, total_steps): ...
    """
    checkpoint, _ = _agreed_latest(directory, "resume")
    if checkpoint is None:
        return ResumeInfo()
    info = load_checkpoint(checkpoint, model, optimizer, restore_rng=restore_rng, scaler=scaler)
    return ResumeInfo(step=info["step"], extra=info["extra"], checkpoint=checkpoint, rng=info["rng"])


def saved_balance(directory: str | os.PathLike | None,
                  pipeline_stages: int | None = None) -> list[int] | None:
    """The balance (layers per stage) of the latest checkpoint in ``directory`` when it was saved
    with ``pipeline_stages`` stages (default: this grid's), else None; collective over the world.

    Pass it to ``hp.PipelineModel(..., balance=...)`` before resuming: the same partition as the
    saved run restores each rank's own random generator states (dropout continues exactly), where
    a profiled ``balance="time"`` may come out different after a restart.

    Raises:
        CheckpointError: ranks see different checkpoints, or its manifest is damaged (every rank).
    """
    stages = pipeline_stages or runtime.job("saved_balance").grid.pipeline_stages
    _, manifest = _agreed_latest(directory, "saved_balance")
    if manifest is None or manifest.get("stages") != stages or len(manifest.get("balance") or []) != stages:
        return None
    return list(manifest["balance"])


def consolidate(directory: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Writes one ordinary state_dict (keys without the ``layers.`` prefix, i.e. those of the
    ``nn.Sequential`` of all layers) from a sharded checkpoint. No MPI needed."""
    checkpoint = _resolve(directory)
    _, payloads = _load_all(checkpoint)
    state: dict[str, torch.Tensor] = {}
    for payload in payloads:
        for key, value in payload["model"].items():
            state[key.removeprefix("layers.")] = value
    output = Path(output)
    _atomic_save(state, output)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridpipe.checkpoint",
                                     description="Tools for hybridpipe checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("consolidate", help="write one state_dict for single-process inference")
    merge.add_argument("directory", help="checkpoint directory (or its parent, whose `latest` is used)")
    merge.add_argument("output", help="the .pt file to write")
    args = parser.parse_args(argv)
    try:
        path = consolidate(args.directory, args.output)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

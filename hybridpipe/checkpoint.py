"""Sharded checkpoints that reshard: save on one grid, load on any other.

Layout of ``DIR`` (every write atomic: a temporary file, then ``os.replace``)::

    DIR/step-00000100/stage-0.pt      # stage 0's layers: parameters, buffers, optimizer state
    DIR/step-00000100/stage-1.pt
    DIR/step-00000100/manifest.json   # written after every stage file is complete
    DIR/latest                        # "step-00000100", replaced last

Everything is keyed by the ORIGINAL layer index and parameter name (``layers.7.weight``), never by
stage, so a checkpoint saved with 2 stages × 2 replicas loads into 4 × 1, 1 × 1 or another balance:
each rank reads the files that hold its layers and keeps its own. Optimizer state (e.g. AdamW's
moments and step) follows its parameter. One replica per stage (replica 0) writes. A process
killed during a save leaves ``latest`` pointing to the previous, complete checkpoint.

Files are read with ``torch.load(weights_only=True)``. ``python -m hybridpipe.checkpoint
consolidate DIR OUT.pt`` writes one ordinary ``state_dict`` for single-process inference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from . import runtime
from .comm.engine import call
from .errors import HybridPipeError

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "consolidate", "latest_checkpoint"]

FORMAT = 1


class CheckpointError(HybridPipeError):
    """A checkpoint is missing, incomplete, truncated or not a hybridpipe checkpoint."""


def _atomic_save(obj: Any, path: Path) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)


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
                raise HybridPipeError("the optimizer holds a parameter that is not in the model: checkpoint an "
                                      "optimizer over model.parameters()")
            index_to_name[position] = names[id(parameter)]
            position += 1
    by_name = {index_to_name[index]: value for index, value in state["state"].items()}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "param_names": [index_to_name[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": by_name, "param_groups": groups}


def save_checkpoint(directory: str | os.PathLike, model: Any, optimizer: torch.optim.Optimizer | None = None,
                    step: int = 0, extra: dict | None = None) -> Path:
    """Saves this grid's model (a PipelineModel or nn.Module) and optimizer; collective over the world.

    Args:
        directory: the checkpoint directory (created).
        model: a ``hp.PipelineModel`` (each stage saves its layers) or a plain module (rank 0 saves).
        optimizer: the (Distributed)Optimizer over ``model.parameters()``, or None.
        step: the training step, part of the checkpoint's name.
        extra: small picklable-by-torch values (ints, floats, strings, tensors) to restore with it.

    Returns:
        The path of the written checkpoint (``DIR/step-XXXXXXXX``).
    """
    grid = runtime._require("save_checkpoint").grid
    root = Path(directory)
    name = f"step-{int(step):08d}"
    target = root / name
    stage = getattr(model, "stage", 0)
    stages = getattr(model, "stages", 1)
    error = ""
    if grid.rank == 0:
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = f"cannot create {target}: {exc}"
    error = call(None, "save_checkpoint", lambda: grid.world_comm.bcast(error, root=0))
    if error:
        raise CheckpointError(error)
    writer = grid.replica == 0 and (stages > 1 or grid.stage == 0)
    if writer:
        try:
            payload = {
                "format": FORMAT,
                "stage": stage,
                "layers": list(model.layers_of_stage(stage)) if hasattr(model, "layers_of_stage") else None,
                "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "optimizer": _optimizer_state_by_name(model, optimizer),
                "step": int(step),
                "extra": extra or {},
            }
            _atomic_save(payload, target / f"stage-{stage}.pt")
        except Exception as exc:  # every rank must learn of it
            error = f"stage {stage} could not write its file: {type(exc).__name__}: {exc}"
    errors = [e for e in call(None, "save_checkpoint", lambda: grid.world_comm.allgather(error)) if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    if grid.rank == 0:
        manifest = {"format": FORMAT, "step": int(step), "stages": stages,
                    "balance": list(getattr(model, "balance", [])),
                    "files": [f"stage-{s}.pt" for s in range(stages)],
                    "grid": {"pipeline_stages": grid.pipeline_stages, "data_replicas": grid.data_replicas}}
        _atomic_write_text(json.dumps(manifest, indent=1), target / "manifest.json")
        _atomic_write_text(name + "\n", root / "latest")
    call(None, "save_checkpoint", grid.world_comm.Barrier)
    return target


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
                              f"({type(exc).__name__}: {exc})") from None
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


def load_checkpoint(directory: str | os.PathLike, model: Any, optimizer: torch.optim.Optimizer | None = None
                    ) -> dict:
    """Restores ``model`` (and ``optimizer``) from a checkpoint saved on any grid.

    Args:
        directory: a checkpoint directory's parent (its ``latest`` is used) or one checkpoint.

    Returns:
        ``{"step": int, "extra": dict}`` of the checkpoint.

    Raises:
        CheckpointError: missing, incomplete, truncated or foreign files; parameters missing or of
            another shape (names and shapes given).
    """
    grid = runtime._require("load_checkpoint").grid
    error, result = "", None
    try:
        checkpoint = _resolve(directory)
        manifest, payloads = _load_all(checkpoint)
        tensors: dict[str, torch.Tensor] = {}
        optimizer_state: dict[str, Any] = {}
        groups: list[dict] = []
        for payload in payloads:
            tensors.update(payload["model"])
            optimizer_state.update(payload["optimizer"]["state"])
            groups = groups or payload["optimizer"]["param_groups"]
        own = model.state_dict()
        missing = [key for key in own if key not in tensors]
        if missing:
            raise CheckpointError(f"{checkpoint} lacks {len(missing)} entries this model needs "
                                  f"(e.g. {missing[:3]}); was it saved from the same model?")
        wrong = [f"{key}: {tuple(tensors[key].shape)} saved, {tuple(own[key].shape)} here" for key in own
                 if tuple(tensors[key].shape) != tuple(own[key].shape)]
        if wrong:
            raise CheckpointError(f"{checkpoint}: shapes differ ({'; '.join(wrong[:3])})")
        model.load_state_dict({key: tensors[key] for key in own}, strict=True)
        if optimizer is not None:
            names = {id(p): name for name, p in model.named_parameters()}
            current = optimizer.state_dict()
            position, state = 0, {}
            for index, group in enumerate(optimizer.param_groups):
                for parameter in group["params"]:
                    name = names.get(id(parameter))
                    if name in optimizer_state:
                        state[position] = optimizer_state[name]
                    position += 1
                if index < len(groups):  # hyper-parameters (lr after a scheduler, betas, ...)
                    current["param_groups"][index].update(
                        {k: v for k, v in groups[index].items() if k not in ("param_names", "params")})
            current["state"] = state
            optimizer.load_state_dict(current)
        result = {"step": int(manifest["step"]), "extra": payloads[0].get("extra", {})}
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    errors = sorted({e for e in call(None, "load_checkpoint", lambda: grid.world_comm.allgather(error)) if e})
    if errors:
        raise CheckpointError("loading the checkpoint failed: " + " | ".join(errors))
    return result


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

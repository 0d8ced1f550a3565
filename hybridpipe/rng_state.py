"""The random generators a training step draws from, captured and restored as one value per rank.

Four generators: torch's CPU generator (dropout on CPU, ``torch.rand*``), the current CUDA
device's generator (dropout on the GPU; only once CUDA is in use), Python's ``random`` and numpy's
global ``np.random``. A state holds only tensors, ints, floats, strings and None, so a checkpoint
file that carries it still loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

__all__ = ["capture", "restore", "reseed", "derive_seed"]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional: its generator is then neither saved nor restored
        return None
    return numpy


def capture() -> dict[str, Any]:
    """This process's generator states: ``{"torch", "python", "numpy", "cuda"}`` (absent ones None)."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": None,
        "cuda": None,
    }
    numpy = _numpy()
    if numpy is not None:
        algorithm, keys, position, has_gauss, cached_gaussian = numpy.random.get_state(legacy=True)
        state["numpy"] = {"algorithm": str(algorithm), "keys": torch.from_numpy(keys.astype(numpy.int64)),
                          "position": int(position), "has_gauss": int(has_gauss),
                          "cached_gaussian": float(cached_gaussian)}
    # only once CUDA is in use: asking earlier would create a CUDA context in a CPU-only job
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = {"device": torch.cuda.current_device(), "state": torch.cuda.get_rng_state()}
    return state


def restore(state: dict[str, Any]) -> list[str]:
    """Sets the generators to ``state`` (from :func:`capture`); returns the names of those set.

    A generator missing from ``state`` or from this process (no numpy, no CUDA) is left alone.
    """
    restored = []
    if state.get("torch") is not None:
        torch.set_rng_state(state["torch"])
        restored.append("torch")
    python = state.get("python")
    if python is not None:
        random.setstate((python["version"], tuple(python["internal"].tolist()), python["gauss_next"]))
        restored.append("python")
    numpy = _numpy()
    saved = state.get("numpy")
    if numpy is not None and saved is not None:
        keys = saved["keys"].numpy().astype(numpy.uint32)
        numpy.random.set_state((saved["algorithm"], keys, saved["position"], saved["has_gauss"],
                                saved["cached_gaussian"]))
        restored.append("numpy")
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda["state"], torch.cuda.current_device())
        restored.append("cuda")
    return restored


def reseed(seed: int) -> None:
    """Seeds every generator from one integer (numpy takes it modulo 2**32)."""
    torch.manual_seed(seed)  # CPU and every CUDA device
    random.seed(seed)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def derive_seed(state: dict[str, Any], *coordinates: int) -> int:
    """A 63-bit seed from a saved state and integers (e.g. a grid position): the same inputs always
    give the same seed, different coordinates give unrelated seeds."""
    digest = hashlib.sha256(state["torch"].numpy().tobytes())
    digest.update(repr(tuple(int(c) for c in coordinates)).encode())
    return int.from_bytes(digest.digest()[:8], "little") & (2**63 - 1)

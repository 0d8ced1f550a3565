"""What a non-editable install (``pip install .``, as on a cluster) ships: every package under hybridpipe/."""

from __future__ import annotations

from pathlib import Path

import pytest
import setuptools

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_under_hybridpipe_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert isinstance(config.get("packages"), dict), "find packages ([tool.setuptools.packages.find]), do not list " \
        "them by hand (a new one gets forgotten)"
    found = set(setuptools.find_packages(str(ROOT), **config["packages"]["find"]))
    on_disk = {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "hybridpipe").rglob("__init__.py")}
    assert on_disk <= found, f"packages a `pip install .` would leave out: {sorted(on_disk - found)}"
    assert {"hybridpipe.plan", "hybridpipe.pipeline", "hybridpipe.comm"} <= found

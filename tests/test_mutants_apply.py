"""Every planted bug of tests/mutants.py still applies: its text occurs exactly once in the file it names (a
refactor that moves the code must move the mutant with it, or ``make mutants`` would silently skip a check)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import mutants  # noqa: E402


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_finds_its_code_once(mutant):
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.name}: its text occurs {text.count(mutant.old)} times in {mutant.path}"
    assert mutant.new != mutant.old
    for test_file, _ in mutant.files:
        assert (ROOT / test_file).is_file(), f"{mutant.name}: {test_file} does not exist"

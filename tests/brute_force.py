"""Brute-force enumerations the tests check optimizers and generators against (written apart from the library's own,
so that a test does not check the code with itself)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of ``parts`` positive ints summing to ``total`` (a contiguous cut of ``total`` layers into
    ``parts`` stages, or of ``total`` ranks into ``parts`` replica counts)."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))

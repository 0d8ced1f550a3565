"""docs/compatibility.md is what the table in hybridpipe/testing/compatibility.py generates, and the table's
covering arrays cover what they promise (every pair / triple of allowed values, no refused case among the
training ones, every refused pair once)."""

from __future__ import annotations

import itertools

from hybridpipe.testing import compatibility as compat


def test_docs_compatibility_page_is_generated_from_the_table():
    expected = compat.markdown(compat.covering_cases(2)) + "\n"
    assert compat.DOC.read_text() == expected, (
        "docs/compatibility.md is stale: run `python -m hybridpipe.testing.compatibility --write`")


def test_pairwise_cases_cover_every_allowed_pair_and_every_refusal():
    cases = compat.covering_cases(2)
    training = [c for c in cases if compat.refusal_for(c) is None]
    refused = [c for c in cases if compat.refusal_for(c) is not None]
    for a, b in itertools.combinations(compat.OPTIONS, 2):
        for va, vb in itertools.product(compat.OPTIONS[a], compat.OPTIONS[b]):
            if any(compat.refusal_for({**c, a: va, b: vb}) is None for c in training):  # some completion trains
                assert any(c[a] == va and c[b] == vb for c in training), f"{a}={va} with {b}={vb} never trains"
    for refusal in compat.REFUSALS:  # each refusal is exercised, on a case that is otherwise plain
        assert any(compat.refusal_for(c) is refusal for c in refused), refusal.why
    assert len(training) <= 30, f"{len(training)} training cases: make test's budget is about 30"
    assert compat.covering_cases(2) == cases  # deterministic


def test_a_refusal_names_a_pair_the_docs_list():
    text = compat.DOC.read_text()
    for number, refusal in enumerate(compat.REFUSALS, 1):
        assert f"### Refusal {number}" in text and refusal.why in text

"""The documentation site builds with warnings as errors, by the same command as `make docs`, and
the pages name only functions hybridpipe really has.

This is how `make test` proves the docs: a broken cross-reference, a page missing from the table
of contents, a docstring that is not valid reStructuredText or an API entry that no longer
imports fails the build, and so this test.
"""

from __future__ import annotations

import enum
import os
import re
import subprocess
import sys
from pathlib import Path

import hybridpipe

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# `make docs` runs `$(PY) -m sphinx` + these arguments + build/docs.
BUILD_ARGS = ["-j", "2", "-W", "--keep-going", "-b", "html", "docs"]


def test_makefile_builds_docs_with_the_same_command():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^docs:.*\n\t(.+)$", makefile, re.MULTILINE)
    assert recipe, "the Makefile has no `docs` target"
    assert recipe.group(1).split() == ["$(PY)", "-m", "sphinx", *BUILD_ARGS, "build/docs"]


def test_docs_build_without_warnings(tmp_path):
    out = tmp_path / "html"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "sphinx", *BUILD_ARGS, str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (f"the docs build failed (exit {result.returncode}); its warnings:\n"
                                    f"{result.stderr[-10000:]}\n{result.stdout[-3000:]}")
    pages = {path.stem for path in DOCS.glob("*.md")}
    built = {path.stem for path in out.glob("*.html")}
    assert pages <= built, f"pages not built: {sorted(pages - built)}"
    api = (out / "api.html").read_text()
    for name in ("hybridpipe.init", "hybridpipe.Grid", "hybridpipe.allreduce", "hybridpipe.allreduce_async_",
                 "hybridpipe.PipelineModel", "hybridpipe.LayerSpec", "hybridpipe.DistributedOptimizer",
                 "hybridpipe.broadcast_parameters", "hybridpipe.save_checkpoint", "hybridpipe.load_checkpoint",
                 "hybridpipe.launch.mpirun_command", "hybridpipe.pipeline.schedule.one_f_one_b",
                 "hybridpipe.pipeline.partition.partition_by_weights", "hybridpipe.pipeline.microbatch.split",
                 "hybridpipe.checkpoint.latest_checkpoint"):
        assert f'id="{name}"' in api, f"{name} is missing from the API reference"


def _resolve(dotted: str) -> bool:
    value = hybridpipe
    for part in dotted.split("."):
        if isinstance(value, type) and issubclass(value, enum.Enum) and part in value.__members__:
            value = value[part]
        elif hasattr(value, part):
            value = getattr(value, part)
        else:
            return False
    return True


def test_hp_names_in_the_new_pages_exist():
    """Every `hp.something` in the pages written for the site (the Horovod table above all) is real."""
    missing = []
    for page in ("index.md", "horovod.md", "sharp_bits.md"):
        text = (DOCS / page).read_text()
        for dotted in sorted(set(re.findall(r"\bhp\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)", text))):
            if not _resolve(dotted):
                missing.append(f"{page}: hp.{dotted}")
    assert not missing, f"names that hybridpipe does not have: {missing}"


#: How the docs must not read: a lab notebook (who did the work, when, in which round of it). A table says
#: when it was measured ("Measured on DATE"); the history is in git.
#: Dated runs live in bench/results/ (one file per run, with the machine); a page names the file, not the day.
NOTEBOOK_WORDS = re.compile(r"\bissue \d+|\bthis session|\btonight|\bfindings for|\blast session|\bhelper \d+"
                            r"|\bthis VM\b|\bsame day\b|(?<!bench/results/)(?<![\w-])20\d\d-[01]\d-[0-3]\d\b",
                            re.IGNORECASE)


def test_docs_read_as_a_manual_not_a_notebook():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    found = [f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r}"
             for page in pages for number, line in enumerate(page.read_text().splitlines(), 1)
             for match in [NOTEBOOK_WORDS.search(line)] if match]
    assert not found, "words about how or when the work was done (keep results, the command and the machine):\n" \
        + "\n".join(found)


def test_readme_and_benchmark_pages_fit_in_150_lines():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*benchmarks.md"))]
    assert len(pages) >= 4, pages
    long = {str(page.relative_to(ROOT)): n for page in pages if (n := len(page.read_text().splitlines())) > 150}
    assert not long, f"pages over 150 lines (current numbers only, one table per machine; git keeps the rest): {long}"


def test_every_results_file_the_docs_name_exists_and_holds_its_run():
    import json

    named = {match.group(1) for page in [ROOT / "README.md", *DOCS.glob("*.md")]
             for match in re.finditer(r"bench/results/([\w.-]+\.json)", page.read_text())}
    assert named, "no page names a bench/results/ file"
    for name in sorted(named):
        path = ROOT / "bench" / "results" / name
        assert path.is_file(), f"docs name bench/results/{name}, which does not exist"
        run = json.loads(path.read_text())
        assert run["bench"] and run["machine"] and run["tables"] and run["tables"][0]["rows"], name
        assert all(len(row) == len(table["header"]) for table in run["tables"] for row in table["rows"]), name


def test_notebook_words_catch_a_dated_run():
    assert NOTEBOOK_WORDS.search("**Measured on 2026-11-23** on the reference machine")
    assert not NOTEBOOK_WORDS.search("**Current figures** (`bench/results/allreduce-2026-11-23.json`)")


def test_code_cites_no_issue_numbers():
    """Comments and docstrings say why, not which ticket: an issue number means nothing to a reader of a clone."""
    cited = re.compile("issue" + r" #?\d+", re.IGNORECASE)
    found = [f"{path.relative_to(ROOT)}:{number}" for folder in ("hybridpipe", "tests", "bench", "examples")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if cited.search(line)]
    assert not found, f"issue numbers cited in code: {found}"

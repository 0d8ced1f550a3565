"""Sphinx configuration of the hybridpipe documentation site.

Build (warnings are errors, as `make docs` and tests/test_docs.py do):

    sphinx-build -W --keep-going -b html docs build/docs

The pages are Markdown read by MyST; the API reference (api.md) is autodoc over the docstrings.
Importing hybridpipe neither initialises MPI nor loads the compiled extension hybridpipe._C (both
happen in hp.init()), so autodoc needs torch, numpy and the package sources only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# The sources of this checkout, whether or not `pip install -e .` has run.
sys.path.insert(0, str(ROOT))
# Autodoc imports torch; keep it from spreading threads over a shared machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import hybridpipe  # noqa: E402

project = "hybridpipe"
author = "the hybridpipe authors"
copyright = "the hybridpipe authors"
release = version = hybridpipe.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# Build outputs and editor files under docs/ are not pages.
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: plain CommonMark + tables, no syntax extensions (a `$` in prose stays a dollar sign), and an
# anchor for every heading down to level 3 so that pages can link to `page.md#section`.
myst_enable_extensions: list[str] = []
myst_heading_anchors = 3

# Docstrings are Google style (Args:/Returns:/Raises:/Attributes:). Attributes become :ivar: fields
# so that a dataclass documented with :members: does not describe each field twice.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_default_options = {"show-inheritance": True}
# torch's and mpi4py's own types are not documented here: a missing cross-reference to them is not
# an error (nitpicky stays off).

html_theme = "alabaster"
html_title = f"hybridpipe {release}"
html_static_path: list[str] = []
html_theme_options = {
    "description": "Data + pipeline parallel training for PyTorch over MPI",
    "fixed_sidebar": True,
    "page_width": "1180px",
    "body_max_width": "none",
}
html_show_sourcelink = False

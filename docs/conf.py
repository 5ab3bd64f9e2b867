"""Sphinx configuration of bridgeflow's documentation: ``sphinx-build -W --keep-going docs docs/_build``."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # apigen, the API pages' generator, and its table api_pages

import bridgeflow

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # autodoc imports the TensorFlow adapter

project = "bridgeflow"
author = "the bridgeflow authors"
copyright = "the bridgeflow authors; Apache-2.0"
release = version = bridgeflow.__version__

extensions = [
    "myst_parser",  # the pages are Markdown
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # the docstrings' "Args:" / "Example:" sections
    "sphinx.ext.viewcode",
    "apigen",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
suppress_warnings = ["toc.empty_glob"]  # the architecture page lists its children by glob

myst_heading_anchors = 3  # [text](page.md#a-heading) links
myst_enable_extensions = ["colon_fence"]

autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False
autosummary_generate = False  # apigen writes the pages
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"bridgeflow {release}"
html_static_path = ["_static"]
html_css_files = ["bridgeflow.css"]  # code that wraps instead of hiding past the edge

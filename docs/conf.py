"""Sphinx configuration of aioshmq's documentation (built in CI with warnings as errors)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# Built from a checkout that may have no compiled core: the pure one, and no warning.
os.environ["AIOSHMQ_PURE"] = "1"

import aioshmq

project = "aioshmq"
release = version = aioshmq.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.intersphinx"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False}
html_theme = "furo"
html_title = f"aioshmq {release}"
intersphinx_mapping: dict[str, tuple[str, None]] = {}

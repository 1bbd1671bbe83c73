"""Sphinx configuration of aioshmq's documentation (built in CI with warnings as errors)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from sphinx.util import logging

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

_log = logging.getLogger("aioshmq.docs")
# Classes users get from aioshmq and never construct (create() makes a Writer, and so on):
# their constructors take internal objects, so the page shows none.
MADE_FOR_YOU = [
    "aioshmq.Writer",
    "aioshmq.Reader",
    "aioshmq.Lease",
    "aioshmq.Reservation",
    "aioshmq.rpc.Call",
]
# A private name: one part of a name that starts with a single underscore ("_spin.Spin",
# "aioshmq._errors._Busy"); dunders ("__aexit__") are Python's own.
PRIVATE = re.compile(r"(?<!\w)_(?!_)\w+")


def _private(text: str | None) -> list[str]:
    return PRIVATE.findall(text or "")


def _signature(
    app: Any,
    what: str,
    name: str,
    obj: object,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str, str | None] | None:
    """Hide the constructors of MADE_FOR_YOU; a private name in any other signature fails
    the build (a warning, which -W makes an error)."""
    if what in ("class", "exception") and name in MADE_FOR_YOU:
        return "", None
    if found := _private(signature) + _private(return_annotation):
        _log.warning("the signature of %s names %s, which users cannot see", name, found)
    return None


def _docstring(app: Any, what: str, name: str, obj: object, options: Any, lines: list[str]) -> None:
    """A private name in a docstring fails the build too."""
    if found := _private("\n".join(lines)):
        _log.warning("the docstring of %s names %s, which users cannot see", name, found)


def setup(app: Any) -> None:
    app.connect("autodoc-process-signature", _signature)
    app.connect("autodoc-process-docstring", _docstring)

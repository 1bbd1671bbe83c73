"""Which aioshmq the bench measures, chosen before anything of the harness imports it.

The harness runs from a checkout (``python -m benchmarks``), so the checkout's own ``aioshmq/``
folder is first on ``sys.path`` and would shadow the installed package, built or not.  The
bench measures instead:

- the tree named by ``AIOSHMQ_BENCH_TREE`` (a checkout of the repository whose C extension is
  built in place), first on ``sys.path``: how ``compare`` runs each of its two trees;
- else the installed aioshmq (an editable install included), found with neither the current
  directory, nor the checkout, nor a folder named ``aioshmq`` that is no package (a clone of
  the repository seen from its parent) on the path; the checkout's own only where none is
  installed.

Spawned children import the harness before anything of aioshmq, so they choose the same.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from types import ModuleType
from typing import Any

TREE_ENV = "AIOSHMQ_BENCH_TREE"
CHECKOUT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  #: the harness's


def import_aioshmq() -> ModuleType:
    """aioshmq, from the tree named by AIOSHMQ_BENCH_TREE or else the installed one."""
    module = sys.modules.get("aioshmq")
    if module is not None:
        return module
    tree = os.environ.get(TREE_ENV)
    if tree:
        return _from_tree(os.path.abspath(tree))
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if not _shadows(entry)]
    try:
        return importlib.import_module("aioshmq")
    except ModuleNotFoundError as exc:
        if exc.name != "aioshmq":
            raise
    finally:
        sys.path[:] = saved
    return importlib.import_module("aioshmq")  # none installed: the checkout's own


def _shadows(entry: str) -> bool:
    """Whether ``import aioshmq`` could find something in ``entry`` that is not the installed
    package: the checkout the harness runs from, the current directory (``python -m`` puts
    it first), or a folder named aioshmq without ``__init__.py`` (a namespace package)."""
    where = os.path.realpath(entry or os.curdir)
    if where in (CHECKOUT, os.path.realpath(os.curdir)):
        return True
    folder = os.path.join(where, "aioshmq")
    return os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "__init__.py"))


def _from_tree(tree: str) -> ModuleType:
    if not os.path.isfile(os.path.join(tree, "aioshmq", "__init__.py")):
        raise ImportError(f"{TREE_ENV}={tree}: no aioshmq/__init__.py there")
    if sys.path[:1] != [tree]:
        sys.path.insert(0, tree)
    module = importlib.import_module("aioshmq")
    where = os.path.abspath(module.__file__ or "")
    if os.path.dirname(where) != os.path.join(tree, "aioshmq"):
        raise ImportError(f"{TREE_ENV}={tree}, but aioshmq was imported from {where}")
    return module


def _git(tree: str, *args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", tree, *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def source() -> dict[str, Any]:
    """Where the imported aioshmq comes from: its file, its core, and the commit of the git
    checkout it lives in (None outside one; ``dirty`` if tracked files differ from it)."""
    aioshmq = import_aioshmq()
    where = os.path.abspath(aioshmq.__file__ or "")
    tree = os.path.dirname(os.path.dirname(where))
    top = _git(tree, "rev-parse", "--show-toplevel")
    commit = dirty = None
    if top is not None and os.path.realpath(top) == os.path.realpath(tree):
        commit = _git(tree, "rev-parse", "--short=7", "HEAD")
        status = _git(tree, "status", "--porcelain", "--untracked-files=no")
        dirty = None if status is None else bool(status)
    return {
        "file": where,
        "tree": tree,
        "version": aioshmq.__version__,
        "core": aioshmq.CORE,
        "pure_forced": os.environ.get("AIOSHMQ_PURE", "") not in ("", "0"),
        "commit": commit,
        "dirty": dirty,
    }

"""The benchmark, ``python -m benchmarks`` from a clone: aioshmq against its peers.

Private: nothing here is part of the library's API.  The scenarios and the tools use the
public ``aioshmq`` API only, the way an application would.  Which aioshmq they measure is
decided here, before anything imports it (``_which``): the tree named by
``AIOSHMQ_BENCH_TREE``, else the installed one.
"""

from __future__ import annotations

from typing import Any

from ._which import import_aioshmq

import_aioshmq()

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # the whole harness, imported only when asked for
        from .run import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

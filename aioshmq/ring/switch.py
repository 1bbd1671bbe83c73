"""The one switch between the compiled ring core and its pure-Python reference.

The compiled core (``compiled.c``, built by ``pip install``) runs unless the environment
variable ``AIOSHMQ_PURE`` is set to anything but ``0`` or empty, or it was not built (no C
compiler at install time); then the pure core runs, and a missing build says so once, as
a RuntimeWarning at import.  Both read and write the same bytes: ends of either kind
share a ring.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from types import ModuleType

PURE_ENV = "AIOSHMQ_PURE"


def _choose() -> tuple[ModuleType | None, str]:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None, f"pure ({PURE_ENV} is set)"
    try:
        from . import compiled
    except ImportError as exc:
        built = importlib.util.find_spec(f"{__package__}.compiled") is not None
        why = f"failed to load ({exc})" if built else "is not built"
        warnings.warn(
            f"aioshmq's compiled core {why}: the pure-Python core runs, slower (benchmarks.md "
            "has the figures). Reinstall with a C compiler and the "
            f"Python headers to build it, or set {PURE_ENV}=1 to choose the pure core "
            "and silence this warning",
            RuntimeWarning,
            stacklevel=2,
        )
        return None, f"pure (the compiled core {why})"
    return compiled, "compiled"


_compiled, CORE = _choose()
COMPILED = _compiled is not None

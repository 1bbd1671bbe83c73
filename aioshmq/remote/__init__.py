"""Readers on other hosts: the writer's server, remote readers and mirrors, over ZeroMQ."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._mirror import Mirror, mirror

__all__ = ["Mirror", "mirror"]


def load(module: str) -> Any:
    """A module of this package, with a clear error where pyzmq is not installed."""
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as exc:
        if exc.name != "zmq":
            raise
        raise ModuleNotFoundError(
            "aioshmq's remote path needs pyzmq: pip install 'aioshmq[remote]'", name="zmq"
        ) from None


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(load("_mirror"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

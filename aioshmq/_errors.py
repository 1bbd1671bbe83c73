"""The exceptions aioshmq raises beyond anyio's own."""

from __future__ import annotations

import anyio

__all__ = ["CorruptedError", "Empty", "Full", "PeerDied"]


class Full(anyio.WouldBlock):
    """The ring has no room for the message now (for the slowest attached reader)."""


class Empty(anyio.WouldBlock):
    """No complete message is waiting for this reader now."""


class PeerDied(anyio.BrokenResourceError):
    """The process at the other end exited without closing its end."""

    def __init__(self, message: str, *, role: str, pid: int, index: int | None = None) -> None:
        super().__init__(message)
        self.role = role
        self.pid = pid
        self.index = index


class CorruptedError(RuntimeError):
    """The shared memory holds something no writer of this version could have written."""

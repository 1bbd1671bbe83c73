"""What both ends share: lifecycle, ownership by one process, fork safety, waiting on an fd."""

from __future__ import annotations

import os
import select
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

YIELD_INTERVAL = 0.001  # an end that never has to wait still yields to the loop this often

_live: weakref.WeakSet[End] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for end in list(_live):
        end._abandon()


os.register_at_fork(after_in_child=_after_fork_in_child)


class End:
    """Lifecycle shared by the writer and the readers.

    An end belongs to the process that made it.  A forked child gets a copy it cannot use:
    the copy's fds are closed in the child at once, so they never keep a dead peer looking
    alive, and nothing shared is touched.
    """

    _role = "end"

    def __init__(self) -> None:
        self._closed = False
        self._pid = os.getpid()
        self._lock = anyio.Lock(fast_acquire=True)
        self._waiting = 0
        self._next_yield = 0.0
        self._wait_fd = -1
        _live.add(self)

    # -- lifecycle -------------------------------------------------------------------------

    def _check(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError(f"this aioshmq {self._role} is closed")

    def _release(self, *, clean: bool) -> None:
        """Give every resource back; ``clean`` is False in a forked child."""
        raise NotImplementedError

    def _abandon(self) -> None:
        if not self._closed:
            self._closed = True
            self._release(clean=False)

    def close(self) -> None:
        """Close this end now (sync); tasks waiting on it get ClosedResourceError."""
        if self._closed:
            return
        self._closed = True
        if self._waiting and self._wait_fd >= 0:
            try:
                anyio.notify_closing(self._wait_fd)
            except Exception:  # no event loop in this thread: nobody can be waiting in one
                pass
        self._release(clean=os.getpid() == self._pid)

    async def aclose(self) -> None:
        self.close()
        await checkpoint()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        if getattr(self, "_closed", True):
            return
        if os.getpid() == self._pid:
            _warn(f"unclosed {self!r}", ResourceWarning, source=self)
        try:
            self.close()
        except Exception:
            pass

    # -- waiting ---------------------------------------------------------------------------

    async def _pace(self) -> None:
        """A checkpoint at most every YIELD_INTERVAL, so a never-waiting loop stays fair."""
        now = time.monotonic()
        if now >= self._next_yield:
            await checkpoint()  # outside an event loop this raises anyio's NoEventLoopError
            self._next_yield = now + YIELD_INTERVAL

    async def _sleep(self) -> None:
        self._waiting += 1
        try:
            await anyio.wait_readable(self._wait_fd)
        finally:
            self._waiting -= 1

    def _sleep_sync(self, deadline: float | None) -> None:
        """Block until the wait fd is readable or the deadline passes (TimeoutError)."""
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise TimeoutError(f"aioshmq {self._role}: timed out")
        poller = select.poll()
        poller.register(self._wait_fd, select.POLLIN)
        self._waiting += 1
        try:
            # Milliseconds rounded up: an empty result means the deadline has passed.
            if not poller.poll(None if timeout is None else int(timeout * 1000) + 1):
                raise TimeoutError(f"aioshmq {self._role}: timed out")
        finally:
            self._waiting -= 1


def deadline_of(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, not {timeout!r}")
    return time.monotonic() + timeout

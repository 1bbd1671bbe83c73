"""What both ends share: lifecycle, ownership by one process, fork safety, waiting on an fd."""

from __future__ import annotations

import asyncio
import os
import select
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

from ._notify import Notifier

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
    _wake: Notifier  #: the notifier whose signals end this end's sleeps

    def __init__(self) -> None:
        self._closed = False
        self._pid = os.getpid()
        self._lock = anyio.Lock(fast_acquire=True)
        self._waiting = 0
        self._next_yield = 0.0
        self._wait_fd = -1
        # On asyncio the wait fd stays registered with the loop between sleeps (see _sleep).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
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
            self._loop = self._waiter = None  # the parent's loop: not this process's to touch
            self._release(clean=False)

    def close(self) -> None:
        """Close this end now (sync); tasks waiting on it get ClosedResourceError."""
        if self._closed:
            return
        self._closed = True
        waiter, self._waiter = self._waiter, None
        self._unregister()
        if waiter is not None and not waiter.done():
            waiter.set_exception(anyio.ClosedResourceError(f"this aioshmq {self._role} was closed"))
        elif self._waiting and self._wait_fd >= 0:
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

    def _drain(self) -> None:
        """Clear wake-ups left from earlier sleeps before announcing a new one.

        Not needed while the fd is registered with an asyncio loop: its callback drains
        every wake-up as it comes, and a stale one only costs a spurious wake.
        """
        if self._loop is None:
            self._wake.drain()

    async def _sleep(self) -> None:
        self._waiting += 1
        try:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is None or asyncio.current_task(loop) is None:  # trio, or a trio guest
                await anyio.wait_readable(self._wait_fd)
                return
            # Registered once, not per sleep: add_reader and remove_reader are two syscalls,
            # each a large share of a wake-up's cost.
            if self._loop is not loop:
                # Never drained here: the sleep is announced, and its wake-up may be pending.
                self._unregister()
                loop.add_reader(self._wait_fd, self._on_readable)
                self._loop = loop
            self._waiter = waiter = loop.create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        finally:
            self._waiting -= 1

    def _on_readable(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            # Nobody waits: unregister rather than let a readable fd spin the loop, and
            # leave the wake-up for whoever waits next (a blocking call, say).
            self._unregister()
            return
        self._wake.drain()
        waiter.set_result(None)

    def _unregister(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self._wait_fd)
            except Exception:  # closed from a thread the loop does not run in, or at exit
                pass

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

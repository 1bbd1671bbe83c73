"""What both ends share: lifecycle, ownership by one process, fork safety, waiting on an fd."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import select
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import NoReturn, Self

import anyio
from anyio.lowlevel import checkpoint

from ..memory.notify import Notifier
from .cancel import Checkpoint, pending_checkpoint
from .cancel import current_task as _current_task
from .tasklock import TaskLock

YIELD_INTERVAL = 0.001  # an end that never has to wait still yields to the loop this often
CLOSE_WAIT = 5.0  # s: how long close() waits for calls blocked in other threads to leave
LOOP_LOOK = 0.01  # s: how often that wait looks whether the loop it waits for has closed

_live: weakref.WeakSet[End] = weakref.WeakSet()
_watchers: list[Callable[[End], None]] = []
_tokens = itertools.count()
_get_ident = threading.get_ident
_monotonic = time.monotonic


def _after_fork_in_child() -> None:
    for end in list(_live):
        end._abandon()


os.register_at_fork(after_in_child=_after_fork_in_child)


def open_ends() -> list[End]:
    """Every end of this process that is open now (what a leak check looks at)."""
    return [end for end in list(_live) if not end._closed]


def watch_opened(watcher: Callable[[End], None]) -> Callable[[], None]:
    """Call ``watcher(end)`` with every end this process opens from now on, until the
    function returned is called: how a leak check knows, by identity, the ends a test
    opened."""
    _watchers.append(watcher)
    return functools.partial(_watchers.remove, watcher)


def _in_event_loop(
    _running: Callable[[], object] = asyncio.events._get_running_loop,
    _modules: dict[str, ModuleType] = sys.modules,
) -> bool:
    """Whether this thread is running an asyncio or trio event loop right now."""
    if _running() is not None:
        return True
    trio = _modules.get("trio")
    return trio is not None and bool(trio.lowlevel.in_trio_run())


in_event_loop = _in_event_loop


def call_soon(
    fn: Callable[[], None],
    _running: Callable[[], asyncio.AbstractEventLoop | None] = asyncio.events._get_running_loop,
    _modules: dict[str, ModuleType] = sys.modules,
) -> bool:
    """Have the event loop running in this thread call ``fn`` once the current task next
    yields to it (asyncio's ``call_soon``, trio's ``run_sync_soon``); False if this thread
    runs no event loop."""
    loop = _running()
    if loop is not None:
        loop.call_soon(fn)
        return True
    trio = _modules.get("trio")
    if trio is not None and trio.lowlevel.in_trio_run():
        trio.lowlevel.current_trio_token().run_sync_soon(fn)
        return True
    return False


class End:
    """Lifecycle shared by the writer and the readers.

    An end belongs to the process that made it.  A forked child gets a copy it cannot use:
    the copy's fds are closed in the child at once, so they never keep a dead peer looking
    alive, and nothing shared is touched.

    ``close()`` may come from any thread.  Every call that sleeps holds the end while it
    touches the ring and its fds (or, for a task whose loop has the wait fd registered, is
    covered by the release waiting for that loop); closing wakes the holders (through the
    end's own wake-up fd), and the fds and the mapping are released only once the last of
    them has left, so no call ever waits on, or reads from, something closed or reused.
    """

    # What every put and get reads, kept in slots (a little quicker to read than the
    # instance dict, which holds the rest).
    __slots__ = ("__dict__", "__weakref__", "_closed", "_core", "_lock", "_next_yield", "_ring")

    _role = "end"
    _wake: Notifier  #: the notifier whose signals end this end's sleeps

    def __init__(self) -> None:
        self._closed = False
        self._released = False
        self._clean = True
        self._pid = os.getpid()
        self._forked = False
        self._lock = TaskLock()
        self._waiting = 0
        self._next_yield = 0.0
        self._wait_fd = -1
        # On asyncio the wait fd stays registered with the loop between sleeps (see _sleep).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._waiter: asyncio.Future[None] | None = None
        self._mutex = threading.Lock()
        self._holds: dict[int, tuple[int, bool]] = {}  # token -> (thread, is async)
        self._blockers: set[int] = set()  # holds that must leave before the release
        self._loop_pending = False  # a foreign loop has yet to unregister the wait fd
        self._done = threading.Event()
        _live.add(self)
        for watcher in _watchers:
            watcher(self)

    # -- lifecycle -------------------------------------------------------------------------

    def _check(self) -> None:
        if self._closed:
            raise self._closed_error()

    def _release(self, *, clean: bool) -> None:
        """Give every resource back; ``clean`` is False in a forked child."""
        raise NotImplementedError

    def _interrupt(self) -> None:
        """Make the wait fd readable, so every sleeper of this end wakes and re-checks."""
        self._wake.signal()

    def _abandon(self) -> None:
        if not self._closed:
            self._closed = self._released = self._forked = True
            # The parent's loop, threads and locks: not this process's to touch.
            self._mutex = threading.Lock()
            self._loop = self._waiter = None
            self._holds.clear()
            self._release(clean=False)

    def close(self) -> None:
        """Close this end now (sync), from any thread; calls waiting on it get
        ClosedResourceError."""
        me = threading.get_ident()
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._clean = os.getpid() == self._pid
            waiter, self._waiter = self._waiter, None
            loop, loop_thread = self._loop, self._loop_thread
            here_async = any(t == me and is_async for t, is_async in self._holds.values())
            # Sleepers of this thread's own event loop are woken below and never touch the
            # end again; any other (a blocking call, another thread's loop) must leave first.
            self._blockers = {
                token for token, (t, is_async) in self._holds.items() if t != me or not is_async
            }
            foreign = (
                loop is not None
                and loop_thread != me
                and loop.is_running()
                and not loop.is_closed()
            )
            self._loop_pending = foreign
            blockers_here = any(self._holds[token][0] == me for token in self._blockers)
            if self._blockers or foreign:
                # Under the lock: a holder that leaves meanwhile cannot release (close) the
                # fd this writes to until the lock is let go.
                self._interrupt()
        if foreign:
            assert loop is not None
            try:
                loop.call_soon_threadsafe(self._unregister_in_loop, loop, waiter)
            except RuntimeError:  # closed meanwhile: nothing registered any more
                self._loop_done()
        else:
            self._unregister()
            if waiter is not None and not waiter.done():
                waiter.set_exception(self._closed_error())
            elif here_async and self._wait_fd >= 0 and not self._notify_closing():
                with self._mutex:  # no way to wake them now: wait for them to leave
                    self._blockers |= {t for t, (th, a) in self._holds.items() if th == me}
                    if not self._released:
                        self._interrupt()
        self._try_release()
        if not self._released and not blockers_here:
            self._wait_released(loop if foreign else None)

    def _wait_released(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Wait up to CLOSE_WAIT for the release.  Where ``loop`` (another thread's) was to
        run its part, look every LOOP_LOOK s whether it closed first: a closed loop never
        runs what was queued on it, nor anything of its tasks, so the release is done here."""
        if loop is None:
            self._done.wait(CLOSE_WAIT)
            return
        deadline = time.monotonic() + CLOSE_WAIT
        while not self._done.wait(LOOP_LOOK) and time.monotonic() < deadline:
            if loop.is_closed():
                self._loop_done()

    def _notify_closing(self) -> bool:
        try:
            anyio.notify_closing(self._wait_fd)
        except Exception:  # not called from async code: no event loop to notify
            return False
        return True

    def _closed_error(self) -> anyio.ClosedResourceError:
        """What any call of a closed end raises (one inherited through fork says so)."""
        if self._forked:
            return anyio.ClosedResourceError(
                f"this aioshmq {self._role} was inherited through fork from process "
                f"{self._pid} and cannot be used here: pass the ring's handle (or name) to "
                "the child and call aioshmq.connect() there"
            )
        return anyio.ClosedResourceError(f"this aioshmq {self._role} is closed")

    def _unregister_in_loop(
        self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[None] | None
    ) -> None:
        """Run in the loop's own thread: drop the registration a closing thread found."""
        if self._loop is loop:
            self._unregister()
        if waiter is not None and not waiter.done():
            waiter.set_exception(self._closed_error())
        self._loop_done()

    def _loop_done(self) -> None:
        with self._mutex:
            self._loop_pending = False
        self._try_release()

    def _try_release(self) -> None:
        with self._mutex:
            if self._released or self._blockers or self._loop_pending:
                return
            self._released = True
        try:
            self._release(clean=self._clean)
        finally:
            self._done.set()

    def _hold(self, is_async: bool) -> int:
        """Register a call that is about to sleep; ClosedResourceError if closed already."""
        with self._mutex:
            if self._closed:
                self._check()
            token = next(_tokens)
            self._holds[token] = (threading.get_ident(), is_async)
        return token

    def _unhold(self, token: int) -> None:
        with self._mutex:
            del self._holds[token]
            self._blockers.discard(token)
        if self._closed:
            self._try_release()

    async def aclose(self) -> None:
        self.close()
        await checkpoint()

    def __reduce__(self) -> NoReturn:
        """Never: an end belongs to the process that opened it, so it is not pickled (nor
        sent to a spawned process); the error says what to send instead."""
        raise TypeError(self._stays_here())

    def _stays_here(self) -> str:
        """Why this end cannot go to another process, and what to pass there instead."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        if getattr(self, "_closed", True):
            return
        if os.getpid() == self._pid:
            _warn(f"unclosed {self!r}", ResourceWarning, source=self)
        try:
            self._close_unwaited()
        except Exception:
            pass

    def _close_unwaited(self) -> None:
        """``close()`` from the garbage collector: never waits for anything."""
        self.close()

    # -- waiting ---------------------------------------------------------------------------

    async def _pause(self) -> None:
        """Await what ``_due`` says is due: the rare path of a call whose inline look at the
        common case (``pending_checkpoint()``, then the pace) found something."""
        if (due := self._due()) is not None:
            await due()
        self._check()

    def _due(self) -> Checkpoint | None:
        """What an async call must await before it takes or publishes anything, if anything:
        a checkpoint at most every YIELD_INTERVAL, so a loop that never has to wait stays
        fair to its other tasks, or the pending cancellation of a scope around the task."""
        if (pending := pending_checkpoint()) is not None:
            return pending
        now = _monotonic()
        if now >= self._next_yield:
            self._next_yield = now + YIELD_INTERVAL
            return checkpoint  # outside an event loop this raises anyio's NoEventLoopError
        return None

    def _drain(self) -> None:
        """Clear wake-ups left from earlier sleeps before announcing a new one.

        Not needed while the fd is registered with an asyncio loop: its callback drains
        every wake-up as it comes, and a stale one only costs a spurious wake.
        """
        if self._loop is None:
            self._wake.drain()

    def _armable(self) -> bool:
        """Whether the wait fd is registered with the loop running the current task."""
        loop = self._loop
        # A thread runs one loop at a time: asyncio's own lookup makes a getpid() call.
        return (
            loop is not None
            and self._loop_thread == _get_ident()
            and _current_task(loop) is not None
        )

    def _arm(self) -> asyncio.Future[None] | None:
        """A future the wait fd's next wake-up completes, if the fd is registered with the
        loop running the current task (the caller awaits it, counted in ``_waiting``);
        else None, and the caller registers it first."""
        if not self._armable():
            return None
        assert self._loop is not None
        self._waiter = waiter = self._loop.create_future()
        if self._closed:
            # Closed by another thread as this armed: that close may have looked for the
            # waiter before it was there, and may yet drop the registration that would
            # complete it.  Cancelled, so that a late close that found it leaves it be.
            waiter.cancel()
            if self._waiter is waiter:
                self._waiter = None
            self._check()
        return waiter

    async def _sleep(self) -> None:
        """Wait until the wait fd is readable (the caller holds the end: ``_hold``)."""
        self._waiting += 1
        try:
            waiter = self._arm()
            if waiter is None:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    loop = None
                if loop is None or asyncio.current_task(loop) is None:  # trio, a trio guest
                    await anyio.wait_readable(self._wait_fd)
                    return
                # Registered once, not per sleep: add_reader and remove_reader are two
                # syscalls, each a large share of a wake-up's cost.  Never drained here: the
                # sleep is announced, and its wake-up may be pending.
                self._unregister()
                loop.add_reader(self._wait_fd, self._on_readable)
                self._loop, self._loop_thread = loop, threading.get_ident()
                waiter = self._arm()
                assert waiter is not None  # registered just now, with this task's loop
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        finally:
            self._waiting -= 1

    async def _sleep_until(self, done: Callable[[], bool]) -> None:
        """Sleep on the wait fd until ``done()``: every wake-up (the broker's, a reader's,
        a close) makes it look again."""
        while True:
            self._drain()
            if done():
                return
            token = self._hold(True)
            try:
                await self._sleep()
            finally:
                self._unhold(token)
            self._check()

    def _sleep_until_sync(self, done: Callable[[], bool], deadline: float | None) -> None:
        """``_sleep_until`` for blocking calls; TimeoutError at ``deadline``."""
        while True:
            self._wake.drain()
            if done():
                return
            token = self._hold(False)
            try:
                self._sleep_sync(deadline)
            finally:
                self._unhold(token)
            self._check()

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
            except Exception:  # at exit, or the loop's selector is gone
                pass

    def _sleep_sync(self, deadline: float | None) -> None:
        """Block until the wait fd is readable or the deadline passes (TimeoutError).

        The caller holds the end (``_hold``); a close from another thread wakes this.
        """
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

    def _refuse_in_loop(self, call: str, instead: str) -> None:
        """A blocking call inside a running event loop would freeze it (or deadlock with
        the task that should let it go on): refuse it with the call to use instead."""
        if in_event_loop():
            raise RuntimeError(
                f"{call}() blocks, and this thread is running an event loop: "
                f"use 'await {instead}' here instead"
            )


def deadline_of(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, not {timeout!r}")
    return time.monotonic() + timeout

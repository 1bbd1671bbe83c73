"""The lock that lets one task at a time wait on an end: first come, first served, cheap."""

from __future__ import annotations

import collections

import anyio


class TaskLock:
    """A lock for the tasks of one event loop, first come first served.

    anyio's ``Lock`` looks up the current task (a ``getpid()`` on Python 3.11) and checks for
    cancellation on every acquire and release, which costs a waiting ``get`` about a twentieth
    of its wake-up.  The ends check for cancellation themselves before they lock, so this one
    only keeps order: taking it free is two attribute reads and a store, and a waiter that is
    cancelled leaves no trace, passing the lock on if it was handed over just then.
    """

    __slots__ = ("_waiters", "held")

    def __init__(self) -> None:
        self.held = False  #: what ``locked()`` says, read directly on the ends' hot paths
        self._waiters: collections.deque[anyio.Event] = collections.deque()

    def locked(self) -> bool:
        return self.held

    def acquire_nowait(self) -> None:
        """Take the lock if it is free; anyio's ``WouldBlock`` if not."""
        if self.held:
            raise anyio.WouldBlock
        self.held = True

    async def acquire(self) -> None:
        """Take the lock, waiting behind those already waiting (no checkpoint when free)."""
        if not self.held:
            self.held = True
            return
        turn = anyio.Event()
        self._waiters.append(turn)
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():  # handed over as the wait was cancelled: hand it on
                self.release()
            else:
                self._waiters.remove(turn)
            raise

    def release(self) -> None:
        """Hand the lock to the first waiter, or free it."""
        if self._waiters:
            self._waiters.popleft().set()  # still held: it is the waiter's now
        else:
            self.held = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

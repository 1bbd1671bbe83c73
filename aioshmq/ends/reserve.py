"""Writing in place: ring memory reserved, filled by the caller, then published or dropped."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..base.errors import busy
from ..ring.ring import Frame
from .cancel import pending_checkpoint
from .end import deadline_of

if TYPE_CHECKING:
    from .writer import Writer

V = TypeVar("V")


class Reservation(Generic[V]):
    """Room for one message in the ring, handed out as a writable view of the ring itself.

    ``async with writer.reserve(n) as view:`` waits for room like ``put`` (both bounds), and
    holds the writer (other puts wait) until the block ends: then the message is published
    to every reader, or, if the block raised or was cancelled, forgotten as if never begun.
    ``with`` does the same for code without an event loop (``timeout`` bounds the wait).
    The view must not be used after the block: its memory belongs to the ring again.
    """

    __slots__ = ("_frame", "_timeout", "_token", "_view", "_wrap", "_writer")

    def __init__(
        self,
        writer: Writer[Any],
        frame: Frame,
        wrap: Callable[[memoryview], V],
        timeout: float | None = None,
    ) -> None:
        self._writer = writer
        self._frame = frame
        self._wrap = wrap
        self._timeout = timeout
        self._token: int | None = None
        self._view: memoryview | None = None

    def _take(self) -> V:
        ring = self._writer._ring
        start = ring.written_at + self._frame.hole
        view = self._view = ring.data[start : start + self._frame.length - self._frame.hole]
        return self._wrap(view)

    def _finish(self, publish: bool) -> None:
        writer, frame = self._writer, self._frame
        ring = writer._ring
        try:
            if self._view is not None:
                try:
                    self._view.release()  # later writes through it fail, where nothing holds it
                except BufferError:
                    pass  # an array or tensor still wraps it: the caller's to drop
                self._view = None
            if writer._closed:  # closing dropped what was not published
                if publish:
                    raise writer._closed_error()
            elif publish:
                ring.publish()
                writer._messages += 1
                writer._bytes += frame.length
            else:
                ring.rollback(ring.head, ring.head_count)
        finally:
            token, self._token = self._token, None
            if token is not None:
                writer._unhold(token)

    # -- async ---------------------------------------------------------------------------

    async def __aenter__(self) -> V:
        writer = self._writer
        if self._token is not None:
            raise RuntimeError("this reservation is already open")
        writer._check()
        if (cancelled := pending_checkpoint()) is not None:
            await cancelled()
        await writer._lock.acquire()
        try:
            # Not an async hold: a close from anywhere leaves the mapping in place until
            # this block ends, since the caller writes into it without asking.
            self._token = writer._hold(False)
            ring = writer._ring
            since = time.monotonic()
            while not ring.try_write(self._frame):
                await writer._wait_room(since)
            return self._take()
        except BaseException:
            try:
                self._finish(False)
            finally:
                writer._lock.release()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._finish(exc_type is None)
        finally:
            self._writer._lock.release()

    # -- sync ----------------------------------------------------------------------------

    def __enter__(self) -> V:
        writer = self._writer
        if self._token is not None:
            raise RuntimeError("this reservation is already open")
        writer._check()
        writer._refuse_in_loop("reserve", "writer.reserve(...) with 'async with'")
        if writer._lock.locked():
            raise busy("an async put or wait_readers is under way on this writer")
        deadline = deadline_of(self._timeout)
        self._token = writer._hold(False)
        try:
            ring = writer._ring
            since = time.monotonic()
            while not ring.try_write(self._frame):
                writer._wait_room_sync(deadline, since)
            # Until the block ends, any other put stops at its first check (busy).
            writer._reserving = writer._halt = True
            return self._take()
        except BaseException:
            try:
                self._finish(False)
            finally:
                writer._resume()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._finish(exc_type is None)
        finally:
            self._writer._resume()

"""Model-based test: the whole public API against a plain-Python broadcast queue.

Random sequences of put / put_nowait / put_many / get / get_nowait / get_many, cancelled
waits, reader attach and close, and writer close, on each backend (through a blocking
portal), must agree with a model that follows the documented rules on every result and on
``statistics()``.
"""

from __future__ import annotations

import collections
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from conftest import BACKENDS
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import aioshmq
from aioshmq.ring import format as L

CAP = 4096
MAX = 6
READERS = 2
WAIT = 5.0  # for calls the model says complete now
CANCEL = 0.002  # for calls the model says must wait: they are cancelled


def record(size: int) -> int:
    return L.HEADER_SIZE + L.align(size, 16)


class QueueModel(RuleBasedStateMachine):
    backend: Any = "asyncio"

    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = start_blocking_portal(*_portal_args(self.backend))
        self.portal: BlockingPortal = self._portal_cm.__enter__()
        self.w = aioshmq.create(capacity=CAP, max_messages=MAX, readers=READERS, serializer="raw")
        self.r: list[aioshmq.Reader[bytes] | None] = [
            aioshmq.connect(self.w.name, i) for i in range(READERS)
        ]
        self.pos = self.count = 0  # the writer's head, bytes and messages
        self.queues = [collections.deque[tuple[bytes, int]]() for _ in range(READERS)]
        self.tails = [0] * READERS
        self.counts = [0] * READERS
        self.serial = 0
        self.writer_closed = False

    def teardown(self) -> None:
        for r in self.r:
            if r is not None:
                r.close()
        self.w.close()
        self._portal_cm.__exit__(None, None, None)

    # -- the model's rules ------------------------------------------------------------------

    def message(self, size: int) -> bytes:
        self.serial += 1
        return (self.serial.to_bytes(4, "little") * (size // 4 + 1))[:size]

    def counted(self) -> list[int]:
        return [i for i in range(READERS) if self.r[i] is not None]

    def span(self, pos: int, size: int) -> int:
        off = pos % CAP
        rec = record(size)
        return rec if off + rec <= CAP else CAP - off + rec

    def fits(self, pos: int, count: int, size: int) -> bool:
        counted = self.counted()
        low_pos = min((self.tails[i] for i in counted), default=self.pos)
        low_count = min((self.counts[i] for i in counted), default=self.count)
        return pos + self.span(pos, size) - low_pos <= CAP and count + 1 - low_count <= MAX

    def publish(self, msgs: list[bytes]) -> None:
        for msg in msgs:
            self.pos += self.span(self.pos, len(msg))
            self.count += 1
            for i in self.counted():
                self.queues[i].append((msg, self.pos))

    def how_many_fit(self, sizes: list[int]) -> int:
        pos, count = self.pos, self.count
        for n, size in enumerate(sizes):
            if not self.fits(pos, count, size):
                return n
            pos += self.span(pos, size)
            count += 1
        return len(sizes)

    def took(self, i: int, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            msg, end = self.queues[i].popleft()
            self.tails[i], self.counts[i] = end, self.counts[i] + 1
            out.append(msg)
        return out

    # -- writer rules -----------------------------------------------------------------------

    sizes = st.integers(0, CAP // 2 - L.HEADER_SIZE)

    @precondition(lambda self: not self.writer_closed)
    @rule(size=sizes)
    def put_nowait(self, size: int) -> None:
        msg = self.message(size)
        fits = self.how_many_fit([size]) == 1
        try:
            self.w.put_nowait(msg)
        except aioshmq.Full:
            assert not fits, "Full, but the model has room"
            return
        assert fits, "put_nowait accepted, but the model has no room"
        self.publish([msg])

    @precondition(lambda self: not self.writer_closed)
    @rule(size=sizes)
    def put(self, size: int) -> None:
        msg = self.message(size)
        fits = self.how_many_fit([size]) == 1
        done = self.portal.call(_timed, self.w.put, msg, WAIT if fits else CANCEL)
        assert done == fits, f"put {'completed' if done else 'waited'}; model says fits={fits}"
        if done:
            self.publish([msg])

    @precondition(lambda self: not self.writer_closed)
    @rule(sizes=st.lists(st.integers(0, 400), min_size=1, max_size=MAX))
    def put_many(self, sizes: list[int]) -> None:
        msgs = [self.message(size) for size in sizes]
        atomic = sum(record(s) for s in sizes) <= CAP // 2
        n = self.how_many_fit(sizes)
        done = self.portal.call(_timed, self.w.put_many, msgs, WAIT if n == len(msgs) else CANCEL)
        assert done == (n == len(msgs))
        if done:
            self.publish(msgs)
        elif not atomic:
            self.publish(msgs[:n])  # a batch over half the ring goes out as far as it fits

    @precondition(lambda self: not self.writer_closed)
    @rule()
    def close_writer(self) -> None:
        self.portal.call(self.w.aclose)
        self.writer_closed = True
        with pytest.raises(anyio.ClosedResourceError):
            self.w.put_nowait(b"late")

    # -- reader rules -----------------------------------------------------------------------

    readers = st.integers(0, READERS - 1)

    def end_or_empty(self, i: int, exc: BaseException) -> None:
        assert not self.queues[i]
        if self.writer_closed:
            assert isinstance(exc, anyio.EndOfStream), exc
        else:
            assert isinstance(exc, aioshmq.Empty), exc

    @rule(i=readers)
    def get_nowait(self, i: int) -> None:
        r = self.r[i]
        if r is None:
            return
        try:
            got = r.get_nowait()
        except (aioshmq.Empty, anyio.EndOfStream) as exc:
            self.end_or_empty(i, exc)
            return
        assert [got] == self.took(i, 1)

    @rule(i=readers)
    def get(self, i: int) -> None:
        r = self.r[i]
        if r is None:
            return
        ready = bool(self.queues[i]) or self.writer_closed
        try:
            got = self.portal.call(_value, r.get, WAIT if ready else CANCEL)
        except anyio.EndOfStream:
            assert self.writer_closed and not self.queues[i]
            return
        if got is _CANCELLED:
            assert not ready, "get waited, but the model has a message"
            return
        assert [got] == self.took(i, 1)

    @rule(i=readers, most=st.integers(1, MAX + 1))
    def get_many(self, i: int, most: int) -> None:
        r = self.r[i]
        if r is None or not self.queues[i]:
            return
        got = self.portal.call(_value, lambda: r.get_many(max_messages=most), WAIT)
        assert got == self.took(i, min(most, len(self.queues[i])))

    @rule(i=readers)
    def close_reader(self, i: int) -> None:
        r = self.r[i]
        if r is None:
            return
        self.portal.call(r.aclose)
        self.r[i] = None
        self.queues[i].clear()

    @precondition(lambda self: not self.writer_closed)
    @rule(i=readers)
    def attach_reader(self, i: int) -> None:
        if self.r[i] is not None:
            with pytest.raises(anyio.BusyResourceError):
                aioshmq.connect(self.w.name, i)
            return
        self.r[i] = aioshmq.connect(self.w.name, i)
        self.tails[i], self.counts[i] = self.pos, self.count  # a new reader starts at the head

    # -- what must always agree ---------------------------------------------------------------

    @invariant()
    def statistics_agree(self) -> None:
        counted = self.counted()  # a closed reader is no longer counted once close() returns
        if not self.writer_closed:
            s = self.w.statistics()
            low_pos = min((self.tails[i] for i in counted), default=self.pos)
            low_count = min((self.counts[i] for i in counted), default=self.count)
            assert s.messages_in_ring == self.count - low_count
            assert s.bytes_in_ring == self.pos - low_pos
            assert s.messages_put == self.count
            assert s.readers_attached == len(counted)
        for i in counted:
            r = self.r[i]
            assert r is not None
            rs = r.statistics()
            assert rs.messages_available == len(self.queues[i])
            assert rs.bytes_available == self.pos - self.tails[i]


_CANCELLED: Any = object()


async def _timed(fn: Any, arg: Any, timeout: float) -> bool:
    """True if ``fn(arg)`` completed within ``timeout``, False if it was cancelled."""
    with anyio.move_on_after(timeout) as scope:
        await fn(arg)
    return not scope.cancelled_caught


async def _value(fn: Any, timeout: float) -> Any:
    with anyio.move_on_after(timeout):
        return await fn()
    return _CANCELLED


def _portal_args(backend: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(backend, tuple):
        return backend[0], backend[1]
    return backend, {}


def _run_model(backend: Any, examples: int) -> None:
    machine = type("Machine", (QueueModel,), {"backend": backend})
    runner = machine.TestCase
    runner.settings = settings(max_examples=examples, stateful_step_count=50, deadline=None)
    runner("runTest").runTest()


BACKEND_PARAMS = pytest.mark.parametrize(
    "backend", [p.values[0] for p in BACKENDS], ids=[p.id for p in BACKENDS]
)


@BACKEND_PARAMS
def test_model(backend: Any) -> None:
    """25 random programs of up to 50 steps on each backend; the slow tier runs 200."""
    _run_model(backend, 25)


@pytest.mark.slow
@pytest.mark.timeout(600)
@BACKEND_PARAMS
def test_model_long(backend: Any) -> None:
    """200 random programs of up to 50 steps: about 10 s a backend on a quiet machine."""
    _run_model(backend, 200)

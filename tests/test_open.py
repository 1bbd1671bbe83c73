"""What users call to open a ring: waiting for a writer that is not there yet, and aconnect."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import anyio
import pytest

import aioshmq
from aioshmq.ends import broker as _broker
from aioshmq.ends import reader as _reader

pytestmark = pytest.mark.anyio


def _name() -> str:
    return f"test-open-{secrets.token_hex(6)}"


class _Looked(threading.Event):
    """A give-up event that also tells when the connect first found no ring and paused."""

    def __init__(self) -> None:
        super().__init__()
        self.looked = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.looked.set()
        return super().wait(timeout)


def test_without_wait_a_missing_ring_fails_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="no aioshmq ring named"):
        aioshmq.connect(_name(), timeout=30)
    assert time.monotonic() - start < 5  # not the timeout


def test_wait_finds_a_ring_created_later() -> None:
    name = _name()
    looked = _Looked()
    got: list[Any] = []

    def attach() -> None:
        try:
            got.append(_reader.connect(name, timeout=30, wait=looked))
        except BaseException as exc:  # reported below
            got.append(exc)

    t = threading.Thread(target=attach)
    t.start()
    try:
        assert looked.looked.wait(30)  # it looked, found nothing, and is waiting
        with aioshmq.create(capacity=1 << 16, name=name) as w:
            t.join(30)
            assert not t.is_alive()
            (r,) = got
            assert isinstance(r, aioshmq.Reader), r
            with r:
                w.put_sync("hello", timeout=5)
                assert r.get_sync(timeout=5) == "hello"
    finally:
        looked.set()
        t.join(30)


def test_wait_ends_with_the_timeout() -> None:
    with pytest.raises(TimeoutError, match="appeared within the timeout"):
        aioshmq.connect(_name(), timeout=0.05, wait=True)


def test_a_waiter_that_gives_up_stops_looking() -> None:
    give_up = threading.Event()
    errors: list[BaseException] = []

    def look() -> None:
        try:
            _broker.reach(_name(), None, give_up)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=look)
    t.start()
    give_up.set()
    t.join(30)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], FileNotFoundError)


def test_wait_is_checked() -> None:
    with pytest.raises(TypeError, match="wait must be True or False"):
        aioshmq.connect(_name(), wait="yes")  # type: ignore[arg-type]


async def test_aconnect_leaves_the_loop_free_while_it_waits() -> None:
    name = _name()
    readers: list[aioshmq.Reader[Any]] = []

    async def attach() -> None:
        readers.append(await aioshmq.aconnect(name, timeout=30, wait=True))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(attach)
            await anyio.wait_all_tasks_blocked()
            # The loop runs (this task does) while aconnect waits: the writer comes from here.
            with aioshmq.create(capacity=1 << 16, name=name) as w:
                await w.wait_readers()
                await w.put({"n": 1})
                await w.put({"n": 2})
        (r,) = readers
        with r:
            assert await r.get() == {"n": 1}
            assert await r.get() == {"n": 2}
            with pytest.raises(anyio.EndOfStream):
                await r.get()


async def test_aconnect_to_a_ring_that_exists() -> None:
    with aioshmq.create(capacity=1 << 16, readers=2) as w:
        w.drop_reader(0)  # only slot 1 is used here
        async with await aioshmq.aconnect(w.handle, 1) as r:
            assert r.index == 1
            await w.put("x")
            assert await r.get() == "x"
        with pytest.raises(FileNotFoundError):
            await aioshmq.aconnect(_name())
        with pytest.raises(ValueError, match="out of range"):
            await aioshmq.aconnect(w.name, 5)


async def test_a_cancelled_aconnect_returns_at_once() -> None:
    start = time.monotonic()
    with anyio.move_on_after(0.1) as scope:
        await aioshmq.aconnect(_name(), timeout=None, wait=True)
    assert scope.cancelled_caught
    assert time.monotonic() - start < 10

"""The aioshmq logger: attaches, departures, deaths, refusals, corruption and slow readers."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from conftest import Children

import aioshmq

pytestmark = pytest.mark.anyio


class _Records(logging.Handler):
    """Every record of the "aioshmq" logger, and a way to wait for one (the broker thread
    logs on its own time)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._changed:
            self.records.append(record)
            self._changed.notify_all()

    def lines(self) -> list[str]:
        with self._changed:
            return [f"{r.levelname} {r.getMessage()}" for r in self.records]

    def wait_for(self, pattern: str, timeout: float = 30.0) -> str:
        found: list[str] = []

        def match() -> bool:
            found[:] = [line for line in self.lines() if re.search(pattern, line)]
            return bool(found)

        with self._changed:
            if not self._changed.wait_for(match, timeout):
                raise AssertionError(f"no log line matching {pattern!r} in {self.lines()}")
        return found[0]


@pytest.fixture
def logged() -> Iterator[_Records]:
    logger = logging.getLogger("aioshmq")
    handler = _Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_attach_and_detach(logged: _Records) -> None:
    with aioshmq.create(capacity=1 << 16) as w:
        with aioshmq.connect(w.name):
            line = logged.wait_for("attached")
            assert line == f"INFO ring {w.name!r}: reader 0 attached (pid {os.getpid()})"
        line = logged.wait_for("detached")
        assert line == f"INFO ring {w.name!r}: reader 0 detached (pid {os.getpid()})"


def test_a_refused_attach(logged: _Records) -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name):
        with pytest.raises(anyio.BusyResourceError):
            aioshmq.connect(w.name)
        line = logged.wait_for("refused")
        assert line.startswith(f"INFO ring {w.name!r}: refused an attach from pid {os.getpid()}")
        assert "held by a live reader" in line


def _attach_and_wait(name: str, ready: Any) -> None:
    with aioshmq.connect(name):
        ready.send("attached")
        ready.recv()  # killed here


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn"])
def test_a_reader_that_dies(method: str, children: Children, logged: _Records) -> None:
    ours, theirs = multiprocessing.get_context(method).Pipe()
    with aioshmq.create(capacity=1 << 16, on_reader_death="detach") as w:
        proc = children.start(method, _attach_and_wait, w.name, theirs)
        assert ours.poll(30) and ours.recv() == "attached"
        proc.kill()
        line = logged.wait_for("died")
        assert line == (
            f"WARNING ring {w.name!r}: reader 0 (pid {proc.pid}) died while attached; its slot "
            "is detached (on_reader_death='detach')"
        )
    ours.close()
    theirs.close()


async def test_a_put_that_waits_for_a_slow_reader(logged: _Records) -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=2, slow_reader_warning=0.05) as w:
        with aioshmq.connect(w.name) as r:
            await w.put("a")
            await w.put("b")
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.put, "c")
                line = await anyio.to_thread.run_sync(logged.wait_for, "waited")
                assert re.fullmatch(
                    rf"WARNING ring {re.escape(repr(w.name))}: a put has waited 0\.\d s for "
                    rf"room; the slowest reader is slot 0 \(pid {os.getpid()}\), 2 messages "
                    r"and \d+ bytes behind",
                    line,
                ), line
                assert await r.get() == "a"
            assert [await r.get(), await r.get()] == ["b", "c"]


def test_a_blocking_put_that_waits_for_a_slow_reader(logged: _Records) -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=1, slow_reader_warning=0.05) as w:
        with aioshmq.connect(w.name, 0) as r:
            w.put_sync("a")
            with pytest.raises(TimeoutError):
                w.put_sync("b", timeout=0.3)
            line = logged.wait_for("waited")
            assert f"slot 0 (pid {os.getpid()}), 1 messages" in line
            assert r.get_sync(timeout=5) == "a"


async def test_never_attached_slots_are_named(logged: _Records) -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=1, slow_reader_warning=0.05) as w:
        await w.put("a")
        with anyio.move_on_after(0.5):
            await w.put("b")
        assert "slot 0 (never attached)" in logged.wait_for("waited")
        w.drop_reader(0)
        assert logged.wait_for("dropped") == f"INFO ring {w.name!r}: reader slot 0 dropped"


def test_slow_reader_warning_is_checked() -> None:
    for bad in (0, -1, "10", True):
        with pytest.raises(ValueError, match="slow_reader_warning must be a number of seconds"):
            aioshmq.create(capacity=1 << 16, slow_reader_warning=bad)  # type: ignore[arg-type]


def test_corruption_is_logged_where_it_is_found(logged: _Records) -> None:
    error = aioshmq.CorruptedError("reader 0 claims position 9 beyond the head 0")
    assert logged.lines() == [f"ERROR corruption: {error}"]


async def test_nothing_on_the_per_message_path(logged: _Records) -> None:
    with aioshmq.create(capacity=1 << 16) as w:
        with aioshmq.connect(w.name) as r:
            logged.wait_for("attached")
            before = logged.lines()
            for i in range(300):
                await w.put(i)
                assert await r.get() == i
            await w.put_many(range(64))
            assert await r.get_many() == list(range(64))
            assert logged.lines() == before

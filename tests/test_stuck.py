"""The stuck-reader policy: a live reader that holds the writer back without moving is
evicted after ``slow_reader_timeout`` seconds of waiting, and told so; the default waits."""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from typing import Any

import anyio
import pytest
from conftest import Children

import aioshmq
from aioshmq.cli.stat import observe
from aioshmq.ends.stuck import Stuck

pytestmark = pytest.mark.anyio


class _Ring:
    """What Stuck sees of a ring: the readers holding the write back, and evictions."""

    def __init__(self) -> None:
        self.blocking: dict[int, tuple[int, int]] = {}
        self.evicted: list[int] = []

    def blockers(self) -> list[tuple[int, int, int]]:
        return [(slot, *at) for slot, at in sorted(self.blocking.items())]

    def evict(self, index: int, tail: int, count: int, timeout: float) -> bool:
        if self.blocking.get(index) != (tail, count):
            return False
        self.evicted.append(index)
        del self.blocking[index]
        return True


def test_only_waiting_time_at_one_place_counts() -> None:
    ring = _Ring()
    stuck = Stuck(1.0)
    ring.blocking = {0: (100, 1), 1: (200, 2)}
    assert stuck.waited(ring, 5.0) == []  # first seen now: nothing counted yet
    assert stuck.due() == 1.0
    assert stuck.waited(ring, 0.6) == []
    assert stuck.due() == pytest.approx(0.4)
    ring.blocking[1] = (216, 3)  # slot 1 moved: it starts from zero
    assert stuck.waited(ring, 0.0) == []
    assert stuck.waited(ring, 0.5) == [(0, 100, 1)]
    assert ring.evicted == [0] and stuck.evicted == 1
    assert stuck.due() == pytest.approx(0.5)
    ring.blocking = {}  # nothing holds the writer back: forgotten
    assert stuck.waited(ring, 10.0) == [] and stuck.due() == 1.0
    ring.blocking = {1: (216, 3)}
    assert stuck.waited(ring, 10.0) == []  # seen again, but not counted from before
    assert stuck.waited(ring, 0.99) == [] and stuck.evicted == 1


def test_a_reader_that_moved_at_the_last_moment_is_kept() -> None:
    ring = _Ring()
    stuck = Stuck(0.5)
    ring.blocking = {3: (0, 0)}
    stuck.waited(ring, 0.0)

    class Moved(_Ring):
        def evict(self, index: int, tail: int, count: int, timeout: float) -> bool:
            return False  # it advanced between the look and the eviction

    moved = Moved()
    moved.blocking = ring.blocking
    assert stuck.waited(moved, 1.0) == [] and stuck.evicted == 0


@pytest.mark.parametrize("value", [0, -1, float("nan"), "1", True])
def test_a_bad_timeout_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="slow_reader_timeout"):
        aioshmq.create(slow_reader_timeout=value)
    with aioshmq.create(slow_reader_timeout=2.5) as w:  # the next call works
        assert w.statistics().readers_evicted == 0


async def test_by_default_a_stuck_reader_is_waited_for() -> None:
    with aioshmq.create(capacity=4096, max_messages=4, readers=2) as w:
        with aioshmq.connect(w.name, 0) as a, aioshmq.connect(w.name, 1) as b:
            for i in range(4):
                await w.put(i)
            with anyio.move_on_after(0.5) as waited:
                await w.put(4)
            assert waited.cancelled_caught
            stats = w.statistics()
            assert (stats.readers_attached, stats.readers_evicted) == (2, 0)
            assert [b.get_nowait() for _ in range(4)] == [0, 1, 2, 3]
            assert [a.get_nowait() for _ in range(4)] == [0, 1, 2, 3]


async def test_a_stuck_reader_is_evicted_and_told(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "aioshmq")
    with aioshmq.create(capacity=4096, max_messages=4, readers=2, slow_reader_timeout=0.2) as w:
        a = aioshmq.connect(w.name, 0, spin=0)
        b = aioshmq.connect(w.name, 1, spin=0)
        got: list[int] = []

        async def drain() -> None:
            while len(got) < 20:
                got.append(await a.get())

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            for i in range(20):
                await w.put(i)
        assert got == list(range(20))
        stats = w.statistics()
        assert (stats.readers_attached, stats.readers_evicted) == (1, 1)
        assert [s.state for s in observe(w.name).slots] == ["attached", "evicted"]
        warned = [r for r in caplog.records if "evicted reader 1" in r.getMessage()]
        assert warned[0].levelno == logging.WARNING
        assert f"pid {os.getpid()}" in warned[0].getMessage()

        for read in (b.get_nowait, b.get, b.get_many, b.get_nowait):
            with pytest.raises(aioshmq.ReaderEvicted) as caught:
                result = read()
                if not isinstance(result, int):
                    await result
            assert caught.value.index == 1 and caught.value.timeout == 0.2
            assert isinstance(caught.value, anyio.BrokenResourceError)
            assert repr(w.name) in str(caught.value) and "slow_reader_timeout" in str(caught.value)
        with pytest.raises(aioshmq.ReaderEvicted):
            async with b.lease():
                pass

        # The slot stays taken until the evicted reader lets it go, then is free again.
        with pytest.raises(anyio.BusyResourceError):
            aioshmq.connect(w.name, 1)
        b.close()
        assert "evicted reader 1" in caplog.records[-1].getMessage()
        with aioshmq.connect(w.name, 1) as again:
            await w.put("next")
            assert again.get_nowait() == "next" and a.get_nowait() == "next"
        a.close()


async def test_an_evicted_reader_the_writer_lapped_is_told_it_was_evicted() -> None:
    """The ordinary case: a reader frozen while it waited is evicted, and the writer goes on
    until it is more than a ring ahead.  Every read then says the reader was evicted, not
    that the ring is corrupted: the eviction mark is read before the head."""
    with aioshmq.create(capacity=4096, max_messages=4, readers=2, slow_reader_timeout=0.2) as w:
        a = aioshmq.connect(w.name, 0, spin=0)
        b = aioshmq.connect(w.name, 1, spin=0)
        got: list[bytes] = []
        n = 200  # 200 records of 80 bytes: almost four rings past the evicted reader

        async def drain() -> None:
            while len(got) < n:
                got.append(await a.get())

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            for i in range(n):
                await w.put(bytes([i % 256]) * 40)
        assert len(got) == n and w.statistics().readers_evicted == 1
        assert b._core.head == 0  # it never looked: the writer is laps ahead of it
        for name in ("get_nowait", "get", "get_many", "get_sync"):
            read = getattr(b, name)
            with pytest.raises(aioshmq.ReaderEvicted) as caught:
                if name == "get_sync":
                    await anyio.to_thread.run_sync(read)
                else:
                    result = read()
                    if inspect.isawaitable(result):
                        await result
            assert caught.value.index == 1, name
        with pytest.raises(aioshmq.ReaderEvicted):
            async with b.lease():
                pass
        b.close()
        a.close()


async def test_a_reader_that_keeps_moving_is_not_evicted() -> None:
    with aioshmq.create(capacity=4096, max_messages=2, readers=1, slow_reader_timeout=2.0) as w:
        with aioshmq.connect(w.name, spin=0) as r:
            got: list[int] = []

            async def slowly() -> None:
                while len(got) < 30:
                    await anyio.sleep(0.02)  # a slow consumer, far quicker than the timeout
                    got.append(await r.get())

            async with anyio.create_task_group() as tg:
                tg.start_soon(slowly)
                for i in range(30):
                    await w.put(i)
            assert got == list(range(30))
            assert w.statistics().readers_evicted == 0


class _Gated(aioshmq.PickleSerializer):
    """Loads only once let through: the reader is then held in the middle of a read."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.go = threading.Event()
        self.saw: list[Any] = []

    def _hold(self, load: Any) -> Any:
        self.entered.set()
        assert self.go.wait(30)
        obj = load()
        self.saw.append(obj)
        return obj

    def loads_plain(self, main: memoryview) -> Any:
        return self._hold(lambda: super(_Gated, self).loads_plain(main))

    def loads(self, main: memoryview, buffers: Any) -> Any:
        return self._hold(lambda: super(_Gated, self).loads(main, buffers))


@pytest.mark.parametrize("how", ["get_sync", "get", "get_many", "out of band"])
def test_a_record_overwritten_while_it_is_read_is_never_returned(how: str) -> None:
    """The writer evicts a reader that is in the middle of loading a record and writes over
    that record; what the reader loaded is thrown away for ReaderEvicted."""
    ser = _Gated()
    big = 1500  # two such records fill the 4 KiB ring: the third one wraps onto the first
    first: Any = bytes([1]) * big
    if how == "out of band":
        first = pickle.PickleBuffer(bytearray(first))
    with aioshmq.create(capacity=4096, readers=1, slow_reader_timeout=0.1) as w:
        with aioshmq.connect(w.name, serializer=ser, spin=0) as r:
            w.put_sync(first)
            w.put_sync(bytes([2]) * big)
            outcome: list[BaseException | object] = []

            def read() -> None:
                try:
                    if how == "get_sync":
                        outcome.append(r.get_sync(timeout=30))
                    elif how == "get_many":
                        outcome.append(anyio.run(r.get_many))
                    else:
                        outcome.append(anyio.run(r.get))
                except BaseException as exc:
                    outcome.append(exc)

            reader = threading.Thread(target=read)
            reader.start()
            try:
                assert ser.entered.wait(30)
                w.put_sync(bytes([3]) * big, timeout=30)  # evicts the reader, then wraps
                assert w.statistics().readers_evicted == 1
            finally:
                ser.go.set()
                reader.join(30)
            assert isinstance(outcome[0], aioshmq.ReaderEvicted), outcome
            # The load did see the overwritten bytes: without the check, it would be returned.
            if how != "out of band":
                assert ser.saw and ser.saw[0] != first
            with pytest.raises(aioshmq.ReaderEvicted):
                r.get_nowait()


async def test_a_lease_held_past_an_eviction_says_so_when_it_ends() -> None:
    with aioshmq.create(capacity=4096, readers=1, slow_reader_timeout=0.1) as w:
        with aioshmq.connect(w.name, spin=0) as r:
            await w.put(bytearray(1500))
            with pytest.raises(aioshmq.ReaderEvicted):
                async with r.lease() as msg:
                    assert len(msg) == 1500
                    for _ in range(4):  # waits for the lease, evicts, and wraps over it
                        await w.put(bytearray(1500))
            assert w.statistics().readers_evicted == 1


def _stopped_reader(name: str, ready: Any) -> None:
    with aioshmq.connect(name, 1, spin=0, timeout=30) as r:
        ready.send(r.get_sync(timeout=30))
        try:
            r.get_sync(timeout=30)  # stopped in here; evicted meanwhile
        except aioshmq.ReaderEvicted as exc:
            ready.send(("evicted", exc.index))
            return
    ready.send("not evicted")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_frozen_reader_process_is_evicted_and_learns_it_when_it_runs_again(
    method: str, children: Children
) -> None:
    ours, theirs = multiprocessing.get_context(method).Pipe()
    with aioshmq.create(capacity=1 << 16, max_messages=8, readers=2, slow_reader_timeout=0.3) as w:
        with aioshmq.connect(w.name, 0, spin=0) as a:
            proc = children.start(method, _stopped_reader, w.name, theirs)
            w.wait_readers_sync(timeout=60)
            w.put_sync("hello")
            assert ours.poll(60) and ours.recv() == "hello"
            assert a.get_sync() == "hello"
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGSTOP)  # alive, holding its slot, reading nothing
            try:
                for i in range(20):
                    w.put_sync(i, timeout=30)  # waits 0.3 s once, then no more
                    assert a.get_sync() == i
                assert w.statistics().readers_evicted == 1
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert ours.poll(60) and ours.recv() == ("evicted", 1)
            assert children.join() == [0]
            with aioshmq.connect(w.name, 1) as again:  # its close freed the slot
                w.put_sync("after")
                assert again.get_sync() == "after" and a.get_sync() == "after"

"""The writing end: bounds, batching, non-blocking and blocking puts, cancellation, closing."""

from __future__ import annotations

import os
import pickle
import threading
from typing import Any

import anyio
import pytest
from conftest import Children

import aioshmq

pytestmark = pytest.mark.anyio


def test_full_is_would_block() -> None:
    assert issubclass(aioshmq.Full, anyio.WouldBlock)
    assert issubclass(aioshmq.Empty, anyio.WouldBlock)


async def test_put_get_in_order() -> None:
    with aioshmq.create(capacity=1 << 16, readers=2) as w:
        r0, r1 = aioshmq.connect(w.name, 0), aioshmq.connect(w.handle, 1)
        with r0, r1:
            for i in range(500):
                await w.put({"i": i, "pad": "x" * (i % 97)})
            for r in (r0, r1):
                got = [(await r.get())["i"] for _ in range(500)]
                assert got == list(range(500))


async def test_bounded_by_count() -> None:
    with aioshmq.create(capacity=1 << 20, max_messages=5) as w, aioshmq.connect(w.name) as r:
        for i in range(5):
            w.put_nowait(i)
        with pytest.raises(aioshmq.Full):
            w.put_nowait(5)
        assert w.statistics().messages_in_ring == 5
        assert r.get_nowait() == 0
        w.put_nowait(5)
        assert [r.get_nowait() for _ in range(5)] == [1, 2, 3, 4, 5]


async def test_bounded_by_bytes() -> None:
    with aioshmq.create(capacity=4096, max_messages=1000, serializer="raw") as w:
        with aioshmq.connect(w.name) as r:
            n = 0
            while True:
                try:
                    w.put_nowait(bytes([n]) * 100)
                except aioshmq.Full:
                    break
                n += 1
            # 100 bytes + 16 header, aligned: 128 bytes a record, 4096 bytes of ring.
            assert n == 4096 // 128
            stats = w.statistics()
            assert stats.messages_in_ring == n and stats.bytes_in_ring == 4096
            assert r.get_nowait() == bytes([0]) * 100
            w.put_nowait(b"z" * 100)
            out = [r.get_nowait() for _ in range(n)]
            assert out[-1] == b"z" * 100 and out[0] == bytes([1]) * 100


async def test_put_waits_for_slowest_reader() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=3, readers=2) as w:
        fast, slow = aioshmq.connect(w.name, 0), aioshmq.connect(w.name, 1)
        with fast, slow:
            for i in range(3):
                await w.put(i)
            assert [fast.get_nowait() for _ in range(3)] == [0, 1, 2]
            with pytest.raises(aioshmq.Full):
                w.put_nowait(3)
            put_done = anyio.Event()

            async def putter() -> None:
                await w.put(3)
                put_done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(putter)
                await anyio.wait_all_tasks_blocked()
                assert not put_done.is_set()
                assert w.statistics().tasks_waiting_send == 1
                assert slow.get_nowait() == 0
                with anyio.fail_after(5):
                    await put_done.wait()
            assert fast.get_nowait() == 3
            assert [slow.get_nowait() for _ in range(3)] == [1, 2, 3]


async def test_put_many_one_publish_one_wakeup() -> None:
    with aioshmq.create(capacity=1 << 20) as w, aioshmq.connect(w.name) as r:
        got: list[list[int]] = []

        async def reader() -> None:
            got.append(await r.get_many())

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            assert r.statistics().tasks_waiting_receive == 1
            before = w.statistics().wakeups_sent
            await w.put_many(range(100))
            assert w.statistics().wakeups_sent == before + 1
        assert got == [list(range(100))]


async def test_put_many_serializes_everything_first() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
            await w.put_many([1, 2, threading.Lock(), 4])
        assert w.statistics().messages_put == 0
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()
        await w.put_many([5, 6])
        assert await r.get_many() == [5, 6]


async def test_put_many_larger_than_ring_goes_in_parts() -> None:
    with aioshmq.create(capacity=4096, max_messages=4, serializer="raw") as w:
        with aioshmq.connect(w.name) as r:
            items = [bytes([i]) * 500 for i in range(40)]
            got: list[bytes] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.put_many, items)
                with anyio.fail_after(10):
                    while len(got) < 40:
                        got.extend(await r.get_many())
            assert got == items


async def test_unserializable_object_writes_nothing() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(TypeError, match="lock"):
            await w.put(threading.Lock())
        with pytest.raises(TypeError):
            w.put_nowait(threading.Lock())
        with pytest.raises(TypeError):
            await anyio.to_thread.run_sync(lambda: w.put_sync(threading.Lock()))
        assert w.statistics().messages_put == 0
        await w.put("next")
        assert r.get_nowait() == "next"
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()


async def test_cancelled_put_publishes_nothing() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=1) as w, aioshmq.connect(w.name) as r:
        await w.put("first")
        with anyio.move_on_after(0.05) as scope:
            await w.put("never")
        assert scope.cancelled_caught
        assert w.statistics().tasks_waiting_send == 0
        assert r.get_nowait() == "first"
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()
        await w.put("second")
        assert r.get_nowait() == "second"


async def test_cancelled_put_many_publishes_nothing() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=4) as w, aioshmq.connect(w.name) as r:
        await w.put_many([0, 1])
        with anyio.move_on_after(0.05) as scope:
            await w.put_many([2, 3, 4])  # fits the ring, but not now: all or nothing
        assert scope.cancelled_caught
        assert await r.get_many() == [0, 1]
        await w.put_many([5, 6, 7])
        assert await r.get_many() == [5, 6, 7]


def test_put_sync_timeout() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=1) as w, aioshmq.connect(w.name) as r:
        w.put_sync(1, timeout=1)
        with pytest.raises(TimeoutError):
            w.put_sync(2, timeout=0.05)
        assert r.get_sync(timeout=1) == 1
        w.put_sync(3, timeout=1)
        assert r.get_sync(timeout=1) == 3


def test_put_sync_wakes_when_reader_frees_room() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=1) as w, aioshmq.connect(w.name) as r:
        w.put_sync(0)
        got: list[int] = []
        t = threading.Thread(target=lambda: got.extend(r.get_sync(timeout=10) for _ in range(50)))
        t.start()
        for i in range(1, 50):
            w.put_sync(i, timeout=10)
        t.join(20)
        assert got == list(range(50))


async def test_closed_writer_raises() -> None:
    w = aioshmq.create(capacity=1 << 16)
    await w.aclose()
    for call in (lambda: w.put_nowait(1), w.statistics, lambda: w.put_sync(1)):
        with pytest.raises(anyio.ClosedResourceError):
            call()
    with pytest.raises(anyio.ClosedResourceError):
        await w.put(1)
    await w.aclose()  # idempotent


async def test_aclose_wakes_a_waiting_put() -> None:
    w = aioshmq.create(capacity=1 << 16, max_messages=1)
    with aioshmq.connect(w.name) as r:
        await w.put(0)
        async with anyio.create_task_group() as tg:

            async def blocked() -> None:
                with pytest.raises(anyio.ClosedResourceError):
                    await w.put(1)

            tg.start_soon(blocked)
            await anyio.wait_all_tasks_blocked()
            await w.aclose()
        assert await r.get() == 0
        with pytest.raises(anyio.EndOfStream):
            await r.get()


async def test_wait_readers() -> None:
    with aioshmq.create(capacity=1 << 16, readers=2) as w:
        r0 = aioshmq.connect(w.name, 0)
        done = anyio.Event()

        async def waiter() -> None:
            await w.wait_readers()
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert not done.is_set()
            r1 = aioshmq.connect(w.name, 1)
            with anyio.fail_after(5):
                await done.wait()
        r0.close()
        r1.close()


async def test_statistics_totals() -> None:
    with aioshmq.create(capacity=1 << 16, readers=1, serializer="raw") as w:
        with aioshmq.connect(w.name) as r:
            await w.put(b"abc")
            await w.put_many([b"de", b"f"])
            s = w.statistics()
            assert (s.messages_put, s.bytes_put, s.messages_in_ring) == (3, 6, 3)
            assert (s.readers, s.readers_attached, s.capacity) == (1, 1, 1 << 16)
            assert await r.get_many() == [b"abc", b"de", b"f"]
            rs = r.statistics()
            assert (rs.messages_received, rs.bytes_received, rs.messages_available) == (3, 6, 0)
            assert w.statistics().messages_in_ring == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 0}, "capacity=0"),
        ({"capacity": -5}, "capacity=-5"),
        ({"capacity": 100}, "capacity=100"),
        ({"capacity": 1 << 60}, "capacity="),
        ({"max_messages": 0}, "max_messages=0"),
        ({"readers": 0}, "readers=0"),
        ({"name": "a/b"}, "name='a/b'"),
        ({"notifier": "carrier-pigeon"}, "carrier-pigeon"),
        ({"serializer": "yaml"}, "yaml"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        aioshmq.create(**kwargs)  # type: ignore[arg-type]


def test_bad_argument_types() -> None:
    with pytest.raises(TypeError, match="capacity"):
        aioshmq.create(capacity="big")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dumps"):
        aioshmq.create(serializer=object())  # type: ignore[arg-type]


def test_capacity_beyond_memory_fails_cleanly() -> None:
    # 64 TiB cannot be reserved here: a clear MemoryError at creation, never SIGBUS later.
    with pytest.raises(MemoryError, match="capacity="):
        aioshmq.create(capacity=1 << 46)


def test_name_taken() -> None:
    name = f"taken-name-{os.getpid()}"
    with aioshmq.create(capacity=1 << 16, name=name) as w:
        with pytest.raises(FileExistsError, match=name):
            aioshmq.create(capacity=1 << 16, name=name)
        assert w.name == name


async def test_cancelled_multi_record_batch_publishes_nothing() -> None:
    """A batch written as several records (raw messages) is rolled back whole when its
    put_many is cancelled half-way: some of its records were written, none published."""
    with aioshmq.create(capacity=1 << 16, max_messages=4, serializer="raw") as w:
        with aioshmq.connect(w.name) as r:
            await w.put_many([b"0", b"1"])
            with anyio.move_on_after(0.05) as scope:
                await w.put_many([b"2", b"3", b"4"])  # 2 and 3 fit now, 4 must wait
            assert scope.cancelled_caught
            assert await r.get_many() == [b"0", b"1"]
            await w.put_many([b"5", b"6"])
            assert await r.get_many() == [b"5", b"6"]


# -- closing with messages for slots no reader attached ------------------------------------


def test_closing_with_messages_nobody_can_get_warns() -> None:
    w = aioshmq.create(capacity=1 << 16, readers=3)
    r = aioshmq.connect(w.name, 0)
    for i in range(3):
        w.put_nowait(i)
    with pytest.warns(aioshmq.UndeliveredWarning, match=r"3 messages for reader slots \[1, 2\]"):
        w.close()
    assert w._closed  # closed even where warnings are errors
    assert [r.get_nowait() for _ in range(3)] == [0, 1, 2]  # an attached reader gets all
    r.close()


def _late_reader(name: str, started: Any, result: Any) -> None:
    started.set()
    with aioshmq.connect(name, timeout=60) as r:
        got = []
        while True:
            try:
                got.append(r.get_sync(timeout=60))
            except anyio.EndOfStream:
                break
    result.put(got)


@pytest.mark.parametrize("how", ["close", "aclose", "async with"])
def test_linger_waits_for_a_late_reader(how: str, children: Children) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    started, result = ctx.Event(), ctx.Queue()

    async def main() -> None:
        async with aioshmq.create(capacity=1 << 16, linger=60) as w:
            for i in range(3):
                await w.put(i)
            await anyio.to_thread.run_sync(
                children.start, "spawn", _late_reader, w.name, started, result
            )
            assert await anyio.to_thread.run_sync(started.wait, 60)
            if how == "aclose":
                await w.aclose()

    if how == "close":
        w = aioshmq.create(capacity=1 << 16)
        for i in range(3):
            w.put_nowait(i)
        children.start("spawn", _late_reader, w.name, started, result)
        assert started.wait(60)
        w.close(linger=60)  # returns once the reader has attached: no warning
    else:
        anyio.run(main)
    assert result.get(timeout=60) == [0, 1, 2]
    assert children.join() == [0]
    result.close()
    result.join_thread()


def test_linger_that_runs_out_warns() -> None:
    import time

    w = aioshmq.create(capacity=1 << 16, linger=0.2)
    w.put_nowait("lost")
    start = time.monotonic()
    with pytest.warns(aioshmq.UndeliveredWarning, match=r"1 messages for reader slots \[0\]"):
        w.close()
    assert time.monotonic() - start >= 0.2
    with pytest.raises(ValueError, match="linger"):
        aioshmq.create(linger=-1)


def _attach_and_hold(name: str, ready: Any) -> None:
    with aioshmq.connect(name):
        ready.send("attached")
        ready.recv()  # killed while waiting here


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn"])
def test_a_death_signalled_just_before_the_writer_sleeps_is_seen(
    method: str, children: Children, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker marks a dead reader and signals the writer; a signal that lands between
    the writer's last look at the readers and its drain of the wake fd must not be lost
    (the put would then sleep until its timeout instead of raising PeerDied)."""
    import multiprocessing
    import select

    from aioshmq.memory.notify import Notifier
    from aioshmq.ring.format import DEAD

    ours, theirs = multiprocessing.get_context(method).Pipe()
    # No slow-reader warning: its timer would wake the sleep and hide a lost signal.
    with aioshmq.create(capacity=1 << 16, max_messages=1, slow_reader_warning=None) as w:
        proc = children.start(method, _attach_and_hold, w.name, theirs)
        assert ours.poll(30) and ours.recv() == "attached"
        w.put_sync("fills the ring")
        drain = Notifier.drain
        raced: list[bool] = []

        def drain_after_a_death(self: Notifier) -> None:
            if self is w._wake and not raced:
                raced.append(True)
                drain(self)  # whatever was pending, so that what comes next is the death's
                proc.kill()  # the broker sees it and signals this very fd: wait for that
                assert select.select([self.read_fd], [], [], 30)[0]
                assert w._ring.gate.state(0) == DEAD
            drain(self)

        monkeypatch.setattr(Notifier, "drain", drain_after_a_death)
        with pytest.raises(aioshmq.PeerDied, match="reader 0"):
            w.put_sync("waits for the dead reader", timeout=10)
        assert raced
        monkeypatch.undo()
        w.drop_reader(0)
    ours.close()
    theirs.close()

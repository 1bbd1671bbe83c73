"""Lifecycle of both ends: no leaks over many cycles, ResourceWarning on garbage collection,
interrupts in blocking calls, and the async API used where no event loop runs."""

from __future__ import annotations

import gc
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import aioshmq
from aioshmq import _layout as L


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_leaks_over_1000_cycles() -> None:
    def cycle() -> None:
        with aioshmq.create(capacity=1 << 16, readers=2) as w:
            with aioshmq.connect(w.name, 0) as r0, aioshmq.connect(w.handle, 1) as r1:
                w.put_nowait({"x": 1})
                assert r0.get_nowait() == r1.get_nowait() == {"x": 1}

    for _ in range(20):  # warm up caches and allocator arenas
        cycle()
    gc.collect()
    fds, maps, rss, threads = _fds(), _mappings(), _rss(), threading.active_count()
    for _ in range(1000):
        cycle()
    gc.collect()
    assert _fds() == fds
    # The allocator maps and unmaps arenas of its own; a leak would be one mapping a cycle.
    assert _mappings() - maps < 16
    with open("/proc/self/maps") as f:
        assert not [line for line in f if "memfd:aioshmq" in line]  # the rings' own mappings
    assert threading.active_count() == threads
    assert _rss() - rss < 8 << 20, f"RSS grew by {(_rss() - rss) >> 20} MiB"


def test_failed_creation_leaves_nothing() -> None:
    with aioshmq.create(capacity=1 << 16, name="leak-check") as w:
        aioshmq.connect(w.name).close()  # the broker thread is up and has its selector
        gc.collect()
        fds, maps = _fds(), _mappings()
        for _ in range(50):
            with pytest.raises(FileExistsError):
                aioshmq.create(capacity=1 << 16, name="leak-check")
            with pytest.raises(ValueError):
                aioshmq.connect(w.name, 5)
        gc.collect()
        assert _fds() <= fds
        assert _mappings() - maps < 16


def test_garbage_collected_ends_warn_and_release() -> None:
    fds = _fds()
    w = aioshmq.create(capacity=1 << 16)
    r = aioshmq.connect(w.name)
    name = w.name
    with pytest.warns(ResourceWarning, match="unclosed <aioshmq.Reader"):
        del r
        gc.collect()
    with pytest.warns(ResourceWarning, match="unclosed <aioshmq.Writer"):
        del w
        gc.collect()
    assert _fds() == fds
    with pytest.raises(FileNotFoundError):
        aioshmq.connect(name)  # the writer's broker stopped too


@pytest.fixture
def alarm() -> Iterator[Any]:
    """Raise KeyboardInterrupt in the main thread after a delay, as Ctrl-C would."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_keyboard_interrupt_in_get_sync(alarm: Any) -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        alarm(0.1)
        with pytest.raises(KeyboardInterrupt):
            r.get_sync()  # nothing will come: only the interrupt ends this
        sleep_word = w._layout.reader_word(0, L.R_SLEEP)
        assert w._seg.words[sleep_word] == 0  # not left marked asleep
        assert r.statistics().tasks_waiting_receive == 0
        w.put_sync("after")
        assert r.get_sync(timeout=5) == "after"


def test_keyboard_interrupt_in_put_sync(alarm: Any) -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=2) as w, aioshmq.connect(w.name) as r:
        w.put_sync(1)
        w.put_sync(2)
        alarm(0.1)
        with pytest.raises(KeyboardInterrupt):
            w.put_sync(3)  # the ring is full and the reader does not read
        assert w._seg.words[w._layout.writer_word(L.W_SLEEP)] == 0
        s = w.statistics()
        assert (s.messages_put, s.messages_in_ring, s.tasks_waiting_send) == (2, 2, 0)
        assert r.get_sync(timeout=5) == 1
        w.put_sync(4, timeout=5)
        assert [r.get_sync(timeout=5), r.get_sync(timeout=5)] == [2, 4]


def test_async_api_without_an_event_loop() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        for coro in (w.put(1), r.get(), w.put_many([1]), r.get_many(), w.wait_readers()):
            with pytest.raises(RuntimeError, match="event loop"):
                coro.send(None)
            coro.close()
        w.put_sync(2)
        assert r.get_sync(timeout=5) == 2


@pytest.mark.anyio
async def test_wake_ups_nobody_waits_for_neither_spin_the_loop_nor_get_lost(
    anyio_backend: object,
) -> None:
    import time

    import anyio

    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name, spin=0) as r:
        for _round in range(3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.put, "x")  # after the reader is asleep: a real wake-up
                with anyio.fail_after(5):
                    assert await r.get() == "x"
            # A wake-up that nobody waits for: the fd stays readable until the next sleep.
            os.eventfd_write(r._wake.read_fd, 1)
            cpu = time.process_time()
            await anyio.sleep(0.3)
            assert time.process_time() - cpu < 0.05  # the loop slept: no readable-fd spin
        # The next sleep is not fooled by the stale wake-up into missing a real one.
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.put, "y")
            with anyio.fail_after(5):
                assert await r.get() == "y"
        # A blocking get on another thread still gets its wake-up.
        got = []
        thread = threading.Thread(target=lambda: got.append(r.get_sync(timeout=5)))
        thread.start()
        with anyio.fail_after(5):
            while not r._ring.w[r._ring.r_sleep]:  # until the thread is asleep in get_sync
                await anyio.sleep(0.001)
        await w.put("z")
        await anyio.to_thread.run_sync(thread.join, 10)
        assert got == ["z"]

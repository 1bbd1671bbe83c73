"""The reading end: iteration, end of stream, non-blocking and blocking gets, cancellation."""

from __future__ import annotations

import anyio
import pytest

import aioshmq

pytestmark = pytest.mark.anyio


async def test_async_for_ends_after_writer_closes() -> None:
    w = aioshmq.create(capacity=1 << 16)
    with aioshmq.connect(w.name) as r:
        await w.put_many(range(10))
        await w.aclose()
        got = [msg async for msg in r]
        assert got == list(range(10))
        with pytest.raises(anyio.EndOfStream):
            await r.get()
        with pytest.raises(anyio.EndOfStream):
            r.get_nowait()
        with pytest.raises(anyio.EndOfStream):
            await anyio.to_thread.run_sync(lambda: r.get_sync(timeout=1))


async def test_end_of_stream_wakes_a_sleeping_reader() -> None:
    w = aioshmq.create(capacity=1 << 16)
    with aioshmq.connect(w.name) as r:
        got: list[object] = []

        async def consume() -> None:
            got.extend([msg async for msg in r])

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            await w.put("last")
            await w.aclose()
        assert got == ["last"]


async def test_get_nowait_empty_then_message() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()
        w.put_nowait(("a", 1))
        assert r.get_nowait() == ("a", 1)
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()


async def test_get_many_respects_max() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put_many(range(10))
        assert await r.get_many(max_messages=4) == [0, 1, 2, 3]
        assert await r.get_many() == [4, 5, 6, 7, 8, 9]
        with pytest.raises(ValueError, match="max_messages"):
            await r.get_many(max_messages=0)


async def test_get_waits_until_put() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        async with anyio.create_task_group() as tg:
            result: list[object] = []

            async def getter() -> None:
                result.append(await r.get())

            tg.start_soon(getter)
            await anyio.wait_all_tasks_blocked()
            assert r.statistics().tasks_waiting_receive == 1
            await w.put("hello")
        assert result == ["hello"]


async def test_cancelled_get_consumes_nothing() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with anyio.move_on_after(0.05) as scope:
            await r.get()
        assert scope.cancelled_caught
        assert r.statistics().tasks_waiting_receive == 0
        await w.put(1)
        await w.put(2)
        assert await r.get() == 1
        assert await r.get() == 2


async def test_many_cancelled_gets_lose_nothing() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        got: list[int] = []

        async def consume() -> None:
            while len(got) < 200:
                with anyio.move_on_after(0.0005):
                    got.append(await r.get())

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for i in range(200):
                await w.put(i)
                if i % 7 == 0:
                    await anyio.sleep(0.001)
        assert got == list(range(200))


def test_get_sync_timeout() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(TimeoutError):
            r.get_sync(timeout=0.05)
        w.put_sync("x")
        assert r.get_sync(timeout=0) == "x"
        with pytest.raises(ValueError, match="timeout"):
            r.get_sync(timeout=-1)


async def test_closed_reader_raises() -> None:
    with aioshmq.create(capacity=1 << 16) as w:
        r = aioshmq.connect(w.name)
        await r.aclose()
        with pytest.raises(anyio.ClosedResourceError):
            await r.get()
        with pytest.raises(anyio.ClosedResourceError):
            r.get_nowait()
        with pytest.raises(anyio.ClosedResourceError):
            r.statistics()


async def test_aclose_wakes_a_waiting_get() -> None:
    with aioshmq.create(capacity=1 << 16) as w:
        r = aioshmq.connect(w.name)
        async with anyio.create_task_group() as tg:

            async def blocked() -> None:
                with pytest.raises(anyio.ClosedResourceError):
                    await r.get()

            tg.start_soon(blocked)
            await anyio.wait_all_tasks_blocked()
            await r.aclose()


async def test_closing_reader_gives_its_slot_up() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=2, readers=2) as w:
        r0, r1 = aioshmq.connect(w.name, 0), aioshmq.connect(w.name, 1)
        await w.put_many([1, 2])
        r1.close()
        # The writer stops waiting for reader 1 once it has gone.
        assert await r0.get_many() == [1, 2]
        with anyio.fail_after(5):
            await w.put_many([3, 4])
        # A new reader in that slot starts at the head: it gets what comes next.
        with aioshmq.connect(w.name, 1) as again:
            assert await r0.get_many() == [3, 4]
            await w.put(5)
            assert await again.get() == 5
            assert await r0.get() == 5
        r0.close()


async def test_unattached_slot_keeps_messages_for_a_late_reader() -> None:
    with aioshmq.create(capacity=1 << 16, readers=2) as w:
        with aioshmq.connect(w.name, 0) as r0:
            await w.put_many(["a", "b"])
            assert await r0.get_many() == ["a", "b"]
            assert w.statistics().messages_in_ring == 2  # kept for reader 1
            with aioshmq.connect(w.name, 1) as late:
                assert await late.get_many() == ["a", "b"]


async def test_reader_statistics() -> None:
    with aioshmq.create(capacity=1 << 16, readers=3) as w, aioshmq.connect(w.name, 2) as r:
        await w.put_many([b"x" * 10] * 3)
        s = r.statistics()
        assert (s.reader, s.messages_available, s.messages_received) == (2, 3, 0)
        assert s.bytes_available > 30
        await r.get()
        s = r.statistics()
        assert (s.messages_available, s.messages_received) == (2, 1)
        w.drop_reader(0)  # never attached: without this, closing warns that they lost 3
        w.drop_reader(1)


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_under_pytest_asyncio() -> None:
    """The runner most asyncio projects use (strict mode), on asyncio and uvloop loops."""
    async with aioshmq.create(capacity=1 << 16) as w:
        async with aioshmq.connect(w.name) as r:
            await w.put_many(range(5))
            assert [await r.get() for _ in range(5)] == list(range(5))
            with pytest.raises(aioshmq.Empty):
                r.get_nowait()


async def test_lease_reads_in_place_and_holds_only_its_space() -> None:
    with aioshmq.create(capacity=8192, serializer="raw") as w, aioshmq.connect(w.name) as r:
        await w.put(b"a" * 3000)
        await w.put(b"b" * 3000)
        async with r.lease() as view:
            assert isinstance(view, memoryview) and view == b"a" * 3000  # the ring itself
            assert await r.get() == b"b" * 3000  # other messages keep flowing
            # The leased record keeps its room (and, the ring being in order, what follows).
            assert w.statistics().bytes_in_ring == 2 * 3024
            await w.put(b"c" * 2000)
            with pytest.raises(aioshmq.Full):
                w.put_nowait(b"d" * 3000)
        assert w.statistics().bytes_in_ring == 2016  # released: only "c" is left
        w.put_nowait(b"d" * 3000)
        assert [await r.get(), await r.get()] == [b"c" * 2000, b"d" * 3000]


async def test_lease_of_a_numpy_array_is_zero_copy() -> None:
    np = pytest.importorskip("numpy")
    with aioshmq.create(capacity=1 << 22) as w, aioshmq.connect(w.name) as r:
        arr = np.arange(1 << 17, dtype=np.float64)  # 1 MiB: one record in a 4 MiB ring
        ring = np.frombuffer(r._seg.data, dtype=np.uint8)
        start, end = ring.ctypes.data, ring.ctypes.data + ring.nbytes
        del ring  # a view held past close would keep the mapping alive
        await w.put(arr)
        async with r.lease() as got:
            assert np.array_equal(got, arr)
            assert start <= got.ctypes.data < end  # it lives in the ring
            del got
        await w.put(arr)
        copied = await r.get()
        assert np.array_equal(copied, arr)
        assert not start <= copied.ctypes.data < end  # get() copies out


async def test_leases_of_fragmented_messages_reuse_one_buffer_and_get_never_does() -> None:
    np = pytest.importorskip("numpy")
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        size = 200_000  # three times the ring: sent in fragments, reassembled
        sent = [np.full(size, i, dtype=np.uint8) for i in range(4)]
        addresses = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.put_many, sent)
            for i in range(2):
                async with r.lease() as got:
                    assert got.shape == (size,) and np.array_equal(got, sent[i])
                    addresses.append(got.ctypes.data)
                    del got
            kept = await r.get()  # owned by the caller: never handed to a later message
            async with r.lease() as got:
                assert np.array_equal(got, sent[3])
                assert got.ctypes.data != kept.ctypes.data
                del got
        assert addresses[0] == addresses[1]  # the first lease's buffer served the second
        assert np.array_equal(kept, sent[2])  # and a later lease did not write over a get's


async def test_cancelled_lease_consumes_nothing() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with anyio.move_on_after(0.05) as scope:
            async with r.lease():
                pass
        assert scope.cancelled_caught
        await w.put("x")
        async with r.lease() as msg:
            assert msg == "x"
        w.close()
        with pytest.raises(anyio.EndOfStream):
            async with r.lease():
                pass


async def test_spin_catches_a_message_without_a_wake_up() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name, spin=1.0) as r:
        got: list[str] = []

        async def getter() -> None:
            got.append(await r.get())

        async with anyio.create_task_group() as tg:
            tg.start_soon(getter)
            for _ in range(3):
                await anyio.lowlevel.checkpoint()  # the getter is now spinning, not asleep
            await w.put("fast")
        assert got == ["fast"]
        assert w.statistics().wakeups_sent == 0


async def test_no_spin_sleeps_at_once() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name, spin=0) as r:
        async with anyio.create_task_group() as tg:
            tg.start_soon(r.get)
            await anyio.wait_all_tasks_blocked()
            assert r.statistics().tasks_waiting_receive == 1
            await w.put("slow")
        assert w.statistics().wakeups_sent == 1
        with pytest.raises(ValueError, match="spin"):
            aioshmq.connect(w.name, spin=-1)


def test_fd_numbers_above_1023() -> None:
    """A busy process holds more than 1024 fds: nothing may use select() on ours."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1500:
        pytest.skip(f"the hard fd limit ({hard}) is too low to reach fd numbers above 1023")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1500), hard))
    probe = os.open("/dev/null", os.O_RDONLY)
    fillers = [probe]
    try:
        while fillers[-1] < 1100:
            fillers.append(os.dup(probe))
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            w = aioshmq.create(capacity=1 << 16)
            r = aioshmq.connect(w.name)
            assert r._wait_fd > 1023 and r._sock.fileno() > 1023
            with pytest.raises(aioshmq.Empty):
                r.get_nowait()  # looks at the writer's liveness: the socket and the pidfd
            w.put_nowait("x")
            assert r.get_sync(timeout=5) == "x"
            r.close()  # says goodbye and waits for the answer
            w.close()
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_closing_a_reader_while_get_sync_spins_in_another_thread() -> None:
    """The compiled core spins without the GIL: a close from another thread meanwhile must
    not unmap the ring under it; the blocked call gets ClosedResourceError."""
    import threading
    import time

    with aioshmq.create() as w:
        r = aioshmq.connect(w.name, spin=1.0)  # the longest spin allowed
        errors: list[BaseException] = []

        def blocked() -> None:
            try:
                r.get_sync(timeout=10)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=blocked)
        thread.start()
        deadline = time.monotonic() + 10
        while not r._holds:  # until the call holds the end (it spins from then on)
            assert time.monotonic() < deadline, "get_sync never started waiting"
            time.sleep(0.001)
        r.close()
        thread.join(10)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], anyio.ClosedResourceError), errors

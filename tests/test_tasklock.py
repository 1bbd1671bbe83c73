"""The ends' task lock: first come first served, and a cancelled waiter leaves no trace."""

from __future__ import annotations

import anyio
import pytest

from aioshmq.ends.tasklock import TaskLock

pytestmark = pytest.mark.anyio


async def test_waiters_take_turns_in_order() -> None:
    lock = TaskLock()
    order: list[int] = []

    async def take(i: int) -> None:
        async with lock:
            order.append(i)
            await anyio.sleep(0)

    await lock.acquire()
    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(take, i)
            await anyio.wait_all_tasks_blocked()
        lock.release()
    assert order == [0, 1, 2, 3, 4] and not lock.locked()


async def test_a_free_lock_is_taken_at_once_and_refused_when_held() -> None:
    lock = TaskLock()
    lock.acquire_nowait()
    assert lock.locked()
    with pytest.raises(anyio.WouldBlock):
        lock.acquire_nowait()
    lock.release()
    await lock.acquire()  # free: no waiting
    lock.release()
    assert not lock.locked()


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    lock = TaskLock()
    got: list[str] = []
    await lock.acquire()
    doomed = anyio.CancelScope()

    async def wait_cancelled() -> None:
        with doomed:
            await lock.acquire()
            got.append("doomed")  # never: it is cancelled while waiting

    async def wait() -> None:
        async with lock:
            got.append("next")

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_cancelled)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        doomed.cancel()
        await anyio.wait_all_tasks_blocked()
        lock.release()
    assert got == ["next"] and not lock.locked()


async def test_a_waiter_cancelled_as_it_is_handed_the_lock_hands_it_on() -> None:
    lock = TaskLock()
    got: list[str] = []
    await lock.acquire()
    scope = anyio.CancelScope()

    async def first() -> None:
        with scope:
            await lock.acquire()
            got.append("first")
            lock.release()

    async def second() -> None:
        async with lock:
            got.append("second")

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(second)
        await anyio.wait_all_tasks_blocked()
        lock.release()  # to "first", which is cancelled before it runs again
        scope.cancel()
    assert got in (["second"], ["first", "second"]) and not lock.locked()

"""The writer's remote server: dead remote readers and dead writers are seen within a heartbeat."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import anyio
import pytest

import aioshmq
from tests.conftest import Children

pytestmark = pytest.mark.anyio

SECRET = b"test-secret-" + b"s" * 20
HEARTBEAT = 1.5


def _read_some_then_hang(address: str, got: Any, ready: Any) -> None:
    # A reader that would wait long for its writer: the writer's shorter timeout counts.
    r = aioshmq.connect(address, reader=0, secret=SECRET, heartbeat=30)
    for _ in range(5):
        r.get_sync(timeout=30)
    got.value = 5
    ready.set()
    time.sleep(600)  # killed here


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["raise", "detach"])
async def test_a_killed_remote_reader_is_a_dead_reader(children: Children, policy: str) -> None:
    """Start method: spawn.  The writer learns of it within the heartbeat timeout."""
    w = aioshmq.create(
        capacity=1 << 16,
        max_messages=8,
        readers=1,
        listen="tcp://127.0.0.1:0",
        secret=SECRET,
        heartbeat=HEARTBEAT,
        on_reader_death=policy,  # type: ignore[arg-type]
    )
    ctx = multiprocessing.get_context("spawn")
    got, ready = ctx.Value("i", 0), ctx.Event()
    with w:
        proc = await anyio.to_thread.run_sync(
            children.start, "spawn", _read_some_then_hang, w.address, got, ready
        )
        await w.put_many(range(5))
        assert await anyio.to_thread.run_sync(ready.wait, 30)
        proc.kill()
        await anyio.to_thread.run_sync(proc.join, 10)
        killed = time.monotonic()
        if policy == "raise":
            with anyio.fail_after(30), pytest.raises(aioshmq.PeerDied) as info:
                for i in range(1000):  # more than the ring holds: the put must wait for it
                    await w.put(i)
            assert time.monotonic() - killed < HEARTBEAT + 5
            assert "remote reader pid" in str(info.value) and str(proc.pid) in str(info.value)
            w.drop_reader(0)
            await w.put("goes on")
        else:
            with anyio.fail_after(30):
                for i in range(1000):
                    await w.put(i)
            assert time.monotonic() - killed < HEARTBEAT + 5


def _write_wait_then_die(address: Any, n: int, ready: Any) -> None:
    w = aioshmq.create(
        capacity=1 << 20, listen="tcp://127.0.0.1:0", secret=SECRET, heartbeat=HEARTBEAT
    )
    address.value = w.address.encode()
    ready.set()
    w.wait_readers_sync(timeout=30)
    for i in range(n):
        w.put_sync(i)
    while w.statistics().messages_in_ring:  # until the remote reader holds every message
        time.sleep(0.001)
    ready.clear()
    time.sleep(600)  # killed here, without closing


@pytest.mark.timeout(60)
async def test_a_killed_writer_gives_every_message_then_peer_died(children: Children) -> None:
    """Start method: spawn."""
    ctx = multiprocessing.get_context("spawn")
    address, ready = ctx.Array("c", 200), ctx.Event()
    proc = await anyio.to_thread.run_sync(
        children.start, "spawn", _write_wait_then_die, address, 300, ready
    )
    assert await anyio.to_thread.run_sync(ready.wait, 30)
    with aioshmq.connect(address.value.decode(), secret=SECRET, heartbeat=HEARTBEAT) as r:
        got = []
        with anyio.fail_after(30):
            while len(got) < 300:
                got.append(await r.get())
        proc.kill()
        await anyio.to_thread.run_sync(proc.join, 10)
        killed = time.monotonic()
        with anyio.fail_after(30), pytest.raises(aioshmq.PeerDied) as info:
            await r.get()
        assert time.monotonic() - killed < HEARTBEAT + 5
        assert info.value.role == "writer" and info.value.pid == proc.pid
        assert "no word from the writer" in str(info.value)
        with pytest.raises(aioshmq.PeerDied):
            r.get_nowait()
    assert got == list(range(300))

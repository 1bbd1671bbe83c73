"""The writer's remote server: dead remote readers and dead writers are seen within a heartbeat."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import anyio
import pytest
from conftest import BACKENDS_ASYNCIO_FIRST, Children

import aioshmq

pytestmark = pytest.mark.anyio


@pytest.fixture(params=BACKENDS_ASYNCIO_FIRST)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


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


async def test_the_writer_reuses_only_what_a_remote_reader_acknowledged() -> None:
    """Sent is not enough: records in flight stay in the writer's ring (to be sent again
    after a reconnection) until the reader says it holds them."""
    import struct

    import zmq

    from aioshmq.remote import _wire as W
    from aioshmq.remote._auth import Keys, secure_client
    from aioshmq.ring.format import record_size

    with aioshmq.create(1 << 16, 8, listen="tcp://127.0.0.1:0", secret=SECRET, heartbeat=60) as w:
        assert w.address is not None
        for i in range(8):
            w.put_nowait(i)  # the ring is full: 8 messages
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.rcvtimeo = 10_000
            secure_client(sock, Keys.from_secret(SECRET))
            sock.connect(w.address)
            sock.send(W.pack_json(W.HELLO, {"v": 2, "reader": 0, "heartbeat": 30, "peer": "t"}))
            assert sock.poll(10_000)
            welcome = W.unpack_json(sock.recv())
            sock.send(W.PING + W.POS.pack(*welcome["start"]))  # go ahead: nothing comes before
            while True:
                assert sock.poll(10_000)
                frames = sock.recv_multipart()
                if frames[0][:1] == W.DATA:
                    _pos, count, end, _end_count = W.RUN.unpack_from(frames[0], 1)
                    break
            (word,) = struct.unpack_from("<Q", frames[1])
            first = end - len(frames[1]) + record_size(word >> 8)  # the first message's end
            sock.send(W.ACK + W.POS.pack(first, count + 1))
            with anyio.fail_after(10):  # until the server took the acknowledgement in
                while w.statistics().messages_in_ring == 8:
                    await anyio.sleep(0.001)
            w.put_nowait(8)  # room for one message: this one
            with pytest.raises(aioshmq.Full):
                w.put_nowait(9)  # no room: the other 7 are in flight, unacknowledged
            assert w.statistics().messages_in_ring == 8
            sock.send(W.BYE)  # gives the slot up: the writer need not wait for it to close
            while sock.recv_multipart()[0] != W.BYE_OK:  # after data still on its way
                assert sock.poll(10_000)
        finally:
            ctx.destroy(linger=0)


def test_a_remote_reader_that_stops_reading_is_evicted_and_told() -> None:
    """The relay's slot is evicted like a local one: the remote reader gets what fully
    arrived, then ReaderEvicted (never a run the writer may have overwritten)."""
    with aioshmq.create(
        capacity=1 << 16,
        max_messages=16,
        readers=2,
        listen="tcp://127.0.0.1:0",
        insecure_loopback=True,
        slow_reader_timeout=0.3,
    ) as w:
        assert w.address is not None
        with (
            aioshmq.connect(w.name, 0, spin=0) as a,
            aioshmq.connect(w.address, 1, insecure_loopback=True, timeout=30) as r,
        ):
            for i in range(100):  # the remote reader reads none of them: it is evicted
                w.put_sync(i, timeout=30)
                assert a.get_sync(timeout=30) == i
            assert w.statistics().readers_evicted == 1
            got = []
            with pytest.raises(aioshmq.ReaderEvicted, match="slow_reader_timeout") as caught:
                while True:
                    got.append(r.get_sync(timeout=30))
            assert got == list(range(len(got))) and 0 < len(got) < 100
            assert caught.value.index == 1 and caught.value.timeout == 0.3

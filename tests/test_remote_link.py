"""A remote reader (``connect("tcp://...")``) keeps the whole reader contract, over tcp and ipc."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from conftest import BACKENDS_ASYNCIO_FIRST

import aioshmq

pytestmark = pytest.mark.anyio

SECRET = b"test-secret-" + b"s" * 20


@pytest.fixture(params=["tcp", "ipc"])
def listen(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "tcp":
        yield "tcp://127.0.0.1:0"
        return
    with tempfile.TemporaryDirectory(prefix="aioshmq-ipc-") as folder:
        yield f"ipc://{folder}/ring"


def remote_pair(listen: str, **options: Any) -> tuple[aioshmq.Writer[Any], aioshmq.Reader[Any]]:
    w = aioshmq.create(listen=listen, secret=SECRET, **options)
    try:
        assert w.address is not None
        r = aioshmq.connect(w.address, reader=0, secret=SECRET, timeout=10)
    except BaseException:
        w.close()
        raise
    return w, r


def _messages(n: int) -> list[Any]:
    rng = np.random.default_rng(7)
    out: list[Any] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(i)
        elif kind == 1:
            out.append({"i": i, "text": "x" * int(rng.integers(0, 300))})
        elif kind == 2:
            out.append(rng.integers(0, 1 << 40, size=int(rng.integers(0, 3000))))
        else:
            out.append(("batch", i, b"b" * 40))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


async def test_every_message_once_in_order_then_end_of_stream(listen: str) -> None:
    """Small objects, batches, arrays (out of band) and a message larger than the ring."""
    w, r = remote_pair(listen, capacity=1 << 16, max_messages=64)
    sent = _messages(1200)
    big = np.arange(200_000, dtype=np.int64)  # 1.6 MB through a 64 KiB ring: fragments
    sent[600] = big
    got: list[Any] = []
    with r:

        async def produce() -> None:
            await w.put_many(sent[:100])
            for msg in sent[100:]:
                await w.put(msg)
            await w.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            with anyio.fail_after(60):
                async for msg in r:
                    got.append(msg)
        with pytest.raises(anyio.EndOfStream):
            await r.get()
        with pytest.raises(anyio.EndOfStream):
            r.get_nowait()
    assert len(got) == len(sent)
    assert all(_same(a, b) for a, b in zip(sent, got, strict=True))


async def test_aclose_delivers_the_end_off_the_loop_that_serves_a_remote_reader() -> None:
    """The writer's ``aclose`` and a remote reader in one event loop: the loop goes on
    while the writer waits for the reader's last acknowledgement, so the reader takes the
    end at once (the loop was blocked until the reader's keeper thread stepped in, a third
    of the heartbeat later: 10 s here)."""
    heartbeat = 30.0
    w = aioshmq.create(4096, 4, listen="tcp://127.0.0.1:0", secret=SECRET, heartbeat=heartbeat)
    assert w.address is not None
    with aioshmq.connect(w.address, secret=SECRET, timeout=10, heartbeat=heartbeat) as r:

        async def produce() -> None:
            for i in range(40):  # ten rings' worth: the writer waits for room in this loop
                await w.put(i)
            await w.aclose()

        with anyio.fail_after(heartbeat / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                assert [msg async for msg in r] == list(range(40))
    assert w._relay is not None and w._relay.deaths == 0


async def test_get_many_get_nowait_get_sync_lease_and_statistics(listen: str) -> None:
    w, r = remote_pair(listen, capacity=1 << 20)
    with w, r:
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()
        await w.put_many(range(10))
        with anyio.fail_after(10):
            first = await r.get_many(max_messages=4)
            rest = [] if len(first) == 10 else await r.get_many()
            while len(first) + len(rest) < 10:
                rest += await r.get_many()
        assert first + rest == list(range(10))
        await w.put(np.arange(1000))
        async with r.lease() as arr:
            assert np.array_equal(arr, np.arange(1000))
        w.put_nowait("sync")
        assert await anyio.to_thread.run_sync(lambda: r.get_sync(timeout=10)) == "sync"
        stats = r.statistics()
        assert stats.reader == 0 and stats.messages_received == 12
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()


async def test_a_held_slot_is_busy_and_a_closed_one_free_again() -> None:
    w = aioshmq.create(readers=2, listen="tcp://127.0.0.1:0", secret=SECRET)
    assert w.address is not None
    with w:
        local = aioshmq.connect(w.name, reader=0)
        with pytest.raises(anyio.BusyResourceError, match="held by a live reader"):
            aioshmq.connect(w.address, reader=0, secret=SECRET)
        local.close()
        r1 = aioshmq.connect(w.address, reader=1, secret=SECRET)
        with pytest.raises(anyio.BusyResourceError):
            aioshmq.connect(w.address, reader=1, secret=SECRET)
        with pytest.raises(anyio.BusyResourceError):
            aioshmq.connect(w.name, reader=1)
        with pytest.raises(ValueError, match="out of range"):
            aioshmq.connect(w.address, reader=2, secret=SECRET)
        r1.close()  # returns once the writer took the slot back
        with aioshmq.connect(w.address, reader=1, secret=SECRET) as r2:
            w.drop_reader(0)
            await w.put("after")
            with anyio.fail_after(10):
                assert await r2.get() == "after"


async def test_a_slow_remote_reader_holds_the_writer_back_with_bounded_memory() -> None:
    """The writer's ring keeps what is in flight: it can run ahead of a remote reader that
    does not read by its own ring and the reader's local ring, no more."""
    w, r = remote_pair("tcp://127.0.0.1:0", capacity=1 << 16, max_messages=50)
    with w, r:
        put = 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                w.put_nowait(put)
                put += 1
                continue
            except aioshmq.Full:
                pass
            # Full now: wait until what is in flight has settled, then try again.
            before = put
            with anyio.move_on_after(1):
                await w.put(put)
                put += 1
            if put == before:
                break
        assert 50 <= put <= 2 * 50 + 1, put
        with anyio.fail_after(10):
            got = [await r.get() for _ in range(put)]
        assert got == list(range(put))
        with anyio.fail_after(10):
            await w.put("moves again")
            assert await r.get() == "moves again"


async def test_closing_the_writer_delivers_the_rest_to_remote_readers(listen: str) -> None:
    w, r = remote_pair(listen, capacity=1 << 20)
    with r:
        for i in range(500):
            w.put_nowait(i)
        w.close()  # returns once the remote reader holds all of it
        got = await anyio.to_thread.run_sync(lambda: [r.get_sync(timeout=10) for _ in range(500)])
        assert got == list(range(500))
        with pytest.raises(anyio.EndOfStream):
            await r.get()


async def test_wrong_or_missing_secret_is_refused_and_the_writer_serves_on() -> None:
    """Nothing from a peer without the secret reaches the writer's code, let alone pickle."""
    import zmq

    from aioshmq.remote._auth import Keys

    w = aioshmq.create(listen="tcp://127.0.0.1:0", secret=SECRET)
    assert w.address is not None
    with w:
        # A handshake cut short says no more than that: the writer could not be reached.
        with pytest.raises(TimeoutError, match=r"cut short.*another secret"):
            aioshmq.connect(w.address, secret=b"another-secret-" + b"x" * 20, timeout=1)
        with pytest.raises(TimeoutError, match="needs one here too"):
            aioshmq.connect(w.address, insecure_loopback=True, timeout=1)
        # A peer that knows the writer's public key but not the secret: CURVE alone would let
        # it in; the writer's ZAP check must not.
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            public, private = zmq.curve_keypair()
            sock.curve_serverkey = Keys.from_secret(SECRET).server_public
            sock.curve_publickey, sock.curve_secretkey = public, private
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            sock.connect(w.address)
            sock.send(b'H{"v": 2, "reader": 0, "heartbeat": 3, "peer": "intruder"}')
            assert monitor.poll(10_000), "the handshake was not refused"
            monitor.close()
            sock.close()
        finally:
            ctx.term()
        assert w._relay.refused >= 1
        assert w._relay.requests == 0
        with aioshmq.connect(w.address, secret=SECRET) as r:
            await w.put("ok")
            with anyio.fail_after(10):
                assert await r.get() == "ok"
        assert w._relay.requests > 0


def test_plain_traffic_only_by_name_and_only_on_loopback() -> None:
    with pytest.raises(ValueError, match="needs secret"):
        aioshmq.create(listen="tcp://127.0.0.1:0")
    with pytest.raises(ValueError, match="loopback"):
        aioshmq.create(listen="tcp://0.0.0.0:0", insecure_loopback=True)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        aioshmq.create(listen="tcp://127.0.0.1:0", secret=b"short")
    with pytest.raises(TypeError, match="bytes"):
        aioshmq.create(listen="tcp://127.0.0.1:0", secret="text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        aioshmq.create(listen="udp://127.0.0.1:5", secret=SECRET)
    with pytest.raises(ValueError, match="listen="):
        aioshmq.create(secret=SECRET)
    with pytest.raises(ValueError, match="remote addresses"):
        aioshmq.connect("some-ring", secret=SECRET)
    with pytest.raises(ValueError, match="needs secret"):
        aioshmq.connect("tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="heartbeat"):
        aioshmq.create(listen="tcp://127.0.0.1:0", secret=SECRET, heartbeat=0)
    with aioshmq.create(listen="tcp://127.0.0.1:0", insecure_loopback=True) as w:
        assert w.address is not None and w.address.startswith("tcp://127.0.0.1:")
        assert not w.address.endswith(":0")
        with aioshmq.connect(w.address, insecure_loopback=True) as r:
            w.put_nowait(1)
            assert r.get_sync(timeout=10) == 1
    with aioshmq.create() as local:
        assert local.address is None


def test_nothing_listens_there_is_a_timeout_not_a_hang() -> None:
    with pytest.raises(TimeoutError, match=r"could not be reached.*nothing accepted"):
        aioshmq.connect("tcp://127.0.0.1:9", secret=SECRET, timeout=0.5)


def test_remote_threads_and_fds_are_released_on_close() -> None:
    before_threads = set(threading.enumerate())
    before_fds = set(os.listdir("/proc/self/fd"))
    for _ in range(5):
        w, r = remote_pair("tcp://127.0.0.1:0", capacity=1 << 16)
        w.put_nowait("x")
        assert r.get_sync(timeout=10) == "x"
        r.close()
        w.close()
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before_threads and time.monotonic() < deadline:
        time.sleep(0.01)  # zmq's own I/O threads end asynchronously after term()
    left = set(threading.enumerate()) - before_threads
    assert not {t for t in left if t.name.startswith("aioshmq")}
    assert set(os.listdir("/proc/self/fd")) - before_fds == set()


def _kill_connections(port: str) -> bool:
    """Reset every TCP connection to ``port`` (as a failing link would); False if the
    kernel or the user cannot."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("ss") is None:
        return False
    done = subprocess.run(["ss", "-K", "-t", "dport", "=", port], capture_output=True)
    return done.returncode == 0


@pytest.mark.slow  # about 7 s of streams cut and resumed
@pytest.mark.timeout(120)
def test_connections_reset_mid_stream_lose_nothing_and_repeat_nothing() -> None:
    """ZeroMQ reconnects by itself; what was in flight goes again from the writer's ring,
    and the reader drops what it already had: every message once, in order."""
    w = aioshmq.create(1 << 16, 64, listen="tcp://127.0.0.1:0", secret=SECRET)
    assert w.address is not None
    port = w.address.rsplit(":", 1)[1]
    with w, aioshmq.connect(w.address, secret=SECRET) as r:
        if not _kill_connections(port):
            pytest.skip("cannot reset TCP connections here (needs root and ss -K)")
        n = 12_000
        got: list[int] = []
        failure: list[BaseException] = []

        def consume() -> None:
            try:
                for _ in range(n):
                    got.append(r.get_sync(timeout=30))
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=consume)
        thread.start()
        for i in range(n):
            w.put_sync(i, timeout=30)
            if i % 2000 == 1000:
                assert _kill_connections(port)
        thread.join(60)
        assert not failure
        assert got == list(range(n))
        assert w._relay.resends >= 3  # the connection really dropped, and records went again


@pytest.mark.parametrize("anyio_backend", BACKENDS_ASYNCIO_FIRST)
async def test_a_reader_slower_than_the_heartbeat_after_the_end_still_gets_everything() -> None:
    """Once the stream ended the writer's side is gone: the rest waits in the reader's
    process, however long its reader takes."""
    w = aioshmq.create(1 << 16, 16, listen="tcp://127.0.0.1:0", secret=SECRET, heartbeat=1.0)
    assert w.address is not None
    with aioshmq.connect(w.address, secret=SECRET, heartbeat=1.0) as r:
        for i in range(21):  # more than the reader's local ring holds
            await w.put(i)
        await anyio.to_thread.run_sync(w.close)  # returns once the reader has all
        assert r.statistics().messages_available == 16  # the rest waits in the link
        assert await r.get() == 0
        await anyio.to_thread.run_sync(time.sleep, 2.5)  # slower than the 1 s heartbeat
        with anyio.fail_after(10):
            assert [msg async for msg in r] == list(range(1, 21))


async def test_a_reader_that_has_everything_lets_the_writer_close_cleanly() -> None:
    """Its last acknowledgement comes after the end even when it said the same before."""
    w, r = remote_pair("tcp://127.0.0.1:0")
    relay = w._relay
    with r:
        await w.put("hello")
        with anyio.fail_after(10):
            assert await r.get() == "hello"
            while w.statistics().messages_in_ring:  # until acknowledged: nothing to await
                await anyio.sleep(0.001)
        await w.aclose()
        with pytest.raises(anyio.EndOfStream):
            await r.get()
    assert relay.deaths == 0

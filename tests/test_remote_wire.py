"""What crosses the network is checked before use: hostile bytes from either side never crash."""

from __future__ import annotations

import json
import struct
import time
from typing import Any

import anyio
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

import aioshmq
from aioshmq.base.errors import CorruptedError
from aioshmq.remote import _wire as W
from aioshmq.remote._auth import Keys, secure_client, secure_server
from aioshmq.ring import format as L
from aioshmq.ring.format import record_size
from aioshmq.ring.layout import Layout

SECRET = b"test-secret-" + b"w" * 20
LAYOUT = Layout(1 << 16, 64, 1)


def _record(kind: int, payload: bytes, aux: int = 0) -> bytes:
    body = struct.pack("<QQ", (len(payload) << 8) | kind, aux) + payload
    return body + b"\0" * (record_size(len(payload)) - len(body))


def _run(
    *records: bytes, pos: int = 0, count: int = 0, messages: int | None = None
) -> tuple[bytes, bytes]:
    run = b"".join(records)
    n = len(records) if messages is None else messages
    return W.DATA + W.RUN.pack(pos, count, pos + len(run), count + n), run


def test_a_valid_run_gives_each_record_and_what_it_counts() -> None:
    full = LAYOUT.fragment_payload
    records = [
        _record(L.MSG, b"a" * 5),
        _record(L.MSG | L.BATCH, b"b" * 40, aux=3),
        _record(L.FIRST, b"c" * full, aux=full + 7),
        _record(L.LAST, b"d" * 7),
    ]
    head, run = _run(*records, pos=4096, count=10, messages=5)
    pos, count, end, end_count, view, table = W.check_run(head, memoryview(run), LAYOUT)
    assert (pos, count, end, end_count) == (4096, 10, 4096 + len(run), 15)
    sizes = [len(r) for r in records]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    assert table == [(o, s, e) for o, s, e in zip(offsets, sizes, [1, 3, 0, 1], strict=True)]
    assert bytes(view) == run


@pytest.mark.parametrize(
    "records, messages, why",
    [
        ([_record(L.PAD, b"x")], 1, "kind"),
        ([_record(0x7, b"x")], 1, "kind"),
        ([_record(L.MSG | 0x40, b"x")], 1, "kind"),
        ([_record(L.MSG, b"x")], 2, "claims"),
        ([_record(L.MSG | L.BATCH, b"x", aux=65)], 65, "ending"),
        ([_record(L.MIDDLE, b"x" * 10)], 0, "fragment"),
        ([_record(L.MSG, b"x" * (1 << 15))], 1, "ending"),  # larger than a record may be
        ([_record(L.MSG, b"x" * 40)[:32]], 1, "overruns"),  # cut short: claims 40 bytes
    ],
)
def test_a_scribbled_run_is_refused(records: list[bytes], messages: int, why: str) -> None:
    head, run = _run(*records, messages=messages)
    with pytest.raises(CorruptedError, match=why):
        W.check_run(head, memoryview(run), LAYOUT)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 1 << 20), st.integers(0, 300))
def test_random_bytes_are_refused_or_read_within_bounds(data: bytes, pos: int, extra: int) -> None:
    head = W.DATA + W.RUN.pack(pos, 5, pos + len(data) + extra % 48, 5 + extra % 7)
    try:
        _p, _c, _e, _ec, view, table = W.check_run(head, memoryview(data), LAYOUT)
    except CorruptedError:
        return
    assert sum(size for _o, size, _m in table) == len(view) == len(data)
    assert all(off + size <= len(data) for off, size, _m in table)


@pytest.mark.timeout(60)
def test_a_hostile_peer_with_the_secret_cannot_break_the_writer() -> None:
    """Garbage of every kind from an authenticated peer: refused, the writer serves on."""
    keys = Keys.from_secret(SECRET)
    with aioshmq.create(1 << 16, 64, readers=2, listen="tcp://127.0.0.1:0", secret=SECRET) as w:
        assert w.address is not None
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            secure_client(sock, keys)
            sock.connect(w.address)
            garbage = [
                b"",
                b"?",
                b"H" + b"[" * 4000,
                b"H" + b"x" * 4100,  # over MAX_JSON, under the socket's limit (over it: dropped)
                b'H{"v": 2, "reader": "0", "heartbeat": 3, "peer": "p"}',
                b'H{"v": 2, "reader": 9, "heartbeat": 3, "peer": "p"}',
                b'H{"v": 99, "reader": 0, "heartbeat": 3, "peer": "p"}',
                b'H{"v": 2, "reader": 0, "heartbeat": 1e300, "peer": "p"}',
                b"A" + W.POS.pack(1, 1),
                b"R",
                b"M{}",
            ]
            for body in garbage:
                sock.send(body)
            refusals = 0
            deadline = time.monotonic() + 20
            while refusals < 7 and time.monotonic() < deadline:
                if sock.poll(1000):
                    reply = sock.recv()
                    assert reply[:1] == W.REFUSE, reply[:80]
                    refusals += 1
            assert refusals >= 7
            # Now attach for real, then acknowledge what was never sent: the slot is given up
            # as a dead reader, never advanced past what its reader holds.
            sock.send(W.pack_json(W.HELLO, {"v": 2, "reader": 1, "heartbeat": 3, "peer": "p"}))
            while True:
                assert sock.poll(10_000)
                reply = sock.recv()
                if reply[:1] == W.WELCOME:
                    break
            sock.send(W.ACK + W.POS.pack(1 << 40, 1 << 40))
            put = 0
            with pytest.raises(aioshmq.PeerDied, match="remote reader"):
                for i in range(200):
                    w.put_sync(i, timeout=20)
                    put += 1
            w.drop_reader(1)
        finally:
            # Closed here, not in the block: a failure above would otherwise leave term()
            # waiting for the socket, and the timeout would hide the failure's own error.
            ctx.destroy(linger=0)
        with aioshmq.connect(w.address, reader=0, secret=SECRET) as r:
            w.put_sync("still serving")  # slot 0 never had a reader: it kept everything
            got = [r.get_sync(timeout=20) for _ in range(put + 1)]
            assert got == [*range(put), "still serving"]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_hostile_writer_with_the_secret_gives_peer_died_not_a_crash() -> None:
    """A scribbled data message from the writer's side: the reader stops with PeerDied
    naming the corruption, after every message that arrived whole."""
    keys = Keys.from_secret(SECRET)
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.router_handover = 1  # the reader connects again after the welcome
        secure_server(router, None if keys is None else keys)
        zap = ctx.socket(zmq.REP)
        zap.bind("inproc://zeromq.zap.01")
        router.bind("tcp://127.0.0.1:0")
        address = router.get_string(zmq.LAST_ENDPOINT)

        def serve() -> None:
            import pickle

            from aioshmq.remote._auth import zap_reply

            poller = zmq.Poller()
            poller.register(zap, zmq.POLLIN)
            poller.register(router, zmq.POLLIN)
            while True:  # a handshake, then the reader's second connection with its limits
                events = dict(poller.poll(20_000))
                assert events, "the reader went quiet"
                if zap in events:
                    zap.send_multipart(zap_reply(zap.recv_multipart(), keys))
                if router not in events:
                    continue
                rid, body = router.recv_multipart()
                if body[:1] == W.HELLO:
                    assert json.loads(body[1:])["reader"] == 0
                    welcome: dict[str, Any] = {
                        "v": 2,
                        "capacity": 1 << 16,
                        "max_messages": 64,
                        "readers": 1,
                        "serializer": "pickle",
                        "pid": 4242,
                        "host": "elsewhere",
                        "heartbeat": 3.0,
                        "start": [0, 0],
                    }
                    router.send_multipart([rid, W.pack_json(W.WELCOME, welcome)])
                elif body[:1] == W.PING:  # go ahead
                    break
            good = _record(L.MSG, pickle.dumps("whole"))
            head, run = _run(good)
            router.send_multipart([rid, head, run])
            bad = W.DATA + W.RUN.pack(len(run), 1, len(run) + 32, 2)
            router.send_multipart([rid, bad, struct.pack("<QQ", (10**9 << 8) | L.MSG, 0) * 2])

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, serve)
            r = await anyio.to_thread.run_sync(
                lambda: aioshmq.connect(address, secret=SECRET, timeout=20)
            )
        with r:
            with anyio.fail_after(20):
                assert await r.get() == "whole"
                with pytest.raises(aioshmq.PeerDied, match="corrupted") as info:
                    await r.get()
            assert info.value.pid == 4242
    finally:
        ctx.destroy(linger=0)


def test_what_arrives_twice_is_dropped_by_position() -> None:
    """After a reconnection the writer sends again from what was acknowledged: a run the
    reader already has is dropped, one that straddles what it has is cut at the record where
    it left off, and one that would not line up with it is refused."""
    from aioshmq.remote._link import _trim

    records = [_record(L.MSG, bytes([i]) * (10 + i)) for i in range(4)]
    head, run = _run(*records, pos=1000, count=50)
    end = 1000 + len(run)
    assert _trim(head, memoryview(run), LAYOUT, (end, 54)) is None
    assert _trim(head, memoryview(run), LAYOUT, (end + 64, 60)) is None
    whole = _trim(head, memoryview(run), LAYOUT, (1000, 50))
    assert whole is not None and (whole.pos, whole.count, len(whole.table)) == (1000, 50, 4)
    second = 1000 + len(records[0])
    cut = _trim(head, memoryview(run), LAYOUT, (second, 51))
    assert cut is not None and (cut.pos, cut.count, cut.end) == (second, 51, (end, 54))
    assert [off for off, _s, _m in cut.table] == [sum(map(len, records[:i])) for i in (1, 2, 3)]
    with pytest.raises(CorruptedError, match="no record at"):
        _trim(head, memoryview(run), LAYOUT, (1000 + 8, 50))

"""Connections cut at random moments, acknowledgements lost with them: every message still
arrives once, in order, and the stream never stalls for longer than two heartbeats."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest
from _chaos import ChaosProxy

import aioshmq

# The default heartbeat: one process hosts the writer, its server thread, the reader and the
# proxy, sharing one interpreter lock on a machine that may be loaded, and a heartbeat must
# be longer than the longest stall of either side (docs/remote.md).  With connections cut
# every few tenths of a second, a much shorter one takes a starved side for a dead one.
HEARTBEAT = 3.0


def _stream(*, messages: int | None, seconds: float | None, every: float, seed: int) -> Any:
    """Stream ints through a proxy that resets connections about every ``every`` s and drops
    one acknowledgement in four (with its connection), for ``messages`` messages or
    ``seconds``; returns the proxy's counts, what arrived and the longest gap between two
    arrivals."""
    w = aioshmq.create(
        1 << 16, 32, listen="tcp://127.0.0.1:0", insecure_loopback=True, heartbeat=HEARTBEAT
    )
    assert w.address is not None
    port = int(w.address.rsplit(":", 1)[1])
    got: list[int] = []
    gaps: list[float] = [0.0]
    failures: list[BaseException] = []
    with w, ChaosProxy(("127.0.0.1", port), every=every, ack_cut=0.25, seed=seed) as proxy:
        r = aioshmq.connect(proxy.address, insecure_loopback=True, heartbeat=HEARTBEAT)
        with r:

            def consume() -> None:
                last = time.monotonic()
                try:
                    while True:
                        # A stall longer than two heartbeats fails here.
                        msg = r.get_sync(timeout=2 * HEARTBEAT)
                        now = time.monotonic()
                        gaps[0] = max(gaps[0], now - last)
                        last = now
                        got.append(msg)
                except anyio.EndOfStream:
                    pass
                except BaseException as exc:
                    failures.append(exc)

            thread = threading.Thread(target=consume)
            thread.start()
            try:
                end = None if seconds is None else time.monotonic() + seconds
                n = 0
                while (messages is None or n < messages) and (
                    end is None or time.monotonic() < end
                ):
                    w.put_sync(n, timeout=2 * HEARTBEAT)
                    n += 1
                w.close()  # delivers the rest, then the end
            finally:
                thread.join(30)
    assert not thread.is_alive()
    if failures:
        raise failures[0]
    assert got == list(range(n)), f"{len(got)} of {n} arrived, not once each in order"
    return proxy, n, gaps[0]


@pytest.mark.timeout(90)
def test_connections_cut_at_random_and_after_acknowledgements_lose_and_stall_nothing() -> None:
    proxy, _n, gap = _stream(messages=6000, seconds=None, every=0.2, seed=1)
    assert proxy.cuts + proxy.acks_lost >= 5, (proxy.cuts, proxy.acks_lost)
    assert proxy.acks_lost >= 1
    assert gap < 2 * HEARTBEAT


@pytest.mark.slow  # three minutes of streaming through hundreds of cuts
@pytest.mark.timeout(400)
def test_soak_hundreds_of_cuts() -> None:
    proxy, n, gap = _stream(messages=None, seconds=180.0, every=0.3, seed=2)
    assert proxy.cuts + proxy.acks_lost >= 300, (proxy.cuts, proxy.acks_lost)
    assert proxy.acks_lost >= 50
    assert gap < 2 * HEARTBEAT
    # Not a speed floor (most of the time goes to reconnecting): enough messages that the
    # cuts fall at every moment of the protocol, between and inside runs.
    assert n > 10_000


@pytest.mark.timeout(60)
def test_a_dropped_connection_goes_on_at_once_not_at_the_next_heartbeat() -> None:
    """Once a connection is back, the writer asks the reader where it is and the stream
    goes on from there at once, even with records lost in the dropped connection or sent
    while it was down; it does not wait for either side's next heartbeat (a third of
    ``heartbeat``, 10 s here)."""
    heartbeat = 30.0
    w = aioshmq.create(
        1 << 16, 32, listen="tcp://127.0.0.1:0", insecure_loopback=True, heartbeat=heartbeat
    )
    assert w.address is not None
    port = int(w.address.rsplit(":", 1)[1])
    with w, ChaosProxy(("127.0.0.1", port)) as proxy:
        with aioshmq.connect(proxy.address, insecure_loopback=True, heartbeat=heartbeat) as r:
            w.put_sync("first")
            assert r.get_sync(timeout=10) == "first"
            for round_ in range(3):
                assert proxy.cut() == 1
                # Sent while the connection is down, or into the one being reset.
                for i in range(10):
                    w.put_sync((round_, i), timeout=10)
                got = [r.get_sync(timeout=heartbeat / 6) for _ in range(10)]
                assert got == [(round_, i) for i in range(10)]


@pytest.mark.timeout(60)
def test_the_last_acknowledgement_lost_is_said_again_at_goodbye() -> None:
    """The reader's acknowledgement of the end goes with its connection, and the reader
    closes at once: it says it again at goodbye, so the writer's close returns within a
    round trip of the reconnection, with no reader taken for dead (it waited out the
    heartbeat, 30 s here, and reported a dead reader)."""
    heartbeat = 30.0
    w = aioshmq.create(
        1 << 16, 32, listen="tcp://127.0.0.1:0", insecure_loopback=True, heartbeat=heartbeat
    )
    assert w.address is not None
    port = int(w.address.rsplit(":", 1)[1])
    relay = w._relay
    with ChaosProxy(("127.0.0.1", port), ack_cut=1.0, acks_to_lose=1) as proxy:
        r = aioshmq.connect(proxy.address, insecure_loopback=True, heartbeat=heartbeat)
        with r:
            w.put_sync("only")
            assert r.get_sync(timeout=10) == "only"
            closer = threading.Thread(target=w.close)
            closer.start()
            with pytest.raises(anyio.EndOfStream):
                r.get_sync(timeout=10)
        closer.join(heartbeat / 3)
        assert not closer.is_alive(), "the writer's close waited for the lost acknowledgement"
        assert proxy.acks_lost == 1  # it was the end's: one message acknowledges no earlier
    assert relay.deaths == 0

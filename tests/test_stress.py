"""The stress test of the original variable-length proposal: 10,000 messages of random sizes,
over 400 MB in all, to 3 reader processes through a 1 MiB ring with max_messages=64, with
random short pauses on both sides; every reader checks every byte and the order.  Then
cancellation storms.

The full runs are in the slow tier (``pytest -m slow``); the default tier runs the same tests
on a prefix of the same messages (and a shorter storm), which still has every kind of
message: small ones, fragmented ones and ones bigger than the ring."""

from __future__ import annotations

import random

import anyio
import numpy as np
import pytest
from conftest import Children, backend_name, run_backend

import aioshmq

pytestmark = pytest.mark.anyio

MESSAGES = 10_000  # the slow tier's full run
SHORT = 1_000  # the default tier's: the first SHORT of the same messages
READERS = 3
RING = 1 << 20
JOIN = 60  # seconds for the readers to finish once everything is put
SEED = 20261202


def sizes(messages: int = MESSAGES, seed: int = SEED) -> list[int]:
    """Mostly small messages, some bigger than a record (fragmented), a few of several MiB;
    fewer messages are a prefix of more."""
    rng = random.Random(seed)
    out = []
    for _ in range(messages):
        roll = rng.random()
        if roll < 0.70:
            out.append(rng.randrange(0, 4096))
        elif roll < 0.95:
            out.append(rng.randrange(4096, 200_000))
        else:
            out.append(rng.randrange(200_000, 3 << 20))
    return out


def payload(k: int, size: int) -> np.ndarray:
    """Message k's bytes: a pattern that differs at every offset and for every message."""
    return ((np.arange(size, dtype=np.uint32) * 2654435761 + k * 40503) >> 13).astype(np.uint8)


def pauses(rng: random.Random) -> float:
    return rng.choice((0.0005, 0.001, 0.002)) if rng.random() < 0.01 else 0.0


def _reader(handle: aioshmq.Handle, index: int, backend: str, messages: int) -> None:
    async def main() -> None:
        rng = random.Random(index)
        expected = sizes(messages)
        k = 0
        async with aioshmq.connect(handle, reader=index) as r:
            async for msg in r:
                seq, data = msg
                if seq != k:
                    raise SystemExit(f"reader {index}: message {seq} arrived when {k} was due")
                if data.nbytes != expected[k] or not np.array_equal(data, payload(k, data.size)):
                    raise SystemExit(f"reader {index}: message {k} damaged")
                k += 1
                if delay := pauses(rng):
                    await anyio.sleep(delay)
        if k != messages:
            raise SystemExit(f"reader {index}: stream ended after {k} messages")

    run_backend(backend, main)


async def test_stress(anyio_backend: object, children: Children) -> None:
    await _stress(backend_name(anyio_backend), "eventfd", children, SHORT, 40)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_stress_pipe_notifier(anyio_backend: object, children: Children) -> None:
    await _stress("asyncio", "pipe", children, SHORT, 40)


@pytest.mark.slow
@pytest.mark.timeout(360)
async def test_stress_full(anyio_backend: object, children: Children) -> None:
    await _stress(backend_name(anyio_backend), "eventfd", children, MESSAGES, 240)


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_stress_full_pipe_notifier(anyio_backend: object, children: Children) -> None:
    await _stress("asyncio", "pipe", children, MESSAGES, 240)


def test_short_stress_has_every_kind_of_message() -> None:
    """The default tier's prefix still has small, fragmented and bigger-than-ring messages."""
    short = sizes(SHORT)
    assert short == sizes()[:SHORT]
    assert min(short) < 4096 and any(RING // 2 < n <= RING for n in short)
    assert sum(n > RING for n in short) >= 10
    assert sum(short) > 40_000_000


async def _stress(
    backend: str, notifier: str, children: Children, messages: int, limit: float
) -> None:
    """Spawn the readers and put ``messages`` messages within ``limit`` seconds; every reader
    then exits cleanly within JOIN more: the caller's pytest timeout exceeds the sum."""
    all_sizes = sizes(messages)
    if messages == MESSAGES:
        assert sum(all_sizes) > 400_000_000
    rng = random.Random(SEED)
    async with aioshmq.create(
        capacity=RING,
        max_messages=64,
        readers=READERS,
        notifier=notifier,  # type: ignore[arg-type]
    ) as w:
        for i in range(READERS):
            await anyio.to_thread.run_sync(
                children.start, "spawn", _reader, w.handle, i, backend, messages
            )
        with anyio.fail_after(limit):
            await w.wait_readers()
            for k, size in enumerate(all_sizes):
                await w.put((k, payload(k, size)))
                if delay := pauses(rng):
                    await anyio.sleep(delay)
        stats = w.statistics()
        assert stats.messages_put == messages
    codes = await anyio.to_thread.run_sync(children.join, JOIN)
    assert codes == [0] * READERS


# -- cancellation storms ---------------------------------------------------------------------

STORM = 50_000  # the slow tier's full storm
SHORT_STORM = 5_000  # the default tier's
TIMEOUTS = (0.0, 0.00002, 0.0001, 0.0005, 0.002, None)


def _storm_reader(handle: aioshmq.Handle, index: int, backend: str, storm: int) -> None:
    async def main() -> None:
        rng = random.Random(1000 + index)
        expected = 0
        cancelled = 0
        async with aioshmq.connect(handle, reader=index) as r:
            while expected < storm:
                timeout = rng.choice(TIMEOUTS)
                got: list[int] = []
                with anyio.move_on_after(timeout if timeout is not None else 60) as scope:
                    if rng.random() < 0.5:
                        got = [await r.get()]
                    else:
                        got = await r.get_many(max_messages=rng.randint(1, 20))
                if scope.cancelled_caught:
                    cancelled += 1
                    if got:
                        raise SystemExit(f"reader {index}: a cancelled get returned {got}")
                for msg in got:
                    if msg != expected:
                        raise SystemExit(f"reader {index}: got {msg}, expected {expected}")
                    expected += 1
            with anyio.fail_after(30):
                try:
                    extra = await r.get()
                except anyio.EndOfStream:
                    pass
                else:
                    raise SystemExit(f"reader {index}: got {extra} after the last message")
        if cancelled < storm // 50:
            raise SystemExit(f"reader {index}: only {cancelled} gets were cancelled")

    run_backend(backend, main)


async def test_cancellation_storm(anyio_backend: object, children: Children) -> None:
    """Writer and readers in three processes, their puts and gets cancelled at random points
    by tiny timeouts: each reader still gets exactly the sequence put, once each."""
    await _storm(backend_name(anyio_backend), children, SHORT_STORM, 40)


@pytest.mark.slow
@pytest.mark.timeout(480)
async def test_cancellation_storm_full(anyio_backend: object, children: Children) -> None:
    """The same storm, ten times longer."""
    await _storm(backend_name(anyio_backend), children, STORM, 360)


async def _storm(backend: str, children: Children, storm: int, limit: float) -> None:
    """Spawn the readers and put ``storm`` messages within ``limit`` seconds; the readers
    then exit cleanly within JOIN more: the caller's pytest timeout exceeds the sum."""
    rng = random.Random(SEED)
    cancelled = 0
    async with aioshmq.create(capacity=4096, max_messages=8, readers=2) as w:
        for i in range(2):
            await anyio.to_thread.run_sync(
                children.start, "spawn", _storm_reader, w.handle, i, backend, storm
            )
        sent = 0
        with anyio.fail_after(limit):
            await w.wait_readers()
            while sent < storm:
                batch = list(range(sent, min(sent + rng.randint(1, 8), storm)))
                timeout = rng.choice(TIMEOUTS)
                with anyio.move_on_after(timeout if timeout is not None else 60) as scope:
                    if len(batch) == 1:
                        await w.put(batch[0])
                    else:
                        await w.put_many(batch)  # small enough to be all or nothing
                if scope.cancelled_caught:
                    cancelled += 1  # nothing was published: send the same again
                else:
                    sent += len(batch)
        assert w.statistics().messages_put == storm
        assert cancelled > storm // 50
    assert await anyio.to_thread.run_sync(children.join, JOIN) == [0, 0]

"""The stress test of the original variable-length proposal: 10,000 messages of random sizes,
over 400 MB in all, to 3 reader processes through a 1 MiB ring with max_messages=64, with
random short pauses on both sides; every reader checks every byte and the order."""

from __future__ import annotations

import random

import anyio
import numpy as np
import pytest
from conftest import Children, backend_name, run_backend

import aioshmq

pytestmark = pytest.mark.anyio

MESSAGES = 10_000
READERS = 3
SEED = 20261202


def sizes(seed: int = SEED) -> list[int]:
    """Mostly small messages, some bigger than a record (fragmented), a few of several MiB."""
    rng = random.Random(seed)
    out = []
    for _ in range(MESSAGES):
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


def _reader(handle: aioshmq.Handle, index: int, backend: str) -> None:
    async def main() -> None:
        rng = random.Random(index)
        expected = sizes()
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
        if k != MESSAGES:
            raise SystemExit(f"reader {index}: stream ended after {k} messages")

    run_backend(backend, main)


async def test_stress(anyio_backend: object, children: Children) -> None:
    await _stress(backend_name(anyio_backend), "eventfd", children)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_stress_pipe_notifier(anyio_backend: object, children: Children) -> None:
    await _stress("asyncio", "pipe", children)


async def _stress(backend: str, notifier: str, children: Children) -> None:
    all_sizes = sizes()
    assert sum(all_sizes) > 400_000_000
    rng = random.Random(SEED)
    async with aioshmq.create(
        capacity=1 << 20,
        max_messages=64,
        readers=READERS,
        notifier=notifier,  # type: ignore[arg-type]
    ) as w:
        for i in range(READERS):
            await anyio.to_thread.run_sync(children.start, "spawn", _reader, w.handle, i, backend)
        with anyio.fail_after(240):
            await w.wait_readers()
            for k, size in enumerate(all_sizes):
                await w.put((k, payload(k, size)))
                if delay := pauses(rng):
                    await anyio.sleep(delay)
        stats = w.statistics()
        assert stats.messages_put == MESSAGES
    codes = await anyio.to_thread.run_sync(children.join, 120)
    assert codes == [0] * READERS


# -- cancellation storms ---------------------------------------------------------------------

STORM = 50_000
TIMEOUTS = (0.0, 0.00002, 0.0001, 0.0005, 0.002, None)


def _storm_reader(handle: aioshmq.Handle, index: int, backend: str) -> None:
    async def main() -> None:
        rng = random.Random(1000 + index)
        expected = 0
        cancelled = 0
        async with aioshmq.connect(handle, reader=index) as r:
            while expected < STORM:
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
        if cancelled < 1000:
            raise SystemExit(f"reader {index}: only {cancelled} gets were cancelled")

    run_backend(backend, main)


async def test_cancellation_storm(anyio_backend: object, children: Children) -> None:
    """Writer and readers in three processes, their puts and gets cancelled at random points
    by tiny timeouts: each reader still gets exactly the sequence put, once each."""
    backend = backend_name(anyio_backend)
    rng = random.Random(SEED)
    cancelled = 0
    async with aioshmq.create(capacity=4096, max_messages=8, readers=2) as w:
        for i in range(2):
            await anyio.to_thread.run_sync(
                children.start, "spawn", _storm_reader, w.handle, i, backend
            )
        with anyio.fail_after(60):
            await w.wait_readers()
        sent = 0
        with anyio.fail_after(600):
            while sent < STORM:
                batch = list(range(sent, min(sent + rng.randint(1, 8), STORM)))
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
        assert w.statistics().messages_put == STORM
        assert cancelled > 1000
    assert await anyio.to_thread.run_sync(children.join, 120) == [0, 0]

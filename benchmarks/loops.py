"""The timed loops each process runs (pump, drain, ping, echo, ticker, memcpy) and the
children's entry points."""

from __future__ import annotations

import importlib
import mmap
import os
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, TypedDict

import anyio

from .peers import STOP, SYNC_TIMEOUT, AioshmqMirrorChannel, Channel, Receiver, Sender
from .procs import Link, run_backend
from .workload import Workload, pattern_array

TICK = 0.001  # the ticker's period: a task that sleeps 1 ms at a time


class ReaderReport(TypedDict):
    count: int  #: messages received before STOP, warm-up included
    t_first: float  #: time.monotonic() when the first counted message arrived
    t_last: float  #: time.monotonic() when STOP arrived (the clock is shared by processes)
    gaps: tuple[float, float] | None  #: the ticker's longest and p99 gap (ms), if it ran
    read: str  #: "get" or "lease"
    stats: dict[str, int]  #: the receiver's counters (aioshmq: wake-ups sent to the writer)


class Ticker:
    """The gaps between the wake-ups of a task that sleeps TICK at a time.

    Anything that holds the event loop without yielding shows up as a gap above TICK (and so
    does waiting for a CPU, when the machine has fewer cores than busy processes).
    """

    def __init__(self) -> None:
        self.gaps: list[float] = []

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await anyio.sleep(TICK)
            now = time.monotonic()
            self.gaps.append(now - last)
            last = now

    def summary(self) -> tuple[float, float]:
        """The longest gap and the 99th percentile, in milliseconds."""
        gaps = sorted(self.gaps) or [0.0]
        return gaps[-1] * 1000, gaps[round(0.99 * (len(gaps) - 1))] * 1000


async def idle_ticks(seconds: float) -> tuple[float, float]:
    """The ticker's gaps in a loop with nothing else to do: the floor for the lag figures."""
    ticker = Ticker()
    with anyio.move_on_after(seconds):
        await ticker.run()
    return ticker.summary()


async def pump(
    tx: Sender,
    workload: Workload,
    *,
    seconds: float,
    min_messages: int,
    batch: int | None,
    warmup: int = 0,
) -> int:
    """Send ``warmup`` messages, then more for ``seconds`` (at least ``min_messages``), then
    STOP; how many were sent in all.  Nothing starts before every receiver is attached."""
    await tx.wait_ready()
    if tx.blocking:
        return await anyio.to_thread.run_sync(
            partial(_pump_sync, tx, workload, seconds, min_messages, batch, warmup)
        )
    make, make_batch = workload.maker(), workload.make_batch
    total = warmup + max(min_messages, 1)
    deadline = float("inf")
    n = 0
    if batch:
        while n < total or time.monotonic() < deadline:
            if n >= warmup and deadline == float("inf"):
                deadline = time.monotonic() + seconds
            await tx.send_many(make_batch(n, batch))
            n += batch
    else:
        while n < total or time.monotonic() < deadline:
            if n == warmup:
                deadline = time.monotonic() + seconds
            await tx.send(make(n))
            n += 1
    await tx.send(STOP)
    return n


def _pump_sync(
    tx: Sender,
    workload: Workload,
    seconds: float,
    min_messages: int,
    batch: int | None,
    warmup: int,
) -> int:
    """``pump`` in a thread without an event loop, each call given its timeout as its own
    argument (no wrapper of the bench's around a call that takes one)."""
    make, make_batch = workload.maker(), workload.make_batch
    total = warmup + max(min_messages, 1)
    deadline = float("inf")
    n = 0
    if batch:
        send_many = tx.send_many_sync
        while n < total or time.monotonic() < deadline:
            if n >= warmup and deadline == float("inf"):
                deadline = time.monotonic() + seconds
            send_many(make_batch(n, batch), SYNC_TIMEOUT)
            n += batch
    else:
        send = tx.send_sync
        while n < total or time.monotonic() < deadline:
            if n == warmup:
                deadline = time.monotonic() + seconds
            send(make(n), SYNC_TIMEOUT)
            n += 1
    tx.send_sync(STOP, SYNC_TIMEOUT)
    return n


def _drain_sync(
    rx: Receiver, workload: Workload, batch: int | None, warmup: int
) -> tuple[int, float]:
    """``drain`` in a thread without an event loop."""
    check = workload.checker()
    n = 0
    t_first = 0.0
    if batch:
        recv_many = rx.recv_many_sync
        while True:
            n, t_first, more = _take_batch(
                workload, recv_many(batch, SYNC_TIMEOUT), n, warmup, t_first
            )
            if not more:
                return n, t_first
    recv = rx.recv_sync
    while (msg := recv(SYNC_TIMEOUT)) is not STOP:
        if n == warmup:
            t_first = time.monotonic()
        check(msg, n)
        n += 1
    return n, t_first


def _take_batch(
    workload: Workload, msgs: Sequence[Any], n: int, warmup: int, t_first: float
) -> tuple[int, float, bool]:
    """Check a batch of messages numbered from ``n``: how many have arrived in all, when message
    ``warmup`` did, and whether more are to come (no STOP yet, which only ends a batch)."""
    more = not msgs or msgs[-1] is not STOP
    if not more:
        msgs = msgs[:-1]
    if n <= warmup < n + len(msgs):
        t_first = time.monotonic()
    workload.check_batch(msgs, n)
    return n + len(msgs), t_first, more


async def drain(
    rx: Receiver, workload: Workload, batch: int | None, warmup: int
) -> tuple[int, float]:
    """Receive and check every message until STOP: how many, and when message ``warmup``
    (the first one counted) arrived."""
    if rx.blocking:
        return await anyio.to_thread.run_sync(partial(_drain_sync, rx, workload, batch, warmup))
    check = workload.checker()
    n = 0
    t_first = 0.0
    if batch:
        while True:
            n, t_first, more = _take_batch(workload, await rx.recv_many(batch), n, warmup, t_first)
            if not more:
                return n, t_first

    if rx.read == "get":  # as _drain_sync does: the check inline, no callback
        while (msg := await rx.recv()) is not STOP:
            if n == warmup:
                t_first = time.monotonic()
            check(msg, n)
            n += 1
        return n, t_first

    def take(msg: Any) -> bool:
        nonlocal n, t_first
        if msg is STOP:
            return False
        if n == warmup:
            t_first = time.monotonic()
        check(msg, n)
        n += 1
        return True

    while await rx.recv_with(take):
        pass
    return n, t_first


async def ping(
    tx: Sender,
    rx: Receiver,
    workload: Workload,
    *,
    warmup: int,
    rounds: int,
    seconds: float,
    first: int = 0,
    stop: bool = True,
) -> list[float]:
    """Round trips through an echoing peer, in microseconds (the first ``warmup`` not kept).

    Messages are numbered from ``first``; with ``stop=False`` the peer is left echoing, so
    that a later call can go on where this one ended."""
    if first == 0:
        await tx.wait_ready()
    samples: list[float] = []
    deadline = float("inf")
    clock = time.perf_counter_ns
    make = workload.maker()
    for i in range(first, first + warmup + rounds):
        if i == first + warmup:
            deadline = time.monotonic() + seconds
        msg = make(i)
        start = clock()
        await tx.send(msg)
        reply = await rx.recv()
        took = clock() - start
        if reply is STOP or (isinstance(reply, dict) and reply["seq"] != i):
            raise AssertionError(f"round trip {i} came back as {reply!r}")
        if i >= first + warmup:
            samples.append(took / 1000)
            if time.monotonic() > deadline:
                break
    if stop:
        await tx.send(STOP)
    return samples


def memcpy_gbps(nbytes: int, seconds: float) -> float:
    """The best GB/s of numpy.copyto into an mmap'd memfd of ``nbytes`` (pages faulted in)."""
    import numpy as np

    src = pattern_array(nbytes)
    fd = os.memfd_create("aioshmq-bench-memcpy", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as mm:
            dst = np.frombuffer(mm, dtype=np.uint8)
            np.copyto(dst, src)
            best = float("inf")
            rounds = 0
            deadline = time.monotonic() + seconds
            while rounds < 5 or (time.monotonic() < deadline and rounds < 10_000):
                start = time.perf_counter()
                np.copyto(dst, src)
                best = min(best, time.perf_counter() - start)
                rounds += 1
            del dst
    finally:
        os.close(fd)
    return nbytes / best / 1e9


# -- children's entry points -----------------------------------------------------------------


def reader_main(
    link: Link,
    channel: Channel,
    index: int,
    workload: Workload,
    batch: int | None,
    warmup: int,
    backend: str,
    tick: bool,
) -> ReaderReport:
    """A receiving process: open reader ``index``, say ready, drain until STOP, report."""
    # Imported before the clock runs, rather than by unpickling the first message.
    if workload.arrays:
        importlib.import_module("numpy")
    if workload.kind == "tensor":
        importlib.import_module("torch")  # seconds

    async def main() -> ReaderReport:
        rx = channel.receiver(index)
        try:
            ticker = Ticker()
            async with anyio.create_task_group() as tg:
                if tick:
                    tg.start_soon(ticker.run)
                link.ready()
                count, t_first = await drain(rx, workload, batch, warmup)
                t_last = time.monotonic()
                tg.cancel_scope.cancel()
            return ReaderReport(
                count=count,
                t_first=t_first,
                t_last=t_last,
                gaps=ticker.summary() if tick else None,
                read=rx.read,
                stats=rx.stats(),
            )
        finally:
            rx.close()

    try:
        return run_backend(backend, main)
    finally:
        channel.close()


def echo_main(link: Link, forward: Channel, back: Channel, backend: str) -> int:
    """The far side of a ping-pong: send back every message until STOP; how many there were."""

    async def main() -> int:
        rx = forward.receiver(0)
        try:
            tx = back.sender()
            try:
                link.ready()
                await tx.wait_ready()
                n = 0
                while (msg := await rx.recv()) is not STOP:
                    await tx.send(msg)
                    n += 1
                return n
            finally:
                tx.close()
        finally:
            rx.close()

    try:
        return run_backend(backend, main)
    finally:
        forward.close()
        back.close()


def where_main(link: Link) -> str:
    """Where a spawned child imports aioshmq from: the file the run's children measure."""
    return str(importlib.import_module("aioshmq").__file__)


def mirror_main(link: Link, channel: AioshmqMirrorChannel) -> int:
    """The far host's mirror: hold the writer's one remote slot and republish the stream
    into the ring the local readers attach to, until the stream ends."""
    try:
        with channel.mirror() as mirror:
            link.ready()
            mirror.run()
        return 0
    finally:
        channel.close()

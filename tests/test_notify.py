"""Wake-ups: eventfd and pipe notifiers, cross-process ping-pong, and an idle reader's sleep."""

from __future__ import annotations

import os
import select

import anyio
import pytest
from conftest import Children, backend_name, run_backend

import aioshmq
from aioshmq._notify import Notifier

pytestmark = pytest.mark.anyio

KINDS = ["eventfd", "pipe"]


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_notifier_is_level_triggered(kind: str) -> None:
    n = Notifier.create(kind)  # type: ignore[arg-type]
    try:
        assert not _readable(n.read_fd)
        n.signal()
        n.signal()
        assert _readable(n.read_fd)
        n.drain()
        assert not _readable(n.read_fd)
        n.drain()  # draining an idle notifier never blocks
    finally:
        n.close()
    assert n.fds() == []


def test_pipe_notifier_never_blocks_when_full() -> None:
    n = Notifier.create("pipe")
    try:
        for _ in range(100_000):  # far more than a pipe buffer holds
            n.signal()
        n.drain()
        assert not _readable(n.read_fd)
    finally:
        n.close()


def test_bad_notifier() -> None:
    with pytest.raises(ValueError, match="smoke-signal"):
        Notifier.create("smoke-signal")  # type: ignore[arg-type]


def _pong(name: str, kind: str, backend: str) -> None:
    async def main() -> None:
        # The reply ring exists before this process attaches to the requests: once the
        # parent sees it attached, it can connect to the replies.
        async with aioshmq.create(
            capacity=1 << 16,
            name=name + "-reply",
            notifier=kind,  # type: ignore[arg-type]
        ) as replies:
            async with aioshmq.connect(name, spin=0) as requests:  # sleep at once: every wait
                await replies.wait_readers()
                async for msg in requests:
                    await replies.put(msg)

    run_backend(backend, main)


ROUNDS = 200_000


@pytest.mark.parametrize("kind", KINDS)
async def test_no_wake_up_is_lost(anyio_backend: object, kind: str, children: Children) -> None:
    """200,000 round trips in which messages find the other process asleep, so each is a
    real wake-up; a watchdog fails the test if any single message waits over 1 s."""
    backend = backend_name(anyio_backend)
    async with aioshmq.create(capacity=1 << 16, notifier=kind) as requests:  # type: ignore[arg-type]
        await anyio.to_thread.run_sync(children.start, "spawn", _pong, requests.name, kind, backend)
        with anyio.fail_after(60):
            await requests.wait_readers()
        async with aioshmq.connect(requests.name + "-reply", spin=0) as replies:
            for i in range(ROUNDS):
                with anyio.fail_after(1):  # the watchdog
                    await requests.put(i)
                    if await replies.get() != i:
                        raise AssertionError(f"round {i}: wrong reply")
            # Requests that found the echo process asleep had to wake it: on a quiet machine
            # nearly all of them, under load fewer (the echo may still be on its way to sleep).
            assert requests.statistics().wakeups_sent >= ROUNDS // 2
    assert await anyio.to_thread.run_sync(children.join) == [0]


def _idle_reader(name: str, backend: str) -> None:
    async def main() -> None:
        async with aioshmq.connect(name) as r:
            await r.get()  # sleeps until the writer puts or closes
            async for _ in r:
                pass

    run_backend(backend, main)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_idle_reader_uses_no_cpu(anyio_backend: object, children: Children) -> None:
    """A reader awaiting an empty ring sleeps in the kernel: no spinning, no polling."""
    async with aioshmq.create(capacity=1 << 16) as w:
        proc = await anyio.to_thread.run_sync(
            children.start, "spawn", _idle_reader, w.name, backend_name(anyio_backend)
        )
        with anyio.fail_after(60):
            await w.wait_readers()  # attached: all it does from here on is await get()
        assert proc.pid is not None
        before = _cpu_seconds(proc.pid)
        await anyio.sleep(1.0)  # the measurement window, not a synchronization
        used = _cpu_seconds(proc.pid) - before
        assert used < 0.05, f"idle reader used {used:.3f} s of CPU in 1 s"
        await w.put("wake up")
    assert await anyio.to_thread.run_sync(children.join) == [0]

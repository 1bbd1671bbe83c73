"""Wake-ups: eventfd and pipe notifiers, cross-process ping-pong, and an idle reader's sleep."""

from __future__ import annotations

import os
import select

import anyio
import pytest
from conftest import Children, backend_name, run_backend

import aioshmq
from aioshmq.memory.notify import Notifier

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


ROUNDS = 200_000  # the slow tier's full run
SHORT_ROUNDS = 3_000  # the default tier's: each round is still two real wake-ups
# A lost wake-up is a hang: the sleeping side waits in the kernel with no timeout and nothing
# polls, so the round never completes.  Any finite watchdog catches that; it only has to stay
# above the worst delay a healthy round meets when the machine is busy (both processes
# descheduled behind other test runs on 2 CPUs can take over a second), so it is 10 s.
WATCHDOG = 10.0


async def _ping_pong(anyio_backend: object, kind: str, children: Children, rounds: int) -> None:
    backend = backend_name(anyio_backend)
    async with aioshmq.create(capacity=1 << 16, notifier=kind) as requests:  # type: ignore[arg-type]
        await anyio.to_thread.run_sync(children.start, "spawn", _pong, requests.name, kind, backend)
        with anyio.fail_after(60):
            await requests.wait_readers()
        async with aioshmq.connect(requests.name + "-reply", spin=0) as replies:
            for i in range(rounds):
                with anyio.fail_after(WATCHDOG):
                    await requests.put(i)
                    if await replies.get() != i:
                        raise AssertionError(f"round {i}: wrong reply")
            # Requests that found the echo process asleep had to wake it: on a quiet machine
            # nearly all of them, under load fewer (the echo may still be on its way to sleep).
            assert requests.statistics().wakeups_sent >= rounds // 2
    assert await anyio.to_thread.run_sync(children.join) == [0]


@pytest.mark.parametrize("kind", KINDS)
async def test_no_wake_up_is_lost(anyio_backend: object, kind: str, children: Children) -> None:
    """3,000 round trips (spawned echo process) in which messages find the other process
    asleep, so each is a real wake-up both ways; a lost one hangs its round, and the
    watchdog (WATCHDOG: 10 s, far above any healthy round on a loaded machine) fails it.
    The slow tier runs the same for 200,000 rounds."""
    await _ping_pong(anyio_backend, kind, children, SHORT_ROUNDS)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", KINDS)
async def test_no_wake_up_is_lost_in_200_000_rounds(
    anyio_backend: object, kind: str, children: Children
) -> None:
    """200,000 round trips (spawned echo process) in which messages find the other process
    asleep, so each is a real wake-up both ways: about 30 s a parameter on a quiet 2-CPU
    machine, a few times that under load.

    A lost wake-up is a hang, not a slow round: the side left asleep waits in the kernel with
    no timeout and nothing polls, so its round never completes.  The per-round watchdog
    therefore only needs to exceed the worst delay of a healthy round, which on a loaded
    machine (both processes descheduled behind other work) can exceed 1 s; at WATCHDOG = 10 s
    it never fires on a healthy round and still ends a hung one long before the test's own
    900 s timeout."""
    await _ping_pong(anyio_backend, kind, children, ROUNDS)


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

"""The cost of aioshmq's own sleep and wake-up path, without another process's noise.

    python -m benchmarks.tools.wake_cycle [--uvloop] [--rounds 20000]

Two tasks on one event loop ping-pong the bench's 100-byte dict over two rings whose
readers never spin: every message puts a reader to sleep and wakes it through its eventfd
and the loop, so a round trip is two puts, two gets, two sleeps and two wake-ups, all on
one CPU.  What ``benchmarks.tools.latency_pair`` shows across processes, this shows with the
other process's scheduling (and the VM's) left out: the figure moves only with our code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import anyio

import aioshmq
from benchmarks.workload import small_object


async def _cycle(rounds: int) -> list[float]:
    with (
        aioshmq.create(1 << 20) as out,
        aioshmq.create(1 << 20) as back,
        aioshmq.connect(out.name, spin=0) as forward,
        aioshmq.connect(back.name, spin=0) as returned,
    ):

        async def echo() -> None:
            while (msg := await forward.get()) is not None:
                await back.put(msg)

        figures = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(echo)
            msg = small_object(0)
            for _ in range(3):  # the first is a warm-up
                start = time.perf_counter()
                for _ in range(rounds):
                    await out.put(msg)
                    await returned.get()
                figures.append((time.perf_counter() - start) / rounds * 1e6)
            await out.put(None)
    return figures[1:]


class _Bell:
    """A bare eventfd kept registered with the loop: a ring the far side rings, awaited."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.loop = asyncio.get_running_loop()
        self.waiter: asyncio.Future[None] | None = None
        self.loop.add_reader(self.fd, self._on_readable)

    def _on_readable(self) -> None:
        os.eventfd_read(self.fd)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def ring(self) -> None:
        os.eventfd_write(self.fd, 1)

    async def wait(self) -> None:
        self.waiter = self.loop.create_future()
        await self.waiter

    def close(self) -> None:
        self.loop.remove_reader(self.fd)
        os.close(self.fd)


async def _floor(rounds: int) -> list[float]:
    """The same ping-pong with no transport: each side awaits its own eventfd."""
    out, back = _Bell(), _Bell()
    stop = False

    async def echo() -> None:
        while True:
            await out.wait()
            if stop:
                return
            back.ring()

    figures = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(echo)
        await anyio.sleep(0)  # the echo waits now
        for _ in range(3):  # the first is a warm-up
            start = time.perf_counter()
            for _ in range(rounds):
                waiting = back.wait()
                out.ring()
                await waiting
            figures.append((time.perf_counter() - start) / rounds * 1e6)
        stop = True
        out.ring()
    out.close()
    back.close()
    return figures[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--rounds", type=int, default=20000)
    args = parser.parse_args()
    figures = anyio.run(
        _cycle, args.rounds, backend="asyncio", backend_options={"use_uvloop": args.uvloop}
    )
    floor = anyio.run(
        _floor, args.rounds, backend="asyncio", backend_options={"use_uvloop": args.uvloop}
    )
    loop = "uvloop" if args.uvloop else "asyncio"
    print(f"{loop}: " + ", ".join(f"{f:.2f}" for f in figures) + " us a round trip")
    print(f"{loop}, bare eventfds: " + ", ".join(f"{f:.2f}" for f in floor) + " us a round trip")


if __name__ == "__main__":
    main()

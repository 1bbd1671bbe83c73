"""Where a sleeping-peer round trip goes: aioshmq against a bare eventfd ping-pong.

    python tools/latency_pair.py [--uvloop] [--rounds 3000]

Runs, one after the other on the same loop kind, a bare eventfd ping-pong between two
processes (``anyio.wait_readable``, no payload: the bench's floor) and an aioshmq ping-pong
of the bench's 100-byte dict over two rings whose readers never spin (every message a
sleep and a wake-up).  Prints each one's p50 round trip and the pinging process's CPU time
per round trip (``time.process_time()``, kernel time included): the difference is what
aioshmq's own work costs per round trip.  Under ``strace -c -f`` it also shows the syscalls.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from typing import Any

import anyio

import aioshmq
from aioshmq._bench._workload import small_object

WARMUP = 300


def _run(fn: Any, *args: Any, uvloop: bool) -> Any:
    return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": uvloop})


def _floor_echo(a: int, b: int, uvloop: bool) -> None:
    async def main() -> None:
        while True:
            await anyio.wait_readable(a)
            value = os.eventfd_read(a)
            os.eventfd_write(b, 1)
            if value > 1:
                return

    _run(main, uvloop=uvloop)


async def _floor(a: int, b: int, rounds: int) -> tuple[list[float], float]:
    samples = []
    cpu = time.process_time()
    for _ in range(rounds):
        start = time.perf_counter()
        os.eventfd_write(a, 1)
        await anyio.wait_readable(b)
        os.eventfd_read(b)
        samples.append(time.perf_counter() - start)
    return samples, time.process_time() - cpu


def _aioshmq_echo(forward: str, back: str, uvloop: bool) -> None:
    async def main() -> None:
        with aioshmq.connect(forward, spin=0) as r, aioshmq.create(1 << 20, name=back) as w:
            while (msg := await r.get()) is not None:
                await w.put(msg)
            await w.put(None)
            await w.wait_readers()

    _run(main, uvloop=uvloop)


async def _aioshmq(forward: str, back: str, rounds: int) -> tuple[list[float], float]:
    with aioshmq.create(1 << 20, name=forward) as w:
        while True:
            try:
                r = aioshmq.connect(back, spin=0)
                break
            except FileNotFoundError:
                await anyio.sleep(0.01)  # the echo process has not made its ring yet
        with r:
            samples = []
            cpu = time.process_time()
            for i in range(rounds):
                msg = small_object(i)
                start = time.perf_counter()
                await w.put(msg)
                if (await r.get())["seq"] != i:
                    raise AssertionError("echo out of order")
                samples.append(time.perf_counter() - start)
            cpu = time.process_time() - cpu
            await w.put(None)
            assert await r.get() is None
    return samples, cpu


def _report(name: str, samples: list[float], cpu: float, rounds: int) -> float:
    p50 = statistics.median(samples[WARMUP:]) * 1e6
    print(f"{name:8s} p50 {p50:6.1f} us   pinging process CPU {cpu / rounds * 1e6:5.1f} us/trip")
    return p50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")

    a = os.eventfd(0, os.EFD_NONBLOCK)
    b = os.eventfd(0, os.EFD_NONBLOCK)
    # Forked, before any event loop runs here: the child inherits the two eventfds.
    echo = multiprocessing.get_context("fork").Process(target=_floor_echo, args=(a, b, args.uvloop))
    echo.start()
    samples, cpu = _run(_floor, a, b, args.rounds, uvloop=args.uvloop)
    os.eventfd_write(a, 5)
    echo.join(10)
    floor = _report("eventfd", samples, cpu, args.rounds)

    name = f"latency-pair-{os.getpid()}"
    echo = ctx.Process(target=_aioshmq_echo, args=(name, name + "-back", args.uvloop))
    echo.start()
    try:
        samples, cpu = _run(_aioshmq, name, name + "-back", args.rounds, uvloop=args.uvloop)
    finally:
        echo.join(10)
        if echo.is_alive():
            echo.kill()
    ours = _report("aioshmq", samples, cpu, args.rounds)
    print(f"ratio {ours / floor:.2f}x on {'uvloop' if args.uvloop else 'asyncio'}")


if __name__ == "__main__":
    main()

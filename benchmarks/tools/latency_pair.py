"""Where a sleeping-peer round trip goes: aioshmq against a bare eventfd ping-pong.

    python -m benchmarks.tools.latency_pair [--uvloop] [--rounds 3000] [--warmup 300]
        [--unpinned] [--only KIND] [--start-method spawn]

Runs, one after the other on the same loop kind, two bare eventfd ping-pongs between two
processes with no payload (``anyio.wait_readable``, which registers the fd at every wait,
and "kept": the fd registered once, a callback completing a future, as the bench's floor
and aioshmq's own sleep do), then an aioshmq ping-pong of the bench's 100-byte dict over
two rings whose readers never spin (every message a sleep and a wake-up).  Each echo runs
on the last CPU and this process on the first, unless ``--unpinned``: left to the
scheduler, one pair may share a CPU (a wake-up is then a context switch) while the other
does not (a wake-up then wakes a halted vCPU), which moves a ratio by a factor of two.
Prints each one's p50 round trip and the pinging process's CPU time per round trip (user
and kernel, from ``os.times()``): the difference is what aioshmq's own work costs per
round trip.  Under ``strace -c -f`` it also shows the syscalls.  The eventfd echoes are
forked (they inherit the two eventfds); aioshmq's is started with ``--start-method``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time
from typing import Any

import anyio

import aioshmq
from benchmarks.workload import small_object


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


async def _floor(a: int, b: int, rounds: int) -> tuple[list[float], os.times_result]:
    samples = []
    cpu = os.times()
    for _ in range(rounds):
        start = time.perf_counter()
        os.eventfd_write(a, 1)
        await anyio.wait_readable(b)
        os.eventfd_read(b)
        samples.append(time.perf_counter() - start)
    return samples, _since(cpu)


def _kept_echo(a: int, b: int, uvloop: bool) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_readable() -> None:
            if os.eventfd_read(a) > 1:
                done.set_result(None)
            else:
                os.eventfd_write(b, 1)

        loop.add_reader(a, on_readable)
        await done
        loop.remove_reader(a)

    _run(main, uvloop=uvloop)


async def _kept(a: int, b: int, rounds: int) -> tuple[list[float], os.times_result]:
    """The floor with the fd registered once: a callback completes a future per wake-up,
    as aioshmq's own sleep does."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        os.eventfd_read(b)
        if not waiter.done():
            waiter.set_result(None)

    loop.add_reader(b, on_readable)
    samples = []
    cpu = os.times()
    for _ in range(rounds):
        waiter = loop.create_future()
        start = time.perf_counter()
        os.eventfd_write(a, 1)
        await waiter
        samples.append(time.perf_counter() - start)
    cpu = _since(cpu)
    loop.remove_reader(b)
    return samples, cpu


def _since(start: os.times_result) -> os.times_result:
    now = os.times()
    return os.times_result(tuple(x - y for x, y in zip(now, start, strict=True)))


def _aioshmq_echo(forward: str, back: str, uvloop: bool) -> None:
    async def main() -> None:
        with aioshmq.connect(forward, spin=0) as r, aioshmq.create(1 << 20, name=back) as w:
            while (msg := await r.get()) is not None:
                await w.put(msg)
            await w.put(None)
            await w.wait_readers()

    _run(main, uvloop=uvloop)


async def _aioshmq(forward: str, back: str, rounds: int) -> tuple[list[float], os.times_result]:
    with aioshmq.create(1 << 20, name=forward) as w:
        while True:
            try:
                r = aioshmq.connect(back, spin=0)
                break
            except FileNotFoundError:
                await anyio.sleep(0.01)  # the echo process has not made its ring yet
        with r:
            samples = []
            cpu = os.times()
            for i in range(rounds):
                msg = small_object(i)
                start = time.perf_counter()
                await w.put(msg)
                if (await r.get())["seq"] != i:
                    raise AssertionError("echo out of order")
                samples.append(time.perf_counter() - start)
            cpu = _since(cpu)
            await w.put(None)
            assert await r.get() is None
    return samples, cpu


def _report(name: str, samples: list[float], cpu: os.times_result, args: Any) -> float:
    rounds = args.rounds
    p50 = statistics.median(samples[args.warmup :]) * 1e6
    user, system = cpu.user / rounds * 1e6, cpu.system / rounds * 1e6
    print(
        f"{name:8s} p50 {p50:6.1f} us   pinging process CPU {user + system:5.1f} us/trip"
        f" (user {user:5.1f}, kernel {system:5.1f})"
    )
    return p50


def _start(echo: multiprocessing.process.BaseProcess, args: argparse.Namespace) -> None:
    """Start the echo; unless ``--unpinned``, it on the last CPU and this process on the
    first (left to the scheduler, one pair may share a CPU while the other does not)."""
    if not args.unpinned:
        os.sched_setaffinity(0, {args.cpus[-1]})
    try:
        echo.start()
    finally:
        os.sched_setaffinity(0, {args.cpus[0]} if not args.unpinned else args.cpus)


def _eventfd_pair(name: str, echo_fn: Any, ping_fn: Any, args: argparse.Namespace) -> float:
    a = os.eventfd(0, os.EFD_NONBLOCK)
    b = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        # Forked, before any event loop runs here: the child inherits the two eventfds.
        ctx = multiprocessing.get_context("fork")
        echo = ctx.Process(target=echo_fn, args=(a, b, args.uvloop))
        _start(echo, args)
        samples, cpu = _run(ping_fn, a, b, args.rounds, uvloop=args.uvloop)
        os.eventfd_write(a, 5)
        echo.join(10)
    finally:
        os.close(a)
        os.close(b)
    return _report(name, samples, cpu, args)


def _aioshmq_pair(args: argparse.Namespace) -> float:
    name = f"latency-pair-{os.getpid()}"
    context: Any = multiprocessing.get_context(args.start_method)
    echo = context.Process(target=_aioshmq_echo, args=(name, name + "-back", args.uvloop))
    _start(echo, args)
    try:
        samples, cpu = _run(_aioshmq, name, name + "-back", args.rounds, uvloop=args.uvloop)
    finally:
        echo.join(10)
        if echo.is_alive():
            echo.kill()
    return _report("aioshmq", samples, cpu, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--rounds", type=int, default=3000, help="round trips per ping-pong")
    parser.add_argument("--warmup", type=int, default=300, help="first round trips not counted")
    parser.add_argument("--start-method", default="spawn", choices=("spawn", "forkserver", "fork"))
    parser.add_argument("--unpinned", action="store_true", help="leave placement to the scheduler")
    parser.add_argument(
        "--only", choices=["eventfd", "kept", "aioshmq"], help="run one ping-pong (for perf)"
    )
    args = parser.parse_args()
    if not 0 <= args.warmup < args.rounds:
        parser.error("--warmup must be below --rounds")
    args.cpus = sorted(os.sched_getaffinity(0))
    p50 = {}
    if args.only in (None, "eventfd"):
        p50["eventfd"] = _eventfd_pair("eventfd", _floor_echo, _floor, args)
    if args.only in (None, "kept"):
        p50["kept"] = _eventfd_pair("kept", _kept_echo, _kept, args)
    if args.only in (None, "aioshmq"):
        p50["aioshmq"] = _aioshmq_pair(args)
    if args.only is None:
        loop = "uvloop" if args.uvloop else "asyncio"
        print(
            f"ratio {p50['aioshmq'] / p50['eventfd']:.2f}x the eventfd floor,"
            f" {p50['aioshmq'] / p50['kept']:.2f}x the kept-registered one, on {loop}"
        )


if __name__ == "__main__":
    main()

"""Where a broadcast of small objects spends its CPU: the writer's and each reader's share.

    python -m benchmarks.tools.broadcast_cpu [--readers 1 4] [--seconds 2] [--rounds 2]
        [--warmup 20000] [--start-method spawn]

Streams the bench's 100-byte dict with ``put`` from this process to N reader processes
(spawned unless told otherwise; ``async for``, asyncio, the default spin), as
``python -m benchmarks --only broadcast`` does, and measures over the same window, after a
warm-up: messages a second, and the CPU time per message of the writer and of every reader
(``time.process_time()``, kernel time included).

With W and R the writer's and a reader's CPU per message, a stream on C CPUs moves at most
min(1 / W, 1 / R, C / (W + N R)) messages a second: with one reader on two CPUs,
1 / max(W, R); with four, 2 / (W + 4 R).  The script prints that bound next to the measured rate
and the ratio it implies for N readers against one, so a broadcast figure can be read as
"the CPUs are full" (the two agree, and W and R stay as they were with one reader) or as
"something else costs" (a reader's R grows with N, or the CPUs are not full).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from typing import Any

import anyio

import aioshmq
from benchmarks.workload import small_object

TIMEOUT = 120.0  #: s: the longest a reader's report may take


def _reader(handle: aioshmq.Handle, index: int, warmup: int, out: Any) -> None:
    async def main() -> tuple[int, float, float]:
        with aioshmq.connect(handle, reader=index) as reader:
            n, cpu, start = 0, 0.0, 0.0
            async for msg in reader:
                if msg is None:
                    break
                if n == warmup:
                    cpu, start = time.process_time(), time.monotonic()
                if msg["seq"] != n:
                    raise AssertionError(f"reader {index}: message {n} arrived as {msg['seq']}")
                n += 1
            return n - warmup, time.process_time() - cpu, time.monotonic() - start

    out.put((index, *anyio.run(main)))


async def _stream(
    readers: int, seconds: float, warmup: int, method: str
) -> tuple[float, float, list[float], float]:
    """Messages a second, the writer's and each reader's CPU s per message, and the CPUs the
    processes used in all over the window."""
    ctx: Any = multiprocessing.get_context(method)
    out = ctx.Queue()
    with aioshmq.create(readers=readers) as writer:
        procs = [
            ctx.Process(target=_reader, args=(writer.handle, i, warmup, out))
            for i in range(readers)
        ]
        for proc in procs:
            proc.start()
        try:
            await writer.wait_readers()
            n = 0
            while n < warmup:
                await writer.put(small_object(n))
                n += 1
            cpu, start = time.process_time(), time.monotonic()
            deadline = start + seconds
            while time.monotonic() < deadline:
                for _ in range(100):  # the clock read every 100 messages, not in W
                    await writer.put(small_object(n))
                    n += 1
            writer_cpu = time.process_time() - cpu
            await writer.put(None)
            reports: list[tuple[int, int, float, float]] = []
            for _ in procs:
                reports.append(await anyio.to_thread.run_sync(out.get, True, TIMEOUT))
            reports.sort()
        finally:
            for proc in procs:
                proc.join(TIMEOUT)
                if proc.exitcode is None:
                    proc.kill()
    counted = n - warmup
    for index, got, _, _ in reports:
        if got != counted:
            raise AssertionError(f"reader {index} counted {got} of {counted} messages")
    elapsed = max(report[3] for report in reports)
    used = (writer_cpu + sum(report[2] for report in reports)) / elapsed
    return counted / elapsed, writer_cpu / counted, [r[2] / counted for r in reports], used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seconds", type=float, default=2.0, help="the window of one stream")
    parser.add_argument("--rounds", type=int, default=2, help="times the list of N is run")
    parser.add_argument("--warmup", type=int, default=20_000, help="messages before the window")
    parser.add_argument("--start-method", default="spawn", choices=("spawn", "forkserver", "fork"))
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print(f"core: {aioshmq.CORE}; {cpus} CPUs; the bench's 100-byte dict, put / async for")
    one: float | None = None
    for _ in range(args.rounds):
        for readers in args.readers:
            rate, w, rs, used = anyio.run(
                _stream, readers, args.seconds, args.warmup, args.start_method
            )
            r = sum(rs) / len(rs)
            bound = min(1 / w, 1 / r, cpus / (w + readers * r))
            if readers == 1:
                one = rate
            shown = ", ".join(f"{x * 1e9:.0f}" for x in rs)
            ratio = f", {rate / one:.1%} of the last 1-reader run" if one and readers > 1 else ""
            print(
                f"{readers} reader{'s' if readers > 1 else ' '}: {rate / 1e3:6.1f}k msg/s "
                f"(CPU bound {bound / 1e3:6.1f}k{ratio}); CPU per message: writer "
                f"{w * 1e9:.0f} ns, readers {shown} ns; CPUs busy {used:.2f} of {cpus}",
                flush=True,
            )


if __name__ == "__main__":
    main()

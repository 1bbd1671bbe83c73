"""An idle reader costs nothing: it sleeps in the kernel until the writer puts something.

Starts one reader process per backend, lets it await an empty ring for a few seconds, and
prints the CPU time it used (from /proc/<pid>/stat), then wakes it with one message.

    python examples/idle_reader.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

import anyio

import aioshmq


def reader(name: str, backend: str) -> None:
    async def main() -> None:
        async with aioshmq.connect(name) as r:
            async for msg in r:
                print(f"  {backend} reader woke up with {msg!r}")

    options = {"use_uvloop": True} if backend == "uvloop" else {}
    anyio.run(main, backend="trio" if backend == "trio" else "asyncio", backend_options=options)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    for backend in ("asyncio", "uvloop", "trio"):
        with aioshmq.create(capacity=1 << 20) as w:
            proc = ctx.Process(target=reader, args=(w.name, backend))
            proc.start()
            assert proc.pid is not None
            w.wait_readers_sync(timeout=60)
            start_cpu, start = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(args.seconds)
            used, elapsed = cpu_seconds(proc.pid) - start_cpu, time.monotonic() - start
            print(
                f"{backend}: idle reader used {used:.3f} s of CPU in {elapsed:.1f} s "
                f"({used / elapsed * 100:.2f}% of a core)"
            )
            w.put_sync("hello")
        proc.join(30)


if __name__ == "__main__":
    main()

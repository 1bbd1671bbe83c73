"""Where a large payload's time goes on each side of a ring, next to the bare copy.

    python -m benchmarks.tools.large_stream [--sizes KIB ...] [--seconds S]
        [--start-method spawn]

For each size, streams one numpy array again and again with ``put`` to a reader in another
process (spawned unless told otherwise), which reads each one in a ``lease()`` and looks at
its last byte, as the bench's large rows do, through a ring of four payloads.  It prints the
rate, the writer's microseconds inside ``put`` and the reader's after it enters each lease,
and how often the payload lay at each place in the ring (the leased array's address, ranked:
the writer goes back to the start of the ring once the reader is done with it, so a stream
that keeps up cycles through few places).  Then, in this process alone, it times
``numpy.copyto`` of the same array into one, two and four slots of shared memory in turn,
next to the bench's memcpy floor (an in-cache copy, the large rows' 100%).  Where ``put``
takes what the copy into as many slots as it used takes, the row is bound by the copy, not
by the queue.  Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import time
from collections import Counter
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

import aioshmq
from benchmarks.loops import memcpy_gbps
from benchmarks.workload import pattern_array

WARMUP = 50  #: payloads sent before the clock starts
TIMEOUT = 60.0  #: seconds for the reader to start, and to report at the end


def _reader(handle: aioshmq.Handle, results: Any) -> None:
    """Lease every message until None; send back how many, the microseconds after entry, and
    how many payloads lay at each address of the ring."""

    async def main() -> None:
        async with aioshmq.connect(handle) as reader:
            count, busy, clock = 0, 0.0, time.perf_counter
            places: Counter[int] = Counter()
            while True:
                async with reader.lease() as msg:
                    start = clock()
                    if msg is None:
                        break
                    int(msg[len(msg) - 1])
                    if count >= WARMUP:
                        places[msg.__array_interface__["data"][0]] += 1
                    count += 1
                busy += clock() - start
            results.put((count - WARMUP, busy / max(count, 1) * 1e6, dict(places)))

    anyio.run(main)


async def _stream(
    nbytes: int, seconds: float, method: str
) -> tuple[float, float, float, list[int]]:
    """GB/s through a ring of four payloads, the writer's us inside put, the reader's us, and
    how many payloads the reader found at each place in the ring (by address, lowest first)."""
    context: Any = multiprocessing.get_context(method)
    results = context.Queue()
    async with aioshmq.create(capacity=4 * nbytes) as writer:
        child = context.Process(target=_reader, args=(writer.handle, results))
        child.start()
        try:
            with anyio.fail_after(TIMEOUT):
                await writer.wait_readers()
            array = pattern_array(nbytes)
            for _ in range(WARMUP):
                await writer.put(array)
            sent, inside, clock = 0, 0.0, time.perf_counter
            begin = clock()
            while sent == 0 or clock() - begin < seconds:
                start = clock()
                await writer.put(array)
                inside += clock() - start
                sent += 1
            elapsed = clock() - begin
            await writer.put(None)
            got, reader_us, places = await anyio.to_thread.run_sync(results.get, True, TIMEOUT)
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
    if got != sent:
        raise AssertionError(f"the reader leased {got} of {sent} payloads")
    counts = [places[address] for address in sorted(places)]
    return nbytes * sent / elapsed / 1e9, inside / sent * 1e6, reader_us, counts


def _copy_us(nbytes: int, slots: int, count: int = 1000) -> float:
    """Microseconds of numpy.copyto of the payload into ``slots`` slots of a memfd in turn."""
    fd = os.memfd_create("aioshmq-large-stream", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, slots * nbytes)
        with mmap.mmap(fd, slots * nbytes) as mm:
            data: Any = np.frombuffer(mm, np.uint8)
            data[:] = 0  # every page faulted in before anything is timed
            src = pattern_array(nbytes)
            best = float("inf")
            for _ in range(5):
                begin = time.perf_counter()
                for i in range(count):
                    start = i % slots * nbytes
                    np.copyto(data[start : start + nbytes], src)
                best = min(best, time.perf_counter() - begin)
            del data
    finally:
        os.close(fd)
    return best / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], metavar="KIB")
    parser.add_argument("--seconds", type=float, default=2.0, help="streaming time per size")
    parser.add_argument("--start-method", default="spawn", choices=("spawn", "forkserver", "fork"))
    args = parser.parse_args()
    for kib in args.sizes:
        nbytes = kib * 1024
        gbps, put_us, reader_us, places = anyio.run(
            _stream, nbytes, args.seconds, args.start_method
        )
        sent = sum(places)
        where = ", ".join(f"{q}: {100 * n / sent:.0f}%" for q, n in enumerate(places))
        cycling = ", ".join(f"{n} {_copy_us(nbytes, n):.1f}" for n in (1, 2, 4))
        floor = memcpy_gbps(nbytes, 1.0)
        print(
            f"{kib} KiB: {gbps:.1f} GB/s through a ring of 4 payloads ({100 * gbps / floor:.0f}% "
            f"of memcpy), {put_us:.1f} us inside put, the reader {reader_us:.1f} us after "
            f"entering a lease; payloads at each place in the ring {{{where}}}; "
            f"numpy.copyto into 1, 2 and 4 slots in turn (us): {cycling}; the memcpy floor "
            f"{floor:.1f} GB/s = {nbytes / floor / 1e3:.1f} us"
        )


if __name__ == "__main__":
    main()

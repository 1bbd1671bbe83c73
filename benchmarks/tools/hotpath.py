"""The per-message cost of put and get in one process, and of their parts.

    python tools/hotpath.py

Puts 100,000 of the bench's 100-byte dicts into a ring, then gets them all, twice; prints
microseconds per put and per get as bare ``pickle.dumps`` (``pickle.loads``) plus the rest
(issue 11's target: the rest at most 1 us), nanoseconds for parts of the hot paths, and the
same for ``put_sync`` and ``get_sync``.  ``AIOSHMQ_PURE=1`` measures the pure core.  In one
process nothing waits, so this is the cost that bounds small-object throughput across
processes (benchmarks.md).
"""

from __future__ import annotations

import pickle
import time
import timeit
from collections.abc import Callable
from typing import Any

import anyio

import aioshmq
from benchmarks.workload import small_object

N = 100_000


def _ns(fn: Callable[[], Any], number: int = N) -> float:
    return timeit.timeit(fn, number=number) / number * 1e9


async def main() -> None:
    objs = [small_object(i) for i in range(N)]
    data = pickle.dumps(objs[0], protocol=5)
    with aioshmq.create(256 << 20, 1 << 24, 1) as w, aioshmq.connect(w.name) as r:
        for _ in range(2):
            start = time.perf_counter()
            for obj in objs:
                await w.put(obj)
            put = (time.perf_counter() - start) / N
            start = time.perf_counter()
            for _obj in objs:
                await r.get()
            get = (time.perf_counter() - start) / N
            dumps = _ns(lambda: pickle.dumps(objs[0], protocol=5)) / 1e3
            loads = _ns(lambda: pickle.loads(data)) / 1e3
            print(
                f"put {put * 1e6:.2f} us = pickle.dumps {dumps:.2f} + {put * 1e6 - dumps:.2f}   "
                f"get {get * 1e6:.2f} us = pickle.loads {loads:.2f} + {get * 1e6 - loads:.2f}"
            )
        main_bytes, _ = w._ser.dumps(objs[0])
        print(f"core: {aioshmq.CORE}")
        print(f"serializer dumps {_ns(lambda: w._ser.dumps(objs[0])):.0f} ns")
        print(f"ring put_plain + publish {_ns(lambda: w._ring.put_plain(main_bytes)):.0f} ns")
        print(f"reader publish {_ns(r._ring.publish):.0f} ns")
        print(f"fence {_ns(aioshmq._atomics.fence):.0f} ns")


def blocking() -> None:
    """put_sync and get_sync, outside any event loop."""
    objs = [small_object(i) for i in range(N)]
    with aioshmq.create(256 << 20, 1 << 24, 1) as w, aioshmq.connect(w.name) as r:
        for _ in range(2):
            start = time.perf_counter()
            for obj in objs:
                w.put_sync(obj)
            put = (time.perf_counter() - start) / N
            start = time.perf_counter()
            for _obj in objs:
                r.get_sync()
            get = (time.perf_counter() - start) / N
            print(f"put_sync {put * 1e6:.2f} us   get_sync {get * 1e6:.2f} us")


if __name__ == "__main__":
    anyio.run(main)
    blocking()

"""The per-message cost of put and get in one process, next to bare pickle.

    python -m benchmarks.tools.hotpath [--count 100000]

Puts ``--count`` of the bench's 100-byte dicts into a ring, then gets them all, twice, and
prints microseconds per put and per get as bare ``pickle.dumps`` (``pickle.loads``) plus the
rest: what the library adds to the pickle (negative where the compiled core pickles the
plain values itself, faster than ``pickle.dumps``).  Then the same for ``put_nowait``/``get_nowait``
(no await), ``put_sync``/``get_sync`` (no event loop) and ``put_many``/``get_many`` in
batches of 64 (per message).  ``AIOSHMQ_PURE=1`` measures the pure core.  In one process
nothing waits, so this is the cost that bounds small-object throughput across processes.
"""

from __future__ import annotations

import argparse
import pickle
import time
import timeit
from collections.abc import Callable
from typing import Any

import anyio

import aioshmq
from benchmarks.workload import small_object

BATCH = 64


def _us(fn: Callable[[], Any], number: int) -> float:
    return timeit.timeit(fn, number=number) / number * 1e6


def _ring(count: int) -> tuple[aioshmq.Writer[Any], aioshmq.Reader[Any]]:
    """A ring that holds ``count`` of the objects at once, and its one reader."""
    writer = aioshmq.create(max(1 << 20, 256 * count), max(1024, 2 * count), 1)
    return writer, aioshmq.connect(writer.name)


async def _awaited(objs: list[Any], number: int) -> None:
    data = pickle.dumps(objs[0], protocol=5)
    dumps = _us(lambda: pickle.dumps(objs[0], protocol=5), number)
    loads = _us(lambda: pickle.loads(data), number)
    w, r = _ring(len(objs))
    with w, r:
        for _ in range(2):
            start = time.perf_counter()
            for obj in objs:
                await w.put(obj)
            put = (time.perf_counter() - start) / len(objs) * 1e6
            start = time.perf_counter()
            for _obj in objs:
                await r.get()
            get = (time.perf_counter() - start) / len(objs) * 1e6
            print(
                f"put {put:.2f} us = pickle.dumps {dumps:.2f} + {put - dumps:.2f}   "
                f"get {get:.2f} us = pickle.loads {loads:.2f} + {get - loads:.2f}",
                flush=True,
            )
        for _ in range(2):
            batches = [objs[i : i + BATCH] for i in range(0, len(objs), BATCH)]
            start = time.perf_counter()
            for batch in batches:
                await w.put_many(batch)
            put = (time.perf_counter() - start) / len(objs) * 1e6
            start = time.perf_counter()
            got = 0
            while got < len(objs):
                got += len(await r.get_many(BATCH))
            get = (time.perf_counter() - start) / len(objs) * 1e6
            print(f"put_many {put:.2f} us   get_many {get:.2f} us   (a message, in {BATCH}s)")


def _unawaited(objs: list[Any]) -> None:
    """put_nowait/get_nowait, then put_sync and get_sync, outside any event loop."""
    w, r = _ring(len(objs))
    with w, r:
        for name, put, get in (
            ("nowait", w.put_nowait, r.get_nowait),
            ("sync", w.put_sync, r.get_sync),
        ):
            for _ in range(2):
                start = time.perf_counter()
                for obj in objs:
                    put(obj)
                put_us = (time.perf_counter() - start) / len(objs) * 1e6
                start = time.perf_counter()
                for _obj in objs:
                    get()
                get_us = (time.perf_counter() - start) / len(objs) * 1e6
                print(f"put_{name} {put_us:.2f} us   get_{name} {get_us:.2f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000, help="messages per pass")
    args = parser.parse_args()
    print(f"core: {aioshmq.CORE}; {args.count} x the bench's 100-byte dict")
    objs = [small_object(i) for i in range(args.count)]
    anyio.run(_awaited, objs, args.count)
    _unawaited(objs)


if __name__ == "__main__":
    main()

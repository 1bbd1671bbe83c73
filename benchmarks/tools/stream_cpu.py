"""Where a one-writer, one-reader stream of small objects spends its CPU, side by side.

    python tools/stream_cpu.py [--messages 300000] [--tuple] [--batch 64]

Streams the bench's 100-byte dict (or, with ``--tuple``, its 100-byte tuple) from this
process to a spawned reader, one after the other through: aioshmq ``put``/``get`` (asyncio),
aioshmq ``put_sync``/``get_sync``, and sync pyzmq PUSH/PULL over ipc:// (pickle protocol 5).
Prints, for each, messages a second and each side's CPU time per message
(``time.process_time()``, kernel time included): the side with more CPU per message bounds
the stream, and the difference from pyzmq's is what each side's code costs.  ``aioshmq core``
calls the compiled core's ``put_object``/``get_plain`` straight (falling back to
``put_sync``/``get_sync`` only to wait): the difference from ``aioshmq sync`` is what the
ends' Python around those calls costs across processes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import tempfile
import time
from typing import Any

import anyio

import aioshmq
from benchmarks.workload import small_object, small_tuple


def _reader(kind: str, where: str, n: int, batch: int, out: Any) -> None:
    cpu = time.process_time()
    if kind == "aioshmq":

        async def main() -> None:
            async with aioshmq.connect(where) as r:
                got = 0
                while got < n:
                    got += len(await r.get_many(batch)) if batch > 1 else (await r.get(), 1)[1]

        anyio.run(main)
    elif kind == "aioshmq sync":
        with aioshmq.connect(where) as r:
            for _ in range(n):
                r.get_sync(timeout=30)
    elif kind == "aioshmq core":
        # The core's own call (what get_sync makes when a message is there), get_sync only
        # to wait: the cost of the ends' Python around the core, by difference.
        with aioshmq.connect(where) as r:
            get_plain, loads, empty = r._ring.get_plain, pickle.loads, object()
            for _ in range(n):
                if get_plain(loads, empty) is empty:
                    r.get_sync(timeout=30)
    else:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.connect(where)
        got = 0
        while got < n:
            msg = pickle.loads(sock.recv())
            got += len(msg) if batch > 1 else 1
        sock.close(linger=0)
        ctx.term()
    out.send(time.process_time() - cpu)


def _run(kind: str, objs: list[Any], batch: int) -> tuple[float, float, float]:
    n = len(objs)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    chunks = [objs[i : i + batch] for i in range(0, n, batch)]
    if kind.startswith("aioshmq"):
        w = aioshmq.create(256 << 20, 1 << 20)
        where = w.name
    else:
        import zmq

        zctx = zmq.Context()
        sock = zctx.socket(zmq.PUSH)
        where = f"ipc://{tempfile.gettempdir()}/aioshmq-stream-cpu-{os.getpid()}"
        sock.bind(where)
    proc = ctx.Process(target=_reader, args=(kind, where, n, batch, there))
    proc.start()
    try:
        if kind.startswith("aioshmq"):
            w.wait_readers_sync(timeout=30)
        else:
            time.sleep(0.5)  # let the PULL connect (pyzmq has no "reader attached" signal)
        cpu, start = time.process_time(), time.perf_counter()
        if kind == "aioshmq":

            async def main() -> None:
                if batch > 1:
                    for chunk in chunks:
                        await w.put_many(chunk)
                else:
                    for obj in objs:
                        await w.put(obj)

            anyio.run(main)
        elif kind == "aioshmq sync":
            for obj in objs:
                w.put_sync(obj, timeout=30)
        elif kind == "aioshmq core":
            put_object, dumps = w._ring.put_object, pickle.dumps
            for obj in objs:
                if put_object(obj, dumps) is not None:  # no room: wait as put_sync does
                    w.put_sync(obj, timeout=30)
        else:
            for item in chunks if batch > 1 else objs:
                sock.send(pickle.dumps(item, protocol=5))
        writer_cpu = time.process_time() - cpu
        reader_cpu = here.recv()
        elapsed = time.perf_counter() - start
        proc.join(30)
    finally:
        if kind.startswith("aioshmq"):
            w.close()
        else:
            sock.close(linger=0)
            zctx.term()
    return n / elapsed, writer_cpu / n * 1e6, reader_cpu / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--tuple", action="store_true", help="the 100-byte tuple, not the dict")
    parser.add_argument("--batch", type=int, default=1, help="messages per put_many/send")
    args = parser.parse_args()
    make = small_tuple if args.tuple else small_object
    objs = [make(100_000 + i) for i in range(args.messages)]
    kinds = ["aioshmq", "pyzmq"]
    if args.batch == 1:
        kinds[1:1] = ["aioshmq sync", "aioshmq core"]
    print(f"core: {aioshmq.CORE}; {args.messages} x {make.__name__}, batch {args.batch}")
    for kind in kinds:
        rate, writer, reader = _run(kind, objs, args.batch)
        print(
            f"{kind:13} {rate / 1e3:7.1f}k msg/s   CPU per message: writer {writer:.2f} us, "
            f"reader {reader:.2f} us"
        )


if __name__ == "__main__":
    main()

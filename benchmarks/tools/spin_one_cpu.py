"""The default spin against ``spin=0`` with both processes of a round trip on one CPU.

    python tools/spin_one_cpu.py [--order dz] [--rounds 8000] [--no-tries]

This process and one echo process per configuration are pinned to CPU 0.  Each
configuration is a pair of rings, read with the default spin (``d``) or with ``spin=0``
(``z``); the letters may repeat in other case (``dD``, ``zZ``) to compare a configuration
with itself, which shows what two pairs differ by on their own.  Round trips of the bench's
100-byte dict go in blocks of 100, the pairs taking turns in ``--order``, so that each sees
the machine as the others do.  Prints each pair's p50 and p99 round trip (the first 300
left out) and each reader's spin counters: spins that caught a message, spins that ran out,
spins skipped (reader and writer pinned to the same CPU), its budget now and the sleeps
between two tries.  ``--no-tries`` stops the default spin's periodic tries, and with them
their checks.
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
from aioshmq.ends import spin as _spin
from benchmarks.workload import small_object

BLOCK = 100
WARMUP = 300
CPU = 0


def _spin_of(tag: str) -> float:
    return 0.0 if tag.lower() == "z" else aioshmq._reader.DEFAULT_SPIN


def _counters(reader: Any) -> tuple[int, int, int, float, int]:
    s = reader._spinner
    return s.caught, s.missed, s.skipped, s.now, s.every


def _no_tries() -> None:
    _spin.PROBE_EVERY = _spin.PROBE_EVERY_MOST = 1 << 62


def _echo(names: tuple[str, str], spin: float, no_tries: bool, out: Any) -> None:
    os.sched_setaffinity(0, {CPU})
    if no_tries:
        _no_tries()

    async def main() -> None:
        with (
            aioshmq.connect(names[0], spin=spin, timeout=30) as r,
            aioshmq.create(1 << 20, 1024, 1, name=names[1]) as w,
        ):
            out.put("ready")
            await w.wait_readers()
            while (msg := await r.get()) is not None:
                await w.put(msg)
            out.put(_counters(r))

    anyio.run(main)


async def _main(order: str, rounds: int, no_tries: bool) -> None:
    os.sched_setaffinity(0, {CPU})
    if no_tries:
        _no_tries()
    ctx = multiprocessing.get_context("spawn")
    pairs: dict[str, tuple[Any, Any, Any, Any]] = {}
    for tag in order:
        names = (f"spin1cpu-{os.getpid()}-{tag}-a", f"spin1cpu-{os.getpid()}-{tag}-b")
        out = ctx.Queue()
        w = aioshmq.create(1 << 20, 1024, 1, name=names[0])
        child = ctx.Process(target=_echo, args=(names, _spin_of(tag), no_tries, out))
        child.start()
        out.get(timeout=30)
        r = aioshmq.connect(names[1], spin=_spin_of(tag), timeout=30)
        await w.wait_readers()
        pairs[tag] = (w, r, child, out)
    obj = small_object(1)
    times: dict[str, list[float]] = {tag: [] for tag in order}
    with anyio.fail_after(600):
        for _ in range(rounds // BLOCK):
            for tag in order:
                w, r = pairs[tag][:2]
                for _ in range(BLOCK):
                    t = time.perf_counter()
                    await w.put(obj)
                    await r.get()
                    times[tag].append(time.perf_counter() - t)
    for tag in order:
        w, r, child, out = pairs[tag]
        await w.put(None)
        echo = out.get(timeout=30)
        child.join(30)
        kept = sorted(times[tag][WARMUP:])
        p50, p99 = statistics.median(kept) * 1e6, kept[int(len(kept) * 0.99)] * 1e6
        print(
            f"{tag} spin={_spin_of(tag)}: p50 {p50:.1f} us, p99 {p99:.1f} us; "
            f"spins (caught, ran out, skipped, budget, every): this {_counters(r)}, echo {echo}"
        )
        r.close()
        w.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--order", default="dz", help="pairs by letter: d default, z spin=0")
    parser.add_argument("--rounds", type=int, default=8000, help="round trips per pair")
    parser.add_argument("--no-tries", action="store_true", help="no periodic tries")
    args = parser.parse_args()
    anyio.run(_main, args.order, args.rounds, args.no_tries)

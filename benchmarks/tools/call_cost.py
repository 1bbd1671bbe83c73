"""What one awaited ``put`` or ``get`` costs, in instructions, under callgrind.

    python -m benchmarks.tools.call_cost put|get|nowait [--count 20000]

In one process, ``put`` awaits ``put`` of the bench's 100-byte dict ``--count`` times and
serves the other side with ``get_nowait``; ``get`` awaits ``get`` of what ``put_nowait``
wrote; ``nowait`` does both sides without awaiting (the baseline).  The tool runs that loop
under ``valgrind --tool=callgrind`` twice, with ``--count`` and twice as many messages, and
prints the difference of the two totals per message: start-up, imports and warm-up cancel
out, so no symbol of the compiled code has to be named.  ``put`` minus ``nowait`` is what
awaiting a put costs beyond ``put_nowait`` (``get`` likewise).  Instruction counts, unlike
times, do not drift with the machine, so two builds compare on a shared VM (run the tool in
each tree, ``AIOSHMQ_BENCH_TREE=TREE``); ``PYTHONHASHSEED=0`` is set for repeatable counts.
Needs valgrind; ``--inner`` runs the loop alone, without it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio

import aioshmq
from benchmarks._which import CHECKOUT
from benchmarks.workload import small_objects

BLOCK = 2000  # messages in the ring at a time
CALLS = ("put", "get", "nowait")
VALGRIND_TIMEOUT = 1800.0  # seconds for one run under callgrind (Python runs ~50x slower)


async def loop(call: str, count: int) -> tuple[int, int]:
    """``count`` messages (in blocks of BLOCK) through one ring, ``call`` awaited: how many
    the writer put and the reader received in all, warm-up included."""
    objs = small_objects(0, BLOCK)
    with aioshmq.create(1 << 20, 4 * BLOCK, 1) as w, aioshmq.connect(w.name) as r:
        put, get = w.put, r.get
        for obj in objs[:10]:  # warm-up: the lookups the calls remember
            await put(obj)
        for _ in range(10):
            await get()
        for _ in range(count // BLOCK):
            if call == "put":
                for obj in objs:
                    await put(obj)
                for _ in objs:
                    r.get_nowait()
            elif call == "get":
                for obj in objs:
                    w.put_nowait(obj)
                for _ in objs:
                    await get()
            else:
                for obj in objs:
                    w.put_nowait(obj)
                for _ in objs:
                    r.get_nowait()
        return w.statistics().messages_put, r.statistics().messages_received


def total(callgrind_out: str) -> int:
    """The instructions callgrind counted in all (its ``summary:`` or ``totals:`` line)."""
    for line in callgrind_out.splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise ValueError("no summary: or totals: line in the callgrind output")


def counted(call: str, count: int) -> int:
    """Instructions of a whole run of ``loop(call, count)`` in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="aioshmq-call-cost-") as scratch:
        out = Path(scratch) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable]
        cmd += ["-m", "benchmarks.tools.call_cost", call, "--count", str(count), "--inner"]
        path = os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": path}
        subprocess.run(
            cmd, env=env, cwd=CHECKOUT, check=True, capture_output=True, timeout=VALGRIND_TIMEOUT
        )
        return total(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("call", choices=CALLS)
    parser.add_argument("--count", type=int, default=20_000, help=f"messages, in {BLOCK}s")
    parser.add_argument("--inner", action="store_true", help="run the loop only, no valgrind")
    args = parser.parse_args()
    count = max(BLOCK, args.count - args.count % BLOCK)
    if args.inner:
        put, received = anyio.run(loop, args.call, count)
        print(f"core: {aioshmq.CORE}; {args.call}: {put} messages put, {received} received")
        return
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (--inner runs the loop without it)")
    once, twice = counted(args.call, count), counted(args.call, 2 * count)
    print(
        f"core: {aioshmq.CORE}; {args.call}: {(twice - once) / count:.0f} instructions a "
        f"message ({twice - once} more instructions for {count} more messages)"
    )


if __name__ == "__main__":
    main()

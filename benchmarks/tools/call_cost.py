"""What one awaited ``put`` or ``get`` of the compiled core costs, in instructions.

    valgrind --tool=callgrind --toggle-collect=call_send --callgrind-out-file=/tmp/put.out \\
        python tools/call_cost.py put
    valgrind --tool=callgrind --toggle-collect=call_send --callgrind-out-file=/tmp/get.out \\
        python tools/call_cost.py get

In one process, awaits ``put`` (or ``get``) of the bench's 100-byte dict ``--count`` times;
the other side is served with ``get_nowait`` (``put_nowait``), which never enters the
compiled call.  Collected only inside the compiled call (``call_send``, aioshmq._cancel_c),
callgrind's total divided by the count (plus the 20 calls of the warm-up) is the cost of one
call, pickle included; instruction counts, unlike times, do not drift with the machine, so
two builds compare on this shared VM.  Set ``PYTHONHASHSEED=0`` for repeatable counts.
"""

from __future__ import annotations

import argparse

import anyio

import aioshmq
from benchmarks.workload import small_objects

BLOCK = 2000  # messages in the ring at a time


async def main(call: str, count: int) -> None:
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
            else:
                for obj in objs:
                    w.put_nowait(obj)
                for _ in objs:
                    await get()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("call", choices=["put", "get"])
    parser.add_argument("--count", type=int, default=20_000, help="calls, in blocks of 2000")
    args = parser.parse_args()
    anyio.run(main, args.call, args.count)

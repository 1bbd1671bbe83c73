"""What the bench's small-object rows cost before any transport: their ceiling.

    python -m benchmarks.tools.harness_floor [--batches N] [--rounds N]

Runs, in this one process and with nothing between the two sides, the work each side of the
bench's small rows does for every message whatever the transport: the writer makes the
message (``Workload.maker``, or ``make_batch``), pickles it (protocol 5) and lets it go;
the reader unpickles it, checks it (``Workload.checker``, or ``check_batch``) and lets it
go.  For the bench's dict and its tuple, one per message and in batches of 64 (a list
pickled whole, as every peer's batch is), it prints each side's microseconds per message
and the messages a second that side alone allows.

A transport that pickles cannot stream faster than the slower side here: with one process
per side on two CPUs, that side's figure is the ceiling of the row on this machine.  Run it
alone on the machine.
"""

from __future__ import annotations

import argparse
import pickle
import time

from benchmarks.workload import Workload


def _writer(workload: Workload, batch: int, batches: int) -> float:
    """Seconds per message to make and pickle ``batches`` batches (one message: batch 1)."""
    make, make_batch, dumps = workload.maker(), workload.make_batch, pickle.dumps
    n = 0
    start = time.perf_counter()
    if batch == 1:
        for n in range(batches):
            dumps(make(n), protocol=5)
    else:
        for _ in range(batches):
            dumps(make_batch(n, batch), protocol=5)
            n += batch
    return (time.perf_counter() - start) / (batches * batch)


def _reader(workload: Workload, batch: int, batches: int) -> float:
    """Seconds per message to unpickle and check what ``_writer`` sent, in order."""
    check, check_batch, loads = workload.checker(), workload.check_batch, pickle.loads
    made = 256  # pickled beforehand and read again and again: the check follows their numbers
    if batch == 1:
        data = [pickle.dumps(workload.make(i), protocol=5) for i in range(made)]
    else:
        data = [
            pickle.dumps(workload.make_batch(k * batch, batch), protocol=5) for k in range(made)
        ]
    start = time.perf_counter()
    if batch == 1:
        for n in range(batches):
            check(loads(data[n % made]), n % made)
    else:
        for k in range(batches):
            check_batch(loads(data[k % made]), (k % made) * batch)
    return (time.perf_counter() - start) / (batches * batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20_000, help="batches of 64 per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per figure (the best kept)")
    args = parser.parse_args()
    print("row                      writer us/msg  (msg/s)   reader us/msg  (msg/s)")
    for kind, what in (("small", "dict"), ("tuple", "tuple")):
        workload = Workload(kind)  # type: ignore[arg-type]
        for batch in (1, 64):
            count = args.batches * 64 // batch
            w = min(_writer(workload, batch, count) for _ in range(args.rounds))
            r = min(_reader(workload, batch, count) for _ in range(args.rounds))
            row = f"{what}, {'one per put' if batch == 1 else 'batches of 64'}"
            print(
                f"{row:24s} {w * 1e6:13.3f}  ({1 / w / 1e6:.2f}M)   "
                f"{r * 1e6:13.3f}  ({1 / r / 1e6:.2f}M)"
            )


if __name__ == "__main__":
    main()

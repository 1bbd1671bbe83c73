"""What moving a large payload from one process to another costs with no queue at all.

    python -m benchmarks.tools.copy_floor [--sizes KIB ...] [--slots N] [--count N]

For each size, in GB/s, measured one after the other:

- the bench's memcpy floor: ``numpy.copyto`` into an mmap'd memfd of the same size, best of
  several, source and destination staying in this core's cache;
- a bare hand-over between two processes: the parent copies the payload into slot
  ``i % slots`` of a shared memfd (as ``put`` does into the ring), and a forked child either
  reads the slot's last byte (as the bench's reader does inside a ``lease()``) or copies the
  slot out into a new ``bytearray`` (as ``get()`` does).  The two take turns through two
  counters on lines of their own and spin on them: no syscall, no pickle, nothing of
  aioshmq's.

The hand-over is what the bytes themselves cost once they cycle through a ring of several
payloads, larger than one core's cache, and (for the copy out) cross from one core's cache
to another's; so it bounds ``put``/``lease`` and ``put``/``get`` of large arrays (the bench's
``large`` and ``tensors`` rows).  The spin relies on x86-64's store order; elsewhere the
figures still stand but the data is not checked.  Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from typing import Any

import numpy as np

from benchmarks.loops import memcpy_gbps
from benchmarks.workload import pattern_array

LINE_WORDS = 16  # the two counters sit 128 bytes apart: no line (nor prefetched pair) shared


def cross_process_gbps(nbytes: int, slots: int, count: int, copy_out: bool) -> float:
    """GB/s of ``count`` payloads copied in by this process and looked at (their last byte)
    or copied out by a forked child."""
    size = slots * nbytes + 2 * LINE_WORDS * 8
    fd = os.memfd_create("aioshmq-copy-floor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mm:
            data: Any = np.frombuffer(mm, np.uint8, slots * nbytes)
            words: Any = np.frombuffer(mm, np.int64, 2 * LINE_WORDS, slots * nbytes)
            written, taken = words[0:1], words[LINE_WORDS : LINE_WORDS + 1]
            data[:] = 0  # every page faulted in before anything is timed
            pid = os.fork()
            if pid == 0:  # the reader: copy each slot out as it is written
                code = 0
                try:
                    for i in range(count):
                        while written[0] <= i:
                            pass
                        start = i % slots * nbytes
                        if copy_out:
                            bytearray(data[start : start + nbytes])
                        else:
                            data[start + nbytes - 1]  # the read is the point
                        taken[0] = i + 1
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            src = pattern_array(nbytes)
            begin = time.perf_counter()
            for i in range(count):
                while i - taken[0] >= slots:
                    pass
                start = i % slots * nbytes
                np.copyto(data[start : start + nbytes], src)
                written[0] = i + 1
            while taken[0] < count:
                pass
            elapsed = time.perf_counter() - begin
            _, status = os.waitpid(pid, 0)
            if status:
                raise RuntimeError(f"the reading process failed (wait status {status})")
            del data, words, written, taken
    finally:
        os.close(fd)
    return nbytes * count / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], metavar="KIB")
    parser.add_argument("--slots", type=int, default=4, help="payloads the shared area holds")
    parser.add_argument("--count", type=int, default=4000, help="payloads sent per size")
    args = parser.parse_args()
    for kib in args.sizes:
        nbytes = kib * 1024
        floor = memcpy_gbps(nbytes, 1.0)
        touched = cross_process_gbps(nbytes, args.slots, args.count, copy_out=False)
        copied = cross_process_gbps(nbytes, args.slots, args.count, copy_out=True)
        print(
            f"{kib} KiB: memcpy {floor:.1f} GB/s; through {args.slots} slots to another "
            f"process, last byte read {touched:.1f} GB/s ({100 * touched / floor:.0f}%), "
            f"copied out {copied:.1f} GB/s ({100 * copied / floor:.0f}%)"
        )


if __name__ == "__main__":
    main()

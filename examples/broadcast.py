"""Broadcast a stream of Python objects from one writer process to N reader processes.

    python examples/broadcast.py --workers 3 --messages 20000 --backend trio

The parent creates a ring, starts the workers with the "spawn" start method, waits until every
reader slot is attached, puts the messages (dicts, numpy arrays when numpy is installed, and a
few dicts bigger than the whole ring, which travel in fragments), then closes the writer.  Each
worker attaches to its own slot, iterates until the writer closes, checks the order, and sends
back a summary (count, bytes, CRC-32 of everything in order).  The parent compares every
summary with what it sent and exits non-zero if anything differs, a worker failed, or
something timed out.  Children are always reaped: joined with a timeout, killed if they hang.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from multiprocessing.process import BaseProcess
from types import ModuleType
from typing import Any, TypedDict

import anyio

import aioshmq

if sys.platform == "win32":  # Pipe() returns these there, and type checkers may check every OS
    from multiprocessing.connection import PipeConnection as Connection
else:
    from multiprocessing.connection import Connection

numpy: ModuleType | None
try:
    import numpy
except ImportError:  # numpy is optional: without it every message is a dict
    numpy = None

CAPACITY = 1 << 20  # bytes of ring
MAX_MESSAGES = 4096  # messages the ring holds for the slowest reader
BIG = (5 << 20) // 2  # a few messages of 2.5 MiB: bigger than the ring, sent in fragments
READY_TIMEOUT = 30.0  # seconds for every worker to start and attach
SEND_TIMEOUT = 60.0  # seconds for the whole stream
RESULT_TIMEOUT = 15.0  # seconds for the workers to report and exit once the writer closed


class Summary(TypedDict):
    count: int
    nbytes: int
    crc: int


class Report(Summary):
    worker: int
    error: str | None
    wakeups: int  # wake-ups this reader sent to a sleeping writer
    done_at: float  # time.monotonic() when the worker saw the end of the stream


def run_backend(backend: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    if backend == "uvloop":
        return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(fn, *args, backend=backend)


# -- the messages ----------------------------------------------------------------------------


def make_message(seq: int, total: int) -> Any:
    """Message ``seq`` of the stream: mostly small dicts, some arrays, a few huge dicts."""
    if total >= 16 and seq % (total // 4) == total // 8:
        return {"seq": seq, "text": "big", "blob": random.Random(seq).randbytes(BIG)}
    if numpy is not None and seq % 3 == 2:
        return numpy.arange(seq, seq + 1 + (seq * 7919) % 2048, dtype=numpy.int64)
    return {"seq": seq, "text": f"message {seq}", "blob": seq.to_bytes(8, "little") * (seq % 64)}


def seq_of(msg: Any) -> int:
    match msg:
        case {"seq": int(seq)}:
            return seq
        case _:
            return int(msg[0])


def content(msg: Any) -> bytes | memoryview:
    """The bytes that the count, size and checksum are computed over."""
    match msg:
        case {"seq": int(seq), "text": str(text), "blob": bytes(blob)}:
            return seq.to_bytes(8, "little") + text.encode() + blob
        case _:
            return memoryview(msg).cast("B")  # a numpy array: its raw contents


def add(summary: Summary, msg: Any) -> None:
    data = content(msg)
    summary["count"] += 1
    summary["nbytes"] += len(data)
    summary["crc"] = zlib.crc32(data, summary["crc"])


# -- a worker process ------------------------------------------------------------------------


async def read_all(handle: aioshmq.Handle, index: int) -> Report:
    report: Report = {
        "worker": index,
        "count": 0,
        "nbytes": 0,
        "crc": 0,
        "error": None,
        "wakeups": 0,
        "done_at": 0.0,
    }
    with aioshmq.connect(handle, reader=index) as reader:
        async for msg in reader:
            seq = seq_of(msg)
            if seq != report["count"]:
                report["error"] = f"message {report['count']} arrived with seq {seq}"
                break
            add(report, msg)
        report["done_at"] = time.monotonic()
        report["wakeups"] = reader.statistics().wakeups_sent
    return report


def worker(handle: aioshmq.Handle, index: int, backend: str, results: Connection) -> None:
    try:
        report = run_backend(backend, read_all, handle, index)
    except BaseException as exc:
        results.send({"worker": index, "error": f"{type(exc).__name__}: {exc}"})
        raise
    results.send(report)
    sys.exit(1 if report["error"] else 0)


# -- the writer process ----------------------------------------------------------------------


class Workers:
    """The worker processes and the pipes they report on."""

    def __init__(self) -> None:
        self.procs: list[BaseProcess] = []
        self.results: list[Connection] = []

    def start(self, handle: aioshmq.Handle, count: int, backend: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        for i in range(count):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker, args=(handle, i, backend, send_end), name=f"worker-{i}", daemon=True
            )
            proc.start()
            send_end.close()  # the child has its copy: EOF here once the child is gone
            self.procs.append(proc)
            self.results.append(recv_end)

    def collect(self, timeout: float) -> list[dict[str, Any]]:
        """Every worker's report, or an error entry for a worker that sent none in time."""
        deadline = time.monotonic() + timeout
        reports: list[dict[str, Any]] = []
        for i, conn in enumerate(self.results):
            try:
                if conn.poll(max(deadline - time.monotonic(), 0)):
                    reports.append(conn.recv())
                else:
                    reports.append({"worker": i, "error": f"no report within {timeout} s"})
            except EOFError:
                reports.append({"worker": i, "error": "exited without a report"})
        return reports

    def reap(self, timeout: float) -> list[int | None]:
        """Join every worker, killing any that is still running after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.results:
            conn.close()
        return [proc.exitcode for proc in self.procs]


async def wait_ready(writer: aioshmq.Writer[Any], workers: Workers) -> None:
    """Wait until every worker attached; fail early if one exits first or it takes too long."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        with anyio.move_on_after(0.1):
            await writer.wait_readers()
            return
        for proc in workers.procs:
            if proc.exitcode is not None:
                raise RuntimeError(f"{proc.name} exited with code {proc.exitcode} before attaching")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not all attach within {READY_TIMEOUT} s")


async def write_all(args: argparse.Namespace, workers: Workers) -> tuple[Summary, float, int]:
    """Put the stream; returns what was sent, when sending started, and wake-ups sent."""
    sent: Summary = {"count": 0, "nbytes": 0, "crc": 0}
    with aioshmq.create(
        capacity=CAPACITY, max_messages=MAX_MESSAGES, readers=args.workers
    ) as writer:
        workers.start(writer.handle, args.workers, args.backend)
        await wait_ready(writer, workers)
        started = time.monotonic()
        with anyio.fail_after(SEND_TIMEOUT):
            for seq in range(args.messages):
                msg = make_message(seq, args.messages)
                await writer.put(msg)
                add(sent, msg)
        wakeups = writer.statistics().wakeups_sent
    return sent, started, wakeups


def run_writer(
    args: argparse.Namespace, workers: Workers
) -> tuple[Summary, float, int, list[dict[str, Any]]] | str:
    """What write_all returns and the workers' reports; or the error that stopped the writer."""
    try:
        sent, started, wakeups = run_backend(args.backend, write_all, args, workers)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return sent, started, wakeups, workers.collect(RESULT_TIMEOUT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=3, help="reader processes (default 3)")
    parser.add_argument("--messages", type=int, default=20000, help="messages (default 20000)")
    parser.add_argument(
        "--backend", choices=["asyncio", "uvloop", "trio"], default="asyncio", help="event loop"
    )
    args = parser.parse_args(argv)
    if args.workers < 1 or args.messages < 0:
        parser.error("need --workers >= 1 and --messages >= 0")

    workers = Workers()
    try:
        outcome = run_writer(args, workers)
    finally:
        codes = workers.reap(RESULT_TIMEOUT)  # always: no worker outlives this function
    if isinstance(outcome, str):
        print(f"writer failed: {outcome}")
        for proc, code in zip(workers.procs, codes, strict=True):
            print(f"{proc.name}: exit code {code}")
        print("FAILED")
        return 1
    sent, started, wakeups, reports = outcome

    print(
        f"sent {sent['count']} messages, {sent['nbytes']} bytes, crc32 {sent['crc']:08x} "
        f"to {args.workers} workers on {args.backend}"
        + ("" if numpy is not None else " (numpy not installed: dicts only)")
    )
    expected = (sent["count"], sent["nbytes"], sent["crc"])
    failed = False
    for report, code in zip(reports, codes, strict=True):
        i = report["worker"]
        if report.get("error") is None and "crc" in report:
            got = (report["count"], report["nbytes"], report["crc"])
            ok = got == expected and code == 0
            print(
                f"worker {i}: {got[0]} messages, {got[1]} bytes, crc32 {got[2]:08x}, "
                f"{report['wakeups']} wake-ups sent, exit code {code}"
                + ("" if ok else "  <-- MISMATCH")
            )
        else:
            ok = False
            print(f"worker {i}: FAILED ({report.get('error')}), exit code {code}")
        failed |= not ok

    done = [r["done_at"] for r in reports if "done_at" in r]
    if done and not failed and sent["count"]:
        elapsed = max(done) - started
        print(
            f"every worker had the whole stream {elapsed:.3f} s after the first put: "
            f"{sent['count'] / elapsed:,.0f} messages/s, "
            f"{sent['nbytes'] / elapsed / 1e6:,.1f} MB/s to each worker; "
            f"writer sent {wakeups} wake-ups"
        )
    print("OK" if not failed else "FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

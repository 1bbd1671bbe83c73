"""An async scheduler driving 4 worker processes with batched RPC calls (aioshmq.rpc).

    python examples/scheduler.py --seconds 5 --backend trio

The scheduler starts the workers with the "spawn" start method and waits until each one is
attached.  Then, for ``--seconds``, it queues calls continuously: a batch of 64 per loop turn
(calls submitted in one loop turn leave as one record in the call ring), then awaits the
oldest calls until at most 512 are in flight.  Most calls are small: ``echo`` a dict on
every worker, or ``tag`` it on two workers named in a chosen order.  Every 16th call carries
a 256 KiB float32 numpy array, which every worker sums and one of them (``unique_reply_rank``)
returns.  Every result is checked against what the scheduler expects.  Meanwhile a task that
sleeps 1 ms at a time measures the scheduler's event loop: its longest gap is the worst lag
that the calls caused (on a machine with fewer cores than busy processes, it includes the
time the scheduler process waited for a core).

It prints calls per second, batches and wake-ups sent, and the worst lag; it exits non-zero
if any result was wrong, a worker failed, or something timed out.  Workers stop when the
client closes, and are always reaped: joined with a timeout, killed if they hang.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from types import ModuleType
from typing import Any, cast

import anyio

from aioshmq import rpc

numpy: ModuleType | None
try:
    import numpy
except ImportError:  # numpy is optional: without it no call carries an array
    numpy = None

WORKERS = 4
BATCH = 64  # calls queued per loop turn
IN_FLIGHT = 512  # calls awaited down to this many before the next batch
ARRAY_EVERY = 16  # one call in this many carries an array
ARRAY_ITEMS = (256 << 10) // 4  # float32 items in 256 KiB
ARRAYS = 8  # distinct arrays, made once and sent again and again
TICK = 0.001  # the ticker's period
READY_TIMEOUT = 20.0  # seconds for every worker to start and attach
DRAIN_TIMEOUT = 10.0  # seconds, beyond --seconds, for the calls in flight to finish
REAP_TIMEOUT = 5.0  # seconds for the workers to exit once the client closed


def run_backend(backend: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    if backend == "uvloop":
        return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(fn, *args, backend=backend)


# -- the worker processes --------------------------------------------------------------------


class Jobs:
    """What each worker serves: the scheduler calls these methods by name."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def echo(self, job: dict[str, Any]) -> dict[str, Any]:
        return job

    def tag(self, job: dict[str, Any], *, label: str) -> tuple[int, str, int]:
        return self.rank, label, job["seq"]

    def total(self, values: Any) -> float:
        assert numpy is not None  # only a scheduler with numpy sends arrays
        return float(values.sum(dtype=numpy.float64))


def worker(handle: rpc.RpcHandle, rank: int, backend: str) -> None:
    """A worker process: serve the client's calls until it closes."""
    run_backend(backend, rpc.serve, handle, rank, Jobs(rank))


class Workers:
    """The worker processes, always reaped."""

    def __init__(self) -> None:
        self.procs: list[BaseProcess] = []

    def start(self, handle: rpc.RpcHandle, backend: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        for rank in range(WORKERS):
            proc = ctx.Process(
                target=worker, args=(handle, rank, backend), name=f"worker-{rank}", daemon=True
            )
            proc.start()
            self.procs.append(proc)

    def reap(self, timeout: float) -> list[int | None]:
        """Join every worker, killing any that is still running after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        return [proc.exitcode for proc in self.procs]


# -- the scheduler ---------------------------------------------------------------------------


@dataclass
class Run:
    """What the scheduler did and saw."""

    calls: int = 0
    array_calls: int = 0
    wrong: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    worst_lag: float = 0.0  #: the ticker's longest gap, in seconds
    ticks: int = 0
    stats: rpc.ClientStatistics | None = None


async def tick(run: Run) -> None:
    """Sleep TICK at a time and keep the longest gap between wake-ups."""
    last = time.monotonic()
    while True:
        await anyio.sleep(TICK)
        now = time.monotonic()
        run.worst_lag = max(run.worst_lag, now - last)
        run.ticks += 1
        last = now


def make_arrays() -> list[tuple[Any, float]]:
    """ARRAYS arrays of whole numbers (so every sum is exact in float64) and their sums."""
    if numpy is None:
        return []
    arrays: list[tuple[Any, float]] = []
    for i in range(ARRAYS):
        values = (numpy.arange(ARRAY_ITEMS, dtype=numpy.int64) * (i + 1) % 1009).astype(
            numpy.float32
        )
        arrays.append((values, float(values.sum(dtype=numpy.float64))))
    return arrays


def submit(
    client: rpc.Client, seq: int, arrays: list[tuple[Any, float]], run: Run
) -> tuple[rpc.Call, Any]:
    """Submit call ``seq``; returns the call and the result it must have."""
    job = {"seq": seq, "name": f"job-{seq}", "weights": (0.25, 0.5, 0.25)}
    if arrays and seq % ARRAY_EVERY == 0:
        values, expected = arrays[seq // ARRAY_EVERY % len(arrays)]
        run.array_calls += 1
        return client.submit("total", values, unique_reply_rank=seq % WORKERS), expected
    if seq % ARRAY_EVERY == ARRAY_EVERY // 2:
        ranks = [(seq + 1) % WORKERS, seq % WORKERS]  # in this order, not rank order
        label = f"label-{seq % 7}"
        return (
            client.submit("tag", job, label=label, workers=ranks),
            [(rank, label, seq) for rank in ranks],
        )
    return client.submit("echo", job), [job] * WORKERS


async def check(seq: int, call: rpc.Call, expected: Any, run: Run) -> None:
    try:
        result = await call
    except Exception as exc:  # raised in the worker: a wrong result too
        result = describe(exc)
    if result != expected:
        run.wrong.append(f"call {seq} ({call.method}): got {result!r}, expected {expected!r}")


def describe(exc: BaseException) -> str:
    """The exception, or the first one an exception group holds (anyio task groups wrap)."""
    while isinstance(exc, BaseExceptionGroup):  # a group is never empty
        exc = cast("BaseExceptionGroup[BaseException]", exc).exceptions[0]
    return f"{type(exc).__name__}: {exc}"


async def schedule(
    client: rpc.Client, seconds: float, arrays: list[tuple[Any, float]], run: Run
) -> None:
    """Queue batches of calls for ``seconds``, then await the rest; check every result."""
    pending: deque[tuple[int, rpc.Call, Any]] = deque()
    started = time.monotonic()
    deadline = started + seconds
    seq = 0
    while time.monotonic() < deadline:
        for _ in range(BATCH):
            pending.append((seq, *submit(client, seq, arrays, run)))
            seq += 1
        while len(pending) > IN_FLIGHT - BATCH:
            await check(*pending.popleft(), run)
    while pending:
        await check(*pending.popleft(), run)
    run.elapsed = time.monotonic() - started
    run.calls = seq


async def main_async(args: argparse.Namespace, workers: Workers) -> Run:
    run = Run()
    arrays = make_arrays()  # before the ticker starts: making them takes a few ms
    async with rpc.Client(WORKERS) as client:
        workers.start(client.handle, args.backend)
        with anyio.fail_after(READY_TIMEOUT):
            await client.wait_workers()
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick, run)
            with anyio.fail_after(args.seconds + DRAIN_TIMEOUT):
                await schedule(client, args.seconds, arrays, run)
            tg.cancel_scope.cancel()
        run.stats = client.statistics()
    return run


def run_scheduler(args: argparse.Namespace, workers: Workers) -> Run | str:
    """What the scheduler did, or the error that stopped it."""
    try:
        run: Run = run_backend(args.backend, main_async, args, workers)
    except Exception as exc:
        return describe(exc)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to call (default 5)")
    parser.add_argument(
        "--backend", choices=["asyncio", "uvloop", "trio"], default="asyncio", help="event loop"
    )
    args = parser.parse_args(argv)
    if not args.seconds > 0:
        parser.error("--seconds must be above 0")

    workers = Workers()
    try:
        outcome = run_scheduler(args, workers)
    finally:
        codes = workers.reap(REAP_TIMEOUT)  # always: no worker outlives this function
    failed = [f"worker-{rank}: exit code {code}" for rank, code in enumerate(codes) if code != 0]
    if isinstance(outcome, str):
        print(f"scheduler failed: {outcome}")
        for line in failed:
            print(line)
        print("FAILED")
        return 1
    run = outcome

    assert run.stats is not None
    print(
        f"{run.calls:,} calls in {run.elapsed:.2f} s to {WORKERS} workers on {args.backend}: "
        f"{run.calls / run.elapsed:,.0f} calls/s"
    )
    arrays = f"{run.array_calls:,} carried a 256 KiB array" if numpy is not None else "none"
    print(
        f"  {arrays} (numpy {'installed' if numpy is not None else 'not installed'}); "
        f"{run.stats.batches_sent:,} batches sent "
        f"({run.stats.calls_submitted / max(run.stats.batches_sent, 1):.1f} calls each), "
        f"{run.stats.wakeups_sent:,} wake-ups"
    )
    print(f"event loop's worst lag: {run.worst_lag * 1000:.1f} ms ({run.ticks:,} ticks of 1 ms)")
    for line in run.wrong[:10]:
        print(f"WRONG {line}")
    if run.wrong:
        print(f"{len(run.wrong):,} wrong results")
    for line in failed:
        print(line)
    ok = not run.wrong and not failed
    print("OK: every result checked" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

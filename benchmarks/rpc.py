"""The RPC scenario's sessions: one async scheduler calling ``echo`` on 4 worker processes.

A session starts the workers (spawn), waits until each one is attached, then measures in the
same processes: round trips of one call at a time (each call goes to every worker and comes
back as their 4 replies), then calls per second with a window of calls kept in flight (each
completion submits the next call).  Two transports are driven the same way:

- aioshmq: ``rpc.Client`` in the scheduler, ``rpc.serve`` in each worker;
- zmq.asyncio, the way vLLM's engine talks to its workers: one PUSH socket per worker over
  ipc:// carries each call (pickled once, sent to every worker), each worker replies over a
  PUSH to the scheduler's one PULL, and a task there matches replies to calls by id and
  resolves an asyncio future once the call's 4 replies are in.

Every reply is checked, and each worker must have served every call of the session.

A session of its own (aioshmq only: zmq.asyncio has no way to withdraw a call) times a
cancelled call: ``hold`` runs in the workers for HELD, is cancelled, and the clock runs from
the cancel to the replies of the next call, which the workers take once they have dropped
``hold``.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import pickle
import secrets
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Literal, NoReturn, Protocol

import anyio
import anyio.to_thread

from aioshmq import rpc

from .procs import READY_TIMEOUT, Child, ChildFailed, Children, Link, run_backend
from .workload import Budget, small_object

Transport = Literal["aioshmq", "zmq.asyncio"]
WORKERS = 4  #: worker processes; every call goes to all of them
WINDOW = 256  #: calls kept in flight for the throughput figure
SESSION_TIMEOUT = 180.0  # seconds for one session, whatever happens
WORKER_TIMEOUT = 240.0  # seconds a worker lives at most, should its scheduler vanish
STOP_LINGER_MS = 1000  # how long zmq may take to deliver the stop messages at close
HELD = 0.005  #: how long (s) a call runs in the workers before it is cancelled
HOLD = 0.1  #: how long (s) ``hold`` would run if nothing cut it short (an aioshmq without
# cancellation reaching the workers, as measured by ``compare``, then still ends the session)


class Echo:
    """The workers' target: ``echo(x)`` returns ``x``, and the calls are counted."""

    def __init__(self) -> None:
        self.calls = 0

    def echo(self, x: Any) -> Any:
        self.calls += 1
        return x

    async def hold(self, seconds: float) -> None:
        """Busy for ``seconds``, unless cancelled: the call that the cancelled-call session
        withdraws (not counted among the calls)."""
        await anyio.sleep(seconds)


@dataclass
class Session:
    """What one session measured, and what it did."""

    samples: list[float] = field(default_factory=list)  #: round trips (us), warm-up excluded
    cancelled: list[float] = field(default_factory=list)  #: cancel to next reply (us)
    rates: list[float] = field(default_factory=list)  #: calls/s, one per window run
    counted: list[int] = field(default_factory=list)  #: calls counted in each window run
    calls: int = 0  #: calls made in all, warm-ups included: each worker served this many
    stats: dict[str, int] = field(default_factory=dict)  #: the client's counters (aioshmq)


class Scheduler(Protocol):
    """The scheduler's side of a transport, as the measurements use it."""

    async def call(self, x: Any) -> list[Any]:
        """``echo(x)`` on every worker: their replies, in rank order."""
        ...

    async def submit(self, x: Any) -> Awaitable[list[Any]]:
        """Send ``echo(x)`` to every worker now; await the result for their replies."""
        ...


def _check(replies: list[Any], seq: int) -> None:
    if len(replies) != WORKERS or any(reply["seq"] != seq for reply in replies):
        raise AssertionError(f"call {seq} came back as {replies!r}")


async def _round_trips(scheduler: Scheduler, budget: Budget, session: Session) -> None:
    """One call at a time: each call's round trip in microseconds, after the warm-up."""
    clock = time.perf_counter_ns
    deadline = float("inf")
    warmup = budget.warmup_round_trips
    for i in range(warmup + budget.round_trips):
        if i == warmup:
            deadline = time.monotonic() + budget.latency_seconds
        x = small_object(session.calls)
        start = clock()
        replies = await scheduler.call(x)
        took = clock() - start
        _check(replies, session.calls)
        session.calls += 1
        if i >= warmup:
            session.samples.append(took / 1000)
            if time.monotonic() > deadline:
                break


async def _window(scheduler: Scheduler, budget: Budget, session: Session) -> None:
    """WINDOW calls in flight: each completion submits a new call.  The clock starts at the
    completion of the warm-up's last call and stops at the last completion before
    ``budget.seconds`` ran out; the calls still in flight then are awaited, not counted."""
    inflight: deque[tuple[int, Awaitable[list[Any]]]] = deque()

    async def submit() -> None:
        seq = session.calls
        inflight.append((seq, await scheduler.submit(small_object(seq))))
        session.calls += 1

    for _ in range(WINDOW):
        await submit()
    clock = time.monotonic
    warmup = budget.warmup_messages
    start = clock()
    deadline = start + budget.seconds if warmup == 0 else float("inf")
    done = counted = 0
    last = start
    while inflight:
        seq, call = inflight.popleft()
        _check(await call, seq)
        done += 1
        now = clock()
        if done == warmup:
            start, deadline = now, now + budget.seconds
        elif done > warmup and (now <= deadline or counted == 0):
            counted += 1
            last = now
        if now <= deadline or counted == 0:
            await submit()
    session.rates.append(counted / max(last - start, 1e-9))
    session.counted.append(counted)


async def _cancelled_round_trips(client: rpc.Client, budget: Budget, session: Session) -> None:
    """``hold`` is cancelled after HELD in the workers: the time from the cancel to the
    replies of the next call (``echo``), one at a time, after a few not counted."""
    clock = time.perf_counter_ns
    warmup = max(1, budget.warmup_round_trips // 50)
    deadline = float("inf")
    for i in range(warmup + budget.round_trips):
        if i == warmup:
            deadline = time.monotonic() + budget.latency_seconds
        held = client.submit("hold", HOLD)
        await anyio.sleep(HELD)
        x = small_object(session.calls)
        start = clock()
        held.cancel()
        replies = await client.call("echo", x)
        took = clock() - start
        _check(replies, session.calls)
        session.calls += 1
        if i >= warmup:
            session.cancelled.append(took / 1000)
            if time.monotonic() > deadline:
                break


async def _drive(scheduler: Scheduler, budget: Budget) -> Session:
    session = Session()
    await _round_trips(scheduler, budget, session)
    for _ in range(budget.repeats):
        await _window(scheduler, budget, session)
    return session


async def _watch(kids: Children) -> None:
    """Raise ChildFailed as soon as a worker process exits (until cancelled): calls to a dead
    zmq worker would otherwise wait for the session's timeout.  It costs nothing meanwhile,
    as it awaits the processes' sentinels."""
    async with anyio.create_task_group() as tg:
        for kid in kids.kids:
            tg.start_soon(_exited, kid)


async def _exited(kid: Child) -> NoReturn:
    await anyio.wait_readable(kid.proc.sentinel)
    kid.proc.join(1.0)  # its exit code: the sentinel can be readable a moment before
    raise ChildFailed(f"{kid.proc.name} exited (code {kid.proc.exitcode}) during the session")


def _check_served(served: list[int], session: Session) -> None:
    for rank, calls in enumerate(served):
        if calls != session.calls:
            raise AssertionError(f"worker {rank} served {calls} of {session.calls} calls")


# -- aioshmq ---------------------------------------------------------------------------------


class _AioshmqScheduler:
    def __init__(self, client: rpc.Client) -> None:
        self._client = client

    async def call(self, x: Any) -> list[Any]:
        replies: list[Any] = await self._client.call("echo", x)
        return replies

    async def submit(self, x: Any) -> Awaitable[list[Any]]:
        return self._client.submit("echo", x)


def aioshmq_worker(link: Link, handle: rpc.RpcHandle, rank: int) -> int:
    """A worker process: ``rpc.serve`` until the client closes; how many calls it served."""
    target = Echo()

    async def main() -> None:
        link.ready()
        with anyio.fail_after(WORKER_TIMEOUT):
            await rpc.serve(handle, rank, target)

    run_backend("asyncio", main)
    return target.calls


async def _aioshmq_session(
    budget: Budget, capacity: int, depth: int, cancelled: bool = False
) -> Session:
    with anyio.fail_after(SESSION_TIMEOUT):
        with Children() as kids:
            async with rpc.Client(workers=WORKERS, capacity=capacity, max_messages=depth) as client:
                for rank in range(WORKERS):
                    kids.start(f"aioshmq-worker-{rank}", aioshmq_worker, client.handle, rank)
                await anyio.to_thread.run_sync(kids.ready)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_watch, kids)
                    with anyio.fail_after(READY_TIMEOUT):
                        await client.wait_workers()
                    if cancelled:
                        session = Session()
                        await _cancelled_round_trips(client, budget, session)
                    else:
                        session = await _drive(_AioshmqScheduler(client), budget)
                    tg.cancel_scope.cancel()
                session.stats = client.statistics()._asdict()
            served: list[int] = await anyio.to_thread.run_sync(kids.results)
    _check_served(served, session)
    return session


# -- zmq.asyncio -----------------------------------------------------------------------------


@dataclass
class _Pending:
    future: asyncio.Future[list[Any]]
    replies: list[Any]
    left: int
    error: BaseException | None = None


class _ZmqScheduler:
    """The scheduler's sockets: a bound PUSH per worker for calls, one bound PULL for replies.

    A call is ``(id, method, args, kwargs)`` pickled once and sent to every worker; a reply is
    ``(id, rank, ok, value)``.  ``run()`` is the task that receives replies and resolves the
    call's future once every worker has replied (with the first error, if any).
    """

    def __init__(self, workers: int, depth: int) -> None:
        zmq: Any = importlib.import_module("zmq")
        base = os.path.join(
            tempfile.gettempdir(), f"aioshmq-bench-rpc-{os.getpid()}-{secrets.token_hex(6)}"
        )
        self.paths = [f"{base}-{rank}.ipc" for rank in range(workers)] + [f"{base}-replies.ipc"]
        self.requests = [f"ipc://{path}" for path in self.paths[:-1]]
        self.replies = f"ipc://{self.paths[-1]}"
        self._workers = workers
        self._ctx: Any = importlib.import_module("zmq.asyncio").Context()
        self._pushes: list[Any] = []
        self._pending: dict[int, _Pending] = {}
        self._ids = count()
        self._linger = 0
        try:
            for address in self.requests:
                sock = self._ctx.socket(zmq.PUSH)
                self._pushes.append(sock)
                sock.setsockopt(zmq.SNDHWM, depth)
                sock.bind(address)
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.setsockopt(zmq.RCVHWM, depth)
            self._pull.bind(self.replies)
        except BaseException:
            self.close()
            raise

    async def wait_workers(self) -> None:
        """Return once every worker has said hello over the reply socket."""
        ranks: set[int] = set()
        while len(ranks) < self._workers:
            kind, rank = pickle.loads(await self._pull.recv())
            assert kind == "hello", kind
            ranks.add(rank)

    async def run(self) -> None:
        pending = self._pending
        while True:
            call_id, rank, ok, value = pickle.loads(await self._pull.recv())
            call = pending[call_id]
            call.replies[rank] = value
            if not ok and call.error is None:
                call.error = value
            call.left -= 1
            if call.left == 0:
                del pending[call_id]
                if call.error is not None:
                    call.future.set_exception(call.error)
                else:
                    call.future.set_result(call.replies)

    async def submit(self, x: Any) -> Awaitable[list[Any]]:
        call_id = next(self._ids)
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = _Pending(future, [None] * self._workers, self._workers)
        data = pickle.dumps((call_id, "echo", (x,), {}), protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._pushes:
            await sock.send(data)
        return future

    async def call(self, x: Any) -> list[Any]:
        return await (await self.submit(x))

    async def stop(self) -> None:
        """Tell every worker to return; close() then waits a little for that to be sent."""
        data = pickle.dumps(None)
        for sock in self._pushes:
            await sock.send(data)
        self._linger = STOP_LINGER_MS

    def close(self) -> None:
        for sock in self._pushes:
            sock.close(linger=self._linger)
        if hasattr(self, "_pull"):
            self._pull.close(linger=0)
        self._ctx.term()
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def zmq_worker(link: Link, requests: str, replies: str, rank: int, depth: int) -> int:
    """A worker process over zmq.asyncio: run each call until told to stop; how many."""
    zmq: Any = importlib.import_module("zmq")
    zmq_asyncio: Any = importlib.import_module("zmq.asyncio")
    target = Echo()

    async def main() -> None:
        ctx = zmq_asyncio.Context()
        pull = ctx.socket(zmq.PULL)
        push = ctx.socket(zmq.PUSH)
        try:
            pull.setsockopt(zmq.RCVHWM, depth)
            pull.connect(requests)
            push.setsockopt(zmq.SNDHWM, depth)
            push.connect(replies)
            link.ready()
            with anyio.fail_after(WORKER_TIMEOUT):
                await push.send(pickle.dumps(("hello", rank)))
                while (msg := pickle.loads(await pull.recv())) is not None:
                    call_id, method, args, kwargs = msg
                    try:
                        value, ok = getattr(target, method)(*args, **kwargs), True
                    except Exception as exc:
                        value, ok = exc, False
                    reply = (call_id, rank, ok, value)
                    await push.send(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        finally:
            # Every reply was received before the stop came: nothing is left to deliver.
            pull.close(linger=0)
            push.close(linger=0)
            ctx.term()

    run_backend("asyncio", main)
    return target.calls


async def _zmq_session(budget: Budget, capacity: int, depth: int) -> Session:
    with anyio.fail_after(SESSION_TIMEOUT):
        with Children() as kids:
            scheduler = _ZmqScheduler(WORKERS, depth)
            try:
                for rank in range(WORKERS):
                    kids.start(
                        f"zmq-worker-{rank}",
                        zmq_worker,
                        scheduler.requests[rank],
                        scheduler.replies,
                        rank,
                        depth,
                    )
                await anyio.to_thread.run_sync(kids.ready)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_watch, kids)
                    with anyio.fail_after(READY_TIMEOUT):
                        await scheduler.wait_workers()
                    tg.start_soon(scheduler.run)
                    session = await _drive(scheduler, budget)
                    tg.cancel_scope.cancel()
                await scheduler.stop()
            finally:
                scheduler.close()
            served: list[int] = await anyio.to_thread.run_sync(kids.results)
    _check_served(served, session)
    return session


def run_session(transport: Transport, budget: Budget, capacity: int, depth: int) -> Session:
    """One session on ``transport``, the scheduler under asyncio in this process."""
    session_fn = _aioshmq_session if transport == "aioshmq" else _zmq_session
    return run_backend("asyncio", session_fn, budget, capacity, depth)


def run_cancelled_session(budget: Budget, capacity: int, depth: int) -> Session:
    """The cancelled-call session (aioshmq), the scheduler under asyncio in this process."""
    return run_backend("asyncio", _aioshmq_session, budget, capacity, depth, True)


def figures(session: Session) -> dict[str, float]:
    """p50 and p99 round trip (us) and the median calls/s with WINDOW calls in flight."""
    return {**_percentiles(session.samples), "throughput": statistics.median(session.rates)}


def cancelled_figures(session: Session) -> dict[str, float]:
    """p50 and p99 (us) from a cancel to the next call's replies."""
    return _percentiles(session.cancelled)


def _percentiles(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "p50": statistics.median(samples),
        "p99": samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))],
    }

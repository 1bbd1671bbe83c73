"""The eleven scenarios: what each measures, on which transports, and how runs become figures.

Every measurement runs in fresh processes: the parent sends (or pings, or watches), children
started with "spawn" receive.  The parent's side runs under asyncio.  One measurement that
fails is reported as failed and the run goes on.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import anyio.to_thread

from .loops import (
    ReaderReport,
    Ticker,
    echo_main,
    idle_ticks,
    memcpy_gbps,
    mirror_main,
    ping,
    pump,
    reader_main,
)
from .netns import isolated, lo_bytes
from .peers import (
    AIOSHMQ,
    AIOSHMQ_ASLEEP,
    AIOSHMQ_DIRECT,
    AIOSHMQ_GET,
    AIOSHMQ_MIRROR,
    AIOSHMQ_MSGPACK,
    AIOSHMQ_PLAIN,
    AIOSHMQ_REMOTE,
    AIOSHMQ_RESERVE,
    AIOSHMQ_SYNC,
    EVENTFD,
    FASTER_FIFO,
    ICEORYX2,
    ICEORYX2_ASLEEP,
    MP_QUEUE,
    STOP,
    VLLM,
    VLLM_MAX_CHUNKS,
    ZMQ,
    ZMQ_SYNC,
    ZMQ_TCP,
    ZMQ_TCP_CURVE,
    AioshmqMirrorChannel,
    Peer,
)
from .procs import RESULT_TIMEOUT, Children, cpu_seconds, run_backend
from .report import fmt
from .results import Result
from .rpc import (
    HELD,
    WINDOW,
    WORKERS,
    Transport,
    cancelled_figures,
    figures,
    run_cancelled_session,
    run_session,
)
from .workload import Budget, Workload

KiB, MiB = 1 << 10, 1 << 20
SMALL_CAPACITY, SMALL_DEPTH = 16 * MiB, 1 << 16  # aioshmq.create()'s defaults
ARRAY_DEPTH = 4  # arrays in flight at most, for the peers (aioshmq: a ring of 4 arrays)
MEASURE_TIMEOUT = 180.0  # seconds for one measurement, whatever happens
IDLE_SETTLE = 0.3  # seconds for an idle reader to fall asleep before it is watched
CHUNK_SLACK = 64 * KiB  # room in a vLLM chunk for an array's pickle besides its bytes
FAR_READERS = 8  # readers on the far host, through one mirror or each on its own


class Bench:
    """The run so far: its budget, the figures gathered, and how many measurements failed."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.results: list[Result] = []
        self.failures = 0

    def say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def measure(
        self,
        scenario: str,
        case: str,
        peer: str,
        units: dict[str, str],
        params: dict[str, Any],
        fn: Callable[[dict[str, Any]], dict[str, float]],
        *,
        absent: str | None = None,
        cases: Mapping[str, str] | None = None,
    ) -> None:
        """Record ``fn(params)``'s figures (one per metric in ``units``; ``fn`` may add to
        ``params``), or a figure-less result saying why: ``absent`` or the failure.

        Each figure is filed under ``case``, or under ``cases[metric]``: one run can then
        give the rows of several cases."""
        cases = cases or {}
        values: dict[str, float] = {}
        note = absent or ""
        if absent is None:
            label = " + ".join(dict.fromkeys(cases.get(metric, case) for metric in units))
            self.say(f"  {label}: {peer} ...")
            started = time.monotonic()
            try:
                values = fn(params)
            except Exception as exc:
                self.failures += 1
                while isinstance(exc, ExceptionGroup) and exc.exceptions:  # a task group's
                    exc = exc.exceptions[0]
                first = str(exc).splitlines()[0] if str(exc) else ""
                note = f"failed: {type(exc).__name__}: {first}"
                self.say(f"  {label}: {peer} FAILED\n{traceback.format_exc()}")
            else:
                took = time.monotonic() - started
                shown = ", ".join(f"{k} {fmt(v, units[k])} {units[k]}" for k, v in values.items())
                self.say(f"    {shown} ({took:.1f} s)")
        for metric, unit in units.items():
            value = values.get(metric)
            filed = cases.get(metric, case)
            self.results.append(Result(scenario, filed, peer, metric, value, unit, params, note))


# -- measurements (the parent's side) --------------------------------------------------------


@dataclass
class Stream:
    counted: int  #: messages sent after the warm-up
    elapsed: float  #: from the first counted message's arrival to the last reader's STOP
    reports: list[ReaderReport]
    writer_gaps: tuple[float, float] | None  #: longest and p99 gap of the writer's ticker (ms)
    stats: dict[str, int]  #: the sender's counters (aioshmq: wake-ups sent to readers)


async def _stream(
    peer: Peer,
    workload: Workload,
    *,
    readers: int = 1,
    batch: int | None = None,
    warmup: int = 0,
    seconds: float = 0.0,
    min_messages: int = 1,
    capacity: int = SMALL_CAPACITY,
    depth: int = SMALL_DEPTH,
    tick: bool = False,
) -> Stream:
    """One writer (this process) streaming to ``readers`` child processes."""
    with anyio.fail_after(MEASURE_TIMEOUT):
        channel = peer.channel(readers, capacity=capacity, depth=depth, arrays=workload.arrays)
        try:
            tx = channel.sender()
            try:
                with Children() as kids:
                    for i in range(readers):
                        kids.start(
                            f"{peer.name}-reader-{i}",
                            reader_main,
                            channel,
                            i,
                            workload,
                            batch,
                            warmup,
                            "asyncio",
                            tick,
                        )
                    await anyio.to_thread.run_sync(kids.ready)
                    ticker = Ticker()
                    async with anyio.create_task_group() as tg:
                        if tick:
                            tg.start_soon(ticker.run)
                        sent = await pump(
                            tx,
                            workload,
                            seconds=seconds,
                            min_messages=min_messages,
                            batch=batch,
                            warmup=warmup,
                        )
                        tg.cancel_scope.cancel()
                    reports: list[ReaderReport] = await anyio.to_thread.run_sync(kids.results)
                    stats = tx.stats()
            finally:
                tx.close()
        finally:
            channel.close()
    for i, report in enumerate(reports):
        if report["count"] != sent:
            raise AssertionError(f"reader {i} received {report['count']} of {sent} messages")
    start = min(report["t_first"] for report in reports)
    elapsed = max(report["t_last"] for report in reports) - start
    return Stream(sent - warmup, elapsed, reports, ticker.summary() if tick else None, stats)


def _throughput(
    bench: Bench,
    peer: Peer,
    workload: Workload,
    params: dict[str, Any],
    *,
    readers: int = 1,
    batch: int | None = None,
    capacity: int = SMALL_CAPACITY,
    depth: int = SMALL_DEPTH,
) -> dict[str, float]:
    """The median over the budget's repeats of messages/s (small) or GB/s (arrays)."""
    budget = bench.budget
    arrays = workload.arrays
    warmup = budget.warmup_arrays if arrays else budget.warmup_messages
    min_messages = budget.min_arrays if arrays else 1
    rates: list[float] = []
    streams: list[Stream] = []
    for _ in range(budget.repeats):
        stream = run_backend(
            "asyncio",
            partial(
                _stream,
                peer,
                workload,
                readers=readers,
                batch=batch,
                warmup=warmup,
                seconds=budget.seconds,
                min_messages=min_messages,
                capacity=capacity,
                depth=depth,
            ),
        )
        streams.append(stream)
        if arrays:
            rates.append(stream.counted * workload.nbytes / stream.elapsed / 1e9)
        else:
            rates.append(stream.counted / stream.elapsed)
    params["runs"] = [round(rate, 3) for rate in rates]
    params["messages"] = [stream.counted for stream in streams]
    params["warmup"] = warmup
    params["read"] = streams[0].reports[0]["read"]
    if streams[-1].stats:  # the last run's counters, for whoever wonders about wake-ups
        params["writer_stats"] = streams[-1].stats
        params["reader_stats"] = [report["stats"] for report in streams[-1].reports]
    return {"throughput": statistics.median(rates)}


LATENCY_BLOCK = 100  #: round trips a peer makes in its turn when peers take turns


async def _pingpong(
    peers: Sequence[Peer], workload: Workload, budget: Budget, split: bool = False
) -> list[list[float]]:
    """Round trips from this process through a child per peer that echoes, over two
    channels each.  Several peers take turns, LATENCY_BLOCK round trips at a time, so that
    each sees the machine as the others do: on a shared VM the floor moves by half within
    minutes, and a ratio of figures taken one after the other moves with it."""
    with anyio.fail_after(MEASURE_TIMEOUT * len(peers)), ExitStack() as stack:
        senders = []
        for peer in peers:
            forward, back = peer.channel(1), peer.channel(1)
            stack.callback(back.close)
            stack.callback(forward.close)
            senders.append((forward, back, forward.sender()))
            stack.callback(senders[-1][2].close)
        kids = stack.enter_context(Children())
        backend = "uvloop" if _on_uvloop() else "asyncio"
        cpus = sorted(os.sched_getaffinity(0))
        if split:  # the echoes on one CPU (they inherit it), this process on another
            os.sched_setaffinity(0, {cpus[-1]})
        try:
            for peer, (forward, back, _) in zip(peers, senders, strict=True):
                kids.start(f"{peer.name}-echo", echo_main, forward, back, backend)
        finally:
            os.sched_setaffinity(0, {cpus[0]} if split else cpus)
        if split:
            stack.callback(os.sched_setaffinity, 0, cpus)
        await anyio.to_thread.run_sync(kids.ready)
        pairs = []
        for _, back, tx in senders:
            pairs.append((tx, back.receiver(0)))
            stack.callback(pairs[-1][1].close)
        warmup = budget.warmup_round_trips
        for tx, rx in pairs:
            await ping(tx, rx, workload, warmup=warmup, rounds=0, seconds=0, stop=False)
        samples: list[list[float]] = [[] for _ in peers]
        deadline = time.monotonic() + budget.latency_seconds * len(peers)
        first = warmup
        while min(map(len, samples)) < budget.round_trips and time.monotonic() < deadline:
            turns = list(zip(pairs, samples, strict=True))
            if first // LATENCY_BLOCK % 2:  # each peer goes first as often as the others
                turns.reverse()
            for (tx, rx), kept in turns:
                kept += await ping(
                    tx,
                    rx,
                    workload,
                    warmup=0,
                    rounds=min(LATENCY_BLOCK, budget.round_trips - len(kept)),
                    seconds=float("inf"),
                    first=first,
                    stop=False,
                )
            first += LATENCY_BLOCK
        for tx, _ in pairs:
            await tx.send(STOP)
        await anyio.to_thread.run_sync(kids.results)
    return samples


def _on_uvloop() -> bool:
    loop = asyncio.get_running_loop()
    return type(loop).__module__.startswith("uvloop")


def _latency(
    bench: Bench,
    peer: Peer,
    params: dict[str, Any],
    *,
    hogs: int = 0,
    one_cpu: bool = False,
    split: bool = False,
    beside: tuple[Sequence[Peer], dict[str, list[float]]] | None = None,
    backend: str = "asyncio",
) -> dict[str, float]:
    """Round trips; with ``hogs``, that many busy-looping processes load the CPUs meanwhile;
    with ``one_cpu``, both processes of the ping-pong share one CPU; with ``split``, each
    side has a CPU of its own; with ``beside``, this peer and those take turns in one run
    (the first of their calls makes the run and leaves the others' samples in the dict)."""
    others: Sequence[Peer] = () if beside is None else beside[0]
    if beside is not None and peer.name in beside[1]:
        samples = beside[1].pop(peer.name)
    else:
        busy = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(hogs)
        ]
        cpus = os.sched_getaffinity(0)
        if one_cpu:  # the processes started meanwhile inherit it
            os.sched_setaffinity(0, {min(cpus)})
        peers = [peer, *others]
        try:
            runs = run_backend(backend, _pingpong, peers, Workload("small"), bench.budget, split)
        finally:
            os.sched_setaffinity(0, cpus)
            for proc in busy:
                proc.kill()
                proc.wait()
        samples = runs[0]
        if beside is not None:
            for other, run in zip(others, runs[1:], strict=True):
                beside[1][other.name] = run
    if others:
        params["taking_turns_with"] = [other.name for other in others]
    samples.sort()
    params["round_trips"] = len(samples)
    return {
        "p50": statistics.median(samples),
        "p99": samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))],
    }


async def _idle(peer: Peer, backend: str, seconds: float) -> tuple[float, float]:
    """CPU seconds used by a reader process awaiting an empty ring, and the wall seconds."""
    with anyio.fail_after(MEASURE_TIMEOUT):
        channel = peer.channel(1)
        tx = channel.sender()
        try:
            with Children() as kids:
                kid = kids.start(
                    f"{peer.name}-idle-reader-{backend}",
                    reader_main,
                    channel,
                    0,
                    Workload("small"),
                    None,
                    0,
                    backend,
                    False,
                )
                await anyio.to_thread.run_sync(kids.ready)
                await tx.wait_ready()
                await anyio.sleep(min(IDLE_SETTLE, seconds))  # the reader sleeps in get() now
                cpu0, t0 = cpu_seconds(kid.pid), time.monotonic()
                await anyio.sleep(seconds)
                cpu1, t1 = cpu_seconds(kid.pid), time.monotonic()
                await tx.send(STOP)
                await anyio.to_thread.run_sync(kids.results)
        finally:
            tx.close()
            channel.close()
    return cpu1 - cpu0, t1 - t0


def _idle_cost(
    peer: Peer, backend: str, seconds: float, params: dict[str, Any]
) -> dict[str, float]:
    cpu, wall = run_backend("asyncio", _idle, peer, backend, seconds)
    params["cpu_seconds"], params["wall_seconds"] = cpu, round(wall, 3)
    return {"cpu": 100.0 * cpu / wall}


def _memcpy(nbytes: int, seconds: float, params: dict[str, Any]) -> dict[str, float]:
    return {"throughput": memcpy_gbps(nbytes, seconds)}


# -- the scenarios ---------------------------------------------------------------------------


def small(bench: Bench) -> None:
    """100-byte objects (the bench's dict, and a plain tuple), 1 writer -> 1 reader: one per
    put, and in batches of 64."""
    for kind, what in (("small", ""), ("tuple", ", a tuple")):
        workload = Workload(kind)  # type: ignore[arg-type]
        for case, batch in ((f"one per put{what}", None), (f"batches of 64{what}", 64)):
            peers = [AIOSHMQ, MP_QUEUE, ZMQ, ZMQ_SYNC, FASTER_FIFO, ICEORYX2, VLLM]
            if not batch:
                peers.insert(1, AIOSHMQ_SYNC)
            for peer in peers:
                params: dict[str, Any] = {
                    "readers": 1,
                    "object_bytes": 100,
                    "object": "tuple" if kind == "tuple" else "dict",
                    "batch": batch or 1,
                    "how": peer.batch if batch else peer.how,
                    "capacity": SMALL_CAPACITY,
                    "depth": SMALL_DEPTH,
                    "backend": "asyncio",
                }
                if peer is VLLM:
                    params["depth"] = VLLM_MAX_CHUNKS
                fn = partial(_throughput, bench, peer, workload, batch=batch)
                bench.measure(
                    "small",
                    case,
                    peer.name,
                    {"throughput": "msg/s"},
                    params,
                    fn,
                    absent=peer.missing(),
                )


def _numpy_missing() -> str | None:
    return None if importlib.util.find_spec("numpy") else "not installed (numpy)"


def _torch_missing() -> str | None:
    """Why tensors cannot be measured here (torch wraps numpy's array), or None."""
    if no_numpy := _numpy_missing():
        return no_numpy
    return None if importlib.util.find_spec("torch") else "not installed (torch)"


def large(bench: Bench) -> None:
    """numpy arrays of 512 KiB, 1 MiB and 64 MiB in GB/s, next to memcpy into shared memory."""
    budget = bench.budget
    no_numpy = _numpy_missing()
    for nbytes, case in ((512 * KiB, "512 KiB"), (1 * MiB, "1 MiB"), (64 * MiB, "64 MiB")):
        workload = Workload("array", nbytes)
        bench.measure(
            "large",
            case,
            "memcpy",
            {"throughput": "GB/s"},
            {"bytes": nbytes, "how": "numpy.copyto into an mmap'd memfd, best of several"},
            partial(_memcpy, nbytes, budget.memcpy_seconds),
            absent=no_numpy,
        )
        capacity = 4 * nbytes
        bench.measure(
            "large",
            case,
            "aioshmq",
            {"throughput": "GB/s"},
            {
                "bytes": nbytes,
                "capacity": capacity,
                "depth": 16,
                "how": "put, out of band; read in a lease",
            },
            partial(_throughput, bench, AIOSHMQ, workload, capacity=capacity, depth=16),
            absent=no_numpy,
        )
        for peer, how in (
            (MP_QUEUE, "put/get, pickled in-band"),
            (ZMQ, "send(copy=False) of the buffer, recv(copy=False)"),
        ):
            params = {"bytes": nbytes, "depth": ARRAY_DEPTH, "how": how}
            bench.measure(
                "large",
                case,
                peer.name,
                {"throughput": "GB/s"},
                params,
                partial(_throughput, bench, peer, workload, depth=ARRAY_DEPTH),
                absent=no_numpy or peer.missing(),
            )
        chunk = nbytes + CHUNK_SLACK  # a chunk holds one array: none goes over zmq instead
        bench.measure(
            "large",
            case,
            VLLM.name,
            {"throughput": "GB/s"},
            {
                "bytes": nbytes,
                "capacity": ARRAY_DEPTH * chunk,
                "depth": ARRAY_DEPTH,
                "how": "enqueue/dequeue, pickled (out-of-band from 1 MiB) into a chunk",
            },
            partial(
                _throughput,
                bench,
                VLLM,
                workload,
                capacity=ARRAY_DEPTH * chunk,
                depth=ARRAY_DEPTH,
            ),
            absent=no_numpy or VLLM.missing(),
        )
    workload = Workload("array", 64 * MiB)
    bench.measure(
        "large",
        "64 MiB via a 16 MiB ring",
        "aioshmq",
        {"throughput": "GB/s"},
        {
            "bytes": 64 * MiB,
            "capacity": 16 * MiB,
            "how": "put, sent in fragments; read in a lease (reassembled)",
        },
        partial(_throughput, bench, AIOSHMQ, workload, capacity=16 * MiB, depth=16),
        absent=no_numpy,
    )


def latency(bench: Bench) -> None:
    """Ping-pong of a 100-byte object between two processes: p50 and p99 round trip, with
    aioshmq's default short spin and with its readers sleeping at once (every message then
    has to wake its peer, as the eventfd floor does)."""
    hows = {AIOSHMQ.name: "two rings, default spin", VLLM.name: f"two queues, {VLLM.how}"}
    for peer in (AIOSHMQ, EVENTFD, ZMQ, MP_QUEUE, FASTER_FIFO, VLLM):
        how = hows.get(peer.name, peer.how)
        bench.measure(
            "latency",
            "round trip",
            peer.name,
            {"p50": "us", "p99": "us"},
            {"object_bytes": 100, "how": how, "backend": "asyncio"},
            partial(_latency, bench, peer),
            absent=peer.missing(),
        )
    # Every message wakes a sleeping peer, as the floor's do, and aioshmq, the floor and
    # iceoryx2 (its subscribers asleep in an event listener) take turns in one run, so that
    # their ratios are not the VM's drift between two runs.  Where
    # the two sides run decides the figure more than either transport does: a wake-up on
    # the waker's own CPU is a context switch, one on the other CPU wakes a halted vCPU.
    # Left to the scheduler, one pair may share a CPU while the other does not.
    hogs = len(os.sched_getaffinity(0))
    placements = (
        ("", "the two sides on two CPUs"),
        (", unpinned", "where the scheduler puts them"),
        (", both on one CPU", "both processes on one CPU"),
        (f", {hogs} busy processes beside", "where the scheduler puts them, beside busy ones"),
    )
    for backend in ("asyncio", "uvloop"):
        absent = None if importlib.util.find_spec(backend) else "not installed"
        for suffix, where in placements:
            if backend == "uvloop" and suffix:
                continue  # one placement is enough to compare the loops
            case = "round trip, peer asleep" + (", uvloop" if backend == "uvloop" else suffix)
            asleep = (AIOSHMQ_ASLEEP, EVENTFD, ICEORYX2_ASLEEP)
            present = [peer for peer in asleep if not peer.missing()]
            shared: dict[str, list[float]] = {}
            for peer in asleep:
                others = [other for other in present if other is not peer]
                bench.measure(
                    "latency",
                    case,
                    peer.name,
                    {"p50": "us", "p99": "us"},
                    {"object_bytes": 100, "how": peer.how, "backend": backend, "cpus": where},
                    partial(
                        _latency,
                        bench,
                        peer,
                        beside=(others, shared),
                        backend=backend,
                        split=not suffix,
                        one_cpu="one CPU" in suffix,
                        hogs=hogs if "busy" in suffix else 0,
                    ),
                    absent=absent or peer.missing(),
                )
    # A busy machine: as many busy-looping processes as CPUs.  A reader that spins there
    # takes the CPU its peer needs; the default (adaptive) spin must not lose to spin=0.
    for peer, how in ((AIOSHMQ, "two rings, default spin"), (AIOSHMQ_ASLEEP, AIOSHMQ_ASLEEP.how)):
        bench.measure(
            "latency",
            f"round trip, {hogs} busy processes beside",
            "aioshmq" if peer is AIOSHMQ else "aioshmq spin=0",
            {"p50": "us", "p99": "us"},
            {"object_bytes": 100, "how": how, "backend": "asyncio", "busy_processes": hogs},
            partial(_latency, bench, peer, hogs=hogs),
        )
    # Both sides on one CPU: a spinning reader then keeps its writer off the CPU for the
    # whole spin, which is when a fixed spin cost 5x spin=0's round trip.
    for peer, how in ((AIOSHMQ, "two rings, default spin"), (AIOSHMQ_ASLEEP, AIOSHMQ_ASLEEP.how)):
        bench.measure(
            "latency",
            "round trip, both processes on one CPU",
            "aioshmq" if peer is AIOSHMQ else "aioshmq spin=0",
            {"p50": "us", "p99": "us"},
            {"object_bytes": 100, "how": how, "backend": "asyncio", "cpus": 1},
            partial(_latency, bench, peer, one_cpu=True),
        )


def broadcast(bench: Bench) -> None:
    """100-byte objects from 1 writer to 1, 2 and 4 readers, each receiving every message:
    aioshmq and vLLM's MessageQueue, the two transports here that broadcast."""
    workload = Workload("small")
    for readers in (1, 2, 4):
        case = f"1 -> {readers} reader{'s' if readers > 1 else ''}"
        for peer, how in (
            (AIOSHMQ, "put/get, one message per put"),
            (ICEORYX2, ICEORYX2.how),
            (VLLM, "enqueue/dequeue, one message per enqueue, sync (no async API)"),
        ):
            bench.measure(
                "broadcast",
                case,
                peer.name,
                {"throughput": "msg/s"},
                {"readers": readers, "object_bytes": 100, "how": how},
                partial(_throughput, bench, peer, workload, readers=readers),
                absent=peer.missing(),
            )


def idle(bench: Bench) -> None:
    """CPU used by a reader process awaiting an empty ring, as % of a core, watched from
    IDLE_SETTLE after the writer knows it is there.  vLLM's reader blocks in ``dequeue()``
    and iceoryx2's sleeping subscriber in its listener whatever the event loop, so each is
    watched once, under asyncio; a reader that spins for a while before it sleeps shows it
    here in proportion to the time watched."""
    seconds = bench.budget.idle_seconds
    how = "utime+stime from /proc/<pid>/stat"
    for backend, module in (("asyncio", "asyncio"), ("uvloop", "uvloop"), ("trio", "trio")):
        absent = None if importlib.util.find_spec(module) else "not installed"
        bench.measure(
            "idle",
            backend,
            "aioshmq",
            {"cpu": "% core"},
            {"seconds": seconds, "settle": IDLE_SETTLE, "how": f"get(); {how}"},
            partial(_idle_cost, AIOSHMQ, backend, seconds),
            absent=absent,
        )
    bench.measure(
        "idle",
        "asyncio",
        ICEORYX2_ASLEEP.name,
        {"cpu": "% core"},
        {
            "seconds": seconds,
            "settle": IDLE_SETTLE,
            "how": f"Listener.timed_wait() of a sleeping subscriber; {how}",
        },
        partial(_idle_cost, ICEORYX2_ASLEEP, "asyncio", seconds),
        absent=ICEORYX2_ASLEEP.missing(),
    )
    bench.measure(
        "idle",
        "asyncio",
        VLLM.name,
        {"cpu": "% core"},
        {"seconds": seconds, "settle": IDLE_SETTLE, "how": f"dequeue(); {how}"},
        partial(_idle_cost, VLLM, "asyncio", seconds),
        absent=VLLM.missing(),
    )


def lag(bench: Bench) -> None:
    """The gaps of a 1 ms ticker in every loop while arrays stream to two readers, next to
    the same ticker in a loop with nothing else to do."""
    nbytes = 1 * MiB
    count = bench.budget.lag_bytes // nbytes
    workload = Workload("array", nbytes)
    case = f"{count} x 1 MiB to 2 readers"
    loops = ("writer", "reader 0", "reader 1")
    gap_units = {f"{loop} {what} gap": "ms" for what in ("max", "p99") for loop in loops}

    def measure(params: dict[str, Any], peer: Peer = AIOSHMQ) -> dict[str, float]:
        stream = run_backend(
            "asyncio",
            partial(_stream, peer, workload, readers=2, min_messages=count, tick=True),
        )
        gaps = [stream.writer_gaps, *(report["gaps"] for report in stream.reports)]
        values = {"throughput": stream.counted * nbytes / stream.elapsed / 1e9}
        for loop, summary in zip(loops, gaps, strict=True):
            assert summary is not None
            values[f"{loop} max gap"], values[f"{loop} p99 gap"] = summary
        params["read"] = stream.reports[0]["read"]
        params["writer_stats"] = stream.stats
        params["reader_stats"] = [report["stats"] for report in stream.reports]
        return values

    def alone(params: dict[str, Any]) -> dict[str, float]:
        longest, p99 = run_backend("asyncio", idle_ticks, bench.budget.latency_seconds)
        return {key: longest if "max" in key else p99 for key in gap_units}

    # Plain beside CURVE: what the encryption's CPU, on as few cores as there are
    # processes, adds to the lag.
    ticker = "a ticker task in each of the 3 loops"
    rows = [(case, AIOSHMQ, f"put/get, {ticker}", None)]
    rows += [
        (f"{count} x 1 MiB to 2 remote readers", peer, f"{peer.how}; {ticker}", peer.missing())
        for peer in (AIOSHMQ_REMOTE, AIOSHMQ_PLAIN)
    ]
    for row_case, peer, how, absent in rows:
        bench.measure(
            "lag",
            row_case,
            peer.name,
            {**gap_units, "throughput": "GB/s"},
            {
                "bytes": count * nbytes,
                "message_bytes": nbytes,
                "readers": 2,
                "tick_ms": 1.0,
                "capacity": SMALL_CAPACITY,
                "backend": "asyncio",
                "how": how,
            },
            partial(measure, peer=peer),
            absent=_numpy_missing() or absent,
        )
    bench.measure(
        "lag",
        case,
        "ticker alone",
        gap_units,
        {"seconds": bench.budget.latency_seconds, "how": "the same ticker, no traffic"},
        alone,
    )


def _rpc_figures(bench: Bench, transport: Transport, params: dict[str, Any]) -> dict[str, float]:
    session = run_session(transport, bench.budget, SMALL_CAPACITY, SMALL_DEPTH)
    params["round_trips"] = len(session.samples)
    params["runs"] = [round(rate, 1) for rate in session.rates]
    params["calls_counted"] = session.counted
    params["calls"] = session.calls
    if session.stats:
        params["client_stats"] = session.stats
    return figures(session)


def _rpc_cancelled_figures(bench: Bench, params: dict[str, Any]) -> dict[str, float]:
    session = run_cancelled_session(bench.budget, SMALL_CAPACITY, SMALL_DEPTH)
    params["round_trips"] = len(session.cancelled)
    params["calls"] = session.calls
    params["client_stats"] = session.stats
    return cancelled_figures(session)


def rpc(bench: Bench) -> None:
    """One async scheduler calls ``echo(x)`` on 4 worker processes, each call going to every
    worker and returning their 4 replies: round trips of one call at a time (p50, p99), and
    calls per second with 256 calls kept in flight.  One session of processes per transport
    gives both.  A session of its own times a cancelled call: from the cancel of a call the
    workers have run for a while to the replies of the next call (aioshmq only)."""
    hows: dict[Transport, str] = {
        "aioshmq": "rpc.Client.call/submit -> rpc.serve",
        "zmq.asyncio": "a PUSH per worker over ipc://, replies to one PULL, futures by call id",
    }
    for transport, how in hows.items():
        absent = ZMQ.missing() if transport == ZMQ.name else None
        bench.measure(
            "rpc",
            "one call at a time",
            transport,
            {"p50": "us", "p99": "us", "throughput": "calls/s"},
            {
                "workers": WORKERS,
                "window": WINDOW,
                "object_bytes": 100,
                "backend": "asyncio",
                "how": f"{how}; {WINDOW} in flight: each completion submits the next call",
            },
            partial(_rpc_figures, bench, transport),
            absent=absent,
            cases={"throughput": f"{WINDOW} calls in flight"},
        )
    bench.measure(
        "rpc",
        "a cancelled call, then the next",
        "aioshmq",
        {"p50": "us", "p99": "us"},
        {
            "workers": WORKERS,
            "held_ms": HELD * 1000,
            "object_bytes": 100,
            "backend": "asyncio",
            "how": (
                f"submit hold() to every worker; {HELD * 1000:g} ms later cancel it and "
                "call echo(): the time from the cancel to echo's replies"
            ),
        },
        partial(_rpc_cancelled_figures, bench),
    )


async def _wire(peer: Peer, readers: int, messages: int) -> tuple[int, int]:
    """``messages`` small objects streamed from this process to ``readers`` far reader
    processes (through a mirror process of their own for a mirror channel): the bytes sent
    on ``lo`` from before the writer existed until every process has exited, and how many
    messages were sent."""
    workload = Workload("small")
    before = lo_bytes()
    with anyio.fail_after(MEASURE_TIMEOUT):
        channel = peer.channel(readers)
        try:
            tx = channel.sender()
            try:
                with Children() as kids:
                    relay = None
                    if isinstance(channel, AioshmqMirrorChannel):
                        relay = kids.start(f"{peer.name}-mirror", mirror_main, channel)
                    far = [
                        kids.start(
                            f"{peer.name}-far-reader-{i}",
                            reader_main,
                            channel,
                            i,
                            workload,
                            None,
                            0,
                            "asyncio",
                            False,
                        )
                        for i in range(readers)
                    ]
                    await anyio.to_thread.run_sync(kids.ready)
                    sent = await pump(tx, workload, seconds=0.0, min_messages=messages, batch=None)
                    reports: list[ReaderReport] = await anyio.to_thread.run_sync(
                        lambda: [kid.expect("result", RESULT_TIMEOUT) for kid in far]
                    )
                    tx.close()  # the end of the stream: the mirror passes it on and exits
                    if relay is not None:
                        await anyio.to_thread.run_sync(relay.expect, "result", RESULT_TIMEOUT)
            finally:
                tx.close()
        finally:
            channel.close()
    after = lo_bytes()  # every process is gone: their connections are closed
    for i, report in enumerate(reports):
        if report["count"] != sent:
            raise AssertionError(f"far reader {i} received {report['count']} of {sent} messages")
    return after - before, sent


def _wire_bytes(bench: Bench, peer: Peer, readers: int, params: dict[str, Any]) -> dict[str, float]:
    (nbytes, sent), where = isolated(
        run_backend, "asyncio", _wire, peer, readers, bench.budget.wire_messages
    )
    params["lo_bytes"], params["messages"], params["network"] = nbytes, sent, where
    params["how"] = f"{params['how']}; every byte sent on lo, in {where}"
    return {"wire bytes": nbytes / sent}


def remote(bench: Bench) -> None:
    """Readers on another host, here over TCP loopback between processes (aioshmq's remote
    path, CURVE on unless said otherwise) against raw sync pyzmq PUSH/PULL on the same link:
    100-byte objects (msg/s), 64 MiB arrays (GB/s), the ping-pong round trip, and the bytes
    sent on the network per message to 1 and to 8 far readers, through one mirror and
    directly."""
    small_workload = Workload("small")
    peers = (AIOSHMQ_REMOTE, ZMQ_TCP_CURVE, AIOSHMQ_PLAIN, ZMQ_TCP)
    for peer in peers:
        bench.measure(
            "remote",
            "100 B, 1 -> 1 remote reader",
            peer.name,
            {"throughput": "msg/s"},
            {
                "readers": 1,
                "object_bytes": 100,
                "capacity": SMALL_CAPACITY,
                "depth": SMALL_DEPTH,
                "backend": "asyncio",
                "how": peer.how,
            },
            partial(_throughput, bench, peer, small_workload),
            absent=peer.missing(),
        )
    nbytes = 64 * MiB
    arrays = Workload("array", nbytes)
    no_numpy = _numpy_missing()
    for peer in peers:
        if peer in (ZMQ_TCP, ZMQ_TCP_CURVE):
            params: dict[str, Any] = {
                "bytes": nbytes,
                "depth": ARRAY_DEPTH,
                "how": f"{peer.how}: the buffer out of band, as a second frame, "
                "send_multipart(copy=False), recv_multipart(copy=False)",
            }
            fn = partial(_throughput, bench, peer, arrays, depth=ARRAY_DEPTH)
        else:
            params = {"bytes": nbytes, "capacity": 4 * nbytes, "depth": 16, "how": peer.how}
            fn = partial(_throughput, bench, peer, arrays, capacity=4 * nbytes, depth=16)
        bench.measure(
            "remote",
            "64 MiB arrays",
            peer.name,
            {"throughput": "GB/s"},
            params,
            fn,
            absent=no_numpy or peer.missing(),
        )
    for peer in peers:
        pair = peer in (ZMQ_TCP, ZMQ_TCP_CURVE)
        how = "a PUSH/PULL pair" if pair else "two rings, each read remotely"
        bench.measure(
            "remote",
            "round trip",
            peer.name,
            {"p50": "us", "p99": "us"},
            {"object_bytes": 100, "backend": "asyncio", "how": f"{peer.how}; {how}"},
            partial(_latency, bench, peer),
            absent=peer.missing(),
        )
    wire: list[tuple[int, Peer]] = [
        (1, AIOSHMQ_MIRROR),
        (1, AIOSHMQ_DIRECT),
        (1, ZMQ_TCP),
        (FAR_READERS, AIOSHMQ_MIRROR),
        (FAR_READERS, AIOSHMQ_DIRECT),
    ]
    for readers, peer in wire:
        case = f"{readers} far reader{'s' if readers > 1 else ''}"
        bench.measure(
            "remote",
            case,
            peer.name,
            {"wire bytes": "B/msg"},
            {
                "readers": readers,
                "object_bytes": 100,
                "messages": bench.budget.wire_messages,
                "how": peer.how,
            },
            partial(_wire_bytes, bench, peer, readers),
            absent=peer.missing(),
        )


def tensors(bench: Bench) -> None:
    """uint8 CPU torch tensors of 16 MiB and 256 MiB (the tiny budget: 64 MiB) in GB/s,
    1 writer -> 1 reader, read with get() (a tensor owning a copy) and inside a lease (a
    tensor viewing the ring), each next to the numpy array that the tensor wraps, sent and
    read the same way: a tensor's bytes travel out of band as an array's do, so the two
    should be level (the tensor within 10% of the array)."""
    no_numpy, no_torch = _numpy_missing(), _torch_missing()
    reads = "get() copies out, lease() views the ring"
    for nbytes in dict.fromkeys((16 * MiB, bench.budget.tensor_bytes)):
        capacity = 4 * nbytes  # each message one record: at most half the ring
        for peer, read in ((AIOSHMQ_GET, "get"), (AIOSHMQ, "lease")):
            for name, workload, what, absent in (
                ("aioshmq", Workload("tensor", nbytes), "a uint8 CPU tensor", no_torch),
                ("aioshmq numpy", Workload("array", nbytes), "the array it wraps", no_numpy),
            ):
                bench.measure(
                    "tensors",
                    f"{nbytes // MiB} MiB, put + {read}",
                    name,
                    {"throughput": "GB/s"},
                    {
                        "bytes": nbytes,
                        "payload": workload.kind,
                        "dtype": "uint8",
                        "capacity": capacity,
                        "depth": 16,
                        "how": f"put({what}), out of band; {reads}",
                    },
                    partial(_throughput, bench, peer, workload, capacity=capacity, depth=16),
                    absent=absent,
                )


def reserve(bench: Bench) -> None:
    """64 MiB numpy arrays written in place, 1 writer -> 1 reader (lease), in GB/s: the
    writer fills ``reserve_array()``'s view of the ring with numpy.copyto from a prepared
    array, the very copy that the memcpy floor times (so its share of memcpy is what the
    ring costs besides the copy), next to that floor and to put() of the same array."""
    nbytes = 64 * MiB
    capacity = 4 * nbytes  # a reserved message is one record: at most half the ring
    workload = Workload("array", nbytes)
    no_numpy = _numpy_missing()
    case = "64 MiB"
    bench.measure(
        "reserve",
        case,
        "memcpy",
        {"throughput": "GB/s"},
        {"bytes": nbytes, "how": "numpy.copyto into an mmap'd memfd, best of several"},
        partial(_memcpy, nbytes, bench.budget.memcpy_seconds),
        absent=no_numpy,
    )
    for name, peer, how in (
        ("aioshmq", AIOSHMQ_RESERVE, AIOSHMQ_RESERVE.how),
        ("aioshmq put", AIOSHMQ, "put(array), out of band (copied into the ring), lease"),
    ):
        bench.measure(
            "reserve",
            case,
            name,
            {"throughput": "GB/s"},
            {"bytes": nbytes, "capacity": capacity, "depth": 16, "how": how},
            partial(_throughput, bench, peer, workload, capacity=capacity, depth=16),
            absent=no_numpy or peer.missing(),
        )


def serializers(bench: Bench) -> None:
    """100-byte objects (the bench's dict, and a plain tuple), 1 writer -> 1 reader, one per
    put, in msg/s: a ring with serializer="msgpack" (msgspec) next to one with the default
    pickle.  The reader checks every message as in ``small``."""
    for kind, what in (("small", ""), ("tuple", ", a tuple")):
        workload = Workload(kind)  # type: ignore[arg-type]
        for name, peer, serializer in (
            ("aioshmq", AIOSHMQ_MSGPACK, "msgpack"),
            ("aioshmq pickle", AIOSHMQ, "pickle"),
        ):
            bench.measure(
                "serializers",
                f"one per put{what}",
                name,
                {"throughput": "msg/s"},
                {
                    "readers": 1,
                    "object_bytes": 100,
                    "object": "tuple" if kind == "tuple" else "dict",
                    "serializer": serializer,
                    "capacity": SMALL_CAPACITY,
                    "depth": SMALL_DEPTH,
                    "backend": "asyncio",
                    "how": f'async put/get, serializer="{serializer}"',
                },
                partial(_throughput, bench, peer, workload),
                absent=peer.missing(),
            )


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: Callable[[Bench], None]


SCENARIOS = (
    Scenario("small", "small objects (100 B), 1 writer -> 1 reader", small),
    Scenario("large", "large payloads (numpy arrays), 1 writer -> 1 reader", large),
    Scenario("latency", "ping-pong latency of a 100-byte object", latency),
    Scenario("broadcast", "broadcast of 100-byte objects, 1 writer -> N readers", broadcast),
    Scenario("idle", "idle cost: a reader awaiting an empty ring", idle),
    Scenario("lag", "event-loop lag: 1 ms ticker while 1 MiB arrays stream", lag),
    Scenario("rpc", f"RPC: 1 async scheduler -> {WORKERS} worker processes, echo(100 B)", rpc),
    Scenario("remote", "remote readers over TCP loopback (aioshmq.remote) and raw pyzmq", remote),
    Scenario(
        "tensors",
        "CPU torch tensors (aioshmq) next to the same bytes as numpy arrays, 1 writer -> 1 reader",
        tensors,
    ),
    Scenario(
        "reserve",
        "64 MiB written in place by reserve_array() (aioshmq) next to put() and memcpy",
        reserve,
    ),
    Scenario(
        "serializers",
        'small objects (100 B), serializer="msgpack" (aioshmq) next to pickle, 1 -> 1 reader',
        serializers,
    ),
)
SCENARIO_NAMES = tuple(scenario.name for scenario in SCENARIOS)

__all__ = ["SCENARIOS", "SCENARIO_NAMES", "Bench", "Scenario"]

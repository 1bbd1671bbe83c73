"""Batched RPC: results, subsets, unique replies, errors, batching, death, cancellation."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import secrets
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from conftest import Children, Recorder, backend_name, run_backend

import aioshmq
from aioshmq import rpc
from aioshmq.serialize.pickling import PickleSerializer

pytestmark = pytest.mark.anyio

TIMEOUT = 30  # seconds for any one test's waits on worker processes


class NoPickle(Exception):
    """An exception that pickles but cannot be loaded (its __init__ needs two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


class Target(Recorder):
    """What the test workers serve."""

    def __init__(self, rank: int, gate: Any = None) -> None:
        super().__init__()
        self.rank = rank
        self.gate = gate

    def whoami(self) -> int:
        return self.rank

    def add(self, a: int, b: int = 0) -> int:
        return a + b

    async def async_add(self, a: int, b: int) -> int:
        await anyio.lowlevel.checkpoint()
        return a + b

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def fail_unless(self, rank: int) -> int:
        if self.rank != rank:
            raise RuntimeError(f"worker {self.rank} fails on purpose")
        return self.rank

    def fail_oddly(self) -> None:
        raise NoPickle("a", "b")

    def lock(self) -> Any:
        return threading.Lock()  # a result that cannot be pickled

    def wait_gate(self, x: Any) -> Any:
        assert self.gate is not None and self.gate.wait(TIMEOUT)
        return x

    def die_if(self, rank: int) -> int:
        if self.rank == rank:
            os.kill(os.getpid(), 9)
        return self.rank

    def total(self, arr: np.ndarray) -> float:  # type: ignore[type-arg]
        return float(arr.sum())

    def scaled(self, arr: np.ndarray, k: float) -> np.ndarray:  # type: ignore[type-arg]
        return arr * k

    def _private(self) -> None:
        raise AssertionError("must not be callable")


def times_rank(target: Target, k: int) -> int:
    """A function sent by reference and run as ``times_rank(target, k)``."""
    return target.rank * k


def _worker(
    handle: rpc.RpcHandle, rank: int, backend: str, sync: bool, spin: float, gate: Any
) -> None:
    target = Target(rank, gate)
    if sync:
        rpc.serve_sync(handle, rank, target)
    else:
        run_backend(backend, lambda: rpc.serve(handle, rank, target, spin=spin))


async def _start(
    children: Children,
    client: rpc.Client,
    anyio_backend: object,
    *,
    method: str = "fork",
    sync: bool = False,
    spin: float = 0.0002,
    gate: Any = None,
) -> list[multiprocessing.process.BaseProcess]:
    """One worker process per rank, started with ``method``; returns once all are ready."""
    procs = []
    for rank in range(client.handle.workers):
        procs.append(
            await anyio.to_thread.run_sync(
                children.start,
                method,
                _worker,
                client.handle,
                rank,
                backend_name(anyio_backend),
                sync,
                spin,
                gate,
            )
        )
    with anyio.fail_after(TIMEOUT):
        await client.wait_workers()
    return procs


async def _exit_codes(children: Children) -> list[int | None]:
    return await anyio.to_thread.run_sync(children.join, TIMEOUT)


async def test_results_subsets_and_unique_reply(anyio_backend: object, children: Children) -> None:
    async with rpc.Client(3) as client:
        await _start(children, client, anyio_backend)
        with anyio.fail_after(TIMEOUT):
            assert await client.call("whoami") == [0, 1, 2]
            assert await client.call("add", 1, b=2) == [3, 3, 3]
            assert await client.call("async_add", 2, 5) == [7, 7, 7]
            assert await client.call("whoami", workers=[2, 0]) == [2, 0]
            assert await client.call("whoami", unique_reply_rank=1) == 1
            assert await client.call(times_rank, 10) == [0, 10, 20]
            # Only worker 2 runs it; the others never see it.
            assert await client.call("record", "x", workers=[2]) == ["x"]
            assert await client.call("recorded") == [[], [], ["x"]]
            # Every worker runs a unique-reply call; only rank 1 answers.
            assert await client.call("record", "y", unique_reply_rank=1) == "y"
            assert await client.call("recorded") == [["y"], ["y"], ["x", "y"]]
            stats = client.statistics()
            assert stats.workers == 3 and stats.calls_submitted == 10 and stats.calls_pending == 0
            assert stats.workers_attached == 3
    assert await _exit_codes(children) == [0, 0, 0]  # the client closed: serve() returned


async def test_worker_errors_come_back_and_the_worker_goes_on(
    anyio_backend: object, children: Children
) -> None:
    async with rpc.Client(2) as client:
        await _start(children, client, anyio_backend)
        with anyio.fail_after(TIMEOUT):
            with pytest.raises(ValueError, match="boom") as info:
                await client.call("fail", "boom")
            cause = info.value.__cause__
            assert isinstance(cause, rpc.RemoteTraceback)
            assert "in fail" in str(cause) and "raise ValueError(message)" in str(cause)
            assert any("worker 0" in note for note in info.value.__notes__)

            with pytest.raises(AttributeError, match="no method 'nope'"):
                await client.call("nope")
            with pytest.raises(AttributeError, match="private"):
                await client.call("_private")
            with pytest.raises(TypeError, match="add"):
                await client.call("add", 1, 2, 3)
            with pytest.raises(rpc.RemoteError, match="NoPickle: a/b") as remote:
                await client.call("fail_oddly")
            assert remote.value.type_name == f"{__name__}.NoPickle"
            with pytest.raises(TypeError, match="could not be serialized"):
                await client.call("lock")
            # The lowest rank's error is raised; here only worker 1 fails.
            with pytest.raises(RuntimeError, match="worker 1 fails"):
                await client.call("fail_unless", 0)
            # A worker that is not asked to reply does not report its error.
            assert await client.call("fail_unless", 1, unique_reply_rank=1) == 1
            assert await client.call("whoami") == [0, 1]
    assert await _exit_codes(children) == [0, 0]


async def test_unserializable_argument_fails_only_its_call(
    anyio_backend: object, children: Children
) -> None:
    async with rpc.Client(2) as client:
        await _start(children, client, anyio_backend)
        with anyio.fail_after(TIMEOUT):
            good = client.submit("echo", 1)
            bad = client.submit("echo", threading.Lock())
            also_good = client.submit("echo", 2)
            with pytest.raises(TypeError, match=r"arguments of call .* could not be serialized"):
                await bad
            assert await good == [1, 1] and await also_good == [2, 2]
            assert await client.call("echo", 3) == [3, 3]


def test_bad_arguments_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="workers=0"):
        rpc.Client(0)
    with pytest.raises(TypeError, match="workers must be an int"):
        rpc.Client("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spin must be"):
        rpc.Client(2, spin=-1)
    with pytest.raises(ValueError, match="capacity"):
        rpc.Client(2, capacity=10)
    client = rpc.Client(2)
    try:
        with pytest.raises(RuntimeError, match="async with client"):
            client.submit("echo", 1)
    finally:
        anyio.run(client.aclose)


async def test_bad_call_arguments(anyio_backend: object, children: Children) -> None:
    async with rpc.Client(2) as client:
        with pytest.raises(ValueError, match=r"workers\[\]=5 is out of range"):
            client.submit("echo", 1, workers=[5])
        with pytest.raises(ValueError, match="names no worker"):
            client.submit("echo", 1, workers=[])
        with pytest.raises(ValueError, match="twice"):
            client.submit("echo", 1, workers=[1, 1])
        with pytest.raises(ValueError, match="not among workers"):
            client.submit("echo", 1, workers=[0], unique_reply_rank=1)
        with pytest.raises(TypeError, match="method must be"):
            client.submit(3)  # type: ignore[arg-type]
        assert client.statistics().calls_submitted == 0
        await _start(children, client, anyio_backend)
        with anyio.fail_after(TIMEOUT):
            assert await client.call("echo", "ok") == ["ok", "ok"]


async def _all_asleep(client: rpc.Client) -> None:
    """Wait until every worker is asleep on the call ring (its sleep flag is up)."""
    ring = client._calls._ring
    with anyio.fail_after(TIMEOUT):
        while not all(ring.w[i] for i in ring.r_sleep):
            await anyio.sleep(0.001)


async def test_a_batch_is_one_publish_and_one_wake_up(
    anyio_backend: object, children: Children
) -> None:
    async with rpc.Client(2) as client:
        await _start(children, client, anyio_backend, spin=0.0)
        with anyio.fail_after(TIMEOUT):
            assert await client.call("echo", 0) == [0, 0]
            await _all_asleep(client)
            before = client.statistics()
            calls = [client.submit("echo", i) for i in range(100)]  # one loop turn
            assert [await call for call in calls] == [[i, i] for i in range(100)]
            after = client.statistics()
            assert after.batches_sent - before.batches_sent == 1
            assert after.wakeups_sent - before.wakeups_sent == 2  # one per sleeping worker
            # Awaited one by one, calls go out one batch each.
            for i in range(10):
                assert await client.call("echo", i) == [i, i]
            assert client.statistics().batches_sent - after.batches_sent == 10


async def test_many_calls_in_flight_run_in_order(anyio_backend: object, children: Children) -> None:
    async with rpc.Client(2, capacity=1 << 16, max_messages=64) as client:
        await _start(children, client, anyio_backend)
        with anyio.fail_after(TIMEOUT):
            calls = []
            for i in range(1000):
                calls.append(client.submit("record", i))
                if i % 97 == 0:
                    await anyio.lowlevel.checkpoint()  # batches of different sizes
            assert [await call for call in calls] == [[i, i] for i in range(1000)]
            assert await client.call("recorded") == [list(range(1000))] * 2


async def test_cancelled_call_is_withdrawn_and_its_late_reply_dropped(
    anyio_backend: object, children: Children
) -> None:
    gate = multiprocessing.get_context("fork").Event()
    async with rpc.Client(2) as client:
        await _start(children, client, anyio_backend, gate=gate)
        with anyio.fail_after(TIMEOUT):
            with anyio.move_on_after(0.05) as scope:
                await client.call("wait_gate", "late")  # the workers hold it until the gate
            assert scope.cancelled_caught
            assert client.statistics().calls_pending == 0
            gate.set()
            assert await client.call("echo", "next") == ["next", "next"]
            # Withdrawn in the turn it was submitted: never sent.
            withdrawn = client.submit("record", "never")
            withdrawn.cancel()
            with pytest.raises(anyio.ClosedResourceError, match="withdrawn"):
                await withdrawn
            assert await client.call("record", "sent") == ["sent", "sent"]
            assert await client.call("recorded") == [["sent"], ["sent"]]


async def test_dead_worker_fails_pending_and_later_calls(
    anyio_backend: object, children: Children
) -> None:
    async with rpc.Client(2) as client:
        await _start(children, client, anyio_backend)
        with anyio.fail_after(TIMEOUT):
            assert await client.call("whoami") == [0, 1]
            dying = client.submit("die_if", 1)
            pending = client.submit("whoami")
        with anyio.fail_after(1):
            with pytest.raises(aioshmq.PeerDied) as info:
                await dying
        assert info.value.role == "worker" and info.value.index == 1
        with pytest.raises(aioshmq.PeerDied) as other:
            await pending
        assert other.value is not info.value  # each call raises its own exception object
        assert (other.value.index, other.value.pid) == (info.value.index, info.value.pid)
        with pytest.raises(aioshmq.PeerDied, match="worker 1"):
            await client.call("whoami")
    assert await _exit_codes(children) == [0, -9]


def _scheduler(conn: Any, backend: str) -> None:
    async def main() -> None:
        async with rpc.Client(1) as client:
            conn.send(client.handle)
            await client.wait_workers()
            assert await client.call("echo", 1) == [1]
            conn.send("ready")
            await anyio.sleep_forever()

    run_backend(backend, main)


async def test_dead_scheduler_stops_the_workers(anyio_backend: object, children: Children) -> None:
    backend = backend_name(anyio_backend)
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    scheduler = await anyio.to_thread.run_sync(children.start, "fork", _scheduler, theirs, backend)
    handle = await anyio.to_thread.run_sync(ours.recv)
    worker = await anyio.to_thread.run_sync(
        children.start, "fork", _worker, handle, 0, backend, False, 0.0002, None
    )
    assert await anyio.to_thread.run_sync(ours.poll, TIMEOUT) and ours.recv() == "ready"
    os.kill(scheduler.pid or 0, 9)
    await anyio.to_thread.run_sync(worker.join, TIMEOUT)
    assert worker.exitcode == 0  # serve() returned: no hang, no error


async def test_serve_sync(anyio_backend: object, children: Children) -> None:
    async with rpc.Client(2) as client:
        await _start(children, client, anyio_backend, sync=True)
        with anyio.fail_after(TIMEOUT):
            calls = [client.submit("record", i) for i in range(50)]
            assert [await call for call in calls] == [[i, i] for i in range(50)]
            with pytest.raises(ValueError, match="sync boom"):
                await client.call("fail", "sync boom")
            with pytest.raises(TypeError, match=r"is async: serve it with aioshmq\.rpc\.serve"):
                await client.call("async_add", 1, 2)
            with pytest.raises(TypeError, match="could not be serialized"):
                await client.call("lock")
            assert await client.call("whoami") == [0, 1]
    assert await _exit_codes(children) == [0, 0]


async def test_spawned_workers_with_numpy_arrays(anyio_backend: object, children: Children) -> None:
    async with rpc.Client(2) as client:
        await _start(children, client, anyio_backend, method="spawn")
        with anyio.fail_after(TIMEOUT):
            arr = np.arange(1 << 18, dtype=np.float32)  # 1 MiB, out of band both ways
            assert await client.call("total", arr) == [float(arr.sum())] * 2
            doubled = await client.call("scaled", arr, 2.0)
            assert all(np.array_equal(got, arr * 2) for got in doubled)
    assert await _exit_codes(children) == [0, 0]


async def test_cloudpickle_sends_lambdas(anyio_backend: object, children: Children) -> None:
    async with rpc.Client(2, serializer="cloudpickle") as client:
        await _start(children, client, anyio_backend)
        with anyio.fail_after(TIMEOUT):
            assert await client.call(lambda target, x: target.rank + x, 10) == [10, 11]


async def test_closing_fails_pending_calls(anyio_backend: object, children: Children) -> None:
    gate = multiprocessing.get_context("fork").Event()
    async with rpc.Client(1) as client:
        await _start(children, client, anyio_backend, gate=gate)
        call = client.submit("wait_gate", 1)
        await anyio.wait_all_tasks_blocked()
    with pytest.raises(anyio.ClosedResourceError):
        await call
    with pytest.raises(anyio.ClosedResourceError):
        client.submit("echo", 1)
    gate.set()
    assert await _exit_codes(children) == [0]


async def test_an_error_in_the_body_propagates_as_itself_and_stops_the_workers(
    anyio_backend: object, children: Children
) -> None:
    with pytest.raises(KeyError, match="from the body"):
        async with rpc.Client(2) as client:
            await _start(children, client, anyio_backend)
            with anyio.fail_after(TIMEOUT):
                assert await client.call("whoami") == [0, 1]
            raise KeyError("from the body")
    assert await _exit_codes(children) == [0, 0]  # the rings were closed on the way out


async def test_aclose_inside_the_block_does_not_cancel_the_caller(
    anyio_backend: object, children: Children
) -> None:
    after = []
    async with rpc.Client(1) as client:
        await _start(children, client, anyio_backend)
        with anyio.fail_after(TIMEOUT):
            assert await client.call("whoami") == [0]
            await client.aclose()
            after.append("ran")
            await anyio.lowlevel.checkpoint()
            after.append("still running")
            with pytest.raises(anyio.ClosedResourceError):
                await client.call("whoami")
    assert after == ["ran", "still running"]
    assert await _exit_codes(children) == [0]


# -- replies that the client cannot load ---------------------------------------------------------

FOREIGN_MODULE = """
class Thing:
    def __init__(self, n):
        self.n = n


class Oops(Exception):
    pass
"""


def foreign(target: Target, path: str, module: str, what: str) -> Any:
    """Run in a worker: import a module found only on that worker's sys.path, and return
    one of its objects (or raise one of its exceptions): the client cannot load either."""
    if path not in sys.path:
        sys.path.insert(0, path)
    mod = importlib.import_module(module)
    if what == "raise":
        raise mod.Oops("from the worker")
    return mod.Thing(7) if what == "return" else None


class PicklePerMessage:
    """A custom serializer (plain pickle): a batch of replies travels as one message each."""

    def dumps(self, obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=5)

    def loads(self, data: bytes) -> Any:
        return pickle.loads(data)


def _holding_worker(handle: rpc.RpcHandle, rank: int, backend: str, serializer: Any) -> None:
    """A worker whose replies to a batch of calls all leave together, at the batch's end:
    FLUSH_AFTER is raised so that none leaves early however slow this machine is."""
    rpc.FLUSH_AFTER = TIMEOUT
    target = Target(rank)
    run_backend(backend, lambda: rpc.serve(handle, rank, target, serializer=serializer))


@pytest.mark.parametrize("serializer", ["pickle", "custom"])
async def test_a_reply_that_cannot_be_loaded_fails_only_its_own_call(
    anyio_backend: object, children: Children, tmp_path: Path, serializer: str
) -> None:
    """With pickle a worker sends a batch's replies as one pickled list; a result or an
    exception in it whose class the client cannot import fails its own call (RemoteError,
    the load error as its cause), and every other call of the batch gets its result.  A
    custom serializer sends one message per reply: the right call fails there too."""
    module = f"only_in_workers_{secrets.token_hex(4)}"
    (tmp_path / f"{module}.py").write_text(FOREIGN_MODULE)
    path = str(tmp_path)
    spec: Any = PicklePerMessage() if serializer == "custom" else "pickle"
    type_name = (lambda name: f"{module}.{name}") if serializer == "pickle" else (lambda _: "?")
    arr = np.arange(1 << 16, dtype=np.float64)
    async with rpc.Client(2, serializer=spec) as client:
        for rank in range(2):
            await anyio.to_thread.run_sync(
                children.start,
                "spawn",
                _holding_worker,
                client.handle,
                rank,
                backend_name(anyio_backend),
                spec,
            )
        with anyio.fail_after(TIMEOUT):
            await client.wait_workers()
            assert await client.call(foreign, path, module, "import") == [None, None]
            with pytest.raises(ModuleNotFoundError):
                importlib.import_module(module)  # the client really cannot load them

            # One batch of calls (one event-loop turn), so one batch of replies per worker.
            before = [
                client.submit("echo", 1),
                client.submit("echo", [2, "two"]),
                client.submit("fail", "a plain error"),
            ]
            guilty = client.submit(foreign, path, module, "return")
            after = [client.submit("echo", {"three": 3}), client.submit("scaled", arr, 2.0)]
            with pytest.raises(rpc.RemoteError, match="could not be loaded") as info:
                await guilty
            assert info.value.type_name == type_name("Thing")
            assert isinstance(info.value.__cause__, ModuleNotFoundError)
            assert await before[0] == [1, 1]
            assert await before[1] == [[2, "two"]] * 2
            with pytest.raises(ValueError, match="a plain error"):
                await before[2]
            assert await after[0] == [{"three": 3}] * 2
            assert all(np.array_equal(got, arr * 2) for got in await after[1])

            # The same with an exception that the client cannot load.
            first = client.submit("echo", "first")
            guilty = client.submit(foreign, path, module, "raise")
            last = client.submit("scaled", arr, 3.0)
            with pytest.raises(rpc.RemoteError) as info:
                await guilty
            assert info.value.type_name == type_name("Oops")
            assert isinstance(info.value.__cause__, ModuleNotFoundError)
            if serializer == "pickle":
                assert str(info.value) == "Oops: from the worker"
                assert any('raise mod.Oops("from the worker")' in n for n in info.value.__notes__)
            assert await first == ["first", "first"]
            assert all(np.array_equal(got, arr * 3) for got in await last)
            assert await client.call("whoami") == [0, 1]
    assert await _exit_codes(children) == [0, 0]


def test_a_boxed_reply_keeps_its_buffers_out_of_band() -> None:
    """A reply's value pickled on its own still leaves its arrays out of band in the
    batch's pickle (no copy into it), and loads back as itself."""
    ser = PickleSerializer()
    arr = np.arange(1 << 16, dtype=np.float64)
    boxed = rpc._Boxed(*ser.dumps(arr), "numpy.ndarray", None)
    main, buffers = ser.dumps_many([(1, True, boxed), (2, True, 3)])
    assert len(buffers) == 1 and buffers[0].nbytes == arr.nbytes
    assert len(main) < 1024
    replies = ser.loads(memoryview(main), [bytearray(b) for b in buffers])
    assert np.array_equal(replies[0][2], arr) and replies[1] == (2, True, 3)


# -- a client opened in one task and closed in another, or never closed ----------------------


class WhoAmI:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def whoami(self) -> int:
        return self.rank


def _whoami_worker(handle: rpc.RpcHandle, rank: int, backend: str) -> None:
    run_backend(backend, rpc.serve, handle, rank, WhoAmI(rank))


async def _start_whoami(children: Children, client: rpc.Client, backend: str) -> None:
    await anyio.to_thread.run_sync(
        children.start, "spawn", _whoami_worker, client.handle, 0, backend
    )
    with anyio.fail_after(TIMEOUT):
        await client.wait_workers()


@pytest.mark.anyio
@pytest.mark.parametrize("close", ["__aexit__", "aclose"])
async def test_a_client_opened_in_one_task_closes_in_another(
    anyio_backend: object, children: Children, close: str
) -> None:
    client = rpc.Client(1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.__aenter__)  # that task ends here; the client lives on
    await _start_whoami(children, client, backend_name(anyio_backend))
    with anyio.fail_after(TIMEOUT):
        assert await client.call("whoami") == [0]
        pending = client.submit("whoami")
        async with anyio.create_task_group() as tg:
            if close == "aclose":
                tg.start_soon(client.aclose)
            else:
                tg.start_soon(client.__aexit__, None, None, None)
    with pytest.raises(anyio.ClosedResourceError):
        await pending
    with pytest.raises(anyio.ClosedResourceError):
        client.submit("whoami")
    assert "closed" in repr(client)
    assert await anyio.to_thread.run_sync(children.join, TIMEOUT) == [0]  # serve() returned


def test_a_client_left_open_is_closed_when_its_event_loop_ends(anyio_backend: Any) -> None:
    """Nothing leaks when the loop ends first: the client's own task closes the rings (the
    autouse fixture checks that no end is left open)."""
    clients: list[rpc.Client] = []
    calls: list[rpc.Call] = []

    async def main() -> None:
        client = rpc.Client(1)
        clients.append(client)
        await client.__aenter__()
        calls.append(client.submit("whoami"))  # no worker ever answers it

    name, options = anyio_backend if isinstance(anyio_backend, tuple) else (anyio_backend, {})
    anyio.run(main, backend=name, backend_options=options)
    assert "closed" in repr(clients[0])
    assert calls[0].done()
    with pytest.raises(anyio.ClosedResourceError):
        anyio.run(calls[0].wait)


def test_replies_made_of_builtins_travel_unboxed() -> None:
    """Only a value that might not load in the client gets a box (a pickle of its own)."""
    from aioshmq.rpc import _always_loads

    assert _always_loads({"i": 1, "text": "x", "nested": [1.5, (b"b", None, True)]})
    assert not _always_loads({"i": object()})
    assert not _always_loads([[[[1]]]])  # deeper than it looks
    assert not _always_loads(list(range(1000)))  # longer than it looks at
    assert not _always_loads({(1, 2): 3})  # a key that is not a plain value
    assert not _always_loads(RuntimeError("x"))

"""rpc across hosts: workers that reach the client by its address, mixed with local ones."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import anyio
import numpy as np
import pytest
from conftest import BACKENDS_ASYNCIO_FIRST, Children, backend_name, run_backend

import aioshmq
from aioshmq import rpc

pytestmark = pytest.mark.anyio


@pytest.fixture(params=BACKENDS_ASYNCIO_FIRST)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


SECRET = b"test-secret-" + b"r" * 20
HEARTBEAT = 1.5


class Target:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.finals = 0

    def whoami(self) -> int:
        return self.rank

    def total(self, arr: np.ndarray) -> float:  # type: ignore[type-arg]
        return float(arr.sum())

    async def later(self, x: int) -> int:
        await anyio.sleep(0)
        return x * 10 + self.rank

    def fail(self) -> None:
        raise KeyError(f"worker {self.rank} refuses")

    def hang(self) -> None:
        time.sleep(600)

    async def slow(self, seconds: float) -> None:
        try:
            await anyio.sleep(seconds)
        finally:
            self.finals += 1

    def finals_run(self) -> int:
        return self.finals


def _worker(where: Any, rank: int, backend: str, sync: bool) -> None:
    if isinstance(where, str):  # the client's address: a worker on "another host"
        options: dict[str, Any] = {"secret": SECRET, "heartbeat": HEARTBEAT}
    else:
        options = {}
    if sync:
        rpc.serve_sync(where, rank, Target(rank), **options)
    else:
        run_backend(backend, lambda: rpc.serve(where, rank, Target(rank), **options))


async def _start(
    children: Children, client: rpc.Client, backend: str, remote: set[int], sync: bool = False
) -> list[multiprocessing.process.BaseProcess]:
    """Start method: spawn.  Ranks in ``remote`` reach the client by its address."""
    procs = []
    for rank in range(client.handle.workers):
        where = client.address if rank in remote else client.handle
        procs.append(
            await anyio.to_thread.run_sync(
                children.start, "spawn", _worker, where, rank, backend, sync
            )
        )
    with anyio.fail_after(60):
        await client.wait_workers()
    return procs


@pytest.mark.timeout(90)
async def test_remote_and_local_workers_serve_one_client(
    anyio_backend: object, children: Children
) -> None:
    """Same results, exceptions, batching and arrays from remote workers as from local ones."""
    client = rpc.Client(4, listen="tcp://127.0.0.1:0", secret=SECRET, heartbeat=HEARTBEAT)
    assert client.address is not None and client.address.startswith("tcp://127.0.0.1:")
    async with client:
        await _start(children, client, backend_name(anyio_backend), {2, 3})
        with anyio.fail_after(60):
            assert await client.call("whoami") == [0, 1, 2, 3]
            calls = [client.submit("later", i, workers=[i % 4]) for i in range(200)]
            assert [await c for c in calls] == [[i * 10 + i % 4] for i in range(200)]
            arr = np.arange(300_000, dtype=np.float64)
            assert await client.call("total", arr, unique_reply_rank=3) == float(arr.sum())
            with pytest.raises(KeyError, match="worker 2 refuses"):
                await client.call("fail", workers=[2])
            assert await client.call("whoami", workers=[3, 1]) == [3, 1]
    children.join(30)


@pytest.mark.timeout(90)
async def test_remote_serve_sync(children: Children) -> None:
    client = rpc.Client(2, listen="tcp://127.0.0.1:0", secret=SECRET)
    async with client:
        await _start(children, client, "asyncio", {0, 1}, sync=True)
        with anyio.fail_after(60):
            assert await client.call("whoami") == [0, 1]
    children.join(30)


@pytest.mark.timeout(90)
async def test_a_killed_remote_worker_fails_the_calls_within_the_heartbeat(
    children: Children,
) -> None:
    client = rpc.Client(4, listen="tcp://127.0.0.1:0", secret=SECRET, heartbeat=HEARTBEAT)
    async with client:
        procs = await _start(children, client, "asyncio", {1, 3})
        with anyio.fail_after(60):
            assert await client.call("whoami") == [0, 1, 2, 3]
        pending = client.submit("hang", workers=[3])
        procs[3].kill()
        await anyio.to_thread.run_sync(procs[3].join, 10)
        killed = time.monotonic()
        with anyio.fail_after(30), pytest.raises(aioshmq.PeerDied):
            await pending
        assert time.monotonic() - killed < HEARTBEAT + 5
        with pytest.raises(aioshmq.PeerDied):
            await client.call("whoami")
    # The other workers, local and remote, end once the client closed.
    for rank in (0, 1, 2):
        await anyio.to_thread.run_sync(procs[rank].join, 30)
        assert procs[rank].exitcode == 0


@pytest.mark.timeout(90)
async def test_a_timed_out_call_is_cancelled_in_remote_and_local_workers(
    children: Children,
) -> None:
    """The withdrawal travels the call ring like the calls: a remote worker cancels the
    method too (its finally runs), and the next call comes back at once."""
    slow = 20.0
    client = rpc.Client(2, listen="tcp://127.0.0.1:0", secret=SECRET, heartbeat=HEARTBEAT)
    async with client:
        await _start(children, client, "asyncio", {1})
        with anyio.fail_after(60):
            assert await client.call("whoami") == [0, 1]
            with anyio.move_on_after(0.5) as scope:
                await client.call("slow", slow)
            assert scope.cancelled_caught
            began = time.monotonic()
            assert await client.call("finals_run") == [1, 1]
            assert time.monotonic() - began < slow / 2
            assert client.statistics().calls_cancelled == 1
    children.join(30)


def test_remote_options_go_with_an_address() -> None:
    client = rpc.Client(1)
    try:
        with pytest.raises(ValueError, match="address"):
            rpc.serve_sync(client.handle, 0, Target(0), secret=SECRET)
        with pytest.raises(TypeError, match="RpcHandle or a client's address"):
            rpc.serve_sync(42, 0, Target(0))  # type: ignore[arg-type]
        assert client.address is None
    finally:
        anyio.run(client.aclose)

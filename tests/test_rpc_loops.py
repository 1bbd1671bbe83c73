"""rpc without silent hangs: a client refuses at once a use from another event loop or
thread than the one that entered it, and wait_workers gives up after its timeout, naming the
workers that did not attach."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import Any

import anyio
import pytest
import uvloop
from conftest import Children, Recorder, backend_name, run_backend

from aioshmq import rpc

pytestmark = pytest.mark.anyio

TIMEOUT = 30  # seconds for any one test's waits on worker processes


class Target(Recorder):
    def __init__(self, gate: Any) -> None:
        super().__init__()
        self.gate = gate

    def wait_gate(self) -> None:
        assert self.gate.wait(TIMEOUT)


def _worker(handle: rpc.RpcHandle, rank: int, backend: str, gate: Any) -> None:
    run_backend(backend, lambda: rpc.serve(handle, rank, Target(gate), spin=0.0))


async def _start(children: Children, client: rpc.Client, backend: str, gate: Any = None) -> None:
    """A worker per rank (fork), attached."""
    for rank in range(client.handle.workers):
        await anyio.to_thread.run_sync(
            children.start, "fork", _worker, client.handle, rank, backend, gate
        )
    with anyio.fail_after(TIMEOUT):
        await client.wait_workers()


async def _exit_codes(children: Children) -> list[int | None]:
    return await anyio.to_thread.run_sync(children.join, TIMEOUT)


# -- a client belongs to the event loop that entered it ----------------------------------------


@pytest.mark.timeout(60)
async def test_a_client_refuses_calls_from_another_thread(
    anyio_backend: object, children: Children
) -> None:
    gate = multiprocessing.get_context("fork").Event()
    async with rpc.Client(1) as client:
        await _start(children, client, backend_name(anyio_backend), gate)
        with anyio.fail_after(TIMEOUT):
            assert await client.call("echo", 1) == [1]
            with pytest.raises(RuntimeError, match="belongs to the event loop that entered it"):
                await anyio.to_thread.run_sync(client.submit, "record", "from a thread")

            def in_a_loop_of_its_own() -> None:
                async def call() -> None:
                    with anyio.fail_after(5):  # the old client hung here
                        await client.call("record", "from another loop")

                asyncio.run(call())

            with pytest.raises(RuntimeError, match=r"cannot submit a call from thread") as info:
                await anyio.to_thread.run_sync(in_a_loop_of_its_own)
            assert "MainThread" in str(info.value)  # where it belongs
            waiting = client.submit("wait_gate")
            with pytest.raises(RuntimeError, match="cannot await a call"):
                await anyio.to_thread.run_sync(asyncio.run, waiting.wait())
            gate.set()
            assert await waiting == [None]
            assert await client.call("recorded") == [[]]  # nothing else reached the worker
    assert await _exit_codes(children) == [0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_client_refuses_another_event_loop_of_its_thread(children: Children, loop: str) -> None:
    """A client held across event loops of one thread (as a session-scoped fixture used by
    a test whose loop is another one) is refused at once in the other loop; the old one
    waited forever."""
    factory = uvloop.new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        client = rpc.Client(1)
        runner.run(client.__aenter__())
        try:
            # The runner's loop is not running now: a forked child inherits none.
            children.start("fork", _worker, client.handle, 0, loop, None)
            runner.run(asyncio.wait_for(client.wait_workers(), TIMEOUT))
            assert runner.run(client.call("echo", 1)) == [1]

            async def other(what: str) -> None:
                with anyio.fail_after(5):  # the old client hung here
                    if what == "call":
                        await client.call("record", "from another loop")
                    elif what == "wait_workers":
                        await client.wait_workers()
                    else:
                        await client.aclose()

            for what in ("call", "wait_workers", "aclose"):
                with pytest.raises(RuntimeError, match="belongs to the event loop") as info:
                    asyncio.run(other(what))
                assert "with pytest-asyncio" in str(info.value)
            assert runner.run(client.call("recorded")) == [[]]
        finally:
            runner.run(client.aclose())
    assert children.join(TIMEOUT) == [0]


@pytest.mark.timeout(60)
async def test_wait_workers_times_out_naming_the_workers_missing(
    anyio_backend: object, children: Children
) -> None:
    backend = backend_name(anyio_backend)
    async with rpc.Client(3) as client:
        await anyio.to_thread.run_sync(
            children.start, "fork", _worker, client.handle, 1, backend, None
        )
        with anyio.fail_after(TIMEOUT):
            while client.statistics().workers_attached < 1:  # worker 1 attached: nothing to await
                await anyio.sleep(0.01)
            began = time.monotonic()
            with pytest.raises(
                TimeoutError, match=r"^aioshmq.rpc client .*: workers 0, 2 \(of 3\) did not "
            ) as info:
                await client.wait_workers(timeout=0.2)
            assert time.monotonic() - began < 5  # not a silent hang
            assert "within 0.2 s" in str(info.value) and "rpc.serve" in str(info.value)
            for rank in (0, 2):
                await anyio.to_thread.run_sync(
                    children.start, "fork", _worker, client.handle, rank, backend, None
                )
            await client.wait_workers(timeout=TIMEOUT)
            assert await client.call("echo", 3) == [3, 3, 3]
    assert await _exit_codes(children) == [0, 0, 0]


def test_wait_workers_says_start_the_client_first() -> None:
    client = rpc.Client(1)
    try:
        with pytest.raises(RuntimeError, match="async with client"):
            anyio.run(client.wait_workers, 1.0)
    finally:
        anyio.run(client.aclose)

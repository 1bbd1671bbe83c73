"""rpc: a withdrawn call reaches the workers: skipped if not started, cut short if it is an
async method, its result dropped if it is a plain one, and the workers go on at once."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import Any

import anyio
import pytest
from conftest import Children, Recorder, backend_name, run_backend

from aioshmq import rpc

pytestmark = pytest.mark.anyio

TIMEOUT = 30  # seconds for any one test's waits on worker processes
SLOW = 10.0  # seconds a stuck call would take: a freed worker answers long before half that
BLOCK = 0.5  # seconds a plain method blocks its worker; withdrawals reach it long before


class Target(Recorder):
    """What the workers serve; ``started`` is released once by each call that begins."""

    def __init__(self, started: Any) -> None:
        super().__init__()
        self.started = started
        self.finals = 0  # finally blocks of slow() run
        self.ended = 0  # slow() calls that ran to their end

    async def slow(self, seconds: float) -> str:
        self.started.release()
        try:
            await anyio.sleep(seconds)
            self.ended += 1
        finally:
            self.finals += 1
        return "slept"

    def block(self, seconds: float) -> str:
        """A plain method: nothing can cut it short."""
        self.started.release()
        time.sleep(seconds)
        self.seen.append("block ended")
        return "blocked"

    def counts(self) -> dict[str, int]:
        return {"finals": self.finals, "ended": self.ended}


def _worker(handle: rpc.RpcHandle, rank: int, backend: str, sync: bool, started: Any) -> None:
    target = Target(started)
    if sync:
        rpc.serve_sync(handle, rank, target)
    else:
        run_backend(backend, lambda: rpc.serve(handle, rank, target, spin=0.0))


async def _start(children: Children, client: rpc.Client, backend: str, sync: bool = False) -> Any:
    """A worker per rank (fork), attached; returns the semaphore their calls release."""
    started = multiprocessing.get_context("fork").Semaphore(0)
    for rank in range(client.handle.workers):
        await anyio.to_thread.run_sync(
            children.start, "fork", _worker, client.handle, rank, backend, sync, started
        )
    with anyio.fail_after(TIMEOUT):
        await client.wait_workers()
    return started


async def _begun(started: Any, workers: int) -> None:
    """Wait until ``workers`` calls have begun in the workers (one each)."""
    for _ in range(workers):
        assert await anyio.to_thread.run_sync(started.acquire, True, TIMEOUT)


async def _exit_codes(children: Children) -> list[int | None]:
    return await anyio.to_thread.run_sync(children.join, TIMEOUT)


@pytest.mark.timeout(60)
async def test_a_timed_out_async_call_is_cancelled_in_the_workers(
    anyio_backend: object, children: Children
) -> None:
    """The issue's case: a timeout around slow() used to leave the workers running it, and
    the next call waited for its end.  Now the method is cancelled (its finally runs) and
    the next call comes back at once."""
    async with rpc.Client(2) as client:
        await _start(children, client, backend_name(anyio_backend))
        with anyio.fail_after(TIMEOUT):
            assert await client.call("echo", 1) == [1, 1]
            with anyio.move_on_after(0.5) as scope:
                await client.call("slow", SLOW)
            assert scope.cancelled_caught
            began = time.monotonic()
            assert await client.call("echo", "next") == ["next", "next"]
            assert time.monotonic() - began < SLOW / 2  # not held until slow() ended
            assert await client.call("counts") == [{"finals": 1, "ended": 0}] * 2
            stats = client.statistics()
            assert stats.calls_cancelled == 1 and stats.calls_pending == 0
    assert await _exit_codes(children) == [0, 0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio", ("asyncio", {"use_uvloop": True})])
async def test_asyncio_timeout_cancels_the_call_in_the_workers(
    anyio_backend: object, children: Children
) -> None:
    async with rpc.Client(1) as client:
        await _start(children, client, backend_name(anyio_backend))
        with anyio.fail_after(TIMEOUT):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await client.call("slow", SLOW)
            began = time.monotonic()
            assert await client.call("counts") == [{"finals": 1, "ended": 0}]
            assert time.monotonic() - began < SLOW / 2


@pytest.mark.timeout(60)
async def test_withdrawn_queued_calls_never_run(anyio_backend: object, children: Children) -> None:
    """Calls queued in the workers behind a stuck one, withdrawn with it, are skipped; the
    withdrawals travel as one message, in the batch of the next call."""
    async with rpc.Client(2) as client:
        started = await _start(children, client, backend_name(anyio_backend))
        with anyio.fail_after(TIMEOUT):
            stuck = client.submit("slow", SLOW)
            queued = [client.submit("record", i) for i in range(3)]  # one batch with it
            queued.append(client.submit("record", "only 1", workers=[1]))
            queued.append(client.submit("record", "answered by 0", unique_reply_rank=0))
            await _begun(started, 2)  # slow() runs: the others wait in the workers' queue
            for call in [*queued, stuck]:
                call.cancel()
            before = client.statistics()
            began = time.monotonic()
            assert await client.call("recorded") == [[], []]
            assert time.monotonic() - began < SLOW / 2
            after = client.statistics()
            assert after.batches_sent - before.batches_sent == 1
            assert after.calls_cancelled == 6 and after.calls_pending == 0
            assert await client.call("counts") == [{"finals": 1, "ended": 0}] * 2
            for call in [*queued, stuck]:
                with pytest.raises(anyio.ClosedResourceError, match="withdrawn"):
                    await call
            assert await client.call("record", "after") == ["after", "after"]
            assert await client.call("recorded") == [["after"], ["after"]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("serve", ["serve", "serve_sync"])
async def test_a_withdrawn_plain_method_runs_to_its_end_and_the_worker_is_then_free(
    anyio_backend: object, children: Children, serve: str
) -> None:
    """A plain method cannot be cut short: it ends, its result is dropped, and the calls
    queued behind it that were withdrawn too (as long as it) never run."""
    async with rpc.Client(2) as client:
        started = await _start(
            children, client, backend_name(anyio_backend), sync=serve == "serve_sync"
        )
        with anyio.fail_after(TIMEOUT):
            stuck = client.submit("block", BLOCK)
            queued = [client.submit("block", BLOCK) for _ in range(4)]
            await _begun(started, 2)
            with anyio.move_on_after(0) as scope:
                await stuck  # cancelled at once: withdrawn by its own cancellation
            assert scope.cancelled_caught
            for call in queued:
                call.cancel()
            began = time.monotonic()
            assert await client.call("recorded") == [["block ended"]] * 2
            # What was left of the first one (BLOCK at most), not the 4 others after it.
            assert time.monotonic() - began < 3 * BLOCK
            assert client.statistics().calls_cancelled == 5
            with pytest.raises(anyio.ClosedResourceError, match="withdrawn"):
                await stuck
            assert await client.call("echo", "free") == ["free", "free"]
    assert await _exit_codes(children) == [0, 0]

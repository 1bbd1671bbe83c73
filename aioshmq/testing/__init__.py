"""pytest fixtures for code that uses aioshmq: rings, worker processes, rpc clients, leak checks.

Loaded by pytest through the ``pytest11`` entry point wherever aioshmq is installed (or with
``-p aioshmq.testing``); nothing changes for a test that asks for none of it.  The fixtures
are sync, so they serve every async runner alike (pytest-asyncio in any mode and loop scope,
anyio's plugin on asyncio, uvloop and trio), and ring names are unique per pytest-xdist
worker.  The leak check is opt-in: ``--aioshmq-leaks``, the ``aioshmq_leaks`` ini option, or
the ``aioshmq_leaks`` marker.
"""

from __future__ import annotations

import functools
import gc
import inspect
import multiprocessing
import os
import secrets
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import anyio
import pytest

import aioshmq

from .. import rpc
from ..ends.end import End, open_ends, watch_opened

__all__ = ["Processes", "Rings", "ring_memory", "rpc_client", "unique_name"]

JOIN_TIMEOUT = 60.0  # seconds a worker process gets to exit before it is killed


def unique_name(prefix: str = "test") -> str:
    """A ring name no other process, test or pytest-xdist worker on this machine will use."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return f"{prefix}-{worker}-{os.getpid()}-{secrets.token_hex(4)}"


class Processes:
    """Child processes that are always reaped: joined with a timeout, killed if they hang,
    even when the test fails."""

    def __init__(self) -> None:
        self.procs: list[BaseProcess] = []

    def start(self, target: Callable[..., Any], *args: Any, method: str = "spawn") -> BaseProcess:
        """Start ``target(*args)`` with the start method named (from a coroutine, through
        ``anyio.to_thread.run_sync``, so that a forked child does not inherit a running loop)."""
        context: Any = multiprocessing.get_context(method)
        proc: BaseProcess = context.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def join(self, timeout: float = JOIN_TIMEOUT) -> list[int | None]:
        """Wait for every child; kill and fail on one still running after ``timeout``."""
        codes = []
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
                raise AssertionError(f"child {proc.pid} still running after {timeout} s")
            codes.append(proc.exitcode)
        return codes

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            proc.close()
        self.procs.clear()


class Rings:
    """Rings made for one test, every end closed at its end: ``writer, readers =
    aioshmq_ring(readers=2)``."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._ends: list[aioshmq.Writer[Any] | aioshmq.Reader[Any]] = []

    def __call__(
        self, readers: int = 1, *, capacity: int = 1 << 20, connect: bool = True, **create: Any
    ) -> tuple[aioshmq.Writer[Any], list[aioshmq.Reader[Any]]]:
        """A writer with ``readers`` slots (``create``'s other arguments pass through) and,
        with ``connect``, a reader attached to each slot."""
        create.setdefault("name", unique_name(self._prefix))
        writer = aioshmq.create(capacity, readers=readers, **create)
        self._ends.append(writer)
        attached = []
        if connect:
            for index in range(readers):
                reader = aioshmq.connect(writer.name, index)
                self._ends.append(reader)
                attached.append(reader)
        return writer, attached

    def close(self) -> None:
        for end in reversed(self._ends):
            end.close()
        self._ends.clear()


SERVE_MODES = ("auto", "sync", "async")
WORKER_BACKENDS = ("asyncio", "uvloop", "trio")


def _has_async_methods(target: object) -> bool:
    """Whether any public method of ``target`` is ``async def`` (looked up without running
    a property or ``__getattr__``)."""
    for name in dir(target):
        if name.startswith("_"):
            continue
        try:
            attribute = inspect.getattr_static(target, name)
        except AttributeError:
            continue
        if isinstance(attribute, (staticmethod, classmethod)):
            attribute = attribute.__func__
        if inspect.iscoroutinefunction(attribute):
            return True
    return False


def _serve(
    handle: rpc.RpcHandle, rank: int, make: Callable[[int], object], serve: str, backend: str
) -> None:
    target = make(rank)
    if serve == "async" or (serve == "auto" and _has_async_methods(target)):
        if backend == "uvloop":
            options = {"use_uvloop": True}
            anyio.run(rpc.serve, handle, rank, target, backend="asyncio", backend_options=options)
        else:
            anyio.run(rpc.serve, handle, rank, target, backend=backend)
    else:
        rpc.serve_sync(handle, rank, target)


async def _wait_attached(client: rpc.Client, procs: list[BaseProcess]) -> None:
    """Return once every worker has attached; fail as soon as a worker process exits before
    that (naming the exit codes), or after JOIN_TIMEOUT."""
    exited: list[int] = []
    failed: list[Exception] = []

    async def attach(scope: anyio.CancelScope) -> None:
        try:
            await client.wait_workers()
        except Exception as exc:  # PeerDied: a worker died after attaching
            failed.append(exc)
        scope.cancel()

    async def watch(rank: int, proc: BaseProcess, scope: anyio.CancelScope) -> None:
        await anyio.wait_readable(proc.sentinel)  # readable once the process has exited
        exited.append(rank)
        scope.cancel()

    with anyio.move_on_after(JOIN_TIMEOUT) as waited:
        async with anyio.create_task_group() as tg:
            tg.start_soon(attach, tg.cancel_scope)
            for rank, proc in enumerate(procs):
                tg.start_soon(watch, rank, proc, tg.cancel_scope)
    if exited:
        dead = procs[exited[0]]
        await anyio.to_thread.run_sync(dead.join, 5.0)  # its exit code is there to read
        codes = ", ".join(f"worker {rank}: {proc.exitcode}" for rank, proc in enumerate(procs))
        raise aioshmq.PeerDied(
            f"aioshmq.testing.rpc_client: worker {exited[0]} (pid {dead.pid}) exited with code "
            f"{dead.exitcode} before attaching (exit codes so far, None while running: "
            f"{codes}); a worker's error is on its stderr: did make(rank) raise?",
            role="worker",
            pid=dead.pid or 0,
            index=exited[0],
        )
    if failed:
        raise failed[0]
    if waited.cancelled_caught:
        codes = ", ".join(f"worker {rank}: {proc.exitcode}" for rank, proc in enumerate(procs))
        raise TimeoutError(
            f"the rpc workers did not all attach within {JOIN_TIMEOUT} s (their exit codes so "
            f"far, None while running: {codes}); a worker's error is on its stderr"
        )


@asynccontextmanager
async def rpc_client(
    make: Callable[[int], object],
    workers: int = 2,
    *,
    method: str = "spawn",
    serve: Literal["auto", "sync", "async"] = "auto",
    worker_backend: Literal["asyncio", "uvloop", "trio"] = "asyncio",
    **client: Any,
) -> AsyncIterator[rpc.Client]:
    """An ``rpc.Client`` with ``workers`` worker processes started with ``method``, each
    serving ``make(rank)`` (``make`` must be importable for "spawn" and "forkserver"), all
    attached when it is handed out; the workers are reaped when the block ends, however it
    ends.  Fit for a session-scoped async fixture: it may be left from another task.

    ``serve`` says how the workers serve: "sync" with ``rpc.serve_sync``, "async" with
    ``rpc.serve`` under ``anyio.run``, "auto" (the default) with ``rpc.serve`` if the
    target has a public ``async def`` method and ``rpc.serve_sync`` if not;
    ``worker_backend`` is the event loop ``rpc.serve`` runs on there ("asyncio", "uvloop"
    or "trio"; the test's own may differ: the workers are processes of their own).  A worker
    process that exits before attaching fails the block at once with ``PeerDied`` naming
    the exit codes; workers still not attached after 60 s fail it with ``TimeoutError``.
    """
    if serve not in SERVE_MODES:
        raise ValueError(f"serve must be 'auto', 'sync' or 'async', not {serve!r}")
    if worker_backend not in WORKER_BACKENDS:
        raise ValueError(
            f"worker_backend must be 'asyncio', 'uvloop' or 'trio', not {worker_backend!r}"
        )
    procs = Processes()
    try:
        async with rpc.Client(workers, **client) as c:
            for rank in range(workers):
                start = functools.partial(
                    procs.start, _serve, c.handle, rank, make, serve, worker_backend, method=method
                )
                await anyio.to_thread.run_sync(start)
            await _wait_attached(c, procs.procs)
            yield c
        await anyio.to_thread.run_sync(procs.join)
    finally:
        procs.kill_all()


# -- the plugin ------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aioshmq")
    group.addoption(
        "--aioshmq-leaks",
        action="store_true",
        help="fail a test that leaves an aioshmq end open or ring memory mapped",
    )
    parser.addini("aioshmq_leaks", "the same as --aioshmq-leaks, for every test", type="bool")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "aioshmq_leaks: fail this test if it leaves an aioshmq end open or ring memory"
    )


@pytest.fixture
def aioshmq_name() -> str:
    """A ring name unique to this test (and this pytest-xdist worker)."""
    return unique_name()


@pytest.fixture
def aioshmq_ring(request: pytest.FixtureRequest) -> Iterator[Rings]:
    """Make rings for this test: ``writer, readers = aioshmq_ring(readers=2)``; closed after."""
    rings = Rings(f"test-{request.node.name[:40]}".replace("[", "-").replace("]", ""))
    try:
        yield rings
    finally:
        rings.close()


@pytest.fixture
def aioshmq_processes() -> Iterator[Processes]:
    """Start child processes under a named start method; reaped after the test, pass or fail."""
    procs = Processes()
    try:
        yield procs
    finally:
        procs.kill_all()


def ring_memory() -> set[str]:
    """The ring memory this process holds: memfd descriptors and mappings."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:aioshmq" in target:
            found.add(f"fd {fd} -> {target}")
    with open("/proc/self/maps") as maps:
        found.update(line.strip() for line in maps if "memfd:aioshmq" in line)
    return found


@pytest.fixture(autouse=True)
def _aioshmq_leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """The opt-in leak check: the ends this test opened (known by identity: not a session's
    rings, nor an end an earlier test left to the garbage collector) must be closed after it,
    none of them collected unclosed, and the ring memory mapped during it released.  Other
    warnings raised during the test, such as a ResourceWarning about another test's end,
    reach pytest as they would without the check."""
    config = request.config
    wanted = (
        config.getoption("aioshmq_leaks")
        or config.getini("aioshmq_leaks")
        or request.node.get_closest_marker("aioshmq_leaks") is not None
    )
    if not wanted:
        yield
        return
    opened: set[int] = set()
    memory = ring_memory()
    unwatch = watch_opened(lambda end: opened.add(id(end)))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            yield
            if any(id(end) in opened for end in open_ends()) or ring_memory() - memory:
                gc.collect()  # what is only unreferenced goes now (and warns, if unclosed)
    finally:
        unwatch()
    # An id names one end throughout: an end open when the test began lives on until the
    # collector's warning about it, which holds it, so no end opened since shares its id.
    left = [end for end in open_ends() if id(end) in opened]
    mapped = sorted(ring_memory() - memory)
    own = [
        w
        for w in caught
        if issubclass(w.category, ResourceWarning)
        and isinstance(w.source, End)
        and id(w.source) in opened
    ]
    problems = []
    if left:
        problems.append(f"aioshmq ends left open: {left}")
    if mapped:
        problems.append(f"ring memory still held: {mapped}")
    if own:
        problems.append(f"aioshmq ends collected unclosed: {[str(w.message) for w in own]}")
    try:
        for w in caught:
            if w not in own:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    finally:
        if problems:
            pytest.fail("; ".join(problems), pytrace=False)

"""Shared fixtures: the three backends, start methods, and child-process helpers."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import uvloop

BACKENDS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param("trio", id="trio"),
]
START_METHODS = ["fork", "spawn", "forkserver"]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Loops for the tests that run under pytest-asyncio (strict mode)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def backend_name(anyio_backend: Any) -> str:
    """'asyncio', 'uvloop' or 'trio': what a child process should run."""
    if isinstance(anyio_backend, tuple):
        return "uvloop" if anyio_backend[1].get("use_uvloop") else anyio_backend[0]
    return str(anyio_backend)


def run_backend(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` under the named backend (in a child process, say)."""
    import signal

    import anyio

    # A child forked from a process running trio inherits trio's signal wake-up fd, which
    # makes the child's own trio refuse to start.
    signal.set_wakeup_fd(-1)
    if name == "uvloop":
        return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(fn, *args, backend=name)


class Children:
    """Child processes that are always reaped: joined with a timeout, killed if they hang."""

    def __init__(self) -> None:
        self.procs: list[multiprocessing.process.BaseProcess] = []

    def start(
        self, method: str, target: Callable[..., Any], *args: Any
    ) -> multiprocessing.process.BaseProcess:
        """Start a child; from a coroutine, use ``await anyio.to_thread.run_sync(...)``, so
        that a forked child does not inherit a running event loop."""
        ctx = multiprocessing.get_context(method)
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def join(self, timeout: float = 60.0) -> list[int | None]:
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
            close = getattr(proc, "close", None)
            if close is not None:
                close()


@pytest.fixture
def children() -> Iterator[Children]:
    kids = Children()
    try:
        yield kids
    finally:
        kids.kill_all()


@pytest.fixture(autouse=True)
def _no_leak() -> Iterator[None]:
    """Every test closes the ends it opens and leaves no ring memory mapped or held.

    (Event loops keep fds of their own across tests, so this looks only at ours; the leak
    tests count every fd over many cycles.)
    """
    yield
    gc.collect()
    from aioshmq import _end

    open_ends = [end for end in _end._live if not end._closed]
    assert not open_ends, f"ends left open by this test: {open_ends}"
    assert not _ring_fds(), f"ring memory still held by this process: {_ring_fds()}"


def _ring_fds() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:aioshmq" in target:
            found.append(f"{fd} -> {target}")
    with open("/proc/self/maps") as maps:
        found += [line.strip() for line in maps if "memfd:aioshmq" in line]
    return found

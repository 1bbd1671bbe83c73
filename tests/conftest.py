"""Shared fixtures: the three backends, start methods, child-process helpers, and timeouts
that end a hung test on every backend."""

from __future__ import annotations

import asyncio
import functools
import inspect
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import pytest_timeout
import uvloop

from aioshmq.testing import Processes

BACKENDS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param("trio", id="trio"),
]
START_METHODS = ["fork", "spawn", "forkserver"]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


# For tests that start processes and wait for heartbeats: asyncio in the default tier,
# uvloop and trio in the slow one (CI runs both).
BACKENDS_ASYNCIO_FIRST = [
    BACKENDS[0],
    *(pytest.param(*p.values, id=p.id, marks=pytest.mark.slow) for p in BACKENDS[1:]),
]


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


class Recorder:
    """What every rpc test target serves: an echo, and a record of what it was given."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def echo(self, x: Any) -> Any:
        return x

    def record(self, x: Any) -> Any:
        self.seen.append(x)
        return x

    def recorded(self) -> list[Any]:
        return self.seen


class Children(Processes):
    """The plugin's reaper, with the start method first: ``children.start(method, target,
    *args)``."""

    def start(  # type: ignore[override]
        self, method: str, target: Callable[..., Any], *args: Any
    ) -> multiprocessing.process.BaseProcess:
        """Start a child; from a coroutine, use ``await anyio.to_thread.run_sync(...)``, so
        that a forked child does not inherit a running event loop."""
        return super().start(target, *args, method=method)


@pytest.fixture
def children() -> Iterator[Children]:
    kids = Children()
    try:
        yield kids
    finally:
        kids.kill_all()


# -- timeouts that hold on every backend -------------------------------------------------------
#
# pytest-timeout's SIGALRM raises in the main thread, and on asyncio that ends a hung test.  On
# trio (which anyio's plugin runs as a guest of the main thread) and on uvloop it does not:
# the exception leaves the loop, the test's task stays blocked, and the plugin waits for it
# forever.  So an async anyio test also runs under a cancel scope whose deadline comes shortly
# before its pytest timeout: the hung task is cancelled inside its own loop, on every backend,
# and the test fails at once.  And if a test (a sync one, a fixture's teardown) still runs
# BACKSTOP seconds after its pytest timeout, its stacks are dumped and the run ends (as
# pytest-timeout's thread method does) rather than hang.

BACKSTOP = 30.0
_STARTED = pytest.StashKey[tuple[float, float]]()  # (monotonic start, pytest timeout)
_BACKSTOP = pytest.StashKey[threading.Timer]()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Note when the test started and its timeout, and arm the backstop; pytest-timeout's own
    implementation then arms its timer (this returns None, so the hook goes on to it)."""
    item.stash[_STARTED] = (time.monotonic(), float(settings.timeout))
    if settings.method == "thread":
        return  # that already ends the run
    timer = threading.Timer(settings.timeout + BACKSTOP, _end_the_run, (item, settings))
    timer.name = f"backstop {item.nodeid}"
    timer.daemon = True
    item.stash[_BACKSTOP] = timer
    timer.start()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    timer = item.stash.get(_BACKSTOP, None)
    if timer is not None:
        timer.cancel()
        timer.join()  # gone before the next test counts this process's threads


def _end_the_run(item: pytest.Item, settings: Any) -> None:
    print(
        f"\n{item.nodeid} is still running {BACKSTOP:.0f} s after its {settings.timeout} s "
        "pytest timeout, which could not interrupt it: dumping every thread's stack and "
        "ending the run",
        file=sys.stderr,
        flush=True,
    )
    pytest_timeout.timeout_timer(item, settings)  # dumps the stacks, then os._exit(1)


def _deadline_margin(timeout: float) -> float:
    """How long before its pytest timeout a hung async test is cancelled: time left for the
    fixtures' teardown (closing ends, killing children)."""
    return min(10.0, timeout / 10)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    """Run an async anyio test under a cancel scope that expires before its pytest timeout."""
    original = pyfuncitem.obj
    started = pyfuncitem.stash.get(_STARTED, None)
    if (
        started is None
        or started[1] <= 0
        or "anyio_backend" not in pyfuncitem.funcargs
        or not inspect.iscoroutinefunction(original)
        or hasattr(original, "hypothesis")
    ):
        return (yield)
    start, timeout = started
    deadline = timeout - _deadline_margin(timeout) - (time.monotonic() - start)
    pyfuncitem.obj = _with_deadline(original, deadline, timeout)
    try:
        return (yield)
    finally:
        pyfuncitem.obj = original


def _with_deadline(test: Callable[..., Any], seconds: float, timeout: float) -> Callable[..., Any]:
    import anyio

    @functools.wraps(test)
    async def run(**kwargs: Any) -> None:
        hung: BaseException | None = None
        with anyio.CancelScope(deadline=anyio.current_time() + seconds) as scope:
            try:
                await test(**kwargs)
            except anyio.get_cancelled_exc_class() as exc:
                if not scope.cancel_called:
                    raise
                hung = exc  # its traceback ends at the await that never returned
        if hung is not None:
            raise pytest.fail.Exception(
                f"cancelled {seconds:.1f} s into its {timeout:.0f} s pytest timeout, still "
                "waiting (the await that never returned is above)"
            ) from hung

    return run


def run_in_session(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with this checkout on its path, in a session of its own: on timeout the
    test fails, and at the end anything it left running is killed with it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{cmd} ran over {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

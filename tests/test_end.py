"""Lifecycle of both ends: no leaks over many cycles, ResourceWarning on garbage collection,
interrupts in blocking calls, and the async API used where no event loop runs."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import pytest

import aioshmq
from aioshmq.ring import format as F
from aioshmq.ring import format as L


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _broker_threads() -> list[str]:
    """This package's own threads (an event loop's worker threads come and go on their own)."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("aioshmq-"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_leaks_over_1000_cycles() -> None:
    def cycle() -> None:
        with aioshmq.create(capacity=1 << 16, readers=2) as w:
            with aioshmq.connect(w.name, 0) as r0, aioshmq.connect(w.handle, 1) as r1:
                w.put_nowait({"x": 1})
                assert r0.get_nowait() == r1.get_nowait() == {"x": 1}

    for _ in range(20):  # warm up caches and allocator arenas
        cycle()
    gc.collect()
    fds, maps, rss, threads = _fds(), _mappings(), _rss(), _broker_threads()
    for _ in range(1000):
        cycle()
    gc.collect()
    assert _fds() == fds
    # The allocator maps and unmaps arenas of its own; a leak would be one mapping a cycle.
    assert _mappings() - maps < 16
    with open("/proc/self/maps") as f:
        assert not [line for line in f if "memfd:aioshmq" in line]  # the rings' own mappings
    assert _broker_threads() == threads
    assert _rss() - rss < 8 << 20, f"RSS grew by {(_rss() - rss) >> 20} MiB"


def test_failed_creation_leaves_nothing() -> None:
    name = f"leak-check-{os.getpid()}"
    with aioshmq.create(capacity=1 << 16, name=name) as w:
        aioshmq.connect(w.name).close()  # the broker thread is up and has its selector
        gc.collect()
        fds, maps = _fds(), _mappings()
        for _ in range(50):
            with pytest.raises(FileExistsError):
                aioshmq.create(capacity=1 << 16, name=name)
            with pytest.raises(ValueError):
                aioshmq.connect(w.name, 5)
        gc.collect()
        assert _fds() <= fds
        assert _mappings() - maps < 16


def test_garbage_collected_ends_warn_and_release() -> None:
    fds = _fds()
    w = aioshmq.create(capacity=1 << 16)
    r = aioshmq.connect(w.name)
    name = w.name
    with pytest.warns(ResourceWarning, match="unclosed <aioshmq.Reader"):
        del r
        gc.collect()
    with pytest.warns(ResourceWarning, match="unclosed <aioshmq.Writer"):
        del w
        gc.collect()
    assert _fds() == fds
    with pytest.raises(FileNotFoundError):
        aioshmq.connect(name)  # the writer's broker stopped too


@pytest.fixture
def alarm() -> Iterator[Any]:
    """Raise KeyboardInterrupt in the main thread after a delay, as Ctrl-C would."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_keyboard_interrupt_in_get_sync(alarm: Any) -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        alarm(0.1)
        with pytest.raises(KeyboardInterrupt):
            r.get_sync()  # nothing will come: only the interrupt ends this
        sleep_word = w._layout.reader_word(0, L.R_SLEEP)
        assert w._seg.words[sleep_word] == 0  # not left marked asleep
        assert r.statistics().tasks_waiting_receive == 0
        w.put_sync("after")
        assert r.get_sync(timeout=5) == "after"


def test_keyboard_interrupt_in_put_sync(alarm: Any) -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=2) as w, aioshmq.connect(w.name) as r:
        w.put_sync(1)
        w.put_sync(2)
        alarm(0.1)
        with pytest.raises(KeyboardInterrupt):
            w.put_sync(3)  # the ring is full and the reader does not read
        assert w._seg.words[w._layout.writer_word(L.W_SLEEP)] == 0
        s = w.statistics()
        assert (s.messages_put, s.messages_in_ring, s.tasks_waiting_send) == (2, 2, 0)
        assert r.get_sync(timeout=5) == 1
        w.put_sync(4, timeout=5)
        assert [r.get_sync(timeout=5), r.get_sync(timeout=5)] == [2, 4]


def test_async_api_without_an_event_loop() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        for coro in (w.put(1), r.get(), w.put_many([1]), r.get_many(), w.wait_readers()):
            with pytest.raises(RuntimeError, match="event loop"):
                coro.send(None)
            coro.close()
        w.put_sync(2)
        assert r.get_sync(timeout=5) == 2


@pytest.mark.anyio
async def test_wake_ups_nobody_waits_for_neither_spin_the_loop_nor_get_lost(
    anyio_backend: object,
) -> None:
    import time

    import anyio

    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name, spin=0) as r:
        for _round in range(3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.put, "x")  # after the reader is asleep: a real wake-up
                with anyio.fail_after(5):
                    assert await r.get() == "x"
            # A wake-up that nobody waits for: the fd stays readable until the next sleep.
            os.eventfd_write(r._wake.read_fd, 1)
            cpu = time.process_time()
            await anyio.sleep(0.3)
            assert time.process_time() - cpu < 0.05  # the loop slept: no readable-fd spin
        # The next sleep is not fooled by the stale wake-up into missing a real one.
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.put, "y")
            with anyio.fail_after(5):
                assert await r.get() == "y"
        # A blocking get on another thread still gets its wake-up.
        got = []
        thread = threading.Thread(target=lambda: got.append(r.get_sync(timeout=5)))
        thread.start()
        with anyio.fail_after(5):
            while not r._ring.w[F.reader_word_index(0, F.R_SLEEP)]:  # the thread sleeps in get_sync
                await anyio.sleep(0.001)
        await w.put("z")
        await anyio.to_thread.run_sync(thread.join, 10)
        assert got == ["z"]


# -- closing from another thread, blocking calls in a loop, ends that cross tasks -----------


def _wait_until(condition: Any, what: str, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


@pytest.mark.parametrize("kind", ["eventfd", "pipe"])
@pytest.mark.parametrize("call", ["get_sync", "put_sync", "wait_readers_sync"])
def test_close_from_another_thread_ends_a_blocked_call(kind: str, call: str) -> None:
    """A monitor thread closes an end while a worker thread is blocked in it: the blocked
    call raises ClosedResourceError (never EBADF, never a hang), and nothing leaks."""
    import anyio

    fds = _fds()
    w = aioshmq.create(capacity=4096, max_messages=1, readers=2, notifier=kind)  # type: ignore
    r = aioshmq.connect(w.name, 0)
    if call != "wait_readers_sync":
        w.drop_reader(1)
    end: Any = r if call == "get_sync" else w
    if call == "put_sync":
        w.put_sync(0)  # full by count: the next put waits for the reader
    outcome: list[BaseException | None] = []

    def blocked() -> None:
        try:
            if call == "get_sync":
                r.get_sync()
            elif call == "put_sync":
                w.put_sync(1)
            else:
                w.wait_readers_sync()  # slot 1 never comes
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=blocked, daemon=True)
    thread.start()
    _wait_until(lambda: end._waiting == 1, f"{call} sleeps")
    end.close()  # from this thread: the monitor
    thread.join(10)
    assert not thread.is_alive(), f"{call} still blocked after the close"
    (exc,) = outcome
    assert isinstance(exc, anyio.ClosedResourceError), repr(exc)
    r.close()
    w.close()
    gc.collect()
    assert _fds() == fds


def _run_on(backend: str, main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main`` under anyio on "asyncio", "uvloop" or "trio"."""
    import anyio

    if backend == "uvloop":
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    else:
        anyio.run(main, backend=backend)


async def _get_into(r: aioshmq.Reader[Any], outcome: list[BaseException | None]) -> None:
    """``r.get()``, its exception (or None) appended to ``outcome``."""
    try:
        await r.get()
    except BaseException as exc:
        outcome.append(exc)
    else:
        outcome.append(None)


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_close_from_another_thread_ends_an_awaiting_task(backend: str) -> None:
    """The same for a task of an event loop that runs in another thread."""
    import anyio

    async def nothing() -> None:
        pass

    _run_on(backend, nothing)  # a loop's first run may open fds it keeps (uvloop does)
    fds = _fds()
    w = aioshmq.create(capacity=1 << 16)
    r = aioshmq.connect(w.name, spin=0)
    outcome: list[BaseException | None] = []

    async def main() -> None:
        await _get_into(r, outcome)

    thread = threading.Thread(target=_run_on, args=(backend, main), daemon=True)
    thread.start()
    _wait_until(lambda: r._waiting == 1, "get() sleeps")
    r.close()
    thread.join(10)
    assert not thread.is_alive(), "get() still waiting after the close"
    (exc,) = outcome
    assert isinstance(exc, anyio.ClosedResourceError), repr(exc)
    w.close()
    gc.collect()
    assert _fds() == fds


@pytest.mark.parametrize("backend", ["asyncio", "uvloop"])
def test_a_close_from_another_thread_as_a_task_arms_its_wait(backend: str) -> None:
    """A close from another thread that lands just as a task of a loop arms the future it
    is about to await (the fd is already registered with that loop): the task ends with
    ClosedResourceError, not with a wait that nothing would ever end."""
    import anyio

    w = aioshmq.create(capacity=1 << 16)
    r = aioshmq.connect(w.name, spin=0)
    outcome: list[BaseException | None] = []
    closer: list[threading.Thread] = []

    async def main() -> None:
        with anyio.fail_after(10):
            await w.put(1)
            assert await r.get() == 1
            with anyio.move_on_after(0.01):  # the fd is registered with this loop now
                await r.get()
            assert r._loop is not None
            loop = r._loop
            create_future = loop.create_future

            def closed_meanwhile() -> Any:
                del loop.create_future
                closer.append(threading.Thread(target=r.close))
                closer[0].start()
                while not r._closed:  # the close has begun in the other thread
                    time.sleep(0.0001)
                return create_future()

            loop.create_future = closed_meanwhile  # type: ignore[method-assign]
            await _get_into(r, outcome)

    thread = threading.Thread(target=_run_on, args=(backend, main), daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "get() still waiting after the close"
    closer[0].join(10)
    (exc,) = outcome
    assert isinstance(exc, anyio.ClosedResourceError), repr(exc)
    w.close()


@pytest.mark.anyio
async def test_blocking_calls_are_refused_in_a_running_loop(anyio_backend: object) -> None:
    import anyio

    with aioshmq.create(capacity=1 << 16, readers=1) as w, aioshmq.connect(w.name) as r:
        refused = {
            "put_sync": (lambda: w.put_sync(1, timeout=0.5), r"await writer\.put\(obj\)"),
            "get_sync": (lambda: r.get_sync(timeout=0.5), r"await reader\.get\(\)"),
            "wait_readers_sync": (
                lambda: w.wait_readers_sync(timeout=0.5),
                r"await writer\.wait_readers\(\)",
            ),
        }
        for name, (call, instead) in refused.items():
            with pytest.raises(RuntimeError, match=rf"{name}\(\) blocks.*{instead}"):
                call()
        assert w.statistics().messages_put == 0  # refused before doing anything
        # From a worker thread, outside the loop, they work.
        await anyio.to_thread.run_sync(lambda: w.put_sync(2, timeout=5))
        assert await anyio.to_thread.run_sync(lambda: r.get_sync(timeout=5)) == 2


@pytest.mark.anyio
async def test_ends_open_in_one_task_and_close_in_another(anyio_backend: object) -> None:
    import anyio

    opened: list[Any] = []

    async def opener() -> None:
        w = aioshmq.create(capacity=1 << 16)
        opened.extend([w, aioshmq.connect(w.name)])
        await w.__aenter__()
        await opened[1].__aenter__()

    async with anyio.create_task_group() as tg:
        tg.start_soon(opener)
    w, r = opened
    await w.put("across tasks")
    assert await r.get() == "across tasks"
    await r.__aexit__(None, None, None)
    await w.__aexit__(None, None, None)
    assert w._closed and r._closed


def _loop_check_answers() -> dict[str, bool]:
    """What ``in_event_loop`` (which every ``put_sync`` and ``get_sync`` asks) says in each
    state a thread can be in."""
    import anyio

    from aioshmq.ends.end import in_event_loop

    answers = {"no loop": in_event_loop()}

    async def inside(name: str) -> None:
        answers[name] = in_event_loop()
        answers[f"{name}'s worker thread"] = await anyio.to_thread.run_sync(in_event_loop)

    anyio.run(inside, "asyncio", backend="asyncio")
    anyio.run(inside, "uvloop", backend="asyncio", backend_options={"use_uvloop": True})
    answers["after the loops"] = in_event_loop()
    return answers


_LOOP_CHECK_EXPECTED = {
    "no loop": False,
    "asyncio": True,
    "asyncio's worker thread": False,
    "uvloop": True,
    "uvloop's worker thread": False,
    "after the loops": False,
}


def test_the_loop_check_knows_where_it_runs() -> None:
    """The check is right in and out of asyncio's, uvloop's and trio's loops."""
    import anyio

    from aioshmq.ends.end import in_event_loop

    answers = _loop_check_answers()

    async def in_trio() -> bool:
        return in_event_loop()

    answers["trio"] = anyio.run(in_trio, backend="trio")
    assert answers == {**_LOOP_CHECK_EXPECTED, "trio": True}


def test_the_loop_check_without_trio_imported() -> None:
    """The same in a fresh interpreter (started by subprocess, so no start method applies)
    where trio was never imported."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys, test_end\n"
        "answers = test_end._loop_check_answers()\n"
        "assert 'trio' not in sys.modules, 'trio was imported'\n"
        "print(json.dumps(answers))\n"
    )
    root, path = os.path.dirname(os.path.dirname(aioshmq.__file__)), os.environ.get("PYTHONPATH")
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=os.path.dirname(__file__),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, path)))},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == _LOOP_CHECK_EXPECTED


def test_a_close_never_signals_an_fd_a_leaving_call_let_go() -> None:
    """A get_sync that leaves (a message came) just as another thread closes the reader:
    the close wakes the holders it found while they cannot let the fds go, so it never
    writes to a closed fd (EBADF) or to one that took its number."""
    import time

    with aioshmq.create(capacity=1 << 16) as w:
        r = aioshmq.connect(w.name, spin=0)
        got: list[object] = []

        def get() -> None:
            try:
                got.append(r.get_sync(timeout=30))
            except BaseException as exc:  # closed right after the message: also fine
                got.append(exc)

        thread = threading.Thread(target=get)
        thread.start()
        _wait_until(lambda: r._waiting, "the get sleeps")
        interrupt = r._interrupt

        def late_interrupt() -> None:
            w.put_nowait("x")  # the sleeper wakes and leaves, letting the end go if it can
            deadline = time.monotonic() + 0.3
            while not r._released and time.monotonic() < deadline:
                time.sleep(0.001)
            interrupt()

        r._interrupt = late_interrupt  # type: ignore[method-assign]
        r.close()  # raises OSError(EBADF) if it signals a released end
        thread.join(30)
        assert got and (got[0] == "x" or isinstance(got[0], anyio.ClosedResourceError)), got
        assert r._released


# Every public call of each end, as a child that inherited the end through fork makes it.
# Async ones run in an event loop of the child's own; a context manager is entered too.
_INHERITED_CALLS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "Writer": {
        "put": lambda w: anyio.run(w.put, 1),
        "send": lambda w: anyio.run(w.send, 1),
        "put_many": lambda w: anyio.run(w.put_many, [1, 2]),
        "put_nowait": lambda w: w.put_nowait(1),
        "put_sync": lambda w: w.put_sync(1, timeout=5),
        "reserve": lambda w: w.reserve(8).__enter__(),
        "reserve_array": lambda w: w.reserve_array(4, "int64").__enter__(),
        "wait_readers": lambda w: anyio.run(w.wait_readers),
        "wait_readers_sync": lambda w: w.wait_readers_sync(timeout=5),
        "drop_reader": lambda w: w.drop_reader(0),
        "remote_reader": lambda w: w.remote_reader(0),
        "missing_readers": lambda w: w.missing_readers(),
        "statistics": lambda w: w.statistics(),
    },
    "Reader": {
        "get": lambda r: anyio.run(r.get),
        "receive": lambda r: anyio.run(r.receive),
        "__anext__": lambda r: anyio.run(r.__anext__),
        "get_many": lambda r: anyio.run(r.get_many),
        "get_nowait": lambda r: r.get_nowait(),
        "get_sync": lambda r: r.get_sync(timeout=5),
        "lease": lambda r: anyio.run(r.lease().__aenter__),
        "statistics": lambda r: r.statistics(),
    },
}
# What a child may do with an inherited end: close it (as leaving a `with` block does), look
# at what it names, and ask anyio's typed attributes (it has none).
_HARMLESS = {"close", "aclose", "name", "handle", "address", "index", "extra", "extra_attributes"}


def _use_inherited(ends: dict[str, Any], queue: Any) -> None:
    outcomes = {}
    for role, calls in _INHERITED_CALLS.items():
        for method, call in calls.items():
            try:
                call(ends[role])
                outcomes[f"{role}.{method}"] = "no error"
            except BaseException as exc:
                outcomes[f"{role}.{method}"] = f"{type(exc).__name__}: {exc}"
        ends[role].close()
    queue.put(outcomes)


@pytest.mark.timeout(60)
def test_every_call_of_an_end_inherited_through_fork_says_to_pass_the_handle() -> None:
    """Writer and reader alike, whatever the call: the same error, naming the fix."""
    for role, cls in (("Writer", aioshmq.Writer), ("Reader", aioshmq.Reader)):
        public = {name for name in dir(cls) if not name.startswith("_")} - _HARMLESS
        assert public <= set(_INHERITED_CALLS[role]), f"{role} calls not tried: {public}"
    ctx = multiprocessing.get_context("fork")
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        queue = ctx.Queue()
        child = ctx.Process(target=_use_inherited, args=({"Writer": w, "Reader": r}, queue))
        child.start()
        try:
            outcomes = queue.get(timeout=30)
        finally:
            child.join(30)
        assert child.exitcode == 0
        w.put_nowait("the parent's ends are untouched")
        assert r.get_nowait() == "the parent's ends are untouched"
    for call, outcome in outcomes.items():
        role = call.split(".")[0].lower()
        assert outcome.startswith(
            f"ClosedResourceError: this aioshmq {role} was inherited through fork from process "
            f"{os.getpid()}"
        ), (call, outcome)
        assert "pass the ring's handle" in outcome and "aioshmq.connect()" in outcome, outcome

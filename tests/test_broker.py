"""Attaching readers: by handle under fork, spawn and forkserver, by name from any process."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from conftest import START_METHODS, Children, backend_name, run_backend

import aioshmq

pytestmark = pytest.mark.anyio


def _child_reads(handle: aioshmq.Handle, index: int, backend: str, expected: int) -> None:
    async def main() -> None:
        async with aioshmq.connect(handle, reader=index) as r:
            got = [msg async for msg in r]
        if got != list(range(expected)):
            raise SystemExit(f"reader {index} got {got[:10]}... ({len(got)} messages)")

    run_backend(backend, main)


@pytest.mark.parametrize("method", START_METHODS)
async def test_attach_by_handle(method: str, anyio_backend: object, children: Children) -> None:
    backend = backend_name(anyio_backend)
    async with aioshmq.create(capacity=1 << 16, max_messages=16, readers=2) as w:
        for i in range(2):
            await anyio.to_thread.run_sync(
                children.start, method, _child_reads, w.handle, i, backend, 300
            )
        with anyio.fail_after(60):
            await w.wait_readers()
            for i in range(300):
                await w.put(i)
    assert await anyio.to_thread.run_sync(children.join) == [0, 0]


async def test_attach_by_name_from_unrelated_process() -> None:
    script = textwrap.dedent(
        """
        import sys, aioshmq
        with aioshmq.connect(sys.argv[1], reader=int(sys.argv[2])) as r:
            total = 0
            while True:
                try:
                    total += r.get_sync(timeout=30)
                except Exception as exc:
                    if type(exc).__name__ == "EndOfStream":
                        break
                    raise
        print(total)
        """
    )
    async with aioshmq.create(capacity=1 << 16, readers=1) as w:
        proc = await anyio.open_process([sys.executable, "-c", script, w.name, "0"])
        try:
            with anyio.fail_after(60):
                await w.wait_readers()
                await w.put_many(range(1000))
        finally:
            await w.aclose()
        with anyio.fail_after(60):
            assert proc.stdout is not None
            out = b"".join([chunk async for chunk in proc.stdout])
            assert await proc.wait() == 0
        await proc.aclose()
    assert int(out) == sum(range(1000))


def test_drop_reader() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=2, readers=2) as w:
        with aioshmq.connect(w.name, 0) as r0:
            with pytest.raises(anyio.BusyResourceError, match="slot 0"):
                w.drop_reader(0)
            with pytest.raises(ValueError, match="index=2"):
                w.drop_reader(2)
            w.put_nowait(1)
            w.put_nowait(2)
            assert r0.get_nowait() == 1 and r0.get_nowait() == 2
            with pytest.raises(aioshmq.Full):  # slot 1 never attached: it keeps both
                w.put_nowait(3)
            w.drop_reader(1)
            w.put_nowait(3)
            assert r0.get_nowait() == 3


def test_busy_slot() -> None:
    with aioshmq.create(capacity=1 << 16, readers=2) as w, aioshmq.connect(w.name, 1):
        with pytest.raises(anyio.BusyResourceError, match="slot 1"):
            aioshmq.connect(w.name, 1)
        with aioshmq.connect(w.name, 0):
            pass


def test_slot_out_of_range() -> None:
    with aioshmq.create(capacity=1 << 16, readers=2) as w:
        with pytest.raises(ValueError, match="reader=2 is out of range"):
            aioshmq.connect(w.name, 2)
        with pytest.raises(ValueError, match="reader=-1"):
            aioshmq.connect(w.name, -1)
        with aioshmq.connect(w.name, 1):
            pass


def test_unknown_name() -> None:
    with pytest.raises(FileNotFoundError, match="no-such-ring"):
        aioshmq.connect("no-such-ring")
    with pytest.raises(ValueError, match="name"):
        aioshmq.connect("a/b")


def test_name_of_closed_writer() -> None:
    w = aioshmq.create(capacity=1 << 16)
    handle = w.handle
    w.close()
    with pytest.raises(FileNotFoundError, match=handle.name):
        aioshmq.connect(handle)


def test_received_fds_do_not_leak_into_exec() -> None:
    with aioshmq.create(capacity=1 << 16, notifier="pipe") as w, aioshmq.connect(w.name) as r:
        fds = [*r._wake.fds(), *r._writer_wake.fds(), r._sock.fileno(), r._wait_fd]
        assert not any(os.get_inheritable(fd) for fd in fds)


def test_handle_pickles() -> None:
    import pickle

    with aioshmq.create(capacity=1 << 16) as w:
        h = pickle.loads(pickle.dumps(w.handle))
        assert h == w.handle and str(h) == w.name
        with aioshmq.connect(h):
            pass


def _child_uses_inherited(writer: aioshmq.Writer[int], reader: aioshmq.Reader[int]) -> None:
    # Ends inherited through fork are unusable in the child, and their fds are already
    # closed there: the parent's peers see nothing of them.
    for call in (lambda: writer.put_nowait(1), reader.get_nowait):
        try:
            call()
        except anyio.ClosedResourceError as exc:
            if "inherited through fork" not in str(exc) or "aioshmq.connect()" not in str(exc):
                raise SystemExit(f"the error does not say what happened: {exc}") from None
            continue
        raise SystemExit("an inherited end worked in the child")
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the fd listdir itself used
            pass
    if any("memfd:aioshmq" in target for target in targets):
        raise SystemExit(f"inherited ring fds still open: {targets}")


def test_forked_child_cannot_use_inherited_ends(children: Children) -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        children.start("fork", _child_uses_inherited, w, r)
        assert children.join() == [0]
        w.put_nowait(7)
        assert r.get_nowait() == 7


def test_reader_of_custom_serializer_must_name_it() -> None:
    import pickle

    class Custom:
        dumps = staticmethod(pickle.dumps)
        loads = staticmethod(pickle.loads)

    with aioshmq.create(capacity=1 << 16, serializer=Custom()) as w:
        with pytest.raises(ValueError, match="custom serializer"):
            aioshmq.connect(w.name)
        with aioshmq.connect(w.name, serializer=Custom()) as r:
            w.put_nowait({"k": 1})
            assert r.get_nowait() == {"k": 1}


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
async def test_attach_by_handle_under_pytest_asyncio(method: str, children: Children) -> None:
    """The same broadcast under pytest-asyncio (strict mode), with asyncio and uvloop loops."""
    import asyncio

    async with aioshmq.create(capacity=1 << 16, max_messages=8, readers=2) as w:
        for i in range(2):
            await asyncio.to_thread(
                children.start, method, _child_reads, w.handle, i, "asyncio", 100
            )
        await asyncio.wait_for(w.wait_readers(), 60)
        await asyncio.wait_for(w.put_many(range(100)), 60)
    assert await asyncio.to_thread(children.join) == [0, 0]


# -- peers that die ------------------------------------------------------------------------


def _attach_and_hang(name: str, index: int, keep_socket_alive: bool, ready: Any) -> None:
    """Attach, read nothing, wait to be killed.  Optionally leave a copy of the connection
    in an unrelated process, so only the pidfd can tell that this one died."""
    import subprocess
    import time

    r = aioshmq.connect(name, reader=index)
    if keep_socket_alive:
        fd = os.dup(r._sock.fileno())
        subprocess.Popen(["sleep", "30"], pass_fds=(fd,), start_new_session=True)
    ready.set()  # the copy exists before anybody kills this process
    time.sleep(600)


async def _spawn_hanging_reader(
    children: Children, name: str, index: int, keep_socket_alive: bool = False
) -> int:
    import multiprocessing

    ready = multiprocessing.get_context("spawn").Event()
    proc = await anyio.to_thread.run_sync(
        children.start, "spawn", _attach_and_hang, name, index, keep_socket_alive, ready
    )
    assert await anyio.to_thread.run_sync(ready.wait, 60)
    assert proc.pid is not None
    return proc.pid


@pytest.mark.parametrize("keep_socket_alive", [False, True], ids=["socket", "pidfd"])
async def test_dead_reader_fails_a_waiting_put(
    anyio_backend: object, children: Children, keep_socket_alive: bool
) -> None:
    async with aioshmq.create(capacity=1 << 16, max_messages=4, readers=1) as w:
        pid = await _spawn_hanging_reader(children, w.name, 0, keep_socket_alive)
        with anyio.fail_after(60):
            await w.wait_readers()
        await w.put_many(range(4))
        caught: list[BaseException] = []
        done = anyio.Event()

        async def put_more() -> None:
            try:
                await w.put(4)
            except aioshmq.PeerDied as exc:
                caught.append(exc)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(put_more)
            await anyio.wait_all_tasks_blocked()
            assert w.statistics().tasks_waiting_send == 1
            os.kill(pid, 9)
            with anyio.fail_after(1):  # the required bound
                await done.wait()
        (exc,) = caught
        assert isinstance(exc, aioshmq.PeerDied) and isinstance(exc, anyio.BrokenResourceError)
        assert (exc.index, exc.pid, exc.role) == (0, pid, "reader")
        assert f"reader 0 (pid {pid})" in str(exc)
        # Nothing was lost: the four messages are still there; the next put fails the same way.
        assert w.statistics().messages_in_ring == 4
        with pytest.raises(aioshmq.PeerDied):
            await anyio.to_thread.run_sync(lambda: w.put_sync(5, timeout=5))
        with pytest.raises(aioshmq.PeerDied):
            w.put_nowait(5)
        # The writer can give up on that reader and go on.
        w.drop_reader(0)
        with anyio.fail_after(5):
            await w.put_many(range(10))
        assert w.statistics().messages_in_ring == 0


async def test_dead_reader_detached(anyio_backend: object, children: Children) -> None:
    async with aioshmq.create(
        capacity=1 << 16, max_messages=4, readers=2, on_reader_death="detach"
    ) as w:
        pid = await _spawn_hanging_reader(children, w.name, 1)
        with aioshmq.connect(w.name, 0) as survivor:
            with anyio.fail_after(60):
                await w.wait_readers()
            await w.put_many(range(4))
            got: list[int] = []
            async with anyio.create_task_group() as tg:

                async def read_all() -> None:
                    while len(got) < 20:
                        got.extend(await survivor.get_many())

                tg.start_soon(read_all)
                await anyio.wait_all_tasks_blocked()
                os.kill(pid, 9)
                with anyio.fail_after(5):
                    for i in range(4, 20):
                        await w.put(i)
            assert got == list(range(20))
            assert w.statistics().readers_attached == 1
            # The slot can be attached again, and its new reader starts at the head.
            with aioshmq.connect(w.name, 1) as again:
                await w.put(20)
                assert await again.get() == 20
                assert await survivor.get() == 20


def _write_then_die(name: str, ready: Any, attached: Any, small: int) -> None:
    """Put ``small`` messages, then die (SIGKILL) half-way through a message larger than
    the ring, at the moment the writer has to wait for room."""
    from aioshmq.ring import ring as _ring

    w = aioshmq.create(capacity=1 << 16, readers=2, name=name)  # slot 1 never attaches
    ready.set()
    attached.wait(60)
    for i in range(small):
        w.put_sync(i)
    original = _ring.RingWriter.prepare_sleep

    def die(self: _ring.RingWriter, need: int, messages: int) -> bool:
        os.kill(os.getpid(), 9)
        return original(self, need, messages)

    _ring.RingWriter.prepare_sleep = die  # type: ignore[method-assign]
    w.put_sync(b"z" * (1 << 20))


async def test_dead_writer(anyio_backend: object, children: Children) -> None:
    """Readers get every message the writer completed, then PeerDied; never the half one."""
    import multiprocessing
    import secrets
    import time

    name = f"dead-writer-{secrets.token_hex(4)}"
    ctx = multiprocessing.get_context("spawn")
    ready, attached = ctx.Event(), ctx.Event()
    proc = await anyio.to_thread.run_sync(
        children.start, "spawn", _write_then_die, name, ready, attached, 10
    )
    assert await anyio.to_thread.run_sync(ready.wait, 60)
    got: list[object] = []
    times: dict[str, float] = {}

    async def watch_child() -> None:
        await anyio.to_thread.run_sync(proc.join, 60)
        times["died"] = time.monotonic()

    caught: list[aioshmq.PeerDied] = []
    with aioshmq.connect(name, reader=0) as r:
        attached.set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_child)
            with anyio.fail_after(60):
                try:
                    while True:
                        got.append(await r.get())
                except aioshmq.PeerDied as exc:
                    times["error"] = time.monotonic()
                    caught.append(exc)
        with pytest.raises(aioshmq.PeerDied):
            r.get_nowait()
        with pytest.raises(aioshmq.PeerDied):
            await anyio.to_thread.run_sync(lambda: r.get_sync(timeout=5))
    assert times["error"] - times["died"] < 1.0
    assert got == list(range(10))
    (exc,) = caught
    assert exc.role == "writer" and exc.pid == proc.pid


# -- faults: who serves the ring, hostile peers, fd shortages, failed connects --------------

NOBODY = 65534  # the uid of the stranger in these tests


def _as_stranger(name: str, ready: Any, done: Any) -> None:
    """As another user: serve a ring named ``name`` whose first message, once unpickled,
    runs ``os.getuid`` in the reading process."""
    os.setgid(NOBODY)
    os.setuid(NOBODY)

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return os.getuid, ()

    with aioshmq.create(capacity=1 << 16, name=name) as w:
        w.put_nowait(Payload())
        ready.set()
        done.wait(60)


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")


@needs_root
def test_reader_refuses_a_ring_served_by_another_user(children: Children) -> None:
    import multiprocessing
    import secrets

    name = f"stranger-{secrets.token_hex(4)}"
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    children.start("spawn", _as_stranger, name, ready, done)
    assert ready.wait(60)
    try:
        with pytest.raises(PermissionError, match=rf"uid {NOBODY}.*trusted_uids=\[{NOBODY}\]"):
            aioshmq.connect(name)
        # Trusted on purpose, the stranger's pickle runs here: the reason for the check.
        with aioshmq.connect(name, trusted_uids=[NOBODY]) as r:
            assert r.get_nowait() == os.getuid() == 0
    finally:
        done.set()
    assert children.join() == [0]


def _connect_as_stranger(name: str, result: Any) -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        aioshmq.connect(name, trusted_uids=[0], timeout=30)
    except PermissionError as exc:
        result.put(("PermissionError", str(exc)))
    except Exception as exc:
        result.put((type(exc).__name__, str(exc)))
    else:
        result.put(("connected", ""))


@needs_root
def test_another_user_is_told_it_may_not_attach(children: Children) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    with aioshmq.create(capacity=1 << 16) as w:
        children.start("spawn", _connect_as_stranger, w.name, result)
        kind, text = result.get(timeout=60)
        assert children.join() == [0]
        assert kind == "PermissionError", (kind, text)
        assert f"uid {NOBODY} may not attach" in text and "closed" not in text
        with aioshmq.connect(w.name) as r:  # the writer is alive and serves its own user
            w.put_nowait(1)
            assert r.get_nowait() == 1
    result.close()
    result.join_thread()


def _raw_request(name: str, packet: bytes) -> bytes:
    import socket

    from aioshmq.ends.broker import PREFIX

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(PREFIX + name)
        sock.send(packet)
        return sock.recv(4096)


HOSTILE = [
    b"[" * 4000,  # nesting: a RecursionError in the JSON parser
    b"{" * 400 + b"}" * 400,
    b'{"reader": 0, "pad": "' + b"x" * 8000 + b'"}',  # longer than any request
    b"\xff\xfe not json",
    b"[0]",
    b'{"reader": true}',
    b'{"reader": 1e308}',
    b'{"reader": 99}',
]


@pytest.mark.parametrize("packet", HOSTILE, ids=lambda p: repr(p[:12]))
def test_broker_survives_any_request(packet: bytes) -> None:
    import json

    with aioshmq.create(capacity=1 << 16, max_messages=2) as w:
        reply = json.loads(_raw_request(w.name, packet))
        assert reply["ok"] is False and reply["error"] in ("request", "range")
        # Still served: a reader attaches, waits are woken, and a departure is seen.
        with aioshmq.connect(w.name, timeout=10) as r:
            w.wait_readers_sync(timeout=10)
            w.put_sync(1, timeout=5)
            assert r.get_sync(timeout=5) == 1
        assert w.statistics().readers_attached == 0


def _fill_fds(spare: int) -> list[int]:
    """Open fds until only ``spare`` remain under the soft limit; the caller closes them."""
    fillers = [os.open("/dev/null", os.O_RDONLY)]
    try:
        while True:
            fillers.append(os.dup(fillers[0]))
    except OSError:
        pass
    for _ in range(spare):
        os.close(fillers.pop())
    return fillers


@pytest.fixture
def fd_limit() -> Iterator[None]:
    """A soft fd limit low enough to fill quickly, restored afterwards."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, len(os.listdir("/proc/self/fd")) + 200)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _connect_when_told(name: str, go: Any, result: Any) -> None:
    go.wait(60)
    try:
        with aioshmq.connect(name, timeout=30) as r:
            result.put(("ok", r.get_sync(timeout=30)))
    except Exception as exc:
        result.put((type(exc).__name__, str(exc)))


def test_broker_retries_accept_when_out_of_fds(children: Children, fd_limit: None) -> None:
    import multiprocessing
    import time

    ctx = multiprocessing.get_context("spawn")
    go, result = ctx.Event(), ctx.Queue()
    with aioshmq.create(capacity=1 << 16) as w:
        children.start("spawn", _connect_when_told, w.name, go, result)
        w.put_nowait("hello")
        fillers = _fill_fds(0)
        try:
            go.set()  # the child connects now; accepting it needs an fd there is not
            deadline = time.monotonic() + 60
            # Until the broker has met the shortage (or, as it used to, died of it).
            while not getattr(w._broker, "accept_errors", 0) and w._broker._thread.is_alive():
                assert time.monotonic() < deadline, "the broker never tried to accept"
                time.sleep(0.001)
        finally:
            for fd in fillers:
                os.close(fd)
        assert result.get(timeout=60) == ("ok", "hello")
        assert children.join() == [0]
    result.close()
    result.join_thread()


def test_failed_create_leaves_nothing_at_any_fd_budget(fd_limit: None) -> None:
    import gc
    import secrets

    name = f"budget-{secrets.token_hex(4)}"
    before = len(os.listdir("/proc/self/fd"))
    outcomes = set()
    for spare in range(0, 24):
        fillers = _fill_fds(spare)
        try:
            w = aioshmq.create(capacity=1 << 16, readers=1, name=name)
        except (OSError, MemoryError) as exc:
            outcomes.add(type(exc).__name__)
            for fd in fillers:  # the exception and its traceback are still alive here
                os.close(fd)
            fillers = []
            assert len(os.listdir("/proc/self/fd")) == before, f"fds left at {spare} spare"
            with aioshmq.create(capacity=1 << 16, name=name):  # the name is free
                pass
            continue
        finally:
            for fd in fillers:
                os.close(fd)
        outcomes.add("created")
        with w:  # fully working: its broker serves readers
            with aioshmq.connect(name, timeout=10) as r:
                w.put_nowait(spare)
                assert r.get_nowait() == spare
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == before
    assert outcomes >= {"OSError", "created"}, outcomes


def test_connect_short_of_fds_leaves_the_slot_as_it_was(fd_limit: None) -> None:
    with aioshmq.create(capacity=1 << 16, readers=1) as w:
        for i in range(10):
            w.put_nowait(i)
        fillers = _fill_fds(2)  # room for the socket and for part of what the writer sends
        try:
            with pytest.raises(OSError, match=r"(?i)too many open files"):
                aioshmq.connect(w.name, timeout=10)
        finally:
            for fd in fillers:
                os.close(fd)
        assert w.statistics().messages_in_ring == 10  # still kept for the slot
        with aioshmq.connect(w.name, timeout=10) as r:  # no PeerDied, nothing skipped
            w.wait_readers_sync(timeout=10)
            assert [r.get_nowait() for _ in range(10)] == list(range(10))


def _serve_then_stop(name: str, ready: Any, result: Any) -> None:
    with aioshmq.create(capacity=1 << 16, readers=1, name=name) as w:
        for i in range(10):
            w.put_sync(i)
        ready.set()  # the parent stops this process now, and goes on with it later
        try:
            w.wait_readers_sync(timeout=60)
            for i in range(10, 20):
                w.put_sync(i, timeout=60)
        except Exception as exc:
            result.put(f"{type(exc).__name__}: {exc}")
            return
        result.put("ok")


def _wait_until_stopped(pid: int) -> None:
    """Until the kernel shows process ``pid`` stopped (a signal takes effect a moment later)."""
    import time

    deadline = time.monotonic() + 30
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        assert time.monotonic() < deadline, f"process {pid} never stopped"
        time.sleep(0.001)


def test_connect_that_times_out_leaves_the_slot_as_it_was(children: Children) -> None:
    import multiprocessing
    import secrets
    import signal

    name = f"stopped-{secrets.token_hex(4)}"
    ctx = multiprocessing.get_context("spawn")
    ready, result = ctx.Event(), ctx.Queue()
    proc = children.start("spawn", _serve_then_stop, name, ready, result)
    assert ready.wait(60) and proc.pid is not None
    os.kill(proc.pid, signal.SIGSTOP)
    _wait_until_stopped(proc.pid)
    try:
        with pytest.raises(TimeoutError):
            aioshmq.connect(name, timeout=0.5)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    with aioshmq.connect(name, timeout=30) as r:
        assert [r.get_sync(timeout=30) for _ in range(20)] == list(range(20))
    assert result.get(timeout=60) == "ok"
    assert children.join() == [0]
    result.close()
    result.join_thread()


def test_connect_that_fails_after_the_slot_changed_hands_gives_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from aioshmq.ends import broker as _broker

    release = threading.Event()
    attach = _broker.Broker._attach

    def slow_attach(self: _broker.Broker, *args: Any) -> None:
        release.wait(30)  # the writer is busy: the reader gives up meanwhile
        attach(self, *args)

    monkeypatch.setattr(_broker.Broker, "_attach", slow_attach)
    with aioshmq.create(capacity=1 << 16, readers=2) as w:
        for i in range(10):
            w.put_nowait(i)
        with pytest.raises(TimeoutError):
            aioshmq.connect(w.name, timeout=0.5)
        release.set()
        monkeypatch.undo()
        # Served after the broker handled the failed reader's abort: slot 0 is free again.
        with aioshmq.connect(w.name, reader=1, timeout=30) as other:
            assert w.statistics().readers_attached == 1
            with aioshmq.connect(w.name, timeout=30) as r:
                w.wait_readers_sync(timeout=10)  # no PeerDied for the reader that gave up
                assert [r.get_nowait() for _ in range(10)] == list(range(10))
            assert other.get_nowait() == 0


def test_drop_reader_never_drops_a_reader_attaching_meanwhile() -> None:
    import threading

    with aioshmq.create(capacity=1 << 16, readers=2) as w:
        w.drop_reader(0)  # not part of this test
        readers: list[aioshmq.Reader[Any]] = []
        main = threading.get_ident()

        class Gate:
            """The writer's gate, with a reader attaching just as drop_reader looks."""

            armed = True

            def __init__(self, gate: Any) -> None:
                self.gate = gate

            def __getattr__(self, name: str) -> Any:
                return getattr(self.gate, name)

            def __enter__(self) -> None:
                self.gate.__enter__()

            def __exit__(self, *exc_info: object) -> None:
                self.gate.__exit__(*exc_info)

            def state(self, index: int) -> int:
                state: int = self.gate.state(index)
                if self.armed and threading.get_ident() == main:
                    # drop_reader has just seen slot 1 free: a reader attaches right now.
                    self.armed = False
                    t = threading.Thread(target=lambda: readers.append(aioshmq.connect(w.name, 1)))
                    t.start()
                    t.join(1)  # a correct drop holds the slot: the attach waits for it
                    Gate.attacher = t  # type: ignore[attr-defined]
                return state

        w._ring.gate = Gate(w._ring.gate)  # type: ignore[assignment]
        w.drop_reader(1)
        Gate.attacher.join(30)  # type: ignore[attr-defined]
        (r,) = readers
        with r:
            assert w.statistics().readers_attached == 1  # the reader that came was kept
            w.put_nowait("after")
            assert r.get_nowait() == "after"


def test_a_stopped_broker_makes_the_writer_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever stops the broker thread, the writer says so instead of waiting on it."""
    import selectors
    import threading

    from aioshmq.ends import broker as _broker

    stopped = threading.Event()

    class Breaking(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
        armed = False

        def select(self, timeout: float | None = None) -> Any:
            if Breaking.armed:
                stopped.set()
                raise RuntimeError("boom")
            return super().select(timeout)

    monkeypatch.setattr(_broker.selectors, "DefaultSelector", Breaking)
    with aioshmq.create(capacity=1 << 16, readers=1, max_messages=1) as w:
        Breaking.armed = True
        with pytest.raises(TimeoutError):  # wakes the broker: it meets the broken select
            aioshmq.connect(w.name, timeout=0.5)
        assert stopped.wait(10)
        w._broker._thread.join(10)
        for call in (lambda: w.put_nowait(1), lambda: w.wait_readers_sync(timeout=5)):
            with pytest.raises(anyio.BrokenResourceError, match=r"broker thread .* stopped"):
                call()


def test_busy_slot_says_so_in_plain_words() -> None:
    with aioshmq.create(capacity=1 << 16, readers=1) as w, aioshmq.connect(w.name, 0) as r:
        with pytest.raises(anyio.BusyResourceError) as caught:
            aioshmq.connect(w.name, 0)
        text = str(caught.value)
        assert text.startswith("reader slot 0 of ring") and "held by a live reader" in text
        assert "Another task is already" not in text
        with pytest.raises(anyio.BusyResourceError) as caught:
            w.drop_reader(0)
        assert str(caught.value) == "reader slot 0 is held by a live reader: it cannot be dropped"
        r.close()

"""Attaching readers: by handle under fork, spawn and forkserver, by name from any process."""

from __future__ import annotations

import os
import sys
import textwrap
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
        except anyio.ClosedResourceError:
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
    from aioshmq import _ring

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

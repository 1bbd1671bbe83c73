"""Attaching readers: by handle under fork, spawn and forkserver, by name from any process."""

from __future__ import annotations

import os
import sys
import textwrap

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

"""A mirror carries one remote slot into a local ring for many readers; so does its command."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioshmq
from aioshmq.remote import Mirror

pytestmark = pytest.mark.anyio

SECRET = b"test-secret-" + b"m" * 20
ROOT = Path(__file__).resolve().parent.parent


async def test_a_mirror_gives_every_local_reader_every_message() -> None:
    w = aioshmq.create(capacity=1 << 16, max_messages=32, listen="tcp://127.0.0.1:0", secret=SECRET)
    assert w.address is not None
    m = Mirror(w.address, 0, readers=3, secret=SECRET)
    failures: list[BaseException] = []

    def carry() -> None:
        try:
            m.run()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=carry)
    thread.start()
    try:
        readers = [aioshmq.connect(m.name, reader=i) for i in range(3)]
        assert m.writer.statistics().capacity == 1 << 16
        got: list[list[Any]] = [[], [], []]

        async def read(i: int) -> None:
            async for msg in readers[i]:
                got[i].append(msg)

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(read, i)
            with anyio.fail_after(60):
                for n in range(2000):
                    await w.put((n, "x" * (n % 200)))
                await w.aclose()
        for r in readers:
            r.close()
    finally:
        m.close()
        thread.join(30)
        w.close()
    assert not failures
    expected = [(n, "x" * (n % 200)) for n in range(2000)]
    assert got == [expected, expected, expected]


def _mirror_command(
    address: str, name: str, readers: int, heartbeat: float
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AIOSHMQ_SECRET": SECRET.decode()}
    options = ["--readers", str(readers), "--name", name, "--heartbeat", str(heartbeat)]
    return subprocess.Popen(
        [sys.executable, "-m", "aioshmq", "mirror", address, "--reader", "0", *options],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _ready(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    line = proc.stderr.readline()  # printed once the local ring exists
    assert "aioshmq mirror: ring" in line, line
    return line


@pytest.mark.timeout(60)
def test_the_mirror_command_carries_the_stream_then_exits_0() -> None:
    name = f"mirror-{secrets.token_hex(4)}"
    with aioshmq.create(listen="tcp://127.0.0.1:0", secret=SECRET) as w:
        assert w.address is not None
        proc = _mirror_command(w.address, name, 2, 3.0)
        try:
            _ready(proc)
            readers = [aioshmq.connect(name, reader=i) for i in range(2)]
            w.wait_readers_sync(timeout=30)
            for n in range(500):
                w.put_sync(n)
            w.close()
            for r in readers:
                with r:
                    assert [r.get_sync(timeout=30) for _ in range(500)] == list(range(500))
                    with pytest.raises(anyio.EndOfStream):
                        r.get_sync(timeout=30)
            assert proc.wait(30) == 0
        finally:
            _kill(proc)


@pytest.mark.timeout(60)
def test_a_killed_writer_reaches_the_mirrors_readers_as_peer_died() -> None:
    """The mirror's readers get what arrived, then PeerDied; the command exits 1."""
    name = f"mirror-{secrets.token_hex(4)}"
    code = (
        "import aioshmq, sys, time\n"
        f"w = aioshmq.create(listen='tcp://127.0.0.1:0', secret={SECRET!r}, heartbeat=1.5)\n"
        "print(w.address, flush=True)\n"
        "w.wait_readers_sync(timeout=30)\n"
        "for i in range(100): w.put_sync(i)\n"
        "while w.statistics().messages_in_ring: time.sleep(0.001)\n"
        "print('sent', flush=True)\n"
        "time.sleep(600)\n"
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    proc: subprocess.Popen[str] | None = None
    try:
        assert writer.stdout is not None
        address = writer.stdout.readline().strip()
        proc = _mirror_command(address, name, 1, 1.5)
        _ready(proc)
        with aioshmq.connect(name, reader=0) as r:
            assert writer.stdout.readline().strip() == "sent"
            got = [r.get_sync(timeout=30) for _ in range(100)]
            writer.kill()
            writer.wait(10)
            killed = time.monotonic()
            with pytest.raises(aioshmq.PeerDied, match="cut off"):
                r.get_sync(timeout=30)
            assert time.monotonic() - killed < 1.5 + 5
        assert got == list(range(100))
        assert proc.wait(30) == 1
        assert proc.stderr is not None and "cut off" in proc.stderr.read()
    finally:
        _kill(writer)
        if proc is not None:
            _kill(proc)


@pytest.mark.timeout(60)
def test_a_killed_mirror_is_a_dead_reader_to_the_writer_and_a_dead_writer_to_its_readers() -> None:
    name = f"mirror-{secrets.token_hex(4)}"
    with aioshmq.create(
        capacity=1 << 16, max_messages=16, listen="tcp://127.0.0.1:0", secret=SECRET, heartbeat=1.5
    ) as w:
        assert w.address is not None
        proc = _mirror_command(w.address, name, 1, 1.5)
        try:
            _ready(proc)
            with aioshmq.connect(name, reader=0) as r:
                w.put_sync("first")
                assert r.get_sync(timeout=30) == "first"
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
                with pytest.raises(aioshmq.PeerDied):
                    r.get_sync(timeout=30)
            killed = time.monotonic()
            with pytest.raises(aioshmq.PeerDied, match="remote reader"):
                for n in range(1000):
                    w.put_sync(n, timeout=30)
            assert time.monotonic() - killed < 1.5 + 5
        finally:
            _kill(proc)


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()

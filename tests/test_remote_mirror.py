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
    address: str,
    name: str,
    readers: int,
    heartbeat: float,
    *more: str,
    reader: int = 0,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """The command in a process of its own (start method: a fresh interpreter)."""
    if env is None:
        env = {"AIOSHMQ_SECRET": SECRET.hex()}
    options = ["--readers", str(readers), "--name", name, "--heartbeat", str(heartbeat)]
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "aioshmq", "mirror", address, "--reader", str(reader)),
            *options,
            *more,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m aioshmq mirror ARGS`` run to its end: (status, stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "aioshmq", "mirror", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
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


@pytest.mark.timeout(120)
def test_sigterm_and_sigint_close_each_of_several_mirrors_once_exit_0_and_free_the_slot() -> None:
    """Four mirrors at once, stopped by a signal, three times over on the same slots: each
    exits 0 with no traceback, and its slot is free again for the next round."""
    with aioshmq.create(readers=4, listen="tcp://127.0.0.1:0", secret=SECRET) as w:
        assert w.address is not None
        for round_, sig in enumerate((signal.SIGTERM, signal.SIGINT, signal.SIGTERM)):
            names = [f"mirror-{secrets.token_hex(4)}" for _ in range(4)]
            procs = [
                _mirror_command(w.address, name, 1, 3.0, reader=i) for i, name in enumerate(names)
            ]
            try:
                for proc in procs:
                    _ready(proc)
                w.put_sync(round_)
                for name in names:
                    with aioshmq.connect(name, reader=0) as r:
                        assert r.get_sync(timeout=30) == round_
                for proc in procs:
                    proc.send_signal(sig)
                for proc in procs:
                    assert proc.wait(30) == 0
                    assert proc.stderr is not None
                    err = proc.stderr.read()
                    assert "Traceback" not in err and "Assertion" not in err, err
                deadline = time.monotonic() + 10
                while any(w.remote_reader(i) is not None for i in range(4)):
                    assert time.monotonic() < deadline, "a slot was not given back"
                    time.sleep(0.01)
            finally:
                for proc in procs:
                    _kill(proc)


@pytest.mark.timeout(60)
def test_the_secret_file_is_read_byte_for_byte_and_the_environment_as_hex(tmp_path: Path) -> None:
    """A secret that ends in CR and LF bytes works from the file: nothing is stripped.  The
    second mirror holds the slot the first gave back, after what the first had."""
    secret = secrets.token_bytes(30) + b"\r\n"
    path = tmp_path / "secret"
    path.write_bytes(secret)
    with aioshmq.create(listen="tcp://127.0.0.1:0", secret=secret) as w:
        assert w.address is not None
        for i, env in enumerate(({"AIOSHMQ_SECRET": ""}, {"AIOSHMQ_SECRET": secret.hex().upper()})):
            name = f"mirror-{secrets.token_hex(4)}"
            more = ("--secret-file", str(path)) if i == 0 else ()
            proc = _mirror_command(w.address, name, 1, 3.0, *more, env=env)
            try:
                _ready(proc)
                with aioshmq.connect(name, reader=0) as r:
                    w.put_sync(i)
                    assert r.get_sync(timeout=30) == i
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0
            finally:
                _kill(proc)


def test_every_error_of_the_command_is_one_line_naming_what_to_change(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"0123456789")
    good = tmp_path / "good"
    good.write_bytes(SECRET)
    address = "tcp://127.0.0.1:9"
    cases: list[tuple[list[str], dict[str, str], int, str]] = [
        ([address, "--readers", "0", "--secret-file", str(good)], {}, 2, "--readers"),
        ([address, "--reader", "-1", "--secret-file", str(good)], {}, 2, "--reader"),
        ([address, "--heartbeat", "0", "--secret-file", str(good)], {}, 2, "--heartbeat"),
        (["udp://x:1", "--secret-file", str(good)], {}, 2, "ADDRESS"),
        ([address], {"AIOSHMQ_SECRET": ""}, 2, "--secret-file"),
        ([address, "--secret-file", str(short)], {}, 2, "--secret-file"),
        ([address, "--secret-file", str(tmp_path / "none")], {}, 2, "--secret-file"),
        ([address], {"AIOSHMQ_SECRET": "not hex"}, 2, "AIOSHMQ_SECRET"),
        ([address, "--insecure-loopback", "--secret-file", str(good)], {}, 2, "not both"),
        ([address, "--name", "a/b", "--secret-file", str(good)], {}, 2, "--name"),
        ([address, "--timeout", "0.3", "--secret-file", str(good)], {}, 1, "--timeout"),
    ]
    for args, env, status, flag in cases:
        done = _command(*args, env={"AIOSHMQ_SECRET": "", **env})
        lines = done.stderr.strip().splitlines()
        assert done.returncode == status, (args, done.stderr)
        assert len(lines) == 1 and lines[0].startswith("aioshmq mirror: "), (args, done.stderr)
        assert flag in lines[0], (args, lines[0])


def test_without_pyzmq_the_command_names_the_extra_to_install(tmp_path: Path) -> None:
    fake = tmp_path / "zmq"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'zmq'\", name='zmq')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "aioshmq", "mirror", "tcp://127.0.0.1:9", "--insecure-loopback"],
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "aioshmq mirror: aioshmq's remote path needs pyzmq: pip install 'aioshmq[remote]'"
    )

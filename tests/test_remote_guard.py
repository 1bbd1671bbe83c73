"""Nothing before authentication: a stranger's frames cannot grow the writer's memory, its
half-open handshakes cannot pile up, and a handshake cut short is retried, not taken for a
wrong secret."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _chaos import ChaosProxy

import aioshmq
from aioshmq.remote._auth import Keys
from aioshmq.remote._guard import MAX_UNAUTHENTICATED
from aioshmq.remote._link import Link

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"guard-secret-" + b"g" * 20
MiB = 1 << 20

# The writer runs in a process of its own (start method: a fresh interpreter, subprocess),
# so that its memory and descriptors are measured apart from the test's.
WRITER = f"""
import sys
import aioshmq
w = aioshmq.create(listen="tcp://127.0.0.1:0", secret={SECRET!r})
print(w.address, flush=True)
sys.stdin.read()  # until the test lets go
w.close()
"""


@pytest.fixture
def writer() -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:"), address
        yield proc, address
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _status(pid: int, field: str) -> int:
    """A field of /proc/PID/status, in bytes (the kernel gives kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _port(address: str) -> tuple[str, int]:
    host, port = address[len("tcp://") :].rsplit(":", 1)
    return host, int(port)


def _greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting, as a client."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + bytes(32)


@pytest.mark.timeout(60)
def test_a_frame_claiming_a_gigabyte_before_the_handshake_grows_nothing(
    writer: tuple[subprocess.Popen[str], str],
) -> None:
    proc, address = writer
    peak = _status(proc.pid, "VmHWM")
    sent = 0
    with socket.create_connection(_port(address), timeout=10) as s:
        s.sendall(_greeting(b"CURVE"))
        s.sendall(b"\x02" + (1 << 30).to_bytes(8, "big"))  # a long frame of 1 GiB follows
        zeros = bytes(MiB)
        try:
            while sent < 256 * MiB:
                s.sendall(zeros)
                sent += MiB
        except OSError:  # the writer dropped the connection at the header
            pass
    assert sent < 64 * MiB, f"the writer took {sent // MiB} MiB of a stranger's frame"
    assert _status(proc.pid, "VmHWM") - peak < 32 * MiB
    with aioshmq.connect(address, secret=SECRET, timeout=10) as r:  # it serves on
        assert r.index == 0


@pytest.mark.timeout(60)
def test_half_open_handshakes_are_bounded_and_the_writer_serves_on(
    writer: tuple[subprocess.Popen[str], str],
) -> None:
    proc, address = writer
    base = _fds(proc.pid)
    flood = [socket.create_connection(_port(address), timeout=10) for _ in range(200)]
    try:
        for s in flood:
            s.sendall(_greeting(b"CURVE")[:30])  # and never the rest
            s.setblocking(False)
        # A reader with the secret gets through the flood.
        with aioshmq.connect(address, secret=SECRET, timeout=20) as r:
            assert r.index == 0
        # The writer shut all but the newest of them, long before its handshake timeout.
        open_ = set(flood)
        deadline = time.monotonic() + 4.0
        while len(open_) > MAX_UNAUTHENTICATED and time.monotonic() < deadline:
            ready, _, _ = select.select(list(open_), [], [], 0.2)
            for s in ready:
                try:
                    if not s.recv(4096):
                        open_.discard(s)
                except OSError:
                    open_.discard(s)
        assert len(open_) <= MAX_UNAUTHENTICATED, f"{len(open_)} strangers still connected"
        assert _fds(proc.pid) <= base + MAX_UNAUTHENTICATED + 4
    finally:
        for s in flood:
            s.close()


def test_a_handshake_cut_short_is_retried_until_it_succeeds() -> None:
    with aioshmq.create(listen="tcp://127.0.0.1:0", secret=SECRET) as w:
        assert w.address is not None
        with ChaosProxy(_port(w.address), greet_and_reset=3) as proxy:
            with aioshmq.connect(proxy.address, secret=SECRET, timeout=20) as r:
                w.put_nowait("through")
                assert r.get_sync(timeout=10) == "through"
            assert proxy.accepted >= 4


def test_handshakes_always_cut_short_are_a_timeout_not_a_wrong_secret() -> None:
    with aioshmq.create(listen="tcp://127.0.0.1:0", secret=SECRET) as w:
        assert w.address is not None
        with ChaosProxy(_port(w.address), greet_and_reset=1 << 30) as proxy:
            with pytest.raises(TimeoutError, match=r"could not be reached.*cut short"):
                aioshmq.connect(proxy.address, secret=SECRET, timeout=1.0)
        wrong = b"another-secret-" + b"x" * 20
        with pytest.raises(TimeoutError, match=r"could not be reached.*another secret"):
            aioshmq.connect(w.address, secret=wrong, timeout=1.0)


def test_only_a_completed_refusal_says_the_secret_differs() -> None:
    """A client that completes CURVE with the writer's key, then is refused by its ZAP check
    (a key pair not derived from the secret): the one case that is known for sure."""
    import zmq

    with aioshmq.create(listen="tcp://127.0.0.1:0", secret=SECRET) as w:
        assert w.address is not None
        real = Keys.from_secret(SECRET)
        public, private = zmq.curve_keypair()
        forged = Keys(real.server_public, real.server_secret, public, private)
        with pytest.raises(PermissionError, match="secret differs"):
            Link(w.address, 0, forged, 3.0, 10.0)

"""Shared memory ownership: reserved up front, freed with its last user, even after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import aioshmq

RING = 256 << 20


def _shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


def test_memory_is_reserved_at_creation_and_freed_at_close() -> None:
    before = _shmem_bytes()
    w = aioshmq.create(capacity=RING)
    try:
        assert _shmem_bytes() - before > RING * 0.9  # every page reserved now, not on first use
    finally:
        w.close()
    assert _shmem_bytes() - before < RING * 0.1


def test_nothing_survives_sigkill_of_every_process() -> None:
    """A writer and a reader in two processes, both killed: no file, no memory is left."""
    shm_before = set(os.listdir("/dev/shm"))
    before = _shmem_bytes()
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, aioshmq
            w = aioshmq.create(capacity={RING})
            w.put_sync(b"x" * 1000)
            print(w.name, flush=True)
            sys.stdin.read()
        """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    reader = None
    try:
        assert writer.stdout is not None
        name = writer.stdout.readline().strip()
        reader = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(f"""
                import aioshmq
                r = aioshmq.connect({name!r})
                print(r.get_sync(timeout=30)[:1].decode(), flush=True)
                r.get_sync()
            """),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert reader.stdout is not None
        assert reader.stdout.readline().strip() == "x"
        assert _shmem_bytes() - before > RING * 0.9
    finally:
        for proc in (writer, reader):
            if proc is not None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                for stream in (proc.stdin, proc.stdout):
                    if stream is not None:
                        stream.close()
    assert not _holders(name), "a process still holds the ring's memory"
    assert _shmem_bytes() - before < RING * 0.1
    assert set(os.listdir("/dev/shm")) == shm_before


def _holders(name: str) -> list[str]:
    """Every fd or mapping of the ring's memfd in any process on this machine."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if name in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    found.append(f"{pid} fd {fd}")
            with open(f"/proc/{pid}/maps") as maps:
                found += [f"{pid} maps" for line in maps if name in line]
        except OSError:
            continue
    return found


def test_no_dev_shm_files_ever() -> None:
    before = set(os.listdir("/dev/shm"))
    with aioshmq.create(capacity=1 << 20) as w, aioshmq.connect(w.name):
        assert set(os.listdir("/dev/shm")) == before


@pytest.mark.parametrize("capacity", [1 << 46])
def test_too_big_for_memory(capacity: int) -> None:
    before = _shmem_bytes()
    with pytest.raises(MemoryError, match=f"capacity={capacity}"):
        aioshmq.create(capacity=capacity)
    assert _shmem_bytes() - before < 16 << 20

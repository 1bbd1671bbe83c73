"""The live view: `python -m aioshmq ls` and `stat` show a ring without disturbing it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aioshmq
from aioshmq.cli.stat import (
    RING_STATES,
    SLOT_STATES,
    format_view,
    observe,
    request_view,
    ring_names,
)
from aioshmq.ring import format as L
from aioshmq.ring.layout import Layout

pytestmark = pytest.mark.anyio


def _name() -> str:
    return f"test-stat-{secrets.token_hex(6)}"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aioshmq", *args], capture_output=True, text=True, timeout=60
    )


async def test_a_snapshot_of_a_live_ring() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=4, readers=3, name=_name()) as w:
        w.drop_reader(2)
        with aioshmq.connect(w.name, 1, spin=0) as r:
            for _ in range(4):
                await w.put(bytes(100))
            assert len(await r.get()) == 100
            view = observe(w.name)
            assert (view.name, view.writer_pid, view.state) == (w.name, os.getpid(), "open")
            assert (view.capacity, view.max_messages, view.serializer) == (65536, 4, "pickle")
            assert view.messages_put == 4 and view.messages_in_ring == 4
            assert not view.writer_asleep
            states = [(s.index, s.state, s.messages_behind) for s in view.slots]
            assert states == [(0, "pending", 4), (1, "attached", 3), (2, "detached", 4)]
            assert view.slots[1].pid == os.getpid()
            assert view.slots[1].bytes_behind * 4 == view.slots[0].bytes_behind * 3

            async with anyio.create_task_group() as tg:
                tg.start_soon(w.put, "one too many")  # the ring is full for slot 0
                await anyio.wait_all_tasks_blocked()
                assert observe(w.name).writer_asleep
                w.drop_reader(0)
            assert [await r.get() for _ in range(4)][-1] == "one too many"

            async with anyio.create_task_group() as tg:
                tg.start_soon(r.get)
                await anyio.wait_all_tasks_blocked()  # asleep: spin=0
                view = observe(w.name)
                assert view.slots[1].asleep and view.messages_in_ring == 0
                await w.put("wakes it")
            assert w.statistics().readers_attached == 1  # observing took no slot


async def test_observing_takes_no_slot_and_leaves_no_trace() -> None:
    with aioshmq.create(capacity=1 << 16, name=_name()) as w:
        for _ in range(3):
            observe(w.name)
        with aioshmq.connect(w.name, 0) as r:  # the only slot is still free
            await w.put("x")
            assert await r.get() == "x"


def test_an_observer_gets_the_memory_read_only() -> None:
    """An observer of the same user could otherwise map the ring writable and scribble it."""
    with aioshmq.create(capacity=1 << 16, name=_name()) as w:
        reply, fd = request_view(w.name)
        try:
            assert reply["ok"] and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            size = os.fstat(fd).st_size
            with pytest.raises(PermissionError):
                mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError):
                os.pwrite(fd, b"x", 0)
            with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as memory:
                view = memoryview(memory)
                try:  # readable, as the live view needs
                    assert Layout.read_header(view)[0].capacity == 1 << 16
                finally:
                    view.release()
        finally:
            os.close(fd)


def test_a_dead_reader_and_a_missing_ring() -> None:
    with pytest.raises(FileNotFoundError):
        observe(_name())
    w = aioshmq.create(capacity=1 << 16)
    name = w.name
    w.close()
    with pytest.raises(FileNotFoundError):
        observe(name)


def test_ls_and_stat_commands() -> None:
    with aioshmq.create(capacity=1 << 20, readers=2, name=_name()) as w:
        w.drop_reader(0)
        w.drop_reader(1)
        w.put_sync({"a": 1})
        ls = _cli("ls")
        assert ls.returncode == (1 if "damaged" in ls.stdout else 0), ls.stderr  # anyone's
        (line,) = [line for line in ls.stdout.splitlines() if line.startswith(w.name)]
        assert line.split()[1:4] == [str(os.getpid()), "open", "0/2"]
        listed = [json.loads(line) for line in _cli("ls", "--json").stdout.splitlines()]
        assert any(v["name"] == w.name and len(v["slots"]) == 2 for v in listed)

        stat = _cli("stat", w.name)
        assert stat.returncode == 0, stat.stderr
        assert stat.stdout == format_view(observe(w.name)) + "\n"
        assert f"ring {w.name}  writer pid {os.getpid()}  open" in stat.stdout

        watched = _cli("stat", w.name, "--json", "--watch", "0.01", "--count", "3")
        views = [json.loads(line) for line in watched.stdout.splitlines()]
        assert len(views) == 3 and all(v["messages_put"] == 1 for v in views)

    gone = _cli("stat", w.name)
    assert gone.returncode == 1 and "no aioshmq ring named" in gone.stderr


def test_ring_names_come_from_listening_sockets(tmp_path: Path) -> None:
    table = tmp_path / "unix"
    table.write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0000: 00000002 00000000 00010000 0005 01 1 @aioshmq/ring-a\n"
        "0000: 00000003 00000000 00000000 0005 03 2 @aioshmq/ring-a\n"  # an accepted one
        "0000: 00000002 00000000 00010000 0001 01 3 @other/thing\n"
        "0000: 00000002 00000000 00010000 0005 01 4 @aioshmq/ring-b\n"
        "0000: 00000002 00000000 00000000 0002 07 5\n"
    )
    assert ring_names(str(table)) == ["ring-a", "ring-b"]


def test_this_process_rings_are_listed() -> None:
    with aioshmq.create(capacity=1 << 16, name=_name()) as w:
        w.drop_reader(0)
        assert w.name in ring_names()
    assert w.name not in ring_names()


# Scribbles on a ring's memory (word index in the segment's u64 view, value), and what the
# view says is wrong.
SCRIBBLES = {
    "magic": (L.OFF_MAGIC // 8, int.from_bytes(b"NOTARING", "little"), "bad magic 0x"),
    "version": (L.OFF_MAGIC // 8 + 1, 99, "ring format version 99"),
    "capacity": (L.OFF_MAGIC // 8 + 2, 12345, "inconsistent header: capacity=12345"),
    "closed": (L.writer_word_index(L.W_CLOSED), 7, "its end-of-stream word holds 7"),
}


@contextlib.contextmanager
def _scribbled(w: aioshmq.Writer[Any], what: str) -> Iterator[str]:
    """Ring ``w`` scribbled on as SCRIBBLES says, for the block (the words are restored after
    it); yields what the view is to say is wrong."""
    word, value, problem = SCRIBBLES[what]
    words = w._seg.words
    kept, words[word] = words[word], value
    try:
        yield problem
    finally:
        words[word] = kept


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", sorted(SCRIBBLES))
def test_ls_lists_every_ring_and_marks_a_damaged_one(what: str) -> None:
    with aioshmq.create(capacity=1 << 16, name=_name()) as healthy:
        with aioshmq.create(capacity=1 << 16, name=_name()) as damaged:
            healthy.drop_reader(0)
            damaged.drop_reader(0)
            with _scribbled(damaged, what) as problem:
                ls = _cli("ls")
                listed = [json.loads(line) for line in _cli("ls", "--json").stdout.splitlines()]
    assert ls.returncode == 1 and ls.stderr == "", ls.stderr  # no traceback, no log line
    lines = {line.split()[0]: line for line in ls.stdout.splitlines()[1:]}
    assert lines[healthy.name].split()[1:4] == [str(os.getpid()), "open", "0/1"]
    assert lines[damaged.name].split()[1:3] == [str(os.getpid()), "damaged"]
    assert problem in lines[damaged.name]
    by_name = {view["name"]: view for view in listed}
    assert by_name[healthy.name]["state"] == "open"
    assert by_name[damaged.name]["state"] == "damaged"
    assert problem in by_name[damaged.name]["problem"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", sorted(SCRIBBLES))
def test_stat_of_a_damaged_ring_says_what_is_wrong_in_one_line(what: str) -> None:
    with aioshmq.create(capacity=1 << 16, name=_name()) as w:
        w.drop_reader(0)
        with _scribbled(w, what) as problem:
            stat = _cli("stat", w.name)
            watched = _cli("stat", w.name, "--watch", "0.01", "--count", "2")
        assert _cli("stat", w.name).returncode == 0  # restored, it is a ring again
    for run in (stat, watched):
        assert run.returncode == 1 and run.stdout == ""
        (line,) = run.stderr.splitlines()
        assert line.startswith(f"aioshmq stat: ring {w.name!r} (writer pid {os.getpid()})")
        assert f"is damaged: {problem}" in line, line


def _help(command: str) -> str:
    return " ".join(_cli(command, "--help").stdout.split())  # argparse's wrapping undone


def test_every_state_stat_can_show_is_explained_in_its_help_and_the_docs() -> None:
    from aioshmq.cli import stat

    # Every state a view can hold: each letter the writer sends (or none, or another one)
    # and each value of the end-of-stream word (any other is a damaged ring).
    assert set(stat._BY_LETTER.values()) | {"unknown"} == set(SLOT_STATES)
    assert set(stat._CLOSED.values()) == set(RING_STATES)
    help_text = _help("stat")
    docs = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    for states in (RING_STATES, SLOT_STATES):
        for state, meaning in states.items():
            assert f"{state}: {meaning}" in help_text, state
            assert re.search(rf"^- `{re.escape(state)}`: \S", docs, re.MULTILINE), state
    assert re.search(r"^- `damaged` \(`ls` only\): \S", docs, re.MULTILINE)
    ls_help = _help("ls")
    assert "'damaged' and what is wrong" in ls_help and "1 if any ring listed is damaged" in ls_help

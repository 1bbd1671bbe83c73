"""The live view: `python -m aioshmq ls` and `stat`, read only, never taking a reader slot."""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..ends.broker import OBSERVE, check_name, peer_credentials, reach
from ..ring import format as L
from ..ring.layout import Layout

RING_STATES = {
    "open": "its writer puts messages",
    "closed": "its writer closed it: readers get every message put, then the end of the stream",
    "closed (source lost)": (
        "the writer of a mirror lost the remote writer it copies: readers get every message "
        "that fully arrived, then PeerDied"
    ),
}
SLOT_STATES = {
    "pending": (
        "no reader has attached yet: the writer keeps every message for the reader to come, "
        "waiting for it when the ring is full (closing the writer loses them)"
    ),
    "attached": "a live reader holds it: the writer waits for it when the ring is full",
    "detached": (
        "its reader closed, or the writer dropped the slot (drop_reader): not waited for; "
        "a reader that attaches starts with the next message put"
    ),
    "dead": (
        "its reader's process ended without closing it: a put that must wait for it raises "
        "PeerDied until drop_reader() lets it go (with on_reader_death='detach' such a slot "
        "is detached at once)"
    ),
    "evicted": (
        "its live reader was evicted for not advancing (slow_reader_timeout): not waited "
        "for; the slot is free again once that reader closes"
    ),
    "unknown": "its writer did not say (an aioshmq of another version)",
}
_BY_LETTER = {"p": "pending", "a": "attached", "d": "detached", "x": "dead", "e": "evicted"}
_CLOSED = {0: "open", L.CLOSED_END: "closed", L.CLOSED_BROKEN: "closed (source lost)"}
_ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix: a listening socket
_WIDTH = 78  # columns of the help texts written out here


class DamagedRing(Exception):
    """A live ring whose memory holds what no writer writes (a scribbled header, say):
    what ``observe`` raises instead of a view, without logging it as corruption."""

    def __init__(self, name: str, writer_pid: int, problem: str) -> None:
        super().__init__(f"ring {name!r} (writer pid {writer_pid}) is damaged: {problem}")
        self.name = name
        self.writer_pid = writer_pid  #: of the process that serves it
        self.problem = problem


@dataclass(frozen=True)
class SlotView:
    """One reader slot as the writer sees it."""

    index: int
    state: str  #: one of SLOT_STATES
    pid: int  #: of its reader (of the dead one, for a dead slot); 0 if none
    peer: str  #: the remote reader a relay serves, if any
    messages_behind: int  #: published and not yet read by it
    bytes_behind: int
    asleep: bool  #: waiting for the writer to wake it


@dataclass(frozen=True)
class RingView:
    """A snapshot of one live ring, read from its memory without disturbing it."""

    name: str
    writer_pid: int
    serializer: str
    state: str  #: one of RING_STATES
    capacity: int
    max_messages: int
    messages_put: int  #: published since the ring was made
    bytes_put: int
    messages_in_ring: int  #: held for the slowest reader the writer waits for
    bytes_in_ring: int
    writer_asleep: bool  #: the writer waits for room
    slots: tuple[SlotView, ...]


def observe(name: str, timeout: float = 5.0) -> RingView:
    """A snapshot of ring ``name``: its counters from its memory, mapped read-only, and its
    slots' states from its writer.  Rings of other users are refused, as ``connect`` does;
    a damaged one raises DamagedRing."""
    reply, fd, server = _request(name, timeout)
    try:
        size = os.fstat(fd).st_size
        memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with memory:
        view = memoryview(memory)
        try:
            return _snapshot(name, reply, view, server)
        finally:
            view.release()


def request_view(name: str, timeout: float = 5.0) -> tuple[dict[str, Any], int]:
    """What the writer of ring ``name`` tells an observer: its reply, and a read-only
    descriptor of the ring's memory (the caller closes it)."""
    reply, fd, _server = _request(name, timeout)
    return reply, fd


def _request(name: str, timeout: float) -> tuple[dict[str, Any], int, int]:
    """``request_view``, and the pid of the process that answered."""
    name = check_name(name)
    sock = reach(name, time.monotonic() + timeout, None)
    with sock:
        pid, uid = peer_credentials(sock)
        me = os.getuid()
        if uid != me and me != 0:
            raise PermissionError(f"ring {name!r} belongs to uid {uid}, not to this user ({me})")
        sock.send(OBSERVE)
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 1, socket.MSG_CMSG_CLOEXEC)
        except TimeoutError:
            raise TimeoutError(f"the writer of ring {name!r} did not answer") from None
    if not fds:
        reply = json.loads(msg) if msg else {}
        raise FileNotFoundError(reply.get("message", f"ring {name!r} closed"))
    try:
        return json.loads(msg), fds[0], pid
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _snapshot(name: str, reply: dict[str, Any], buf: memoryview, server: int) -> RingView:
    """The view of ring ``name`` in ``buf``, served by process ``server``."""
    found = Layout.parse_header(buf)
    if isinstance(found, str):
        raise DamagedRing(name, server, found)
    layout, writer_pid = found
    words = buf.cast("Q")
    try:
        head = words[L.writer_word_index(L.W_HEAD)]
        head_count = words[L.writer_word_index(L.W_HEAD_COUNT)]
        closed = words[L.writer_word_index(L.W_CLOSED)]
        writer_asleep = words[L.writer_word_index(L.W_SLEEP)] != 0
        given = reply.get("slots", {})
        states: str = given.get("states", "")
        pids: list[int] = given.get("pids", [])
        peers: dict[str, str] = given.get("peers", {})
        slots = []
        for i in range(layout.readers):
            state = _BY_LETTER.get(states[i : i + 1], "unknown")
            tail = min(words[L.reader_word_index(i, L.R_TAIL)], head)
            count = min(words[L.reader_word_index(i, L.R_TAIL_COUNT)], head_count)
            pid = pids[i] if i < len(pids) else 0
            if state == "attached" and not pid:
                pid = words[L.reader_word_index(i, L.R_PID)]
            slots.append(
                SlotView(
                    index=i,
                    state=state,
                    pid=pid,
                    peer=peers.get(str(i), ""),
                    messages_behind=head_count - count,
                    bytes_behind=head - tail,
                    asleep=state == "attached" and words[L.reader_word_index(i, L.R_SLEEP)] != 0,
                )
            )
    finally:
        words.release()
    if closed not in _CLOSED:
        raise DamagedRing(
            name, server, f"its end-of-stream word holds {closed}, which no writer writes"
        )
    counted = [s for s in slots if s.state not in ("detached", "evicted")]
    return RingView(
        name=name,
        writer_pid=writer_pid,
        serializer=str(reply.get("serializer", "")),
        state=_CLOSED[closed],
        capacity=layout.capacity,
        max_messages=layout.max_messages,
        messages_put=head_count,
        bytes_put=head,
        messages_in_ring=max((s.messages_behind for s in counted), default=0),
        bytes_in_ring=max((s.bytes_behind for s in counted), default=0),
        writer_asleep=writer_asleep,
        slots=tuple(slots),
    )


def ring_names(unix: str = "/proc/net/unix") -> list[str]:
    """The names of the rings served on this machine (in this network namespace)."""
    names = set()
    with open(unix) as table:
        next(table, None)  # the column titles
        for line in table:
            fields = line.split()
            if len(fields) < 8 or not fields[7].startswith("@aioshmq/"):
                continue
            if int(fields[3], 16) & _ACCEPTING:
                names.add(fields[7][len("@aioshmq/") :])
    return sorted(names)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def format_view(view: RingView) -> str:
    """What ``stat`` prints for one snapshot."""
    share = 100.0 * view.bytes_in_ring / view.capacity
    lines = [
        f"ring {view.name}  writer pid {view.writer_pid}  {view.state}  "
        f"serializer {view.serializer}",
        f"bounds: {_size(view.capacity)}, {view.max_messages} messages; in the ring: "
        f"{view.messages_in_ring} messages, {_size(view.bytes_in_ring)} ({share:.1f}%)",
        f"put so far: {view.messages_put} messages, {_size(view.bytes_put)}; writer "
        + ("asleep, waiting for room" if view.writer_asleep else "not waiting"),
        "",
    ]
    rows = [["slot", "state", "pid", "behind", "bytes behind", "asleep", "peer"]]
    for s in view.slots:
        rows.append(
            [
                str(s.index),
                s.state,
                str(s.pid or "-"),
                str(s.messages_behind),
                _size(s.bytes_behind),
                "yes" if s.asleep else "no",
                s.peer or "-",
            ]
        )
    return "\n".join(lines) + _table(rows)


def _explained(title: str, states: dict[str, str]) -> str:
    """A help text's list of ``states`` and what each means."""
    lines = [title]
    for state, meaning in states.items():
        lines += textwrap.wrap(
            f"{state}: {meaning}", _WIDTH, initial_indent="  ", subsequent_indent="      "
        )
    return "\n".join(lines)


LS_EXIT = (
    "A ring whose memory is damaged (a scribbled header, say) is listed with the state "
    "'damaged' and what is wrong with it.  Exit status: 0, or 1 if any ring listed is "
    "damaged (every other ring is listed all the same)."
)
STAT_EXIT = (
    "Exit status: 0, or 1 with one line on stderr saying why if the ring is missing, is "
    "another user's, does not answer, or is damaged."
)


def add_parser(commands: Any) -> None:
    """The ``ls`` and ``stat`` commands of ``python -m aioshmq``."""
    ls = commands.add_parser(
        "ls",
        help="list this user's rings on this machine",
        description="List the rings served on this machine by this user (root: by anyone).",
        epilog="\n\n".join(
            [_explained("A ring's state:", RING_STATES), "\n".join(textwrap.wrap(LS_EXIT, _WIDTH))]
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ls.add_argument("--json", action="store_true", help="one JSON object per ring, a line each")
    ls.set_defaults(run=_run_ls)
    stat = commands.add_parser(
        "stat",
        help="show a live ring: bounds, fill, each slot's state, pid, lag and sleep",
        description=textwrap.fill(
            "Show a live ring without disturbing it: its memory is mapped read-only and no "
            "reader slot is taken.",
            _WIDTH,
        ),
        epilog="\n\n".join(
            [
                _explained("The ring's state:", RING_STATES),
                _explained("A reader slot's state:", SLOT_STATES),
                "\n".join(textwrap.wrap(STAT_EXIT, _WIDTH)),
            ]
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stat.add_argument("name", help="the ring's name (writer.name)")
    stat.add_argument(
        "--watch",
        nargs="?",
        const=1.0,
        type=float,
        metavar="SECONDS",
        help="show it again every SECONDS (1 by default) until interrupted",
    )
    stat.add_argument("--count", type=int, help="with --watch: stop after this many views")
    stat.add_argument("--json", action="store_true", help="JSON instead of a table")
    stat.set_defaults(run=_run_stat)


def _run_ls(args: argparse.Namespace) -> int:
    rows = [["name", "writer pid", "state", "readers", "messages", "bytes", "capacity"]]
    damaged = False
    for name in ring_names():
        try:
            view = observe(name)
        except DamagedRing as exc:
            damaged = True
            if args.json:
                found = {"name": name, "writer_pid": exc.writer_pid, "state": "damaged"}
                print(json.dumps({**found, "problem": exc.problem}))
            else:
                rows.append([name, str(exc.writer_pid), "damaged", "-", "-", "-", "-", exc.problem])
            continue
        except (OSError, ValueError):
            continue  # closed meanwhile, or another user's
        if args.json:
            print(json.dumps(asdict(view)))
            continue
        attached = sum(s.state == "attached" for s in view.slots)
        rows.append(
            [
                name,
                str(view.writer_pid),
                view.state,
                f"{attached}/{len(view.slots)}",
                str(view.messages_in_ring),
                _size(view.bytes_in_ring),
                _size(view.capacity),
            ]
        )
    if not args.json:
        if damaged:  # what is wrong, in a last column
            width = len(rows[0]) + 1
            rows[0].append("problem")
            rows = [row + [""] * (width - len(row)) for row in rows]
        print(_table(rows) if len(rows) > 1 else "no rings")
    return 1 if damaged else 0


def _run_stat(args: argparse.Namespace) -> int:
    shown = 0
    try:
        while True:
            try:
                view = observe(args.name)
            except (FileNotFoundError, PermissionError, TimeoutError, DamagedRing) as exc:
                print(f"aioshmq stat: {exc}", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(asdict(view)), flush=True)
            else:
                if shown:
                    print()
                print(format_view(view), flush=True)
            shown += 1
            if args.watch is None or (args.count is not None and shown >= args.count):
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0

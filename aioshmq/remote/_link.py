"""The reader's side of the remote path: one connection to a writer, carried into a local ring."""

from __future__ import annotations

import collections
import math
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.monitor

from ..base.errors import Busy, CorruptedError
from ..ends.writer import MirrorWriter
from ..ring.layout import Layout
from . import _wire as W
from ._auth import NOBLOCK, Keys, fd_of, readable, secure_client, tune

BYE_WAIT = 1.0
BATCH = 256  # messages taken from the socket per pump, before the ring gets its turn
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_CONNECTED
)


_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclass
class _Run:
    pos: int
    count: int
    end: tuple[int, int]
    records: memoryview
    table: list[tuple[int, int, int]]
    done: int = 0


class Link:
    """One remote reader slot: the handshake, then, at each ``pump``, every record that
    arrived, checked, into a local ring, and the answers the writer needs.

    ``pump`` never blocks: the thread that reads the local ring calls it when the ring is
    empty and sleeps on ``fd`` between calls (a remote reader), or a thread of its own
    does (a mirror).  What it acknowledges is only what the local ring holds (or, once
    the stream ended, what it received): the writer's ring keeps the rest, so a dropped
    connection loses nothing, and a full local ring holds the writer back.
    """

    def __init__(
        self,
        address: str,
        index: int,
        keys: Keys | None,
        heartbeat: float,
        timeout: float | None,
    ) -> None:
        self.address = address
        self.index = index
        self.heartbeat = heartbeat
        self.reason = ""  # why the stream was cut off, once it was
        self.evicted: float | None = None  # the writer's slow_reader_timeout, if it evicted us
        self.over: str | None = None  # "end", "broken" or "cut" once the stream is over
        self._lock = threading.Lock()  # one pump at a time: a ZeroMQ socket is one thread's
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        try:
            sock = self._sock = self._ctx.socket(zmq.DEALER)
            sock.sndhwm = sock.rcvhwm = 0  # the writer's ring bounds what is in flight
            sock.reconnect_ivl = 100
            sock.reconnect_ivl_max = 1000
            sock.routing_id = b"r" + os.urandom(15)  # kept across reconnections
            tune(sock, heartbeat, W.CONTROL_LIMIT)  # until the writer says how big it sends
            secure_client(sock, keys)
            self.welcome = self._handshake(keys, timeout)
            w = self.welcome
            self.layout = Layout(w["capacity"], w["max_messages"], 1)
            # Connected again with the limit the ring implies: an option is read when a
            # connection is made.  The writer sends nothing until this reader speaks again.
            sock.maxmsgsize = W.data_limit(self.layout)
            sock.disconnect(address)
            sock.connect(address)
        except BaseException:
            self.close()
            raise
        self.writer_pid: int = w["pid"]
        self.writer_host: str = w["host"]
        self.fd = fd_of(sock)  #: readable when the socket may have news
        self._timeout = min(heartbeat, float(w["heartbeat"]))  # the shorter side's says
        self._beat = self._timeout / 3
        start = (int(w["start"][0]), int(w["start"][1]))
        self._expect = start  # the next position to arrive
        self._held = start  # what the local ring holds (or, at the end, what arrived)
        self._said = start  # the last acknowledgement sent
        self._ack_bytes = max(self.layout.capacity // 4, 1)
        self._ack_messages = max(self.layout.max_messages // 4, 1)
        self._pending: collections.deque[_Run] = collections.deque()
        self._ended: bool | None = None  # once the end arrived: True if cut off upstream
        self._cut: str | None = None  # the writer sent something impossible, or fell silent
        now = time.monotonic()
        self._heard = self._pumped = now
        self._spoke = -math.inf  # when this side last sent anything
        self._resumed = -math.inf
        self._say(W.PING, start, now)  # go ahead, on this connection

    # -- the handshake -----------------------------------------------------------------------

    def _handshake(self, keys: Keys | None, timeout: float | None) -> dict[str, Any]:
        """HELLO until WELCOME (or a refusal).  A connection that fails or is cut during
        the handshake is retried until ``timeout``; only a completed refusal by the writer's
        authentication says the secret differs."""
        sock = self._sock
        monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        attempts = connected = failed = dropped = 0
        try:
            sock.connect(self.address)
            hello = {
                "v": W.VERSION,
                "reader": self.index,
                "heartbeat": self.heartbeat,
                "peer": f"pid {os.getpid()} on {socket.gethostname()}",
            }
            sock.send(W.pack_json(W.HELLO, hello))
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if deadline is None else max(deadline - time.monotonic(), 0)
                events = dict(poller.poll(None if left is None else int(left * 1000)))
                if monitor in events:
                    event = zmq.utils.monitor.parse_monitor_message(monitor.recv_multipart())
                    kind = event["event"]
                    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                        raise PermissionError(
                            f"the writer at {self.address} refused this reader: its secret "
                            "differs from this reader's"
                        )
                    # Else a connection was refused, or cut during its handshake: again.
                    attempts += kind == zmq.EVENT_CONNECT_RETRIED
                    connected += kind == zmq.EVENT_CONNECTED
                    dropped += kind == zmq.EVENT_DISCONNECTED
                    failed += kind & _FAILED != 0
                    continue
                if sock in events:
                    body = sock.recv()
                    if body[:1] == W.WELCOME:
                        return _check_welcome(W.unpack_json(body))
                    if body[:1] == W.REFUSE:
                        _raise_refusal(W.unpack_json(body))
                    continue
                if left == 0:
                    cut_short = failed or dropped  # a failed handshake may drop too
                    raise TimeoutError(
                        self._unreached(timeout, keys, attempts, connected, cut_short)
                    )
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)

    def _unreached(
        self,
        timeout: float | None,
        keys: Keys | None,
        attempts: int,
        connected: int,
        cut_short: int,
    ) -> str:
        """Why a handshake did not happen in time, as far as ZeroMQ's events tell."""
        text = f"the writer at {self.address} could not be reached within {timeout} s: "
        if cut_short:
            return text + (
                f"{cut_short} handshakes were cut short (a writer with another secret, "
                "something that is not an aioshmq writer, or a network that resets "
                "connections does that)"
                + ("" if keys is not None else "; a writer with a secret needs one here too")
            )
        if connected:
            return text + (
                f"{connected} connections were made and none finished its handshake "
                "(something else listens there, or the network holds the traffic)"
            )
        if attempts:
            return text + "nothing accepted a connection there"
        return text + "nothing answered (the network may drop the traffic)"

    # -- the stream --------------------------------------------------------------------------

    def pump(self, writer: MirrorWriter[Any]) -> float:
        """Take in what arrived, write what fits into ``writer``'s ring, answer the writer;
        never blocks.  Returns the time (``time.monotonic``) by which to call it again at
        the latest, if nothing wakes ``fd`` before: a heartbeat is due then, or the
        writer's silence is judged.  Once the stream is over (``over``), every message
        that fully arrived is in the ring and ``writer`` is closed: as ended, or as cut off
        (``reason`` says why)."""
        with self._lock:
            if self.over is not None:
                return math.inf
            now = time.monotonic()
            if now - self._pumped > 2 * self._beat:
                # Nobody listened meanwhile (this process was starved or frozen): what
                # arrived is read first, and the writer's silence counts from now on.
                self._heard = max(self._heard, now)
            self._pumped = now
            sock = self._sock
            more = False
            if self._cut is None:
                for _ in range(BATCH):
                    if not readable(sock):
                        break
                    frames = sock.recv_multipart(NOBLOCK, copy=False)
                    self._heard = now
                    if not self._take(frames, now):
                        break
                else:
                    more = True
            self._write(writer)
            if self._ended is not None and not self._pending:
                self._finish(writer, "end" if not self._ended else "broken")
                return math.inf
            if self._cut is not None and not self._pending:
                self._finish(writer, "cut")
                return math.inf
            if self._ended is None and self._cut is None:
                if now - self._heard > self._timeout:
                    self._cut = f"no word from the writer for {self._timeout:g} s"
                    return now
                held, said = self._held, self._said
                if held[0] - said[0] >= self._ack_bytes or held[1] - said[1] >= self._ack_messages:
                    self._say(W.ACK, held, now)
                elif now - self._spoke >= self._beat:
                    self._say(W.PING, held, now)  # also acknowledges
            if more or readable(sock):
                return now  # more to take now: the fd need not say so again
            return min(self._spoke + self._beat, self._heard + self._timeout)

    def _take(self, frames: list[zmq.Frame], now: float) -> bool:
        """Handle one message from the writer; False to stop reading (it is cut off)."""
        try:
            return self._handle(frames, now)
        except (ValueError, struct.error) as exc:
            self._cut = f"the writer sent a malformed message: {exc}"
            return False

    def _handle(self, frames: list[zmq.Frame], now: float) -> bool:
        head = frames[0].bytes
        tag = head[:1]
        if tag == W.DATA and len(frames) == 2:
            try:
                new = _trim(head, frames[1].buffer, self.layout, self._expect)
            except CorruptedError as exc:
                self._cut = f"the writer sent a corrupted message: {exc}"
                return False
            if new is None:  # sent again after a reconnection: already here
                self._say(W.ACK, self._held, now)  # it may have missed ours
            elif new.pos != self._expect[0]:
                self._resume(now)  # records went missing: ask again
            else:
                self._pending.append(new)
                self._expect = new.end
        elif tag == W.BEAT:
            sent, acked, answer = W.unpack_beat(head)
            # Asked to answer, it asks again even if it just did: that went with a connection.
            resumed = sent[0] > self._expect[0] and self._resume(now, again=answer)
            if acked[0] < self._held[0]:  # an acknowledgement went missing, or is due
                self._say(W.ACK, self._held, now)
            elif answer and not resumed:  # the writer sends on once it hears from here
                self._say(W.PING, self._held, now)
        elif tag == W.END:
            pos, count, broken = W.END_.unpack_from(head, 1)
            if (pos, count) == self._expect and self._ended is None:
                self._ended = bool(broken)
                # Everything is here (if not yet in the ring): the writer may let go.
                self._say(W.ACK, self._expect, now)
            elif pos > self._expect[0]:
                self._resume(now)
        elif tag == W.REFUSE:
            refusal = W.unpack_json(head)
            after = refusal.get("timeout")
            if refusal.get("error") == "evicted" and isinstance(after, int | float):
                self.evicted = float(after)
            self._cut = f"the writer gave this reader up: {refusal.get('message')}"
            return False
        return True

    def _write(self, writer: MirrorWriter[Any]) -> None:
        """What arrived, into the local ring, as far as it has room."""
        pending = self._pending
        while pending:
            run = pending[0]
            run.done += writer.write_records(run.records, run.table[run.done :])
            if run.done < len(run.table):
                return
            pending.popleft()
            self._held = run.end

    def _resume(self, now: float, again: bool = False) -> bool:
        """Ask for the records after what arrived (once per heartbeat, unless ``again``:
        the first is enough); True if it was asked now."""
        if now - self._resumed <= self._beat and not again:
            return False
        self._say(W.RESUME, self._expect, now)
        self._resumed = now
        return True

    def _say(self, tag: bytes, pos: tuple[int, int], now: float) -> None:
        """Send ``tag`` with a position; an ACK or PING acknowledges everything before it."""
        self._sock.send(tag + W.POS.pack(*pos))
        self._spoke = now
        if tag != W.RESUME:
            self._said = pos

    def _finish(self, writer: MirrorWriter[Any], how: str) -> None:
        """The stream is over and the ring holds all that arrived: close it as ``how``."""
        self.over = how
        if how == "end":
            writer.close()
            return
        self.reason = "the writer's own source was cut off" if how == "broken" else self._cut or how
        writer.close_cut_off()

    @property
    def beat(self) -> float:
        """How often the writer must hear from this side (a third of the heartbeat)."""
        return self._beat

    @property
    def pumped(self) -> float:
        """When ``pump`` last ran (``time.monotonic``)."""
        return self._pumped

    def needs_room(self) -> bool:
        """Whether records wait for room in the local ring (a mirror's readers lag)."""
        return bool(self._pending)

    def send_meta(self, meta: dict[str, Any]) -> None:
        """Tell the writer's owner something about this reader (before the stream)."""
        with self._lock:
            self._sock.send(W.pack_json(W.META, meta))

    def say_bye(self) -> None:
        """Give the slot up and wait (briefly) for the writer to have taken it back.  After
        the end, the writer lets go as soon as it has the last acknowledgement, and says
        so: unless it did, that acknowledgement may have gone with a connection, and is
        said again (else the writer would wait for it, then take this reader for dead)."""
        with self._lock:
            try:
                if self.over is not None and self._let_go(0.0):
                    return
                # What it holds is acknowledged first: the slot's next holder starts after it.
                self._sock.send(W.ACK + W.POS.pack(*self._held), zmq.NOBLOCK)
                self._sock.send(W.BYE, zmq.NOBLOCK)
                self._let_go(BYE_WAIT)
            except zmq.ZMQError:
                pass

    def _let_go(self, wait: float) -> bool:
        """Whether the writer said, within ``wait`` seconds, that it holds no slot for this
        reader any more (what else arrives is dropped: the stream is over)."""
        deadline = time.monotonic() + wait
        while True:
            while readable(self._sock):
                if self._sock.recv_multipart(NOBLOCK)[0][:1] in (W.BYE_OK, W.REFUSE):
                    return True
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                return False

    def close(self) -> None:
        with self._lock:
            sock = getattr(self, "_sock", None)
            if sock is not None:
                sock.close(linger=0)
            self._ctx.term()


def _trim(head: bytes, records: memoryview, layout: Layout, expect: tuple[int, int]) -> _Run | None:
    """The checked DATA message, less any records before ``expect`` (sent twice)."""
    pos, count, end_pos, end_count, run, table = W.check_run(head, records, layout)
    if end_pos <= expect[0]:
        return None
    if pos < expect[0]:
        first = end_pos - len(run)
        for i, (off, _, _) in enumerate(table):
            if first + off == expect[0]:
                return _Run(expect[0], expect[1], (end_pos, end_count), run, table[i:])
        raise CorruptedError(f"a data message from {pos} has no record at {expect[0]}")
    return _Run(pos, count, (end_pos, end_count), run, table)


def _check_welcome(w: dict[str, Any]) -> dict[str, Any]:
    try:
        layout = Layout(int(w["capacity"]), int(w["max_messages"]), 1)
        ok = (
            w.get("v") == W.VERSION
            and layout.capacity % 64 == 0
            and 4096 <= layout.capacity <= 1 << 46
            and layout.max_messages >= 1
            and isinstance(w["serializer"], str)
            and isinstance(w["readers"], int)
            and isinstance(w["pid"], int)
            and isinstance(w["host"], str)
            and isinstance(w["heartbeat"], int | float)
            and 0.05 <= w["heartbeat"] <= 3600
            and len(w["start"]) == 2
            and all(isinstance(x, int) and x >= 0 for x in w["start"])
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CorruptedError(f"a malformed welcome from the writer: {str(w)[:200]}")
    return w


def _raise_refusal(refusal: dict[str, Any]) -> None:
    text = str(refusal.get("message", "refused"))
    code = refusal.get("error")
    if code == "busy":
        raise Busy(text)
    if code == "range":
        raise ValueError(text)
    if code == "gone":
        raise FileNotFoundError(text)
    if code == "version":
        raise RuntimeError(text)
    raise ConnectionRefusedError(text)


__all__ = ["Link"]

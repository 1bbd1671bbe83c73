"""The reader's side of the remote path: one connection to a writer, carried into a local ring."""

from __future__ import annotations

import collections
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import zmq

from ..base.errors import Busy, CorruptedError
from ..ends.writer import MirrorWriter
from ..ring.layout import Layout
from . import _wire as W
from ._auth import Keys, secure_client

BYE_WAIT = 1.0
_HANDSHAKE_FAILED = (
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
    """One remote reader slot: the handshake, then every record, checked, into a local ring.

    What it acknowledges is only what the local ring holds (or, once the stream ended,
    what it received): the writer's ring keeps the rest, so a dropped connection loses
    nothing, and a full local ring holds the writer back.
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
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        try:
            sock = self._sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = sock.rcvhwm = 0  # the writer's ring bounds what is in flight
            sock.reconnect_ivl = 100
            sock.reconnect_ivl_max = 1000
            sock.routing_id = b"r" + os.urandom(15)  # kept across reconnections
            secure_client(sock, keys)
            self.welcome = self._handshake(keys, timeout)
        except BaseException:
            self.close()
            raise
        w = self.welcome
        self.layout = Layout(w["capacity"], w["max_messages"], 1)
        self.writer_pid: int = w["pid"]
        self.writer_host: str = w["host"]
        self._peer_heartbeat = float(w["heartbeat"])

    def _handshake(self, keys: Keys | None, timeout: float | None) -> dict[str, Any]:
        sock = self._sock
        monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
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
                    monitor.recv_multipart()
                    raise PermissionError(
                        f"the handshake with {self.address} failed: its secret differs from "
                        "this reader's (or it is not an aioshmq writer)"
                        + ("" if keys is not None else ", or it needs a secret")
                    )
                if sock in events:
                    body = sock.recv()
                    if body[:1] == W.WELCOME:
                        return _check_welcome(W.unpack_json(body))
                    if body[:1] == W.REFUSE:
                        _raise_refusal(W.unpack_json(body))
                    continue
                if left == 0:
                    raise TimeoutError(
                        f"no answer from {self.address} within {timeout} s: nothing listens "
                        "there, or the network drops the traffic"
                    )
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)

    def run(self, writer: MirrorWriter[Any], stop_fd: int) -> str | None:
        """Receive into ``writer`` (a ring of the writer's capacity) until the stream ends
        (None), ``stop_fd`` is readable ("stopped") or the stream is cut off (why)."""
        sock = self._sock
        timeout = min(self.heartbeat, self._peer_heartbeat)  # the shorter side's says
        beat = timeout / 3
        start = tuple(self.welcome["start"])
        expect: tuple[int, int] = (start[0], start[1])
        acked = shown = expect
        pending: collections.deque[_Run] = collections.deque()
        ended: bool | None = None  # once the end arrived: True if it was cut off upstream
        cut: str | None = None  # the writer sent something impossible: what arrived, then stop
        now = heard = sent = time.monotonic()
        resumed = 0.0
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(stop_fd, zmq.POLLIN)
        poller.register(writer.wait_fd, zmq.POLLIN)
        while True:
            while pending:
                run = pending[0]
                run.done += writer.write_records(run.records, run.table[run.done :])
                if run.done < len(run.table):
                    break
                pending.popleft()
                if ended is None:
                    acked = run.end
            if acked != shown:
                sock.send(W.ACK + W.POS.pack(*acked))
                shown = acked
                sent = time.monotonic()
            if ended is not None and not pending:
                return None if not ended else "the writer's own source was cut off"
            if cut is not None and not pending:
                return cut
            sleeping = False
            if pending:
                if writer.prepare_sleep():
                    sleeping = True
                else:
                    continue
            now = time.monotonic()
            wait = max(min(beat - (now - sent), timeout - (now - heard)), 0)
            # Silence is judged only after a poll that saw nothing: what arrived while this
            # thread did not run (a starved or frozen process) is read first.
            events = dict(poller.poll(int(wait * 1000) + 1))
            if sleeping:
                writer.end_sleep()
            if writer.wait_fd in events:
                writer.drain()
            if stop_fd in events:
                return "stopped"
            now = time.monotonic()
            if sock in events and cut is None:
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    heard = now
                    head = frames[0].bytes
                    tag = head[:1]
                    if tag == W.DATA and len(frames) == 2:
                        try:
                            new = _trim(head, frames[1].buffer, self.layout, expect)
                        except CorruptedError as exc:
                            cut = f"the writer sent a corrupted message: {exc}"
                            poller.unregister(sock)  # nothing more is read from it
                            break
                        if new is None:
                            continue  # sent again after a reconnection: already here
                        if new.pos != expect[0]:
                            if now - resumed > beat:  # records went missing: ask again
                                sock.send(W.RESUME + W.POS.pack(*expect))
                                resumed = sent = now
                            continue
                        pending.append(new)
                        expect = new.end
                    elif tag == W.BEAT:
                        pos, _ = W.unpack_pos(head)
                        if pos > expect[0] and now - resumed > beat:
                            sock.send(W.RESUME + W.POS.pack(*expect))
                            resumed = sent = now
                    elif tag == W.END:
                        pos, count, broken = W.END_.unpack_from(head, 1)
                        if (pos, count) == expect and ended is None:
                            ended = bool(broken)
                            # Everything is here: the writer may let go (its ring is closed).
                            acked, shown = expect, (-1, -1)  # said even if said before
                        elif pos > expect[0] and now - resumed > beat:
                            sock.send(W.RESUME + W.POS.pack(*expect))
                            resumed = sent = now
                    elif tag == W.REFUSE:
                        refusal = W.unpack_json(head)
                        after = refusal.get("timeout")
                        if refusal.get("error") == "evicted" and isinstance(after, int | float):
                            self.evicted = float(after)
                        return f"the writer gave this reader up: {refusal.get('message')}"
            if now - heard > timeout and cut is None and ended is None:
                return f"no word from the writer for {timeout:g} s"
            if now - sent >= beat:
                sock.send(W.PING + W.POS.pack(*expect))
                sent = now

    def send_meta(self, meta: dict[str, Any]) -> None:
        """Tell the writer's owner something about this reader (before ``run``)."""
        self._sock.send(W.pack_json(W.META, meta))

    def say_bye(self) -> None:
        """Give the slot up and wait (briefly) for the writer to have taken it back."""
        try:
            self._sock.send(W.BYE, zmq.NOBLOCK)
            if self._sock.poll(int(BYE_WAIT * 1000)):
                self._sock.recv(zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
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

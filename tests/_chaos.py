"""A TCP proxy on loopback that cuts the connections it carries: at random moments, and
right where a reader's acknowledgement would pass (the acknowledgement then lost with it).

It reads the reader-to-writer direction as ZeroMQ frames (ZMTP 3, plain: the NULL mechanism,
which is what ``insecure_loopback=True`` uses) to know where an acknowledgement is; the
other direction is copied as it comes.  Every cut is a reset (SO_LINGER 0), both ways.
"""

from __future__ import annotations

import random
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

GREETING = 64  # bytes of the ZMTP 3 greeting, each way
ACK = b"A"  # the reader's acknowledgement tag (aioshmq.remote's wire format)
ACK_SIZE = 1 + 16


@dataclass(eq=False)
class _Pair:
    reader: socket.socket  # the connection from the reader
    writer: socket.socket  # the proxy's own connection to the writer
    inbound: bytearray = field(default_factory=bytearray)  # reader bytes not yet framed
    up: int = 0  # greeting bytes passed from the reader
    doomed: bool = False  # reset once the writer's greeting has passed
    down: int = 0  # bytes passed from the writer


class ChaosProxy:
    """Listens on 127.0.0.1; each connection is carried to ``target`` (host, port).  Every
    ``every`` seconds on average it resets every connection it carries; with probability
    ``ack_cut`` it resets a connection instead of passing an acknowledgement on (the first
    ``acks_to_lose`` times, if given).  The first
    ``greet_and_reset`` connections are reset as soon as the writer's greeting passed (a
    handshake cut short).  ``cut()`` resets every connection at once."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        every: float = float("inf"),
        ack_cut: float = 0.0,
        seed: int = 0,
        greet_and_reset: int = 0,
        acks_to_lose: int | None = None,
    ) -> None:
        self._target = target
        self._every = every
        self._ack_cut = ack_cut
        self._doom = greet_and_reset
        self._acks_to_lose = acks_to_lose
        self.accepted = 0  #: connections carried
        self._rng = random.Random(seed)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.cuts = 0  #: resets at random moments
        self.acks_lost = 0  #: connections reset with an acknowledgement dropped
        self._pairs: list[_Pair] = []
        self._stop_r, self._stop_w = socket.socketpair()
        self._cut_done = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)
        self._thread.start()

    def cut(self) -> int:
        """Reset every connection the proxy carries now; returns how many it reset."""
        before = self.cuts
        self._stop_w.send(b"c")
        if not self._cut_done.acquire(timeout=10):
            raise TimeoutError("the proxy's thread did not cut within 10 s")
        return self.cuts - before

    def close(self) -> None:
        self._stop_w.send(b"x")
        self._thread.join(10)
        for pair in self._pairs:
            self._reset(pair)
        for sock in (self._listener, self._stop_r, self._stop_w):
            sock.close()

    def __enter__(self) -> ChaosProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        sel.register(self._stop_r, selectors.EVENT_READ, "stop")
        next_cut = self._next_cut()
        while True:
            left = next_cut - time.monotonic()
            events = sel.select(None if left == float("inf") else max(left, 0.0))
            if time.monotonic() >= next_cut:
                self._cut_all(sel)
                next_cut = self._next_cut()
            for key, _ in events:
                if key.data == "stop":
                    for command in self._stop_r.recv(64):
                        if command == ord("x"):
                            sel.close()
                            return
                        self._cut_all(sel)
                        self._cut_done.release()
                    continue
                if key.data == "accept":
                    self._accept(sel)
                    continue
                pair, from_reader = key.data
                if pair in self._pairs:
                    self._carry(sel, pair, from_reader)

    def _cut_all(self, sel: selectors.BaseSelector) -> None:
        for pair in list(self._pairs):
            self._drop(sel, pair)
            self.cuts += 1

    def _next_cut(self) -> float:
        if self._every == float("inf"):
            return float("inf")
        return time.monotonic() + self._rng.expovariate(1 / self._every)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            out = socket.create_connection(self._target, timeout=5)
        except OSError:
            conn.close()
            return
        for sock in (conn, out):
            sock.setblocking(True)
            sock.settimeout(5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(conn, out, doomed=self.accepted < self._doom)
        self.accepted += 1
        self._pairs.append(pair)
        sel.register(conn, selectors.EVENT_READ, (pair, True))
        sel.register(out, selectors.EVENT_READ, (pair, False))

    def _carry(self, sel: selectors.BaseSelector, pair: _Pair, from_reader: bool) -> None:
        src, dst = (pair.reader, pair.writer) if from_reader else (pair.writer, pair.reader)
        try:
            data = src.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._drop(sel, pair)
            return
        try:
            if not from_reader:
                dst.sendall(data)
                pair.down += len(data)
                if pair.doomed and pair.down >= GREETING:
                    self._drop(sel, pair)
                return
            pair.inbound += data
            for chunk in self._frames(pair):
                if chunk is None:  # an acknowledgement, and its connection to cut
                    self._drop(sel, pair)
                    self.acks_lost += 1
                    return
                dst.sendall(chunk)
        except OSError:
            self._drop(sel, pair)

    def _frames(self, pair: _Pair) -> list[bytes | None]:
        """Whole frames ready to pass on, in order; None in place of an acknowledgement to
        lose (and nothing after it)."""
        buf, out = pair.inbound, []
        if pair.up < GREETING:  # passed on as it comes: the greeting is a dialogue
            n = min(GREETING - pair.up, len(buf))
            out.append(bytes(buf[:n]))
            del buf[:n]
            pair.up += n
        while buf:
            flags = buf[0]
            if flags & 0x02:  # a long frame: 8 bytes of size
                if len(buf) < 9:
                    break
                size, start = struct.unpack_from(">Q", buf, 1)[0], 9
            else:
                if len(buf) < 2:
                    break
                size, start = buf[1], 2
            if len(buf) < start + size:
                break
            body = bytes(buf[start : start + size])
            frame = bytes(buf[: start + size])
            del buf[: start + size]
            is_ack = not flags & 0x04 and size == ACK_SIZE and body[:1] == ACK
            if (
                is_ack
                and self._rng.random() < self._ack_cut
                and (self._acks_to_lose is None or self.acks_lost < self._acks_to_lose)
            ):
                out.append(None)
                return out
            out.append(frame)
        return out

    def _drop(self, sel: selectors.BaseSelector, pair: _Pair) -> None:
        if pair in self._pairs:
            self._pairs.remove(pair)
        for sock in (pair.reader, pair.writer):
            try:
                sel.unregister(sock)
            except (KeyError, ValueError):
                pass
        self._reset(pair)

    @staticmethod
    def _reset(pair: _Pair) -> None:
        for sock in (pair.reader, pair.writer):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            sock.close()

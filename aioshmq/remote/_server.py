"""The writer's side of the remote path: one thread serving its reader slots over ZeroMQ."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio
import zmq

from ..base.errors import CorruptedError, ReaderEvicted
from ..ends.reader import RelayReader
from ..ring.layout import Layout
from ..ring.ring import RingReader
from . import _wire as W
from ._auth import ZAP_ENDPOINT, Keys, secure_server, zap_reply

CHUNK = 256 << 10  # bytes of records per data message, unless one record is bigger
ATTACH_TIMEOUT = 5.0
FINISH_POLL = 0.05


@dataclass(eq=False)
class _Remote:
    """One remote reader: the local slot it holds, and what it has been sent and has."""

    rid: bytes
    index: int
    reader: RelayReader
    ring: RingReader
    heartbeat: float
    peer: str
    acked: tuple[int, int]
    heard: float
    sent_at: float
    sent: tuple[int, int]  # the furthest position sent (the cursor may be rewound below it)
    away: bool = False  # its connection dropped: nothing is sent until it speaks again
    end: tuple[int, int] | None = None  # where the stream ended, once END was sent
    meta: dict[str, Any] | None = None  # what the reader said about itself (META)


class Server:
    """Serves remote readers of one writer's ring: ``address`` is what they connect to.

    Each remote reader holds its slot through a local reader in this process, whose
    published tail is only what the remote side acknowledged: the ring itself keeps what is
    in flight, so nothing is lost when a connection drops, memory stays bounded by the
    ring, and a slow remote reader holds the writer back like a slow local one.
    """

    def __init__(
        self,
        ring_name: str,
        layout: Layout,
        serializer: str,
        listen: str,
        keys: Keys | None,
        heartbeat: float,
    ) -> None:
        self.ring_name = ring_name
        self.layout = layout
        self.serializer = serializer
        self.keys = keys
        self.heartbeat = heartbeat
        self.failure: BaseException | None = None
        self.refused = 0  # handshakes refused (a wrong client key) and requests refused
        self.requests = 0  # messages received from remote readers that passed the handshake
        self.resends = 0  # times a remote reader got records again (a dropped connection)
        self.deaths = 0  # remote readers given up as dead
        self._remotes: dict[bytes, _Remote] = {}
        self._attaching: set[int] = set()  # slots whose remote reader is being attached
        self._finishing = False
        self._abandoned = False
        self._host = socket.gethostname()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self._stop_r = self._stop_w = -1
        try:
            self._zap = self._ctx.socket(zmq.REP)
            self._zap.linger = 0
            self._zap.bind(ZAP_ENDPOINT)
            self._router = self._ctx.socket(zmq.ROUTER)
            router = self._router
            router.linger = 0
            router.router_mandatory = 1
            router.router_handover = 1
            router.sndhwm = router.rcvhwm = 0  # the ring bounds what is in flight
            secure_server(router, keys)
            try:
                router.bind(listen)
            except zmq.ZMQError as exc:
                raise OSError(exc.errno, f"cannot listen on {listen!r}: {exc}") from None
            self.address = router.get_string(zmq.LAST_ENDPOINT)
            if self.address.startswith("ipc://"):
                os.chmod(self.address[len("ipc://") :], 0o600)
            self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._thread = threading.Thread(
                target=self._run, name=f"aioshmq-remote-{ring_name}", daemon=True
            )
            self._thread.start()
        except BaseException:
            self._close_sockets()
            raise

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # never silent: remote readers then see no heartbeat
            self.failure = exc
        finally:
            if not self._abandoned:
                for remote in list(self._remotes.values()):
                    self._drop(remote, dead=True)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        registered: set[int] = set()
        while True:
            # What arrived while this thread did not run (a starved or frozen process) is
            # taken in before anyone's silence is judged: only the peer's own silence counts.
            while not self._receive():
                pass
            now = time.monotonic()
            timeout = self.heartbeat / 3
            for remote in list(self._remotes.values()):
                if now - remote.heard > remote.heartbeat:
                    self._drop(remote, dead=True)
                    continue
                self._pump(remote, now)
                if remote.rid not in self._remotes:
                    continue
                fd = remote.reader.wait_fd
                if fd not in registered:
                    poller.register(fd, zmq.POLLIN)
                    registered.add(fd)
                timeout = min(timeout, remote.heartbeat / 3)
            live = {r.reader.wait_fd for r in self._remotes.values()}
            for fd in registered - live:
                poller.unregister(fd)
            registered &= live
            if self._finishing and not self._remotes:
                return
            events = dict(poller.poll(int(timeout * 1000) + 1))
            for remote in self._remotes.values():
                remote.ring.core.end_sleep()
                if remote.reader.wait_fd in events:
                    remote.reader.drain()
            if self._stop_r in events:
                os.read(self._stop_r, 64)  # finish() was called: serve until all is delivered
            if self._zap in events:
                self._answer_zap()
            if self._router in events:
                self._receive()

    def _answer_zap(self) -> None:
        while True:
            try:
                frames = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = zap_reply(frames, self.keys)
            if reply[2] != b"200":
                self.refused += 1
            self._zap.send_multipart(reply)

    def _pump(self, remote: _Remote, now: float) -> None:
        """Send what the ring holds past what this remote reader was sent; END at the end;
        a heartbeat when there was nothing to send for a while.  Then announce the sleep."""
        ring = remote.ring
        try:
            while not remote.away:
                while (run := ring.next_run(CHUNK)) is not None:
                    pos, count, records = run
                    head = W.DATA + W.RUN.pack(pos, count, ring.core.tail, ring.core.count)
                    # Copied out, then checked: a run the writer may have overwritten (it
                    # evicted this reader) is never sent.
                    data = bytes(records)
                    ring.core.check_evicted()
                    self._send(remote, [head, data], copy=False)
                    if remote.away:
                        return
                    if ring.core.tail > remote.sent[0]:
                        remote.sent = (ring.core.tail, ring.core.count)
                if remote.end is None and ring.closed():
                    remote.end = (ring.core.tail, ring.core.count)
                    self._send(remote, [W.END + W.END_.pack(*remote.end, ring.broken())])
                elif now - remote.sent_at > remote.heartbeat / 3:
                    self._send(remote, [W.BEAT + W.POS.pack(ring.core.tail, ring.core.count)])
                if remote.end is not None or ring.core.prepare_sleep():
                    return
        except CorruptedError:
            self._drop(remote, dead=True)
        except ReaderEvicted as exc:
            self._refuse(remote.rid, "evicted", str(exc), timeout=exc.timeout)
            self._drop(remote, dead=False)

    def _send(self, remote: _Remote, frames: list[Any], copy: bool = True) -> None:
        try:
            self._router.send_multipart([remote.rid, *frames], copy=copy)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # Its connection dropped: what was sent and not acknowledged is still in the
            # ring, and goes again once it is back.
            remote.away = True
            remote.ring.rewind(*remote.acked)
            self.resends += 1
            return
        remote.sent_at = time.monotonic()

    def _receive(self) -> bool:
        """Handle what the remote readers sent, 256 messages at most; True once none is left."""
        for _ in range(256):  # then the rings get their turn again
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self.requests += 1
            if len(frames) != 2 or not frames[1]:
                continue
            rid, body = frames
            remote = self._remotes.get(rid)
            tag = body[:1]
            try:
                if tag == W.HELLO:
                    self._hello(rid, body, remote)
                elif remote is None:
                    text = "this writer holds no slot for that reader (it was given up)"
                    self._refuse(rid, "unknown", text)
                else:
                    remote.heard = time.monotonic()
                    if tag == W.ACK:
                        self._ack(remote, *W.unpack_pos(body))
                    elif tag == W.PING:
                        if remote.away:
                            remote.away = False  # back: send again from what it holds
                    elif tag == W.RESUME:
                        remote.ring.rewind(*remote.acked)
                        self.resends += 1
                        remote.away = False
                    elif tag == W.META:
                        remote.meta = W.unpack_json(body)
                    elif tag == W.BYE:
                        self._drop(remote, dead=False)
                        self._router.send_multipart([rid, W.BYE_OK])
            except (ValueError, zmq.ZMQError) as exc:
                if remote is not None and rid in self._remotes:
                    self._drop(remote, dead=True)
                self._refuse(rid, "request", str(exc))
        return False

    def _hello(self, rid: bytes, body: bytes, remote: _Remote | None) -> None:
        hello = W.unpack_json(body)
        index, heartbeat, peer = hello.get("reader"), hello.get("heartbeat"), hello.get("peer")
        if hello.get("v") != W.VERSION:
            self._refuse(rid, "version", f"protocol version {hello.get('v')!r}, not {W.VERSION}")
            return
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or isinstance(heartbeat, bool)
            or not isinstance(heartbeat, int | float)
            or not 0.05 <= heartbeat <= 3600
            or not isinstance(peer, str)
        ):
            raise ValueError(f"malformed hello {body[:100]!r}")
        if remote is not None:  # the same reader again (its first answer went missing)
            if remote.index != index:
                raise ValueError("a reader asked for a second slot on one connection")
            self._welcome(remote)
            return
        if self._finishing:
            self._refuse(rid, "gone", f"the writer of ring {self.ring_name!r} closed")
            return
        if not 0 <= index < self.layout.readers:
            self._refuse(
                rid,
                "range",
                f"reader={index} is out of range: this ring has readers "
                f"0..{self.layout.readers - 1}",
            )
            return
        peer = f"remote reader {peer[:160]}"
        self._attaching.add(index)  # held remotely from the moment the writer sees it held
        try:
            reader = RelayReader(self.ring_name, index, ATTACH_TIMEOUT, peer)
        except anyio.BusyResourceError as exc:
            self._attaching.discard(index)
            self._refuse(rid, "busy", str(exc))
            return
        except Exception as exc:
            self._attaching.discard(index)
            self._refuse(rid, "attach", str(exc))
            return
        now = time.monotonic()
        ring = reader.ring
        remote = _Remote(
            rid,
            index,
            reader,
            ring,
            min(float(heartbeat), self.heartbeat),  # the shorter of the two sides' timeouts
            peer,
            (ring.core.tail, ring.core.count),
            now,
            now,
            (ring.core.tail, ring.core.count),
        )
        self._remotes[rid] = remote
        self._attaching.discard(index)
        self._welcome(remote)

    def _welcome(self, remote: _Remote) -> None:
        remote.ring.rewind(*remote.acked)
        remote.end = None
        remote.away = False
        info = {
            "v": W.VERSION,
            "capacity": self.layout.capacity,
            "max_messages": self.layout.max_messages,
            "readers": self.layout.readers,
            "serializer": self.serializer,
            "pid": os.getpid(),
            "host": self._host,
            "heartbeat": self.heartbeat,
            "start": list(remote.acked),
        }
        self._send(remote, [W.pack_json(W.WELCOME, info)])

    def _ack(self, remote: _Remote, pos: int, count: int) -> None:
        """The remote reader holds everything before (pos, count): the ring may reuse it."""
        if (pos, count) != remote.acked:
            lo, lo_count = remote.acked
            hi, hi_count = remote.sent
            if not (lo <= pos <= hi and lo_count <= count <= hi_count):
                raise ValueError(f"an acknowledgement of position {pos}, which was never sent")
            ring = remote.ring
            if pos > ring.core.tail:  # sent before a reconnection rewound the cursor: not again
                ring.rewind(pos, count)
            remote.acked = (pos, count)
            ring.release_to(pos, count)
        if remote.end is not None and (pos, count) == remote.end:
            self._drop(remote, dead=False)  # it has everything: the slot is done with

    def _refuse(self, rid: bytes, code: str, message: str, **more: object) -> None:
        self.refused += 1
        try:
            self._router.send_multipart(
                [rid, W.pack_json(W.REFUSE, {"error": code, "message": message, **more})]
            )
        except zmq.ZMQError:
            pass

    def _drop(self, remote: _Remote, *, dead: bool) -> None:
        """Give the slot back: cleanly, or as a dead reader (the writer then says so)."""
        self._remotes.pop(remote.rid, None)
        self.deaths += dead
        try:
            remote.ring.core.end_sleep()
            if dead:
                remote.reader.close(dead=True)
            else:
                remote.reader.close()
        except Exception:
            pass

    # -- the writer's side -----------------------------------------------------------------

    def remote_slot(self, index: int) -> dict[str, Any] | None:
        """None unless slot ``index`` is held by a remote reader; then what it said about
        itself (empty until its META arrives, which follows its HELLO at once)."""
        for remote in list(self._remotes.values()):
            if remote.index == index:
                return dict(remote.meta or {})
        return {} if index in self._attaching else None

    def finish(self) -> None:
        """Once the writer closed: deliver the rest to every remote reader (until each has
        it all, or misses its heartbeats), then stop and release everything."""
        if self._stop_w < 0:
            return
        self._finishing = True
        os.write(self._stop_w, b"x")
        self._thread.join()
        self._close_sockets()

    def abandon(self) -> None:
        """In a forked child: let go of everything without touching the parent's state."""
        self._abandoned = True
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self._stop_r = self._stop_w = -1

    def _close_sockets(self) -> None:
        for sock in (getattr(self, "_router", None), getattr(self, "_zap", None)):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self._stop_r = self._stop_w = -1

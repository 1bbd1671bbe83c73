"""The writer's side of the remote path: its reader slots served over ZeroMQ."""

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
from ..base.log import log
from ..ends.end import call_soon
from ..ends.reader import RelayReader
from ..ring.layout import Layout
from ..ring.ring import RingReader
from . import _wire as W
from ._auth import (
    NOBLOCK,
    ZAP_ENDPOINT,
    Keys,
    fd_of,
    readable,
    secure_server,
    send_frames,
    tune,
    zap_reply,
)
from ._guard import Guard

ATTACH_TIMEOUT = 5.0
PUSH_GAP = 50e-6  # s: puts closer together than this go out together, when the loop is next free
FAREWELL_LINGER_MS = 200  # ms for the last answers to go out once the writer closed


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
    away: bool = True  # nothing is sent until it speaks (after the welcome, or a drop)
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
        self._finish_lock = threading.Lock()
        self._finish_started = False
        self._finished = threading.Event()
        self._abandoned = False
        self._host = socket.gethostname()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self._stop_r = self._stop_w = -1
        # The ROUTER is used by this server's thread and by the writer's (``push``), one at
        # a time: ZeroMQ allows a socket to change threads with a full barrier between.
        self._lock = threading.Lock()
        self._pushed_at = 0.0
        self._flush_due = False
        try:
            self._zap = self._ctx.socket(zmq.REP)
            self._zap.linger = 0
            self._zap.bind(ZAP_ENDPOINT)
            self._router = self._ctx.socket(zmq.ROUTER)
            router = self._router
            router.router_mandatory = 1
            router.router_handover = 1
            router.sndhwm = router.rcvhwm = 0  # the ring bounds what is in flight
            tune(router, heartbeat, W.CONTROL_LIMIT)
            secure_server(router, keys)
            self._guard = Guard(router)
            try:
                router.bind(listen)
            except zmq.ZMQError as exc:
                raise OSError(exc.errno, f"cannot listen on {listen!r}: {exc}") from None
            self._router_fd = fd_of(router)
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
        # The socket's own fd, not the socket: the writer's thread sends on it too (under
        # the lock), and a ZeroMQ socket is polled only by its user.  Its readiness is an
        # edge: its events are read under the lock before every sleep, and a send in the
        # writer's thread that sees news makes the stop pipe readable (``push``).
        poller.register(self._router_fd, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        poller.register(self._guard.monitor, zmq.POLLIN)
        rejoined = False  # a connection finished its handshake: a reader may be back
        while True:
            with self._lock:
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
                    self._pump(remote, now, rejoined)
                    timeout = min(timeout, remote.heartbeat / 3)
                if self._finishing and not self._remotes:
                    return
                if readable(self._router):
                    timeout = 0.0
            ready = dict(poller.poll(int(timeout * 1000) + (timeout > 0)))
            if self._stop_r in ready:
                os.read(self._stop_r, 64)  # finish(), or a push that saw news for this thread
            if self._zap in ready:
                self._answer_zap()
            rejoined = self._guard.monitor in ready and self._guard.watch() > 0

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

    def _pump(self, remote: _Remote, now: float, rejoined: bool = False) -> None:
        """Send what the ring holds past what this remote reader was sent; END at the end;
        a heartbeat when there was nothing to send for a while (under the lock).  One that
        is away is sent a heartbeat that asks for an answer, and so is every reader as soon
        as a connection finished its handshake: one that is back (its drop perhaps not even
        noticed here) then says where it is, and the stream goes on from there."""
        ring = remote.ring
        try:
            if rejoined or (remote.away and now - remote.sent_at > remote.heartbeat / 3):
                self._beat(remote, answer=True)
            if not remote.away:
                while (run := ring.next_run(W.CHUNK)) is not None:
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
                    self._beat(remote, answer=False)
                return
        except CorruptedError:
            self._drop(remote, dead=True)
        except ReaderEvicted as exc:
            self._refuse(remote.rid, "evicted", str(exc), timeout=exc.timeout)
            self._drop(remote, dead=False)

    def _beat(self, remote: _Remote, *, answer: bool) -> None:
        """A heartbeat: what was sent, so a reader that misses some asks again, what was
        acknowledged, so a reader whose acknowledgement was lost says it again, and whether
        it must answer even if neither (this side waits to hear from it)."""
        core = remote.ring.core
        beat = W.BEAT_.pack(core.tail, core.count, *remote.acked, answer)
        self._send(remote, [W.BEAT + beat])

    def _send(self, remote: _Remote, frames: list[Any], copy: bool = True) -> None:
        try:
            send_frames(self._router, [remote.rid, *frames], copy)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # Its connection dropped: what was sent and not acknowledged is still in the
            # ring, and goes again once it is back.
            if not remote.away:
                remote.away = True
                remote.ring.rewind(*remote.acked)
                self.resends += 1
            return
        remote.sent_at = time.monotonic()

    def _receive(self) -> bool:
        """Handle what the remote readers sent, 256 messages at most; True once none is left."""
        for _ in range(256):  # then the rings get their turn again
            if not readable(self._router):
                return True
            frames = self._router.recv_multipart(NOBLOCK, copy=False)
            self.requests += 1
            self._guard.heard(frames[0])
            if len(frames) != 2 or not len(frames[1]):
                continue
            rid, body = frames[0].bytes, frames[1].bytes
            remote = self._remotes.get(rid)
            tag = body[:1]
            try:
                if tag == W.HELLO:
                    self._hello(rid, body, remote)
                elif remote is None:
                    if tag == W.BYE:  # it had everything, or was given up: nothing held
                        self._bye_ok(rid)
                        continue
                    text = "this writer holds no slot for that reader (it was given up)"
                    self._refuse(rid, "unknown", text)
                else:
                    remote.heard = time.monotonic()
                    remote.away = False  # it speaks: from what it holds, send on
                    if tag in (W.ACK, W.PING):  # a heartbeat acknowledges too
                        self._ack(remote, *W.unpack_pos(body))
                    elif tag == W.RESUME:
                        self._resume(remote, *W.unpack_pos(body))
                    elif tag == W.META:
                        remote.meta = W.unpack_json(body)
                    elif tag == W.BYE:
                        self._drop(remote, dead=False)
                        self._bye_ok(rid)
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
        remote.away = True  # it connects again, with its limits, and then says so
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

    def _resume(self, remote: _Remote, pos: int, count: int) -> None:
        """Records after (pos, count) went missing (a dropped connection): send them again,
        from there if the reader holds that much, else from what it acknowledged."""
        lo, lo_count = remote.acked
        hi, hi_count = remote.sent
        if not (lo <= pos <= hi and lo_count <= count <= hi_count):
            pos, count = remote.acked
        remote.ring.rewind(pos, count)
        remote.end = None
        self.resends += 1

    def _ack(self, remote: _Remote, pos: int, count: int) -> None:
        """The remote reader holds everything before (pos, count): the ring may reuse it."""
        if (pos, count) != remote.acked:
            lo, lo_count = remote.acked
            hi, hi_count = remote.sent
            if pos < lo and count < lo_count:
                return  # said before a reconnection, and overtaken: nothing new
            if not (lo <= pos <= hi and lo_count <= count <= hi_count):
                raise ValueError(f"an acknowledgement of position {pos}, which was never sent")
            ring = remote.ring
            if pos > ring.core.tail:  # sent before a reconnection rewound the cursor: not again
                ring.rewind(pos, count)
            remote.acked = (pos, count)
            ring.release_to(pos, count)
        if remote.end is not None and (pos, count) == remote.end:
            self._drop(remote, dead=False)  # it has everything: the slot is done with
            self._bye_ok(remote.rid)  # so it need not say goodbye

    def _bye_ok(self, rid: bytes) -> None:
        """Tell a remote reader that this writer holds no slot for it any more."""
        try:
            self._router.send_multipart([rid, W.BYE_OK])
        except zmq.ZMQError:  # its connection dropped: it asks again, or gives up
            pass

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

    def push(self) -> None:
        """The writer published (called in its thread): send it on to the remote readers
        from this thread, at once if nothing went out in the last PUSH_GAP, else when its
        event loop is next free (a burst of puts goes out together), or at once without a
        loop.  If the server's thread holds the socket, it sends instead."""
        if not self._remotes:
            return
        if self._flush_due or (
            time.monotonic() - self._pushed_at < PUSH_GAP and call_soon(self._flush)
        ):
            self._flush_due = True
            return
        self._send_now()

    def _flush(self) -> None:
        if self._flush_due:
            try:
                self._send_now()
            except Exception as exc:  # in the loop's callback: the server's thread goes on
                log.warning("ring %r: sending to remote readers failed: %r", self.ring_name, exc)

    def _send_now(self) -> None:
        self._flush_due = False
        if self._finishing or not self._lock.acquire(blocking=False):
            self._wake()  # the server's thread is at it: it looks again once done
            return
        try:
            now = self._pushed_at = time.monotonic()
            for remote in list(self._remotes.values()):
                if not remote.away:
                    self._pump(remote, now)
            news = readable(self._router)
        finally:
            self._lock.release()
        if news:  # read by the sends above: the socket's fd may not say so again
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._stop_w, b"w")
        except (BlockingIOError, OSError):  # woken already, or closing
            pass

    def remote_slot(self, index: int) -> dict[str, Any] | None:
        """None unless slot ``index`` is held by a remote reader; then what it said about
        itself (empty until its META arrives, which follows its HELLO at once)."""
        for remote in list(self._remotes.values()):
            if remote.index == index:
                return dict(remote.meta or {})
        return {} if index in self._attaching else None

    def finish(self, wait: bool = True) -> None:
        """Once the writer closed: deliver the rest to every remote reader (until each has
        it all, or misses its heartbeats), then stop and release everything.  With
        ``wait=False`` (in an event loop's thread, which must not wait for the network: a
        remote reader may be served by that very loop) a thread of its own does it;
        ``wait_finished`` waits for that."""
        with self._finish_lock:
            start, self._finish_started = not self._finish_started, True
        if not start:
            if wait:
                self._finished.wait()
            return
        if self._stop_w < 0:  # abandoned (a forked child's copy): nothing to deliver
            self._finished.set()
            return
        self._finishing = True
        self._wake()
        if wait:
            self._complete()
        else:  # not a daemon: the interpreter's exit waits for the delivery
            threading.Thread(target=self._complete, name=f"{self._thread.name}-end").start()

    def wait_finished(self) -> None:
        """Wait until a ``finish`` (called, or yet to be) has delivered and released all."""
        self._finished.wait()

    def _complete(self) -> None:
        try:
            self._thread.join()
            self._close_sockets()
        finally:
            self._finished.set()

    def abandon(self) -> None:
        """In a forked child: let go of everything without touching the parent's state."""
        self._abandoned = True
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self._stop_r = self._stop_w = -1

    def _close_sockets(self) -> None:
        guard = getattr(self, "_guard", None)
        if guard is not None:
            guard.close()
        router = getattr(self, "_router", None)
        if router is not None:
            # A moment for the last answers (each remote reader's BYE_OK) to go out.
            router.close(linger=FAREWELL_LINGER_MS)
        zap = getattr(self, "_zap", None)
        if zap is not None:
            zap.close(linger=0)
        self._ctx.term()
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self._stop_r = self._stop_w = -1

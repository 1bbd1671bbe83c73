"""Attaching readers: the writer's broker thread and the handshake readers run against it.

A ring is found by name through an abstract Unix socket (no file to leak, gone with the
writer's process).  Each side checks who the other is (``SO_PEERCRED``) before it trusts it:
the broker serves only its own user and root, a reader accepts only a writer of its own
user (or of a uid it names).  An attaching reader asks for a slot, receives the memfd and
the wake-up fds over SCM_RIGHTS, maps the ring, and only then confirms; the slot changes
hands at the confirmation, so a connect that fails on the way leaves the slot as it was.
The reader keeps the connection open: its end-of-file tells the writer the reader has gone
(and the reader that the writer has), whoever closed it and however the process ended.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..base.errors import Busy
from ..base.log import log
from ..memory.notify import Notifier, NotifierKind
from ..ring import format as F
from ..ring.ring import RingWriter

PREFIX = "\0aioshmq/"
OBSERVE = b'{"observe": true}'  # a live view's request: no slot, the memory read-only
NAME_MAX = 100
BYE = b"bye"  # reader -> broker: a clean departure; broker -> reader: acknowledged
ATTACH = b"attach"  # reader -> broker: mapped and ready, hand me the slot
ATTACHED = b"attached"  # broker -> reader: the slot is yours
ABORT = b"abort"  # reader -> broker: the connect failed, put the slot back as it was
MAX_REQUEST = 512  # bytes: an attach request is a small JSON object
ACCEPT_RETRY = 0.05  # s: pause before accepting again after running out of fds
_CRED = struct.Struct("3i")


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    if not name or len(name.encode()) > NAME_MAX or "/" in name or "\0" in name:
        raise ValueError(f"name={name!r}: need 1 to {NAME_MAX} bytes without '/' or NUL")
    return name


def _who(conn: _Conn) -> str:
    return f"pid {conn.pid}" + (f", relaying {conn.peer}" if conn.peer else "")


def pidfd_of(pid: int) -> int:
    """An fd that becomes readable when process ``pid`` exits; -1 where pidfds are missing.

    The connection's end-of-file already tells that the peer has gone; the pidfd also tells
    it when a stray copy of the peer's socket outlives the peer's process.
    """
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel recorded them."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, _gid = _CRED.unpack(creds)
    return pid, uid


def fds_for(kind: NotifierKind) -> int:
    """How many fds a reader receives: the memfd, the writer's wake-up write end, its own
    wake-up fd, and for a pipe its write end too (so a closing thread can wake a sleeper)."""
    return 4 if kind == "pipe" else 3


class _Conn:
    """One reader connection: granted a slot on request, holding it once it confirms."""

    __slots__ = ("attached", "bye", "index", "peer", "pid", "pidfd", "prior", "sock", "uid")

    def __init__(self, sock: socket.socket, pid: int, uid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.index: int | None = None  # the slot granted (reserved, then held)
        self.attached = False
        self.prior: tuple[int, int] = (0, 0)  # the slot's state and dead pid before the attach
        self.pidfd = -1
        self.bye = False
        self.peer = ""  # who really reads, where the attaching process relays a remote reader

    def close(self) -> None:
        self.sock.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Broker:
    """Serves attach requests for one ring and notices when a reader goes away.

    It survives any request and any transient error (a malformed or hostile packet is
    refused, a shortage of fds pauses accepting); if its thread ever stops for another
    reason, ``failure`` says why and the writer raises instead of waiting on it.
    """

    def __init__(
        self,
        name: str,
        ring: RingWriter,
        segment_fd: int,
        writer_wake: Notifier,
        reader_wake: list[Notifier],
        serializer: str,
        on_change: Callable[[], None],
        *,
        detach_dead: bool,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.ring = ring
        self.segment_fd = segment_fd
        self.writer_wake = writer_wake
        self.reader_wake = reader_wake
        self.serializer = serializer
        self.on_change = on_change
        self.detach_dead = detach_dead
        self.on_failure = on_failure or on_change
        self.failure: BaseException | None = None
        self.accept_errors = 0  # accepts that met a shortage of fds (and were retried)
        self._uid = os.getuid()
        self._dead_pids: dict[int, int] = {}
        self._dead_peers: dict[int, str] = {}
        self._conns: set[_Conn] = set()
        self._resume_accept: float | None = None
        self._stop_r = self._stop_w = -1
        self._sel: selectors.BaseSelector | None = None
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            try:
                self._listener.bind(PREFIX + name)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise FileExistsError(
                        f"an aioshmq ring named {name!r} already exists"
                    ) from None
                raise
            self._listener.listen(64)
            self._listener.setblocking(False)
            self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._sel = selectors.DefaultSelector()
            self._sel.register(self._listener, selectors.EVENT_READ)
            self._sel.register(self._stop_r, selectors.EVENT_READ)
            self._thread = threading.Thread(
                target=self._run, name=f"aioshmq-broker-{name}", daemon=True
            )
            self._thread.start()
        except BaseException:
            self._close_fds()
            raise

    # -- thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # never silent: the writer raises on its next call
            log.error("ring %r: the broker thread stopped: %r", self.name, exc, exc_info=exc)
            self.failure = exc
            try:
                self.on_failure()
            except Exception:
                pass

    def _serve(self) -> None:
        sel = self._sel
        assert sel is not None
        while True:
            timeout = None
            if self._resume_accept is not None:
                timeout = self._resume_accept - time.monotonic()
                if timeout <= 0:
                    self._resume_accept = None
                    sel.register(self._listener, selectors.EVENT_READ)
                    timeout = None
            for key, _ in sel.select(timeout):
                if key.fileobj == self._stop_r:
                    return
                if key.fileobj is self._listener:
                    self._accept(sel)
                    continue
                conn = key.data
                if not isinstance(conn, _Conn) or conn not in self._conns:
                    continue  # gone on an earlier event of this same batch
                try:
                    if key.fileobj is conn.sock:
                        self._readable(sel, conn)
                    else:  # its pidfd: the reader's process has exited
                        self._gone(sel, conn)
                except Exception:  # whatever one peer did, the others go on being served
                    self._settle(sel, conn)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError:
            # Out of fds (EMFILE, ENFILE) or kernel memory: the connection waits in the
            # backlog, and retrying at once would spin on it.
            self.accept_errors += 1
            sel.unregister(self._listener)
            self._resume_accept = time.monotonic() + ACCEPT_RETRY
            return
        try:
            pid, uid = peer_credentials(sock)
            sock.setblocking(False)
            conn = _Conn(sock, pid, uid)
            sel.register(sock, selectors.EVENT_READ, conn)
        except Exception:
            sock.close()
            return
        self._conns.add(conn)

    def _readable(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        try:
            data, _anc, flags, _addr = conn.sock.recvmsg(MAX_REQUEST)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, flags = b"", 0
        if not data:  # end of file
            self._gone(sel, conn)
        elif conn.index is None:
            if flags & socket.MSG_TRUNC:
                text = f"attach request longer than {MAX_REQUEST} bytes"
                self._refuse(sel, conn, "request", text)
            else:
                self._grant(sel, conn, data)
        elif not conn.attached:
            if data == ATTACH:
                self._attach(sel, conn)
            else:  # an abort, or garbage: the connect failed before the slot changed hands
                self._drop(sel, conn)
        elif data == BYE:
            conn.bye = True
            self._gone(sel, conn)  # acknowledged there: the slot is free when close() returns
        elif data == ABORT:
            self._abort(sel, conn)
        else:  # garbage from an attached reader: it is gone
            self._gone(sel, conn)

    def _grant(self, sel: selectors.BaseSelector, conn: _Conn, data: bytes) -> None:
        """Phase one: reserve the slot and send the fds; nothing about the slot changes yet."""
        try:
            if conn.uid not in (self._uid, 0):
                # Refused once its request is read: closing with it unread would reset the
                # connection, and the reader would never see why.
                raise _Refused(
                    "permission",
                    f"user uid {conn.uid} may not attach to ring {self.name!r}: it belongs to "
                    f"uid {self._uid}, and only the same user or root may attach",
                )
            if data == OBSERVE:
                self._observe(sel, conn)
                return
            index, conn.peer = _parse_request(data, self.ring.layout.readers)
            holder = next((c for c in self._conns if c.index == index), None)
            if holder is not None and self._settle_queued(sel, holder):
                holder = None
            if holder is not None:
                raise _Refused(
                    "busy",
                    f"reader slot {index} of ring {self.name!r} is held by a live reader "
                    f"(pid {holder.pid})",
                )
        except _Refused as exc:
            self._refuse(sel, conn, exc.code, str(exc))
            return
        conn.index = index
        reply = {"ok": True, "notifier": self.writer_wake.kind, "serializer": self.serializer}
        wake = self.reader_wake[index]
        fds = [self.segment_fd, self.writer_wake.write_fd, wake.read_fd]
        if wake.kind == "pipe":
            fds.append(wake.write_fd)
        try:
            socket.send_fds(conn.sock, [json.dumps(reply).encode()], fds)
        except OSError:
            self._drop(sel, conn)  # the reader went away already

    def _observe(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        """A live view (``python -m aioshmq stat``): the ring's memory, to map read-only, and
        what only this process knows of its slots; no slot changes hands."""
        holders = {c.index: c for c in self._conns if c.attached}
        letters = {
            F.PENDING: "p",
            F.ATTACHED: "a",
            F.DETACHED: "d",
            F.DEAD: "x",
            F.EVICTED: "e",
        }
        states = "".join(letters.get(state, "?") for state in self.ring.gate.states())
        pids, peers = [], {}
        for index in range(len(states)):
            holder = holders.get(index)
            pids.append(holder.pid if holder else self._dead_pids.get(index, 0))
            peer = holder.peer if holder else self._dead_peers.get(index, "")
            if peer:
                peers[str(index)] = peer
        slots = {"states": states, "pids": pids, "peers": peers}
        reply = {"ok": True, "serializer": self.serializer, "slots": slots}
        try:
            # A descriptor of its own, opened read-only: an observer cannot map it writable.
            view = os.open(f"/proc/self/fd/{self.segment_fd}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                socket.send_fds(conn.sock, [json.dumps(reply).encode()], [view])
            finally:
                os.close(view)
        except OSError:
            pass
        self._drop(sel, conn)

    def _settle_queued(self, sel: selectors.BaseSelector, holder: _Conn) -> bool:
        """Handle what ``holder`` has already sent (a bye, an abort, its end-of-file) before
        calling its slot busy: a reader that retries at once after a failed connect, or
        after closing, must not find its own departure still unread.  True if it left."""
        for _ in range(4):  # at most a few packets: a bye or an abort comes before the end
            try:
                peek = holder.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                peek = b""
            if not peek:
                self._gone(sel, holder)
            else:
                self._readable(sel, holder)
            if holder not in self._conns:
                return True
        return False

    def _attach(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        """Phase two: the reader has mapped the ring; the slot is now its own."""
        index = conn.index
        assert index is not None
        self.reader_wake[index].drain()
        conn.prior = (self.ring.attach(index), self._dead_pids.pop(index, 0))
        conn.attached = True
        conn.pidfd = pidfd_of(conn.pid)
        if conn.pidfd >= 0:
            sel.register(conn.pidfd, selectors.EVENT_READ, conn)
        try:
            conn.sock.send(ATTACHED)
        except OSError:
            pass  # the reader went away already: its end-of-file settles the slot
        log.info("ring %r: reader %d attached (%s)", self.name, index, _who(conn))
        self.on_change()

    def _abort(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        """The reader's connect failed after the slot changed hands: give it back as it was."""
        index = conn.index
        assert index is not None
        state, dead_pid = conn.prior
        self.ring.restore(index, state)
        if state == F.DEAD:
            self._dead_pids[index] = dead_pid
        self._drop(sel, conn)
        self.on_change()

    def _gone(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        """The connection ended or the reader's process did: free or mark its slot."""
        if not conn.attached:
            self._drop(sel, conn)
            return
        # The pidfd can fire before the socket's last words are read: a "bye" sent just
        # before a normal exit still makes this a clean departure.
        while not conn.bye:
            try:
                data = conn.sock.recv(MAX_REQUEST)
            except OSError:
                break
            if not data:
                break
            if data == ABORT:
                self._abort(sel, conn)
                return
            conn.bye = data == BYE
        index = conn.index
        assert index is not None
        dead = not (conn.bye or self.detach_dead)
        if dead:
            self._dead_pids[index] = conn.pid
            self._dead_peers[index] = conn.peer
        prior = self.ring.leave(index, dead)
        if prior == F.EVICTED:
            self._dead_pids.pop(index, None)
            self._dead_peers.pop(index, None)
            log.info(
                "ring %r: evicted reader %d (%s) %s; its slot is free",
                self.name,
                index,
                _who(conn),
                "closed" if conn.bye else "ended",
            )
        elif conn.bye:
            log.info("ring %r: reader %d detached (%s)", self.name, index, _who(conn))
        else:
            log.warning(
                "ring %r: reader %d (%s) died while attached; %s",
                self.name,
                index,
                _who(conn),
                "its slot is detached (on_reader_death='detach')"
                if self.detach_dead
                else "the writer raises PeerDied when it waits for it",
            )
        if conn.bye:
            try:
                conn.sock.send(BYE)
            except OSError:
                pass
        self._drop(sel, conn)
        self.on_change()

    def _settle(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        """Handling ``conn`` failed: end it as if it had gone, at the least forget it."""
        if conn in self._conns:
            try:
                self._gone(sel, conn)
            except Exception:
                self._drop(sel, conn)

    def _refuse(self, sel: selectors.BaseSelector, conn: _Conn, code: str, msg: str) -> None:
        log.info("ring %r: refused an attach from pid %d: %s", self.name, conn.pid, msg)
        self._send_refusal(conn, code, msg)
        self._drop(sel, conn)

    @staticmethod
    def _send_refusal(conn: _Conn, code: str, msg: str) -> None:
        try:
            conn.sock.send(json.dumps({"ok": False, "error": code, "message": msg}).encode())
        except OSError:
            pass

    def _drop(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        """Forget a connection (the slot's state is settled by the caller)."""
        for fileobj in (conn.sock, conn.pidfd):
            try:
                sel.unregister(fileobj)
            except (KeyError, ValueError):
                pass
        self._conns.discard(conn)
        conn.close()

    # -- owner side ------------------------------------------------------------------------

    def dead_pid(self, index: int) -> int:
        """The pid of the process that held slot ``index`` when it died."""
        return self._dead_pids.get(index, 0)

    def dead_peer(self, index: int) -> str:
        """Who held slot ``index`` when it died: "pid N", or the remote reader it relayed."""
        return self._dead_peers.get(index) or f"pid {self.dead_pid(index)}"

    def stop(self) -> None:
        """Stop serving and drop every reader connection (they see end-of-file)."""
        if self._stop_w < 0:
            return
        os.write(self._stop_w, b"x")
        self._thread.join()
        self.abandon()

    def abandon(self) -> None:
        """Release every fd (in a forked child: without touching anything shared)."""
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()
        self._close_fds()

    def _close_fds(self) -> None:
        if self._sel is not None:
            self._sel.close()
            self._sel = None
        self._listener.close()
        if self._stop_r >= 0:
            os.close(self._stop_r)
            os.close(self._stop_w)
            self._stop_r = self._stop_w = -1


def _parse_request(data: bytes, readers: int) -> tuple[int, str]:
    """The slot an attach request asks for, and the remote peer it relays ("" if none);
    _Refused if it is malformed or out of range."""
    try:
        request = json.loads(data)
        index = request["reader"]
        peer = request.get("peer", "")
    except Exception:  # not JSON (nested too deep, say), not an object, no "reader"
        raise _Refused("request", f"malformed attach request {data[:100]!r}") from None
    if isinstance(index, bool) or not isinstance(index, int) or not isinstance(peer, str):
        raise _Refused("request", f"malformed attach request {data[:100]!r}")
    if not 0 <= index < readers:
        raise _Refused(
            "range", f"reader={index} is out of range: this ring has readers 0..{readers - 1}"
        )
    return index, peer[:200]


@dataclass
class Attachment:
    """What a reader receives from the writer's broker before it confirms."""

    sock: socket.socket
    segment_fd: int
    writer_wake: Notifier
    reader_wake: Notifier
    serializer: str
    writer_pid: int
    deadline: float | None
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        """Release what was received (a connect that failed)."""
        self.sock.close()
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds = []
        self.segment_fd = -1


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), 0.0)


_FIRST_RETRY = 0.001  # seconds before looking again for a ring that is not there yet
_LAST_RETRY = 0.05  # the longest pause between two looks


def reach(name: str, deadline: float | None, wait: threading.Event | None) -> socket.socket:
    """A socket connected to the broker of ring ``name``.  With ``wait``, a ring that is not
    there yet is looked for again, less and less often, until the deadline (TimeoutError) or
    until ``wait`` is set (the caller gave up: FileNotFoundError)."""
    pause = _FIRST_RETRY
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(PREFIX + name)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            left = _remaining(deadline)
            if wait is None or wait.is_set():
                raise FileNotFoundError(
                    f"no aioshmq ring named {name!r} (its writer closed, or never existed)"
                ) from None
            if left is not None and left <= 0:
                raise TimeoutError(
                    f"no aioshmq ring named {name!r} appeared within the timeout"
                ) from None
            if wait.wait(pause if left is None else min(pause, left)):
                raise FileNotFoundError(f"gave up waiting for aioshmq ring {name!r}") from None
            pause = min(pause * 2, _LAST_RETRY)
        except BaseException:
            sock.close()
            raise


def request(
    name: str,
    index: int,
    deadline: float | None,
    trusted_uids: Iterable[int] = (),
    peer: str = "",
    wait: threading.Event | None = None,
) -> Attachment:
    """Ask for slot ``index`` of the ring named ``name``; raises a clear error if refused.

    Nothing is sent before the serving process is known to run as this user (or as one of
    ``trusted_uids``): a ring served by another user could make this process unpickle
    anything.  ``wait`` (see ``reach``) waits for a ring that does not exist yet.
    """
    sock = reach(name, deadline, wait)
    fds: list[int] = []
    try:
        writer_pid, uid = peer_credentials(sock)
        me = os.getuid()
        if uid != me and uid not in trusted_uids:
            if me != 0:
                raise PermissionError(
                    f"ring {name!r} belongs to uid {uid}: this user (uid {me}) may not attach "
                    "to it (only the same user or root may)"
                )
            raise PermissionError(
                f"ring {name!r} is served by uid {uid} (pid {writer_pid}), not by this user "
                f"(uid {me}): refused, since its messages could run code in this process; "
                f"pass connect(..., trusted_uids=[{uid}]) to accept that user"
            )
        try:
            try:
                ask = {"reader": index, "pid": os.getpid(), **({"peer": peer} if peer else {})}
                sock.send(json.dumps(ask).encode())
            except (ConnectionResetError, BrokenPipeError):
                pass  # the writer closed: the next read says so
            msg, fds, flags, _addr = socket.recv_fds(sock, 4096, 4, socket.MSG_CMSG_CLOEXEC)
            for fd in fds:  # some kernels ignore MSG_CMSG_CLOEXEC: make sure
                os.set_inheritable(fd, False)
        except TimeoutError:
            raise TimeoutError(
                f"the writer of ring {name!r} did not answer within the timeout"
            ) from None
        except (ConnectionResetError, BrokenPipeError):
            msg, flags = b"", 0
        if flags & socket.MSG_CTRUNC:
            raise OSError(
                errno.EMFILE,
                f"too many open files: this process could not receive the fds of ring {name!r}",
            )
        reply: dict[str, Any] = (
            json.loads(msg)
            if msg
            else {"ok": False, "error": "gone", "message": f"the writer of ring {name!r} closed"}
        )
        if not reply.get("ok"):
            text = str(reply.get("message", "attach refused"))
            code = reply.get("error")
            if code == "range":
                raise ValueError(text)
            if code == "busy":
                raise Busy(text)
            if code == "gone":
                raise FileNotFoundError(text)
            if code == "permission":
                raise PermissionError(text)
            raise RuntimeError(text)
        kind: NotifierKind = reply["notifier"]
        if kind not in ("eventfd", "pipe") or len(fds) != fds_for(kind):
            raise RuntimeError(f"the writer of ring {name!r} sent {len(fds)} fds for {kind!r}")
        seg_fd, wfd, rfd = fds[:3]
        own_w = fds[3] if kind == "pipe" else rfd
        att = Attachment(
            sock=sock,
            segment_fd=seg_fd,
            writer_wake=Notifier(kind, -1 if kind == "pipe" else wfd, wfd),
            reader_wake=Notifier(kind, rfd, own_w),
            serializer=str(reply["serializer"]),
            writer_pid=writer_pid,
            deadline=deadline,
            fds=fds,
        )
    except BaseException:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise
    return att


def confirm(att: Attachment, name: str) -> None:
    """Phase two: tell the broker this reader is ready and wait until the slot is its own.

    A connect that fails here (a timeout, an interrupt) asks the broker to put the slot
    back as it was, so a reader that never started leaves nothing behind.
    """
    sock = att.sock
    try:
        sock.settimeout(_remaining(att.deadline))
        sock.send(ATTACH)
        answer = sock.recv(16)
    except BaseException as exc:
        try:
            sock.send(ABORT, socket.MSG_DONTWAIT)
        except OSError:
            pass
        if isinstance(exc, TimeoutError):
            raise TimeoutError(
                f"the writer of ring {name!r} did not answer within the timeout"
            ) from None
        if isinstance(exc, OSError):
            raise FileNotFoundError(f"the writer of ring {name!r} closed") from None
        raise
    if answer != ATTACHED:
        raise FileNotFoundError(f"the writer of ring {name!r} closed")
    sock.setblocking(False)

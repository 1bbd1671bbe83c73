"""Attaching readers: the writer's broker thread and the handshake readers run against it.

A ring is found by name through an abstract Unix socket (no file to leak, gone with the
writer's process).  An attaching reader connects, names its slot, and receives the memfd
and the wake-up fds over SCM_RIGHTS.  It keeps the connection open: its end-of-file tells
the writer the reader has gone (and the reader that the writer has), whoever closed it and
however the process ended.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._notify import Notifier, NotifierKind
from ._ring import DEAD, RingWriter

PREFIX = "\0aioshmq/"
BYE = b"bye"
_CRED = struct.Struct("3i")
NAME_MAX = 100


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    if not name or len(name.encode()) > NAME_MAX or "/" in name or "\0" in name:
        raise ValueError(f"name={name!r}: need 1 to {NAME_MAX} bytes without '/' or NUL")
    return name


def pidfd_of(pid: int) -> int:
    """An fd that becomes readable when process ``pid`` exits; -1 where pidfds are missing.

    The connection's end-of-file already tells that the peer has gone; the pidfd also tells
    it when a stray copy of the peer's socket outlives the peer's process.
    """
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


class _Conn:
    """One reader connection, attached to a slot once its request is granted."""

    __slots__ = ("bye", "index", "pid", "pidfd", "sock")

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.index: int | None = None
        self.pidfd = -1
        self.bye = False

    def close(self) -> None:
        self.sock.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class Broker:
    """Serves attach requests for one ring and notices when a reader goes away."""

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
    ) -> None:
        self.name = name
        self.ring = ring
        self.segment_fd = segment_fd
        self.writer_wake = writer_wake
        self.reader_wake = reader_wake
        self.serializer = serializer
        self.on_change = on_change
        self.detach_dead = detach_dead
        self._dead_pids: dict[int, int] = {}
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind(PREFIX + name)
        except OSError as exc:
            self._listener.close()
            if isinstance(exc, OSError) and exc.errno == 98:  # EADDRINUSE
                raise FileExistsError(f"an aioshmq ring named {name!r} already exists") from None
            raise
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._conns: set[_Conn] = set()
        self._thread = threading.Thread(
            target=self._run, name=f"aioshmq-broker-{name}", daemon=True
        )
        self._thread.start()

    # -- thread --------------------------------------------------------------------------

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._stop_r, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj == self._stop_r:
                        return
                    if key.fileobj is self._listener:
                        self._accept(sel)
                    elif isinstance(key.data, _Conn):
                        conn = key.data
                        if conn not in self._conns:
                            continue  # gone on an earlier event of this same batch
                        if key.fileobj is conn.sock:
                            self._readable(sel, conn)
                        else:  # its pidfd: the reader's process has exited
                            self._gone(sel, conn)
        finally:
            sel.close()
            for conn in list(self._conns):
                conn.close()
            self._conns.clear()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        pid, uid, _gid = _CRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
        )
        if uid not in (os.getuid(), 0):
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, pid)
        self._conns.add(conn)
        sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data == BYE:
            conn.bye = True
            self._gone(sel, conn)  # acknowledged there: the slot is free when close() returns
        elif data and conn.index is None:
            self._attach(sel, conn, data)
        else:  # end of file, or garbage from an attached reader: it is gone
            self._gone(sel, conn)

    def _gone(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        """The reader closed its end, or its process ended: free or mark its slot."""
        # The pidfd can fire before the socket's last words are read: a "bye" sent just
        # before a normal exit still makes this a clean departure.
        while not conn.bye:
            try:
                data = conn.sock.recv(4096)
            except (BlockingIOError, OSError):
                break
            if not data:
                break
            conn.bye = data == BYE
        sel.unregister(conn.sock)
        if conn.pidfd >= 0:
            sel.unregister(conn.pidfd)
        self._conns.discard(conn)
        index = conn.index
        if index is not None:
            if conn.bye or self.detach_dead:
                self.ring.detach(index)
            else:
                self._dead_pids[index] = conn.pid
                self.ring.detach(index, DEAD)
        if conn.bye:
            try:
                conn.sock.send(BYE)
            except OSError:
                pass
        conn.close()
        if index is not None:
            self.on_change()

    def _attach(self, sel: selectors.BaseSelector, conn: _Conn, data: bytes) -> None:
        try:
            request = json.loads(data)
            index = request["reader"]
            if not isinstance(index, int):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            self._refuse(sel, conn, "request", f"malformed attach request {data[:100]!r}")
            return
        readers = self.ring.layout.readers
        if not 0 <= index < readers:
            self._refuse(
                sel,
                conn,
                "range",
                f"reader={index} is out of range: this ring has readers 0..{readers - 1}",
            )
            return
        holder = next((c for c in self._conns if c.index == index), None)
        if holder is not None:
            self._refuse(
                sel,
                conn,
                "busy",
                f"reader slot {index} of ring {self.name!r} is held by a live reader "
                f"(pid {holder.pid})",
            )
            return
        self.reader_wake[index].drain()
        self.ring.attach(index)
        self._dead_pids.pop(index, None)
        conn.index = index
        conn.pidfd = pidfd_of(conn.pid)
        if conn.pidfd >= 0:
            sel.register(conn.pidfd, selectors.EVENT_READ, conn)
        reply = {
            "ok": True,
            "notifier": self.writer_wake.kind,
            "serializer": self.serializer,
        }
        fds = [self.segment_fd, self.writer_wake.write_fd, self.reader_wake[index].read_fd]
        try:
            socket.send_fds(conn.sock, [json.dumps(reply).encode()], fds)
        except OSError:
            pass  # the reader went away already: its end-of-file frees the slot
        self.on_change()

    def _refuse(self, sel: selectors.BaseSelector, conn: _Conn, code: str, msg: str) -> None:
        try:
            conn.sock.send(json.dumps({"ok": False, "error": code, "message": msg}).encode())
        except OSError:
            pass
        sel.unregister(conn.sock)
        self._conns.discard(conn)
        conn.close()

    # -- owner side ------------------------------------------------------------------------

    def dead_pid(self, index: int) -> int:
        """The pid of the process that held slot ``index`` when it died."""
        return self._dead_pids.get(index, 0)

    def stop(self) -> None:
        """Stop serving and drop every reader connection (they see end-of-file)."""
        if self._stop_w < 0:
            return
        os.write(self._stop_w, b"x")
        self._thread.join()
        self._close_fds()

    def abandon(self) -> None:
        """In a forked child: release the inherited fds, touch nothing shared."""
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()
        self._close_fds()

    def _close_fds(self) -> None:
        self._listener.close()
        if self._stop_w >= 0:
            os.close(self._stop_r)
            os.close(self._stop_w)
            self._stop_r = self._stop_w = -1


@dataclass
class Attachment:
    """What a reader receives from the writer's broker."""

    sock: socket.socket
    segment_fd: int
    writer_wake: Notifier
    reader_wake: Notifier
    serializer: str
    writer_pid: int


def request(name: str, index: int, timeout: float | None) -> Attachment:
    """Attach to slot ``index`` of the ring named ``name``; raises a clear error if refused."""
    import anyio

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(PREFIX + name)
        except (FileNotFoundError, ConnectionRefusedError):
            raise FileNotFoundError(
                f"no aioshmq ring named {name!r} (its writer closed, or never existed)"
            ) from None
        try:
            sock.send(json.dumps({"reader": index, "pid": os.getpid()}).encode())
            msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 4, socket.MSG_CMSG_CLOEXEC)
            for fd in fds:  # some kernels ignore MSG_CMSG_CLOEXEC: make sure
                os.set_inheritable(fd, False)
        except TimeoutError:
            raise TimeoutError(
                f"the writer of ring {name!r} did not answer within {timeout} s"
            ) from None
        except (ConnectionResetError, BrokenPipeError):
            msg, fds = b"", []
        reply: dict[str, Any] = (
            json.loads(msg)
            if msg
            else {"ok": False, "error": "gone", "message": f"the writer of ring {name!r} closed"}
        )
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            text = reply.get("message", "attach refused")
            code = reply.get("error")
            if code == "range":
                raise ValueError(text)
            if code == "busy":
                raise anyio.BusyResourceError(text)
            if code == "gone":
                raise FileNotFoundError(text)
            raise RuntimeError(text)
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"writer of ring {name!r} sent {len(fds)} fds instead of 3")
        kind: NotifierKind = reply["notifier"]
        # The writer's pid as this process's pid namespace sees it (not as it reported it).
        writer_pid = _CRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
        )[0]
        seg_fd, wfd, rfd = fds
        sock.setblocking(False)
        return Attachment(
            sock=sock,
            segment_fd=seg_fd,
            writer_wake=Notifier(kind, -1 if kind == "pipe" else wfd, wfd),
            reader_wake=Notifier(kind, rfd, -1 if kind == "pipe" else rfd),
            serializer=reply["serializer"],
            writer_pid=writer_pid,
        )
    except BaseException:
        sock.close()
        raise

"""A mirror: one remote reader slot republished into a local ring, for many local readers."""

from __future__ import annotations

import math
import os
import secrets
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio

from ..base.errors import PeerDied, ReaderEvicted
from ..ends import writer as _writer
from ..ends.handle import Handle
from ..ends.reader import Reader, connect_relayed
from ..ends.writer import MirrorWriter, OnReaderDeath, Writer
from ..memory.notify import NotifierKind
from ..serialize.resolve import SerializerSpec, passed_on, resolve
from ._auth import check_address, check_security
from ._link import Link

DEFAULT_HEARTBEAT = 3.0


def check_heartbeat(heartbeat: object) -> float:
    if isinstance(heartbeat, bool) or not isinstance(heartbeat, int | float):
        raise TypeError(f"heartbeat must be a number of seconds, not {heartbeat!r}")
    if not 0.05 <= heartbeat <= 3600:
        raise ValueError(f"heartbeat must be from 0.05 to 3600 seconds, not {heartbeat!r}")
    return float(heartbeat)


class Mirror:
    """Holds reader slot ``reader`` of a remote writer and republishes its stream into a
    local ring named ``name`` with ``readers`` slots: local readers attach by name as
    usual, and the bytes cross the network once for all of them.

    The local ring has the remote ring's capacity and message bound.  ``run()`` carries
    the stream until it ends (the local readers then get EndOfStream) or is cut off (they
    get every message that fully arrived, then PeerDied, and ``run()`` raises PeerDied).
    """

    def __init__(
        self,
        address: str,
        reader: int = 0,
        *,
        readers: int = 1,
        name: str | None = None,
        secret: bytes | None = None,
        insecure_loopback: bool = False,
        heartbeat: float = DEFAULT_HEARTBEAT,
        timeout: float | None = 10.0,
        serializer: SerializerSpec | None = None,
        notifier: NotifierKind | None = None,
        on_reader_death: OnReaderDeath = "raise",
        linger: float = 0.0,
    ) -> None:
        self._stop_r = self._stop_w = -1
        self._link: Link | None = None
        self._writer: MirrorWriter[Any] | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._running = False
        self._closed = False
        check_address(address, "address")
        if isinstance(reader, bool) or not isinstance(reader, int):
            raise TypeError(f"reader must be an int, not {type(reader).__name__}")
        if reader < 0:
            raise ValueError(f"reader={reader} is out of range: slots are numbered from 0")
        keys = check_security(address, secret, insecure_loopback)
        beat = check_heartbeat(heartbeat)
        ser = resolve(serializer) if serializer is not None else None
        self._link = Link(address, reader, keys, beat, timeout)
        try:
            w = self._link.welcome
            if ser is None:
                if w["serializer"] == "custom":
                    raise ValueError(
                        f"the writer at {address} uses a custom serializer: pass the same "
                        "one as serializer=..."
                    )
                ser = resolve(w["serializer"])
            self._serializer = ser
            writer = _writer.create(
                w["capacity"],
                w["max_messages"],
                readers,
                serializer=passed_on(ser),
                notifier=notifier,
                name=name,
                on_reader_death=on_reader_death,
                linger=linger,
                cls=MirrorWriter,
            )
            assert isinstance(writer, MirrorWriter)
            self._writer = writer
            self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        """The remote writer's address."""
        assert self._link is not None
        return self._link.address

    @property
    def name(self) -> str:
        """The local ring's name: ``aioshmq.connect(name, reader=i)`` on this host."""
        assert self._writer is not None
        return self._writer.name

    @property
    def handle(self) -> Handle:
        return Handle(self.name)

    @property
    def writer(self) -> Writer[Any]:
        """The local ring's writer (owned by the mirror: do not put to it)."""
        assert self._writer is not None
        return self._writer

    @property
    def serializer(self) -> Any:
        """What the local ring's readers load messages with."""
        return self._serializer

    @property
    def _live_link(self) -> Link:
        """The connection to the remote writer (an internal object)."""
        if self._link is None:
            raise RuntimeError("this mirror is closed")
        return self._link

    def run(self) -> None:
        """Carry the stream until it ends, the mirror is stopped or closed, or it is cut off
        (PeerDied, after the local readers had every message that fully arrived)."""
        link, writer = self._link, self._writer
        if link is None or writer is None or self._closed:
            raise RuntimeError("this mirror is closed")
        with self._lock:
            if self._running:
                raise RuntimeError("this mirror is already running")
            self._running = True
        try:
            try:
                stopped = self._carry(link, writer)
            except BaseException as exc:  # a local reader died, say: the chain is broken
                link.reason = f"the mirror stopped: {exc!r}"
                writer.close_cut_off()
                raise
            if stopped or link.over != "cut":
                link.say_bye()
            if not stopped and link.over != "end":
                raise PeerDied(
                    f"the stream from {link.address} was cut off: {link.reason}",
                    role="writer",
                    pid=link.writer_pid,
                )
        finally:
            self._done.set()

    def _carry(self, link: Link, writer: MirrorWriter[Any]) -> bool:
        """Pump until the stream is over (False) or ``stop()`` (True)."""
        poller = select.poll()
        for fd in (link.fd, self._stop_r, writer.wait_fd):
            poller.register(fd, select.POLLIN)
        while True:
            due = link.pump(writer)
            if link.over is not None:
                return False
            sleeping = False
            if link.needs_room():  # the local readers lag: wait for them too
                if not writer.prepare_sleep():
                    continue
                sleeping = True
            wait = max(due - time.monotonic(), 0.0)
            try:
                events = dict(poller.poll(math.ceil(wait * 1000)))
            finally:
                if sleeping:
                    writer.end_sleep()
            if writer.wait_fd in events:
                writer.drain()
            if self._stop_r in events:
                return True

    def stop(self) -> None:
        """Ask ``run()`` to give the slot back and return (from any thread, or a signal
        handler); ``close()`` still closes."""
        with self._lock:
            if self._stop_w >= 0:
                try:
                    os.write(self._stop_w, b"x")
                except BlockingIOError:  # asked already
                    pass

    def close(self) -> None:
        """Stop (from any thread), give the remote slot up and close the local ring; once,
        however many threads call it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running = self._running
            if self._stop_w >= 0:
                try:
                    os.write(self._stop_w, b"x")
                except BlockingIOError:
                    pass
        if running:
            self._done.wait()
        if self._writer is not None:
            self._writer.close(linger=0)
        if self._link is not None:
            self._link.close()
        with self._lock:
            for fd in (self._stop_r, self._stop_w):
                if fd >= 0:
                    os.close(fd)
            self._stop_r = self._stop_w = -1

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def reason(self) -> str:
        return "" if self._link is None else self._link.reason


def mirror(address: str, reader: int = 0, **options: Any) -> None:
    """Run a ``Mirror`` until the stream ends (see ``Mirror`` for the options)."""
    with Mirror(address, reader, **options) as m:
        m.run()


def connect_remote(
    address: str,
    reader: int,
    *,
    secret: bytes | None,
    insecure_loopback: bool,
    heartbeat: float,
    timeout: float | None,
    serializer: SerializerSpec | None,
    spin: float,
) -> Reader[Any]:
    """A reader of a remote writer: the reader of a private one-slot ring, which its own
    calls fill from the connection (so every Reader call behaves exactly as for a local
    ring)."""
    m = open_link(
        address,
        reader,
        secret=secret,
        insecure_loopback=insecure_loopback,
        heartbeat=heartbeat,
        timeout=timeout,
        serializer=serializer,
    )
    return attach(m, timeout, spin)


def open_link(
    address: str,
    reader: int,
    *,
    secret: bytes | None,
    insecure_loopback: bool,
    heartbeat: float,
    timeout: float | None,
    serializer: SerializerSpec | None,
    meta: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Mirror:
    """The blocking half of a remote connect (the handshake): a private one-slot mirror.
    ``meta`` turns the writer's welcome into what this reader tells the writer's owner."""
    m = Mirror(
        address,
        reader,
        name=f"{os.getpid()}-remote-{secrets.token_hex(6)}",
        secret=secret,
        insecure_loopback=insecure_loopback,
        heartbeat=heartbeat,
        timeout=timeout,
        serializer=serializer,
    )
    if meta is not None:
        try:
            m._live_link.send_meta(meta(m._live_link.welcome))
        except BaseException:
            m.close()
            raise
    return m


def attach(m: Mirror, timeout: float | None, spin: float) -> Reader[Any]:
    """The quick half, in the thread that will use the reader: the reader of the private
    mirror's ring, which its own calls fill (``_Direct``)."""
    direct = _Direct(m)
    try:
        local = connect_relayed(m.name, m.serializer, timeout, spin, direct)
    except BaseException:
        m.close()
        raise
    direct.start()
    return local


class _Direct:
    """A remote writer, as the reader of a private mirror's ring sees it: the reader's own
    calls carry what arrived into the ring (``pump``) and sleep on ``fd``, so a message
    crosses no thread of this process.  A keeper thread pumps only while the reader's
    calls do not (the application is busy elsewhere), so that acknowledgements and
    heartbeats go on, and the writer can deliver the rest when it closes."""

    def __init__(self, m: Mirror) -> None:
        self._mirror = m
        self._link = link = m._live_link
        writer = m.writer
        assert isinstance(writer, MirrorWriter)
        self._writer: MirrorWriter[Any] = writer
        self.fd = link.fd
        self.where = f"from {m.address} (pid {link.writer_pid} on {link.writer_host})"
        self.pid = link.writer_pid
        self._stop = threading.Event()
        self._keeper = threading.Thread(
            target=self._keep, name=f"aioshmq-keeper-{m.name}", daemon=True
        )

    def start(self) -> None:
        self._keeper.start()

    def pump(self) -> float:
        return self._link.pump(self._writer)

    def _keep(self) -> None:
        link, writer = self._link, self._writer
        while not self._stop.wait(link.beat):
            if link.over is not None:
                return
            if time.monotonic() - link.pumped >= link.beat:
                try:
                    link.pump(writer)
                except Exception:  # the reader's own next pump meets it, and says it
                    return

    def reason(self) -> str:
        return self._mirror.reason()

    def cut_off(self) -> anyio.BrokenResourceError | None:
        """ReaderEvicted if the remote writer evicted this reader; else the reader's own."""
        link = self._link
        if link.evicted is None:
            return None
        return ReaderEvicted(
            link.address,
            link.index,
            link.evicted,
            message=f"{link.reason}; every message that fully arrived was delivered",
        )

    def close(self) -> None:
        self._stop.set()
        if self._keeper.is_alive() and self._keeper is not threading.current_thread():
            self._keeper.join()
        if self._link.over != "cut":  # a writer that fell silent or gave it up holds nothing
            self._link.say_bye()
        self._mirror.close()

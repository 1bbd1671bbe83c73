"""A mirror: one remote reader slot republished into a local ring, for many local readers."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

import anyio

from ..base.errors import PeerDied, ReaderEvicted
from ..ends import writer as _writer
from ..ends.handle import Handle
from ..ends.reader import Reader, connect_relayed
from ..ends.writer import MirrorWriter, OnReaderDeath, Writer
from ..memory.notify import NotifierKind
from ..serialize.resolve import SerializerSpec, resolve
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
                serializer=ser,
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
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._running = False

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
        """Carry the stream until it ends, the mirror is closed, or it is cut off (PeerDied,
        after the local readers had every message that fully arrived)."""
        link, writer = self._link, self._writer
        if link is None or writer is None:
            raise RuntimeError("this mirror is closed")
        with self._lock:
            if self._running:
                raise RuntimeError("this mirror is already running")
            self._running = True
        try:
            try:
                why = link.run(writer, self._stop_r)
            except BaseException as exc:  # a local reader died, say: the chain is broken
                link.reason = f"the mirror stopped: {exc!r}"
                writer.close_cut_off()
                raise
            if why == "stopped":
                link.say_bye()
            elif why is None:
                writer.close()
            else:
                link.reason = why
                writer.close_cut_off()
                raise PeerDied(
                    f"the stream from {link.address} was cut off: {why}",
                    role="writer",
                    pid=link.writer_pid,
                )
        finally:
            self._done.set()

    def close(self) -> None:
        """Stop (from any thread), give the remote slot up and close the local ring."""
        if self._stop_w >= 0:
            os.write(self._stop_w, b"x")
            if self._running:
                self._done.wait()
        if self._writer is not None:
            self._writer.close(linger=0)
        if self._link is not None:
            self._link.close()
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
    """A reader of a remote writer: a private one-slot mirror in a thread of this process,
    and a local reader of it (so every Reader call behaves exactly as for a local ring)."""
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
    """The quick half, in the thread that will use the reader: its local reader, and the
    mirror's thread started."""
    try:
        local = connect_relayed(m.name, m.serializer, timeout, spin, _Far(m))
    except BaseException:
        m.close()
        raise
    thread = threading.Thread(target=_run_quietly, args=(m,), name=f"aioshmq-link-{m.name}")
    thread.daemon = True
    thread.start()
    return local


class _Far:
    """The remote writer a private mirror relays, as its local reader sees it."""

    def __init__(self, m: Mirror) -> None:
        self._mirror = m
        link = m._live_link
        self.where = f"from {m.address} (pid {link.writer_pid} on {link.writer_host})"
        self.pid = link.writer_pid

    def reason(self) -> str:
        return self._mirror.reason()

    def cut_off(self) -> anyio.BrokenResourceError | None:
        """ReaderEvicted if the remote writer evicted this reader; else the reader's own."""
        link = self._mirror._live_link
        if link.evicted is None:
            return None
        return ReaderEvicted(
            link.address,
            link.index,
            link.evicted,
            message=f"{link.reason}; every message that fully arrived was delivered",
        )

    def close(self) -> None:
        self._mirror.close()


def _run_quietly(m: Mirror) -> None:
    try:
        m.run()
    except Exception:  # the local reader reports it (PeerDied after the last message)
        pass

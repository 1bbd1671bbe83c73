"""What users call: ``create`` and ``connect``, for local rings and remote ones alike."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Iterable
from typing import Any

if sys.version_info >= (3, 13):
    from typing import TypeVar
else:
    from typing_extensions import TypeVar

import anyio

from .. import remote
from ..ends import reader as _reader
from ..ends import writer as _writer
from ..ends.handle import Handle
from ..ends.reader import DEFAULT_SPIN, Reader
from ..ends.writer import OnReaderDeath, RelayServer, Writer
from ..memory.notify import NotifierKind
from ..ring.layout import Layout
from ..serialize.resolve import SerializerSpec

REMOTE = ("tcp://", "ipc://")
DEFAULT_HEARTBEAT = 3.0

# What the ends carry, when the caller names it (message_type=); Any when not.
M = TypeVar("M", default=Any)


def create(
    capacity: int = 16 << 20,
    max_messages: int = 1 << 16,
    readers: int = 1,
    *,
    serializer: SerializerSpec = "pickle",
    notifier: NotifierKind | None = None,
    name: str | None = None,
    on_reader_death: OnReaderDeath = "raise",
    linger: float = 0.0,
    slow_reader_warning: float | None = 10.0,
    slow_reader_timeout: float | None = None,
    listen: str | None = None,
    secret: bytes | None = None,
    insecure_loopback: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    message_type: type[M] | None = None,
) -> Writer[M]:
    """Create a ring and return its writer, which owns it.

    ``message_type`` only types the writer for a type checker (``Writer[Job]``: a ``put`` of
    anything else is a type error); nothing is checked at run time.
    ``capacity`` (bytes, rounded up to a multiple of 64) and ``max_messages`` both bound what
    the ring holds for its slowest reader.  ``readers`` is the number of reader slots.
    ``linger`` is how long (seconds) closing the writer waits for readers to attach to
    slots that never had one while messages wait for them (see ``Writer.close``).
    ``slow_reader_warning``: a put that has waited this long (seconds) for room logs a
    warning (logger ``"aioshmq"``) naming the slowest reader, its pid and how far behind it
    is, and again each time as long again passes; None: never.
    ``slow_reader_timeout``: a reader that is alive but has not advanced for this long
    (seconds) while a put waited for it is evicted: the writer stops keeping messages for
    it, and its next read raises ``ReaderEvicted``.  None (the default): wait for it.

    With ``listen`` (``"tcp://HOST:PORT"``, port 0 for any, or ``"ipc://PATH"``) any slot
    may also be attached from another host: ``writer.address`` is the endpoint bound.
    Remote readers must hold ``secret`` (CurveZMQ: authenticated and encrypted);
    ``insecure_loopback=True`` instead allows plain traffic on loopback or ipc only.  A
    remote reader not heard from for ``heartbeat`` seconds is a dead reader.
    """
    relay = _remote_server_args(listen, secret, insecure_loopback, heartbeat)
    return _writer.create(
        capacity,
        max_messages,
        readers,
        serializer=serializer,
        notifier=notifier,
        name=name,
        on_reader_death=on_reader_death,
        linger=linger,
        slow_reader_warning=slow_reader_warning,
        slow_reader_timeout=slow_reader_timeout,
        relay=None if relay is None else functools.partial(_serve, relay),
    )


def _serve(
    relay: tuple[str, Any, float], name: str, layout: Layout, serializer: str
) -> RelayServer:
    """The server of a writer's remote readers (the ring's name, layout and serializer)."""
    server: RelayServer = remote.load("_server").Server(name, layout, serializer, *relay)
    return server


def _remote_server_args(
    listen: str | None, secret: bytes | None, insecure_loopback: bool, heartbeat: float
) -> tuple[str, Any, float] | None:
    if listen is None:
        if secret is not None or insecure_loopback:
            raise ValueError("secret= and insecure_loopback= go with listen=")
        return None
    auth = remote.load("_auth")
    auth.check_address(listen, "listen")
    keys = auth.check_security(listen, secret, insecure_loopback)
    return listen, keys, remote.load("_mirror").check_heartbeat(heartbeat)


def connect(
    handle: Handle | str,
    reader: int = 0,
    *,
    serializer: SerializerSpec | None = None,
    timeout: float | None = 10.0,
    spin: float = DEFAULT_SPIN,
    trusted_uids: Iterable[int] = (),
    secret: bytes | None = None,
    insecure_loopback: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    wait: bool = False,
    message_type: type[M] | None = None,
) -> Reader[M]:
    """Attach to reader slot ``reader`` of a ring, by its handle or its name, or of a
    remote writer by its address (``"tcp://HOST:PORT"`` or ``"ipc://PATH"``).

    ``serializer`` defaults to the writer's (it must be given when the writer uses a custom
    one).  ``timeout`` bounds the wait for the writer to answer.  ``spin`` is how long (in
    seconds) an async get may keep yielding to the event loop and looking at the ring before
    it goes to sleep: a message that arrives meanwhile needs no wake-up.  0 sleeps at once.
    The reader spins only while spinning catches messages: a spin that runs out halves
    its budget and one that catches a message lets it grow back, so where the writer needs
    the CPU the reader spins on, it soon sleeps at once (and now and then tries again).
    A ring served by a process of another user is refused (its messages could run code in
    this process) unless that user's uid is in ``trusted_uids``.  A connect that fails
    leaves the slot exactly as it was.  ``wait=True`` waits, up to ``timeout``, for a ring
    that does not exist yet (a writer still starting) instead of raising FileNotFoundError
    at once; a remote connect always waits so (ZeroMQ connects in the background).
    ``message_type`` only types the reader for a type checker (``Reader[Job]``: ``get()``
    returns a ``Job``); nothing is checked at run time.

    A remote writer is reached with the ``secret`` it was created with (or
    ``insecure_loopback=True`` if it was); one not heard from for ``heartbeat`` seconds is
    a dead writer (PeerDied after every message that fully arrived).
    """
    return _connect(
        handle,
        reader,
        serializer,
        timeout,
        spin,
        trusted_uids,
        secret,
        insecure_loopback,
        heartbeat,
        wait,
    )


def _connect(
    handle: Handle | str,
    reader: int,
    serializer: SerializerSpec | None,
    timeout: float | None,
    spin: float,
    trusted_uids: Iterable[int],
    secret: bytes | None,
    insecure_loopback: bool,
    heartbeat: float,
    wait: bool | threading.Event,
) -> Reader[Any]:
    """``connect`` and ``aconnect``'s work; ``wait`` may be the event that gives up waiting."""
    if isinstance(handle, str) and handle.startswith(REMOTE):
        if not isinstance(spin, int | float) or isinstance(spin, bool) or not 0 <= spin <= 1:
            raise ValueError(f"spin must be a number of seconds from 0 to 1, not {spin!r}")
        if trusted_uids:
            raise ValueError("trusted_uids= is for local rings; a remote writer needs secret=")
        return remote.load("_mirror").connect_remote(  # type: ignore[no-any-return]
            handle,
            reader,
            secret=secret,
            insecure_loopback=insecure_loopback,
            heartbeat=heartbeat,
            timeout=timeout,
            serializer=serializer,
            spin=float(spin),
        )
    if secret is not None or insecure_loopback:
        raise ValueError("secret= and insecure_loopback= are for remote addresses (tcp://, ipc://)")
    return _reader.connect(
        handle,
        reader,
        serializer=serializer,
        timeout=timeout,
        spin=spin,
        trusted_uids=trusted_uids,
        wait=wait,
    )


async def aconnect(
    handle: Handle | str,
    reader: int = 0,
    *,
    serializer: SerializerSpec | None = None,
    timeout: float | None = 10.0,
    spin: float = DEFAULT_SPIN,
    trusted_uids: Iterable[int] = (),
    secret: bytes | None = None,
    insecure_loopback: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    wait: bool = False,
    message_type: type[M] | None = None,
) -> Reader[M]:
    """``connect`` for async code: the same arguments and result, without blocking the event
    loop (the handshake runs in a worker thread).  Cancelled, it gives up at once: a ring
    it was waiting for is no longer looked for, and a reader that attached meanwhile is
    closed, its slot freed.
    """
    give_up = threading.Event()
    done: list[Reader[Any]] = []
    lock = threading.Lock()

    if not isinstance(wait, bool):
        raise TypeError(f"wait must be True or False, not {wait!r}")

    def attach() -> Reader[M]:
        got = _connect(
            handle,
            reader,
            serializer,
            timeout,
            spin,
            trusted_uids,
            secret,
            insecure_loopback,
            heartbeat,
            give_up if wait else False,
        )
        with lock:
            if give_up.is_set():  # nobody will take it
                got.close()
            else:
                done.append(got)
        return got

    try:
        return await anyio.to_thread.run_sync(attach, abandon_on_cancel=True)
    except BaseException:
        with lock:
            give_up.set()
            for late in done:
                late.close()
        raise

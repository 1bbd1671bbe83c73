"""The reading end: ``connect()`` and ``Reader``, an anyio object receive stream over a ring."""

from __future__ import annotations

import collections
import os
import select
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import anyio
from anyio.abc import ObjectReceiveStream
from anyio.lowlevel import checkpoint

from ..base.errors import Busy, CorruptedError, Empty, PeerDied
from ..base.log import log
from ..memory.segment import Segment
from ..ring import format as L
from ..ring.layout import Layout, decode
from ..ring.ring import RingReader
from ..serialize.resolve import SerializerSpec, resolve
from .broker import BYE, Attachment, check_name, confirm, pidfd_of, request
from .cancel import pending_checkpoint
from .end import End, deadline_of, in_event_loop
from .handle import Handle
from .spin import Spin

T = TypeVar("T")

_EMPTY: Any = object()  # no message now
_LATER: Any = object()  # get's first look did not look: _receive does
_monotonic = time.monotonic
BYE_TIMEOUT = 1.0
DEFAULT_SPIN = 0.0002  # per wait: an idle reader spends at most this once per message


def _readable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` is readable within ``timeout`` s (poll: any fd number, unlike select)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(timeout * 1000)))


class ReaderStatistics(NamedTuple):
    reader: int  #: this reader's slot
    messages_available: int  #: published and not yet received by this reader
    bytes_available: int
    messages_received: int
    bytes_received: int  #: payload bytes received
    tasks_waiting_receive: int
    wakeups_sent: int  #: wake-up syscalls made to the sleeping writer


def connect(
    handle: Handle | str,
    reader: int = 0,
    *,
    serializer: SerializerSpec | None = None,
    timeout: float | None = 10.0,
    spin: float = DEFAULT_SPIN,
    trusted_uids: Iterable[int] = (),
    wait: bool | threading.Event = False,
) -> Reader[Any]:
    """Attach to reader slot ``reader`` of a ring, by its handle or its name.

    ``serializer`` defaults to the writer's (it must be given when the writer uses a custom
    one).  ``timeout`` bounds the wait for the writer to answer.  ``spin`` is how long (in
    seconds) an async get may keep yielding to the event loop and looking at the ring before
    it goes to sleep: a message that arrives meanwhile needs no wake-up.  0 sleeps at once.
    The reader spins only while spinning catches messages (see ``_spin.Spin``).
    A ring served by a process of another user is refused (its messages could run code in
    this process) unless that user's uid is in ``trusted_uids``.  A connect that fails
    leaves the slot exactly as it was.
    """
    if not isinstance(spin, int | float) or isinstance(spin, bool) or not 0 <= spin <= 1:
        raise ValueError(f"spin must be a number of seconds from 0 to 1, not {spin!r}")
    name = check_name(handle.name if isinstance(handle, Handle) else handle)
    if isinstance(reader, bool) or not isinstance(reader, int):
        raise TypeError(f"reader must be an int, not {type(reader).__name__}")
    if reader < 0:
        raise ValueError(f"reader={reader} is out of range: slots are numbered from 0")
    trusted = frozenset(trusted_uids)
    if any(isinstance(uid, bool) or not isinstance(uid, int) for uid in trusted):
        raise TypeError(f"trusted_uids must hold ints, not {sorted(map(repr, trusted))}")
    if not isinstance(wait, bool | threading.Event):
        raise TypeError(f"wait must be True or False, not {wait!r}")
    stop = wait if isinstance(wait, threading.Event) else threading.Event() if wait else None
    return _connect(name, reader, serializer, timeout, float(spin), trusted, wait=stop)


def _connect(
    name: str,
    reader: int,
    serializer: SerializerSpec | None,
    timeout: float | None,
    spin: float,
    trusted: frozenset[int] = frozenset(),
    wait: threading.Event | None = None,
    source: Source | None = None,
) -> Reader[Any]:
    """``connect`` after its checks; ``wait`` waits for a ring not there yet (until the
    timeout, or until it is set); ``source`` says where a relayed stream comes from."""
    ser = resolve(serializer) if serializer is not None else None
    att = request(name, reader, deadline_of(timeout), trusted, "", wait)
    try:
        if ser is None:
            if att.serializer == "custom":
                raise ValueError(
                    f"the writer of ring {name!r} uses a custom serializer: "
                    "pass the same one as connect(..., serializer=...)"
                )
            ser = resolve(att.serializer)
    except BaseException:
        att.close()
        raise
    return Reader(name, reader, att, ser, spin, source)


class Source(Protocol):
    """Where a relayed stream comes from: a remote writer, whose records the reader's own
    calls carry into the private ring that a ``connect_relayed`` reader reads."""

    where: str  #: the far writer, for errors: "from ADDRESS (pid P on HOST)"
    pid: int  #: the far writer's pid
    fd: int  #: readable when more may have come (the reader sleeps on it too)

    def pump(self) -> float:
        """Carry what came into the ring, without blocking; when (``time.monotonic``) to
        call it again at the latest if ``fd`` says nothing before."""

    def reason(self) -> str:
        """Why the stream was cut off, once it was."""

    def cut_off(self) -> anyio.BrokenResourceError | None:
        """What the reader raises once it read everything that arrived from a stream cut
        off at its source (None: PeerDied naming the far writer)."""

    def close(self) -> None:
        """Stop carrying the stream (the reader was closed)."""


def connect_relayed(
    name: str, serializer: SerializerSpec, timeout: float | None, spin: float, source: Source
) -> Reader[Any]:
    """Slot 0 of a ring that a mirror in this process fills from ``source``: every Reader
    call is the local one, errors name the far writer, and closing it stops the mirror."""
    return _connect(name, 0, serializer, timeout, spin, source=source)


class RelayReader:
    """A reader slot held for a remote reader (``aioshmq.remote``'s server): the records
    are sent on raw (``ring``), and the slot is let go only as far as the remote reader
    acknowledged (``RingReader.release_to``)."""

    def __init__(self, name: str, index: int, timeout: float | None, peer: str) -> None:
        att = request(name, index, deadline_of(timeout), frozenset(), peer, None)
        self._reader: Reader[Any] = Reader(name, index, att, resolve("raw"), 0.0)
        self.ring = self._reader._ring  #: the records, read raw

    @property
    def wait_fd(self) -> int:
        """Readable when the writer published (or the slot was evicted, or closed)."""
        return self._reader._wake.read_fd

    def drain(self) -> None:
        self._reader._wake.drain()

    def close(self, *, dead: bool = False) -> None:
        """Give the slot back; ``dead``: without a goodbye (the writer treats the slot's
        reader as dead: the remote reader stopped answering)."""
        if dead:
            self._reader._bye = False
        self._reader.close()


class Lease(Generic[T]):
    """A message read in place: valid inside ``async with``, released at its end."""

    __slots__ = ("_reader", "mark", "spare")

    def __init__(self, reader: Reader[T]) -> None:
        self._reader = reader
        self.mark: tuple[int, int] | None = None  # the pinned record of a message in the ring
        self.spare: bytearray | None = None  # the reassembly buffer of a fragmented message

    async def __aenter__(self) -> T:
        if self.mark is not None:
            raise RuntimeError("this lease is already held")
        return await self._reader._get_leased(self)

    async def __aexit__(self, *exc_info: object) -> None:
        self._reader._end_lease(self)


class Reader(End, ObjectReceiveStream[T], Generic[T]):
    """One reader of a ring, made by ``aioshmq.connect``: receives every message the writer
    puts, in order."""

    __slots__ = ("_deferred", "_loads_plain", "_pending")  # read by every get

    _role = "reader"

    def __init__(
        self,
        name: str,
        index: int,
        att: Attachment,
        serializer: Any,
        spin: float = 0.0,
        source: Source | None = None,
    ) -> None:
        """Takes ``att`` over: whether it succeeds or raises, every fd has its owner."""
        super().__init__()
        self._closed = True  # until everything below exists
        self._name = name
        self._index = index
        self._ser = serializer
        self._death_logged = False
        self._loads_plain = serializer.loads_plain
        self._sock: socket.socket = att.sock
        self._writer_wake = att.writer_wake
        self._wake = att.reader_wake
        self._writer_pid: int = att.writer_pid
        self._messages = 0
        self._bytes = 0
        self._deferred: BaseException | None = None
        self._spinner = Spin(spin)
        self._pending: collections.deque[Any] = collections.deque()  # the rest of a batch
        self._pidfd = -1
        self._epoll: select.epoll | None = None
        self._bye = True  # say goodbye on close; a relay whose remote reader died does not
        self._source = source  # a remote writer, if a mirror in this process relays it
        seg_fd, att.segment_fd = att.segment_fd, -1
        att.fds.remove(seg_fd)
        try:
            self._seg = Segment.attach(seg_fd)
        except BaseException:
            att.close()
            raise
        try:
            self._layout, _ = Layout.read_header(self._seg.buf)
            self._seg.protect_data(self._layout.data_offset)
            # One fd to wait on: readable on a wake-up, when the writer's connection ends,
            # or when the writer's process exits (pidfd, where the kernel has them).
            self._epoll = select.epoll(3)
            self._epoll.register(self._wake.read_fd, select.EPOLLIN)
            self._epoll.register(self._sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
            self._pidfd = pidfd_of(self._writer_pid)
            if self._pidfd >= 0:
                self._epoll.register(self._pidfd, select.EPOLLIN)
            if source is not None:
                self._epoll.register(source.fd, select.EPOLLIN)
            self._wait_fd = self._epoll.fileno()
            confirm(att, name)  # from here on the slot is this reader's
            self._ring = RingReader(self._seg, self._layout, index, self._writer_wake, name)
            self._core = self._ring.core
        except BaseException:
            if self._epoll is not None:
                self._epoll.close()
            if self._pidfd >= 0:
                os.close(self._pidfd)
            self._seg.close()
            att.close()
            raise
        att.fds = []  # this reader owns them now
        self._closed = False

    def _cut_off(self) -> anyio.BrokenResourceError:
        """The error once every message that arrived was read from a stream cut off at its
        source (a relay, such as a remote reader's mirror, lost it)."""
        source = self._source
        if source is None:
            what, pid = f"of ring {self._name!r}", self._writer_pid
            note = f"the process that writes it, pid {pid}, lost its own source"
        else:
            if (error := source.cut_off()) is not None:
                return error
            what, pid, note = source.where, source.pid, source.reason()
        return PeerDied(
            f"the stream {what} was cut off at its source ({note}):"
            " every message that fully arrived was delivered",
            role="writer",
            pid=pid,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<aioshmq.Reader {self._name!r} reader={self._index} {state}>"

    def _stays_here(self) -> str:
        if self._source is not None:
            return (
                f"cannot pickle an aioshmq Reader: it reads the stream {self._source.where} "
                "through this process.  Call aioshmq.connect(ADDRESS, reader=N, secret=...) "
                "in the other process, with that address"
            )
        return (
            f"cannot pickle an aioshmq Reader: it holds slot {self._index} of ring "
            f"{self._name!r} in this process.  Pass the ring's handle (writer.handle, or its "
            "name, reader.name) to the other process and call aioshmq.connect(handle, "
            "reader=N) there, with a slot no other reader holds"
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def index(self) -> int:
        return self._index

    # -- taking messages --------------------------------------------------------------------

    def _poll(self, publish: bool = True, lease: Lease[Any] | None = None) -> Any:
        """The next message, or _EMPTY; EndOfStream once the writer closed and all was read.

        With ``lease``, a message still in the ring is rebuilt on the ring's memory (its
        record pinned until the lease ends) instead of being copied out.
        """
        if self._pending:
            self._messages += 1
            return self._pending.popleft()
        if self._deferred is not None:
            exc, self._deferred = self._deferred, None
            raise exc
        ring, core = self._ring, self._core
        msg = ring.next()
        if msg is None:
            if core.tail != core.shown_tail:
                core.publish()  # fragments were read: let the writer reuse their room
            if ring.closed():
                if ring.broken():
                    raise self._cut_off()
                raise anyio.EndOfStream
            return _EMPTY
        payload, kind, size, count = msg
        try:
            if lease is not None and not kind & L.BATCH:
                # Read-only views: what one reader leases, the others may still be reading.
                main, buffers = decode(payload.toreadonly(), kind)
                obj = self._ser.loads_view(main, buffers)
                if size:
                    lease.mark = ring.pin()
                else:  # reassembled: its buffer may serve the next one once the lease ends
                    lease.spare = payload.obj  # type: ignore[assignment]
            else:
                main, buffers = decode(payload, kind)
                if buffers and size:  # out-of-band buffers still in the ring: copy them out
                    buffers = [bytearray(b) for b in buffers]  # type: ignore[misc]
                obj = self._ser.loads(main, buffers)
        finally:
            if self._closed:  # by the message's own code, or another thread: hands off
                raise self._closed_error()
            ring.consume(size, count)
            if publish:
                core.publish()
        self._messages += 1
        self._bytes += len(payload)
        if kind & L.BATCH:  # a pickled list of messages: hand them out one by one
            if type(obj) is not list or len(obj) != count:
                raise CorruptedError(f"a batch of {count} messages did not load as such a list")
            self._pending.extend(obj)
            obj = self._pending.popleft()
        return obj

    def _writer_gone(self) -> None:
        """Raise PeerDied if the writer's process ended without closing the ring."""
        try:
            alive = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            alive = True
        except OSError:
            alive = False
        if alive and self._pidfd >= 0:
            alive = not _readable(self._pidfd, 0)
        if not alive and not self._core.available() and not self._ring.closed():
            if not self._death_logged:
                self._death_logged = True
                log.warning(
                    "ring %r: its writer (pid %d) died without closing it; reader %d read "
                    "every message it published",
                    self._name,
                    self._writer_pid,
                    self._index,
                )
            raise PeerDied(
                f"the writer (pid {self._writer_pid}) of ring {self._name!r} died without "
                "closing it",
                role="writer",
                pid=self._writer_pid,
            )

    def _spin_budget(self) -> float:
        """How long this wait may spin: none where a spin could only be in the writer's way."""
        spinner = self._spinner
        spin = spinner.budget()
        if spin and spinner.fresh() and self._on_the_writers_cpu():
            spinner.skip()
            return 0.0
        return spin

    def _on_the_writers_cpu(self) -> bool:
        """Whether this process and the writer's may each run on one CPU only, the same."""
        try:
            mine = os.sched_getaffinity(0)
            return len(mine) == 1 and os.sched_getaffinity(self._writer_pid) == mine
        except OSError:  # the writer is gone, or of another user: the spin decides alone
            return False

    async def _wait(self) -> None:
        """Wait for a message or the writer's end (spinning, or asleep on the wait fd)."""
        if self._source is not None:
            await self._wait_source(self._source)
            return
        core = self._core
        spin = self._spin_budget()
        if spin:
            # Yield to the loop (never block it) for a moment: when messages come fast,
            # the next one arrives meanwhile and neither side makes a wake-up syscall.
            deadline = time.monotonic() + spin
            while True:
                await checkpoint()
                self._check()
                if core.available() or self._ring.ended():
                    self._spinner.hit()
                    return
                if time.monotonic() >= deadline:
                    self._spinner.miss()
                    break
        # A task whose wait fd is registered with its own loop takes no hold: a close from
        # another thread leaves the release to that loop (``_loop_pending``), which runs it
        # only once this task has yielded, and a task woken by a close never touches the
        # ring again.
        token = None if self._armable() else self._hold(True)
        try:
            # Drained before announcing the sleep, not after waking: a signal meant for an
            # earlier sleep cannot then wake this one for nothing.
            self._drain()
            if self._closed:  # its close wake-up was just drained: never sleep now
                self._check()
            if not core.prepare_sleep():
                return
            start = time.monotonic()
            try:
                await self._sleep()
            finally:
                if not self._closed:  # closed meanwhile: never touch the ring again
                    core.end_sleep()
            self._check()
            if not core.available():
                self._writer_gone()
            else:
                self._spinner.slept(time.monotonic() - start)
        finally:
            if token is not None:
                self._unhold(token)

    async def _wait_source(self, source: Source) -> None:
        """``_wait`` for a relayed stream: carry what came into the ring, and sleep on the
        wait fd (the source's among them) until more comes or the source is due again."""
        core, ring = self._core, self._ring
        token = None if self._armable() else self._hold(True)
        try:
            while True:
                if self._closed:
                    self._check()
                due = source.pump()
                if core.available() or ring.ended():
                    return
                if due <= time.monotonic():  # more to take at once
                    await checkpoint()
                    continue
                self._drain()  # only now: nothing was wasted on a wait that is not needed
                if self._closed:
                    self._check()
                if not core.prepare_sleep():
                    return
                try:  # the source's pump fills the ring in this thread or, rarely, its own
                    with anyio.move_on_after(due - time.monotonic()):
                        await self._sleep()
                finally:
                    if not self._closed:
                        core.end_sleep()
                self._check()
        finally:
            if token is not None:
                self._unhold(token)

    def _wait_source_sync(self, source: Source, deadline: float | None) -> None:
        core, ring = self._core, self._ring
        token = self._hold(False)
        try:
            if self._closed:
                self._check()
            due = source.pump()
            if core.available() or ring.ended() or due <= time.monotonic():
                return
            self._wake.drain()
            if self._closed:
                self._check()
            if not core.prepare_sleep():
                return
            try:
                if deadline is not None and deadline <= due:
                    self._sleep_sync(deadline)
                else:
                    try:
                        self._sleep_sync(due)
                    except TimeoutError:  # the source is due, not the caller's deadline
                        pass
            finally:
                core.end_sleep()
            self._check()
        finally:
            self._unhold(token)

    def _wait_sync(self, deadline: float | None) -> None:
        if self._source is not None:
            self._wait_source_sync(self._source, deadline)
            return
        core = self._core
        token = self._hold(False)  # first: a close from another thread keeps the mapping
        try:
            spin = self._spin_budget()
            if spin:
                # No loop to yield to: watch the ring for a moment before sleeping (without
                # the GIL, with the compiled core: other threads run meanwhile).
                if core.spin(spin):
                    self._spinner.hit()
                    return
                self._spinner.miss()
            self._wake.drain()
            if self._closed:  # its close wake-up was just drained: never sleep now
                self._check()
            if core.prepare_sleep():
                start = time.monotonic()
                try:
                    self._sleep_sync(deadline)
                finally:
                    core.end_sleep()
                self._check()
                if not core.available():
                    self._writer_gone()
                else:
                    self._spinner.slept(time.monotonic() - start)
        finally:
            self._unhold(token)

    def lease(self) -> Lease[T]:
        """The next message without copying it out of the ring, for as long as it is held.

        ``async with reader.lease() as msg:`` waits like ``get()``; inside the block, large
        out-of-band buffers (numpy arrays, ``PickleBuffer``) and ``raw`` messages are views
        of the ring itself, and the writer does not reuse that message's space until the
        block ends (other messages keep flowing).  After the block the views must not be
        used: the writer may overwrite them.  Small objects are rebuilt as usual.
        """
        return Lease(self)

    async def _get_leased(self, lease: Lease[T]) -> T:
        self._check()
        if (cancelled := pending_checkpoint()) is not None:
            await cancelled()
        async with self._lock:
            while (obj := self._poll(lease=lease)) is _EMPTY:
                await self._wait()
            return obj  # type: ignore[no-any-return]

    def _end_lease(self, lease: Lease[T]) -> None:
        if lease.mark is not None and not self._closed:
            self._ring.unpin(lease.mark)
        if lease.spare is not None:
            self._ring.keep_spare(lease.spare)
        lease.mark = lease.spare = None

    async def get(self) -> T:
        """The next message; waits for one.  EndOfStream after the writer closed.

        A cancelled scope makes it raise before it takes anything, message or not.
        """
        if (obj := self._take()) is _EMPTY or obj is _LATER:
            obj = await self._receive(obj is _EMPTY)
        return obj  # type: ignore[no-any-return]

    receive = get  # the anyio stream interface: the same function, so no extra frame

    async def __anext__(self) -> T:
        """``async for msg in reader``: every message until the writer closes."""
        if (obj := self._take()) is _EMPTY or obj is _LATER:
            try:
                obj = await self._receive(obj is _EMPTY)
            except anyio.EndOfStream:
                raise StopAsyncIteration from None
        return obj  # type: ignore[no-any-return]

    def _take(self) -> Any:
        """The next message if it is a plain one in the ring and nothing is to be awaited
        first (a pace, a pending cancellation) or handed out before it: the common case of
        ``get``, in one call.  Otherwise ``_receive`` does the rest: after _EMPTY (it
        looked, and the ring holds no plain message at its head) or _LATER (it did not)."""
        if (
            self._closed
            or self._lock.held
            or self._pending
            or self._deferred is not None
            or _monotonic() >= self._next_yield
            or pending_checkpoint() is not None
        ):
            return _LATER
        return self._get_plain()

    async def _receive(self, looked: bool) -> Any:
        """``get`` after ``_take``, which ``looked`` at the ring already, or did not."""
        if not looked:
            self._check()
            if (due := self._due()) is not None:
                await due()
                self._check()
        lock = self._lock
        if lock.held:
            await lock.acquire()
            looked = False
        else:
            lock.acquire_nowait()
        try:
            core = self._core
            empty = looked and core.tail == core.head  # nothing at all: wait at once
            while True:
                if not empty and (obj := self._poll()) is not _EMPTY:
                    return obj
                empty = False
                await self._wait()
                # A message after a sleep is most often a plain one: the one-call path.
                if not self._pending and self._deferred is None:
                    obj = self._get_plain()
                    if obj is not _EMPTY:
                        return obj
        finally:
            lock.release()

    def _get_plain(self) -> Any:
        """The core's ``get_plain``: a closed reader's released memory is ClosedResourceError."""
        try:
            return self._core.get_plain(self._loads_plain, _EMPTY)
        except ValueError:
            if self._closed:  # closed meanwhile (another thread, or the message's own code)
                raise self._closed_error() from None
            raise

    def get_nowait(self) -> T:
        """The next message if one is complete now, else raise Empty."""
        self._check()
        if self._lock.held:
            raise Empty("tasks are already waiting to receive from this reader")
        obj = self._poll()
        if obj is _EMPTY and self._source is not None:
            self._source.pump()  # what came over the network counts as waiting now
            obj = self._poll()
        if obj is _EMPTY:
            self._writer_gone()
            raise Empty(f"no message waiting for reader {self._index} of ring {self._name!r}")
        return obj  # type: ignore[no-any-return]

    async def get_many(self, max_messages: int | None = None) -> list[T]:
        """Every message waiting now (at least one, at most ``max_messages``)."""
        if max_messages is not None and (
            isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1
        ):
            raise ValueError(f"max_messages must be a positive int or None, not {max_messages!r}")
        self._check()
        if not self._lock.held and not self._pending and self._deferred is None:
            if (due := self._due()) is not None:
                await due()
                self._check()
            out = self._take_records(max_messages)
            if out:
                if self._deferred is None and (max_messages is None or len(out) < max_messages):
                    self._drain_into(out, max_messages)  # records of other kinds, if any
                return out
        out = [await self.get()]
        self._drain_into(out, max_messages)
        return out

    def _take_records(self, limit: int | None) -> list[T]:
        """Whole records of plain messages waiting now, up to ``limit`` messages (the rest
        of a batch is kept for the next call); an error after some were taken is kept for
        the next call too."""
        core, loads = self._core, self._loads_plain
        out: list[T] = []
        try:
            while limit is None or len(out) < limit:
                got = core.get_record(loads, _EMPTY)
                if got is _EMPTY:
                    break
                obj, n = got
                if n == 1:
                    out.append(obj)
                    continue
                if type(obj) is not list or len(obj) != n:
                    raise CorruptedError(f"a batch of {n} messages did not load as such a list")
                room = n if limit is None else limit - len(out)
                if room >= n:
                    out += obj
                else:
                    out += obj[:room]
                    self._pending.extend(obj[room:])
                    self._messages -= n - room  # counted by the core, handed out later
        except ValueError:
            if self._closed:
                raise self._closed_error() from None
            if not out:
                raise
            self._deferred = self._closed_error()
        except BaseException as exc:
            if not out:
                raise
            self._deferred = exc
        return out

    def _drain_into(self, out: list[T], limit: int | None) -> None:
        pending = self._pending
        try:
            while limit is None or len(out) < limit:
                if pending:  # the rest of a batch, in one step
                    n = len(pending) if limit is None else min(len(pending), limit - len(out))
                    if n == len(pending):
                        out.extend(pending)
                        pending.clear()
                    else:
                        out.extend(pending.popleft() for _ in range(n))
                    self._messages += n
                    continue
                obj = self._poll(publish=False)
                if obj is _EMPTY:
                    break
                out.append(obj)
        except BaseException as exc:  # keep what was read: report the error next time
            self._deferred = exc
        finally:
            if not self._closed:
                self._core.publish()

    def get_sync(self, timeout: float | None = None) -> T:
        """Blocking get for code without an event loop; TimeoutError after ``timeout`` s.

        Refused in a thread that runs an event loop (use ``await get()`` there).  Another
        thread may close the reader meanwhile: this then raises ClosedResourceError.
        """
        if self._closed:
            self._check()
        if in_event_loop():
            self._refuse_in_loop("get_sync", "reader.get()")
        if self._lock.held:
            raise Busy("an async get is under way on this reader")
        if not self._pending and self._deferred is None:
            obj = self._get_plain()
            if obj is not _EMPTY:
                return obj  # type: ignore[no-any-return]
        deadline = deadline_of(timeout)
        try:
            while (obj := self._poll()) is _EMPTY:
                self._wait_sync(deadline)
        except ValueError:
            if self._closed:  # closed by another thread while this one read the ring
                raise self._closed_error() from None
            raise
        return obj  # type: ignore[no-any-return]

    def statistics(self) -> ReaderStatistics:
        self._check()
        core = self._core
        head, head_count = self._ring.published()
        return ReaderStatistics(
            reader=self._index,
            messages_available=max(head_count - core.count, 0) + len(self._pending),
            bytes_available=max(head - core.tail, 0),
            messages_received=self._messages + core.taken,
            bytes_received=self._bytes + core.taken_bytes,
            tasks_waiting_receive=self._waiting,
            wakeups_sent=core.wakeups,
        )

    # -- closing ---------------------------------------------------------------------------

    def _say_bye(self) -> None:
        """Give the slot up and wait (briefly) for the writer to have taken it back.

        Once ``close()`` returns, the writer no longer waits for this reader.  A writer that
        is gone answers with end-of-file at once; one that is frozen gets BYE_TIMEOUT.
        """
        try:
            self._sock.send(BYE)
            if _readable(self._sock.fileno(), BYE_TIMEOUT):
                self._sock.recv(16)
        except OSError:
            pass

    def _release(self, *, clean: bool) -> None:
        if clean and self._bye:
            self._say_bye()
        self._seg.close()  # first: the ring core then no longer signals the fds below
        self._sock.close()
        if self._epoll is not None:
            self._epoll.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
        for fd in {*self._wake.fds(), *self._writer_wake.fds()}:
            os.close(fd)
        self._writer_wake.read_fd = self._writer_wake.write_fd = -1
        if self._source is not None and clean:
            self._source.close()


__all__ = [
    "Lease",
    "Reader",
    "ReaderStatistics",
    "RelayReader",
    "Source",
    "connect",
    "connect_relayed",
]

"""The writing end: ``create()`` and ``Writer``, an anyio object send stream over a ring."""

from __future__ import annotations

import os
import pickle
import secrets
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Generator, Iterable, Sequence
from types import TracebackType
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar

import anyio
from anyio import to_thread
from anyio.abc import ObjectSendStream

from ..base.errors import Busy, Full, PeerDied, UndeliveredWarning
from ..base.log import log
from ..memory.notify import Notifier, NotifierKind, default_kind
from ..memory.segment import Segment
from ..ring import format as L
from ..ring.format import ATTACHED, DEAD, PENDING
from ..ring.layout import Frame, Layout
from ..ring.ring import RingWriter
from ..serialize.base import Buffer, unserializable
from ..serialize.pickling import PickleSerializer, array_nbytes
from ..serialize.resolve import SerializerSpec, resolve
from .broker import Broker, check_name
from .cancel import pending_checkpoint
from .end import End, deadline_of, in_event_loop
from .handle import Handle
from .stuck import Stuck

T = TypeVar("T")
_modules = sys.modules
_UNTRIED: Any = object()  # _offer: the core was not asked to put the object yet
_monotonic = time.monotonic
V = TypeVar("V")

OnReaderDeath = Literal["raise", "detach"]
_LONGEST_SLEEP = 3600.0  # s: a put waiting on a timer wakes at least this often
_LEAST_ARRAY_HEADER = 32  # bytes: a reserved array's buffer table and pickle, at the least


class WriterStatistics(NamedTuple):
    messages_in_ring: int  #: published and not yet read by the slowest counted reader
    bytes_in_ring: int  #: ring bytes those messages occupy (headers and padding included)
    capacity: int
    max_messages: int
    messages_put: int  #: total messages published
    bytes_put: int  #: total payload bytes published
    readers: int  #: reader slots
    readers_attached: int
    tasks_waiting_send: int
    wakeups_sent: int  #: wake-up syscalls made to sleeping readers
    publishes: int  #: times new messages were made visible to readers (a batch is one)
    readers_evicted: int  #: live readers evicted for not advancing (slow_reader_timeout)


def _positive_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value} is too small: it must be at least {minimum}")
    return value


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
    relay: Callable[[str, Layout, str], RelayServer] | None = None,
    cls: type[Writer[Any]] | None = None,
) -> Writer[Any]:
    """Create a ring and return its writer, which owns it.

    ``capacity`` (bytes, rounded up to a multiple of 64) and ``max_messages`` both bound what
    the ring holds for its slowest reader.  ``readers`` is the number of reader slots.
    ``linger`` is how long (seconds) closing the writer waits for readers to attach to
    slots that never had one while messages wait for them (see ``Writer.close``).
    ``slow_reader_warning``: a put that has waited this long (seconds) for room logs a
    warning naming the slowest reader, and again each time as long again passes; None: never.
    ``slow_reader_timeout``: a live reader that has not advanced for this long (seconds)
    while a put waited for it is evicted (see ``Writer``); None (the default): wait for it.
    ``relay`` makes the server that serves remote readers (``aioshmq.remote``), given the
    ring's name, layout and serializer's name; ``cls`` is ``MirrorWriter`` for a mirror.
    """
    capacity = _positive_int("capacity", capacity, L.MIN_CAPACITY)
    if capacity > L.MAX_CAPACITY:
        raise ValueError(f"capacity={capacity} is larger than the {L.MAX_CAPACITY} bytes allowed")
    max_messages = _positive_int("max_messages", max_messages, 1)
    readers = _positive_int("readers", readers, 1)
    if readers > 4096:
        raise ValueError(f"readers={readers} is more than the 4096 slots a ring can have")
    if on_reader_death not in ("raise", "detach"):
        raise ValueError(f"on_reader_death must be 'raise' or 'detach', not {on_reader_death!r}")
    linger = _linger(linger)
    if slow_reader_warning is not None:
        slow_reader_warning = _seconds("slow_reader_warning", slow_reader_warning)
    if slow_reader_timeout is not None:
        slow_reader_timeout = _seconds("slow_reader_timeout", slow_reader_timeout)
    ser = resolve(serializer)
    kind = default_kind() if notifier is None else notifier
    if kind not in ("eventfd", "pipe"):
        raise ValueError(f"notifier must be 'eventfd' or 'pipe', not {notifier!r}")
    name = check_name(name) if name is not None else f"{os.getpid()}-{secrets.token_hex(8)}"
    layout = Layout(L.align(capacity, 64), max_messages, readers)
    if cls is None:
        cls = Writer if relay is None else ServedWriter
    writer = cls(
        layout,
        ser,
        kind,
        name,
        on_reader_death,
        linger,
        slow_reader_warning,
        slow_reader_timeout,
    )
    if relay is not None:
        try:
            writer._relay = relay(name, layout, ser.name)
        except BaseException:
            writer.close()
            raise
    return writer


class RelayServer(Protocol):
    """What serves a writer's remote readers (``aioshmq.remote``'s server thread)."""

    @property
    def address(self) -> str:
        """The endpoint it is bound to."""

    def finish(self, wait: bool = True) -> None:
        """Send the remote readers the rest and the end, then stop (the writer closed);
        with ``wait=False`` in a thread of its own."""

    def wait_finished(self) -> None:
        """Wait until ``finish`` (called, or yet to be) is done."""

    def abandon(self) -> None:
        """Stop at once, touching nothing shared (a copy inherited through fork)."""

    def remote_slot(self, index: int) -> dict[str, Any] | None:
        """None unless slot ``index`` is held by a remote reader; else what it said."""

    def push(self) -> None:
        """The writer published (called in its thread): send it on to the remote readers."""


def _same(view: memoryview) -> memoryview:
    return view


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called through a weak reference: the broker thread must not keep its
    writer alive (an unclosed writer is collected, warns and closes itself)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def _seconds(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{what} must be a number of seconds > 0 (or None), not {value!r}")
    return float(value)


def _linger(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"linger must be a number of seconds >= 0, not {value!r}")
    return float(value)


class Writer(End, ObjectSendStream[T], Generic[T]):
    """The writing end of a ring, made by ``aioshmq.create``: every attached reader receives
    every message, in order."""

    __slots__ = ("_dumps", "_halt", "_pickles", "_ser", "_torch")  # read by every put

    _role = "writer"

    def __init__(
        self,
        layout: Layout,
        serializer: Any,
        kind: NotifierKind,
        name: str,
        on_reader_death: OnReaderDeath,
        linger: float = 0.0,
        slow_reader_warning: float | None = None,
        slow_reader_timeout: float | None = None,
    ) -> None:
        super().__init__()
        self._slow_warning = slow_reader_warning
        self._stuck = None if slow_reader_timeout is None else Stuck(slow_reader_timeout)
        self._closed = True  # until everything below exists
        self._halt = True  # closed, or its broker stopped: the hot paths check this alone
        self._reserving = False  # a sync reservation's block is open (see _reserve)
        self._relay: RelayServer | None = None  # serves remote readers, if listening
        self._broken = False  # close as cut off at the source, not as ended
        self._linger = linger
        self._quiet = False
        self._layout = layout
        self._ser = serializer
        # Whether the serializer hands the core a pickle.dumps to call itself (one-call
        # pickle-and-put), and which: read again once torch is imported (its tensors then
        # have a reducer of the serializer's).
        self._pickles = isinstance(serializer, PickleSerializer)
        self._dumps: Callable[..., Any] = serializer.pickler if self._pickles else pickle.dumps
        self._torch = "torch" in _modules
        self._name = name
        self._on_death = on_reader_death
        self._messages = 0
        self._bytes = 0
        self._seg = Segment.create(
            layout.size, layout.data_offset, name, f"capacity={layout.capacity}"
        )
        try:
            layout.write_header(self._seg.buf, os.getpid())
            self._wake = Notifier.create(kind)
            self._wait_fd = self._wake.read_fd
            self._reader_wake: list[Notifier] = []
            for _ in range(layout.readers):
                self._reader_wake.append(Notifier.create(kind))
            self._ring = RingWriter(self._seg, layout, self._reader_wake)
            self._core = self._ring.core
            self._gate = self._ring.gate
            if self._pickles:
                self._core.arrays = serializer.array_pickles
            self._broker = Broker(
                name,
                self._ring,
                self._seg.fd,
                self._wake,
                self._reader_wake,
                serializer.name,
                self._wake.signal,
                detach_dead=on_reader_death == "detach",
                on_failure=_weakly(self._broker_failed),
            )
        except BaseException:
            self._free()
            raise
        self._closed = self._halt = False

    def _published(self) -> None:
        """What a reservation published goes on to remote readers (``ServedWriter``)."""

    def _resume(self) -> None:
        """A sync reservation's block ended: puts go on (unless the writer stopped)."""
        self._reserving = False
        self._halt = self._closed or self._broker.failure is not None

    def _abandon(self) -> None:
        self._halt = True  # the hot paths check this alone
        super()._abandon()

    def _broker_failed(self) -> None:
        """Called by the broker thread if it ever stops for something it could not survive."""
        self._halt = True
        self._wake.signal()

    def _check(self) -> None:
        super()._check()
        if self._reserving:
            raise Busy("a reservation (writer.reserve) is open on this writer: end its block first")
        failure = self._broker.failure
        if failure is not None:
            raise anyio.BrokenResourceError(
                f"the broker thread of ring {self._name!r} stopped ({failure!r}): readers can "
                "no longer attach, and their deaths go unseen, so this writer cannot go on; "
                "close it"
            ) from failure

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<aioshmq.Writer {self._name!r} capacity={self._layout.capacity} "
            f"max_messages={self._layout.max_messages} readers={self._layout.readers} {state}>"
        )

    def _stays_here(self) -> str:
        return (
            f"cannot pickle an aioshmq Writer: it stays in the process that created ring "
            f"{self._name!r} (a ring has one writer).  Pass writer.handle to the other process "
            "and call aioshmq.connect(handle, reader=N) there to read the ring"
        )

    # -- identity --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The ring's name: ``aioshmq.connect(name, reader=i)`` attaches from any process."""
        return self._name

    @property
    def handle(self) -> Handle:
        return Handle(self._name)

    def remote_reader(self, index: int) -> dict[str, Any] | None:
        """None unless reader slot ``index`` is held by a reader on another host; then what
        that reader said about itself (an ``aioshmq.rpc`` worker says where its replies
        are), empty until it has said it."""
        if self._forked:
            raise self._closed_error()
        return None if self._relay is None else self._relay.remote_slot(index)

    @property
    def address(self) -> str | None:
        """The endpoint remote readers connect to (its real port), or None if not listening."""
        return None if self._relay is None else str(self._relay.address)

    # -- putting ---------------------------------------------------------------------------

    def _frame(self, obj: object) -> Frame:
        main, buffers = self._ser.dumps(obj)
        return Frame(main, buffers)

    def _steps(self, frames: list[Frame], atomic: bool) -> Generator[None, None, None]:
        """Write ``frames``; yields whenever it must wait for room (``ring.need`` says how much).

        With ``atomic``, nothing is published until every frame is written, and closing the
        generator early forgets what was written: a cancelled put published nothing.
        Otherwise what was written is published before each wait.
        """
        ring, core = self._ring, self._core
        start = core.pos, core.count
        sent = nbytes = 0
        try:
            for frame in frames:
                if ring.fits_whole(frame):
                    while not ring.try_write(frame):
                        if not atomic:
                            core.publish()
                        yield
                else:
                    done = 0
                    while done < frame.length:
                        progress = ring.try_write_fragment(frame, done)
                        if progress == done:
                            if not atomic:
                                core.publish()
                            yield
                        done = progress
                sent += frame.count
                nbytes += frame.length
        except GeneratorExit:
            if atomic:
                ring.rollback(*start)
                sent = nbytes = 0
            raise
        finally:
            self._messages += sent
            self._bytes += nbytes
        core.publish()

    def _atomic(self, frames: list[Frame]) -> bool:
        """Whether the batch is small enough to be published whole (half the ring at most)."""
        layout = self._layout
        if len(frames) > layout.max_messages:
            return False
        total = 0
        for frame in frames:
            if not self._ring.fits_whole(frame):
                return False
            total += L.record_size(frame.length)
        return total <= layout.capacity // 2

    def _check_readers(self) -> None:
        """Raise PeerDied if the writer would wait on a reader whose process died (or the
        broker's error if it stopped: then nobody would notice a death or an attach)."""
        if self._broker.failure is not None:
            self._check()
        for i, state in enumerate(self._gate.states()):
            if state == DEAD:
                pid = self._broker.dead_pid(i)
                raise PeerDied(
                    f"reader {i} ({self._broker.dead_peer(i)}) of ring {self._name!r} died "
                    "while attached",
                    role="reader",
                    pid=pid,
                    index=i,
                )

    def _warn_at(self, since: float | None) -> float | None:
        """When the wait that began at ``since`` next deserves a slow-reader warning."""
        every = self._slow_warning
        if every is None or since is None:
            return None
        return since + every * ((time.monotonic() - since) // every + 1)

    def _alarm(self, since: float | None) -> tuple[float | None, float | None]:
        """When the sleep about to start should end for the slow-reader policies (None:
        never), and when the warning is due.  Also notes where the stuck readers are."""
        warn_at = self._warn_at(since)
        alarm = warn_at
        if self._stuck is not None:
            self._stuck.waited(self._ring, 0.0)
            judge_at = time.monotonic() + self._stuck.due()
            alarm = judge_at if alarm is None else min(alarm, judge_at)
        if alarm is not None:
            alarm = min(alarm, time.monotonic() + _LONGEST_SLEEP)
        return alarm, warn_at

    def _after_sleep(self, since: float | None, warn_at: float | None, slept: float) -> None:
        """The sleep begun at ``slept`` ended: warn about the slowest reader if it is time,
        and evict readers that stayed put for the slow_reader_timeout."""
        now = time.monotonic()
        if warn_at is not None and since is not None and now >= warn_at:
            self._warn_slow(since)
        if self._stuck is None:
            return
        for slot, _tail, count in self._stuck.waited(self._ring, now - slept):
            pid = self._seg.words[self._layout.reader_word(slot, L.R_PID)]
            log.warning(
                "ring %r: evicted reader %d (pid %d): it had not advanced for %g s while a "
                "put waited for it (slow_reader_timeout), %d messages behind",
                self._name,
                slot,
                pid,
                self._stuck.timeout,
                self._core.head_count - min(count, self._core.head_count),
            )

    def _warn_slow(self, since: float) -> None:
        lags = self._ring.lags()
        if not lags:
            return
        slot, state, pid, behind, gap = lags[0]
        who = {PENDING: "never attached", DEAD: f"pid {pid}, dead"}.get(state, f"pid {pid}")
        same = sum(1 for lag in lags[1:] if lag[4] == gap and lag[3] == behind)
        log.warning(
            "ring %r: a put has waited %.1f s for room; the slowest reader is slot %d (%s), "
            "%d messages and %d bytes behind%s",
            self._name,
            time.monotonic() - since,
            slot,
            who,
            behind,
            gap,
            f" (and {same} more as far behind)" if same else "",
        )

    async def _wait_room(self, since: float | None = None) -> None:
        """Sleep until readers free room; ``since``: when the put began to wait (for the
        slow-reader warning)."""
        need, messages = self._ring.need
        token = self._hold(True)
        try:
            self._drain()  # before announcing the sleep: no wake-up left over from before
            if self._closed:  # its close wake-up was just drained: never sleep now
                self._check()
            # After the drain: a death the broker signalled before it is seen here, and one
            # after it wakes the sleep below.
            self._check_readers()
            alarm, warn_at = self._alarm(since)
            if self._ring.prepare_sleep(need, messages):
                slept = time.monotonic()
                try:
                    if alarm is None:
                        await self._sleep()
                    else:
                        with anyio.move_on_after(alarm - slept):
                            await self._sleep()
                finally:
                    if not self._closed:  # closed meanwhile: never touch the ring again
                        self._ring.end_sleep()
                        self._after_sleep(since, warn_at, slept)
        finally:
            self._unhold(token)
        self._check()

    def _wait_room_sync(self, deadline: float | None, since: float | None = None) -> None:
        need, messages = self._ring.need
        token = self._hold(False)
        try:
            self._wake.drain()
            if self._closed:  # its close wake-up was just drained: never sleep now
                self._check()
            self._check_readers()  # after the drain, as in _wait_room
            alarm, warn_at = self._alarm(since)
            if self._ring.prepare_sleep(need, messages):
                slept = time.monotonic()
                try:
                    if alarm is None or (deadline is not None and deadline <= alarm):
                        self._sleep_sync(deadline)
                    else:
                        try:
                            self._sleep_sync(alarm)
                        except TimeoutError:
                            pass
                finally:
                    self._ring.end_sleep()
                    if not self._closed:
                        self._after_sleep(since, warn_at, slept)
        finally:
            self._unhold(token)
        self._check()

    async def _run(self, frames: list[Frame]) -> None:
        """Write ``frames`` in turn with the other waiting puts, waiting for room."""
        async with self._lock:
            self._check()
            steps = self._steps(frames, self._atomic(frames))
            since: float | None = None
            try:
                for _ in steps:
                    since = since or time.monotonic()
                    await self._wait_room(since)
            finally:
                steps.close()

    async def put(self, obj: T) -> None:
        """Send ``obj`` to every reader; waits while the ring is full for the slowest one.

        A cancelled scope makes it raise before it writes anything, room or not.
        """
        if self._halt:
            self._check()
        if pending_checkpoint() is not None or _monotonic() >= self._next_yield:
            await self._pause()  # _due(), whose common case is inline here
        if self._pickles and not self._lock.held:  # _put_object, _offer's first step, inline
            if not self._torch and "torch" in _modules:
                self._see_torch()
            try:
                rest = self._core.put_object(obj, self._dumps)
            except Exception as exc:
                self._put_failed(obj, exc)
                raise
            if rest is None:
                return
            frame = self._offer(obj, rest)
        else:
            frame = self._offer(obj)
        if frame is not None:
            await self._run([frame])

    async def send(self, item: T) -> None:
        """Same as ``put`` (the anyio stream interface)."""
        await self.put(item)

    def _put_object(self, obj: T) -> Any:
        """The core's ``put_object`` with the serializer's pickler: None if ``obj`` was
        written and published, else what the serializer is to finish (``_offer``)."""
        if not self._torch and "torch" in _modules:
            self._see_torch()
        try:
            return self._core.put_object(obj, self._dumps)
        except Exception as exc:
            self._put_failed(obj, exc)
            raise

    def _offer(self, obj: T, rest: Any = _UNTRIED) -> Frame | None:
        """Serialize ``obj`` (or finish what ``_put_object`` left, ``rest``) and, unless
        other puts are waiting, write and publish it if there is room now: None.  Otherwise
        the frame to wait with; nothing was written."""
        if rest is _UNTRIED and self._pickles and not self._lock.held:
            rest = self._put_object(obj)
            if rest is None:
                return None
        try:
            if rest is _UNTRIED:
                main, buffers = self._ser.dumps(obj)
            else:
                main, buffers = self._ser.finish(obj, rest)
            return self._put_now(main, buffers)
        except Exception as exc:
            self._put_failed(obj, exc)
            raise

    def _put_now(self, main: Buffer, buffers: list[memoryview]) -> Frame | None:
        """Write and publish a serialized message if nothing waits and there is room now:
        None, else the frame that ``_run`` has to wait with."""
        core = self._core
        if not buffers:
            if not self._lock.held and core.put_plain(main):
                return None
            return Frame(main, buffers)
        if len(buffers) == 1:  # one array: written and published in one call
            if not self._lock.held and core.put_buffer(main, buffers[0]):
                return None
            return Frame(main, buffers)
        frame = Frame(main, buffers)
        if not self._lock.held and self._ring.fits_whole(frame) and self._ring.try_write(frame):
            core.publish()
            self._messages += 1
            self._bytes += frame.length
            return None
        return frame

    def _see_torch(self) -> None:
        """torch was imported: ask the serializer again for its pickler."""
        self._torch = True
        self._dumps = self._ser.pickler

    def _put_failed(self, obj: object, exc: Exception) -> None:
        """Raise what a failed write means for the caller, if not ``exc`` itself: the object
        did not serialize, or another thread closed the writer (its memory is gone)."""
        if self._core.dumps_failed and not isinstance(exc, MemoryError):
            raise unserializable(obj, exc, self._ser.name) from exc
        if self._closed and isinstance(exc, ValueError):
            raise self._closed_error() from None

    def reserve(self, nbytes: int, *, timeout: float | None = None) -> Reservation[memoryview]:
        """Room for one message of ``nbytes``, written in place: ``async with
        writer.reserve(n) as view:`` (or ``with``, without an event loop) gives a writable
        view of the ring, published as one message when the block ends, or not at all if
        it raises or is cancelled.  Waits for room like ``put``, under both bounds;
        ``timeout`` bounds the blocking form's wait.

        Readers get the bytes as written: with the pickle serializers, a ``bytearray``
        from ``get()`` and a read-only ``memoryview`` inside a lease; with ``raw``, as
        ``raw`` messages always arrive; with a serializer of your own, they are what its
        ``loads`` is given.  A reserved message is never split: at most half the ring.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"reserve() takes a number of bytes >= 0, not {nbytes!r}")
        ser = self._ser
        main = ser.buffer_header() if isinstance(ser, PickleSerializer) else None
        return Reservation(self, self._reserved(main, nbytes), _same, timeout)

    def reserve_array(
        self, shape: int | Iterable[int], dtype: Any, *, timeout: float | None = None
    ) -> Reservation[Any]:
        """``reserve`` for one C-contiguous numpy array, or CPU torch tensor if ``dtype`` is a
        ``torch.dtype``, of ``shape``: the block fills it in place, and readers get an array
        (tensor) of that shape and dtype, as if it had been put.  Needs a pickle serializer.
        """
        ser = self._ser
        if not isinstance(ser, PickleSerializer):
            raise TypeError(
                f"reserve_array() needs the pickle or cloudpickle serializer; this ring uses "
                f"{ser.name!r}: reserve(nbytes) writes its bytes in place"
            )
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in dims):
            raise ValueError(f"shape must be sizes >= 0, not {shape!r}")
        # Refused before the serializer makes the placeholder its pickle comes from, which
        # would take as much memory as the array.  The buffer table and the pickle take 32
        # bytes at least: the exact bound is checked once they are made.
        nbytes = array_nbytes(dims, dtype)
        self._check()
        if nbytes > self._core.max_record - L.HEADER_SIZE - _LEAST_ARRAY_HEADER:
            raise self._too_big(nbytes, _LEAST_ARRAY_HEADER)
        main, nbytes, wrap = ser.reserved_array(dims, dtype)
        return Reservation(self, self._reserved(main, nbytes), wrap, timeout)

    def _reserved(self, main: Buffer | None, nbytes: int) -> Frame:
        self._check()
        frame = Frame.reserved(main, nbytes)
        if not self._ring.fits_whole(frame):
            raise self._too_big(nbytes, frame.hole if main else 0)
        return frame

    def _too_big(self, nbytes: int, header: int) -> ValueError:
        """The error for a reserved message of ``nbytes`` that cannot fit in one record,
        ``header`` bytes of its payload being taken before them."""
        most = self._core.max_record - L.HEADER_SIZE - header
        return ValueError(
            f"a reserved message must fit in one record, at most {most} bytes in ring "
            f"{self._name!r} (half its capacity of {self._layout.capacity}, less "
            f"headers), not {nbytes}; put() sends bigger messages in fragments"
        )

    async def put_many(self, objs: Iterable[T]) -> None:
        """Send a batch with one publish and at most one wake-up per sleeping reader.

        Every object is serialized before anything is written.  A batch of up to half the
        ring's bytes (and ``max_messages``) is published whole or, if cancelled, not at all;
        a bigger one goes out in parts as room frees up.  With a pickle serializer a batch
        that fits is written as one record holding the pickled list, which readers unpack
        into its messages: several times cheaper per message on both sides.
        """
        self._check()
        objs = list(objs)
        if (due := self._due()) is not None:
            await due()
            self._check()
        if frames := self._offer_many(objs):
            await self._run(frames)

    def _offer_many(self, objs: list[T]) -> list[Frame]:
        """``_offer`` for a batch: [] if it was written now, else the frames to wait with."""
        batch = 2 <= len(objs) <= self._layout.max_messages
        if batch and self._pickles and not self._lock.held:
            if not self._torch and "torch" in _modules:
                self._see_torch()
            try:
                rest = self._core.put_object(objs, self._dumps, len(objs))
            except Exception as exc:
                if not self._core.dumps_failed:
                    self._put_failed(objs, exc)
                    raise
                rest = ()  # one of them does not serialize: _batch says which
            if rest is None:
                return []
        frames = self._batch(objs)
        if len(frames) == 1 and not frames[0].kind & L.OOB:  # one record, no buffers
            frame = frames[0]
            if not self._lock.held and self._core.put_plain(
                frame.parts[0][1], frame.kind, frame.count
            ):
                return []
        return frames

    def _batch(self, objs: list[T]) -> list[Frame]:
        """One frame holding the whole list where the serializer and the bounds allow."""
        dumps_many = getattr(self._ser, "dumps_many", None)
        if dumps_many is not None and 2 <= len(objs) <= self._layout.max_messages:
            try:
                main, buffers = dumps_many(objs)
            except TypeError:  # one of them does not serialize: the loop below says which
                pass
            else:
                frame = Frame(main, buffers, count=len(objs))
                if self._atomic([frame]):
                    return [frame]
        frames = []
        for i, obj in enumerate(objs):
            try:
                frames.append(self._frame(obj))
            except Exception as exc:
                exc.add_note(f"(object {i} of the {len(objs)} given to put_many)")
                raise
        return frames

    def put_nowait(self, obj: T) -> None:
        """Send ``obj`` now, or raise Full (nothing written) if the ring has no room.

        A message of more than three quarters of the ring, less 48 bytes (three fragments),
        is refused with ValueError: it would fit only where the ring's cursor happens to
        lie, if at all, so waiting for readers would not make room for it; ``put`` sends it
        in fragments as they read.
        """
        self._check()
        if self._lock.held:
            self._nowait_fits(self._frame(obj))  # an object that does not serialize says so first
            raise Full("tasks are already waiting to put into this ring")
        frame = self._offer(obj)
        if frame is None:
            return
        self._nowait_fits(frame)
        steps = self._steps([frame], atomic=True)
        for _ in steps:
            steps.close()
            self._check_readers()
            raise Full(f"ring {self._name!r} has no room for a message of {frame.length} bytes")

    def _nowait_fits(self, frame: Frame) -> None:
        """ValueError unless ``put_nowait`` can place ``frame`` whatever the ring's cursor,
        once the readers have read everything: in three fragments at most.  A record never
        wraps, so a fourth fragment fits only at some positions, and a fifth never: Full would
        come back for ever, however long the caller waited."""
        most = 3 * self._layout.fragment_payload
        if frame.length > most:
            raise ValueError(
                f"a message of {frame.length} bytes is more than put_nowait() places in ring "
                f"{self._name!r}: at most {most} bytes (three quarters of its capacity of "
                f"{self._layout.capacity}, less fragment headers); a bigger one may never find "
                "room all at once, however long it waits, so retrying cannot help: use put() or "
                "put_sync(), which send it in fragments as readers take them"
            )

    def put_sync(self, obj: T, timeout: float | None = None) -> None:
        """Blocking put for code without an event loop; TimeoutError after ``timeout`` s.

        Refused in a thread that runs an event loop (use ``await put()`` there).  Another
        thread may close the writer meanwhile: this then raises ClosedResourceError.
        """
        if self._halt:
            self._check()
        if in_event_loop():
            self._refuse_in_loop("put_sync", "writer.put(obj)")
        if self._lock.held:
            raise Busy("an async put or wait_readers is under way on this writer")
        if (frame := self._offer(obj)) is None:
            return
        deadline = deadline_of(timeout)
        steps = self._steps([frame], self._atomic([frame]))
        since: float | None = None
        try:
            for _ in steps:
                since = since or time.monotonic()
                self._wait_room_sync(deadline, since)
        except ValueError:
            if self._closed:  # closed by another thread while this one wrote the ring
                raise self._closed_error() from None
            raise
        finally:
            steps.close()

    # -- readers -------------------------------------------------------------------------

    async def wait_readers(self) -> None:
        """Return once every reader slot is attached."""
        self._check()
        if (cancelled := pending_checkpoint()) is not None:
            await cancelled()
        async with self._lock:
            await self._sleep_until(self._all_attached)

    def wait_readers_sync(self, timeout: float | None = None) -> None:
        """Blocking ``wait_readers``; TimeoutError after ``timeout`` s."""
        self._check()
        self._refuse_in_loop("wait_readers_sync", "writer.wait_readers()")
        self._sleep_until_sync(self._all_attached, deadline_of(timeout))

    def drop_reader(self, index: int) -> None:
        """Stop keeping messages for slot ``index`` whose reader died or never came.

        After ``PeerDied`` (with ``on_reader_death="raise"``) this lets the writer go on
        without that reader.  A slot held by a live reader cannot be dropped: its reader
        would be overrun.  The slot can be attached again later; its reader starts with
        the next message put after it attached.
        """
        self._check()
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int, not {type(index).__name__}")
        if not 0 <= index < self._layout.readers:
            last = self._layout.readers - 1
            raise ValueError(f"index={index} is out of range: this ring has readers 0..{last}")
        self._ring.drop(index)
        log.info("ring %r: reader slot %d dropped", self._name, index)
        self._wake.signal()

    def missing_readers(self) -> list[int]:
        """The reader slots that no live reader holds now (never attached, left, or died):
        those ``wait_readers`` still waits for."""
        self._check()
        return [i for i, state in enumerate(self._gate.states()) if state != ATTACHED]

    def _all_attached(self) -> bool:
        self._check_readers()
        return all(state == ATTACHED for state in self._gate.states())

    def statistics(self) -> WriterStatistics:
        self._check()
        messages, nbytes = self._ring.backlog()
        return WriterStatistics(
            messages_in_ring=messages,
            bytes_in_ring=nbytes,
            capacity=self._layout.capacity,
            max_messages=self._layout.max_messages,
            messages_put=self._messages + self._core.sent,
            bytes_put=self._bytes + self._core.sent_bytes,
            readers=self._layout.readers,
            readers_attached=self._gate.states().count(ATTACHED),
            tasks_waiting_send=self._waiting,
            wakeups_sent=self._core.wakeups,
            publishes=self._core.publishes,
            readers_evicted=0 if self._stuck is None else self._stuck.evicted,
        )

    # -- closing ---------------------------------------------------------------------------

    def _undelivered(self) -> tuple[list[int], int]:
        """Slots never attached, and how many published messages wait for them."""
        slots = [i for i, state in enumerate(self._gate.states()) if state == PENDING]
        return slots, (self._core.head_count if slots else 0)

    def close(self, linger: float | None = None) -> None:
        """Close the writer: readers get every message published, then the end of stream.

        Messages kept for slots that no reader ever attached are lost when the writer
        closes (a reader that attached keeps the ring's memory and gets them all).  With
        ``linger`` (default: ``create(linger=...)``, 0) it first waits up to that many
        seconds for such slots to be attached; any still unattached then get an
        ``UndeliveredWarning``.  A sync close never lingers in a thread that runs an event
        loop: use ``await writer.aclose()`` there.
        """
        if self._closed:
            return
        lost: tuple[list[int], int] = ([], 0)
        if os.getpid() == self._pid and not self._forked:
            wait = self._linger if linger is None else _linger(linger)
            if wait and not in_event_loop():
                try:
                    self._linger_sync(wait)
                except Exception:  # anything amiss (a closed end, a dead reader): close now
                    pass
            if not self._quiet:
                lost = self._undelivered()
        self._halt = True
        super().close()
        if lost[1]:  # after closing: a warning turned into an error must not keep it open
            self._warn_undelivered(*lost)

    async def aclose(self, linger: float | None = None) -> None:
        """``close`` that lingers without blocking the event loop."""
        try:
            if not self._closed and os.getpid() == self._pid and not self._forked:
                wait = self._linger if linger is None else _linger(linger)
                if wait:
                    with anyio.move_on_after(wait):
                        try:
                            await self._linger_async()
                        except Exception:  # a closed end, a dead reader: close now
                            pass
        finally:
            self.close(linger=0)
            if self._relay is not None and os.getpid() == self._pid and not self._forked:
                # Remote readers get the rest first: that takes network time, off the loop
                # (which may serve one of them, and must go on meanwhile).
                await to_thread.run_sync(self._relay.wait_finished, abandon_on_cancel=True)
        await anyio.lowlevel.checkpoint()

    def _delivered(self) -> bool:
        return not self._undelivered()[1]

    def _linger_sync(self, seconds: float) -> None:
        try:
            self._sleep_until_sync(self._delivered, deadline_of(seconds))
        except TimeoutError:
            pass

    async def _linger_async(self) -> None:
        await self._sleep_until(self._delivered)

    def _warn_undelivered(self, slots: list[int], messages: int) -> None:
        if messages:
            warnings.warn(
                f"writer of ring {self._name!r} closed with {messages} messages for reader "
                f"slots {slots} that no reader ever attached to: they are lost; call "
                "wait_readers() before closing, or close with linger=seconds",
                UndeliveredWarning,
                stacklevel=3,
            )

    def _close_unwaited(self) -> None:
        self._quiet = True  # from the GC, which already warns ResourceWarning
        self.close(linger=0)

    def _release(self, *, clean: bool) -> None:
        if clean:
            self._ring.close(broken=self._broken)
            if self._relay is not None:
                # Never waits for the network in an event loop's thread (``aclose`` does, off it).
                self._relay.finish(wait=not in_event_loop())
            self._broker.stop()
        else:
            if self._relay is not None:
                self._relay.abandon()
            self._broker.abandon()
        self._free()

    def _free(self) -> None:
        for notifier in [getattr(self, "_wake", None), *getattr(self, "_reader_wake", [])]:
            if notifier is not None:
                notifier.close()
        self._seg.close()


class Reservation(Generic[V]):
    """Room for one message in the ring, handed out as a writable view of the ring itself.

    ``async with writer.reserve(n) as view:`` waits for room like ``put`` (both bounds), and
    holds the writer (other puts wait) until the block ends: then the message is published
    to every reader, or, if the block raised or was cancelled, forgotten as if never begun.
    ``with`` does the same for code without an event loop (``timeout`` bounds the wait).
    The view must not be used after the block: its memory belongs to the ring again.
    """

    __slots__ = ("_frame", "_timeout", "_token", "_view", "_wrap", "_writer")

    def __init__(
        self,
        writer: Writer[Any],
        frame: Frame,
        wrap: Callable[[memoryview], V],
        timeout: float | None = None,
    ) -> None:
        self._writer = writer
        self._frame = frame
        self._wrap = wrap
        self._timeout = timeout
        self._token: int | None = None
        self._view: memoryview | None = None

    def _take(self) -> V:
        ring = self._writer._ring
        start = ring.written_at + self._frame.hole
        view = self._view = ring.data[start : start + self._frame.length - self._frame.hole]
        return self._wrap(view)

    def _finish(self, publish: bool) -> None:
        writer, frame = self._writer, self._frame
        ring = writer._ring
        try:
            if self._view is not None:
                try:
                    self._view.release()  # later writes through it fail, where nothing holds it
                except BufferError:
                    pass  # an array or tensor still wraps it: the caller's to drop
                self._view = None
            if writer._closed:  # closing dropped what was not published
                if publish:
                    raise writer._closed_error()
            elif publish:
                writer._core.publish()
                writer._messages += 1
                writer._bytes += frame.length
                writer._published()
            else:
                ring.rollback_unpublished()
        finally:
            token, self._token = self._token, None
            if token is not None:
                writer._unhold(token)

    # -- async ---------------------------------------------------------------------------

    async def __aenter__(self) -> V:
        writer = self._writer
        if self._token is not None:
            raise RuntimeError("this reservation is already open")
        writer._check()
        if (cancelled := pending_checkpoint()) is not None:
            await cancelled()
        await writer._lock.acquire()
        try:
            # Not an async hold: a close from anywhere leaves the mapping in place until
            # this block ends, since the caller writes into it without asking.
            self._token = writer._hold(False)
            ring = writer._ring
            since = time.monotonic()
            while not ring.try_write(self._frame):
                await writer._wait_room(since)
            return self._take()
        except BaseException:
            try:
                self._finish(False)
            finally:
                writer._lock.release()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._finish(exc_type is None)
        finally:
            self._writer._lock.release()

    # -- sync ----------------------------------------------------------------------------

    def __enter__(self) -> V:
        writer = self._writer
        if self._token is not None:
            raise RuntimeError("this reservation is already open")
        writer._check()
        writer._refuse_in_loop("reserve", "writer.reserve(...) with 'async with'")
        if writer._lock.locked():
            raise Busy("an async put or wait_readers is under way on this writer")
        deadline = deadline_of(self._timeout)
        self._token = writer._hold(False)
        try:
            ring = writer._ring
            since = time.monotonic()
            while not ring.try_write(self._frame):
                writer._wait_room_sync(deadline, since)
            # Until the block ends, any other put stops at its first check (busy).
            writer._reserving = writer._halt = True
            return self._take()
        except BaseException:
            try:
                self._finish(False)
            finally:
                writer._resume()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._finish(exc_type is None)
        finally:
            self._writer._resume()


class ServedWriter(Writer[T]):
    """The writer of a ring that serves remote readers (``create(listen=...)``): what a put
    published goes on to them from this thread (``RelayServer.push``), not through the
    server's, and before a put waits for room (their acknowledgements make it)."""

    def _published(self) -> None:
        relay = self._relay
        if relay is not None and not self._closed:
            relay.push()

    async def put(self, obj: T) -> None:
        try:
            await super().put(obj)
        finally:
            self._published()

    async def put_many(self, objs: Iterable[T]) -> None:
        try:
            await super().put_many(objs)
        finally:
            self._published()

    def put_nowait(self, obj: T) -> None:
        try:
            super().put_nowait(obj)
        finally:
            self._published()

    def put_sync(self, obj: T, timeout: float | None = None) -> None:
        try:
            super().put_sync(obj, timeout)
        finally:
            self._published()

    async def _wait_room(self, since: float | None = None) -> None:
        self._published()
        await super()._wait_room(since)

    def _wait_room_sync(self, deadline: float | None, since: float | None = None) -> None:
        self._published()
        super()._wait_room_sync(deadline, since)


class MirrorWriter(Writer[T]):
    """The writer of a mirror's local ring: its records come whole from a remote writer's
    ring of the same capacity, copied in by the mirror's link thread, which waits for room
    on ``wait_fd`` and ends the stream, or marks it cut off at its source."""

    @property
    def wait_fd(self) -> int:
        """Readable when a reader freed room, attached or died (or the writer closed)."""
        return self._wake.read_fd

    def drain(self) -> None:
        self._wake.drain()

    def write_records(self, run: memoryview, records: Sequence[tuple[int, int, int]]) -> int:
        """``RingWriter.write_records``: the records that fitted now, published."""
        done = self._ring.write_records(run, records)
        self._messages += sum(messages for _, _, messages in records[:done])
        return done

    def prepare_sleep(self) -> bool:
        """Announce the wait for the room the last write_records lacked (False: room came
        meanwhile); ``end_sleep`` after the wait.  PeerDied if a reader it would wait for
        died."""
        self._check_readers()
        return self._ring.prepare_sleep(*self._ring.need)

    def end_sleep(self) -> None:
        self._ring.end_sleep()

    def close_cut_off(self) -> None:
        """Close as cut off at the source: readers get every message that fully arrived,
        then PeerDied, not the end of the stream."""
        self._broken = True
        self.close(linger=0)


__all__ = [
    "Handle",
    "MirrorWriter",
    "RelayServer",
    "Reservation",
    "ServedWriter",
    "Writer",
    "WriterStatistics",
    "create",
]

"""The ring's per-message work in pure Python: the reference its compiled twin mirrors.

``compiled.c`` implements the same three classes with the same constructors, methods,
attributes and byte layout (``core.py`` names the primitives both offer, as Protocols that
mypy checks, and picks one).  They are narrow: claim room, write and publish a record, read
and consume one, the two sides of the sleep/wake handshake, the writer's gate; everything
rarer (fragments, a sleeping writer, slots, relays) is written once, in ``ring.py``, over them.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

from ..base.errors import CorruptedError, ReaderEvicted
from . import format as F
from .atomics import acquire, fence, release
from .format import record_size
from .layout import check_record

_OWN_PICKLE_MAX = 64 << 10  # a larger pickle: a new Pickler next time (as compiled.c)
_TABLE_ONE = struct.Struct("<3Q")
_ONE = (1).to_bytes(8, "little")


def _notify(fd: int, eventfd: bool) -> None:
    """One wake-up through an eventfd, or a pipe's write end; one already pending is enough."""
    try:
        os.write(fd, _ONE if eventfd else b"\0")
    except BlockingIOError:
        pass


class Gate:
    """Which reader slots the writer waits for: each slot's state (``format.PENDING`` ...)
    and the lock it changes under, shared by the writer and its broker thread.

    ``with gate:`` holds the lock.  The writer's recomputation of its limits holds it too, so
    a reader that starts at the current head is never overrun by a limit computed without it.
    """

    __slots__ = ("_lock", "_states")

    def __init__(self, readers: int) -> None:
        if readers < 1:
            raise ValueError(f"a gate of {readers} slots")
        self._lock = threading.Lock()
        self._states = [F.PENDING] * readers

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()

    def __len__(self) -> int:
        return len(self._states)

    def state(self, index: int) -> int:
        """Slot ``index``'s state."""
        return self._states[index]

    def set(self, index: int, state: int) -> None:
        """Give slot ``index`` a new state (the caller holds the lock)."""
        if not F.PENDING <= state <= F.EVICTED:
            raise ValueError(f"no slot state {state}")
        self._states[index] = state

    def states(self) -> list[int]:
        """Every slot's state, as it is now."""
        return self._states[:]


class _Mapped:
    """The views of a ring's memory a pure core reads and writes through."""

    def _map(self, mapping: mmap.mmap | bytearray, data_offset: int, capacity: int) -> None:
        buf = self._cbuf = memoryview(mapping)
        self._cdata = buf[data_offset : data_offset + capacity]
        self._cwords = buf[: len(buf) - len(buf) % 8].cast("Q")
        self._cq = self._cdata.cast("Q")

    def release(self) -> None:
        """Stop touching the ring's memory (the segment is being unmapped)."""
        for view in (self._cq, self._cwords, self._cdata, self._cbuf):
            view.release()


class WriterCore(_Mapped):
    """The writer's per-message work: claim room, write a record, publish, wake readers."""

    def __init__(
        self,
        mapping: mmap.mmap | bytearray,
        data_offset: int,
        capacity: int,
        max_messages: int,
        readers: int,
        wake_fds: Sequence[int],
        eventfd: bool,
        gate: Gate,
    ) -> None:
        if len(wake_fds) != readers or len(gate) != readers:
            raise ValueError("one wake-up fd and one gate slot per reader are needed")
        self._map(mapping, data_offset, capacity)
        self._w_head = F.writer_word_index(F.W_HEAD)
        self._w_count = F.writer_word_index(F.W_HEAD_COUNT)
        self._r_sleep = [F.reader_word_index(i, F.R_SLEEP) for i in range(readers)]
        self._r_tail = [F.reader_word_index(i, F.R_TAIL) for i in range(readers)]
        self._r_count = [F.reader_word_index(i, F.R_TAIL_COUNT) for i in range(readers)]
        self._cap = capacity
        self._max_messages = max_messages
        self._wake = list(wake_fds)
        self._eventfd = eventfd
        self._signalled = [0] * readers
        self._gate = gate
        self.pos = 0  # write cursor; > head while records are written but not published
        self.count = 0
        self.head = 0
        self.head_count = 0
        self.limit_pos = capacity  # the cursor may advance up to here without re-checking
        self.limit_count = max_messages
        self.need_span = 0  # what the last failed write waited for: bytes, messages
        self.need_count = 0
        self.wakeups = 0
        self.publishes = 0
        self.sent = 0  # messages and payload bytes put through put_plain and put_buffer
        self.sent_bytes = 0
        self.max_record = capacity // 2
        self._rewind_try = 0  # span() reads the tails for a rewind from here on
        self._found: list[Any] = []
        self._in_dumps = 0
        self.dumps_failed = False  # the last put_object's error came from dumps
        # The serializer's stream pickles of numpy arrays by (dtype, shape), which
        # put_object writes arrays with.
        self.arrays: Any = None
        self._pickler: pickle.Pickler | None = None  # _own_dumps's, with its output
        self._pieces: list[Any] = []

    def refresh_limits(self) -> tuple[int, int]:
        """Re-read the tails of the readers the gate waits for, under its lock, and set the
        limits from the slowest: returns (min tail, min count)."""
        words = self._cwords
        with self._gate:
            # From the published head, not the cursor: a reader attaching now starts there.
            lo_pos, lo_count = self.head, self.head_count
            for i, state in enumerate(self._gate.states()):
                if state in F.WAITED_FOR:
                    t = words[self._r_tail[i]]
                    c = words[self._r_count[i]]
                    if t > self.head or c > self.head_count:
                        raise CorruptedError(
                            f"reader {i} claims position {t}/{c} beyond the head "
                            f"{self.head}/{self.head_count}"
                        )
                    lo_pos = min(lo_pos, t)
                    lo_count = min(lo_count, c)
        self.limit_pos = lo_pos + self._cap
        self.limit_count = lo_count + self._max_messages
        return lo_pos, lo_count

    def span(self, size: int) -> int:
        """Bytes a record of ``size`` takes at the cursor: ``size``, or that and a PAD up to
        the end of the data area before it, which sends the record back to the start.

        It goes back where it would cross the end, and also (a rewind) where the cursor is
        a quarter of the area or ``REWIND_AT`` in, whichever is more, and no unread byte lies
        in the record's way at the start (``format`` says why).  Whether anything unread is
        in the way is read afresh at most once per that many bytes.
        """
        cap = self._cap
        pos = self.pos
        off = pos % cap
        at = max(cap // 4, F.REWIND_AT)
        if off + size > cap:
            return cap - off + size
        if off < at:
            return size
        back = cap - off + size
        if pos + back > self.limit_pos:
            if pos < self._rewind_try:
                return size
            self.refresh_limits()
            if pos + back > self.limit_pos:
                self._rewind_try = pos + at
                return size
        return back

    def claim(self, size: int, count: int) -> int:
        """The data-area offset of room for a record of ``size`` bytes holding ``count``
        messages at the cursor (its PAD written if it goes back to the start), or -1: no
        room now (``need_span`` and ``need_count`` say for what), or bigger than a record
        may be (``max_record``)."""
        if size > self.max_record:
            return -1
        span = self.span(size)
        cap = self._cap
        pos = self.pos
        off = pos % cap
        if pos + span > self.limit_pos or self.count + count > self.limit_count:
            self.refresh_limits()
            if pos + span > self.limit_pos or self.count + count > self.limit_count:
                self.need_span, self.need_count = span, count
                return -1
        if span != size:
            self._cq[off >> 3] = ((cap - off - F.HEADER_SIZE) << 8) | F.PAD
            self.pos = pos + cap - off
            off = 0
        return off

    def _commit(self, size: int, n: int, count: int) -> bool:
        self.pos += size
        self.count += count
        self.sent += count
        self.sent_bytes += n
        self.publish()
        return True

    def put_plain(self, main: Any, kind: int = F.MSG, count: int = 1) -> bool:
        """Write and publish one record without buffers if there is room now: the hot path."""
        n = len(main) if not isinstance(main, memoryview) else main.nbytes
        size = record_size(n)
        off = self.claim(size, count)
        if off < 0:
            return False
        i = off >> 3
        q = self._cq
        q[i] = (n << 8) | kind
        q[i + 1] = count if count > 1 else 0
        start = off + F.HEADER_SIZE
        self._cdata[start : start + n] = main
        return self._commit(size, n, count)

    def put_buffer(self, main: Any, buffer: Any) -> bool:
        """Write and publish one message with one out-of-band buffer if there is room now,
        laid out as ``layout.Frame`` lays out a single buffer."""
        main_view, buf = memoryview(main).cast("B"), memoryview(buffer).cast("B")
        main_len, buf_len = main_view.nbytes, buf.nbytes
        at = (24 + main_len + F.RECORD_ALIGN - 1) & -F.RECORD_ALIGN
        n = at + buf_len
        size = record_size(n)
        off = self.claim(size, 1)
        if off < 0:
            return False
        i = off >> 3
        q = self._cq
        q[i] = (n << 8) | F.MSG | F.OOB
        q[i + 1] = 0
        start = off + F.HEADER_SIZE
        data = self._cdata
        _TABLE_ONE.pack_into(data, start, 1, main_len, buf_len)
        data[start + 24 : start + 24 + main_len] = main_view
        data[start + at : start + n] = buf
        return self._commit(size, n, 1)

    def put_object(self, obj: Any, dumps: Callable[..., Any], count: int = 1) -> Any:
        """Pickle ``obj`` with ``dumps`` and put it as one plain record if it is one and
        fits now: None.  Otherwise nothing is written, and what is left is returned: ``()``
        for a numpy array (the serializer has its own way with those), else ``(main,
        [PickleBuffer, ...])``.  A C-contiguous numpy array whose pickle (data aside) is in
        ``arrays`` is written with it, data out of band, if it fits now: None.  With
        ``count`` > 1, ``obj`` is a list of that many messages written as one batch
        record.  Given ``pickle.dumps``, it pickles with a Pickler it keeps (``_own_dumps``)."""
        if count < 1:
            raise ValueError("count must be at least 1")
        self.dumps_failed = False
        np = sys.modules.get("numpy")
        if np is not None and type(obj) is np.ndarray:
            return self._put_array(obj) if count == 1 else ()
        found: list[Any] = self._found if not self._in_dumps else []
        own = not self._in_dumps and dumps is pickle.dumps
        self._in_dumps += 1
        self.dumps_failed = True  # until dumps returns: says whose error an error is
        try:
            if own:
                main = self._own_dumps(obj)
            else:
                main = dumps(obj, protocol=5, buffer_callback=found.append)
            self.dumps_failed = False
        finally:
            self._in_dumps -= 1
            buffers = found[:]
            found.clear()
        if buffers or type(main) is not bytes:
            return main, buffers
        if self.put_plain(main, F.MSG | F.BATCH if count > 1 else F.MSG, count):
            return None
        return main, []

    def _own_dumps(self, obj: Any) -> bytes:
        """``pickle.dumps(obj, protocol=5, buffer_callback=self._found.append)`` through a
        Pickler kept between calls (see ``compiled.c``, before ``own_pickler``, for why and
        for the one way its pickles differ from ``pickle.dumps``'s)."""
        if self._pickler is None:
            sink = types.SimpleNamespace(write=self._pieces.append)
            self._pickler = pickle.Pickler(sink, 5, buffer_callback=self._found.append)
        pieces = self._pieces
        try:
            self._pickler.dump(obj)
            main = pieces[0] if len(pieces) == 1 and type(pieces[0]) is bytes else b"".join(pieces)
        finally:
            pieces.clear()
            self._pickler.clear_memo()
        if len(main) > _OWN_PICKLE_MAX:  # a Pickler keeps the largest buffer it needed
            self._pickler = None
        return main

    def _put_array(self, arr: Any) -> Any:
        """``put_object``'s way with a numpy array: None if written now, else ``()``."""
        arrays = self.arrays
        if type(arrays) is not dict:
            return ()
        dtype = arr.dtype
        if dtype.isbuiltin != 1:  # its pickle says more than the cached one
            return ()
        main = arrays.get((dtype, arr.shape))
        if type(main) is not bytes or not arr.flags.c_contiguous:
            return ()
        return None if self.put_buffer(main, pickle.PickleBuffer(arr).raw()) else ()

    def publish(self) -> None:
        """Make what was written visible, and wake the readers that sleep."""
        if self.pos == self.head:
            return
        release()
        w = self._cwords
        w[self._w_count] = self.count
        w[self._w_head] = self.pos
        self.head, self.head_count = self.pos, self.count
        self.publishes += 1
        fence()
        self.wake_readers()

    def wake_readers(self) -> None:
        """Wake each reader that sleeps in an episode not woken yet."""
        w = self._cwords
        for i, idx in enumerate(self._r_sleep):
            s = w[idx]
            if s and s != self._signalled[i]:
                self._signalled[i] = s
                _notify(self._wake[i], self._eventfd)
                self.wakeups += 1


class ReaderCore(_Mapped):
    """A reader's per-message work: read records, publish its tail, wake the writer."""

    def __init__(
        self,
        mapping: mmap.mmap | bytearray,
        data_offset: int,
        capacity: int,
        max_messages: int,
        readers: int,
        index: int,
        wake_fd: int,
        eventfd: bool,
        name: str,
    ) -> None:
        if not 0 <= index < readers:
            raise ValueError(f"reader {index} of a ring with {readers} slots")
        self._map(mapping, data_offset, capacity)
        self._cap = capacity
        self._max_messages = max_messages
        self._w_head = F.writer_word_index(F.W_HEAD)
        self._w_closed = F.writer_word_index(F.W_CLOSED)
        self._w_sleep = F.writer_word_index(F.W_SLEEP)
        self._w_want_pos = F.writer_word_index(F.W_WANT_POS)
        self._w_want_count = F.writer_word_index(F.W_WANT_COUNT)
        self._r_tail = F.reader_word_index(index, F.R_TAIL)
        self._r_count = F.reader_word_index(index, F.R_TAIL_COUNT)
        self._r_sleep = F.reader_word_index(index, F.R_SLEEP)
        self._r_evicted = F.reader_word_index(index, F.R_EVICTED)
        self._wake_writer = wake_fd
        self._eventfd = eventfd
        self._name = name
        self.index = index
        self.tail = self._cwords[self._r_tail]
        self.count = self._cwords[self._r_count]
        self.head = self.tail
        self.shown_tail, self.shown_count = self.tail, self.count
        self.wakeups = 0
        self.taken = 0  # messages and payload bytes taken through the plain paths
        self.taken_bytes = 0
        self.episode = 0
        self.pins: list[tuple[int, int]] = []  # records of leased messages, oldest first
        # A fragmented message is being put together (or skipped): the fast paths then leave
        # every record to next(), whose caller drops it when a whole message comes instead.
        self.assembling = False

    def _evicted(self, mark: int) -> None:
        raise ReaderEvicted(self._name, self.index, mark / 1000)

    def check_evicted(self) -> None:
        """Raise ReaderEvicted if the writer evicted this reader.

        Called after a record was read (behind an acquire fence): what was read is sound
        unless this raises, as the writer marks the reader before reusing its records.
        """
        acquire()
        mark = self._cwords[self._r_evicted]
        if mark:
            self._evicted(mark)

    def available(self) -> bool:
        """Whether something is published past this reader's tail."""
        return self.tail != self.head or self.refresh()

    def closed(self) -> int:
        """The writer's closed word: 0 while open, else ``format.CLOSED_END`` or
        ``CLOSED_BROKEN`` (loaded with acquire: the final head is visible after it)."""
        mark = self._cwords[self._w_closed]
        acquire()
        return mark

    def refresh(self) -> bool:
        """Load the published head; True if there is something past this reader's tail.

        The eviction mark is looked at first: a writer that evicted this reader may have
        lapped it, and that is not corruption."""
        if mark := self._cwords[self._r_evicted]:
            self._evicted(mark)
        self.head = head = self._cwords[self._w_head]
        acquire()
        if (head | self.tail) % F.RECORD_ALIGN:
            self.head = self.tail
            raise CorruptedError(
                f"head {head} or reader {self.index}'s tail {self.tail} is not a record "
                f"boundary (a multiple of {F.RECORD_ALIGN})"
            )
        if not 0 <= head - self.tail <= self._cap:
            # The writer never runs more than a ring ahead of a reader it waits for.
            self.head = self.tail
            raise CorruptedError(
                f"head {head} is {'behind' if head < self.tail else 'more than a ring ahead of'} "
                f"reader {self.index}'s tail {self.tail}"
            )
        return self.tail != head

    def next(self) -> tuple[memoryview, int, int, int] | None:
        """The next record that is not padding, as (payload, kind, ring bytes, aux), not
        consumed (PADs before it are); None if nothing is published past the tail.

        The record is checked: a known kind within the ring and the head, and a batch's
        message count (``aux``) within the ring's bounds.  A fragment's ``aux`` is the
        message's total length for FIRST, else 0.
        """
        cap, q = self._cap, self._cq
        while self.tail != self.head or self.available():
            if mark := self._cwords[self._r_evicted]:
                self._evicted(mark)
            off = self.tail % cap
            kind, length = check_record(self.tail, self.head, cap, q[off >> 3])
            if kind == F.PAD:
                if off + F.HEADER_SIZE + length != cap:
                    raise CorruptedError(
                        f"padding at position {self.tail} of {length} bytes stops short of the end"
                    )
                self.tail += cap - off
                continue
            aux = q[(off >> 3) + 1] if kind & F.BATCH or kind & F.KIND_MASK == F.FIRST else 0
            if kind & F.BATCH and not 2 <= aux <= self._max_messages:
                raise CorruptedError(
                    f"batch at position {self.tail} claims {aux} messages "
                    f"(max_messages={self._max_messages})"
                )
            start = off + F.HEADER_SIZE
            return self._cdata[start : start + length], kind, record_size(length), aux
        return None

    def consume(self, size: int, messages: int) -> None:
        """Step past ``size`` ring bytes holding ``messages`` messages, once what they hold
        was read (not published: see ``publish``); ReaderEvicted instead if the writer
        evicted this reader meanwhile (what was read may then be torn)."""
        self.check_evicted()
        self.tail += size
        self.count += messages

    def get_plain(self, loads: Callable[[memoryview], Any], empty: Any) -> Any:
        """The next message loaded with ``loads`` and consumed if it is one whole message
        without buffers (even if ``loads`` raises), else ``empty``: the hot path."""
        got = self._plain(loads, empty, False)
        return got if got is empty else got[0]

    def get_record(self, loads: Callable[[memoryview], Any], empty: Any) -> Any:
        """The next record if it holds whole messages without buffers (one, or a batch),
        loaded with ``loads`` and consumed (even if ``loads`` raises), as (object, messages);
        ``empty`` for anything else, which ``next()`` then handles or reports."""
        return self._plain(loads, empty, True)

    def _plain(self, loads: Callable[[memoryview], Any], empty: Any, batches: bool) -> Any:
        if mark := self._cwords[self._r_evicted]:
            self._evicted(mark)
        tail = self.tail
        if tail == self.head and not self.refresh():
            return empty
        cap = self._cap
        off = tail % cap
        word = self._cq[off >> 3]
        kind, length = word & 0xFF, word >> 8
        if (kind != F.MSG and not (batches and kind == F.MSG | F.BATCH)) or self.assembling:
            return empty
        end = off + F.HEADER_SIZE + length
        if length > cap or end > cap or tail + end - off > self.head:
            return empty  # next() reports the corruption
        messages = 1
        if kind & F.BATCH:
            messages = self._cq[(off >> 3) + 1]
            if not 2 <= messages <= self._max_messages:
                return empty
        try:
            obj = loads(self._cdata[off + F.HEADER_SIZE : end])
        finally:
            self.check_evicted()
            self.tail += record_size(length)
            self.count += messages
            self.taken += messages
            self.taken_bytes += length
            self.publish()
        return obj, messages

    def spin(self, seconds: float) -> bool:
        """Watch the ring up to ``seconds``: True as soon as something is published past the
        tail or the writer closed."""
        if self.tail != self.head:
            return True
        w, tail = self._cwords, self.tail
        deadline = time.monotonic() + seconds
        while w[self._w_head] == tail and not w[self._w_closed]:
            if time.monotonic() >= deadline:
                return False
        self.available()
        return True

    def publish(self) -> None:
        """Store the tail; wake the writer if this step crossed the point it sleeps for.

        Waking on the crossing only (not on every read) means a writer stuck on the
        slowest reader is not woken by the fast ones over and over.
        """
        w = self._cwords
        # A leased message keeps its record: the writer may not reuse it until released.
        tail, count = self.pins[0] if self.pins else (self.tail, self.count)
        w[self._r_count] = count
        w[self._r_tail] = tail
        fence()
        if w[self._w_sleep]:
            acquire()
            want_pos, want_count = w[self._w_want_pos], w[self._w_want_count]
            if (
                tail >= want_pos
                and count >= want_count
                and not (self.shown_tail >= want_pos and self.shown_count >= want_count)
            ):
                self.wakeups += 1
                _notify(self._wake_writer, self._eventfd)
        self.shown_tail, self.shown_count = tail, count

    def prepare_sleep(self) -> bool:
        """Announce that this reader is about to sleep; False if data or the end arrived."""
        w = self._cwords
        self.episode += 2
        w[self._r_sleep] = self.episode
        fence()
        if self.available() or w[self._w_closed]:
            w[self._r_sleep] = 0
            return False
        return True

    def end_sleep(self) -> None:
        """The reader is awake."""
        self._cwords[self._r_sleep] = 0

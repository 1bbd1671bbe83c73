"""The ring's per-message work in pure Python: the reference its compiled twin mirrors.

``_ringcore_c.c`` implements the same two classes with the same constructor, methods,
attributes and byte layout; ``_switch`` picks one.  Everything rarer (fragments, sleeping
writers, slots, relays) lives in ``_ring``'s subclasses and runs on either.
"""

from __future__ import annotations

import mmap
import pickle
import struct
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

from ..base.errors import CorruptedError
from ..memory.notify import Notifier
from . import format as L
from .atomics import acquire, fence, release
from .format import record_size
from .gate import WAITED_FOR, Gate

_NDARRAY = "numpy.ndarray"
_OWN_PICKLE_MAX = 64 << 10  # a larger pickle: a new Pickler next time (as _ringcore_c.c)
_TABLE_ONE = struct.Struct("<3Q")  # a single buffer's table: 1, main's length, its length


def _type_name(obj: object) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def check_record(tail: int, head: int, cap: int, word: int) -> tuple[int, int, int]:
    """The kind, length and end offset of the record whose header ``word`` lies at position
    ``tail``; CorruptedError if it claims bytes past the end of the ring or past ``head``."""
    off = tail % cap
    kind, length = word & 0xFF, word >> 8
    end = off + L.HEADER_SIZE + length
    if end > cap or tail + end - off > head:
        raise CorruptedError(
            f"record at position {tail} (kind {kind}) claims {length} bytes, "
            f"past the {'end of the ring' if end > cap else 'head ' + str(head)}"
        )
    return kind, length, end


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
    """The writer's per-message work: write a plain record, publish, wake sleeping readers."""

    def __init__(
        self,
        mapping: mmap.mmap | bytearray,
        data_offset: int,
        capacity: int,
        max_messages: int,
        readers: int,
        wake: Sequence[Notifier],
    ) -> None:
        self._map(mapping, data_offset, capacity)
        self._w_head = L.writer_word_index(L.W_HEAD)
        self._w_count = L.writer_word_index(L.W_HEAD_COUNT)
        self._r_sleep = [L.reader_word_index(i, L.R_SLEEP) for i in range(readers)]
        self._r_tail = [L.reader_word_index(i, L.R_TAIL) for i in range(readers)]
        self._r_count = [L.reader_word_index(i, L.R_TAIL_COUNT) for i in range(readers)]
        self._cap = capacity
        self._max_messages = max_messages
        self._wake = list(wake)
        self._signalled = [0] * readers
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
        # put_object writes arrays with (the compiled core's ``arrays`` member).
        self.arrays: Any = None
        self._pickler: pickle.Pickler | None = None  # _own_dumps's, with its output
        self._pieces: list[Any] = []
        # The slots to wait for; without one, a subclass's refresh_limits says.
        self.gate: Gate | None = None

    def refresh_limits(self) -> tuple[int, int]:
        """Re-read the tails of the readers the gate waits for, under its lock, and set the
        limits from the slowest: returns (min tail, min count)."""
        gate = self.gate
        if gate is None:
            raise NotImplementedError("refresh_limits needs a gate, or a subclass's own")
        words = self._cwords
        with gate.lock:
            # From the published head, not the cursor: a reader attaching now starts there.
            lo_pos, lo_count = self.head, self.head_count
            for i, state in enumerate(gate.states):
                if state in WAITED_FOR:
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
        in the record's way at the start (``_layout`` says why).  Whether anything unread is
        in the way is read afresh at most once per that many bytes.
        """
        cap = self._cap
        pos = self.pos
        off = pos % cap
        at = max(cap // 4, L.REWIND_AT)
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

    def _claim(self, size: int, count: int) -> int:
        """The data-area offset of room for a record of ``size`` bytes holding ``count``
        messages at the cursor (its PAD written if it goes back to the start), or -1: no
        room now (``need_*`` set), or too big."""
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
            self._cq[off >> 3] = ((cap - off - L.HEADER_SIZE) << 8) | L.PAD
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

    def put_plain(self, main: Any, kind: int = L.MSG, count: int = 1) -> bool:
        """Write and publish one record without buffers if there is room now: the hot path."""
        n = len(main) if not isinstance(main, memoryview) else main.nbytes
        size = record_size(n)
        off = self._claim(size, count)
        if off < 0:
            return False
        i = off >> 3
        q = self._cq
        q[i] = (n << 8) | kind
        q[i + 1] = count if count > 1 else 0
        start = off + L.HEADER_SIZE
        self._cdata[start : start + n] = main
        return self._commit(size, n, count)

    def put_buffer(self, main: Any, buffer: Any) -> bool:
        """Write and publish one message with one out-of-band buffer if there is room now,
        laid out as ``_ring.Frame`` lays out a single buffer."""
        main_view, buf = memoryview(main).cast("B"), memoryview(buffer).cast("B")
        main_len, buf_len = main_view.nbytes, buf.nbytes
        at = (24 + main_len + L.RECORD_ALIGN - 1) & -L.RECORD_ALIGN
        n = at + buf_len
        size = record_size(n)
        off = self._claim(size, 1)
        if off < 0:
            return False
        i = off >> 3
        q = self._cq
        q[i] = (n << 8) | L.MSG | L.OOB
        q[i + 1] = 0
        start = off + L.HEADER_SIZE
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
        if _type_name(obj) == _NDARRAY:
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
        if self.put_plain(main, L.MSG | L.BATCH if count > 1 else L.MSG, count):
            return None
        return main, []

    def _own_dumps(self, obj: Any) -> bytes:
        """``pickle.dumps(obj, protocol=5, buffer_callback=self._found.append)`` through a
        Pickler kept between calls (see ``_ringcore_c.c``, before ``own_pickler``, for why
        and for the one way its pickles differ from ``pickle.dumps``'s)."""
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
        if type(arrays) is not dict or type(arr).__base__ is not object:
            return ()
        dtype = arr.dtype
        if dtype.isbuiltin != 1:  # its pickle says more than the cached one
            return ()
        main = arrays.get((dtype, arr.shape))
        if type(main) is not bytes or not arr.flags.c_contiguous:
            return ()
        return None if self.put_buffer(main, pickle.PickleBuffer(arr).raw()) else ()

    def publish(self) -> None:
        if self.pos == self.head:
            return
        release()
        w = self._cwords
        w[self._w_count] = self.count
        w[self._w_head] = self.pos
        self.head, self.head_count = self.pos, self.count
        self.publishes += 1
        fence()
        self._wake_readers()

    def _wake_readers(self) -> None:
        w = self._cwords
        for i, idx in enumerate(self._r_sleep):
            s = w[idx]
            if s and s != self._signalled[i]:
                self._signalled[i] = s
                self._wake[i].signal()
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
        wake_writer: Notifier,
    ) -> None:
        if not 0 <= index < readers:
            raise ValueError(f"reader {index} of a ring with {readers} slots")
        self._map(mapping, data_offset, capacity)
        self._cap = capacity
        self._max_messages = max_messages
        self._w_head = L.writer_word_index(L.W_HEAD)
        self._w_closed = L.writer_word_index(L.W_CLOSED)
        self._w_sleep = L.writer_word_index(L.W_SLEEP)
        self._w_want_pos = L.writer_word_index(L.W_WANT_POS)
        self._w_want_count = L.writer_word_index(L.W_WANT_COUNT)
        self._r_tail = L.reader_word_index(index, L.R_TAIL)
        self._r_count = L.reader_word_index(index, L.R_TAIL_COUNT)
        self._r_sleep = L.reader_word_index(index, L.R_SLEEP)
        self._r_evicted = L.reader_word_index(index, L.R_EVICTED)
        self._wake_writer = wake_writer
        self.index = index
        self.tail = self._cwords[self._r_tail]
        self.count = self._cwords[self._r_count]
        self.head = self.tail
        self.shown_tail, self.shown_count = self.tail, self.count
        self.wakeups = 0
        self.messages = 1  # how many messages the record next() returned holds
        self.taken = 0  # messages and payload bytes taken through the plain path
        self.taken_bytes = 0
        self.episode = 0
        self.pins: list[tuple[int, int]] = []  # records of leased messages, oldest first
        self.partial: bytearray | None = None  # a fragmented message being reassembled
        self.skipping = False  # joined in the middle of a fragmented message

    def _fragment(self, off: int, base: int, kind: int, length: int) -> memoryview | None:
        raise NotImplementedError

    def _evicted(self, mark: int) -> None:
        """Raise ReaderEvicted (the writer stored ``mark`` in this reader's line)."""
        raise NotImplementedError

    partial_kind: int

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
        return self.tail != self.head or self.refresh()

    def refresh(self) -> bool:
        """Load the published head; True if there is something past this reader's tail."""
        self.head = head = self._cwords[self._w_head]
        acquire()
        if (head | self.tail) % L.RECORD_ALIGN:
            self.head = self.tail
            raise CorruptedError(
                f"head {head} or reader {self.index}'s tail {self.tail} is not a record "
                f"boundary (a multiple of {L.RECORD_ALIGN})"
            )
        if not 0 <= head - self.tail <= self._cap:
            # The writer never runs more than a ring ahead of a reader it waits for.
            self.head = self.tail
            raise CorruptedError(
                f"head {head} is {'behind' if head < self.tail else 'more than a ring ahead of'} "
                f"reader {self.index}'s tail {self.tail}"
            )
        return self.tail != head

    def next(self) -> tuple[memoryview, int, int] | None:
        """The next whole message as (payload, kind, ring bytes), not consumed; None if none.

        Fragments are reassembled as they arrive (consuming their records, so the writer can
        stream a message larger than the ring); the message they form takes 0 ring bytes.
        """
        cap, q, w = self._cap, self._cq, self._cwords
        while self.tail != self.head or self.available():
            if w[self._r_evicted]:
                self._evicted(w[self._r_evicted])
            off = self.tail % cap
            kind, length, end = check_record(self.tail, self.head, cap, q[off >> 3])
            base = kind & L.KIND_MASK
            if base == L.MSG:
                if self.partial is not None or self.skipping:
                    self.partial, self.skipping = None, False  # the writer gave that one up
                if kind & L.BATCH:
                    n = q[(off >> 3) + 1]
                    if not 2 <= n <= self._max_messages:
                        raise CorruptedError(
                            f"batch at position {self.tail} claims {n} messages "
                            f"(max_messages={self._max_messages})"
                        )
                    self.messages = n
                else:
                    self.messages = 1
                return self._cdata[off + L.HEADER_SIZE : end], kind, record_size(length)
            if base == L.PAD:
                if end != cap:
                    raise CorruptedError(
                        f"padding at position {self.tail} of {length} bytes stops short of the end"
                    )
                self.tail += cap - off
            elif base in (L.FIRST, L.MIDDLE, L.LAST):
                whole = self._fragment(off, base, kind, length)
                if whole is not None:
                    return whole, self.partial_kind, 0
            else:
                raise CorruptedError(f"unknown record kind {kind} at position {self.tail}")
        return None

    def take_plain(self) -> memoryview | None:
        """The next record's payload if it is one whole message without buffers: the hot
        path.  None for anything else (or nothing), which ``next()`` then handles."""
        if mark := self._cwords[self._r_evicted]:
            self._evicted(mark)
        tail = self.tail
        if tail == self.head and not self.refresh():
            return None
        cap = self._cap
        off = tail % cap
        word = self._cq[off >> 3]
        if word & 0xFF != L.MSG or self.partial is not None or self.skipping:
            return None
        end = off + L.HEADER_SIZE + (word >> 8)
        if end > cap or tail + end - off > self.head:
            return None  # next() reports the corruption
        return self._cdata[off + L.HEADER_SIZE : end]

    def consume_plain(self, payload: memoryview) -> None:
        """Step past the record ``take_plain`` returned and publish the new tail (unless the
        reader was evicted meanwhile: then what it read may be torn, and it raises)."""
        self.check_evicted()
        n = len(payload)
        self.tail += record_size(n)
        self.count += 1
        self.taken += 1
        self.taken_bytes += n
        self.publish()

    def get_plain(self, loads: Callable[[memoryview], Any], empty: Any) -> Any:
        """The next message loaded with ``loads`` and consumed if it is a plain one (even if
        ``loads`` raises), else ``empty``."""
        view = self.take_plain()
        if view is None:
            return empty
        try:
            return loads(view)
        finally:
            self.consume_plain(view)

    def get_record(self, loads: Callable[[memoryview], Any], empty: Any) -> Any:
        """The next record if it holds whole messages without buffers (one, or a batch),
        loaded with ``loads`` and consumed (even if ``loads`` raises), as (object, messages);
        ``empty`` for anything else, which ``next()`` then handles or reports."""
        if mark := self._cwords[self._r_evicted]:
            self._evicted(mark)
        tail = self.tail
        if tail == self.head and not self.refresh():
            return empty
        cap = self._cap
        off = tail % cap
        word = self._cq[off >> 3]
        kind, length = word & 0xFF, word >> 8
        if kind not in (L.MSG, L.MSG | L.BATCH) or self.partial is not None or self.skipping:
            return empty
        end = off + L.HEADER_SIZE + length
        if end > cap or tail + end - off > self.head:
            return empty
        messages = 1
        if kind & L.BATCH:
            messages = self._cq[(off >> 3) + 1]
            if not 2 <= messages <= self._max_messages:
                return empty
        try:
            obj = loads(self._cdata[off + L.HEADER_SIZE : end])
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
                self._wake_writer.signal()
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
        self._cwords[self._r_sleep] = 0

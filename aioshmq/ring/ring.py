"""The variable-length broadcast ring: records, gating by the slowest reader, sleep/wake flags.

Positions are monotonically increasing u64 byte counts; a record lives at ``pos % capacity``
and never wraps: one that would cross the end is preceded by a PAD record up to the end.
Every record is 16-byte aligned and starts with a 16-byte header, so out-of-band buffers
land 16-byte aligned in memory.  Nothing here blocks or touches an event loop.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

from ..base.errors import CorruptedError, ReaderEvicted, busy
from ..memory.notify import Notifier
from ..memory.segment import Segment
from ..serialize.pickling import Buffer
from . import format as L
from . import switch as _switch
from .atomics import acquire, fence, release
from .format import Layout, record_size
from .gate import ATTACHED, DEAD, DETACHED, EVICTED, WAITED_FOR, Gate
from .pure import ReaderCore, WriterCore, check_record

if _switch.COMPILED:
    from .compiled import ReaderCore, WriterCore

_U64 = struct.Struct("<Q")
_TABLE_HEAD = struct.Struct("<QQ")
_TABLE_ONE = struct.Struct("<3Q")


def _episode() -> int:
    """A fresh nonzero sleep-episode id, unique across processes and slot reuse."""
    return int.from_bytes(os.urandom(7), "little") | 1


class Frame:
    """One serialized message laid out as a record payload.

    Without out-of-band buffers the payload is the main bytes.  With them it is a table
    (``n``, main length, each buffer's length as u64), the main bytes, then each buffer at a
    16-byte-aligned offset.
    """

    __slots__ = ("aux", "count", "hole", "kind", "length", "parts")

    def __init__(self, main: Buffer, buffers: Sequence[memoryview], count: int = 1) -> None:
        # A batch (count > 1) is one serialized list of ``count`` messages.
        self.count = count
        self.hole = 0  # where a reserved message's unwritten bytes start (see ``reserved``)
        self.aux = count if count > 1 else 0
        batch = L.BATCH if count > 1 else 0
        if not buffers:
            self.kind = L.MSG | batch
            self.length = len(main) if not isinstance(main, memoryview) else main.nbytes
            self.parts: list[tuple[int, Buffer]] = [(0, main)]
            return
        main_len = main.nbytes if isinstance(main, memoryview) else len(main)
        if len(buffers) == 1:  # the usual case (one array), spared the general packing
            buf = buffers[0]
            offset = (24 + main_len + 15) & -16
            parts: list[tuple[int, Buffer]] = [
                (0, _TABLE_ONE.pack(1, main_len, buf.nbytes)),
                (24, main),
                (offset, buf),
            ]
            offset += buf.nbytes
        else:
            table = struct.pack(
                f"<{len(buffers) + 2}Q", len(buffers), main_len, *(b.nbytes for b in buffers)
            )
            offset = len(table)
            parts = [(0, table), (offset, main)]
            offset += main_len
            for b in buffers:
                offset = L.align(offset, L.RECORD_ALIGN)
                parts.append((offset, b))
                offset += b.nbytes
        self.kind = L.MSG | L.OOB | batch
        self.length = offset
        self.parts = parts

    @classmethod
    def reserved(cls, main: Buffer | None, nbytes: int) -> Frame:
        """A message whose last ``nbytes`` are left unwritten, to be filled in place: with
        ``main``, its one out-of-band buffer; without, its whole payload.  ``hole`` is
        where they start in the payload (16-byte aligned, like every buffer)."""
        if main is None:
            frame = cls(b"", [])
            frame.parts = []
            frame.length = nbytes
            return frame
        main_len = main.nbytes if isinstance(main, memoryview) else len(main)
        frame = cls(main, [memoryview(b"")])
        frame.parts.pop()  # the buffer's bytes are the caller's to write
        frame.parts[0] = (0, _TABLE_ONE.pack(1, main_len, nbytes))
        frame.hole = frame.length
        frame.length += nbytes
        return frame

    def copy_into(self, dst: memoryview, start: int = 0) -> None:
        """Copy payload bytes [start, start + len(dst)) into ``dst``."""
        end = start + len(dst)
        for offset, part in self.parts:
            n = part.nbytes if isinstance(part, memoryview) else len(part)
            lo, hi = max(offset, start), min(offset + n, end)
            if lo < hi:
                if lo == offset and hi == offset + n:
                    dst[lo - start : hi - start] = part
                else:
                    dst[lo - start : hi - start] = memoryview(part)[lo - offset : hi - offset]


def decode(payload: memoryview, kind: int) -> tuple[memoryview, list[memoryview]]:
    """The main bytes and the out-of-band buffers of a whole message payload."""
    if not kind & L.OOB:
        return payload, []
    size = len(payload)
    if size < 16:
        raise CorruptedError(f"message of {size} bytes is too short for its buffer table")
    n, main_len = _TABLE_HEAD.unpack_from(payload, 0)
    if n > (size - 16) // 8:
        raise CorruptedError(f"buffer table claims {n} buffers in a {size}-byte message")
    lengths = struct.unpack_from(f"<{n}Q", payload, 16)
    offset = 16 + 8 * n
    end = offset + main_len
    if end > size:
        raise CorruptedError(f"main part of {main_len} bytes overruns a {size}-byte message")
    main = payload[offset:end]
    buffers = []
    for length in lengths:
        offset = L.align(end, L.RECORD_ALIGN)
        end = offset + length
        if end > size:
            raise CorruptedError(f"buffer of {length} bytes overruns a {size}-byte message")
        buffers.append(payload[offset:end])
    return main, buffers


class RingWriter(WriterCore):
    """The writer's side: reserve space, write records, publish, and wake sleeping readers.

    The per-message work is the core's (compiled or pure, see ``_switch``).
    """

    def __init__(self, seg: Segment, layout: Layout, gate: Gate, wake: list[Notifier]) -> None:
        super().__init__(
            seg.mapping,
            layout.data_offset,
            layout.capacity,
            layout.max_messages,
            layout.readers,
            wake,
        )
        seg.track(self)  # the core lets go of the memory before the segment unmaps it
        self.seg = seg
        self.layout = layout
        self.gate: Gate = gate  # the core reads it in refresh_limits
        self.wake = wake
        self.cap = layout.capacity
        self.data = seg.data
        self.q = seg.data_words()
        self.w = seg.words
        self.w_head = layout.writer_word(L.W_HEAD)
        self.w_count = layout.writer_word(L.W_HEAD_COUNT)
        self.w_sleep = layout.writer_word(L.W_SLEEP)
        self.r_tail = [layout.reader_word(i, L.R_TAIL) for i in range(layout.readers)]
        self.r_count = [layout.reader_word(i, L.R_TAIL_COUNT) for i in range(layout.readers)]
        self.r_sleep = [layout.reader_word(i, L.R_SLEEP) for i in range(layout.readers)]
        self.r_evicted = [layout.reader_word(i, L.R_EVICTED) for i in range(layout.readers)]
        self.episode = _episode()
        self.written_at = 0  # where the payload of the last record try_write wrote starts

    @property
    def need(self) -> tuple[int, int]:
        """(bytes, messages) the last failed write was waiting for."""
        return self.need_span, self.need_count

    @need.setter
    def need(self, value: tuple[int, int]) -> None:
        self.need_span, self.need_count = value

    # -- space -------------------------------------------------------------------------

    def _room(self, need: int, messages: int) -> bool:
        if self.pos + need <= self.limit_pos and self.count + messages <= self.limit_count:
            return True
        self.refresh_limits()
        return self.pos + need <= self.limit_pos and self.count + messages <= self.limit_count

    def _place(self, size: int, span: int) -> int:
        """The offset where a record of ``size`` goes, taking ``span`` bytes at the cursor
        (as ``span()`` said): after a PAD up to the end, written here, if it is more."""
        off = self.pos % self.cap
        if span != size:
            self.q[off >> 3] = ((self.cap - off - L.HEADER_SIZE) << 8) | L.PAD
            self.pos += self.cap - off
            off = 0
        return off

    def try_write(self, frame: Frame) -> bool:
        """Write a whole-record message unpublished, if there is room for it now."""
        size = record_size(frame.length)
        span = self.span(size)
        if not self._room(span, frame.count):
            self.need = (span, frame.count)
            return False
        off = self._place(size, span)
        i = off >> 3
        self.q[i] = (frame.length << 8) | frame.kind
        self.q[i + 1] = frame.aux
        start = self.written_at = off + L.HEADER_SIZE
        data = self.data
        for offset, part in frame.parts:
            at = start + offset
            data[at : at + len(part)] = part
        self.pos += size
        self.count += frame.count
        return True

    def try_write_fragment(self, frame: Frame, done: int) -> int:
        """Write the next fragment of a message too big for one record; bytes now written."""
        chunk = min(self.layout.fragment_payload, frame.length - done)
        size = record_size(chunk)
        last = done + chunk == frame.length
        span = self.span(size)
        if not self._room(span, 1 if last else 0):
            self.need = (span, 1 if last else 0)
            return done
        if done == 0:
            kind, aux = L.FIRST | (frame.kind & L.OOB), frame.length
        else:
            kind, aux = (L.LAST if last else L.MIDDLE), 0
        off = self._place(size, span)
        self.q[off >> 3] = (chunk << 8) | kind
        self.q[(off >> 3) + 1] = aux
        start = off + L.HEADER_SIZE
        frame.copy_into(self.data[start : start + chunk], done)
        self.pos += size
        if last:
            self.count += 1
        return done + chunk

    def fits_whole(self, frame: Frame) -> bool:
        return record_size(frame.length) <= self.max_record

    def rollback(self, pos: int, count: int) -> None:
        """Forget records written since (pos, count) but not published."""
        self.pos, self.count = pos, count

    def close(self, broken: bool = False) -> None:
        """Mark the stream ended after what was published, and wake every sleeper.

        Records written but not published belong to a put that is still waiting (an atomic
        batch): they are dropped, as that put now fails.  ``broken`` says the stream did
        not end but was cut off upstream (readers get PeerDied after the last message).
        """
        self.rollback(self.head, self.head_count)
        self.w[self.layout.writer_word(L.W_CLOSED)] = L.CLOSED_BROKEN if broken else L.CLOSED_END
        fence()
        self._wake_readers()

    # -- sleeping ----------------------------------------------------------------------

    def want(self, need: int, messages: int) -> tuple[int, int]:
        """The tail position and count that would let ``need`` bytes and ``messages`` in.

        Asks for a quarter of the ring beyond the bare need where possible, so a full
        writer is woken once per batch of reads, not once per read.
        """
        cap, most = self.cap, self.layout.max_messages
        want_pos = min(self.head, self.pos + need - cap + cap // 4)
        want_count = min(self.head_count, self.count + messages - most + most // 4)
        return max(want_pos, 0), max(want_count, 0)

    def prepare_sleep(self, need: int, messages: int) -> bool:
        """Announce that the writer is about to sleep; False if room appeared meanwhile."""
        w = self.w
        want_pos, want_count = self.want(need, messages)
        w[self.layout.writer_word(L.W_WANT_POS)] = want_pos
        w[self.layout.writer_word(L.W_WANT_COUNT)] = want_count
        release()
        self.episode += 2
        w[self.w_sleep] = self.episode
        fence()
        if self._room(need, messages):
            w[self.w_sleep] = 0
            return False
        return True

    def end_sleep(self) -> None:
        self.w[self.w_sleep] = 0

    # -- slots (called by the broker thread) ----------------------------------------------

    def attach(self, index: int) -> int:
        """Hand slot ``index`` to a new reader, which starts at the head unless the slot was
        never attached; returns the slot's state before."""
        w = self.w
        with self.gate.lock:
            prior = self.gate.states[index]
            if prior in (DETACHED, DEAD, EVICTED):
                w[self.r_tail[index]] = w[self.w_head]
                w[self.r_count[index]] = w[self.w_count]
            w[self.r_sleep[index]] = 0
            w[self.r_evicted[index]] = 0
            self.gate.states[index] = ATTACHED
        return prior

    def restore(self, index: int, prior: int) -> None:
        """Undo ``attach`` for a reader that failed before it read anything: the slot goes
        back to ``prior`` (a PENDING slot keeps every message; its tail never moved)."""
        with self.gate.lock:
            self.gate.states[index] = prior
            self.w[self.r_sleep[index]] = 0

    def leave(self, index: int, dead: bool) -> int:
        """Slot ``index``'s reader went away (cleanly or not): the slot becomes DETACHED, or
        DEAD for a death the writer is to notice, unless the writer had already evicted it.
        Returns the state it had."""
        with self.gate.lock:
            prior = self.gate.states[index]
            self.gate.states[index] = DEAD if dead and prior != EVICTED else DETACHED
            self.w[self.r_sleep[index]] = 0
        return prior

    def blockers(self) -> list[tuple[int, int, int]]:
        """(slot, tail, count) of each live reader that holds back the write the writer
        waits to make (``need``)."""
        w = self.w
        pos = self.pos + self.need_span - self.cap
        count = self.count + self.need_count - self.layout.max_messages
        found = []
        with self.gate.lock:
            for i, state in enumerate(self.gate.states):
                if state == ATTACHED:
                    t, c = w[self.r_tail[i]], w[self.r_count[i]]
                    if t < pos or c < count:
                        found.append((i, t, c))
        return found

    def evict(self, index: int, tail: int, count: int, timeout: float) -> bool:
        """Stop waiting for slot ``index``'s live reader if it is still at (tail, count), and
        tell it so; False if it moved or left meanwhile.

        The mark is stored, then fenced, before the writer can reuse any of the reader's
        records: a reader that finds one of its records overwritten then also finds the
        mark (it loads the mark after the record, behind an acquire fence).
        """
        w = self.w
        with self.gate.lock:
            if (
                self.gate.states[index] != ATTACHED
                or w[self.r_tail[index]] != tail
                or w[self.r_count[index]] != count
            ):
                return False
            w[self.r_evicted[index]] = max(1, round(timeout * 1000))
            self.gate.states[index] = EVICTED
        fence()
        self.wake[index].signal()  # should it be asleep, it wakes to find out
        return True

    def drop(self, index: int) -> None:
        """Stop waiting for slot ``index`` unless a live reader holds it (checked and done
        under the gate lock, so a reader attaching meanwhile is never dropped)."""
        with self.gate.lock:
            if self.gate.states[index] == ATTACHED:
                raise busy(f"reader slot {index} is held by a live reader: it cannot be dropped")
            self.gate.states[index] = DETACHED
            self.w[self.r_sleep[index]] = 0

    def write_records(self, run: memoryview, records: Sequence[tuple[int, int, int]]) -> int:
        """Copy whole records (header and payload, as another ring of the same capacity
        laid them out) from ``run`` and publish them; returns how many fitted now.

        ``records`` holds each record's (offset in ``run``, ring bytes, messages it ends),
        in order and back to back.  Records that land side by side are copied at once.
        """
        done = 0
        data = self.data
        src = dst = length = 0  # the pending copy
        for start, size, messages in records:
            pos = self.pos
            span = self.span(size)
            if (pos + span > self.limit_pos or self.count + messages > self.limit_count) and not (
                self._room(span, messages)
            ):
                self.need = (span, messages)
                break
            if span != size or not length:
                if length:
                    data[dst : dst + length] = run[src : src + length]
                off = self._place(size, span)
                src, dst, length = start, off, 0
            length += size
            self.pos += size
            self.count += messages
            done += 1
        if length:
            data[dst : dst + length] = run[src : src + length]
        self.publish()
        return done

    def lags(self) -> list[tuple[int, int, int, int, int]]:
        """(slot, state, pid, messages, bytes) for each reader the writer waits for: how far
        behind the head it is, the furthest behind first.  For logs and views, not puts."""
        w, layout = self.w, self.layout
        found = []
        with self.gate.lock:
            for i, state in enumerate(self.gate.states):
                if state in WAITED_FOR:
                    pid = w[layout.reader_word(i, L.R_PID)]
                    behind = self.head_count - min(w[self.r_count[i]], self.head_count)
                    gap = self.head - min(w[self.r_tail[i]], self.head)
                    found.append((i, state, pid, behind, gap))
        found.sort(key=lambda lag: (-lag[4], -lag[3], lag[0]))
        return found

    def backlog(self) -> tuple[int, int]:
        """Messages and bytes published but not yet read by the slowest counted reader."""
        lo_pos, lo_count = self.refresh_limits()
        return self.head_count - min(lo_count, self.head_count), self.head - min(lo_pos, self.head)


class RingReader(ReaderCore):
    """Reader ``index``'s side: read records in order, publish its tail, wake the writer.

    The per-message work is the core's (compiled or pure, see ``_switch``).
    """

    def __init__(
        self, seg: Segment, layout: Layout, index: int, wake_writer: Notifier, name: str = ""
    ) -> None:
        seg.words[layout.reader_word(index, L.R_PID)] = os.getpid()  # for a reader of the ring
        super().__init__(
            seg.mapping,
            layout.data_offset,
            layout.capacity,
            layout.max_messages,
            layout.readers,
            index,
            wake_writer,
        )
        seg.track(self)  # the core lets go of the memory before the segment unmaps it
        self.seg = seg
        self.layout = layout
        self.cap = layout.capacity
        self.data = seg.data
        self.q = seg.data_words()
        self.w = seg.words
        self.w_head = layout.writer_word(L.W_HEAD)
        self.w_closed = layout.writer_word(L.W_CLOSED)
        self.r_tail = layout.reader_word(index, L.R_TAIL)
        self.r_count = layout.reader_word(index, L.R_TAIL_COUNT)
        self.r_sleep = layout.reader_word(index, L.R_SLEEP)
        self.r_evicted = layout.reader_word(index, L.R_EVICTED)
        self.episode = _episode()
        self.spare: bytearray | None = None  # a finished lease's buffer, reused (no page faults)
        self.partial_kind = 0
        self.partial_len = 0
        self.partial_total = 0
        self.name = name

    def _evicted(self, mark: int) -> None:
        timeout = mark / 1000
        raise ReaderEvicted(
            f"reader {self.index} of ring {self.name!r} was evicted by its writer: it had not "
            f"advanced for {timeout:g} s (the ring's slow_reader_timeout) while a put waited "
            "for it, so the writer stopped keeping messages for it.  Close this reader; a "
            "new connect to the slot starts with the next message put",
            index=self.index,
            timeout=timeout,
        )

    def closed(self) -> bool:
        """True once the writer closed; call only when ``available()`` said False."""
        if not self.w[self.w_closed]:
            return False
        acquire()
        return not self.available()

    def _fragment(self, off: int, base: int, kind: int, length: int) -> memoryview | None:
        start = off + L.HEADER_SIZE
        full = self.layout.fragment_payload
        # Every fragment but the last is exactly full: a scribbled length shows at once.
        if length > full or (base != L.LAST and length != full):
            raise CorruptedError(
                f"fragment at position {self.tail} (kind {kind}) of {length} bytes: "
                f"fragments carry {full} bytes, the last one at most that"
            )
        if base == L.FIRST:
            total = self.q[(off >> 3) + 1]
            if not full < total <= L.MAX_MESSAGE:
                raise CorruptedError(f"fragmented message at {self.tail} claims {total} bytes")
            spare, self.spare = self.spare, None
            if spare is not None and len(spare) == total:
                self.partial = spare
            else:
                # Only as much as the ring holds up front; the rest grows as fragments
                # really arrive, so a scribbled total costs nothing.
                self.partial = bytearray(min(total, self.cap))
            self.partial_total = total
            self.partial_kind = (kind & L.OOB) | L.MSG
            self.partial_len = 0
            self.skipping = False
        elif self.partial is None:
            self.skipping = True  # joined mid-message: drop the rest of it
        partial = self.partial
        if partial is not None:
            end = self.partial_len + length
            if end > self.partial_total:
                raise CorruptedError(
                    f"fragments overrun their message of {self.partial_total} bytes"
                )
            chunk = self.data[start : start + length]
            if end <= len(partial):
                partial[self.partial_len : end] = chunk
            else:
                del partial[self.partial_len :]
                partial += chunk
            self.check_evicted()  # the copy is sound only if this passes
            self.partial_len = end
        self.tail += record_size(length)
        if base != L.LAST:
            return None
        self.count += 1  # a fragmented message is counted when its last fragment is read
        self.partial, self.skipping = None, False
        if partial is None:
            return None
        if self.partial_len != self.partial_total:
            raise CorruptedError(
                f"message of {self.partial_total} bytes ended after {self.partial_len}"
            )
        return memoryview(partial)

    def next_run(self, limit: int) -> tuple[int, int, memoryview] | None:
        """Raw records after the tail that lie back to back in the ring (a PAD or the end of
        the ring ends a run), about ``limit`` bytes of them (one at least): the position
        they follow (before any PAD skipped), the count there, and their bytes.  The tail
        moves past them; the published tail does not (see ``release_to``).  None if
        nothing is published past the tail."""
        cap, q = self.cap, self.q
        if mark := self.w[self.r_evicted]:
            self._evicted(mark)
        skipped = self.tail
        while True:
            if self.tail == self.head and not self.available():
                return None
            off = self.tail % cap
            word = q[off >> 3]
            if word & L.KIND_MASK != L.PAD:
                break
            if off + L.HEADER_SIZE + (word >> 8) != cap:
                raise CorruptedError(f"padding at position {self.tail} stops short of the end")
            self.tail += cap - off
        start, start_count, first = self.tail, self.count, off
        while self.tail != self.head and (self.tail == start or self.tail - start < limit):
            off = self.tail % cap
            if off == 0 and self.tail != start:
                break  # the ring's end: the next record is not contiguous with this run
            kind, length, _end = check_record(self.tail, self.head, cap, q[off >> 3])
            base = kind & L.KIND_MASK
            if base == L.PAD:
                break
            if base == L.MSG:
                n = q[(off >> 3) + 1] if kind & L.BATCH else 1
                if not 1 <= n <= self.layout.max_messages:
                    raise CorruptedError(f"batch at position {self.tail} claims {n} messages")
                self.count += n
            elif base == L.LAST:
                self.count += 1
            elif base not in (L.FIRST, L.MIDDLE):
                raise CorruptedError(f"unknown record kind {kind} at position {self.tail}")
            self.tail += record_size(length)
        return skipped, start_count, self.data[first : first + self.tail - start]

    def rewind(self, pos: int, count: int) -> None:
        """Read again from (pos, count), a record boundary not yet released."""
        self.tail, self.count = pos, count
        self.partial, self.skipping = None, False

    def release_to(self, pos: int, count: int) -> None:
        """Publish (pos, count) as this reader's tail: the writer may reuse what lies before."""
        self.pins[:] = [(pos, count)]
        self.publish()

    def broken(self) -> bool:
        """True if the writer marked the stream cut off upstream rather than ended."""
        return self.w[self.w_closed] == L.CLOSED_BROKEN

    def consume(self, size: int) -> None:
        """Step past the message ``next()`` returned (``size`` is its third item), once it
        was loaded: ReaderEvicted instead if the writer evicted this reader meanwhile."""
        self.check_evicted()
        if size:
            self.tail += size
            self.count += self.messages

    def keep_spare(self, buffer: bytearray) -> None:
        """A finished lease's reassembly buffer: the next fragmented message of its size
        is rebuilt into it (no fresh page faults)."""
        self.spare = buffer

    def published_count(self) -> int:
        """Messages the writer has published so far."""
        return self.w[self.layout.writer_word(L.W_HEAD_COUNT)]

    def pin(self) -> tuple[int, int]:
        """Keep the record ``next()`` returned from being reused until ``unpin``."""
        mark = (self.tail, self.count)
        self.pins.append(mark)
        return mark

    def unpin(self, mark: tuple[int, int]) -> None:
        """Let the writer reuse a leased record; ReaderEvicted if it was evicted before
        (while the lease was held its memory may have been overwritten)."""
        self.pins.remove(mark)
        self.publish()
        self.check_evicted()

"""The variable-length broadcast ring: records, gating by the slowest reader, sleep/wake flags.

Positions are monotonically increasing u64 byte counts; a record lives at ``pos % capacity``
and never wraps: one that would cross the end is preceded by a PAD record up to the end.
Every record is 16-byte aligned and starts with a 16-byte header, so out-of-band buffers
land 16-byte aligned in memory.  The per-message work is a core's (``core.py``); what is
here is written once, over the core's primitives: frames and fragments, the writer's sleep,
reader slots, relays.  Nothing here blocks or touches an event loop.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..base.errors import Busy, CorruptedError
from ..memory.notify import Notifier
from ..memory.segment import Segment
from . import format as F
from .atomics import acquire, fence, release
from .core import Gate, GateAPI, ReaderCore, ReaderCoreAPI, WriterCore, WriterCoreAPI
from .format import record_size
from .layout import Frame, Layout, check_fragment, check_record

__all__ = ["Frame", "RingReader", "RingWriter"]


def _episode() -> int:
    """A fresh nonzero sleep-episode id, unique across processes and slot reuse."""
    return int.from_bytes(os.urandom(7), "little") | 1


class RingWriter:
    """The writer's side: write records, publish, sleep for room, and hand out slots.

    ``core`` does the per-message work (claim, write, publish, wake); ``gate`` holds each
    slot's state, shared with the broker thread that attaches readers.
    """

    def __init__(self, seg: Segment, layout: Layout, wake: list[Notifier]) -> None:
        self.seg = seg
        self.layout = layout
        self.gate: GateAPI = Gate(layout.readers)
        self.core: WriterCoreAPI = WriterCore(
            seg.mapping,
            layout.data_offset,
            layout.capacity,
            layout.max_messages,
            layout.readers,
            [n.write_fd for n in wake],
            all(n.kind == "eventfd" for n in wake),
            self.gate,
        )
        seg.track(self.core)  # the core lets go of the memory before the segment unmaps it
        self.wake = wake
        self.cap = layout.capacity
        self.data = seg.data
        self.q = seg.data_words()
        self.w = seg.words
        self.w_sleep = layout.writer_word(F.W_SLEEP)
        self.r_tail = [layout.reader_word(i, F.R_TAIL) for i in range(layout.readers)]
        self.r_count = [layout.reader_word(i, F.R_TAIL_COUNT) for i in range(layout.readers)]
        self.r_sleep = [layout.reader_word(i, F.R_SLEEP) for i in range(layout.readers)]
        self.r_evicted = [layout.reader_word(i, F.R_EVICTED) for i in range(layout.readers)]
        self.episode = _episode()
        self.written_at = 0  # where the payload of the last record try_write wrote starts

    @property
    def need(self) -> tuple[int, int]:
        """(bytes, messages) the last failed write was waiting for."""
        return self.core.need_span, self.core.need_count

    # -- writing -----------------------------------------------------------------------

    def try_write(self, frame: Frame) -> bool:
        """Write a whole-record message unpublished, if there is room for it now."""
        core = self.core
        size = record_size(frame.length)
        off = core.claim(size, frame.count)
        if off < 0:
            return False
        i = off >> 3
        self.q[i] = (frame.length << 8) | frame.kind
        self.q[i + 1] = frame.aux
        start = self.written_at = off + F.HEADER_SIZE
        data = self.data
        for offset, part in frame.parts:
            at = start + offset
            data[at : at + len(part)] = part
        core.pos += size
        core.count += frame.count
        return True

    def try_write_fragment(self, frame: Frame, done: int) -> int:
        """Write the next fragment of a message too big for one record; bytes now written."""
        chunk = min(self.layout.fragment_payload, frame.length - done)
        size = record_size(chunk)
        last = done + chunk == frame.length
        core = self.core
        off = core.claim(size, 1 if last else 0)
        if off < 0:
            return done
        if done == 0:
            kind, aux = F.FIRST | (frame.kind & F.OOB), frame.length
        else:
            kind, aux = (F.LAST if last else F.MIDDLE), 0
        self.q[off >> 3] = (chunk << 8) | kind
        self.q[(off >> 3) + 1] = aux
        start = off + F.HEADER_SIZE
        frame.copy_into(self.data[start : start + chunk], done)
        core.pos += size
        if last:
            core.count += 1
        return done + chunk

    def fits_whole(self, frame: Frame) -> bool:
        return record_size(frame.length) <= self.core.max_record

    def rollback(self, pos: int, count: int) -> None:
        """Forget records written since (pos, count) but not published."""
        self.core.pos, self.core.count = pos, count

    def rollback_unpublished(self) -> None:
        """Forget every record written but not published."""
        self.rollback(self.core.head, self.core.head_count)

    def close(self, broken: bool = False) -> None:
        """Mark the stream ended after what was published, and wake every sleeper.

        Records written but not published belong to a put that is still waiting (an atomic
        batch): they are dropped, as that put now fails.  ``broken`` says the stream did
        not end but was cut off upstream (readers get PeerDied after the last message).
        """
        self.rollback_unpublished()
        self.w[self.layout.writer_word(F.W_CLOSED)] = F.CLOSED_BROKEN if broken else F.CLOSED_END
        fence()
        self.core.wake_readers()

    def write_records(self, run: memoryview, records: Sequence[tuple[int, int, int]]) -> int:
        """Copy whole records (header and payload, as another ring of the same capacity
        laid them out) from ``run`` and publish them; returns how many fitted now.

        ``records`` holds each record's (offset in ``run``, ring bytes, messages it ends),
        in order and back to back.  Records that land side by side are copied at once.
        """
        core, data = self.core, self.data
        done = 0
        src = dst = length = 0  # the pending copy
        for start, size, messages in records:
            off = core.claim(size, messages)
            if off < 0:
                break
            if length and off == dst + length and start == src + length:
                length += size
            else:
                if length:
                    data[dst : dst + length] = run[src : src + length]
                src, dst, length = start, off, size
            core.pos += size
            core.count += messages
            done += 1
        if length:
            data[dst : dst + length] = run[src : src + length]
        core.publish()
        return done

    # -- sleeping ----------------------------------------------------------------------

    def _room(self, need: int, messages: int) -> bool:
        core = self.core
        if core.pos + need <= core.limit_pos and core.count + messages <= core.limit_count:
            return True
        core.refresh_limits()
        return core.pos + need <= core.limit_pos and core.count + messages <= core.limit_count

    def want(self, need: int, messages: int) -> tuple[int, int]:
        """The tail position and count that would let ``need`` bytes and ``messages`` in.

        Asks for a quarter of the ring beyond the bare need where possible, so a full
        writer is woken once per batch of reads, not once per read.
        """
        core = self.core
        cap, most = self.cap, self.layout.max_messages
        want_pos = min(core.head, core.pos + need - cap + cap // 4)
        want_count = min(core.head_count, core.count + messages - most + most // 4)
        return max(want_pos, 0), max(want_count, 0)

    def prepare_sleep(self, need: int, messages: int) -> bool:
        """Announce that the writer is about to sleep; False if room appeared meanwhile."""
        w = self.w
        want_pos, want_count = self.want(need, messages)
        w[self.layout.writer_word(F.W_WANT_POS)] = want_pos
        w[self.layout.writer_word(F.W_WANT_COUNT)] = want_count
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
        w, gate = self.w, self.gate
        with gate:
            prior = gate.state(index)
            if prior in (F.DETACHED, F.DEAD, F.EVICTED):
                w[self.r_tail[index]] = w[self.layout.writer_word(F.W_HEAD)]
                w[self.r_count[index]] = w[self.layout.writer_word(F.W_HEAD_COUNT)]
            w[self.r_sleep[index]] = 0
            w[self.r_evicted[index]] = 0
            gate.set(index, F.ATTACHED)
        return prior

    def restore(self, index: int, prior: int) -> None:
        """Undo ``attach`` for a reader that failed before it read anything: the slot goes
        back to ``prior`` (a PENDING slot keeps every message; its tail never moved)."""
        with self.gate:
            self.gate.set(index, prior)
            self.w[self.r_sleep[index]] = 0

    def leave(self, index: int, dead: bool) -> int:
        """Slot ``index``'s reader went away (cleanly or not): the slot becomes DETACHED, or
        DEAD for a death the writer is to notice, unless the writer had already evicted it.
        Returns the state it had."""
        gate = self.gate
        with gate:
            prior = gate.state(index)
            gate.set(index, F.DEAD if dead and prior != F.EVICTED else F.DETACHED)
            self.w[self.r_sleep[index]] = 0
        return prior

    def blockers(self) -> list[tuple[int, int, int]]:
        """(slot, tail, count) of each live reader that holds back the write the writer
        waits to make (``need``)."""
        w, core = self.w, self.core
        pos = core.pos + core.need_span - self.cap
        count = core.count + core.need_count - self.layout.max_messages
        found = []
        with self.gate:
            for i, state in enumerate(self.gate.states()):
                if state == F.ATTACHED:
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
        w, gate = self.w, self.gate
        with gate:
            if (
                gate.state(index) != F.ATTACHED
                or w[self.r_tail[index]] != tail
                or w[self.r_count[index]] != count
            ):
                return False
            w[self.r_evicted[index]] = max(1, round(timeout * 1000))
            gate.set(index, F.EVICTED)
        fence()
        self.wake[index].signal()  # should it be asleep, it wakes to find out
        return True

    def drop(self, index: int) -> None:
        """Stop waiting for slot ``index`` unless a live reader holds it (checked and done
        under the gate lock, so a reader attaching meanwhile is never dropped)."""
        with self.gate:
            if self.gate.state(index) == F.ATTACHED:
                raise Busy(f"reader slot {index} is held by a live reader: it cannot be dropped")
            self.gate.set(index, F.DETACHED)
            self.w[self.r_sleep[index]] = 0

    def lags(self) -> list[tuple[int, int, int, int, int]]:
        """(slot, state, pid, messages, bytes) for each reader the writer waits for: how far
        behind the head it is, the furthest behind first.  For logs and views, not puts."""
        w, layout, core = self.w, self.layout, self.core
        found = []
        with self.gate:
            for i, state in enumerate(self.gate.states()):
                if state in F.WAITED_FOR:
                    pid = w[layout.reader_word(i, F.R_PID)]
                    behind = core.head_count - min(w[self.r_count[i]], core.head_count)
                    gap = core.head - min(w[self.r_tail[i]], core.head)
                    found.append((i, state, pid, behind, gap))
        found.sort(key=lambda lag: (-lag[4], -lag[3], lag[0]))
        return found

    def backlog(self) -> tuple[int, int]:
        """Messages and bytes published but not yet read by the slowest counted reader."""
        core = self.core
        lo_pos, lo_count = core.refresh_limits()
        return core.head_count - min(lo_count, core.head_count), core.head - min(lo_pos, core.head)


class RingReader:
    """Reader ``index``'s side: read records in order, put fragments back together, publish
    its tail, wake the writer; ``core`` does the per-message work."""

    def __init__(
        self, seg: Segment, layout: Layout, index: int, wake_writer: Notifier, name: str = ""
    ) -> None:
        seg.words[layout.reader_word(index, F.R_PID)] = os.getpid()  # for a reader of the ring
        self.core: ReaderCoreAPI = ReaderCore(
            seg.mapping,
            layout.data_offset,
            layout.capacity,
            layout.max_messages,
            layout.readers,
            index,
            wake_writer.write_fd,
            wake_writer.kind == "eventfd",
            name,
        )
        seg.track(self.core)  # the core lets go of the memory before the segment unmaps it
        self.seg = seg
        self.layout = layout
        self.index = index
        self.cap = layout.capacity
        self.data = seg.data
        self.q = seg.data_words()
        self.w = seg.words
        self.w_closed = layout.writer_word(F.W_CLOSED)
        self.core.episode = _episode()
        self.spare: bytearray | None = None  # a finished lease's buffer, reused (no page faults)
        self.partial: bytearray | None = None  # a fragmented message being put together
        self.skipping = False  # joined in the middle of a fragmented message: drop the rest
        self.partial_kind = 0
        self.partial_len = 0
        self.partial_total = 0

    def next(self) -> tuple[memoryview, int, int, int] | None:
        """The next whole message as (payload, kind, ring bytes, messages), not consumed;
        None if none is complete yet.

        Fragments are put together as they arrive (consuming their records, so the writer
        can stream a message larger than the ring); the message they form takes 0 ring
        bytes.  A batch record holds ``messages`` messages.
        """
        core = self.core
        while (record := core.next()) is not None:
            payload, kind, size, aux = record
            base = kind & F.KIND_MASK
            if base == F.MSG:
                if core.assembling:  # the writer gave the fragmented message up
                    self._drop_partial()
                return payload, kind, size, aux if kind & F.BATCH else 1
            whole = self._fragment(payload, base, kind, size, aux)
            if whole is not None:
                return whole, self.partial_kind, 0, 1
        return None

    def _drop_partial(self) -> None:
        self.partial, self.skipping = None, False
        self.core.assembling = False

    def _fragment(
        self, chunk: memoryview, base: int, kind: int, size: int, aux: int
    ) -> memoryview | None:
        """Take one fragment record (consumed here); the whole message once its last one
        came, else None."""
        core = self.core
        length = len(chunk)
        full = self.layout.fragment_payload
        check_fragment(base, length, full, f"at position {core.tail}")
        if base == F.FIRST:
            if not full < aux <= F.MAX_MESSAGE:
                raise CorruptedError(f"fragmented message at {core.tail} claims {aux} bytes")
            spare, self.spare = self.spare, None
            if spare is not None and len(spare) == aux:
                self.partial = spare
            else:
                # Only as much as the ring holds up front; the rest grows as fragments
                # really arrive, so a scribbled total costs nothing.
                self.partial = bytearray(min(aux, self.cap))
            self.partial_total = aux
            self.partial_kind = (kind & F.OOB) | F.MSG
            self.partial_len = 0
            self.skipping = False
        elif self.partial is None:
            self.skipping = True  # joined mid-message: drop the rest of it
        core.assembling = True
        partial = self.partial
        if partial is not None:
            end = self.partial_len + length
            if end > self.partial_total:
                raise CorruptedError(
                    f"fragments overrun their message of {self.partial_total} bytes"
                )
            if end <= len(partial):
                partial[self.partial_len : end] = chunk
            else:
                del partial[self.partial_len :]
                partial += chunk
        last = base == F.LAST
        # A fragmented message is counted when its last fragment is read.  The copy above is
        # sound only if consume() finds this reader was not evicted meanwhile.
        core.consume(size, 1 if last else 0)
        if partial is not None:
            self.partial_len += length
        if not last:
            return None
        self._drop_partial()
        if partial is None:
            return None
        if self.partial_len != self.partial_total:
            raise CorruptedError(
                f"message of {self.partial_total} bytes ended after {self.partial_len}"
            )
        return memoryview(partial)

    def consume(self, size: int, messages: int) -> None:
        """Step past the message ``next()`` returned, once it was loaded (``size`` and
        ``messages`` are its third and fourth items; a message put together from fragments
        was consumed already): ReaderEvicted instead if the writer evicted this reader."""
        if size:
            self.core.consume(size, messages)
        else:
            self.core.check_evicted()

    def closed(self) -> bool:
        """True once the writer closed and everything it published was read."""
        if not self.w[self.w_closed]:
            return False
        acquire()
        return not self.core.available()

    def ended(self) -> bool:
        """Whether the writer closed (the stream ended or was cut off), read or not."""
        return bool(self.w[self.w_closed])

    def broken(self) -> bool:
        """True if the writer marked the stream cut off upstream rather than ended."""
        return self.w[self.w_closed] == F.CLOSED_BROKEN

    def published(self) -> tuple[int, int]:
        """The head the writer published, bytes and messages, as the words say now (for
        views: neither checked nor ordered)."""
        w, layout = self.w, self.layout
        return w[layout.writer_word(F.W_HEAD)], w[layout.writer_word(F.W_HEAD_COUNT)]

    def next_run(self, limit: int) -> tuple[int, int, memoryview] | None:
        """Raw records after the tail that lie back to back in the ring (a PAD or the end of
        the ring ends a run), about ``limit`` bytes of them (one at least): the position
        they follow (before any PAD skipped), the count there, and their bytes.  The tail
        moves past them; the published tail does not (see ``release_to``).  None if
        nothing is published past the tail."""
        core, cap, q = self.core, self.cap, self.q
        core.check_evicted()
        skipped = core.tail
        while True:
            if core.tail == core.head and not core.available():
                return None
            off = core.tail % cap
            word = q[off >> 3]
            if word & F.KIND_MASK != F.PAD:
                break
            check_record(core.tail, core.head, cap, word)
            if off + F.HEADER_SIZE + (word >> 8) != cap:
                raise CorruptedError(f"padding at position {core.tail} stops short of the end")
            core.tail += cap - off
        start, first = core.tail, off
        tail, count = core.tail, core.count
        while tail != core.head and (tail == start or tail - start < limit):
            off = tail % cap
            if off == 0 and tail != start:
                break  # the ring's end: the next record is not contiguous with this run
            kind, length = check_record(tail, core.head, cap, q[off >> 3])
            base = kind & F.KIND_MASK
            if base == F.PAD:
                break
            if base == F.MSG:
                n = q[(off >> 3) + 1] if kind & F.BATCH else 1
                if not 1 <= n <= self.layout.max_messages:
                    raise CorruptedError(f"batch at position {tail} claims {n} messages")
                count += n
            elif base == F.LAST:
                count += 1
            tail += record_size(length)
        start_count = core.count
        core.consume(tail - start, count - start_count)
        return skipped, start_count, self.data[first : first + tail - start]

    def rewind(self, pos: int, count: int) -> None:
        """Read again from (pos, count), a record boundary not yet released."""
        self.core.tail, self.core.count = pos, count
        self._drop_partial()

    def release_to(self, pos: int, count: int) -> None:
        """Publish (pos, count) as this reader's tail: the writer may reuse what lies before."""
        self.core.pins[:] = [(pos, count)]
        self.core.publish()

    def keep_spare(self, buffer: bytearray) -> None:
        """A finished lease's reassembly buffer: the next fragmented message of its size
        is rebuilt into it (no fresh page faults)."""
        self.spare = buffer

    def pin(self) -> tuple[int, int]:
        """Keep the record ``next()`` returned from being reused until ``unpin``."""
        mark = (self.core.tail, self.core.count)
        self.core.pins.append(mark)
        return mark

    def unpin(self, mark: tuple[int, int]) -> None:
        """Let the writer reuse a leased record; ReaderEvicted if it was evicted before
        (while the lease was held its memory may have been overwritten)."""
        self.core.pins.remove(mark)
        self.core.publish()
        self.core.check_evicted()

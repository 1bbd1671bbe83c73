"""The byte layout of a ring's shared memory: header, writer line, reader lines, data."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..base.errors import CorruptedError

MAGIC = 0x31514D48534F4941  # b"AIOSHMQ1" read as a little-endian u64
# 2: reader lines carry R_EVICTED (a version-1 reader would not look at it).
# 3: the sleep words moved to the second half of their lines (SLEEP_WORDS).
VERSION = 3

PAGE = 4096
LINE = 128  # two cache lines: keeps adjacent-line prefetch from sharing a counter's line
RECORD_ALIGN = 16
HEADER_SIZE = 16  # per record: u64 (payload_len << 8 | kind), u64 aux

MIN_CAPACITY = 4096
MAX_CAPACITY = 1 << 46
MAX_MESSAGE = 1 << 50  # sanity bound on a fragmented message's claimed size

# Header, fixed at creation and read-only afterwards (byte offsets).
OFF_MAGIC = 0
OFF_VERSION = 8
OFF_CAPACITY = 16
OFF_MAX_MESSAGES = 24
OFF_READERS = 32
OFF_DATA = 40
OFF_WRITER_PID = 48
_HEADER = struct.Struct("<QQQQQQQ")

# A line's counters sit in its first 64 bytes and its sleep words in the second 64 (from
# word SLEEP_WORDS on).  Each side loads the other's sleep word at every publish; kept apart,
# that load hits a line the sleeper alone writes, instead of pulling over, at every message,
# the line whose counters the other side stores at every message.
SLEEP_WORDS = 8

# Writer line: written by the writer process only.
WRITER_LINE = LINE
W_HEAD = 0  # u64 word index within the line: bytes published
W_HEAD_COUNT = 1  # messages published
W_CLOSED = 2  # once the writer closed, stored after the final head: CLOSED_END or CLOSED_BROKEN
CLOSED_END = 1  # the stream ended: readers get EndOfStream after the last message
CLOSED_BROKEN = 2  # its source died (a relay whose upstream was lost): PeerDied instead
W_SLEEP = SLEEP_WORDS  # nonzero episode id while the writer sleeps, else 0
W_WANT_POS = SLEEP_WORDS + 1  # while asleep: wake me once your tail reaches this position
W_WANT_COUNT = SLEEP_WORDS + 2  # ... and your message count reaches this one

# Reader line i at READER_LINES + i * LINE: written by reader i only (and by the writer's
# broker while slot i has no reader, to set where the next reader starts), except R_EVICTED.
READER_LINES = 2 * LINE
R_TAIL = 0  # bytes consumed
R_TAIL_COUNT = 1  # messages consumed
R_SLEEP = SLEEP_WORDS  # nonzero episode id while the reader sleeps, else 0
R_PID = 3  # pid of the reader holding the slot (informational)
# Written by the writer only: nonzero once it evicted the slot's reader for not advancing
# (the slow_reader_timeout, in ms, at least 1), zero again when the slot is handed out.
R_EVICTED = 4

# Record kinds (low 8 bits of a record's first word).
PAD = 1  # filler up to the end of the data area
MSG = 2  # a whole message
FIRST = 3  # first fragment of a message larger than one record
MIDDLE = 4
LAST = 5
OOB = 0x10  # flag on MSG and FIRST: the frame starts with a buffer table
BATCH = 0x20  # flag on MSG: the payload is one serialized list of aux messages
KIND_MASK = 0x0F

# A writer sends a record back to the start of the data area, after a PAD (as it does where
# a record would cross the end), once its cursor is a quarter of the area or this far in,
# whichever is more, and nothing unread is in the record's way at the start.  While readers
# keep up, the bytes in use then stay within that quarter and a record, rather than cycling
# through the whole area: a ring of four large payloads writes each one where the last one
# was, still in cache.  The quarter bounds what the PADs add to positions: at most three
# bytes per byte written (u64 positions last 2**64 / 4 bytes, 14 years at 10 GB/s).  Readers
# need nothing for it: a PAD always runs to the end of the data area.
REWIND_AT = 256 * 1024


def writer_word_index(field: int) -> int:
    """Index of a writer-line field in the segment's u64 view."""
    return WRITER_LINE // 8 + field


def reader_word_index(index: int, field: int) -> int:
    """Index of a field of reader line ``index`` in the segment's u64 view."""
    return (READER_LINES + index * LINE) // 8 + field


def align(n: int, to: int) -> int:
    return (n + to - 1) & ~(to - 1)


def record_size(payload_len: int) -> int:
    """Ring bytes a record of ``payload_len`` payload bytes takes: header, payload, padding."""
    return HEADER_SIZE + ((payload_len + RECORD_ALIGN - 1) & -RECORD_ALIGN)


@dataclass(frozen=True)
class Layout:
    """Where everything lives in one ring's shared memory."""

    capacity: int
    max_messages: int
    readers: int

    @property
    def data_offset(self) -> int:
        return align(READER_LINES + self.readers * LINE, PAGE)

    @property
    def size(self) -> int:
        return self.data_offset + self.capacity

    @property
    def max_record(self) -> int:
        """Largest record written whole; bigger messages are fragmented."""
        return self.capacity // 2

    @property
    def fragment_payload(self) -> int:
        return self.capacity // 4 - HEADER_SIZE

    def reader_word(self, index: int, field: int) -> int:
        """Index of a reader-line field in the segment's u64 view."""
        return reader_word_index(index, field)

    @staticmethod
    def writer_word(field: int) -> int:
        return writer_word_index(field)

    def write_header(self, buf: memoryview, writer_pid: int) -> None:
        _HEADER.pack_into(
            buf,
            0,
            MAGIC,
            VERSION,
            self.capacity,
            self.max_messages,
            self.readers,
            self.data_offset,
            writer_pid,
        )

    @classmethod
    def read_header(cls, buf: memoryview) -> tuple[Layout, int]:
        """The layout stored in a segment, and the writer's pid; checks it is sane."""
        if len(buf) < READER_LINES:
            raise CorruptedError(f"segment of {len(buf)} bytes is too small for a header")
        magic, version, capacity, max_messages, readers, data_offset, pid = _HEADER.unpack_from(
            buf, 0
        )
        if magic != MAGIC:
            raise CorruptedError(f"bad magic {magic:#x}: not an aioshmq ring")
        if version != VERSION:
            raise CorruptedError(f"ring format version {version}, this aioshmq reads {VERSION}")
        layout = cls(capacity, max_messages, readers)
        if (
            not MIN_CAPACITY <= capacity <= MAX_CAPACITY
            or capacity % RECORD_ALIGN
            or max_messages < 1
            or readers < 1
            or data_offset != layout.data_offset
            or layout.size > len(buf)
        ):
            raise CorruptedError(
                f"inconsistent header: capacity={capacity} max_messages={max_messages} "
                f"readers={readers} data_offset={data_offset} segment={len(buf)} bytes"
            )
        return layout, pid

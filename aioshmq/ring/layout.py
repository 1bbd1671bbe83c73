"""Where things lie in a ring, by ``format``: the segment's parts, a record, a message's payload.

``Layout`` places the header, the lines and the data area of one ring and checks a header
before it is trusted.  ``record_kind`` and ``check_record`` read a record header as the pure
core reads it, and every Python reader of records (fragments, relays, the remote wire) goes
through them; the compiled core reads headers by the same rules (``format.KIND_FLAGS``).
``Frame`` lays out one serialized message as a record payload, and ``decode`` takes one apart.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..base.errors import CorruptedError
from . import format as F

_HEADER = struct.Struct("<QQQQQQQ")
_TABLE_HEAD = struct.Struct("<QQ")
_TABLE_ONE = struct.Struct("<3Q")
Buffer = Any  # bytes, bytearray, memoryview or any other buffer


@dataclass(frozen=True)
class Layout:
    """Where everything lives in one ring's shared memory."""

    capacity: int
    max_messages: int
    readers: int

    @property
    def data_offset(self) -> int:
        return F.align(F.READER_LINES + self.readers * F.LINE, F.PAGE)

    @property
    def size(self) -> int:
        return self.data_offset + self.capacity

    @property
    def max_record(self) -> int:
        """Largest record written whole; bigger messages are fragmented."""
        return self.capacity // 2

    @property
    def fragment_payload(self) -> int:
        """Payload bytes of every fragment but the last, which carries at most as many."""
        return self.capacity // 4 - F.HEADER_SIZE

    def reader_word(self, index: int, field: int) -> int:
        """Index of a reader-line field in the segment's u64 view."""
        return F.reader_word_index(index, field)

    @staticmethod
    def writer_word(field: int) -> int:
        return F.writer_word_index(field)

    def write_header(self, buf: memoryview, writer_pid: int) -> None:
        _HEADER.pack_into(
            buf,
            F.OFF_MAGIC,
            F.MAGIC,
            F.VERSION,
            self.capacity,
            self.max_messages,
            self.readers,
            self.data_offset,
            writer_pid,
        )

    @classmethod
    def read_header(cls, buf: memoryview) -> tuple[Layout, int]:
        """The layout stored in a segment, and the writer's pid; checks it is sane."""
        found = cls.parse_header(buf)
        if isinstance(found, str):
            raise CorruptedError(found)
        return found

    @classmethod
    def parse_header(cls, buf: memoryview) -> tuple[Layout, int] | str:
        """``read_header``'s answer, or what is wrong with the header: for a view that only
        looks at rings (``python -m aioshmq stat``), which neither raises nor logs for one."""
        if len(buf) < F.READER_LINES:
            return f"segment of {len(buf)} bytes is too small for a header"
        magic, version, capacity, max_messages, readers, data_offset, pid = _HEADER.unpack_from(
            buf, F.OFF_MAGIC
        )
        if magic != F.MAGIC:
            return f"bad magic {magic:#x}: not an aioshmq ring"
        if version != F.VERSION:
            return f"ring format version {version}, this aioshmq reads {F.VERSION}"
        layout = cls(capacity, max_messages, readers)
        if (
            not F.MIN_CAPACITY <= capacity <= F.MAX_CAPACITY
            or capacity % F.RECORD_ALIGN
            or max_messages < 1
            or not 1 <= readers <= F.MAX_READERS
            or data_offset != layout.data_offset
            or layout.size > len(buf)
        ):
            return (
                f"inconsistent header: capacity={capacity} max_messages={max_messages} "
                f"readers={readers} data_offset={data_offset} segment={len(buf)} bytes"
            )
        return layout, pid


def record_kind(word: int, where: str) -> tuple[int, int]:
    """The kind and payload length in a record's first word; CorruptedError if the kind is
    not one ``format.KIND_FLAGS`` knows (``where`` says where the record lies)."""
    kind = word & 0xFF
    if not F.kind_known(kind):
        raise CorruptedError(f"unknown record kind {kind:#x} {where}")
    return kind, word >> 8


def check_record(pos: int, head: int, cap: int, word: int) -> tuple[int, int]:
    """The kind and payload length of the record whose first word ``word`` lies at ring
    position ``pos``; CorruptedError for an unknown kind, or one that claims bytes past the
    end of the data area or past ``head``."""
    kind, length = record_kind(word, f"at position {pos}")
    off = pos % cap
    end = off + F.HEADER_SIZE + length
    if length > cap or end > cap or pos + end - off > head:
        raise CorruptedError(
            f"record at position {pos} (kind {kind}) claims {length} bytes, "
            f"past the {'end of the ring' if length > cap or end > cap else f'head {head}'}"
        )
    return kind, length


def check_fragment(base: int, length: int, full: int, where: str) -> None:
    """CorruptedError unless a fragment record of ``length`` payload bytes is as long as
    fragments of a ring carrying ``full`` are: every one but the last exactly that."""
    if length > full or (base != F.LAST and length != full):
        raise CorruptedError(
            f"fragment {where} (kind {base}) of {length} bytes: fragments carry {full} bytes, "
            "the last one at most that"
        )


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
        batch = F.BATCH if count > 1 else 0
        if not buffers:
            self.kind = F.MSG | batch
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
                offset = F.align(offset, F.RECORD_ALIGN)
                parts.append((offset, b))
                offset += b.nbytes
        self.kind = F.MSG | F.OOB | batch
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
    if not kind & F.OOB:
        return payload, []
    size = len(payload)
    if size < 16:
        raise CorruptedError(f"message of {size} bytes is too short for its buffer table")
    n, main_len = _TABLE_HEAD.unpack_from(payload, 0)
    if not 1 <= n <= (size - 16) // 8:
        raise CorruptedError(f"buffer table claims {n} buffers in a {size}-byte message")
    lengths = struct.unpack_from(f"<{n}Q", payload, 16)
    offset = 16 + 8 * n
    end = offset + main_len
    if end > size:
        raise CorruptedError(f"main part of {main_len} bytes overruns a {size}-byte message")
    main = payload[offset:end]
    buffers = []
    for length in lengths:
        offset = F.align(end, F.RECORD_ALIGN)
        end = offset + length
        if end > size:
            raise CorruptedError(f"buffer of {length} bytes overruns a {size}-byte message")
        buffers.append(payload[offset:end])
    return main, buffers

"""The byte format of a ring's shared memory, declared once: header, lines, records, states.

Every other statement of the format is made from this module or checked against it: the
compiled core's constants are ``c_header()``, which setup.py writes into ``format.h`` at
build time (and the core reports what it was built with, which a test compares); the record
decoders of both cores follow ``KIND_FLAGS``; ARCHITECTURE.md's layout tables are compared
with it by ``tests/test_layout.py``.  It imports nothing but the standard library, so that
setup.py can run it before anything is installed.

All integers in the shared memory are little-endian u64 words.
"""

from __future__ import annotations

from typing import Final

MAGIC: Final = 0x31514D48534F4941  # b"AIOSHMQ1" read as a little-endian u64
# 2: reader lines carry R_EVICTED (a version-1 reader would not look at it).
# 3: the sleep words moved to the second half of their lines (SLEEP_WORDS).
VERSION: Final = 3

PAGE: Final = 4096
LINE: Final = 128  # two cache lines: keeps adjacent-line prefetch from sharing a counter's line
RECORD_ALIGN: Final = 16
HEADER_SIZE: Final = 16  # per record: u64 (payload_len << 8 | kind), u64 aux

MIN_CAPACITY: Final = 4096
MAX_CAPACITY: Final = 1 << 46
MAX_READERS: Final = 4096
MAX_MESSAGE: Final = 1 << 50  # sanity bound on a fragmented message's claimed size

# -- the header: bytes 0..56 of the segment, written once before any reader can see it ------
OFF_MAGIC: Final = 0
OFF_VERSION: Final = 8
OFF_CAPACITY: Final = 16  # bytes in the data area
OFF_MAX_MESSAGES: Final = 24  # messages the ring may hold for its slowest reader
OFF_READERS: Final = 32  # reader slots
OFF_DATA: Final = 40  # byte offset of the data area
OFF_WRITER_PID: Final = 48

# A line's counters sit in its first 64 bytes and its sleep words in the second 64 (from
# word SLEEP_WORDS on).  Each side loads the other's sleep word at every publish; kept apart,
# that load hits a line the sleeper alone writes, instead of pulling over, at every message,
# the line whose counters the other side stores at every message.
SLEEP_WORDS: Final = 8

# -- the writer line, at byte WRITER_LINE: written by the writer process only ----------------
WRITER_LINE: Final = LINE
W_HEAD: Final = 0  # u64 word index within the line: bytes published
W_HEAD_COUNT: Final = 1  # messages published
W_CLOSED: Final = 2  # once the writer closed, stored after the final head: CLOSED_*
W_SLEEP: Final = SLEEP_WORDS  # nonzero episode id while the writer sleeps, else 0
W_WANT_POS: Final = SLEEP_WORDS + 1  # while asleep: wake me once your tail reaches this
W_WANT_COUNT: Final = SLEEP_WORDS + 2  # ... and your message count reaches this one
CLOSED_END: Final = 1  # the stream ended: readers get EndOfStream after the last message
CLOSED_BROKEN: Final = 2  # its source died (a relay lost its upstream): PeerDied instead

# -- reader line i, at byte READER_LINES + i * LINE: written by reader i only (and by the
# writer's broker while slot i has no reader, to set where the next reader starts), except
# R_EVICTED, which the writer alone writes --------------------------------------------------
READER_LINES: Final = 2 * LINE
R_TAIL: Final = 0  # bytes consumed
R_TAIL_COUNT: Final = 1  # messages consumed
R_PID: Final = 3  # pid of the reader holding the slot (informational)
# Nonzero once the writer evicted the slot's reader for not advancing (the
# slow_reader_timeout, in ms, at least 1); zero again when the slot is handed out.
R_EVICTED: Final = 4
R_SLEEP: Final = SLEEP_WORDS  # nonzero episode id while the reader sleeps, else 0

# -- records: the low 8 bits of a record's first word ---------------------------------------
PAD: Final = 1  # filler up to the end of the data area
MSG: Final = 2  # a whole message
FIRST: Final = 3  # first fragment of a message larger than one record
MIDDLE: Final = 4
LAST: Final = 5
KIND_MASK: Final = 0x0F  # the base kind
OOB: Final = 0x10  # flag: the (first record of the) message starts with a buffer table
BATCH: Final = 0x20  # flag: the payload is one serialized list of ``aux`` messages
# The flags each base kind may carry; a kind outside this table is corruption.
KIND_FLAGS: Final = {PAD: 0, MSG: OOB | BATCH, FIRST: OOB, MIDDLE: 0, LAST: 0}

# A writer sends a record back to the start of the data area, after a PAD (as it does where
# a record would cross the end), once its cursor is a quarter of the area or this far in,
# whichever is more, and nothing unread is in the record's way at the start.  While readers
# keep up, the bytes in use then stay within that quarter and a record, rather than cycling
# through the whole area: a ring of four large payloads writes each one where the last one
# was, still in cache.  The quarter bounds what the PADs add to positions: at most three
# bytes per byte written (u64 positions last 2**64 / 4 bytes, 14 years at 10 GB/s).  Readers
# need nothing for it: a PAD always runs to the end of the data area.
REWIND_AT: Final = 256 * 1024

# -- slot states: the writer process's own record of each reader slot (not in the shared
# memory; the compiled core reads them) -----------------------------------------------------
PENDING: Final = 0  # never attached: keeps every message for the reader to come
ATTACHED: Final = 1
DETACHED: Final = 2  # gave its slot up: not waited for
DEAD: Final = 3  # its process ended without closing: still waited for, so the writer can tell
# Its live reader was evicted (slow_reader_timeout): not waited for, and not handed out again
# until that reader's connection ends.
EVICTED: Final = 4
WAITED_FOR: Final = (PENDING, ATTACHED, DEAD)


def kind_known(kind: int) -> bool:
    """Whether ``kind`` (a record header's low 8 bits) is a base kind with its own flags."""
    flags = KIND_FLAGS.get(kind & KIND_MASK)
    return flags is not None and not kind & ~(KIND_MASK | flags)


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


def constants() -> dict[str, int]:
    """Every integer constant above, by name: what the compiled core is built with."""
    return {
        name: value
        for name, value in globals().items()
        if name.isupper() and isinstance(value, int) and not isinstance(value, bool)
    }


def c_header() -> str:
    """The C header the compiled core includes: every constant, the slot states it waits
    for, and which record kinds are known."""
    lines = [
        "/* Generated from aioshmq/ring/format.py by setup.py: do not edit. */",
        "#ifndef AIOSHMQ_FORMAT_H",
        "#define AIOSHMQ_FORMAT_H",
        "",
    ]
    consts = constants()
    lines += [f"#define {name} {value}ULL" for name, value in consts.items()]
    waited = " || ".join(f"(s) == {state}" for state in WAITED_FOR)
    lines += ["", f"#define WAITED_FOR(s) ({waited})"]
    known = ", ".join("1" if kind_known(kind) else "0" for kind in range(256))
    lines += [
        "",
        "/* KIND_KNOWN[kind]: a base kind with only the flags it may carry (KIND_FLAGS). */",
        f"static const unsigned char KIND_KNOWN[256] = {{{known}}};",
        "",
        "#define FORMAT_CONSTANTS(X) \\",
        *(f"    X({name}) \\" for name in consts),
        "",
        "#endif",
        "",
    ]
    return "\n".join(lines)

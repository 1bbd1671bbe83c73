"""The remote protocol's messages: their tags and layouts, and the checks on what arrives."""

from __future__ import annotations

import json
import struct
from typing import Any

from ..base.errors import CorruptedError
from ..ring import format as L
from ..ring.format import record_size
from ..ring.layout import Layout

VERSION = 2

# Reader -> writer (the first byte of each message).
HELLO = b"H"  # + JSON: {"v", "reader", "heartbeat", "peer"}
ACK = b"A"  # + POS: every record before this position is in the reader's hands
PING = b"P"  # + POS: the reader is there (and acknowledges as ACK does)
RESUME = b"R"  # + POS: records went missing; send again from here
BYE = b"B"  # the reader gives its slot up
META = b"M"  # + JSON: what the reader tells the writer's owner (an rpc worker's reply address)
# Writer -> reader.
WELCOME = b"W"  # + JSON: the ring's bounds and serializer, the writer's pid and host
REFUSE = b"E"  # + JSON: {"error", "message"}
DATA = b"D"  # + RUN: raw records, as the writer's ring holds them
BEAT = b"P"  # + BEAT_: what the writer has sent so far, what it holds acknowledged, and
# whether it waits to hear from the reader (its connection dropped): then it answers at once
END = b"Z"  # + END_: the stream ended (or was cut off upstream) after this position
BYE_OK = b"b"

POS = struct.Struct("<QQ")  # ring byte position, message count
RUN = struct.Struct("<QQQQ")  # start position and count, end position and count
BEAT_ = struct.Struct("<QQQQB")  # sent position and count, acknowledged ones, 1 to answer
END_ = struct.Struct("<QQB")  # position, count, 1 if the stream was cut off upstream
MAX_JSON = 4096
CONTROL_LIMIT = MAX_JSON + 64  # bytes: the largest message a writer takes from a reader
CHUNK = 256 << 10  # bytes of records per data message, unless one record is bigger
_HEADER = struct.Struct("<QQ")


def pack_json(tag: bytes, obj: dict[str, Any]) -> bytes:
    return tag + json.dumps(obj).encode()


def unpack_json(body: bytes) -> dict[str, Any]:
    """The JSON object after a tag; ValueError for anything else."""
    if len(body) > MAX_JSON:
        raise ValueError(f"a control message of {len(body)} bytes (at most {MAX_JSON})")
    try:
        obj = json.loads(body[1:])
    except Exception:  # not JSON, nested too deep, not UTF-8
        raise ValueError(f"malformed control message {body[:60]!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"malformed control message {body[:60]!r}")
    return obj


def data_limit(layout: Layout) -> int:
    """The largest message a reader takes from the writer of a ring of ``layout``: a data
    message's records (a chunk, which may end with a record of the largest size) and a
    margin for its framing."""
    return CHUNK + layout.max_record + 4096


def unpack_beat(body: bytes | memoryview) -> tuple[tuple[int, int], tuple[int, int], bool]:
    """A heartbeat's (sent position, count), (acknowledged position, count), and whether
    the writer asks for an answer."""
    if len(body) != 1 + BEAT_.size:
        raise ValueError(f"a heartbeat of {len(body)} bytes")
    sent_pos, sent_count, acked_pos, acked_count, answer = BEAT_.unpack_from(body, 1)
    return (sent_pos, sent_count), (acked_pos, acked_count), answer != 0


def unpack_pos(body: bytes | memoryview) -> tuple[int, int]:
    if len(body) != 1 + POS.size:
        raise ValueError(f"a position message of {len(body)} bytes")
    pos, count = POS.unpack_from(body, 1)
    return pos, count


def check_run(
    head: bytes, run: memoryview, layout: Layout
) -> tuple[int, int, int, int, memoryview, list[tuple[int, int, int]]]:
    """A DATA message's start and end (position, count), its records (which end at the
    end position) and, for each, its (offset, ring bytes, messages it ends);
    CorruptedError unless every record is one the writer's ring could hold, back to back,
    adding up to the claimed span and count."""
    if len(head) != 1 + RUN.size:
        raise CorruptedError(f"a data message header of {len(head)} bytes")
    pos, count, end_pos, end_count = RUN.unpack_from(head, 1)
    size = len(run)
    # The records lie just before end_pos; the writer's ring may have padding before them.
    if not 0 < size <= end_pos - pos <= layout.capacity:
        raise CorruptedError(f"a data message of {size} bytes claims {pos}..{end_pos}")
    records: list[tuple[int, int, int]] = []
    messages = 0
    off = 0
    most = layout.max_record
    full = layout.fragment_payload
    while off < size:
        if size - off < L.HEADER_SIZE:
            raise CorruptedError(f"a record header cut short at offset {off} of a data message")
        word, aux = _HEADER.unpack_from(run, off)
        kind, length = word & 0xFF, word >> 8
        base = kind & L.KIND_MASK
        n = record_size(length)
        if kind & ~(L.KIND_MASK | L.OOB | L.BATCH):
            raise CorruptedError(f"a record of kind {kind:#x} in a data message")
        if off + n > size:
            raise CorruptedError(f"a record of {length} bytes overruns its data message")
        if base == L.MSG:
            ends = aux if kind & L.BATCH else 1
            if n > most or not 1 <= ends <= layout.max_messages:
                raise CorruptedError(f"a record of {length} bytes ending {ends} messages")
        elif base in (L.FIRST, L.MIDDLE, L.LAST):
            if length > full or (base != L.LAST and length != full):
                raise CorruptedError(f"a fragment of {length} bytes (fragments carry {full})")
            ends = base == L.LAST
        else:
            raise CorruptedError(f"a record of kind {kind} in a data message")
        records.append((off, n, ends))
        messages += ends
        off += n
    if end_count - count != messages:
        claimed = end_count - count
        raise CorruptedError(f"a data message claims {claimed} messages, holds {messages}")
    return pos, count, end_pos, end_count, run, records

"""The shared-memory layout: fixed offsets, and a header that is checked before it is trusted."""

from __future__ import annotations

import pytest

from aioshmq import CorruptedError
from aioshmq import _layout as L
from aioshmq._layout import Layout


def test_offsets() -> None:
    layout = Layout(capacity=1 << 20, max_messages=64, readers=3)
    assert layout.writer_word(L.W_HEAD) * 8 == 128
    assert layout.reader_word(0, L.R_TAIL) * 8 == 256
    assert layout.reader_word(2, L.R_SLEEP) * 8 == 256 + 2 * 128 + 16
    assert layout.data_offset == 4096 and layout.size == 4096 + (1 << 20)
    assert Layout(1 << 20, 64, 40).data_offset == 8192  # 256 + 40 * 128 rounded up to a page


def test_header_round_trip() -> None:
    layout = Layout(capacity=8192, max_messages=10, readers=2)
    buf = memoryview(bytearray(layout.size))
    layout.write_header(buf, writer_pid=1234)
    assert Layout.read_header(buf) == (layout, 1234)


@pytest.mark.parametrize(
    ("offset", "value", "match"),
    [
        (L.OFF_MAGIC, 0xDEAD, "bad magic"),
        (L.OFF_VERSION, 99, "version 99"),
        (L.OFF_CAPACITY, 100, "inconsistent header"),
        (L.OFF_CAPACITY, 1 << 40, "inconsistent header"),
        (L.OFF_MAX_MESSAGES, 0, "inconsistent header"),
        (L.OFF_READERS, 0, "inconsistent header"),
        (L.OFF_DATA, 17, "inconsistent header"),
    ],
)
def test_scribbled_header(offset: int, value: int, match: str) -> None:
    layout = Layout(capacity=8192, max_messages=10, readers=2)
    buf = memoryview(bytearray(layout.size))
    layout.write_header(buf, writer_pid=1)
    buf[offset : offset + 8] = value.to_bytes(8, "little")
    with pytest.raises(CorruptedError, match=match):
        Layout.read_header(buf)


def test_truncated_segment() -> None:
    with pytest.raises(CorruptedError, match="too small"):
        Layout.read_header(memoryview(bytearray(64)))

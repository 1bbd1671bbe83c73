"""The shared-memory layout: fixed offsets, and a header that is checked before it is trusted."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from aioshmq import CorruptedError
from aioshmq.ring import format as L
from aioshmq.ring.layout import Layout


def test_offsets() -> None:
    layout = Layout(capacity=1 << 20, max_messages=64, readers=3)
    assert layout.writer_word(L.W_HEAD) * 8 == 128
    assert layout.reader_word(0, L.R_TAIL) * 8 == 256
    assert layout.reader_word(2, L.R_SLEEP) * 8 == 256 + 2 * 128 + 64
    assert layout.writer_word(L.W_SLEEP) * 8 == 128 + 64
    assert layout.data_offset == 4096 and layout.size == 4096 + (1 << 20)
    assert Layout(1 << 20, 64, 40).data_offset == 8192  # 256 + 40 * 128 rounded up to a page


def test_sleep_words_share_no_cache_line_with_the_counters() -> None:
    """Each side loads the other's sleep words at every publish: they must not sit in the
    64-byte line holding the counters that side stores at every message."""
    layout = Layout(capacity=1 << 20, max_messages=64, readers=3)

    def line(word: int) -> int:
        return word * 8 // 64

    counters = {line(layout.writer_word(f)) for f in (L.W_HEAD, L.W_HEAD_COUNT, L.W_CLOSED)}
    sleep = {line(layout.writer_word(f)) for f in (L.W_SLEEP, L.W_WANT_POS, L.W_WANT_COUNT)}
    assert len(sleep) == 1 and not counters & sleep
    for i in range(layout.readers):
        tail = {line(layout.reader_word(i, f)) for f in (L.R_TAIL, L.R_TAIL_COUNT)}
        assert line(layout.reader_word(i, L.R_SLEEP)) not in tail


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


# -- ARCHITECTURE.md's layout tables say what _layout.py does ----------------------------------


def _tables() -> list[list[list[str]]]:
    """Every Markdown table of ARCHITECTURE.md, as rows of stripped cells (header first)."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "ARCHITECTURE.md").read_text()
    tables: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def _table(header: list[str]) -> list[list[str]]:
    found = [t[1:] for t in _tables() if t[0] == header]
    assert len(found) == 1, f"ARCHITECTURE.md has {len(found)} tables headed {header}"
    return found[0]


def test_documented_header_matches_the_code() -> None:
    rows = _table(["offset", "field", "value"])
    documented = {field: int(offset) for offset, field, _value in rows}
    assert documented == {
        "magic": L.OFF_MAGIC,
        "version": L.OFF_VERSION,
        "capacity": L.OFF_CAPACITY,
        "max_messages": L.OFF_MAX_MESSAGES,
        "readers": L.OFF_READERS,
        "data_offset": L.OFF_DATA,
        "writer_pid": L.OFF_WRITER_PID,
    }
    values = {field: value for _offset, field, value in rows}
    assert f"{L.MAGIC:#x}" in values["magic"].lower() and str(L.VERSION) in values["version"]


def test_documented_counter_lines_match_the_code() -> None:
    layout = Layout(capacity=1 << 20, max_messages=64, readers=3)
    lines = [t[1:] for t in _tables() if t[0] == ["word", "byte", "name", "meaning"]]
    writer = [t for t in lines if t[0][2].startswith("W_")]
    reader = [t for t in lines if t[0][2].startswith("R_")]
    assert len(writer) == len(reader) == 1 == len(lines) - 1
    assert {row[2] for row in writer[0]} == {n for n in dir(L) if n.startswith("W_")}
    assert {row[2] for row in reader[0]} == {n for n in dir(L) if n.startswith("R_")}
    for word, byte, name, _meaning in writer[0]:
        assert getattr(L, name) == int(word)
        assert int(byte) == layout.writer_word(getattr(L, name)) * 8
    for word, byte, name, _meaning in reader[0]:
        assert getattr(L, name) == int(word)
        for i in range(3):  # the byte column is a formula in i
            assert eval(byte, {"i": i}) == layout.reader_word(i, getattr(L, name)) * 8


def test_documented_record_kinds_match_the_code() -> None:
    rows = _table(["kind", "value", "meaning"])
    documented = {name: int(value, 0) for name, value, _meaning in rows}
    in_code = {n: getattr(L, n) for n in ("PAD", "MSG", "FIRST", "MIDDLE", "LAST", "OOB", "BATCH")}
    assert documented == in_code


def test_documented_modules_match_their_docstrings() -> None:
    """ARCHITECTURE.md's module table lists every module and layer folder of the package,
    each with the first paragraph of its docstring."""
    import importlib
    import pkgutil

    import aioshmq

    root = Path(aioshmq.__path__[0])
    documented = dict(_table(["module", "owns"]))
    found = {}
    for info in pkgutil.walk_packages(aioshmq.__path__, "aioshmq."):
        if info.name.endswith("__main__"):
            continue
        rel = info.name.removeprefix("aioshmq.").replace(".", "/")
        path = root / rel / "__init__.py" if info.ispkg else root / f"{rel}.py"
        if path.exists():  # read, not imported: some import optional packages (torch, zmq)
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            source = f"{rel}/" if info.ispkg else f"{rel}.py"
        else:  # the compiled core
            doc = importlib.import_module(info.name).__doc__ or ""
            source = f"{rel}.c"
        found[source] = doc.split("\n\n")[0].replace("\n", " ").replace("``", "`")
    assert found == documented

"""The two ring cores: the compiled one and its pure reference write the same bytes, read them
the same way (scribbled ones included), and their ends share a ring across processes."""

from __future__ import annotations

import multiprocessing
import os
import pickle
from typing import Any

import anyio
import numpy as np
import pytest
from conftest import Children, run_backend
from hypothesis import given, settings
from hypothesis import strategies as st

import aioshmq
from aioshmq.base.errors import CorruptedError
from aioshmq.ring import format as L
from aioshmq.ring import pure as _ringcore
from aioshmq.ring.format import record_size
from aioshmq.ring.layout import Layout
from aioshmq.ring.switch import PURE_ENV

try:
    from aioshmq.ring import compiled as _ringcore_c
except ImportError:  # pragma: no cover - a machine without a compiler
    _ringcore_c = None  # type: ignore[assignment]

needs_compiled = pytest.mark.skipif(_ringcore_c is None, reason="the compiled core is not built")
# .ci/fuzz-sanitized raises these under AddressSanitizer and UBSan.
EXAMPLES = int(os.environ.get("AIOSHMQ_FUZZ_EXAMPLES", "0")) or None


@needs_compiled
def test_the_compiled_core_was_built_from_this_format() -> None:
    """Its constants come from a header generated from format.py at build time; a core
    built from another format (a stale build) is found out here."""
    assert L.constants() == _ringcore_c.FORMAT


def test_the_generated_header_declares_every_constant_and_kind() -> None:
    header = L.c_header()
    for name, value in L.constants().items():
        assert f"#define {name} {value}ULL" in header
    known = header.split("KIND_KNOWN[256] = {")[1].split("}")[0].split(", ")
    assert [k == "1" for k in known] == [L.kind_known(kind) for kind in range(256)]
    assert sum(k == "1" for k in known) == 1 + 4 + 2 + 1 + 1  # PAD, MSG x4, FIRST x2, ...


def test_the_switch_names_the_core_that_runs() -> None:
    from aioshmq.ring import core

    forced = os.environ.get(PURE_ENV, "") not in ("", "0")
    if forced:
        assert f"pure ({PURE_ENV} is set)" == aioshmq.CORE
    elif _ringcore_c is not None:
        assert aioshmq.CORE == "compiled"
    compiled = aioshmq.CORE == "compiled"
    for cls in (core.WriterCore, core.ReaderCore, core.Gate):
        assert (cls.__module__ == "aioshmq.ring.compiled") == compiled


# -- the same bytes ---------------------------------------------------------------------------


_WAKE = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # where the cores' wake-ups go


@pytest.fixture(autouse=True, scope="module")
def _wake_fd() -> Any:
    yield
    os.close(_WAKE)


def _memory(layout: Layout) -> bytearray:
    """A ring on the heap (AddressSanitizer sees an overrun of it), header written."""
    mem = bytearray(layout.size)
    layout.write_header(memoryview(mem), os.getpid())
    return mem


def _gated_writer(core: Any, mem: bytearray, layout: Layout, gate: Any) -> Any:
    return core.WriterCore(
        mem,
        layout.data_offset,
        layout.capacity,
        layout.max_messages,
        layout.readers,
        [_WAKE] * layout.readers,
        True,
        gate,
    )


def _writer(core: Any, mem: bytearray, layout: Layout) -> Any:
    """A writer core waiting for slot 0's reader, as the writer of a ring with one reader."""
    gate = core.Gate(layout.readers)
    with gate:
        gate.set(0, L.ATTACHED)
    return _gated_writer(core, mem, layout, gate)


def _reader(core: Any, mem: bytearray, layout: Layout) -> Any:
    return core.ReaderCore(
        mem, layout.data_offset, layout.capacity, layout.max_messages, 1, 0, _WAKE, True, "test"
    )


def _step(r: Any, record: tuple[memoryview, int, int, int]) -> int:
    """Consume and publish a record next() returned, as the ring would; the messages it
    ends (a fragment's: fragments are the ring's business, stepped over here)."""
    _payload, kind, size, aux = record
    base = kind & L.KIND_MASK
    messages = aux if kind & L.BATCH else int(base in (L.MSG, L.LAST))
    r.consume(size, messages)
    r.publish()
    return messages


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 1500), st.sampled_from([1, 2, 5])),
        st.tuples(st.just("buffer"), st.integers(0, 1500), st.integers(0, 200)),
        st.tuples(st.just("get"), st.integers(1, 6), st.just(0)),
    ),
    max_size=60,
)


@needs_compiled
@settings(max_examples=EXAMPLES or 60, deadline=None)
@given(_ops)
def test_both_cores_write_and_read_the_same_bytes(ops: list[tuple[str, int, int]]) -> None:
    layout = Layout(4096, 9, 1)
    sides = []
    for core in (_ringcore, _ringcore_c):
        mem = _memory(layout)
        sides.append((mem, _writer(core, mem, layout), _reader(core, mem, layout)))
    for op, a, b in ops:
        results = []
        for _mem, w, r in sides:
            if op == "put":
                payload = bytes([a % 251]) * a
                results.append(w.put_plain(payload, L.MSG | (L.BATCH if b > 1 else 0), b))
            elif op == "buffer":  # a buffer of a bytes and a main part of b
                buffer = memoryview(bytes([a % 251]) * a)
                results.append(w.put_buffer(bytes([b % 7]) * b, buffer))
            else:
                got = []
                for _ in range(a):
                    if (msg := r.get_plain(bytes, b"")) != b"":
                        got.append(msg)
                    elif (nxt := r.next()) is not None:  # a batch: next() then consume
                        got.append((bytes(nxt[0]), nxt[1], nxt[2], nxt[3]))
                        _step(r, nxt)
                results.append(got)
            results.append((w.pos, w.count, w.head, w.head_count, w.need_span, w.need_count))
            results.append((r.tail, r.count, r.head, r.shown_tail, r.taken, r.taken_bytes))
        half = len(results) // 2
        assert results[:half] == results[half:], op
        assert sides[0][0] == sides[1][0]  # byte for byte


def _take(r: Any) -> bytes:
    """The reader's next message, stepping over a PAD first if one comes."""
    msg = r.get_plain(bytes, b"")
    if msg != b"":
        return msg  # type: ignore[no-any-return]
    nxt = r.next()
    assert nxt is not None
    _step(r, nxt)
    return bytes(nxt[0])


@needs_compiled
@pytest.mark.parametrize("behind", [0, 1, 3])
def test_both_cores_send_a_record_back_to_the_start_once_nothing_unread_is_in_its_way(
    behind: int,
) -> None:
    """Once the cursor is a quarter of the data area in (at least ``REWIND_AT``), the next
    record goes back to the start, after a PAD, if no unread byte lies in its way there: a
    reader that keeps up has every record written in the first quarter and a record.  A
    reader ``behind`` records behind still gets every message whole and in order.  Both
    cores place every record alike, byte for byte."""
    layout = Layout(4 * L.REWIND_AT, 64, 1)
    n = 100_000
    size = record_size(n)
    sides = []
    for core in (_ringcore, _ringcore_c):
        mem = _memory(layout)
        sides.append((mem, _writer(core, mem, layout), _reader(core, mem, layout)))
    offsets: set[int] = set()
    read = 0
    for i in range(60):
        for _mem, w, _r in sides:
            assert w.put_plain(bytes([i]) * n) is True
        offsets.add((sides[0][1].head - size) % layout.capacity)
        while read < i + 1 - behind:
            assert [_take(r) for _mem, _w, r in sides] == [bytes([read]) * n] * 2
            read += 1
        (mem_a, wa, ra), (mem_b, wb, rb) = sides
        assert (wa.pos, wa.count, ra.tail, ra.count) == (wb.pos, wb.count, rb.tail, rb.count)
        assert mem_a == mem_b
    if behind == 0:
        assert offsets == {0, size, 2 * size}  # the third ends past REWIND_AT: back to 0
    else:  # the start is free again once the reader left it: it goes back later, not never
        assert 0 in offsets and max(offsets) + size > L.REWIND_AT
        assert max(offsets) < layout.capacity - size
    assert sides[0][1].pos > 60 * size  # the PADs took positions: each went back


def _module(core: str) -> Any:
    module = _ringcore if core == "pure" else _ringcore_c
    if module is None:
        pytest.skip("the compiled core is not built")
    return module


def _set_tail(mem: bytearray, layout: Layout, slot: int, tail: int, count: int) -> None:
    words = memoryview(mem).cast("Q")
    words[layout.reader_word(slot, L.R_TAIL)] = tail
    words[layout.reader_word(slot, L.R_TAIL_COUNT)] = count


@pytest.mark.parametrize("core", ["pure", "compiled"])
def test_both_cores_wait_for_the_slowest_slot_the_gate_waits_for(core: str) -> None:
    """The limits come from the slowest pending, attached or dead slot, never from a
    detached or evicted one, and never from beyond the published head."""
    from aioshmq.ring.format import ATTACHED, DEAD, DETACHED, EVICTED, PENDING

    module = _module(core)
    layout = Layout(8192, 50, 5)
    mem = _memory(layout)
    gate = module.Gate(5)
    w = _gated_writer(module, mem, layout, gate)
    w.head, w.head_count = w.pos, w.count = 5000, 40
    with gate:
        for slot, state in enumerate([ATTACHED, DETACHED, DEAD, EVICTED, PENDING]):
            gate.set(slot, state)
    assert gate.states() == [ATTACHED, DETACHED, DEAD, EVICTED, PENDING]
    for slot, (tail, count) in enumerate([(4000, 30), (100, 1), (3000, 35), (50, 2), (3500, 20)]):
        _set_tail(mem, layout, slot, tail, count)
    assert w.refresh_limits() == (3000, 20)  # the dead slot's tail, the pending one's count
    assert (w.limit_pos, w.limit_count) == (3000 + 8192, 20 + 50)
    with gate:
        for slot in range(5):  # nobody waited for: the published head bounds the room
            gate.set(slot, DETACHED)
    assert w.refresh_limits() == (5000, 40)
    with gate:
        gate.set(0, ATTACHED)
    _set_tail(mem, layout, 0, 5008, 40)  # a tail past the head: a scribbled ring
    with pytest.raises(CorruptedError, match="reader 0 claims position 5008/40"):
        w.refresh_limits()
    _set_tail(mem, layout, 0, 5000, 40)
    assert w.refresh_limits() == (5000, 40)  # the lock was let go: the next call works


@pytest.mark.parametrize("core", ["pure", "compiled"])
def test_a_gate_holds_its_states_and_refuses_what_is_not_one(core: str) -> None:
    module = _module(core)
    gate = module.Gate(3)
    assert len(gate) == 3 and gate.states() == [L.PENDING] * 3 and gate.state(2) == L.PENDING
    with gate:
        gate.set(1, L.EVICTED)
    assert gate.states() == [L.PENDING, L.EVICTED, L.PENDING]
    with pytest.raises(ValueError):
        gate.set(0, 5)
    with pytest.raises(IndexError):
        gate.state(3)
    with pytest.raises(ValueError):
        module.Gate(0)
    with pytest.raises((TypeError, ValueError)):  # one gate slot per reader, of this core
        _gated_writer(module, _memory(Layout(4096, 9, 2)), Layout(4096, 9, 2), module.Gate(1))


@pytest.mark.parametrize("core", ["pure", "compiled"])
def test_both_cores_read_the_gate_under_its_lock(core: str) -> None:
    """The writer reads the states only while it holds the gate's lock (the broker attaches
    a slot under it), letting the GIL go meanwhile; the lock is let go after an error too."""
    import threading

    module = _module(core)
    layout = Layout(8192, 50, 1)
    mem = _memory(layout)
    gate = module.Gate(1)
    w = _gated_writer(module, mem, layout, gate)
    w.head = w.pos = 160
    _set_tail(mem, layout, 0, 32, 0)
    with gate:
        gate.set(0, L.ATTACHED)
    done = threading.Event()
    results: list[Any] = []

    def refresh() -> None:
        results.append(w.refresh_limits())
        done.set()

    with gate:
        thread = threading.Thread(target=refresh)
        thread.start()
        assert not done.wait(0.2), "the limits were read while another thread held the gate"
    assert done.wait(30)
    thread.join(30)
    assert results == [(32, 0)]
    _set_tail(mem, layout, 0, 176, 0)
    with pytest.raises(CorruptedError):
        w.refresh_limits()
    with gate:  # free again
        pass


@pytest.mark.parametrize("core", ["pure", "compiled"])
def test_both_cores_find_room_a_reader_freed_through_the_gate(core: str) -> None:
    """A write that finds no room by the limits it knows reads the tails afresh, through
    the gate, and goes ahead once the reader has moved."""
    module = _module(core)
    layout = Layout(4096, 100, 1)
    mem = _memory(layout)
    w = _writer(module, mem, layout)
    record = b"x" * 1000
    while w.put_plain(record):
        pass
    full_at = w.pos
    assert full_at >= 3 * record_size(len(record))
    _set_tail(mem, layout, 0, record_size(len(record)), 1)  # the reader read one record
    assert w.put_plain(record)
    assert w.pos > full_at and w.limit_pos == record_size(len(record)) + 4096


@pytest.mark.parametrize("core", ["pure", "compiled"])
@pytest.mark.parametrize(("main_len", "buf_len"), [(0, 0), (1, 1), (100, 3000), (8, 1000)])
def test_put_buffer_lays_out_a_message_as_a_frame_does(
    core: str, main_len: int, buf_len: int
) -> None:
    """The one-call path for one out-of-band buffer writes the record the general path
    (``Frame``) would, which readers decode into the same main part and buffer."""
    from aioshmq.ring.layout import Frame, decode

    module = _ringcore if core == "pure" else _ringcore_c
    if module is None:
        pytest.skip("the compiled core is not built")
    layout = Layout(8192, 9, 1)
    mem = _memory(layout)
    w = _writer(module, mem, layout)
    main, buffer = bytes(i % 256 for i in range(main_len)), bytes([7]) * buf_len
    frame = Frame(main, [memoryview(buffer)])
    assert w.put_buffer(main, memoryview(buffer))
    assert (w.pos, w.count, w.head, w.head_count) == (record_size(frame.length), 1, w.pos, 1)
    assert (w.sent, w.sent_bytes) == (1, frame.length)
    data = memoryview(mem)[layout.data_offset :]
    word = int.from_bytes(data[:8], "little")
    assert (word & 0xFF, word >> 8) == (frame.kind, frame.length)
    expected = bytearray(frame.length)
    frame.copy_into(memoryview(expected))
    payload = data[L.HEADER_SIZE : L.HEADER_SIZE + frame.length]
    assert bytes(payload) == bytes(expected)
    got_main, got_buffers = decode(payload, frame.kind)
    assert bytes(got_main) == main and [bytes(b) for b in got_buffers] == [buffer]


def test_put_buffer_refuses_what_is_too_big_or_has_no_room() -> None:
    for module in (_ringcore, _ringcore_c):
        if module is None:
            continue
        layout = Layout(4096, 2, 1)
        mem = _memory(layout)
        w = _writer(module, mem, layout)
        assert not w.put_buffer(b"m", bytes(layout.max_record))  # too big for one record
        assert (w.pos, w.count) == (0, 0)
        assert w.put_buffer(b"m", bytes(100)) and w.put_buffer(b"m", bytes(100))
        assert not w.put_buffer(b"m", bytes(100))  # max_messages=2 reached, nothing read
        assert (w.count, w.need_count) == (2, 1)
        assert mem[layout.data_offset + 2 * record_size(24 + 16 + 100) :] == bytes(
            layout.capacity - 2 * record_size(24 + 16 + 100)
        )


# -- scribbled rings ----------------------------------------------------------------------------


def _outcome(core: Any, mem: bytearray, layout: Layout, steps: int) -> list[Any]:
    r = _reader(core, bytearray(mem), layout)
    seen: list[Any] = []
    try:
        for _ in range(steps):
            msg = r.get_plain(bytes, None)
            if msg is not None:
                seen.append(("plain", msg))
                continue
            nxt = r.next()
            if nxt is None:
                seen.append("none")
                break
            payload, kind, size, aux = nxt
            assert len(payload) <= layout.capacity
            seen.append((bytes(payload), kind, size, aux))
            _step(r, nxt)
        seen.append(r.prepare_sleep())
    except CorruptedError as exc:
        seen.append(("corrupt", str(exc)))
    return seen


_kind = st.one_of(
    st.sampled_from([L.PAD, L.MSG, L.FIRST, L.MIDDLE, L.LAST, L.MSG | L.OOB, L.MSG | L.BATCH]),
    st.integers(0, 0xFF),
)
_word = st.one_of(
    st.builds(lambda n, k: (n << 8) | k, st.integers(0, 5000), _kind),  # a record header
    st.builds(lambda n, k: (n << 8) | k, st.integers(0, (1 << 56) - 1), _kind),
    st.integers(0, 300),  # a batch count, a fragment total
    st.integers(0, (1 << 64) - 1),
)


@settings(max_examples=EXAMPLES or 300, deadline=None)
@given(
    scribbles=st.lists(st.tuples(st.integers(0, 4096 // 8 - 1), _word), max_size=16),
    tail=st.one_of(st.integers(0, 1000).map(lambda k: 16 * k), st.integers(0, 1 << 62)),
    ahead=st.one_of(st.integers(0, 300).map(lambda k: 16 * k), st.integers(0, 1 << 62)),
    steps=st.integers(1, 20),
)
def test_a_scribbled_ring_gives_corrupted_error_never_a_stray_read(
    scribbles: list[tuple[int, int]], tail: int, ahead: int, steps: int
) -> None:
    """Random record headers, lengths, head and tail: each core reads inside the ring or
    raises CorruptedError, and both cores tell the same story."""
    layout = Layout(4096, 9, 1)
    mem = _memory(layout)
    words = memoryview(mem).cast("Q")
    data = layout.data_offset // 8
    for k in range(64):  # honest 64-byte records all round, then the scribbles over them
        words[data + 8 * k] = (40 << 8) | L.MSG
    for index, value in scribbles:
        words[data + index] = value
    words[layout.writer_word(L.W_HEAD)] = min(tail + ahead, (1 << 64) - 1)
    words[layout.reader_word(0, L.R_TAIL)] = tail
    pure = _outcome(_ringcore, mem, layout, steps)
    if _ringcore_c is not None:
        assert _outcome(_ringcore_c, mem, layout, steps) == pure


def test_a_released_core_refuses_to_touch_memory() -> None:
    layout = Layout(4096, 9, 1)
    for core in (_ringcore, _ringcore_c) if _ringcore_c is not None else (_ringcore,):
        mem = _memory(layout)
        w, r = _writer(core, mem, layout), _reader(core, mem, layout)
        w.release()
        r.release()
        with pytest.raises(ValueError):
            w.put_plain(b"x")
        with pytest.raises(ValueError):
            r.get_plain(bytes, None)


@pytest.mark.parametrize("core_name", ["pure", "compiled"])
def test_an_evicted_reader_reads_nothing_more_on_either_core(core_name: str) -> None:
    """Once the writer marks the slot, every read path raises ReaderEvicted (with the
    ring's name, the slot and the timeout in the mark) before it reads a record, and after
    one it read: the tail stays put."""
    core = _ringcore if core_name == "pure" else _ringcore_c
    if core is None:
        pytest.skip("the compiled core is not built")
    layout = Layout(4096, 9, 1)
    mem = _memory(layout)
    words = memoryview(mem).cast("Q")
    mark = layout.reader_word(0, L.R_EVICTED)

    w, r = _writer(core, mem, layout), _reader(core, mem, layout)
    for i in range(3):
        assert w.put_plain(pickle.dumps(i))
    assert r.get_plain(pickle.loads, None) == 0
    words[mark] = 250
    reads = {
        "get_plain": lambda: r.get_plain(pickle.loads, None),
        "get_record": lambda: r.get_record(pickle.loads, None),
        "next": r.next,
        "check_evicted": r.check_evicted,
        "consume": lambda: r.consume(0, 0),
        "refresh": r.refresh,
    }
    for name, read in reads.items():
        with pytest.raises(aioshmq.ReaderEvicted) as caught:
            read()
        assert (caught.value.ring, caught.value.index, caught.value.timeout) == ("test", 0, 0.25)
        assert "reader 0 of ring 'test' was evicted" in str(caught.value), name
    assert (r.tail, r.count) == (record_size(len(pickle.dumps(0))), 1)

    def marked_while_loading(view: memoryview) -> Any:
        words[mark] = 7  # as if the writer evicted the reader during this load
        raise ValueError("torn bytes")  # what a load of overwritten bytes may do

    for get in (r.get_plain, r.get_record):
        words[mark] = 0
        with pytest.raises(aioshmq.ReaderEvicted) as caught:
            get(marked_while_loading, None)
        assert caught.value.timeout == 0.007
        assert r.count == 1
    words[mark] = 0
    assert r.get_plain(pickle.loads, None) == 1


@needs_compiled
def test_a_view_handed_out_keeps_the_memory_until_it_goes() -> None:
    """A payload view outlives its core's release: the mapping stays until the view dies."""
    layout = Layout(4096, 9, 1)
    mem = _memory(layout)
    w, r = _writer(_ringcore_c, mem, layout), _reader(_ringcore_c, mem, layout)
    assert w.put_plain(b"abc")
    view = r.next()[0]
    r.release()
    with pytest.raises(BufferError):
        mem.extend(b"x")  # still exported: the bytearray cannot move
    assert bytes(view) == b"abc"
    view.release()
    w.release()
    mem.extend(b"x")


class _ReleasesCore:
    """Unpickles by releasing the core it is read from."""

    core: Any = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_release_core, ())


def _release_core() -> str:
    _ReleasesCore.core.release()
    return "released"


@needs_compiled
def test_loads_is_given_the_message_and_nothing_outlives_it() -> None:
    """pickle.loads reads the ring through the core itself, any other loads gets a view of its
    own; after either, even one that failed or released the core mid-load, the core exports
    nothing more and the memory goes once nothing holds it."""
    layout = Layout(4096, 9, 1)
    mem = _memory(layout)
    w, r = _writer(_ringcore_c, mem, layout), _reader(_ringcore_c, mem, layout)
    kept: list[memoryview] = []
    assert w.put_plain(pickle.dumps(("a", 1)))
    assert r.get_plain(lambda view: kept.append(view) or "mine", None) == "mine"
    assert isinstance(kept[0], memoryview) and pickle.loads(kept[0]) == ("a", 1)
    kept.pop().release()
    assert w.put_plain(pickle.dumps(("b", 2)))
    assert r.get_plain(pickle.loads, None) == ("b", 2)
    assert w.put_plain(b"\x80\x05not a pickle")
    with pytest.raises(pickle.UnpicklingError):
        r.get_plain(pickle.loads, None)
    assert w.put_object(("c", 3), pickle.dumps) is None  # the bad one was consumed
    assert r.get_record(pickle.loads, None) == (("c", 3), 1)
    with pytest.raises(BufferError):
        memoryview(r)  # type: ignore[arg-type]
    _ReleasesCore.core = r
    try:
        assert w.put_object(_ReleasesCore(), pickle.dumps) is None
        with pytest.raises(ValueError, match="released"):
            r.get_plain(pickle.loads, None)
    finally:
        _ReleasesCore.core = None
    with pytest.raises(BufferError):
        memoryview(r)  # type: ignore[arg-type]
    w.release()
    mem.extend(b"x")  # nothing exports the memory any more


# -- ends of either kind on one ring ------------------------------------------------------------


def _child_reader(name: str, expect_core: str, n: int) -> None:
    async def main() -> None:
        assert aioshmq.CORE.startswith(expect_core), aioshmq.CORE
        async with aioshmq.connect(name, spin=0) as r:
            for i in range(n):
                msg = await r.get()
                if msg != ("m", i):
                    raise SystemExit(f"message {i}: {msg!r}")
            batch = await r.get_many(5)
            batch += await r.get_many(5 - len(batch)) if len(batch) < 5 else []
            if batch != [("b", j) for j in range(5)]:
                raise SystemExit(f"batch: {batch!r}")
            arr = await r.get()
            if arr.shape != (300_000,) or int(arr.sum()) != 299_999 * 300_000 // 2:
                raise SystemExit("array damaged")
            with anyio.fail_after(30):
                try:
                    await r.get()
                except anyio.EndOfStream:
                    return
            raise SystemExit("expected the end of the stream")

    run_backend("asyncio", main)


def _child_writer(name: str, created: Any, expect_core: str, n: int) -> None:
    async def main() -> None:
        assert aioshmq.CORE.startswith(expect_core), aioshmq.CORE
        async with aioshmq.create(capacity=16384, max_messages=64, name=name) as w:
            created.set()
            await w.wait_readers()
            for i in range(n):
                await w.put(("m", i))
            await w.put_many([("b", j) for j in range(5)])
            await w.put(np.arange(300_000, dtype=np.int64))

    run_backend("asyncio", main)


async def _read_all(name: str, n: int) -> None:
    with anyio.fail_after(60):
        async with aioshmq.connect(name, spin=0) as r:
            for i in range(n):
                assert await r.get() == ("m", i)
            assert [await r.get() for _ in range(5)] == [("b", j) for j in range(5)]
            arr = await r.get()
            assert int(arr.sum()) == 299_999 * 300_000 // 2
            with pytest.raises(anyio.EndOfStream):
                await r.get()


@needs_compiled
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("child_writes", [False, True], ids=["reader-child", "writer-child"])
async def test_ends_of_either_core_share_a_ring(
    anyio_backend: str,
    child_writes: bool,
    children: Children,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This process runs one core, a spawned child the other: messages (plain, a batch, an
    array out of band, one larger than the ring), backpressure and wake-ups all cross."""
    n = 3000  # far more than the ring holds: both sides sleep and wake each other
    other = "pure" if aioshmq.CORE == "compiled" else "compiled"
    monkeypatch.setenv(PURE_ENV, "1" if other == "pure" else "0")
    if child_writes:
        name = f"interop-{os.getpid()}-{id(children)}"
        created = multiprocessing.get_context("spawn").Event()
        await anyio.to_thread.run_sync(
            children.start, "spawn", _child_writer, name, created, other, n
        )
        assert await anyio.to_thread.run_sync(created.wait, 60)
        await _read_all(name, n)
    else:
        async with aioshmq.create(capacity=16384, max_messages=64) as w:
            await anyio.to_thread.run_sync(children.start, "spawn", _child_reader, w.name, other, n)
            with anyio.fail_after(60):
                await w.wait_readers()
                for i in range(n):
                    await w.put(("m", i))
                await w.put_many([("b", j) for j in range(5)])
                await w.put(np.arange(300_000, dtype=np.int64))
    assert await anyio.to_thread.run_sync(children.join) == [0]


def test_put_object_hands_back_what_it_did_not_write() -> None:
    layout = Layout(4096, 9, 1)
    for core in (_ringcore, _ringcore_c) if _ringcore_c is not None else (_ringcore,):
        mem = _memory(layout)
        w = _writer(core, mem, layout)
        assert w.put_object(("small", 1), pickle.dumps) is None
        assert w.put_object(np.zeros(3), pickle.dumps) == ()
        main, found = w.put_object(pickle.PickleBuffer(b"abc"), pickle.dumps)
        assert [bytes(b) for b in found] == [b"abc"] and isinstance(main, bytes)
        main, found = w.put_object(b"x" * 3000, pickle.dumps)  # larger than half the ring
        assert found == [] and pickle.loads(main) == b"x" * 3000
        with pytest.raises((pickle.PicklingError, AttributeError)):
            w.put_object(lambda: 0, pickle.dumps)
        assert w.put_object(("after", 2), pickle.dumps) is None  # nothing lost or stuck
        assert w.put_object([1, 2, 3], pickle.dumps, 3) is None  # a batch of three
        with pytest.raises(ValueError):
            w.put_object([], pickle.dumps, 0)
        r = _reader(core, mem, layout)
        got = [r.get_plain(pickle.loads, None) for _ in range(3)]
        assert got == [("small", 1), ("after", 2), None]  # a batch is not a plain message
        assert r.get_record(pickle.loads, None) == ([1, 2, 3], 3)
        assert (r.count, r.taken) == (5, 5)
        assert r.get_record(pickle.loads, None) is None
        assert r.spin(0.001) is False


@pytest.mark.parametrize("core", ["pure", "compiled"])
def test_put_object_writes_an_array_with_the_pickle_it_is_given_or_hands_it_back(
    core: str,
) -> None:
    """A plain C-contiguous array whose stream pickle the serializer has made is written by
    ``put_object`` itself, as ``put_buffer`` writes the serializer's result; any other array
    comes back as ``()``, nothing written."""
    from aioshmq.serialize.pickling import PickleSerializer

    module = _ringcore if core == "pure" else _ringcore_c
    if module is None:
        pytest.skip("the compiled core is not built")
    layout = Layout(8192, 9, 1)
    ser = PickleSerializer()
    array = np.arange(6.0).reshape(2, 3)
    main, buffers = ser.dumps(array)  # the serializer's own way, which fills its cache
    mem, expected = _memory(layout), _memory(layout)
    w = _writer(module, mem, layout)
    assert w.put_object(array, pickle.dumps) == ()  # no pickles given yet
    w.arrays = ser.array_pickles
    metadata = np.dtype(np.float64, metadata={"unit": "m"})
    handed_back = [
        np.zeros((3, 2)),  # a shape with no pickle yet
        np.asfortranarray(array),  # not C-contiguous
        np.arange(12.0).reshape(2, 6)[:, ::2],  # not contiguous at all
        np.zeros((2, 3), dtype=metadata),  # its pickle says more than the cached one
        np.zeros((2, 3), dtype=np.float32),
        np.zeros((2, 1000)),  # larger than half the ring
    ]
    for other in handed_back:
        assert w.put_object(other, pickle.dumps) == (), other.dtype
    assert (w.pos, w.count) == (0, 0)
    assert w.put_object(array, pickle.dumps) is None
    assert w.put_object(array, pickle.dumps, 2) == ()  # a batch of arrays is not one record
    assert w.put_object(array[::-1].copy(), pickle.dumps) is None
    e = _writer(module, expected, layout)
    assert e.put_buffer(main, buffers[0])
    main, buffers = ser.dumps(array[::-1].copy())
    assert e.put_buffer(main, buffers[0])
    assert mem == expected
    while w.put_object(array, pickle.dumps) is None:  # until the ring is full
        assert w.count <= layout.max_messages
    assert w.count == layout.max_messages and w.need_count == 1


class _Thing:
    """An object a test can see go (a weakref), pickled by reference to its class."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Thing) and other.n == self.n


class _Fails:
    def __reduce__(self) -> Any:
        raise RuntimeError("cannot pickle this one")


class _PutsWhilePickled:
    """Puts a message of its own into ``core`` while it is being pickled."""

    core: Any = None

    def __reduce__(self) -> Any:
        assert self.core.put_object(("inner", 1), pickle.dumps) is None
        return (tuple, ((1, 2),))


@pytest.mark.parametrize("core", ["pure", "compiled"])
def test_put_object_pickles_as_pickle_dumps_does_and_keeps_nothing_of_the_object(
    core: str,
) -> None:
    """With ``pickle.dumps`` a core pickles through a Pickler it keeps: the same bytes as
    ``pickle.dumps``, nothing of a message held after the call (memo cleared), after an error
    too, and a message put from inside the pickling of another one written whole."""
    import weakref

    module = _ringcore if core == "pure" else _ringcore_c
    if module is None:
        pytest.skip("the compiled core is not built")
    layout = Layout(1 << 20, 64, 1)
    mem = _memory(layout)
    w, r = _writer(module, mem, layout), _reader(module, mem, layout)
    shared = _Thing(3)
    objects: list[Any] = [
        ("small", 1),
        {"seq": 7, "topic": "ticks/eu", "pad": b"x" * 50},
        [shared, shared, {"again": shared}],  # the memo at work within one message
        "é" * 300,
        2**200,
        [[1, 2], {3: 4}, frozenset({5})],
    ]
    for obj in objects:
        assert w.put_object(obj, pickle.dumps) is None
        assert r.get_plain(bytes, None) == pickle.dumps(obj, protocol=5)
    thing = _Thing(9)
    gone = weakref.ref(thing)
    assert w.put_object([thing, thing], pickle.dumps) is None
    del thing
    assert gone() is None  # the kept Pickler's memo let it go
    assert r.get_plain(pickle.loads, None) == [_Thing(9), _Thing(9)]
    doomed = _Thing(10)
    gone = weakref.ref(doomed)
    with pytest.raises(RuntimeError, match="cannot pickle"):
        w.put_object([doomed, _Fails()], pickle.dumps)
    del doomed
    assert gone() is None
    assert w.put_object(("after", 2), pickle.dumps) is None  # nothing of the failure stays
    assert r.get_plain(bytes, None) == pickle.dumps(("after", 2), protocol=5)
    _PutsWhilePickled.core = w
    try:
        assert w.put_object([_PutsWhilePickled(), "outer"], pickle.dumps) is None
    finally:
        _PutsWhilePickled.core = None
    assert r.get_plain(pickle.loads, None) == ("inner", 1)
    assert r.get_plain(pickle.loads, None) == [(1, 2), "outer"]
    big = [b"y" * (100 << 10), "tail"]  # in-band data of 64 KiB or more: out of the frames
    assert w.put_object(big, pickle.dumps) is None
    assert r.get_plain(pickle.loads, None) == big
    assert w.put_object(("small", 2), pickle.dumps) is None  # a new Pickler: the same bytes
    assert r.get_plain(bytes, None) == pickle.dumps(("small", 2), protocol=5)


class _Point:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Point) and other.x == self.x


def _point(x: int) -> _Point:
    return _Point(x)


@pytest.mark.parametrize("core", ["pure", "compiled"])
def test_put_object_pickles_with_the_dumps_it_is_given(core: str) -> None:
    """A serializer's own pickler (reducers registered) gives pickle.dumps's bytes for plain
    values, which the compiled core writes itself, and its reducers' for the rest; a dumps
    that does not say it pickles plain values as pickle does is called for every value."""
    from aioshmq.serialize.pickling import PickleSerializer

    module = _module(core)
    layout = Layout(1 << 20, 64, 1)
    mem = _memory(layout)
    w, r = _writer(module, mem, layout), _reader(module, mem, layout)
    ser = PickleSerializer(reducers={_Point: lambda p: (_point, (p.x + 1,))})
    reducing = ser.pickler
    assert reducing is not pickle.dumps and type(reducing).plain_as_pickle is True  # type: ignore[attr-defined]
    plain = {"seq": 1, "tags": ("a", "b"), "data": [1.5, None, b"x"]}
    assert w.put_object(plain, reducing) is None
    assert r.get_plain(bytes, None) == pickle.dumps(plain, protocol=5)
    assert w.put_object([_Point(1), "p"], reducing) is None
    assert r.get_plain(pickle.loads, None) == [_Point(2), "p"]

    def protocol_4(obj: Any, protocol: int = 5, buffer_callback: Any = None) -> bytes:
        return pickle.dumps(obj, protocol=4)

    assert w.put_object(plain, protocol_4) is None
    assert r.get_plain(bytes, None) == pickle.dumps(plain, protocol=4)
    assert w.put_object(plain, pickle.dumps) is None  # after another type was asked about
    assert r.get_plain(bytes, None) == pickle.dumps(plain, protocol=5)

    class Counted(type(reducing)):  # type: ignore[misc]
        calls = 0

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            Counted.calls += 1
            return super().__call__(*args, **kwargs)

    counted = Counted(pickle.Pickler, ser._table)
    for obj in (plain, [_Point(5)]):
        assert w.put_object(obj, counted) is None
    assert r.get_plain(bytes, None) == pickle.dumps(plain, protocol=5)
    assert r.get_plain(pickle.loads, None) == [_Point(6)]
    assert Counted.calls == (1 if core == "compiled" else 2)  # plain values in C


@needs_compiled
def test_both_cores_pickle_to_the_same_bytes() -> None:
    """The compiled core writes plain values itself (aioshmq/_plainpickle.c) and leaves the
    rest to pickle; the pure core pickles everything: the rings come out the same."""
    from benchmarks.workload import small_object, small_objects

    layout = Layout(1 << 20, 256, 1)
    word = "shared"
    rings = []
    for module in (_ringcore, _ringcore_c):
        mem = _memory(layout)
        w = _writer(module, mem, layout)
        for obj in (
            ("a", 1),
            small_object(7),
            [word, (word, 2**40), {word: [word, -1.5, None, True]}],
            [b"z" * (70 << 10), {"k": "v"}],
            bytearray(b"q" * 100),
            {"not plain": frozenset({1})},
            [f"w{i}" for i in range(3000)],  # a memo grown past what is kept for the next
            ("b", 2),
        ):
            assert w.put_object(obj, pickle.dumps) is None
        assert w.put_object(small_objects(0, 64), pickle.dumps, 64) is None
        rings.append(mem)
    assert rings[0] == rings[1]

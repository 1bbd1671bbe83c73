"""The ring itself: record placement, both bounds, wrap-around, fragments, against a model."""

from __future__ import annotations

import collections
import concurrent.futures

import anyio
import numpy as np
import pytest
from conftest import Children, backend_name, run_backend
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import aioshmq
from aioshmq.ring import format as L

pytestmark = pytest.mark.anyio


class RingModel(RuleBasedStateMachine):
    """The ring against a plain-Python broadcast queue that follows the layout rules.

    Records are 16 bytes of header plus the payload rounded up to 16; one that would cross
    the end of the data area is preceded by padding to the end.  A put fits when the
    slowest reader leaves room for the record (and its padding) and for one more message.
    """

    CAP = 4096
    MAX = 7
    READERS = 2

    def __init__(self) -> None:
        super().__init__()
        self.w = aioshmq.create(
            capacity=self.CAP, max_messages=self.MAX, readers=2, serializer="raw"
        )
        self.r = [aioshmq.connect(self.w.name, i) for i in range(self.READERS)]
        self.pos = self.count = 0
        self.queues: list[collections.deque[tuple[bytes, int]]] = [
            collections.deque() for _ in range(self.READERS)
        ]
        self.tails = [0] * self.READERS
        self.counts = [0] * self.READERS
        self.serial = 0

    def teardown(self) -> None:
        for r in self.r:
            r.close()
        self.w.close()

    @rule(size=st.integers(0, CAP // 2 - L.HEADER_SIZE))
    def put_nowait(self, size: int) -> None:
        self.serial += 1
        msg = (self.serial.to_bytes(4, "little") * (size // 4 + 1))[:size]
        rec = L.HEADER_SIZE + L.align(size, 16)
        off = self.pos % self.CAP
        span = rec if off + rec <= self.CAP else self.CAP - off + rec
        fits = (
            self.pos + span - min(self.tails) <= self.CAP
            and self.count + 1 - min(self.counts) <= self.MAX
        )
        try:
            self.w.put_nowait(msg)
        except aioshmq.Full:
            assert not fits, "Full, but the model has room"
            return
        assert fits, "accepted, but the model has no room"
        self.pos += span
        self.count += 1
        for q in self.queues:
            q.append((msg, self.pos))

    @rule(i=st.integers(0, READERS - 1))
    def get_nowait(self, i: int) -> None:
        try:
            got = self.r[i].get_nowait()
        except aioshmq.Empty:
            assert not self.queues[i]
            return
        msg, end = self.queues[i].popleft()
        assert got == msg
        self.tails[i] = end
        self.counts[i] += 1

    @precondition(lambda self: any(self.queues))
    @rule(i=st.integers(0, READERS - 1))
    def drain(self, i: int) -> None:
        while self.queues[i]:
            self.get_nowait(i)

    @invariant()
    def statistics_agree(self) -> None:
        s = self.w.statistics()
        assert s.messages_in_ring == self.count - min(self.counts)
        assert s.bytes_in_ring == self.pos - min(self.tails)
        for i, r in enumerate(self.r):
            rs = r.statistics()
            assert rs.messages_available == len(self.queues[i])
            assert rs.bytes_available == self.pos - self.tails[i]


TestRingModel = RingModel.TestCase
TestRingModel.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def _child_checks_big(handle: aioshmq.Handle, backend: str, n: int) -> None:
    async def main() -> None:
        async with aioshmq.connect(handle) as r:
            for i in range(n):
                arr = await r.get()
                if arr.shape != (8 << 20,) or arr[0] != i or arr[-1] != i + 1 or arr[1] != 7:
                    raise SystemExit(f"message {i} damaged: {arr[:3]} ... {arr[-3:]}")
            with anyio.fail_after(10):
                try:
                    await r.get()
                except anyio.EndOfStream:
                    return
            raise SystemExit("expected the end of the stream")

    run_backend(backend, main)


async def test_message_larger_than_ring(anyio_backend: object, children: Children) -> None:
    """A 64 MiB array crosses a 1 MiB ring in fragments and arrives intact."""
    n = 3
    async with aioshmq.create(capacity=1 << 20, max_messages=64) as w:
        await anyio.to_thread.run_sync(
            children.start, "spawn", _child_checks_big, w.handle, backend_name(anyio_backend), n
        )
        with anyio.fail_after(60):
            await w.wait_readers()
            for i in range(n):
                arr = np.full(8 << 20, 7, dtype=np.int64)
                arr[0], arr[-1] = i, i + 1
                await w.put(arr)
            assert w.statistics().bytes_put >= n * (64 << 20)
    assert await anyio.to_thread.run_sync(children.join) == [0]


async def test_fragmented_message_in_process() -> None:
    with aioshmq.create(capacity=4096, serializer="raw") as w, aioshmq.connect(w.name) as r:
        big = bytes(range(256)) * 64  # 16 KiB through a 4 KiB ring
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.put, big)
            with anyio.fail_after(10):
                assert await r.get() == big
        w.put_nowait(b"small")
        assert r.get_nowait() == b"small"


async def test_put_nowait_of_a_fragmented_message_is_all_or_nothing() -> None:
    with aioshmq.create(capacity=8192, serializer="raw") as w, aioshmq.connect(w.name) as r:
        w.put_nowait(b"a" * 5000)  # fits the empty ring, in fragments
        with pytest.raises(aioshmq.Full):
            w.put_nowait(b"b" * 5000)
        assert r.get_nowait() == b"a" * 5000
        assert w.statistics().messages_put == 1
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()


async def test_cancelled_fragmented_put_is_never_delivered() -> None:
    with aioshmq.create(capacity=4096, serializer="raw") as w, aioshmq.connect(w.name) as r:
        with anyio.move_on_after(0.05) as scope:
            await w.put(b"x" * 20000)  # needs the reader to make progress: never completes
        assert scope.cancelled_caught
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()  # consumes the fragments that were published, delivers nothing
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.put, b"next")
            with anyio.fail_after(10):
                assert await r.get() == b"next"


async def test_reader_joining_mid_message_skips_it() -> None:
    with aioshmq.create(capacity=4096, readers=2, serializer="raw") as w:
        with aioshmq.connect(w.name, 0) as r0:
            aioshmq.connect(w.name, 1).close()  # slot 1 given up: readers there start at the head
            got: list[bytes] = []
            late_got: list[bytes] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.put, b"y" * 10000)
                await anyio.wait_all_tasks_blocked()
                late = aioshmq.connect(w.name, 1)  # joins while fragments are in flight

                async def read_late() -> None:
                    late_got.append(await late.get())

                tg.start_soon(read_late)
                with anyio.fail_after(10):
                    got.append(await r0.get())
                await w.put(b"after")
            late.close()
            assert got == [b"y" * 10000]
            assert late_got == [b"after"]
            assert await r0.get() == b"after"


def test_reader_attaching_during_an_unpublished_batch_is_not_overrun() -> None:
    """The writer's room is counted from the published head, where a new reader starts,
    even while records written after it wait to be published."""
    from aioshmq.ring.format import DETACHED
    from aioshmq.ring.layout import Frame

    with aioshmq.create(capacity=4096, readers=1, serializer="raw") as w:
        ring, gate, core = w._ring, w._ring.gate, w._ring.core
        with gate:
            gate.set(0, DETACHED)  # nobody is waited for
        frame = Frame(b"x" * 100, [])  # 128 bytes a record
        for _ in range(20):
            assert ring.try_write(frame)
        core.publish()
        head = core.head
        for _ in range(10):  # written, not published (a batch in progress)
            assert ring.try_write(frame)
        ring.attach(0)  # what the broker does for a reader attaching now: it starts at head
        while ring.try_write(frame):
            pass
        assert core.pos - head <= 4096, "the new reader's unread records were overwritten"


async def test_closing_during_an_atomic_batch_publishes_none_of_it() -> None:
    w = aioshmq.create(capacity=1 << 16, max_messages=4)
    with aioshmq.connect(w.name) as r:
        await w.put_many(["old1", "old2"])
        async with anyio.create_task_group() as tg:

            async def batch() -> None:
                with pytest.raises(anyio.ClosedResourceError):
                    await w.put_many(["A", "B", "C"])  # A and B fit now, C must wait

            tg.start_soon(batch)
            await anyio.wait_all_tasks_blocked()
            await w.aclose()
        assert [msg async for msg in r] == ["old1", "old2"]


async def test_sync_calls_refuse_to_interleave_with_a_waiting_async_call() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=1) as w, aioshmq.connect(w.name) as r:
        await w.put(0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.put_many, [1, 2])
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(anyio.BusyResourceError):
                await anyio.to_thread.run_sync(lambda: w.put_sync(99, timeout=1))
            assert r.get_nowait() == 0
            with anyio.fail_after(5):
                assert [await r.get(), await r.get()] == [1, 2]
        async with anyio.create_task_group() as tg:
            tg.start_soon(r.get)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(anyio.BusyResourceError):
                await anyio.to_thread.run_sync(lambda: r.get_sync(timeout=1))
            await w.put(3)


# -- corrupted shared memory ----------------------------------------------------------------


def _scribble(w: aioshmq.Writer[bytes], word: int, value: int) -> None:
    """Overwrite u64 word ``word`` of the data area, as a stray write would."""
    w._seg.data[word * 8 : word * 8 + 8] = value.to_bytes(8, "little")


@pytest.mark.parametrize(
    ("word", "value", "match"),
    [
        (0, (100 << 8) | 0x0E, "unknown record kind 0xe"),
        # A known kind with a flag it does not take, or a flag nobody takes: not a message.
        (0, (100 << 8) | 0x42, "unknown record kind 0x42"),
        (0, (100 << 8) | 0x82, "unknown record kind 0x82"),
        (0, (100 << 8) | L.LAST | L.BATCH, "unknown record kind 0x25"),
        (0, (96 << 8) | L.MSG | L.OOB, "buffer table claims 0 buffers"),
        (0, (1 << 40 << 8) | L.MSG, "past the end of the ring"),
        (0, (3000 << 8) | L.MSG, "past the head"),
        (0, (100 << 8) | L.PAD, "padding at position 0 of 100 bytes stops short"),
        (0, (64 << 8) | L.MSG | L.OOB, "buffer table claims"),
        (1, 1 << 60, "fragmented message at 0 claims"),
    ],
)
def test_scribbled_record(word: int, value: int, match: str) -> None:
    with aioshmq.create(capacity=4096, serializer="raw") as w, aioshmq.connect(w.name) as r:
        if match.startswith("fragmented"):
            w.put_nowait(b"f" * 3000)  # fragments: the first one's aux word is the total
        else:
            w.put_nowait(b"m" * 100)
            if "buffer table claims 0" in match:
                w._seg.data[16:24] = (0).to_bytes(8, "little")
            elif "buffer table" in match:
                w._seg.data[16:24] = (1 << 50).to_bytes(8, "little")
        _scribble(w, word, value)
        with pytest.raises(aioshmq.CorruptedError, match=match):
            r.get_nowait()
        for _ in range(3):  # still a clear error: no crash, no endless loop, no wild read
            with pytest.raises(aioshmq.CorruptedError):
                r.get_nowait()


def test_scribbled_buffer_lengths() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        w.put_nowait(np.arange(100))
        # Table: n, main length, buffer length; make the buffer overrun the message.
        w._seg.data[32:40] = (1 << 20).to_bytes(8, "little")
        with pytest.raises(aioshmq.CorruptedError, match="overruns"):
            r.get_nowait()
        w.put_nowait("next")
        assert r.get_nowait() == "next"  # the bad message was skipped, the ring goes on


def test_scribbled_head_and_tail() -> None:
    with aioshmq.create(capacity=4096, serializer="raw") as w, aioshmq.connect(w.name) as r:
        w.put_nowait(b"a")
        assert r.get_nowait() == b"a"
        words = w._seg.words
        head = w._layout.writer_word(L.W_HEAD)
        words[head] = 0  # the head moved backwards
        with pytest.raises(aioshmq.CorruptedError, match="behind reader 0's tail"):
            r.get_nowait()
        words[head] = 32
        tail = w._layout.reader_word(0, L.R_TAIL)
        words[tail] = 1 << 40  # a reader claims to have read what was never written
        with pytest.raises(aioshmq.CorruptedError, match="reader 0 claims position"):
            for _ in range(200):
                w.put_nowait(b"x" * 100)


def test_scribbled_header_refuses_attach() -> None:
    with aioshmq.create(capacity=4096) as w:
        w._seg.buf[0:8] = b"NOTARING"
        with pytest.raises(aioshmq.CorruptedError, match="bad magic"):
            aioshmq.connect(w.name)
        w._seg.buf[0:8] = L.MAGIC.to_bytes(8, "little")
        with aioshmq.connect(w.name):
            pass


def test_scribbled_head_far_ahead_is_refused_at_once() -> None:
    """A head scribbled far ahead must not make the reader walk stale records for ever."""
    with aioshmq.create(capacity=4096, serializer="raw") as w, aioshmq.connect(w.name) as r:
        for i in range(40):  # a few laps: the data area is full of old, valid records
            w.put_nowait(bytes([i]) * 200)
            assert r.get_nowait() == bytes([i]) * 200
        words = w._seg.words
        head = w._layout.writer_word(L.W_HEAD)
        words[head] = words[head] + (1 << 50)
        for _ in range(3):
            with pytest.raises(aioshmq.CorruptedError, match="more than a ring ahead"):
                r.get_nowait()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("total", [1 << 45, 1 << 31], ids=["huge", "2GiB"])
def test_scribbled_fragment_total_allocates_nothing(total: int) -> None:
    """A first fragment lying about its message's size is refused, without first allocating
    (and zero-filling) what it claims."""
    with aioshmq.create(capacity=4096, serializer="raw") as w, aioshmq.connect(w.name) as r:
        w.put_nowait(b"f" * 3000)  # fragments: the first one's aux word is the total
        _scribble(w, 1, total)
        before = _rss()
        with pytest.raises(aioshmq.CorruptedError, match=r"ended after|claims"):
            r.get_nowait()
        assert _rss() - before < 16 << 20
        w.put_nowait(b"next")
        assert r.get_nowait() == b"next"


def test_scribbled_fragment_length_is_refused() -> None:
    with aioshmq.create(capacity=4096, serializer="raw") as w, aioshmq.connect(w.name) as r:
        w.put_nowait(b"f" * 3000)
        _scribble(w, 0, (100 << 8) | L.FIRST)  # a first fragment is always a full one
        with pytest.raises(aioshmq.CorruptedError, match="fragments carry"):
            r.get_nowait()


def _at_offset(w: aioshmq.Writer[bytes], r: aioshmq.Reader[bytes], offset: int) -> None:
    """Move the ring's cursor to ``offset`` (a multiple of 16) with records every reader read."""
    while offset:
        size = min(offset, 2048)  # a whole record: at most half the ring
        if 0 < offset - size < L.HEADER_SIZE:
            size -= 32
        w.put_nowait(b"p" * (size - L.HEADER_SIZE))
        r.get_nowait()
        offset -= size


@pytest.mark.parametrize("serializer", ["raw", "pickle"])
def test_put_nowait_refuses_what_it_could_never_place(serializer: str) -> None:
    """A message larger than three fragments is a ValueError naming the limit, not a Full that
    a retry loop would retry for ever: a fourth fragment fits only at some positions of the
    cursor (not at 1040 in a 4096-byte ring), a fifth never.  Nothing is written, and the
    writer goes on; put sends it."""
    most = 3 * (4096 // 4 - L.HEADER_SIZE)
    big = b"b" * (most + 1 if serializer == "raw" else most)  # pickling adds a few bytes
    with aioshmq.create(capacity=4096, serializer=serializer) as w:
        with aioshmq.connect(w.name, spin=0) as r:
            _at_offset(w, r, 1040)
            put = w.statistics().messages_put
            for _ in range(2):  # a retry gets the same answer
                with pytest.raises(ValueError, match=rf"at most {most} bytes.*use put\(\)"):
                    w.put_nowait(big)
            with pytest.raises(ValueError, match="put_nowait"):
                w.put_nowait(b"f" * 5000)  # five fragments
            assert w.statistics().messages_put == put
            with pytest.raises(aioshmq.Empty):
                r.get_nowait()
            w.put_nowait(b"next")
            assert r.get_nowait() == b"next"
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                got = pool.submit(r.get_sync, 10)
                w.put_sync(big, timeout=10)
                assert got.result(10) == big


def test_put_nowait_places_three_fragments_wherever_the_cursor_lies() -> None:
    """The limit is exact: a message of three full fragments fits from every position of
    the cursor once the readers have read everything."""
    most = 3 * (4096 // 4 - L.HEADER_SIZE)
    for offset in range(0, 4096, 16):
        with aioshmq.create(capacity=4096, serializer="raw") as w:
            with aioshmq.connect(w.name, spin=0) as r:
                _at_offset(w, r, offset)
                w.put_nowait(b"m" * most)
                assert r.get_nowait() == b"m" * most, offset

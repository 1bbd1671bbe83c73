"""Writing in place: reserved ring memory, published whole at the end of its block or not at all."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import tracemalloc
from typing import Any

import anyio
import numpy as np
import pytest
from conftest import Children, backend_name, run_backend

import aioshmq

pytestmark = pytest.mark.anyio


async def test_reserved_bytes_arrive_as_written() -> None:
    with aioshmq.create(capacity=1 << 16, readers=2) as w:
        with aioshmq.connect(w.name, 0) as r0, aioshmq.connect(w.name, 1) as r1:
            await w.put("before")
            async with w.reserve(1000) as view:
                assert isinstance(view, memoryview) and not view.readonly and view.nbytes == 1000
                view[:] = bytes(range(200)) * 5
                assert w.statistics().messages_put == 1  # nothing published inside the block
            await w.put("after")
            assert await r0.get() == "before"
            got = await r0.get()
            assert isinstance(got, bytearray) and got == bytes(range(200)) * 5
            assert await r0.get() == "after"
            assert await r1.get() == "before"
            async with r1.lease() as leased:
                assert isinstance(leased, memoryview) and leased.readonly
                assert leased == bytes(range(200)) * 5
            assert await r1.get() == "after"


async def test_the_view_is_released_at_the_end_of_the_block() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        async with w.reserve(16) as view:
            view[:] = b"0123456789abcdef"
        with pytest.raises(ValueError, match="released"):
            view[0] = 1  # the ring's memory is no longer the caller's to write
        assert await r.get() == b"0123456789abcdef"


@pytest.mark.parametrize("serializer", ["raw", "msgpack"])
async def test_reserve_with_other_serializers_hands_loads_the_bytes(serializer: str) -> None:
    pytest.importorskip("msgspec")
    import msgspec

    payload = b"raw bytes" if serializer == "raw" else msgspec.msgpack.encode({"a": [1, 2]})
    with aioshmq.create(capacity=1 << 16, serializer=serializer) as w:
        with aioshmq.connect(w.name) as r:
            async with w.reserve(len(payload)) as view:
                view[:] = payload
            got = await r.get()
            assert got == (payload if serializer == "raw" else {"a": [1, 2]})


async def test_reserve_array_fills_a_numpy_array_in_place() -> None:
    with aioshmq.create(capacity=1 << 20, readers=2) as w:
        with aioshmq.connect(w.name, 0) as r0, aioshmq.connect(w.name, 1) as r1:
            async with w.reserve_array((64, 33), np.float32) as arr:
                assert arr.shape == (64, 33) and arr.dtype == np.float32 and arr.flags.writeable
                arr[...] = np.arange(64 * 33, dtype=np.float32).reshape(64, 33)
            async with w.reserve_array(5, "int64") as arr:
                arr[:] = [5, 4, 3, 2, 1]
            expected = np.arange(64 * 33, dtype=np.float32).reshape(64, 33)
            got = await r0.get()
            assert got.dtype == np.float32 and np.array_equal(got, expected)
            got[...] = 0  # a copy of its own
            assert (await r0.get()).tolist() == [5, 4, 3, 2, 1]
            async with r1.lease() as leased:
                assert np.array_equal(leased, expected) and not leased.flags.writeable
            assert (await r1.get()).tolist() == [5, 4, 3, 2, 1]


async def test_reserve_array_of_a_torch_dtype_makes_a_tensor() -> None:
    torch = pytest.importorskip("torch")
    with aioshmq.create(capacity=1 << 20) as w, aioshmq.connect(w.name) as r:
        async with w.reserve_array((3, 4), torch.bfloat16) as t:
            assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
            t.copy_(torch.arange(12, dtype=torch.bfloat16).reshape(3, 4))
        async with w.reserve_array((0, 4), torch.float32) as t:
            assert t.shape == (0, 4)
        got = await r.get()
        assert got.dtype == torch.bfloat16 and got.shape == (3, 4)
        assert torch.equal(got, torch.arange(12, dtype=torch.bfloat16).reshape(3, 4))
        empty = await r.get()
        assert empty.shape == (0, 4) and empty.dtype == torch.float32


async def test_zero_bytes() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        async with w.reserve(0) as view:
            assert view.nbytes == 0
        async with w.reserve_array((0,), np.uint8) as arr:
            assert arr.size == 0
        assert await r.get() == b""
        got = await r.get()
        assert got.shape == (0,) and got.dtype == np.uint8


async def test_a_block_that_raises_publishes_nothing() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(KeyError):
            async with w.reserve(100) as view:
                view[:] = b"x" * 100
                raise KeyError("the producer failed")
        stats = w.statistics()
        assert stats.messages_put == 0 and stats.messages_in_ring == 0
        assert stats.bytes_in_ring == 0
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()
        await w.put("next")  # the writer goes on as if the reservation never began
        assert await r.get() == "next"


async def test_a_block_cancelled_publishes_nothing() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with anyio.CancelScope() as scope:
            async with w.reserve_array(10, np.int32) as arr:
                arr[:] = 7
                scope.cancel()
                await anyio.sleep(1)  # a checkpoint: the cancellation lands here
        assert scope.cancelled_caught
        assert w.statistics().messages_in_ring == 0
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()
        await w.put("next")
        assert await r.get() == "next"


async def test_waits_for_room_under_the_bytes_bound_and_can_be_cancelled_there() -> None:
    with aioshmq.create(capacity=4096, max_messages=1000, serializer="raw") as w:
        with aioshmq.connect(w.name) as r:
            while True:  # fill every byte
                try:
                    w.put_nowait(b"f" * 100)
                except aioshmq.Full:
                    break
            with anyio.move_on_after(0.05) as scope:
                async with w.reserve(100):
                    pytest.fail("reserved room in a full ring")
            assert scope.cancelled_caught and w.statistics().tasks_waiting_send == 0

            entered = anyio.Event()

            async def writer() -> None:
                async with w.reserve(1000) as view:  # needs the room of 8 records
                    entered.set()
                    view[:] = b"r" * 1000

            async with anyio.create_task_group() as tg:
                tg.start_soon(writer)
                await anyio.wait_all_tasks_blocked()
                assert not entered.is_set() and w.statistics().tasks_waiting_send == 1
                got = [r.get_nowait() for _ in range(4)]  # room for 4 records: not enough
                await anyio.wait_all_tasks_blocked()
                assert not entered.is_set()
                got += [r.get_nowait() for _ in range(4096 // 128 - 4)]
                with anyio.fail_after(10):
                    await entered.wait()
            assert got == [b"f" * 100] * (4096 // 128)
            assert r.get_nowait() == b"r" * 1000


async def test_waits_for_room_under_the_message_bound() -> None:
    with aioshmq.create(capacity=1 << 20, max_messages=2) as w, aioshmq.connect(w.name) as r:
        await w.put(0)
        await w.put(1)
        entered = anyio.Event()

        async def writer() -> None:
            async with w.reserve_array(3, np.int16) as arr:
                entered.set()
                arr[:] = [1, 2, 3]

        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            await anyio.wait_all_tasks_blocked()
            assert not entered.is_set()
            assert r.get_nowait() == 0
            with anyio.fail_after(10):
                await entered.wait()
        assert r.get_nowait() == 1
        assert r.get_nowait().tolist() == [1, 2, 3]


async def test_other_puts_wait_for_the_block_and_keep_their_order() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        put_done = anyio.Event()

        async def put() -> None:
            await w.put("second")
            put_done.set()

        async with anyio.create_task_group() as tg:
            async with w.reserve(5) as view:
                tg.start_soon(put)
                await anyio.wait_all_tasks_blocked()
                assert not put_done.is_set()  # the writer is the block's until it ends
                view[:] = b"first"
        assert await r.get() == b"first"
        assert await r.get() == "second"


async def test_too_big_for_one_record_is_refused_and_loses_nothing() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(ValueError, match=r"at most .* bytes .* not 40000"):
            w.reserve(40_000)
        with pytest.raises(ValueError, match="one record"):
            w.reserve_array((10_000,), np.float64)
        await w.put("next")
        assert await r.get() == "next"


@pytest.mark.parametrize("shape", [(1 << 40,), (1 << 28,), (1 << 21, 1 << 21, 1 << 21)])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_reserve_array_refuses_a_huge_shape_before_making_anything(
    kind: str, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 TiB (or 2 GiB, or more than a 64-bit size) for a 64 KiB ring: reserve()'s ValueError,
    before the serializer makes the placeholder array it pickles, which would take as much
    memory as the array would."""
    if kind == "torch":
        torch = pytest.importorskip("torch")
        dtype: Any = torch.int64
    else:
        dtype = np.int64
    from aioshmq.serialize import tensors
    from aioshmq.serialize.pickling import PickleSerializer

    made: list[tuple[int, ...]] = []
    placeholder, array_header = tensors.placeholder, PickleSerializer.array_header
    monkeypatch.setattr(tensors, "placeholder", lambda d, s: made.append(s) or placeholder(d, s))
    monkeypatch.setattr(
        PickleSerializer,
        "array_header",
        lambda self, d, s: made.append(s) or array_header(self, d, s),
    )
    nbytes = 8
    for n in shape:
        nbytes *= n
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        tracemalloc.start()
        try:
            refused = rf"one record, at most \d+ bytes .* not {nbytes};"
            with pytest.raises(ValueError, match=refused):
                w.reserve_array(shape, dtype)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert made == []
        assert peak < 1 << 20
        with w.reserve_array((4,), dtype) as arr:  # the writer goes on
            arr[:] = 7
        assert r.get_nowait().tolist() == [7, 7, 7, 7]
        assert made == [(4,)]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda w: w.reserve(-1), ValueError, "number of bytes >= 0, not -1"),
        (lambda w: w.reserve(1.5), ValueError, "not 1.5"),
        (lambda w: w.reserve(True), ValueError, "not True"),
        (lambda w: w.reserve_array((2, -1), np.uint8), ValueError, r"sizes >= 0, not \(2, -1\)"),
        (lambda w: w.reserve_array(3, object), TypeError, "Python objects"),
        (lambda w: w.reserve_array(3, "no such dtype"), TypeError, "no such dtype"),
    ],
)
async def test_bad_arguments_are_named(call: Any, error: type[Exception], match: str) -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(error, match=match):
            call(w)
        await w.put("next")
        assert await r.get() == "next"


async def test_reserve_array_needs_a_pickle_serializer() -> None:
    with aioshmq.create(capacity=1 << 16, serializer="raw") as w:
        with pytest.raises(TypeError, match=r"pickle or cloudpickle serializer; .* 'raw'"):
            w.reserve_array(3, np.uint8)


async def test_closed_during_the_block() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(anyio.ClosedResourceError):
            async with w.reserve(8) as view:
                view[:] = b"abcdefgh"  # the mapping stays until the block ends
                w.close()
        with pytest.raises(anyio.EndOfStream):
            r.get_nowait()
    with pytest.raises(anyio.ClosedResourceError):
        w.reserve(8)


def test_sync_form_with_timeout() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=1) as w, aioshmq.connect(w.name) as r:
        with w.reserve(3, timeout=1) as view:
            view[:] = b"one"
            with pytest.raises(anyio.BusyResourceError, match="reservation"):
                w.put_sync("meanwhile")  # the block holds the writer
        with pytest.raises(TimeoutError):
            with w.reserve(3, timeout=0.05):
                pytest.fail("reserved room in a full ring")
        assert r.get_sync(timeout=1) == b"one"
        with pytest.raises(RuntimeError, match="failed"):
            with w.reserve_array(2, np.uint8, timeout=1) as arr:
                arr[:] = 1
                raise RuntimeError("failed")
        with w.reserve_array(2, np.uint8, timeout=1) as arr:
            arr[:] = 2
        assert r.get_sync(timeout=1).tolist() == [2, 2]
        w.put_sync("last", timeout=1)
        assert r.get_sync(timeout=1) == "last"


def test_sync_form_waits_for_a_reader_in_another_thread() -> None:
    with aioshmq.create(capacity=1 << 16, max_messages=1) as w, aioshmq.connect(w.name) as r:
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.extend(r.get_sync(timeout=10) for _ in range(20)))
        t.start()
        for i in range(20):
            with w.reserve_array(1, np.int64, timeout=10) as arr:
                arr[0] = i
        t.join(20)
        assert [int(a[0]) for a in got] == list(range(20))


async def test_sync_form_refused_inside_an_event_loop() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(RuntimeError, match="async with"):
            with w.reserve(3):
                pass
        async with w.reserve(3) as view:  # and the refusal left nothing held
            view[:] = b"abc"
        assert await r.get() == b"abc"


def _read_reserved(name: str, backend: str, out: Any) -> None:
    async def main() -> None:
        with aioshmq.connect(name) as r:
            got = await r.get()
            out.send((got.dtype.str, got.shape, int(got.sum())))
            async with r.lease() as leased:
                out.send((type(leased).__name__, bytes(leased)))

    run_backend(backend, main)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn"])
async def test_a_reader_in_another_process(
    anyio_backend: object, method: str, children: Children
) -> None:
    ctx = multiprocessing.get_context(method)
    ours, theirs = ctx.Pipe()
    with aioshmq.create(capacity=1 << 22) as w:
        await anyio.to_thread.run_sync(
            children.start, method, _read_reserved, w.name, backend_name(anyio_backend), theirs
        )
        with anyio.fail_after(30):
            await w.wait_readers()
            async with w.reserve_array((256, 256), np.uint16) as arr:
                arr[...] = 3
            async with w.reserve(4) as view:
                view[:] = b"done"
            assert await anyio.to_thread.run_sync(ours.recv) == ("<u2", (256, 256), 3 * 65536)
            assert await anyio.to_thread.run_sync(ours.recv) == ("memoryview", b"done")
        assert await anyio.to_thread.run_sync(children.join) == [0]
    ours.close()
    theirs.close()


def test_reserved_bytes_load_as_a_bare_buffer_would() -> None:
    from aioshmq.serialize.pickling import PickleSerializer

    ser = PickleSerializer()
    main = ser.buffer_header()
    assert pickle.loads(main, buffers=[bytearray(b"xyz")]) == bytearray(b"xyz")

"""Serializers: pickle protocol 5 with out-of-band buffers, cloudpickle, raw bytes, custom."""

from __future__ import annotations

import pickle
from typing import Any

import anyio
import numpy as np
import pytest

import aioshmq
from aioshmq._serialize import PickleSerializer, resolve

pytestmark = pytest.mark.anyio


def test_pickle_puts_numpy_buffers_out_of_band() -> None:
    arr = np.arange(1000, dtype=np.float64)
    main, buffers = PickleSerializer().dumps({"a": arr})
    assert len(buffers) == 1 and buffers[0].nbytes == arr.nbytes
    assert len(main) < 1000  # the array's bytes are not in the pickle stream


async def test_numpy_arrays_arrive_intact_and_writable() -> None:
    with aioshmq.create(capacity=1 << 20) as w, aioshmq.connect(w.name) as r:
        arrays = [
            np.arange(10_000, dtype=np.int64),
            np.ones((64, 33), dtype=np.float32),
            np.asfortranarray(np.arange(60).reshape(6, 10)),
            np.arange(100)[::3],  # not contiguous: goes in-band
            np.array([], dtype=np.uint8),
        ]
        await w.put_many([(i, a) for i, a in enumerate(arrays)])
        for i, a in enumerate(arrays):
            j, got = await r.get()
            assert j == i and got.dtype == a.dtype and np.array_equal(got, a)
            got[...] = 0  # a copy out of the ring: writable, and the ring is untouched
        await w.put(arrays[0])
        assert np.array_equal(await r.get(), arrays[0])


def test_array_pickles_reused_per_dtype_and_shape_load_as_pickle_would() -> None:
    ser = PickleSerializer()
    cases = [
        np.arange(12, dtype=np.int32),
        np.arange(12, dtype=np.int32)[::-1].copy(),  # same dtype and shape, other data
        np.arange(12, dtype=np.int32).reshape(3, 4),  # same dtype, other shape
        np.arange(12, dtype=np.float64),  # same shape, other dtype
        np.arange(12, dtype=">i4"),  # not native: the plain pickle path
        np.asfortranarray(np.arange(12).reshape(3, 4)),  # not C-contiguous
        np.zeros(3, dtype=[("a", "i4"), ("b", "f8")]),  # structured
        np.array([1, "x", None], dtype=object),  # in-band
        np.float64(2.5),  # a numpy scalar, not an array
    ]
    for _ in range(2):  # the second round is served by the cache
        for arr in cases:
            main, buffers = ser.dumps(arr)
            reference_buffers: list[pickle.PickleBuffer] = []
            reference = pickle.dumps(arr, protocol=5, buffer_callback=reference_buffers.append)
            assert bytes(main) == reference
            assert [bytes(b) for b in buffers] == [bytes(b.raw()) for b in reference_buffers]
            got = pickle.loads(main, buffers=buffers)
            assert type(got) is type(arr) and got.dtype == arr.dtype
            assert got.shape == arr.shape and np.array_equal(got, arr)
    for n in range(200):  # more shapes than the cache holds: it stays bounded
        arr = np.full(n, n, dtype=np.uint16)
        main, buffers = ser.dumps(arr)
        assert np.array_equal(pickle.loads(main, buffers=buffers), arr)
    assert len(ser._arrays) <= 64


async def test_out_of_band_buffers_are_aligned_in_the_ring() -> None:
    with aioshmq.create(capacity=1 << 20) as w, aioshmq.connect(w.name) as r:
        await w.put(("x" * 3, np.arange(5, dtype=np.complex128)))
        from aioshmq._ring import decode

        payload, kind, _ = r._ring.next()  # type: ignore[misc]
        _, buffers = decode(payload, kind)
        base = np.frombuffer(r._seg.data, dtype=np.uint8).ctypes.data
        offset = np.frombuffer(buffers[0], dtype=np.uint8).ctypes.data - base
        assert offset % 16 == 0
        assert np.array_equal((await r.get())[1], np.arange(5, dtype=np.complex128))


async def test_cloudpickle_sends_lambdas() -> None:
    with aioshmq.create(capacity=1 << 16, serializer="cloudpickle") as w:
        with aioshmq.connect(w.name) as r:
            k = 7
            await w.put(lambda x: x * k)
            fn = await r.get()
            assert fn(6) == 42


async def test_raw_bytes_in_bytes_out() -> None:
    with aioshmq.create(capacity=1 << 16, serializer="raw") as w, aioshmq.connect(w.name) as r:
        await w.put(b"abc")
        await w.put(bytearray(b"de"))
        await w.put(memoryview(np.arange(4, dtype=np.int32)))
        assert await r.get() == b"abc"
        assert await r.get() == b"de"
        assert await r.get() == np.arange(4, dtype=np.int32).tobytes()
        with pytest.raises(TypeError, match="bytes-like"):
            await w.put("text")
        with pytest.raises(ValueError, match="contiguous"):
            await w.put(memoryview(np.arange(10)[::2]))
        await w.put(b"still fine")
        assert await r.get() == b"still fine"


class _Json:
    def dumps(self, obj: Any) -> bytes:
        import json

        return json.dumps(obj).encode()

    def loads(self, data: bytes) -> Any:
        import json

        return json.loads(data)


async def test_custom_serializer() -> None:
    with aioshmq.create(capacity=1 << 16, serializer=_Json()) as w:
        with aioshmq.connect(w.name, serializer=_Json()) as r:
            await w.put({"a": [1, 2]})
            assert await r.get() == {"a": [1, 2]}
            with pytest.raises(TypeError):
                await w.put({1, 2})  # json cannot encode a set
            await w.put("ok")
            assert await r.get() == "ok"


def test_custom_serializer_needs_callables() -> None:
    class Half:
        dumps = staticmethod(pickle.dumps)
        loads = "not callable"

    with pytest.raises(TypeError, match="callable dumps and loads"):
        resolve(Half())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        aioshmq.create(serializer=Half())  # type: ignore[arg-type]


class _BadLoads:
    def __reduce__(self) -> Any:
        return (_explode, ())


def _explode() -> None:
    raise RuntimeError("cannot rebuild this")


async def test_a_message_that_fails_to_load_is_reported_and_skipped() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        for obj in (1, _BadLoads(), 3):
            await w.put(obj)
        assert await r.get() == 1
        with pytest.raises(RuntimeError, match="cannot rebuild"):
            await r.get()
        assert await r.get() == 3


async def test_get_many_keeps_what_it_read_before_a_bad_message() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        for obj in (1, 2, _BadLoads(), 4):
            await w.put(obj)
        assert await r.get_many() == [1, 2]
        with pytest.raises(RuntimeError, match="cannot rebuild"):
            await r.get_many()
        assert await r.get_many() == [4]


async def test_put_many_is_one_pickle() -> None:
    """A batch travels as one pickled list: one record, unpacked into its messages."""
    with aioshmq.create(capacity=1 << 16, max_messages=10) as w, aioshmq.connect(w.name) as r:
        await w.put_many([{"n": i} for i in range(10)])  # ten messages: max_messages reached
        s = w.statistics()
        assert (s.messages_put, s.messages_in_ring) == (10, 10)
        with pytest.raises(aioshmq.Full):
            w.put_nowait("no room by count")
        assert r.get_nowait() == {"n": 0}
        rs = r.statistics()
        assert (rs.messages_available, rs.messages_received) == (9, 1)
        assert w.statistics().messages_in_ring == 0  # the record was read whole
        assert await r.get_many(max_messages=4) == [{"n": i} for i in range(1, 5)]
        got = await anyio.to_thread.run_sync(lambda: [r.get_sync(timeout=1) for _ in range(5)])
        assert got == [{"n": i} for i in range(5, 10)]
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()


async def test_a_batch_that_fails_to_load_is_reported_once() -> None:
    """One message of a batch that cannot be rebuilt fails the batch: the error is raised
    once, and the stream goes on with the next put."""
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put_many([1, _BadLoads(), 3])
        await w.put("after")
        with pytest.raises(RuntimeError, match="cannot rebuild"):
            await r.get()
        assert await r.get() == "after"


def test_buffers_go_out_of_band_and_non_contiguous_ones_are_refused() -> None:
    ser = PickleSerializer()
    contiguous = pickle.PickleBuffer(bytearray(b"xyz"))
    main, buffers = ser.dumps([contiguous, b"in-band bytes"])
    assert [bytes(b) for b in buffers] == [b"xyz"]
    got = pickle.loads(main, buffers=buffers)
    assert bytes(got[0]) == b"xyz" and got[1] == b"in-band bytes"
    strided = pickle.PickleBuffer(memoryview(bytearray(b"abcdefgh"))[::2])
    try:
        ser.dumps([strided])  # as plain pickle does: a clear error, nothing half-made
    except aioshmq.SerializationError as exc:
        # Checked here, not kept: a traceback that keeps a non-contiguous PickleBuffer in a
        # reference cycle crashes CPython 3.11's garbage collector (in picklebuf_clear).
        assert "non-contiguous" in str(exc) and isinstance(exc.__cause__, pickle.PicklingError)
    else:
        raise AssertionError("a non-contiguous buffer was serialized")


async def test_cloudpickle_sends_numpy_arrays_out_of_band() -> None:
    with (
        aioshmq.create(capacity=1 << 20, serializer="cloudpickle") as w,
        aioshmq.connect(w.name) as r,
    ):
        for _ in range(2):  # the second is served by the reused stream pickle
            arr = np.arange(50_000, dtype=np.int32)
            await w.put(arr)
            got = await r.get()
            assert got.dtype == arr.dtype and np.array_equal(got, arr)
            main, buffers = w._ser.dumps(arr)
            assert len(buffers) == 1 and len(main) < 1000


def _local_function() -> Any:
    def inner() -> None:
        pass

    return inner


@pytest.mark.parametrize(
    ("obj", "hint"),
    [
        (lambda: 1, True),
        (_local_function(), True),
        ([1, {"f": lambda: 2}], True),
        (__import__("threading").Lock(), False),
    ],
    ids=["lambda", "local function", "nested lambda", "lock"],
)
def test_what_cannot_be_pickled_is_named(obj: object, hint: bool) -> None:
    """One error type for everything pickle refuses (it raises three), saying what failed
    and, for functions, what to use instead; pickle's own error is the cause."""
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(aioshmq.SerializationError) as caught:
            w.put_nowait(obj)
        text = str(caught.value)
        assert f"cannot serialize {type(obj).__qualname__} object" in text
        assert ("serializer='cloudpickle'" in text) == hint
        assert caught.value.__cause__ is not None
        assert isinstance(caught.value, TypeError)  # what callers caught before
        del caught
        w.put_nowait("next")  # nothing was written: the ring goes on
        assert r.get_nowait() == "next"


@pytest.mark.anyio
async def test_put_many_names_the_object_that_cannot_be_pickled(anyio_backend: object) -> None:
    import threading

    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        try:
            await w.put_many([1, 2, threading.Lock(), 4])
        except aioshmq.SerializationError as exc:
            assert "lock object" in str(exc)
            assert any("object 2 of the 4" in note for note in exc.__notes__)
        else:
            raise AssertionError("an unpicklable batch was sent")
        assert w.statistics().messages_put == 0
        await w.put_many([5, 6])
        assert await r.get_many() == [5, 6]

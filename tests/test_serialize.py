"""Serializers: pickle protocol 5 with out-of-band buffers, cloudpickle, raw bytes, custom."""

from __future__ import annotations

import pickle
from typing import Any

import anyio
import numpy as np
import pytest

import aioshmq
from aioshmq.serialize.pickling import PickleSerializer
from aioshmq.serialize.resolve import resolve

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
        from aioshmq.ring.layout import decode

        payload, kind, _, _ = r._ring.next()  # type: ignore[misc]
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


class _Blob:
    """A user type whose payload a reducer sends out of band."""

    def __init__(self, tag: str, data: bytes | bytearray | memoryview) -> None:
        self.tag = tag
        self.data = data


def _rebuild_blob(tag: str, data: Any) -> _Blob:
    return _Blob(tag, data)


def _reduce_blob(blob: _Blob) -> tuple[Any, ...]:
    return _rebuild_blob, (blob.tag, pickle.PickleBuffer(blob.data))


def test_a_registered_reducer_sends_buffers_out_of_band_for_this_serializer_alone() -> None:
    blob = _Blob("x", bytes(range(256)) * 64)
    ser = PickleSerializer(reducers={_Blob: _reduce_blob})
    main, buffers = ser.dumps({"b": blob})
    assert [b.nbytes for b in buffers] == [len(blob.data)] and len(main) < 500
    assert PickleSerializer().dumps(blob)[1] == []  # other serializers, and copyreg, untouched
    assert len(pickle.dumps(blob, protocol=5)) > len(blob.data)
    late = PickleSerializer()
    late.register(_Blob, _reduce_blob)
    assert len(late.dumps(blob)[1]) == 1


async def test_reducers_through_the_ring_put_and_put_many() -> None:
    ser = PickleSerializer(reducers={_Blob: _reduce_blob})
    with aioshmq.create(capacity=1 << 20, serializer=ser) as w, aioshmq.connect(w.name) as r:
        payload = bytes(range(256)) * 64
        await w.put(_Blob("one", payload))
        await w.put_many([_Blob("two", payload), _Blob("three", b"")])
        got = await r.get()  # the reader registered nothing: pickle finds _rebuild_blob
        assert got.tag == "one" and got.data == payload
        assert [(b.tag, bytes(b.data)) for b in await r.get_many()] == [
            ("two", payload),
            ("three", b""),
        ]
        await w.put(_Blob("leased", payload))
        async with r.lease() as leased:
            assert isinstance(leased.data, memoryview) and leased.data.readonly
            assert leased.data == payload


def _failing_reducer(blob: _Blob) -> tuple[Any, ...]:
    raise ValueError(f"cannot reduce blob {blob.tag}")


async def test_a_reducer_that_fails_is_named_and_loses_nothing() -> None:
    ser = PickleSerializer(reducers={_Blob: _failing_reducer})
    with aioshmq.create(capacity=1 << 16, serializer=ser) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(aioshmq.SerializationError, match="cannot reduce blob bad"):
            await w.put([1, _Blob("bad", b"x")])
        await w.put([1, 2])  # the reused pickler starts clean after the failure
        assert await r.get() == [1, 2]


def test_a_reducer_may_pickle_with_the_same_serializer() -> None:
    ser = PickleSerializer()

    def nested(blob: _Blob) -> tuple[Any, ...]:
        inner, buffers = ser.dumps({"tag": blob.tag})  # the pickler is busy: a fresh one
        assert buffers == []
        return _rebuild_blob, (pickle.loads(inner)["tag"], bytes(blob.data))

    ser.register(_Blob, nested)
    main, _ = ser.dumps([_Blob("a", b"1"), _Blob("b", b"2")])
    assert [(b.tag, b.data) for b in pickle.loads(main)] == [("a", b"1"), ("b", b"2")]


def test_register_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="registered for types"):
        PickleSerializer(reducers={"_Blob": _reduce_blob})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="must be callable"):
        PickleSerializer().register(_Blob, "no")  # type: ignore[arg-type]


async def test_cloudpickle_with_reducers_still_sends_lambdas() -> None:
    pytest.importorskip("cloudpickle")
    from aioshmq.serialize.pickling import CloudpickleSerializer

    ser = CloudpickleSerializer(reducers={_Blob: _reduce_blob})
    with aioshmq.create(capacity=1 << 20, serializer=ser) as w, aioshmq.connect(w.name) as r:
        await w.put((lambda x: x * 3, _Blob("c", b"z" * 4096)))
        fn, blob = await r.get()
        assert fn(2) == 6 and blob.data == b"z" * 4096
        assert len(ser.dumps(_Blob("c", b"z" * 4096))[1]) == 1


class _Frames:
    """A user format with buffers of its own: a header of lengths, then the raw parts."""

    out_of_band = True

    def __init__(self) -> None:
        self.loaded: list[tuple[type, list[type]]] = []

    def dumps(self, obj: Any) -> Any:
        if obj == "not a pair":
            return b"header only"
        if obj == "bad buffers":
            return b"h", b"not a list"
        if obj == "bad buffer":
            return b"h", [b"ok", 12]
        if obj == "strided":
            return b"h", [memoryview(np.arange(10)[::2])]
        if obj == "bad header":
            return "text", []
        return ",".join(str(memoryview(p).nbytes) for p in obj).encode(), list(obj)

    def loads(self, header: Any, buffers: Any) -> Any:
        self.loaded.append((type(header), [type(b) for b in buffers]))
        sizes = [int(n) for n in bytes(header).decode().split(",") if n]
        assert sizes == [memoryview(b).nbytes for b in buffers]
        return buffers


async def test_an_out_of_band_custom_serializer() -> None:
    ser = _Frames()
    parts = [b"a" * 100_000, np.arange(1000, dtype=np.float64), bytearray(b"")]
    with aioshmq.create(capacity=1 << 20, serializer=ser) as w:
        with aioshmq.connect(w.name, serializer=ser) as r:
            main, buffers = resolve(ser).dumps(parts)
            assert bytes(main) == b"100000,8000,0" and [b.nbytes for b in buffers] == [
                100_000,
                8000,
                0,
            ]
            await w.put(parts)
            got = await r.get()
            assert [bytes(b) for b in got] == [bytes(memoryview(p).cast("B")) for p in parts]
            assert ser.loaded[-1][0] is bytes and set(ser.loaded[-1][1]) <= {bytes, bytearray}
            await w.put(parts)
            async with r.lease() as views:
                assert all(isinstance(v, memoryview) and v.readonly for v in views)
                assert bytes(views[0]) == parts[0]
            assert ser.loaded[-1][0] is memoryview
            await w.put([])
            assert await r.get() == []


@pytest.mark.parametrize(
    ("obj", "error", "match"),
    [
        ("not a pair", TypeError, r"_Frames.dumps returned bytes: .* \(header, buffers\) pair"),
        ("bad buffers", TypeError, "returned bytes as its buffers, not a sequence"),
        ("bad buffer", TypeError, "returned int as buffer 1, not a bytes-like object"),
        ("strided", ValueError, "non-contiguous buffer as buffer 0"),
        ("bad header", TypeError, "returned str as its header"),
    ],
)
async def test_an_out_of_band_serializer_returning_the_wrong_thing(
    obj: str, error: type[Exception], match: str
) -> None:
    ser = _Frames()
    with aioshmq.create(capacity=1 << 16, serializer=ser) as w:
        with aioshmq.connect(w.name, serializer=ser) as r:
            with pytest.raises(error, match=match):
                await w.put(obj)
            await w.put([b"fine"])
            assert await r.get() == [b"fine"]


@pytest.mark.parametrize("cls", [dict, list, tuple, str, bytes, int, float, bool, type(None), set])
def test_a_reducer_for_a_type_pickle_writes_itself_is_refused(cls: type) -> None:
    """pickle asks no reducer about exact instances of its own types: a reducer registered
    for one would be ignored, so it is refused, saying what to register instead."""
    with pytest.raises(TypeError, match=f"pickle writes {cls.__qualname__} values itself"):
        PickleSerializer(reducers={cls: lambda obj: (cls, ())})
    with pytest.raises(TypeError, match="subclass"):
        aioshmq.CloudpickleSerializer().register(cls, lambda obj: (cls, ()))


class _Counted(dict):  # type: ignore[type-arg]
    pass


def _counted(items: list[Any]) -> tuple[str, dict[Any, Any]]:
    return "rebuilt", dict(items)


async def test_a_reducer_for_a_subclass_of_a_builtin_is_used() -> None:
    ser = PickleSerializer(reducers={_Counted: lambda d: (_counted, (list(d.items()),))})
    with aioshmq.create(capacity=1 << 16, serializer=ser) as w, aioshmq.connect(w.name) as r:
        await w.put(_Counted(a=1))
        await w.put({"a": 1})  # a plain dict is pickle's own
        assert await r.get() == ("rebuilt", {"a": 1})
        assert await r.get() == {"a": 1}


def _not_an_array(value: int) -> tuple[str, int]:
    return "not an array", value


def _named_like_an_array(name: str, module: str) -> Any:
    """A class that calls itself numpy's ndarray without being it (derived from object, as
    numpy's is)."""

    def init(self: Any, value: int) -> None:
        self.value = value

    def reduce(self: Any) -> Any:
        return (_not_an_array, (self.value,))

    return type(name, (), {"__module__": module, "__init__": init, "__reduce__": reduce})


async def test_an_object_of_a_class_named_numpy_ndarray_is_pickled_as_any_other() -> None:
    """Only numpy's own ndarray goes the arrays' way: a class that only has its name (by
    module and qualified name, or as its type's C name) is pickled like any object, on
    either core."""
    by_module = _named_like_an_array("ndarray", "numpy")
    by_c_name = _named_like_an_array("numpy.ndarray", __name__)
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put(by_module(1))
        await w.put(by_c_name(2))
        w.put_nowait(by_module(3))
        assert [await r.get() for _ in range(3)] == [("not an array", v) for v in (1, 2, 3)]
        await w.put(np.arange(3))  # numpy's own still goes out of band
        assert np.array_equal(await r.get(), np.arange(3))

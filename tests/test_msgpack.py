"""The msgspec serializer: MessagePack, typed decoding, arrays and tensors out of band."""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import pytest

import aioshmq

msgspec = pytest.importorskip("msgspec")
pytestmark = pytest.mark.anyio


class Point(msgspec.Struct):
    x: int
    y: float
    data: Any = None


async def test_plain_messages_by_name() -> None:
    with aioshmq.create(capacity=1 << 16, serializer="msgpack") as w, aioshmq.connect(w.name) as r:
        msgs: list[Any] = [{"a": [1, 2.5, "x", None, True]}, [b"bytes", {"k": {}}], "s", 7]
        for msg in msgs:
            await w.put(msg)
        assert [await r.get() for _ in msgs] == msgs
        await w.put_many(msgs)
        assert await r.get_many() == msgs


async def test_typed_decoding_with_the_same_serializer() -> None:
    from aioshmq import MsgpackSerializer

    ser = MsgpackSerializer(Point)
    with aioshmq.create(capacity=1 << 16, readers=2, serializer=ser) as w:
        with (
            aioshmq.connect(w.name, 0, serializer=ser) as typed,
            aioshmq.connect(w.name, 1) as plain,
        ):
            await w.put(Point(1, 2.5))
            assert await typed.get() == Point(1, 2.5)
            assert await plain.get() == {"x": 1, "y": 2.5, "data": None}  # by name: untyped


async def test_a_message_of_the_wrong_type_is_reported_and_skipped() -> None:
    from aioshmq import MsgpackSerializer

    with aioshmq.create(capacity=1 << 16, serializer="msgpack") as w:
        with aioshmq.connect(w.name, serializer=MsgpackSerializer(Point)) as r:
            await w.put({"x": "not an int", "y": 1.0})
            await w.put({"x": 3, "y": 1.0})
            with pytest.raises(msgspec.ValidationError, match="Expected `int`"):
                await r.get()
            assert await r.get() == Point(3, 1.0)


async def test_numpy_arrays_travel_out_of_band() -> None:
    from aioshmq import MsgpackSerializer

    arrays = [
        np.arange(10_000, dtype=np.float64).reshape(100, 100),
        np.arange(12, dtype=np.int16).reshape(3, 4).T,  # not contiguous: made so, once
        np.array(["2020-01-01", "2021-06-30"], dtype="datetime64[D]"),
        np.zeros((0, 3), dtype=np.complex64),
        np.array(5, dtype=np.uint8),
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
    ]
    main, buffers = MsgpackSerializer().dumps(arrays)
    assert len(main) < 500 and sum(b.nbytes for b in buffers) == sum(a.nbytes for a in arrays)
    with aioshmq.create(capacity=1 << 20, serializer="msgpack") as w, aioshmq.connect(w.name) as r:
        await w.put(Point(1, 2.0, arrays))
        got = (await r.get())["data"]
        for a, b in zip(arrays, got, strict=True):
            assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
        got[0][0, 0] = -1  # a copy of its own
        await w.put(arrays[0])
        async with r.lease() as leased:
            assert not leased.flags.writeable and np.array_equal(leased, arrays[0])


async def test_tensors_travel_out_of_band() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()
    grad = torch.ones(2, requires_grad=True)
    with aioshmq.create(capacity=1 << 20, serializer="msgpack") as w, aioshmq.connect(w.name) as r:
        await w.put({"t": t, "g": grad, "e": torch.empty(0, 5)})
        got = await r.get()
        assert got["t"].dtype == torch.bfloat16 and got["t"].stride() == t.stride()
        assert torch.equal(got["t"], t)
        assert got["g"].requires_grad and got["e"].shape == (0, 5)
        with pytest.raises(aioshmq.SerializationError, match="pickle"):
            await w.put(t.to_sparse())
        await w.put("next")
        assert await r.get() == "next"


async def test_what_msgpack_cannot_encode_is_named_and_loses_nothing() -> None:
    with aioshmq.create(capacity=1 << 16, serializer="msgpack") as w, aioshmq.connect(w.name) as r:
        with pytest.raises(aioshmq.SerializationError, match="cannot encode object"):
            await w.put({"a": object()})
        with pytest.raises(aioshmq.SerializationError, match="Python objects"):
            await w.put(np.array([None, 1], dtype=object))
        await w.put("next")
        assert await r.get() == "next"


async def test_user_hooks_extend_the_types() -> None:
    from aioshmq import MsgpackSerializer

    class When(msgspec.Struct):
        at: complex

    ser = MsgpackSerializer(
        When,
        enc_hook=lambda obj: [obj.real, obj.imag],
        dec_hook=lambda kind, obj: complex(*obj),
    )
    with aioshmq.create(capacity=1 << 16, serializer=ser) as w:
        with aioshmq.connect(w.name, serializer=ser) as r:
            await w.put(When(1 + 2j))
            assert await r.get() == When(1 + 2j)
            await w.put(When(datetime.datetime(2026, 1, 1)))  # type: ignore[arg-type]
            with pytest.raises(msgspec.ValidationError):
                await r.get()


@pytest.mark.parametrize(
    ("ext", "match"),
    [
        ((9, b"\x90"), "extension type 9"),
        ((1, b"\xc1"), "corrupt array header"),
        ((1, msgspec.msgpack.encode([3, "<f8", [2]])), "names buffer 3, and it carries 0"),
        ((1, msgspec.msgpack.encode([-1, "<f8", [1000000000]])), "no buffer"),
        ((2, msgspec.msgpack.encode([-1, "no_such_dtype", [1], [1], None, False])), "dtype"),
    ],
)
async def test_untrusted_extension_records_are_refused(ext: tuple[int, bytes], match: str) -> None:
    data = msgspec.msgpack.encode({"x": msgspec.msgpack.Ext(*ext)})
    with aioshmq.create(capacity=1 << 16, serializer="raw") as w:
        with aioshmq.connect(w.name, serializer="msgpack") as r:
            if ext[0] == 2:
                pytest.importorskip("torch")
            await w.put(data)
            await w.put(msgspec.msgpack.encode("next"))
            with pytest.raises(ValueError, match=match):
                await r.get()
            assert await r.get() == "next"


def test_without_msgspec_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "msgspec", None)
    with pytest.raises(ImportError, match=r"pip install 'aioshmq\[msgspec\]'"):
        aioshmq.create(capacity=1 << 16, serializer="msgpack")

"""The compiled writer's pickles of plain values (aioshmq/ring/plainpickle.c): pickle.dumps's bytes,
exactly, for everything it takes, and nothing for what it leaves to pickle."""

from __future__ import annotations

import math
import os
import pickle
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    from aioshmq.ring import compiled as _ringcore_c
except ImportError:  # pragma: no cover - a machine without a compiler
    _ringcore_c = None  # type: ignore[assignment]

pytestmark = pytest.mark.skipif(_ringcore_c is None, reason="the compiled core is not built")
EXAMPLES = int(os.environ.get("AIOSHMQ_FUZZ_EXAMPLES", "0")) or None
INT64 = (-(2**63), 2**63 - 1)


def plain(obj: Any) -> bytes | None:
    return _ringcore_c.plain_pickle(obj)


def same(obj: Any) -> None:
    """``obj`` is plain, and its pickle is pickle's."""
    expected = pickle.dumps(obj, protocol=5)
    assert plain(obj) == expected


scalars = (
    st.none()
    | st.booleans()
    | st.integers(*INT64)
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=300)
    | st.binary(max_size=300)
)
keys = (
    st.none() | st.booleans() | st.integers(*INT64) | st.text(max_size=20) | st.binary(max_size=8)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.lists(inner, max_size=6).map(tuple)
        | st.dictionaries(keys, inner, max_size=6)
    ),
    max_leaves=40,
)


@settings(max_examples=EXAMPLES or 300, deadline=None)
@given(values)
def test_plain_values_pickle_as_pickle_does(obj: Any) -> None:
    same(obj)


@settings(max_examples=EXAMPLES or 100, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 3]), min_size=1, max_size=40), st.data())
def test_values_met_again_are_fetched_from_the_memo_as_pickle_does(
    picks: list[int], data: st.DataObject
) -> None:
    """The same str, bytes, tuple, list or dict object more than once in a message: pickle
    writes it once and fetches it by its memo index after."""
    pool: list[Any] = [
        data.draw(st.text(min_size=1, max_size=5)),
        data.draw(st.binary(max_size=5)),
        data.draw(st.tuples(st.integers(0, 9), st.text(max_size=3))),
        data.draw(st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=3)),
    ]
    pool.append([pool[0], pool[2]])
    message = [pool[i] for i in picks] + [pool[4], {"k": pool[4], "t": (pool[2], pool[0])}]
    same(message)


def test_ints_take_the_opcode_pickle_gives_their_size() -> None:
    edges = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**40, 2**56 - 1, 2**56]
    edges += [2**63 - 1, -1, -128, -129, -256, -257, -(2**31), -(2**31) - 1, -(2**32)]
    edges += [-(2**55), -(2**55) - 1, -(2**56), -(2**63)]
    for n in edges:
        same(n)
        same([n, -n if n != -(2**63) else 0])


def test_floats_go_as_their_eight_bytes() -> None:
    for x in (0.0, -0.0, 1.5, -2.25, 1e308, 5e-324, math.inf, -math.inf, math.nan):
        same(x)


def test_strings_and_bytes_take_the_short_form_up_to_255_bytes() -> None:
    for n in (0, 1, 255, 256, 1000):
        same("a" * n)
        same(b"b" * n)
    same("é" * 127)  # 254 bytes of UTF-8
    same("é" * 128)  # 256 bytes: the long form though 128 characters
    same("日本語🐍")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 999, 1000, 1001, 2000, 2500])
def test_containers_are_written_in_pickles_batches(n: int) -> None:
    """One item alone (APPEND, SETITEM), more in batches of 1000; a dict whose size is a
    multiple of 1000 ends with an empty batch, as pickle's does."""
    same(list(range(n)))
    same(tuple(range(n)))
    same({i: None for i in range(n)})


def test_memo_indices_past_255_take_the_long_form() -> None:
    for n in (400, 3000):  # the memo grows, past the size kept between pickles
        words = [f"w{i}" for i in range(n)]
        same(words + words[::-1])


def test_lists_and_dicts_that_hold_themselves_pickle_as_pickle_does() -> None:
    looped: list[Any] = [1]
    looped.append(looped)
    same(looped)
    same([looped, looped])
    mapping: dict[str, Any] = {"a": 1}
    mapping["self"] = mapping
    same(mapping)
    assert pickle.loads(plain(looped) or b"")[1][1][0] == 1


class _Dict(dict[Any, Any]):
    pass


class _Str(str):
    pass


def test_what_is_not_plain_is_left_to_pickle() -> None:
    """None for anything pickle would write another way or that needs its full machinery: a
    subclass, another type, an int over 64 bits, a lone surrogate (pickle's "surrogatepass"),
    a tuple that holds itself, nesting past 100, a pickle past one 64 KiB frame."""
    holder: list[Any] = []
    looped_tuple = (holder,)
    holder.append(looped_tuple)
    deep: Any = 0
    for _ in range(101):
        deep = [deep]
    obj: Any
    for obj in (
        _Dict(a=1),
        _Str("s"),
        {1, 2},
        frozenset(),
        bytearray(b"x"),
        2**63,
        -(2**63) - 1,
        "\ud800",
        looped_tuple,
        [looped_tuple],
        deep,
        [1, {"k": [object()]}],
        b"x" * (64 << 10),
        ["x" * 40_000, "y" * 40_000],
    ):
        assert plain(obj) is None, repr(obj)[:80]
    shallow: Any = 0
    for _ in range(100):
        shallow = [shallow]
    same(shallow)


def test_the_frame_limit_is_the_last_byte_below_64_kib() -> None:
    """A pickle whose frame is 65535 bytes is plain; one byte more is pickle's."""
    overhead = len(pickle.dumps(b"x" * 1000, protocol=5)) - 1000 - 11
    fits = b"x" * (65535 - overhead)
    assert len(pickle.dumps(fits, protocol=5)) - 11 == 65535
    same(fits)
    assert plain(fits + b"x") is None


def test_a_plain_pickle_keeps_no_reference() -> None:
    payload = ["kept?" * 3, (1, 2.5), {"k": b"v"}]
    before = [sys.getrefcount(x) for x in payload]
    for _ in range(100):
        plain(payload)
    assert [sys.getrefcount(x) for x in payload] == before

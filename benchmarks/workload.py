"""What is sent and for how long: the 100-byte object, the payload arrays and tensors, each
mode's budget."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

_PAD = b"aioshmq-bench-pad!"  # brings the object's protocol-5 pickle to 100 bytes
_arrays: dict[int, Any] = {}
_tensors: dict[int, Any] = {}


_FIELDS = {"topic": "ticks/eu", "price": 101.25, "size": 300, "pad": _PAD}


def small_object(seq: int) -> dict[str, Any]:
    """A typical small message: a dict whose pickle is 100 bytes."""
    return {"seq": seq, **_FIELDS}


def small_objects(first: int, count: int) -> list[dict[str, Any]]:
    """``count`` small objects numbered from ``first``, each made afresh."""
    return [{"seq": seq, **_FIELDS} for seq in range(first, first + count)]


# Brings the tuple's protocol-5 pickle to 100 bytes.
_TUPLE_PAD = b"aioshmq-bench-tuple-padding-0123456789abcdefghijklmnop"


def small_tuple(seq: int) -> tuple[Any, ...]:
    """The plainest small message: a tuple whose pickle is 100 bytes."""
    return (seq, "ticks/eu", 101.25, 300, _TUPLE_PAD)


def small_tuples(first: int, count: int) -> list[tuple[Any, ...]]:
    """``count`` small tuples numbered from ``first``, each made afresh (the literal is
    ``small_tuple``'s, inline: a call per tuple would cost as much as the tuple)."""
    return [(seq, "ticks/eu", 101.25, 300, _TUPLE_PAD) for seq in range(first, first + count)]


def pattern_array(nbytes: int) -> Any:
    """A uint8 array whose byte k is k % 251, made once per size and reused for every send."""
    array = _arrays.get(nbytes)
    if array is None:
        import numpy as np

        array = _arrays[nbytes] = np.resize(np.arange(251, dtype=np.uint8), nbytes)
    return array


def pattern_tensor(nbytes: int) -> Any:
    """``pattern_array(nbytes)`` as a uint8 CPU torch tensor on the same memory (made once
    per size): the same bytes as the array, so that the two travel the same payload."""
    tensor = _tensors.get(nbytes)
    if tensor is None:
        import torch

        tensor = _tensors[nbytes] = torch.from_numpy(pattern_array(nbytes))
    return tensor


@dataclass(frozen=True)
class Workload:
    """A stream of messages: small objects numbered in order, or one array (or tensor) sent
    again and again.

    ``check`` runs in the reader on every message: it verifies the order of small objects,
    and the size and last byte of an array or tensor (so every one is really touched), and
    that a tensor arrived as one.
    """

    kind: Literal["small", "tuple", "array", "tensor"]
    nbytes: int = 100

    @property
    def arrays(self) -> bool:
        """Whether the messages are payloads of ``nbytes`` (arrays or tensors), counted in
        GB/s, rather than small objects counted in msg/s."""
        return self.kind in ("array", "tensor")

    def make(self, seq: int) -> Any:
        """Message ``seq``."""
        return self.maker()(seq)

    def maker(self) -> Callable[[int], Any]:
        """What makes message ``seq``, with no dispatch on the kind left in it: the loops call
        it once a message, so that the harness costs what making the object costs."""
        if self.kind == "small":
            return small_object
        if self.kind == "tuple":
            return small_tuple
        payload = (
            pattern_tensor(self.nbytes) if self.kind == "tensor" else pattern_array(self.nbytes)
        )
        return lambda seq: payload

    def make_batch(self, first: int, count: int) -> list[Any]:
        """Messages ``first`` to ``first + count - 1``, each made afresh."""
        if self.kind == "small":
            return small_objects(first, count)
        if self.kind == "tuple":
            return small_tuples(first, count)
        make = self.maker()
        return [make(seq) for seq in range(first, first + count)]

    def check(self, msg: Any, seq: int) -> None:
        """Raise ``AssertionError`` unless ``msg`` is message ``seq``, intact."""
        self.checker()(msg, seq)

    def checker(self) -> Callable[[Any, int], None]:
        """``check`` with no dispatch on the kind left in it."""
        if self.kind == "small":
            return _check_small
        if self.kind == "tuple":
            return _check_tuple
        return partial(_check_payload, self.kind == "tensor", self.nbytes)

    def check_batch(self, msgs: Sequence[Any], first: int) -> None:
        """``check`` of every message in ``msgs``, numbered from ``first``."""
        if self.kind in ("small", "tuple"):
            key = "seq" if self.kind == "small" else 0
            if [msg[key] for msg in msgs] == list(range(first, first + len(msgs))):
                return
        check = self.checker()
        for seq, msg in enumerate(msgs, first):
            check(msg, seq)


def _check_small(msg: Any, seq: int) -> None:
    if msg["seq"] != seq:
        raise AssertionError(f"message {seq} arrived as {msg['seq']}: order broken")


def _check_tuple(msg: Any, seq: int) -> None:
    if msg[0] != seq:
        raise AssertionError(f"message {seq} arrived as {msg[0]}: order broken")


def _check_payload(tensor: bool, nbytes: int, msg: Any, seq: int) -> None:
    if tensor and type(msg).__name__ != "Tensor":
        raise AssertionError(f"tensor {seq} arrived as {type(msg).__qualname__}")
    last = nbytes - 1
    if len(msg) != nbytes or int(msg[last]) != last % 251:
        raise AssertionError(f"array {seq} arrived damaged ({len(msg)} bytes)")


@dataclass(frozen=True)
class Budget:
    """How long each measurement runs: ``full``, ``quick`` (under 2 minutes in all) or ``tiny``
    (a fraction of a second per measurement, for the test of the command itself)."""

    mode: str
    seconds: float  #: one throughput run streams (or calls, for rpc) this long, after its warm-up
    repeats: int  #: throughput runs per figure; the median is reported
    warmup_messages: int  #: small objects (rpc: calls) sent before the clock starts
    warmup_arrays: int  #: arrays sent before the clock starts
    min_arrays: int  #: a large-payload run counts at least this many arrays
    warmup_round_trips: int  #: ping-pong round trips (rpc: calls one at a time) not counted
    round_trips: int  #: round trips counted (fewer if ``latency_seconds`` runs out)
    latency_seconds: float
    idle_seconds: float  #: how long an idle reader is watched
    lag_bytes: int  #: bytes streamed while the tickers run
    memcpy_seconds: float  #: time spent finding the best memcpy of each size
    wire_messages: int  #: small objects streamed while the bytes on the wire are counted
    tensor_bytes: int  #: the larger size of the tensors scenario (its ring is 4 times that)


FULL = Budget("full", 1.5, 3, 2000, 4, 8, 500, 20_000, 3.0, 3.0, 1 << 30, 0.3, 100_000, 256 << 20)
QUICK = Budget("quick", 0.4, 1, 1000, 4, 4, 200, 3_000, 0.8, 1.0, 256 << 20, 0.1, 20_000, 256 << 20)
# Tiny: 64 MiB tensors rather than 256 MiB, so the test's run maps 256 MiB of ring, not 1 GiB.
TINY = Budget("tiny", 0.02, 1, 128, 0, 2, 20, 100, 0.1, 0.1, 8 << 20, 0.01, 500, 64 << 20)

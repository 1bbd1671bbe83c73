"""Which serializer a ring uses: one named, or one of the user's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from .base import BufferSerializer, CustomSerializer, PlainSerializer, RawSerializer, Serializer
from .msgpack import MsgpackSerializer
from .pickling import CloudpickleSerializer, PickleSerializer


def _msgpack() -> Serializer:
    return MsgpackSerializer()  # needs msgspec, an optional dependency


_NAMED: dict[str, Callable[[], Serializer]] = {
    "pickle": PickleSerializer,
    "cloudpickle": CloudpickleSerializer,
    "raw": RawSerializer,
    "msgpack": _msgpack,
}

# What users may pass: public names only (CloudpickleSerializer is a PickleSerializer).
SerializerSpec = str | PickleSerializer | MsgpackSerializer | PlainSerializer | BufferSerializer


def resolve(spec: SerializerSpec | Serializer) -> Serializer:
    """The serializer named or given; a clear error for anything else."""
    if isinstance(spec, str):
        try:
            return _NAMED[spec]()
        except KeyError:
            raise ValueError(
                f"serializer must be one of {sorted(_NAMED)} or an object with dumps/loads, "
                f"not {spec!r}"
            ) from None
    if isinstance(spec, Serializer):
        return spec
    dumps = getattr(spec, "dumps", None)
    loads = getattr(spec, "loads", None)
    if not callable(dumps) or not callable(loads):
        raise TypeError(
            f"serializer {spec!r} needs callable dumps and loads methods "
            f"(dumps={dumps!r}, loads={loads!r})"
        )
    return CustomSerializer(spec)


def passed_on(ser: Serializer) -> SerializerSpec:
    """A resolved serializer, to pass to ``create`` or ``connect``: they take it back as it
    is (``resolve``), though users may pass only the kinds ``SerializerSpec`` names."""
    return cast(SerializerSpec, ser)

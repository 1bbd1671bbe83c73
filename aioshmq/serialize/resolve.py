"""Which serializer a ring uses: one named, or one of the user's own."""

from __future__ import annotations

from collections.abc import Callable

from .base import BufferSerializer, CustomSerializer, RawSerializer, Serializer, UserSerializer
from .pickling import CloudpickleSerializer, PickleSerializer


def _msgpack() -> Serializer:
    from .msgpack import MsgpackSerializer  # imports msgspec, an optional dependency

    return MsgpackSerializer()


_NAMED: dict[str, Callable[[], Serializer]] = {
    "pickle": PickleSerializer,
    "cloudpickle": CloudpickleSerializer,
    "raw": RawSerializer,
    "msgpack": _msgpack,
}

SerializerSpec = str | UserSerializer | BufferSerializer | Serializer


def resolve(spec: SerializerSpec) -> Serializer:
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

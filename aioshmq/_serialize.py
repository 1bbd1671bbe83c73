"""Turning objects into a main byte string plus out-of-band buffers, and back."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ._errors import SerializationError

Buffer = bytes | bytearray | memoryview


def unserializable(obj: object, exc: Exception, serializer: str) -> SerializationError:
    """The error for ``obj`` that ``serializer`` could not serialize, saying what to do."""
    text = str(exc)
    hint = ""
    if serializer == "pickle" and any(
        mark in text for mark in ("<lambda>", "local object", "attribute lookup")
    ):
        hint = (
            "; pickle sends functions and classes by name, so lambdas and functions defined "
            "inside other functions need serializer='cloudpickle' (pip install "
            "'aioshmq[cloudpickle]')"
        )
    error = SerializationError(
        f"cannot serialize {type(obj).__qualname__} object with the {serializer!r} "
        f"serializer: {text}{hint}"
    )
    error.__cause__ = exc
    return error


@runtime_checkable
class UserSerializer(Protocol):
    """Anything with ``dumps(obj) -> bytes-like`` and ``loads(bytes) -> obj``."""

    def dumps(self, obj: Any, /) -> Any: ...

    def loads(self, data: bytes, /) -> Any: ...


class Serializer:
    """Base of the serializers a ring uses; ``name`` travels to readers at attach."""

    name = "custom"

    def dumps(self, obj: Any) -> tuple[Buffer, list[memoryview]]:
        raise NotImplementedError

    def loads(self, main: memoryview, buffers: Sequence[Buffer]) -> Any:
        raise NotImplementedError

    def loads_view(self, main: memoryview, buffers: Sequence[memoryview]) -> Any:
        """Rebuild an object that may alias ``main`` and ``buffers`` (for a lease)."""
        return self.loads(main, buffers)

    def loads_plain(self, main: memoryview) -> Any:
        """``loads`` of a message without buffers: the readers' hot path."""
        return self.loads(main, ())


_ARRAY_CACHE_SIZE = 64


class PickleSerializer(Serializer):
    name = "pickle"

    def __init__(self) -> None:
        self._dumps = pickle.dumps
        # Pickling a numpy array's dtype costs ~10 us here, more than copying 256 KiB.  With
        # its data out of band, a plain array's pickle depends only on its dtype and shape,
        # so the stream pickle made for the first such array is reused for the next ones.
        self._arrays: dict[tuple[Any, tuple[int, ...]], Buffer] = {}

    @property
    def pickler(self) -> Any:
        """``pickle.dumps`` (or cloudpickle's), which a ring core may call itself."""
        return self._dumps

    def finish(self, obj: Any, rest: Any) -> tuple[Buffer, list[memoryview]]:
        """``dumps(obj)`` given what a ring core's ``put_object`` left: ``()`` or
        ``(main, [PickleBuffer, ...])``."""
        if not rest:
            return self.dumps(obj)
        main, found = rest
        if not found:
            return main, []
        try:
            return main, [pb.raw() for pb in found]
        except BufferError:  # non-contiguous: in-band, which pickle refuses clearly
            return self._pickle_in_band(obj), []

    def _pickle_in_band(self, obj: Any) -> Buffer:
        try:
            return self._dumps(obj, protocol=5)
        except MemoryError:
            raise
        except Exception as exc:
            raise unserializable(obj, exc, self.name) from exc

    def dumps(self, obj: Any) -> tuple[Buffer, list[memoryview]]:
        np = sys.modules.get("numpy")
        if np is not None and type(obj) is np.ndarray:
            return self._dumps_array(obj)
        return self._pickle(obj)

    def _pickle(self, obj: Any) -> tuple[Buffer, list[memoryview]]:
        found: list[pickle.PickleBuffer] = []
        try:
            main = self._dumps(obj, protocol=5, buffer_callback=found.append)
            if not found:
                return main, []
            try:
                return main, [pb.raw() for pb in found]
            except BufferError:  # non-contiguous: in-band, which pickle refuses clearly
                return self._dumps(obj, protocol=5), []
        except MemoryError:
            raise
        except Exception as exc:
            raise unserializable(obj, exc, self.name) from exc

    def _dumps_array(self, arr: Any) -> tuple[Buffer, list[memoryview]]:
        dtype = arr.dtype
        if not arr.flags.c_contiguous or dtype.isbuiltin != 1:
            return self._pickle(arr)
        key = (dtype, arr.shape)
        main = self._arrays.get(key)
        if main is None:
            main, buffers = self._pickle(arr)
            if len(buffers) != 1:  # not the shape of pickle this cache knows
                return main, buffers
            if len(self._arrays) >= _ARRAY_CACHE_SIZE:
                self._arrays.clear()
            self._arrays[key] = main
            return main, buffers
        return main, [pickle.PickleBuffer(arr).raw()]

    def dumps_many(self, objs: list[Any]) -> tuple[Buffer, list[memoryview]]:
        """A whole batch as one pickled list: far cheaper per object than one each."""
        return self.dumps(objs)

    def loads(self, main: memoryview, buffers: Sequence[Buffer]) -> Any:
        return pickle.loads(main, buffers=buffers)

    loads_plain = staticmethod(pickle.loads)  # type: ignore[assignment]


class CloudpickleSerializer(PickleSerializer):
    name = "cloudpickle"

    def __init__(self) -> None:
        try:
            import cloudpickle  # type: ignore[import-untyped]
        except ImportError:
            raise ImportError(
                "serializer='cloudpickle' needs the cloudpickle package: "
                "pip install 'aioshmq[cloudpickle]'"
            ) from None
        super().__init__()
        self._dumps = cloudpickle.dumps


class RawSerializer(Serializer):
    """Bytes-like objects in, ``bytes`` out."""

    name = "raw"

    def dumps(self, obj: Any) -> tuple[Buffer, list[memoryview]]:
        try:
            view = memoryview(obj)
        except TypeError:
            raise TypeError(
                f"serializer='raw' takes bytes-like objects, not {type(obj).__name__}"
            ) from None
        if not view.c_contiguous:
            raise ValueError("serializer='raw' needs a C-contiguous buffer")
        return view.cast("B") if view.format != "B" or view.ndim != 1 else view, []

    def loads(self, main: memoryview, buffers: Sequence[Buffer]) -> Any:
        return bytes(main)

    def loads_view(self, main: memoryview, buffers: Sequence[memoryview]) -> Any:
        return main


class _Custom(Serializer):
    def __init__(self, user: UserSerializer) -> None:
        self._user = user

    def dumps(self, obj: Any) -> tuple[Buffer, list[memoryview]]:
        try:
            data = self._user.dumps(obj)
        except MemoryError:
            raise
        except Exception as exc:
            raise unserializable(obj, exc, type(self._user).__qualname__) from exc
        try:
            return memoryview(data).cast("B"), []
        except TypeError:
            raise TypeError(
                f"{type(self._user).__name__}.dumps returned {type(data).__name__}, "
                "not a bytes-like object"
            ) from None

    def loads(self, main: memoryview, buffers: Sequence[Buffer]) -> Any:
        return self._user.loads(bytes(main))


_NAMED: dict[str, type[Serializer]] = {
    "pickle": PickleSerializer,
    "cloudpickle": CloudpickleSerializer,
    "raw": RawSerializer,
}

SerializerSpec = str | UserSerializer | Serializer


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
    return _Custom(spec)

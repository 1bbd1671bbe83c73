"""What every serializer is: ``dumps`` to a main byte string plus out-of-band buffers, and
``loads`` back; the protocols of users' own serializers, and the raw one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ..base.errors import SerializationError

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
class PlainSerializer(Protocol):
    """A serializer of your own whose messages are one byte string: anything with
    ``dumps(obj) -> bytes-like`` and ``loads(bytes) -> obj`` (the ``pickle`` and ``marshal``
    modules are two).  Readers pass the same object to ``connect``."""

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


@runtime_checkable
class BufferSerializer(Protocol):
    """A serializer of your own whose large buffers travel out of band, as pickle's do.

    ``out_of_band = True`` marks it.  ``dumps(obj)`` returns ``(header, buffers)``: a
    bytes-like header and a sequence of C-contiguous bytes-like buffers, each copied into the
    ring once, beside the header and 16-byte aligned.  ``loads(header, buffers)`` gets them
    back: after ``get()``, ``bytes`` and ``bytearray`` copies that the object may keep; inside
    a lease, read-only ``memoryview`` objects on the ring itself, valid only until the lease ends.
    """

    out_of_band: bool

    def dumps(self, obj: Any, /) -> tuple[Any, Sequence[Any]]: ...

    def loads(self, header: bytes | memoryview, buffers: Sequence[Buffer], /) -> Any: ...


class CustomSerializer(Serializer):
    def __init__(self, user: PlainSerializer | BufferSerializer) -> None:
        self._user = user
        self._oob = getattr(user, "out_of_band", False) is True
        self._owner = type(user).__qualname__

    def _bytes(self, data: object, what: str) -> memoryview:
        try:
            view = memoryview(data)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"{self._owner}.dumps returned {type(data).__name__} as {what}, "
                "not a bytes-like object"
            ) from None
        if not view.c_contiguous:
            raise ValueError(f"{self._owner}.dumps returned a non-contiguous buffer as {what}")
        return view.cast("B") if view.format != "B" or view.ndim != 1 else view

    def dumps(self, obj: Any) -> tuple[Buffer, list[memoryview]]:
        try:
            data = self._user.dumps(obj)
        except MemoryError:
            raise
        except Exception as exc:
            raise unserializable(obj, exc, self._owner) from exc
        if not self._oob:
            return self._bytes(data, "its result"), []
        if not isinstance(data, tuple) or len(data) != 2:
            raise TypeError(
                f"{self._owner}.dumps returned {type(data).__name__}: an out_of_band "
                "serializer returns a (header, buffers) pair"
            )
        header, buffers = data
        if isinstance(buffers, bytes | bytearray | memoryview) or not isinstance(buffers, Sequence):
            raise TypeError(
                f"{self._owner}.dumps returned {type(buffers).__name__} as its buffers, "
                "not a sequence of bytes-like objects"
            )
        views = [self._bytes(b, f"buffer {i}") for i, b in enumerate(buffers)]
        return self._bytes(header, "its header"), views

    def loads(self, main: memoryview, buffers: Sequence[Buffer]) -> Any:
        if self._oob:
            return self._user.loads(bytes(main), list(buffers))  # type: ignore[call-arg]
        return self._user.loads(bytes(main))  # type: ignore[call-arg]

    def loads_view(self, main: memoryview, buffers: Sequence[memoryview]) -> Any:
        if self._oob:
            return self._user.loads(main, list(buffers))  # type: ignore[call-arg, arg-type]
        return self._user.loads(bytes(main))  # type: ignore[call-arg]

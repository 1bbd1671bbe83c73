"""The exceptions and warnings aioshmq raises beyond anyio's own."""

from __future__ import annotations

from typing import Any

import anyio

from .log import log

__all__ = [
    "Busy",
    "CorruptedError",
    "Empty",
    "Full",
    "PeerDied",
    "ReaderEvicted",
    "SerializationError",
    "UndeliveredWarning",
]


class Full(anyio.WouldBlock):
    """The ring has no room for the message now (for the slowest attached reader)."""


class Empty(anyio.WouldBlock):
    """No complete message is waiting for this reader now."""


class PeerDied(anyio.BrokenResourceError):
    """The process at the other end exited without closing its end."""

    def __init__(self, message: str, *, role: str, pid: int, index: int | None = None) -> None:
        super().__init__(message)
        self.role = role  #: "writer", "reader" or "worker"
        self.pid = pid
        self.index = index  #: the reader slot (or worker rank), where one is meant

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, self.__dict__)


class ReaderEvicted(anyio.BrokenResourceError):
    """The writer stopped waiting for this reader, which had not advanced for the ring's
    ``slow_reader_timeout``: messages after the last one it received are not delivered to it.
    """

    def __init__(
        self, ring: str, index: int, timeout: float, *, message: str | None = None
    ) -> None:
        if message is None:
            message = (
                f"reader {index} of ring {ring!r} was evicted by its writer: it had not "
                f"advanced for {timeout:g} s (the ring's slow_reader_timeout) while a put waited "
                "for it, so the writer stopped keeping messages for it.  Close this reader; a "
                "new connect to the slot starts with the next message put"
            )
        super().__init__(message)
        self.ring = ring  #: the ring's name
        self.index = index  #: the reader's slot
        self.timeout = timeout  #: the writer's slow_reader_timeout, in seconds

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """An exception unpickled: its message and attributes as they were, without calling the
    constructor (whose arguments are not its ``args``)."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class CorruptedError(RuntimeError):
    """The shared memory holds something no writer of this version could have written."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        # Logged where it is made, the compiled core's included: whoever catches it.  As
        # text: a record holding the exception would keep its traceback's frames (and the
        # ring memory they view) alive for as long as a handler keeps the record.
        log.error("corruption: %s", str(self))


class SerializationError(TypeError):
    """An object could not be serialized; the serializer's own error is the ``__cause__``."""


class UndeliveredWarning(UserWarning):
    """A writer closed while messages waited for reader slots that no reader ever attached."""


class Busy(anyio.BusyResourceError):
    """What this call needs is held: a reader slot by a live reader, an end by its async call
    under way or by an open reservation.  An ``anyio.BusyResourceError``, worded whole."""

    def __init__(self, message: str) -> None:
        # anyio's class words its argument as an action ("Another task is already <action>
        # this resource"); ours are whole sentences.
        Exception.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0])

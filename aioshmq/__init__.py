"""aioshmq: one writer broadcasts Python objects to N reader processes through shared memory."""

from . import remote, rpc
from .api.open import aconnect, connect, create
from .base.errors import (
    Busy,
    CorruptedError,
    Empty,
    Full,
    PeerDied,
    ReaderEvicted,
    SerializationError,
    UndeliveredWarning,
)
from .ends.handle import Handle
from .ends.reader import Lease, Reader, ReaderStatistics
from .ends.writer import Reservation, Writer, WriterStatistics
from .ring.switch import CORE
from .serialize.base import BufferSerializer, PlainSerializer
from .serialize.msgpack import MsgpackSerializer
from .serialize.pickling import CloudpickleSerializer, PickleSerializer, Reducer

__all__ = [
    "CORE",
    "BufferSerializer",
    "Busy",
    "CloudpickleSerializer",
    "CorruptedError",
    "Empty",
    "Full",
    "Handle",
    "Lease",
    "MsgpackSerializer",
    "PeerDied",
    "PickleSerializer",
    "PlainSerializer",
    "Reader",
    "ReaderEvicted",
    "ReaderStatistics",
    "Reducer",
    "Reservation",
    "SerializationError",
    "UndeliveredWarning",
    "Writer",
    "WriterStatistics",
    "aconnect",
    "connect",
    "create",
    "remote",
    "rpc",
]
__version__ = "0.1.0"

"""aioshmq: one writer broadcasts Python objects to N reader processes through shared memory."""

from . import remote, rpc
from ._errors import (
    CorruptedError,
    Empty,
    Full,
    PeerDied,
    ReaderEvicted,
    SerializationError,
    UndeliveredWarning,
)
from ._handle import Handle
from ._msgpack import MsgpackSerializer
from ._open import aconnect, connect, create
from ._reader import Lease, Reader, ReaderStatistics
from ._reserve import Reservation
from ._serialize import BufferSerializer, CloudpickleSerializer, PickleSerializer, Reducer
from ._switch import CORE
from ._writer import Writer, WriterStatistics

__all__ = [
    "CORE",
    "BufferSerializer",
    "CloudpickleSerializer",
    "CorruptedError",
    "Empty",
    "Full",
    "Handle",
    "Lease",
    "MsgpackSerializer",
    "PeerDied",
    "PickleSerializer",
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

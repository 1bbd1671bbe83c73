"""aioshmq: one writer broadcasts Python objects to N reader processes through shared memory."""

from . import remote, rpc
from ._errors import (
    CorruptedError,
    Empty,
    Full,
    PeerDied,
    SerializationError,
    UndeliveredWarning,
)
from ._handle import Handle
from ._open import connect, create
from ._reader import Lease, Reader, ReaderStatistics
from ._switch import CORE
from ._writer import Writer, WriterStatistics

__all__ = [
    "CORE",
    "CorruptedError",
    "Empty",
    "Full",
    "Handle",
    "Lease",
    "PeerDied",
    "Reader",
    "ReaderStatistics",
    "SerializationError",
    "UndeliveredWarning",
    "Writer",
    "WriterStatistics",
    "connect",
    "create",
    "remote",
    "rpc",
]
__version__ = "0.1.0"

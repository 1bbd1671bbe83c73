"""The primitives both ring cores offer, as Protocols mypy checks, and the core that runs.

A core does the per-message work and nothing else: claim room and write a record, publish,
read and consume a record, the two sides of the sleep/wake handshake, plain-value pickling,
and the writer's gate.  ``WriterCore``, ``ReaderCore`` and ``Gate`` here are the compiled
classes (``compiled.c``) or their pure-Python reference (``pure.py``), whichever ``switch``
chose; everything above the ring uses these names and these Protocols, never one core's own.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from . import pure
from .switch import COMPILED


class GateAPI(Protocol):
    """Which reader slots the writer waits for (``pure.Gate`` says more)."""

    def __init__(self, readers: int) -> None: ...
    def __enter__(self) -> None: ...
    def __exit__(self, *exc_info: object) -> None: ...
    def __len__(self) -> int: ...
    def state(self, index: int, /) -> int: ...
    def set(self, index: int, state: int, /) -> None: ...
    def states(self) -> list[int]: ...


class WriterCoreAPI(Protocol):
    """The writer's per-message work (``pure.WriterCore`` says more)."""

    pos: int
    count: int
    head: int
    head_count: int
    limit_pos: int
    limit_count: int
    need_span: int
    need_count: int
    wakeups: int
    publishes: int
    sent: int
    sent_bytes: int
    dumps_failed: bool
    arrays: Any

    def __init__(
        self,
        mapping: mmap.mmap | bytearray,
        data_offset: int,
        capacity: int,
        max_messages: int,
        readers: int,
        wake_fds: Sequence[int],
        eventfd: bool,
        gate: Any,
    ) -> None: ...
    @property
    def max_record(self) -> int: ...
    def refresh_limits(self) -> tuple[int, int]: ...
    def span(self, size: int, /) -> int: ...
    def claim(self, size: int, count: int, /) -> int: ...
    def put_plain(self, main: Any, kind: int = ..., count: int = ..., /) -> bool: ...
    def put_buffer(self, main: Any, buffer: Any, /) -> bool: ...
    def put_object(self, obj: Any, dumps: Callable[..., Any], count: int = ..., /) -> Any: ...
    def publish(self) -> None: ...
    def wake_readers(self) -> None: ...
    def release(self) -> None: ...


class ReaderCoreAPI(Protocol):
    """A reader's per-message work (``pure.ReaderCore`` says more)."""

    tail: int
    count: int
    head: int
    shown_tail: int
    shown_count: int
    wakeups: int
    taken: int
    taken_bytes: int
    episode: int
    pins: list[tuple[int, int]]
    assembling: bool

    def __init__(
        self,
        mapping: mmap.mmap | bytearray,
        data_offset: int,
        capacity: int,
        max_messages: int,
        readers: int,
        index: int,
        wake_fd: int,
        eventfd: bool,
        name: str,
    ) -> None: ...
    @property
    def index(self) -> int: ...
    def refresh(self) -> bool: ...
    def available(self) -> bool: ...
    def next(self) -> tuple[memoryview, int, int, int] | None: ...
    def consume(self, size: int, messages: int, /) -> None: ...
    def get_plain(self, loads: Callable[[memoryview], Any], empty: Any, /) -> Any: ...
    def get_record(self, loads: Callable[[memoryview], Any], empty: Any, /) -> Any: ...
    def spin(self, seconds: float, /) -> bool: ...
    def publish(self) -> None: ...
    def prepare_sleep(self) -> bool: ...
    def end_sleep(self) -> None: ...
    def check_evicted(self) -> None: ...
    def release(self) -> None: ...


Gate: type[GateAPI]
WriterCore: type[WriterCoreAPI]
ReaderCore: type[ReaderCoreAPI]

if COMPILED:
    from . import compiled

    Gate, WriterCore, ReaderCore = compiled.Gate, compiled.WriterCore, compiled.ReaderCore
else:
    Gate, WriterCore, ReaderCore = pure.Gate, pure.WriterCore, pure.ReaderCore

__all__ = ["Gate", "GateAPI", "ReaderCore", "ReaderCoreAPI", "WriterCore", "WriterCoreAPI"]

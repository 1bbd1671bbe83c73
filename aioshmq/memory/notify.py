"""Wake-up channels between processes: an eventfd, or a pipe where eventfd is missing."""

from __future__ import annotations

import os
from typing import Literal

NotifierKind = Literal["eventfd", "pipe"]

_ONE = (1).to_bytes(8, "little")


def default_kind() -> NotifierKind:
    return "eventfd" if hasattr(os, "eventfd") else "pipe"


class Notifier:
    """One direction of wake-ups: ``signal()`` on one side makes ``read_fd`` readable.

    Level-triggered: the fd stays readable until ``drain()``.  Both calls never block.
    For an eventfd both fds are the same; a process that only signals holds ``write_fd``
    alone (``read_fd == -1`` for a pipe).
    """

    __slots__ = ("kind", "read_fd", "write_fd")

    def __init__(self, kind: NotifierKind, read_fd: int, write_fd: int) -> None:
        self.kind = kind
        self.read_fd = read_fd
        self.write_fd = write_fd

    @classmethod
    def create(cls, kind: NotifierKind) -> Notifier:
        if kind == "eventfd":
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            return cls(kind, fd, fd)
        if kind == "pipe":
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            return cls(kind, r, w)
        raise ValueError(f"notifier must be 'eventfd' or 'pipe', not {kind!r}")

    def signal(self) -> None:
        if self.write_fd < 0:
            return  # closed: a wake-up for nobody (never a write to a reused fd number)
        try:
            os.write(self.write_fd, _ONE if self.kind == "eventfd" else b"\0")
        except BlockingIOError:
            pass  # already pending: the sleeper will wake anyway

    def drain(self) -> None:
        try:
            if self.kind == "eventfd":
                os.read(self.read_fd, 8)
            else:
                while len(os.read(self.read_fd, 4096)) == 4096:
                    pass
        except BlockingIOError:
            pass

    def fds(self) -> list[int]:
        """The distinct fds held (a side may hold only one end of a pipe)."""
        return [fd for fd in {self.read_fd, self.write_fd} if fd >= 0]

    def close(self) -> None:
        for fd in self.fds():
            os.close(fd)
        self.read_fd = self.write_fd = -1

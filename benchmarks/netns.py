"""Bytes on the wire: a measurement run in a network namespace of its own, whose loopback
interface carries nothing but its traffic.

A thread of the bench process moves itself into a new network namespace (``unshare``
with ``CLONE_NEWNET``: it needs root) and brings its ``lo`` up; the processes it starts
(spawned from that thread) and the threads it starts are born in the namespace too, and it
goes away with them.  The rest of the bench process stays where it was.  Without root the
measurement runs on the host's ``lo`` instead, where other traffic counts too.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP = 0x1
PRIVATE = "a network namespace of its own, only lo up"
SHARED = "where other traffic on lo counts too"


def lo_bytes() -> int:
    """Bytes sent on ``lo`` in this thread's network namespace (each packet is sent once
    and received once on loopback: this counts it once, headers included)."""
    with open("/proc/thread-self/net/dev") as f:  # the namespace of this thread
        for line in f:
            name, sep, fields = line.partition(":")
            if sep and name.strip() == "lo":
                return int(fields.split()[8])  # the transmit side's bytes
    raise RuntimeError("no lo in /proc/thread-self/net/dev")


def _bring_up_lo() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # in this thread's namespace
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def _enter_private_namespace() -> str:
    """Move this thread into a new network namespace with ``lo`` up: where the measurement
    runs, or, if that cannot be done here, why it runs on the host's ``lo``."""
    if os.geteuid() != 0:
        return f"the host's network namespace (not root), {SHARED}"
    unshare = getattr(ctypes.CDLL(None, use_errno=True), "unshare", None)
    if unshare is None:
        return f"the host's network namespace (no unshare in libc), {SHARED}"
    if unshare(CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        return (
            f"the host's network namespace (unshare: {errno.errorcode.get(code, code)}), {SHARED}"
        )
    _bring_up_lo()
    return PRIVATE


def isolated(fn: Callable[..., T], *args: Any) -> tuple[T, str]:
    """``fn(*args)`` in a new thread in a network namespace of its own: its result, and
    where it ran (``PRIVATE``, or why in the host's namespace)."""
    box: dict[str, Any] = {}

    def main() -> None:
        try:
            box["where"] = _enter_private_namespace()
            box["result"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=main, name="aioshmq-bench-netns")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"], box["where"]

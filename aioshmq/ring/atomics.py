"""Memory-ordering primitives for counters shared between processes, and why they suffice.

Python has no memory model, so aioshmq relies on three properties of the hardware and of
CPython, and keeps every use of them behind the names in this module:

1. **Untorn counters.**  Every shared counter is an 8-byte-aligned ``u64`` read and written
   through a ``memoryview`` cast to format ``"Q"``.  CPython packs and unpacks such an item
   with a fixed-size ``memcpy`` of 8 bytes, which compilers emit as one aligned 8-byte move;
   on x86-64 and aarch64 an aligned 8-byte move is single-copy atomic.  ``struct.pack_into``
   gives no such promise and is never used on a counter.  Each counter has exactly one
   writing process at any time, so no read-modify-write is ever needed.

2. **Publication order** (``release()`` before a store that publishes, ``acquire()`` after a
   load that observes).  The writer copies a record into the ring and only then stores the
   new head; a reader loads the head and only then reads the record.  On x86-64 (total store
   order) stores are seen by other cores in program order and loads are not reordered with
   older loads, so both functions are no-ops there.  On aarch64 they issue ``dmb ish``.

3. **Store-then-load across locations** (``fence()``).  The sleep/wake handshake is Dekker's
   pattern: a sleeper stores "I am asleep" and then loads the other side's position; the
   other side stores its position and then loads "asleep".  Even x86-64 may let each load
   pass the preceding store, and then both sides miss each other: a lost wake-up.  A full
   fence between the store and the load on *both* sides forbids that outcome: at least one
   side sees the other's store.  On x86-64 any locked read-modify-write instruction is a full
   fence; acquiring and releasing an uncontended ``threading.Lock`` executes one (CPython's
   lock is a pthread mutex/semaphore or, from 3.13, an atomic compare-exchange).  On aarch64
   the fence is a ``dmb ish`` run from a tiny code page through ctypes.

With the compiled core (``_switch``), the per-message paths use C11 atomics instead (see
``compiled.c`` and ARCHITECTURE.md): release stores publish, acquire loads observe, and
``atomic_thread_fence(memory_order_seq_cst)`` is the full fence, so the argument for them
is the compiler's and the hardware's.  The three functions below are then that module's
fences too, for the code that stays in Python (on aarch64 no executable page is made, which
a W^X-hardened system would refuse).  The tricks above serve the pure core alone.

Other architectures are refused at import rather than run without a proven fence.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import threading
from collections.abc import Callable

from . import switch as _switch

__all__ = ["ARCH", "acquire", "fence", "release"]

ARCH = platform.machine().lower()

_X86 = ("x86_64", "amd64")
_ARM = ("aarch64", "arm64")


def _noop() -> None:
    """Nothing: the ordering is already guaranteed by the hardware."""


def _lock_fence() -> Callable[[], None]:
    lock = threading.Lock()
    acquire_ = lock.acquire
    release_ = lock.release

    def fence() -> None:
        """Full memory barrier (a locked read-modify-write on x86-64)."""
        acquire_()
        release_()

    return fence


def _code_fence(code: bytes) -> tuple[Callable[[], None], mmap.mmap]:
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    return ctypes.CFUNCTYPE(None)(address), page


if ARCH not in _X86 + _ARM:  # pragma: no cover - refused on purpose
    raise ImportError(f"aioshmq supports x86-64 and aarch64; no proven memory fence for {ARCH!r}")
if _switch.COMPILED:
    from . import compiled

    fence: Callable[[], None] = compiled.fence
    release: Callable[[], None] = compiled.release
    acquire: Callable[[], None] = compiled.acquire
elif ARCH in _X86:
    fence = _lock_fence()
    release = _noop
    acquire = _noop
else:
    # dmb ish; ret
    _fn, _page = _code_fence(bytes.fromhex("bf3b03d5") + bytes.fromhex("c0035fd6"))
    fence = release = acquire = _fn

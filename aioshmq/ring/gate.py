"""Which reader slots the writer waits for: each slot's state and the lock it changes under."""

from __future__ import annotations

import threading
from typing import Final

PENDING: Final = 0  # never attached: keeps every message for the reader to come
ATTACHED: Final = 1
DETACHED: Final = 2  # gave its slot up: not waited for
DEAD: Final = 3  # its process ended without closing: still waited for, so the writer can tell
# Its live reader was evicted (slow_reader_timeout): not waited for, and not handed out again
# until that reader's connection ends.
EVICTED: Final = 4
WAITED_FOR: Final = (PENDING, ATTACHED, DEAD)


class Gate:
    """Which reader slots the writer waits for; shared by the writer and its broker thread.

    ``lock`` serializes the writer's recomputation of its limits with a slot being attached,
    so a reader that starts at the current head is never overrun by a limit computed
    without it.
    """

    __slots__ = ("lock", "states")

    def __init__(self, readers: int) -> None:
        self.lock = threading.Lock()
        self.states = [PENDING] * readers

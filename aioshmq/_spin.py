"""How long a reader spins before it sleeps: only for as long as spinning pays."""

from __future__ import annotations

PROBE = 25e-6  # s: the spin a reader tries again with, once spinning stopped paying
PROBE_EVERY = 32  # sleeps between two such tries


class Spin:
    """A reader's spin budget, between 0 and ``limit`` seconds.

    A spin that catches a message (it arrived before the budget ran out, with no wake-up
    syscall on either side) adds ``PROBE`` to the budget, up to ``limit``; one that runs out
    halves it, down to nothing: slow to grow, quick to shrink, since a spin that fails cost
    its whole budget in CPU the writer may have needed.  So on a loaded machine, where a
    spinning reader takes the CPU its writer needs and the spins catch nothing, the reader
    soon sleeps at once, as with ``spin=0``; every ``PROBE_EVERY`` sleeps it tries a short
    spin again, in case the machine has a CPU to spare by then.  While spins keep catching
    messages, it spins as long as allowed.
    """

    __slots__ = ("caught", "limit", "missed", "now", "sleeps")

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.now = limit
        self.sleeps = 0
        self.caught = 0  # spins that caught a message
        self.missed = 0  # spins that ran out

    def budget(self) -> float:
        """How long the next wait may spin (0: sleep at once)."""
        if self.now or not self.limit:
            return self.now
        self.sleeps += 1
        if self.sleeps >= PROBE_EVERY:
            self.sleeps = 0
            return min(self.limit, PROBE)
        return 0.0

    def hit(self) -> None:
        """The spin caught a message."""
        self.caught += 1
        self.now = min(self.limit, self.now + PROBE)

    def miss(self) -> None:
        """The spin ran out: the reader sleeps after all."""
        self.missed += 1
        self.now = self.now / 2 if self.now > PROBE else 0.0

"""How long a reader spins before it sleeps: only for as long as spinning pays."""

from __future__ import annotations

PROBE = 25e-6  # s: the shortest spin a reader tries again with, once spinning stopped paying
PROBE_EVERY = 32  # sleeps between two such tries, at first
PROBE_EVERY_MOST = 1024  # ... doubled by each try that fails, up to this
SLEEP_WEIGHT = 0.25  # the weight of the latest sleep in the running mean of short sleeps
PROBE_MARGIN = 1.25  # a try spins this many times that mean: long enough to catch the next


class Spin:
    """A reader's spin budget, between 0 and ``limit`` seconds.

    A spin that catches a message (it arrived before the budget ran out, with no wake-up
    syscall on either side) adds ``PROBE`` to the budget, up to ``limit``; one that runs out
    halves it, down to nothing: slow to grow, quick to shrink, since a spin that fails cost
    its whole budget in CPU the writer may have needed.  So on a loaded machine, where a
    spinning reader takes the CPU its writer needs and the spins catch nothing, the reader
    soon sleeps at once, as with ``spin=0``; every ``PROBE_EVERY`` sleeps it tries a spin
    again, in case the machine has a CPU to spare by then.  While spins keep catching
    messages, it spins as long as allowed.  Each try that fails doubles the number of sleeps
    before the next, up to ``PROBE_EVERY_MOST``, so where no spin can catch anything (both
    processes on one CPU) the tries soon cost nearly nothing; one that catches a message
    brings the count back to ``PROBE_EVERY``.

    The try lasts as long as the reader's recent sleeps (a running mean of those shorter
    than ``limit``, with a margin), at least ``PROBE``: when messages come steadily, a few
    tens of microseconds apart, a try as long as the wait it replaces is one that can catch
    the next, and once one does the budget starts from there.  A reader whose sleeps are
    longer than ``limit`` (messages rare, or a writer starved of CPU) tries ``PROBE`` alone.

    Where the reader and its writer may run on one CPU only, the same one, a spin holds the
    CPU the writer needs to send the message it waits for: it catches nothing and adds its
    whole length to that wait.  The reader checks for that before the first spin and before
    each try, and skips them there (``skip``).
    """

    __slots__ = (
        "caught",
        "every",
        "limit",
        "missed",
        "now",
        "skipped",
        "sleeps",
        "slept_mean",
        "tried",
    )

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.now = limit
        self.sleeps = 0
        self.every = PROBE_EVERY  # sleeps between two tries
        self.caught = 0  # spins that caught a message
        self.missed = 0  # spins that ran out
        self.skipped = 0  # spins not made: they could only have been in the writer's way
        self.slept_mean = 0.0  # the running mean of sleeps shorter than limit (0: none yet)
        self.tried = 0.0  # the budget of the spin under way

    def budget(self) -> float:
        """How long the next wait may spin (0: sleep at once)."""
        if self.now or not self.limit:
            self.tried = self.now
            return self.now
        self.sleeps += 1
        if self.sleeps >= self.every:
            self.sleeps = 0
            self.tried = min(self.limit, max(PROBE, PROBE_MARGIN * self.slept_mean))
            return self.tried
        self.tried = 0.0
        return 0.0

    def hit(self) -> None:
        """The spin caught a message."""
        self.caught += 1
        self.now = min(self.limit, max(self.now, self.tried) + PROBE)
        self.tried = 0.0
        self.every = PROBE_EVERY

    def miss(self) -> None:
        """The spin ran out: the reader sleeps after all."""
        self.missed += 1
        if not self.now and self.tried:  # a try failed
            self._put_off()
        self.now = self.now / 2 if self.now > PROBE else 0.0
        self.tried = 0.0

    def _put_off(self) -> None:
        """A try came to nothing: twice as many sleeps before the next, up to a bound."""
        self.every = min(PROBE_EVERY_MOST, 2 * self.every)

    def fresh(self) -> bool:
        """Whether the next spin is a try, or the first: the ones worth checking first."""
        return not self.now or not (self.caught or self.missed)

    def skip(self) -> None:
        """The spin due is not made (the writer can only run on the CPU it would take): no
        budget left, and a try comes as much later as after one that failed."""
        self.skipped += 1
        if not self.now:
            self._put_off()
        self.now = 0.0
        self.tried = 0.0

    def slept(self, seconds: float) -> None:
        """A sleep that a message ended lasted ``seconds``."""
        if seconds < self.limit:
            mean = self.slept_mean
            self.slept_mean = seconds if not mean else mean + SLEEP_WEIGHT * (seconds - mean)

"""The stuck-reader policy: evicting live readers that hold the writer back without moving."""

from __future__ import annotations

from ..ring.ring import RingWriter


class Stuck:
    """Evicts a live reader that has not advanced for ``timeout`` seconds of the writer's
    waiting for it (``create(slow_reader_timeout=...)``).

    Only time the writer spends waiting for room counts, and a reader that moves at all
    starts again from zero: a slow reader that keeps up now and then is never evicted, nor
    is one that stays put while the writer has nothing to put.
    """

    __slots__ = ("_seen", "evicted", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.evicted = 0  #: readers evicted so far
        # slot -> (tail, count, seconds the writer has waited with the reader there)
        self._seen: dict[int, tuple[int, int, float]] = {}

    def waited(self, ring: RingWriter, seconds: float) -> list[tuple[int, int, int]]:
        """Count ``seconds`` more of waiting against each reader that holds back the write
        the writer waits to make; evict those that stayed put for the timeout.  Returns the
        (slot, tail, count) of each reader evicted now."""
        seen: dict[int, tuple[int, int, float]] = {}
        gone = []
        for slot, tail, count in ring.blockers():
            was = self._seen.get(slot)
            total = was[2] + seconds if was is not None and was[:2] == (tail, count) else 0.0
            if total >= self.timeout and ring.evict(slot, tail, count, self.timeout):
                gone.append((slot, tail, count))
            else:
                seen[slot] = (tail, count, total)
        self._seen = seen
        self.evicted += len(gone)
        return gone

    def due(self) -> float:
        """Seconds of further waiting before a reader could be evicted."""
        waited = max((seen[2] for seen in self._seen.values()), default=0.0)
        return max(self.timeout - waited, 0.0)

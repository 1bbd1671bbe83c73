"""The picklable reference to a ring that a writer hands to the processes that read it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Handle"]


@dataclass(frozen=True)
class Handle:
    """What a reader needs to find a ring: picklable, valid in any process of the same user."""

    name: str

    def __str__(self) -> str:
        return self.name

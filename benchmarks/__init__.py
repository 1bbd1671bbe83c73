"""The benchmark, ``python -m benchmarks`` from a clone: aioshmq against its peers.

Private: nothing here is part of the library's API.  The scenarios use the public ``aioshmq``
API only, the way an application would.
"""

from .run import run

__all__ = ["run"]

"""The benchmark behind ``python -m aioshmq bench``: aioshmq against its peers, across processes.

Private: nothing here is part of the library's API.  The scenarios use the public ``aioshmq``
API only, the way an application would.
"""

from ._run import run

__all__ = ["run"]

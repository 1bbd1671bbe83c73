"""``python -m aioshmq``: the command line (``ls``, ``stat``, ``mirror``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

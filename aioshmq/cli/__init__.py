"""The command line, ``python -m aioshmq``: ``ls`` and ``stat`` (the live view of rings) and
``mirror`` (a remote writer's stream carried into a local ring)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status."""
    from . import mirror, stat

    parser = argparse.ArgumentParser(prog="python -m aioshmq")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    mirror.add_parser(commands)
    stat.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command in ("ls", "stat"):
        return int(args.run(args))
    return mirror.run(args)

"""Command line: ``python -m aioshmq bench``, ``mirror``, ``ls`` and ``stat``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    from ._bench._report import plot_available
    from ._bench._scenarios import SCENARIO_NAMES

    parser = argparse.ArgumentParser(prog="python -m aioshmq")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser(
        "bench",
        help="measure aioshmq against its peers, across processes",
        description=(
            "Measure aioshmq against multiprocessing.Queue, pyzmq and faster-fifo (those "
            "installed), across processes: small-object throughput, large payloads next to "
            "memcpy, ping-pong latency, broadcast, idle CPU, event-loop lag, and RPC from an async "
            "scheduler to 4 worker processes (aioshmq.rpc against zmq.asyncio); CPU torch "
            "tensors next to numpy arrays, writing in place (reserve) next to memcpy, and "
            "msgpack next to pickle.  Progress "
            "goes to stderr, the table to stdout.  A full run takes a few minutes on 2 cores."
        ),
    )
    bench.add_argument(
        "--quick", action="store_true", help="shorten every scenario (under 2 minutes in all)"
    )
    bench.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # for the tests
    bench.add_argument("--json", metavar="PATH", type=Path, help="write every result as JSON")
    bench.add_argument("--plot", metavar="PATH", type=Path, help="write a PNG chart")
    bench.add_argument(
        "--only",
        nargs="+",
        choices=SCENARIO_NAMES,
        metavar="SCENARIO",
        help=f"run only these scenarios: {', '.join(SCENARIO_NAMES)}",
    )
    from .remote._command import add_parser as add_mirror

    add_mirror(commands)
    from ._stat import add_parser as add_stat

    add_stat(commands)
    args = parser.parse_args(argv)
    if args.command in ("ls", "stat"):
        return int(args.run(args))
    if args.command == "mirror":
        from .remote._command import run as run_mirror

        return run_mirror(args)
    if args.plot is not None and not plot_available():
        parser.error("--plot needs matplotlib: pip install 'aioshmq[bench]'")

    from ._bench import run

    return run(
        quick=args.quick,
        tiny=args.tiny,
        only=args.only,
        json_path=args.json,
        plot_path=args.plot,
    )


if __name__ == "__main__":
    sys.exit(main())

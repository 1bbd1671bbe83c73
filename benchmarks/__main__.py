"""``python -m benchmarks``: aioshmq against its peers, across processes (run from a clone)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["compare"]:
        from .compare import main as compare

        return compare(args[1:])
    if args[:1] == ["page"]:
        from .page import main as page

        return page(args[1:])
    return bench(args)


def bench(argv: list[str]) -> int:
    """The run itself: every scenario, or those named."""
    from .report import plot_available
    from .run import run
    from .scenarios import SCENARIO_NAMES

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        epilog=(
            "Also: 'python -m benchmarks compare OLD_TREE NEW_TREE' measures two checkouts in "
            "one run, alternated; 'python -m benchmarks page RESULTS.json [PURE.json]' writes "
            "benchmarks.md from a full run's results.  A full run keeps its results in "
            "benchmarks/results/<date>-<commit>-<core>.json."
        ),
        description=(
            "Measure aioshmq against multiprocessing.Queue, pyzmq, faster-fifo, iceoryx2 and "
            "vLLM's MessageQueue (those installed), across processes: small-object "
            "throughput, large payloads next to "
            "memcpy, ping-pong latency, broadcast, idle CPU, event-loop lag, and RPC from an async "
            "scheduler to 4 worker processes (aioshmq.rpc against zmq.asyncio); CPU torch "
            "tensors next to numpy arrays, writing in place (reserve) next to memcpy, and "
            "msgpack next to pickle.  Progress goes to stderr, the table to stdout.  A full "
            "run takes a few minutes on 2 cores."
        ),
    )
    parser.add_argument(
        "--quick", action="store_true", help="shorten every scenario (under 2 minutes in all)"
    )
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # for the tests
    parser.add_argument("--json", metavar="PATH", type=Path, help="write every result as JSON")
    parser.add_argument("--plot", metavar="PATH", type=Path, help="write a PNG chart")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SCENARIO_NAMES,
        metavar="SCENARIO",
        help=f"run only these scenarios: {', '.join(SCENARIO_NAMES)}",
    )
    args = parser.parse_args(argv)
    if args.plot is not None and not plot_available():
        parser.error("--plot needs matplotlib: pip install matplotlib")
    command = shlex.join(["python", "-m", "benchmarks", *argv])
    if os.environ.get("AIOSHMQ_PURE", "") not in ("", "0"):
        command = f"AIOSHMQ_PURE={shlex.quote(os.environ['AIOSHMQ_PURE'])} {command}"
    return run(
        quick=args.quick,
        tiny=args.tiny,
        only=args.only,
        json_path=args.json,
        plot_path=args.plot,
        command=command,
    )


if __name__ == "__main__":
    sys.exit(main())

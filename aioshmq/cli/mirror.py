"""The ``python -m aioshmq mirror`` command: a remote writer's stream, carried into a ring here."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

SECRET_ENV = "AIOSHMQ_SECRET"


def add_parser(commands: Any) -> None:
    mirror = commands.add_parser(
        "mirror",
        help="republish a remote writer's stream into a ring on this host",
        description=(
            "Attach to reader slot READER of the writer at ADDRESS and republish every "
            "message into a local ring named NAME with READERS slots, which readers on this "
            "host attach to by name.  The bytes cross the network once for all of them.  "
            f"The secret comes from --secret-file or the {SECRET_ENV} environment variable "
            "(never from the command line, where other users could read it).  Prints one "
            "line to stderr once the local ring exists; exits 0 when the stream ends (or on "
            "SIGINT/SIGTERM, giving the slot back), 1 if it is cut off."
        ),
    )
    mirror.add_argument("address", help="the writer's endpoint: tcp://HOST:PORT or ipc://PATH")
    mirror.add_argument("--reader", type=int, default=0, help="the remote slot (default 0)")
    mirror.add_argument("--readers", type=int, default=1, help="local slots (default 1)")
    mirror.add_argument("--name", help="the local ring's name (default: generated, printed)")
    mirror.add_argument("--secret-file", type=Path, help="a file holding the shared secret")
    mirror.add_argument(
        "--insecure-loopback",
        action="store_true",
        help="plain traffic, for a writer on loopback or ipc made with insecure_loopback=True",
    )
    mirror.add_argument("--heartbeat", type=float, default=3.0, help="seconds (default 3)")
    mirror.add_argument("--timeout", type=float, default=10.0, help="connect timeout, seconds")
    mirror.add_argument(
        "--on-reader-death", choices=["raise", "detach"], default="raise", help="local readers"
    )
    mirror.add_argument(
        "--serializer",
        choices=["pickle", "cloudpickle", "raw"],
        help="the writer's serializer, if a custom one is not in use (default: the writer's)",
    )


def run(args: argparse.Namespace) -> int:
    from .. import remote
    from ..base.errors import PeerDied

    Mirror = remote.load("_mirror").Mirror

    secret: bytes | None = None
    if args.secret_file is not None:
        secret = args.secret_file.read_bytes().rstrip(b"\r\n")
    elif os.environ.get(SECRET_ENV):
        secret = os.environ[SECRET_ENV].encode()
    m = Mirror(
        args.address,
        args.reader,
        readers=args.readers,
        name=args.name,
        secret=secret,
        insecure_loopback=args.insecure_loopback,
        heartbeat=args.heartbeat,
        timeout=args.timeout,
        serializer=args.serializer,
        on_reader_death=args.on_reader_death,
    )
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: threading.Thread(target=m.close).start())
    print(
        f"aioshmq mirror: ring {m.name!r} ({args.readers} readers) carries reader "
        f"{args.reader} of {args.address}",
        file=sys.stderr,
        flush=True,
    )
    try:
        m.run()
    except PeerDied as exc:
        print(f"aioshmq mirror: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        m.close()
    return 0

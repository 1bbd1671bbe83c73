"""The ``python -m aioshmq mirror`` command: a remote writer's stream, carried into a ring here."""

from __future__ import annotations

import argparse
import binascii
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import anyio

SECRET_ENV = "AIOSHMQ_SECRET"
MIN_SECRET = 16  # bytes, as aioshmq.remote asks of a secret
MAKE_SECRET = (
    "python -c 'import secrets, sys; sys.stdout.buffer.write(secrets.token_bytes(32))' > FILE"
)


class UsageError(Exception):
    """A flag (or the environment) must change: one line naming it; exit status 2."""


def add_parser(commands: Any) -> None:
    mirror = commands.add_parser(
        "mirror",
        help="republish a remote writer's stream into a ring on this host",
        description=(
            "Attach to reader slot READER of the writer at ADDRESS and republish every "
            "message into a local ring named NAME with READERS slots, which readers on this "
            "host attach to by name.  The bytes cross the network once for all of them.  "
            "The shared secret comes from --secret-file (the file's bytes, exactly as "
            f"written: no newline is stripped) or the {SECRET_ENV} environment variable (the "
            "secret in hex), never from the command line, where other users could read it.  "
            "Prints one line to stderr once the local ring exists; exits 0 when the stream "
            "ends (or on SIGINT/SIGTERM, giving the slot back), 1 if it is cut off or cannot "
            "start, 2 if a flag must change."
        ),
    )
    mirror.add_argument("address", help="the writer's endpoint: tcp://HOST:PORT or ipc://PATH")
    mirror.add_argument("--reader", type=int, default=0, help="the remote slot (default 0)")
    mirror.add_argument("--readers", type=int, default=1, help="local slots (default 1)")
    mirror.add_argument("--name", help="the local ring's name (default: generated, printed)")
    mirror.add_argument(
        "--secret-file",
        type=Path,
        help="a file holding the shared secret, as raw bytes (at least 16); made with "
        + MAKE_SECRET,
    )
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


def read_secret(args: argparse.Namespace) -> bytes | None:
    """The secret from ``--secret-file`` (its bytes, exactly) or the environment (hex)."""
    text = os.environ.get(SECRET_ENV)
    secret: bytes
    if args.secret_file is not None:
        if text:
            raise UsageError(f"give --secret-file or {SECRET_ENV}, not both")
        try:
            secret = args.secret_file.read_bytes()
        except OSError as exc:
            raise UsageError(
                f"--secret-file: cannot read {args.secret_file}: {exc.strerror}"
            ) from None
        where = f"--secret-file {args.secret_file} holds"
    elif text:
        try:
            secret = binascii.unhexlify(text.strip())
        except (binascii.Error, ValueError):
            raise UsageError(
                f"{SECRET_ENV} must hold the secret in hex (64 hex digits for 32 bytes); "
                "for raw bytes use --secret-file"
            ) from None
        where = f"{SECRET_ENV} holds"
    else:
        return None
    if len(secret) < MIN_SECRET:
        raise UsageError(
            f"{where} {len(secret)} bytes: a secret has at least {MIN_SECRET} (the writer's "
            f"own, shared; a new one is made with {MAKE_SECRET})"
        )
    return secret


def check_flags(args: argparse.Namespace, secret: bytes | None) -> None:
    """Every flag's own check, before anything is connected: errors name the flag."""
    address = args.address
    if not (address.startswith("tcp://") or address.startswith("ipc://")) or address in (
        "tcp://",
        "ipc://",
    ):
        raise UsageError(f"ADDRESS must be tcp://HOST:PORT or ipc://PATH, not {address!r}")
    if args.reader < 0:
        raise UsageError(f"--reader {args.reader}: slots are numbered from 0")
    if not 1 <= args.readers <= 4096:
        raise UsageError(f"--readers {args.readers}: from 1 to 4096 local slots")
    if not 0.05 <= args.heartbeat <= 3600:
        raise UsageError(f"--heartbeat {args.heartbeat:g}: from 0.05 to 3600 seconds")
    if not args.timeout >= 0:
        raise UsageError(f"--timeout {args.timeout:g}: seconds, 0 or more")
    if secret is not None and args.insecure_loopback:
        raise UsageError(f"give --secret-file (or {SECRET_ENV}) or --insecure-loopback, not both")
    if secret is None and not args.insecure_loopback:
        raise UsageError(
            f"{address} needs the writer's secret: --secret-file FILE or {SECRET_ENV}=HEX "
            "(--insecure-loopback only for a loopback or ipc writer made without one)"
        )
    if args.name is not None:
        from ..ends.broker import check_name

        try:
            check_name(args.name)
        except ValueError as exc:
            raise UsageError(f"--name: {exc}") from None


def _hint(exc: BaseException) -> str:
    """The flag to change after a failure to start, named after its message."""
    if isinstance(exc, anyio.BusyResourceError):
        return " (another --reader, or wait for its holder to let go)"
    if isinstance(exc, PermissionError):
        return f" (check --secret-file or {SECRET_ENV})"
    if isinstance(exc, TimeoutError):
        return " (check ADDRESS, or give a longer --timeout)"
    if isinstance(exc, FileExistsError):
        return " (another --name)"
    if isinstance(exc, ValueError) and "out of range" in str(exc):
        return " (another --reader)"
    if isinstance(exc, ValueError) and "serializer" in str(exc):
        return " (give --serializer)"
    return ""


def run(args: argparse.Namespace) -> int:
    """The command: 0 when the stream ended or a signal stopped it, 1 if cut off or it could
    not start, 2 if a flag must change."""
    try:
        secret = read_secret(args)
        check_flags(args, secret)
    except UsageError as exc:
        return _say(str(exc), 2)
    from .. import remote
    from ..base.errors import PeerDied

    try:
        mirror = remote.load("_mirror")
    except ModuleNotFoundError as exc:
        return _say(str(exc), 1)
    stopping = threading.Event()
    made: list[Any] = []

    def stop(*_: object) -> None:
        # Only asks the run to end: the close below is the only one.
        stopping.set()
        if made:
            made[0].stop()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop)
    try:
        m = mirror.Mirror(
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
    except (OSError, ValueError, RuntimeError, anyio.BrokenResourceError) as exc:
        return _say(f"{_one_line(exc)}{_hint(exc)}", 1)
    made.append(m)
    try:
        if stopping.is_set():  # a signal came during the handshake
            m.stop()
        print(
            f"aioshmq mirror: ring {m.name!r} ({args.readers} readers) carries reader "
            f"{args.reader} of {args.address}",
            file=sys.stderr,
            flush=True,
        )
        try:
            m.run()
        except PeerDied as exc:
            return _say(_one_line(exc), 1)
        return 0
    finally:
        m.close()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _say(text: str, status: int) -> int:
    print(f"aioshmq mirror: {text}", file=sys.stderr, flush=True)
    return status

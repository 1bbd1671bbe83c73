"""Who may talk to a remote endpoint: keys from the shared secret, the ZAP check, socket limits."""

from __future__ import annotations

import hashlib
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any, cast

import zmq
from zmq.utils import z85

MIN_SECRET = 16  # bytes: the public keys travel in the clear, so a short secret can be guessed
HANDSHAKE_TIMEOUT = 5.0  # s: a connection not through its handshake by then is closed
ZAP_ENDPOINT = "inproc://zeromq.zap.01"


@dataclass(frozen=True)
class Keys:
    """The CurveZMQ key pairs both ends derive from one secret (z85-encoded)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> Keys:
        def pair(role: bytes) -> tuple[bytes, bytes]:
            raw = hashlib.blake2b(secret, digest_size=32, person=b"aioshmq-" + role).digest()
            private = z85.encode(raw)
            return zmq.curve_public(private), private

        server_public, server_secret = pair(b"server")
        client_public, client_secret = pair(b"client")
        return cls(server_public, server_secret, client_public, client_secret)


def check_security(address: str, secret: object, insecure_loopback: bool) -> Keys | None:
    """The keys for ``address``, or None for plain traffic where that was asked for by name
    and is safe (loopback TCP, ipc); a clear error for anything else."""
    if secret is not None:
        if insecure_loopback:
            raise ValueError("give either secret= or insecure_loopback=True, not both")
        if not isinstance(secret, bytes):
            raise TypeError(f"secret must be bytes, not {type(secret).__name__}")
        if len(secret) < MIN_SECRET:
            raise ValueError(
                f"secret must be at least {MIN_SECRET} bytes (it was {len(secret)}): use "
                "secrets.token_bytes(32)"
            )
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support: it cannot encrypt")
        return Keys.from_secret(secret)
    if not insecure_loopback:
        raise ValueError(
            f"{address!r} needs secret=b'...' (shared by the writer and its remote readers): "
            "messages are unpickled, so an unauthenticated peer could run code here; for "
            "loopback or ipc only, insecure_loopback=True turns authentication and encryption "
            "off"
        )
    if not address.startswith("ipc://") and not _is_loopback(address):
        raise ValueError(
            f"insecure_loopback=True is for loopback addresses and ipc only, not {address!r}: "
            "use secret=b'...' across hosts"
        )
    return None


def _is_loopback(address: str) -> bool:
    host = split_tcp(address)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_tcp(address: str) -> tuple[str, str]:
    """(host, port) of a ``tcp://host:port`` address (IPv6 hosts in brackets)."""
    rest = address[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{address!r} is not tcp://HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def check_address(address: object, what: str) -> str:
    if not isinstance(address, str):
        kind = type(address).__name__
        raise TypeError(f"{what} must be a str like 'tcp://HOST:PORT', not {kind}")
    if address.startswith("tcp://"):
        split_tcp(address)
    elif not address.startswith("ipc://") or len(address) <= len("ipc://"):
        raise ValueError(f"{what}={address!r}: use 'tcp://HOST:PORT' or 'ipc://PATH'")
    return address


# Plain ints: pyzmq's flag enums cost more, on the data path, than the calls they go to.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)


def readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on the socket (its ZMQ_EVENTS, whose reading is also what
    makes its fd signal again), asked instead of trying a receive: pyzmq's ``zmq.Again``
    costs several times more."""
    return bool(cast(int, sock.get(_EVENTS)) & _POLLIN)


def send_frames(sock: zmq.Socket[bytes], frames: list[Any], copy: bool = True) -> None:
    """``send_multipart`` without its per-frame checks and flag arithmetic on enums."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, _SNDMORE if i < last else 0, copy=copy)


def fd_of(sock: zmq.Socket[bytes]) -> int:
    """The fd that signals when the socket's events may have changed (an edge, see
    ``events``)."""
    return cast(int, sock.get(zmq.FD))


def tune(sock: zmq.Socket[bytes], heartbeat: float, limit: int) -> None:
    """Options of every socket that faces the network: no message above ``limit`` bytes
    (a peer sending one is disconnected before it is held in memory), a connection not
    through its handshake in HANDSHAKE_TIMEOUT closed, and ZeroMQ's own heartbeats, so
    that a peer that falls silent (its host gone, its process frozen) loses its
    connection within ``heartbeat`` seconds even while no message is due."""
    sock.linger = 0
    sock.maxmsgsize = limit
    sock.handshake_ivl = int(HANDSHAKE_TIMEOUT * 1000)
    sock.heartbeat_ivl = max(int(heartbeat * 1000 / 3), 1)
    sock.heartbeat_timeout = sock.heartbeat_ttl = int(heartbeat * 1000)


def secure_server(sock: zmq.Socket[bytes], keys: Keys | None) -> None:
    if keys is not None:
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.zap_domain = b"aioshmq"
    else:
        sock.zap_domain = b"aioshmq-plain"


def secure_client(sock: zmq.Socket[bytes], keys: Keys | None) -> None:
    if keys is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret


def zap_reply(frames: list[bytes], keys: Keys | None) -> list[bytes]:
    """Answer one ZAP request: only CURVE clients holding the secret's client key pass
    (or, where the user turned security off, plain peers)."""
    if len(frames) < 6:
        return [b"1.0", b"", b"400", b"malformed request", b"", b""]
    version, request_id, _domain, _address, _identity, mechanism = frames[:6]
    credentials = frames[6:]
    if keys is None:
        ok = mechanism == b"NULL"
    else:
        ok = mechanism == b"CURVE" and credentials == [z85.decode(keys.client_public)]
    if ok:
        return [version, request_id, b"200", b"OK", b"aioshmq", b""]
    return [version, request_id, b"400", b"wrong secret", b"", b""]


def local_address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])

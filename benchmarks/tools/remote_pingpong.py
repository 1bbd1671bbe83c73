"""A bare sync round trip over TCP loopback: aioshmq's remote path against raw pyzmq.

    python tools/remote_pingpong.py [--rounds 3000] [--repeat 3]

Two processes, one 100-byte tuple back and forth, no event loop on either side (``put_sync``
and ``get_sync``; PUSH/PULL ``send``/``recv``).  aioshmq runs twice, with a secret (CurveZMQ)
and with ``insecure_loopback=True``; pyzmq runs plain and with CurveZMQ.  The runs
alternate, ``--repeat`` times, and each prints its p50 and p99.  This is the floor the
remote path adds its two thread hops per direction to (the writer's server thread, the
reader's link thread); the bench's round trip runs under asyncio on both sides instead.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import time
from typing import Any

import zmq

import aioshmq
from aioshmq.remote._auth import Keys

SECRET = b"remote-pingpong-secret-0123456789"
MESSAGE = (1, "x" * 90)
WARMUP = 200


def _options(secure: bool) -> dict[str, Any]:
    return {"secret": SECRET} if secure else {"insecure_loopback": True}


def _aioshmq_echo(addresses: Any, secure: bool, rounds: int) -> None:
    back = aioshmq.create(1 << 20, listen="tcp://127.0.0.1:0", **_options(secure))
    addresses.put(back.address)
    calls = aioshmq.connect(addresses.get(), **_options(secure))
    back.wait_readers_sync(timeout=30)
    for _ in range(rounds):
        back.put_sync(calls.get_sync(timeout=30))
    back.close()
    calls.close()


def _aioshmq(secure: bool, rounds: int) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    addresses = ctx.Queue()
    out = aioshmq.create(1 << 20, listen="tcp://127.0.0.1:0", **_options(secure))
    child = ctx.Process(target=_aioshmq_echo, args=(addresses, secure, rounds))
    child.start()
    back_address = addresses.get()
    addresses.put(out.address)
    replies = aioshmq.connect(back_address, **_options(secure))
    out.wait_readers_sync(timeout=30)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        out.put_sync(MESSAGE)
        replies.get_sync(timeout=30)
        times.append(time.perf_counter() - start)
    out.close()
    replies.close()
    child.join(30)
    return times[WARMUP:]


def _curve(sock: zmq.Socket[bytes], server: bool) -> None:
    keys = Keys.from_secret(SECRET)
    if server:
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = keys.server_secret, keys.server_public
    else:
        sock.curve_serverkey = keys.server_public
        sock.curve_secretkey, sock.curve_publickey = keys.client_secret, keys.client_public


def _zmq_echo(ports: tuple[int, int], secure: bool, rounds: int) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    if secure:
        _curve(pull, False)
        _curve(push, False)
    pull.connect(f"tcp://127.0.0.1:{ports[0]}")
    push.connect(f"tcp://127.0.0.1:{ports[1]}")
    for _ in range(rounds):
        push.send(pull.recv())
    ctx.destroy(linger=1000)


def _zmq(secure: bool, rounds: int) -> list[float]:
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    if secure:
        _curve(push, True)
        _curve(pull, True)
    ports = push.bind_to_random_port("tcp://127.0.0.1"), pull.bind_to_random_port("tcp://127.0.0.1")
    child = multiprocessing.get_context("spawn").Process(
        target=_zmq_echo, args=(ports, secure, rounds)
    )
    child.start()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        push.send(pickle.dumps(MESSAGE, protocol=5))
        pickle.loads(pull.recv())
        times.append(time.perf_counter() - start)
    child.join(30)
    ctx.destroy(linger=0)
    return times[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs = [
        ("aioshmq, secret (CURVE)", _aioshmq, True),
        ("pyzmq, CURVE", _zmq, True),
        ("aioshmq, insecure_loopback", _aioshmq, False),
        ("pyzmq, plain", _zmq, False),
    ]
    for _ in range(args.repeat):
        for name, run, secure in runs:
            times = sorted(run(secure, args.rounds + WARMUP))
            p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99)]
            print(f"{name:28} p50 {p50 * 1e6:7.0f} us   p99 {p99 * 1e6:7.0f} us", flush=True)


if __name__ == "__main__":
    main()

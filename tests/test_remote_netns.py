"""Remote readers on "another host" for real: two network namespaces joined by a veth pair,
the writer in one (A), remote readers and a mirror in the other (B), traffic only over the
veth.  Every process is a child run with ``ip netns exec``; the test waits on the lines they
print.  Needs root (the module is skipped otherwise).

The stress test (10,000 random arrays, ~400 MB, to four readers across the link and through
a mirror) is in the slow tier; the default tier runs it on 500 arrays.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator

import pytest
from _netns import Children, Pair, Unavailable

SECRET = secrets.token_bytes(32)
ATTACH = 30.0  # seconds for a child to start (import numpy, zmq) and attach
EXIT = 30.0  # seconds for a child to finish once it should

# -- the children's scripts ------------------------------------------------------------------

PRELUDE = """
import os, random, sys, time
import anyio
import numpy as np
import aioshmq
from aioshmq import PeerDied

SECRET = bytes.fromhex(os.environ["NETNS_TEST_SECRET"])

def say(*words):
    print(*words, flush=True)

def array(i):
    # Message i, from its own seed: random size (0..10,000 int64s), random values.
    rng = np.random.default_rng([20260417, i])
    n = int(rng.integers(0, 10_001))
    return rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64, endpoint=True)
"""

# argv: listen, messages (-1: until PeerDied), heartbeat, capacity, max_messages[, "tell"];
# puts ints 0, 1, 2, ...; with "tell", says FULL i whenever message i finds the ring full.
WRITE_INTS = (
    PRELUDE
    + """
listen, n, beat = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
capacity, max_messages = int(sys.argv[4]), int(sys.argv[5])
tell = sys.argv[6:] == ["tell"]
w = aioshmq.create(
    capacity, max_messages, readers=1, listen=listen, secret=SECRET, heartbeat=beat
)
try:
    say("ADDR", w.address)
    w.wait_readers_sync(timeout=60)
    say("ATTACHED")
    i = 0
    while n < 0 or i < n:
        try:
            if tell:
                try:
                    w.put_nowait(i)
                except aioshmq.Full:
                    say("FULL", i)
                    w.put_sync(i, timeout=60)
            else:
                w.put_sync(i, timeout=60)
        except PeerDied as exc:
            say("PEERDIED", i, exc.index, time.monotonic(), "|", exc)
            break
        i += 1
    else:
        say("PUT", i)
finally:
    w.close()
say("CLOSED")
"""
)

# argv: address, reader, heartbeat, report_at[, hold]; reads ints 0, 1, 2, ... until the
# end; with hold, it stops reading after report_at, says FULL once it holds that many
# messages not read yet (its ring is full), waits for a line on stdin, then reads on and
# says MORE once it read 100 more.
READ_INTS = (
    PRELUDE
    + """
address, index = sys.argv[1], int(sys.argv[2])
beat, report_at = float(sys.argv[3]), int(sys.argv[4])
hold = int(sys.argv[5]) if len(sys.argv) > 5 else 0
r = aioshmq.connect(address, reader=index, secret=SECRET, heartbeat=beat, timeout=20)
say("CONNECTED")
got = 0
try:
    while True:
        x = r.get_sync(timeout=60)
        if x != got:
            say("GAP", "expected", got, "got", x)
            sys.exit(3)
        got += 1
        if got == report_at:
            say("GOT", got)
            if hold:
                deadline = time.monotonic() + 30
                while (held := r.statistics().messages_available) < hold:
                    if time.monotonic() > deadline:
                        say("STUCK", held)
                        sys.exit(7)
                    time.sleep(0.005)
                say("FULL", held)
                sys.stdin.readline()
        elif hold and got == report_at + 100:
            say("MORE", got)
except anyio.EndOfStream:
    say("END", got)
except PeerDied as exc:
    say("PEERDIED", got, time.monotonic(), "|", exc)
finally:
    r.close()
"""
)

# argv: address, wrong secret (hex), then READ_INTS's arguments
WRONG_THEN_RIGHT = (
    PRELUDE
    + """
address, wrong = sys.argv[1], bytes.fromhex(sys.argv[2])
try:
    r = aioshmq.connect(address, reader=0, secret=wrong, heartbeat=3.0, timeout=2)
except TimeoutError as exc:
    say("REFUSED", "|", exc)
else:
    r.close()
    say("ACCEPTED")
    sys.exit(4)
del sys.argv[2]
"""
    + READ_INTS.replace(PRELUDE, "")
)

# argv: listen, messages, name; slot 0 local, 1 the mirror, 2 a direct remote reader
WRITE_ARRAYS = (
    PRELUDE
    + """
listen, n, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pause = random.Random(n)
w = aioshmq.create(1 << 20, 64, readers=3, name=name, listen=listen, secret=SECRET)
try:
    say("ADDR", w.address, w.name)
    w.wait_readers_sync(timeout=60)
    say("ATTACHED")
    started = time.monotonic()
    total = 0
    for i in range(n):
        a = array(i)
        total += a.nbytes
        w.put_sync(a, timeout=120)
        time.sleep(pause.random() / 1000)
    say("PUT", n, total, round(time.monotonic() - started, 2))
finally:
    w.close()
say("CLOSED")
"""
)

# argv: ring name or address, reader, messages, mode (sync / iter / many)
READ_ARRAYS = (
    PRELUDE
    + """
target, index, n, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
remote = {"secret": SECRET} if target.startswith("tcp://") else {}
r = aioshmq.connect(target, reader=index, timeout=30, **remote)
say("CONNECTED")
got = 0

def check(a):
    global got
    want = array(got)
    if not (isinstance(a, np.ndarray) and a.dtype == want.dtype and np.array_equal(a, want)):
        say("BAD", got, type(a).__name__, getattr(a, "shape", None), want.shape)
        sys.exit(5)
    got += 1

async def by_iteration():
    async for a in r:
        check(a)

async def by_batches():
    while True:
        try:
            batch = await r.get_many(16)
        except anyio.EndOfStream:
            return
        for a in batch:
            check(a)

try:
    if mode == "sync":
        while True:
            try:
                a = r.get_sync(timeout=120)
            except anyio.EndOfStream:
                break
            check(a)
    elif mode == "iter":
        anyio.run(by_iteration)
    else:
        anyio.run(by_batches)
finally:
    r.close()
say("COUNT", got)
sys.exit(0 if got == n else 6)
"""
)

# argv: address, reader, local readers, local ring name
MIRROR = (
    PRELUDE
    + """
from aioshmq.remote import Mirror

address, index, readers, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# linger: if the stream ends before a local reader attached, its messages wait for it.
with Mirror(address, index, readers=readers, name=name, secret=SECRET, linger=60) as m:
    say("MIRROR", m.name)
    m.run()
say("MIRRORED")
"""
)


# argv: address, ring name; a mirror with two local readers that is cut off
MIRROR_CUT = (
    PRELUDE
    + """
from aioshmq.remote import Mirror

address, name = sys.argv[1], sys.argv[2]
with Mirror(address, 0, readers=2, name=name, secret=SECRET, heartbeat=1.0, linger=30) as m:
    say("MIRROR", m.name)
    try:
        m.run()
    except PeerDied as exc:
        say("PEERDIED", time.monotonic(), "|", exc)
    else:
        say("ENDED")
"""
)

# argv: ring name, reader; reads ints 0, 1, 2, ... from a local ring until the end
READ_LOCAL_INTS = (
    PRELUDE
    + """
r = aioshmq.connect(sys.argv[1], reader=int(sys.argv[2]), timeout=20)
say("CONNECTED")
got = 0
try:
    async def main():
        global got
        async for x in r:
            if x != got:
                say("GAP", "expected", got, "got", x)
                sys.exit(3)
            got += 1
            if got == 1000:
                say("GOT", got)
    anyio.run(main)
    say("END", got)
except PeerDied as exc:
    say("PEERDIED", got, time.monotonic(), "|", exc)
finally:
    r.close()
"""
)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    """Namespaces A and B joined by a veth, for this module; always deleted afterwards."""
    pid = os.getpid()
    net = Pair(tag=str(pid), subnet=pid % 250 + 1)
    try:
        net.create()
    except Unavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    try:
        yield net
    finally:
        net.delete()


@pytest.fixture
def kids() -> Iterator[Children]:
    group = Children({"NETNS_TEST_SECRET": SECRET.hex()})
    try:
        yield group
    finally:
        group.kill_all()


def port_of(address: str) -> str:
    return address.rpartition(":")[2]


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_messages_cross_the_link_in_order(pair: Pair, kids: Children) -> None:
    """A writer in A listening on every address, a remote reader in B: 2,000 messages in
    order, then EndOfStream once the writer closed."""
    writer = kids.start(
        "writer (A)", pair.a, WRITE_INTS, "tcp://0.0.0.0:0", 2000, 3.0, 1 << 16, 256
    )
    (address,) = writer.expect("ADDR", ATTACH)
    assert address.startswith("tcp://0.0.0.0:")
    reader = kids.start(
        "reader (B)", pair.b, READ_INTS, f"tcp://{pair.a_ip}:{port_of(address)}", 0, 3.0, 0
    )
    writer.expect("ATTACHED", ATTACH)
    assert writer.expect("PUT", EXIT) == ["2000"]
    writer.expect("CLOSED", EXIT)
    assert reader.expect("END", EXIT) == ["2000"]
    writer.ok(EXIT)
    reader.ok(EXIT)


@pytest.mark.timeout(60)
def test_link_cut_both_sides_see_peer_died(pair: Pair, kids: Children) -> None:
    """The veth goes down while the writer puts: within the heartbeat (plus a margin) the
    writer's put raises PeerDied for the remote slot, and the reader gets every message
    that fully arrived, in order, then PeerDied; nothing the writer let go of is lost."""
    beat, max_messages = 1.0, 256
    listen = f"tcp://{pair.a_ip}:0"
    writer = kids.start("writer (A)", pair.a, WRITE_INTS, listen, -1, beat, 1 << 16, max_messages)
    (address,) = writer.expect("ADDR", ATTACH)
    reader = kids.start("reader (B)", pair.b, READ_INTS, address, 0, beat, 1000)
    writer.expect("ATTACHED", ATTACH)
    reader.expect("GOT", ATTACH)  # messages flow
    try:
        pair.set_link(up=False)
        cut = time.monotonic()
        words = writer.expect("PEERDIED", beat + 5)
        put, index, writer_saw = int(words[0]), words[1], float(words[2])
        words = reader.expect("PEERDIED", beat + 5)
        got, reader_saw = int(words[0]), float(words[1])
    finally:
        pair.set_link(up=True)
    writer.expect("CLOSED", EXIT)
    writer.ok(EXIT)
    reader.ok(EXIT)  # it exits 3 on a gap or a duplicate: it got exactly 0..got-1
    assert index == "0"
    # CLOCK_MONOTONIC is the same in every process of the machine.
    assert writer_saw - cut < beat + 3, f"the writer saw it {writer_saw - cut:.2f} s after the cut"
    assert reader_saw - cut < beat + 3, f"the reader saw it {reader_saw - cut:.2f} s after the cut"
    # The writer's ring kept every message the reader did not acknowledge (at most
    # max_messages of them): whatever it let go of had reached the reader.
    assert put - max_messages <= got <= put, (put, got)


@pytest.mark.timeout(60)
def test_mirror_cut_off(pair: Pair, kids: Children) -> None:
    """The veth goes down under a mirror in B: its run() raises PeerDied, its two local
    readers get every message that fully arrived, in order, then PeerDied, and the writer's
    put raises PeerDied for the mirror's slot."""
    beat, max_messages = 1.0, 256
    listen = f"tcp://{pair.a_ip}:0"
    writer = kids.start("writer (A)", pair.a, WRITE_INTS, listen, -1, beat, 1 << 16, max_messages)
    (address,) = writer.expect("ADDR", ATTACH)
    mirror = kids.start("mirror (B)", pair.b, MIRROR_CUT, address, f"netns-cut-{os.getpid()}")
    (name,) = mirror.expect("MIRROR", ATTACH)
    readers = [
        kids.start(f"mirror's reader {i} (B)", pair.b, READ_LOCAL_INTS, name, i) for i in range(2)
    ]
    for reader in readers:
        reader.expect("GOT", ATTACH)
    try:
        pair.set_link(up=False)
        cut = time.monotonic()
        words = writer.expect("PEERDIED", beat + 5)
        put, index, writer_saw = int(words[0]), words[1], float(words[2])
        mirror_saw = float(mirror.expect("PEERDIED", beat + 5)[0])
        got = [int(reader.expect("PEERDIED", beat + 5)[0]) for reader in readers]
    finally:
        pair.set_link(up=True)
    for child in (writer, mirror, *readers):
        child.ok(EXIT)  # a reader exits 3 on a gap or a duplicate
    assert index == "0"
    assert writer_saw - cut < beat + 3, f"the writer saw it {writer_saw - cut:.2f} s after the cut"
    assert mirror_saw - cut < beat + 3, f"the mirror saw it {mirror_saw - cut:.2f} s after the cut"
    # The local readers lose nothing the mirror's ring held, and the mirror acknowledged
    # only what its ring held: both got everything the writer let go of.
    assert got[0] == got[1], got
    assert put - max_messages <= got[0] <= put, (put, got)


@pytest.mark.slow  # about 4 s
@pytest.mark.timeout(60)
def test_connection_reset_loses_nothing(pair: Pair, kids: Children) -> None:
    """The TCP connection is destroyed at both ends while the link is down, for longer than
    the writer's beat interval but shorter than the heartbeat; meanwhile the reader goes on
    with what had arrived, acknowledging records the writer sent before the drop.  Once the
    link is back the reader reconnects by itself and gets every message exactly once."""
    messages, beat, max_messages = 20_000, 5.0, 256
    outage = 2.2  # the writer sends a beat (and finds the reader gone) every beat / 3 s
    listen = f"tcp://{pair.a_ip}:0"
    writer = kids.start(
        "writer (A)", pair.a, WRITE_INTS, listen, messages, beat, 1 << 16, max_messages, "tell"
    )
    (address,) = writer.expect("ADDR", ATTACH)
    reader = kids.start("reader (B)", pair.b, READ_INTS, address, 0, beat, 1000, max_messages)
    # It stopped reading after 1,000: its ring fills with what it acknowledged, and what
    # the writer put after that (the writer's ring is full then) waits in its link.
    held = int(reader.expect("FULL", ATTACH)[0])
    while int(writer.expect("FULL", EXIT)[0]) <= 1000 + held:
        pass
    deadline = time.monotonic() + EXIT
    while not (
        all(sent == 0 for _, sent in pair.connections("a").values())
        and all(unread == 0 for unread, _ in pair.connections("b").values())
    ):  # every byte the writer sent has reached the reader's process
        assert time.monotonic() < deadline, "TCP queues do not drain"
    try:
        pair.set_link(up=False)
        cut = time.monotonic()
        if not (pair.reset("a") and pair.reset("b")):
            pytest.skip("ss -K cannot destroy TCP connections here (CONFIG_INET_DIAG_DESTROY)")
        reader.send("go")
        reader.expect("MORE", EXIT)  # it acknowledged more than the writer heard of
        time.sleep(max(0.0, outage - (time.monotonic() - cut)))  # the outage itself
    finally:
        pair.set_link(up=True)
    assert reader.expect("END", EXIT) == [str(messages)]  # it exits 3 on a gap or duplicate
    writer.expect("CLOSED", EXIT)
    writer.ok(EXIT)
    reader.ok(EXIT)


@pytest.mark.timeout(60)
def test_wrong_secret_refused_writer_keeps_serving(pair: Pair, kids: Children) -> None:
    """A reader in B with the wrong secret is never served: its CURVE handshakes are cut
    short, which it cannot tell from a network resetting them, so after its timeout it says
    the writer could not be reached and names another secret as a cause; the writer then
    serves a reader with the right one."""
    listen = f"tcp://{pair.a_ip}:0"
    writer = kids.start("writer (A)", pair.a, WRITE_INTS, listen, 500, 3.0, 1 << 16, 256)
    (address,) = writer.expect("ADDR", ATTACH)
    wrong = secrets.token_bytes(32)
    reader = kids.start("reader (B)", pair.b, WRONG_THEN_RIGHT, address, wrong.hex(), 0, 3.0, 0)
    refusal = " ".join(reader.expect("REFUSED", ATTACH))
    assert "could not be reached" in refusal and "another secret" in refusal, refusal
    reader.expect("CONNECTED", ATTACH)
    writer.expect("ATTACHED", ATTACH)
    writer.expect("CLOSED", EXIT)
    assert reader.expect("END", EXIT) == ["500"]
    writer.ok(EXIT)
    reader.ok(EXIT)


def _arrays_through_mirror(pair: Pair, kids: Children, messages: int, wait: float) -> None:
    """In A: the writer and a local reader; in B: a mirror with two local readers, and a
    direct remote reader.  Every reader checks every array and counts them."""
    tag = f"{os.getpid()}-{messages}"
    received = pair.b_received()
    writer = kids.start(
        "writer (A)", pair.a, WRITE_ARRAYS, f"tcp://{pair.a_ip}:0", messages, f"netns-a-{tag}"
    )
    address, name = writer.expect("ADDR", ATTACH)
    readers = [kids.start("local reader (A)", pair.a, READ_ARRAYS, name, 0, messages, "sync")]
    mirror = kids.start("mirror (B)", pair.b, MIRROR, address, 1, 2, f"netns-b-{tag}")
    readers.append(
        kids.start("direct remote reader (B)", pair.b, READ_ARRAYS, address, 2, messages, "iter")
    )
    (mirrored,) = mirror.expect("MIRROR", ATTACH)
    for index, mode in ((0, "many"), (1, "sync")):
        label = f"mirror's reader {index} (B)"
        readers.append(kids.start(label, pair.b, READ_ARRAYS, mirrored, index, messages, mode))
    for reader in readers:
        reader.expect("CONNECTED", ATTACH)
    writer.expect("ATTACHED", ATTACH)
    words = writer.expect("PUT", wait)
    assert int(words[0]) == messages
    sent = int(words[1])  # bytes of array data
    writer.expect("CLOSED", EXIT)
    for reader in readers:
        assert reader.expect("COUNT", EXIT) == [str(messages)], reader.report()
        reader.ok(EXIT)
    mirror.expect("MIRRORED", EXIT)
    mirror.ok(EXIT)
    writer.ok(EXIT)
    # Both remote slots' streams (the mirror's and the direct reader's) crossed the veth.
    assert pair.b_received() - received >= 2 * sent


@pytest.mark.timeout(90)
def test_arrays_through_mirror_short(pair: Pair, kids: Children) -> None:
    """The stress test's setup on 500 arrays (~20 MB)."""
    _arrays_through_mirror(pair, kids, 500, wait=60)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_arrays_through_mirror_stress(pair: Pair, kids: Children) -> None:
    """10,000 random int64 arrays (~400 MB) with random sub-millisecond pauses between
    puts: all four readers (local in A, direct remote in B, two behind the mirror in B) get
    all of them, exactly."""
    _arrays_through_mirror(pair, kids, 10_000, wait=780)


# argv: listen; the scheduler: an rpc client of 4 workers (ranks 0 and 1 local, spawned
# here; 2 and 3 on the other side), the scheduler example's kinds of calls, then a call on
# the worker the test kills.
# What every rpc worker of these tests serves, local or remote.
RPC_PRELUDE = (
    PRELUDE
    + """
from aioshmq import rpc

class Target:
    def __init__(self, rank):
        self.rank = rank
    def echo(self, obj):
        return obj
    def tag(self, obj):
        return (self.rank, obj)
    def total(self, arr):
        return float(arr.sum())
    def hang(self):
        time.sleep(600)
"""
)

SCHEDULER = (
    RPC_PRELUDE
    + """
import multiprocessing

def local_worker(handle, rank):
    rpc.serve_sync(handle, rank, Target(rank))

client = rpc.Client(4, listen=sys.argv[1], secret=SECRET, heartbeat=1.0)
# Start method: fork, before any event loop runs (a script given with -c cannot be spawned).
ctx = multiprocessing.get_context("fork")
procs = [ctx.Process(target=local_worker, args=(client.handle, r)) for r in (0, 1)]
for p in procs:
    p.start()
say("ADDR", client.address)

async def main():
    async with client:
        with anyio.fail_after(60):
            await client.wait_workers()
        say("READY")
        arr = np.arange(64 << 10, dtype=np.float32)  # 256 KiB
        with anyio.fail_after(60):
            for i in range(300):
                calls = [client.submit("echo", {"i": i, "k": k}) for k in range(8)]
                calls.append(client.submit("tag", i, workers=[3, 0]))
                if i % 16 == 0:
                    calls.append(client.submit("total", arr, unique_reply_rank=2))
                results = [await c for c in calls]
                assert all(r == [{"i": i, "k": k}] * 4 for k, r in enumerate(results[:8]))
                assert results[8] == [(3, i), (0, i)]
                if i % 16 == 0:
                    assert results[9] == float(arr.sum())
        say("CALLS", 300)
        pending = client.submit("hang", workers=[3])
        say("PENDING")
        try:
            with anyio.fail_after(30):
                await pending
        except PeerDied as exc:
            say("PEERDIED", "|", exc)
    for p in procs:
        p.join(30)
        say("LOCAL", p.exitcode)

anyio.run(main)
"""
)

# argv: client address, rank; a worker on the other side
REMOTE_WORKER = (
    RPC_PRELUDE
    + """

rank = int(sys.argv[2])
say("SERVING", rank)
rpc.serve_sync(sys.argv[1], rank, Target(rank), secret=SECRET, heartbeat=1.0)
say("DONE", rank)
"""
)


@pytest.mark.timeout(120)
def test_rpc_with_workers_on_both_sides(pair: Pair, kids: Children) -> None:
    """4 workers, 2 of them across the link: every result right; one remote worker killed
    fails its call with PeerDied within the heartbeat, and the other workers end cleanly."""
    scheduler = kids.start("scheduler (A)", pair.a, SCHEDULER, "tcp://0.0.0.0:0")
    (address,) = scheduler.expect("ADDR", ATTACH)
    far = f"tcp://{pair.a_ip}:{port_of(address)}"
    workers = [kids.start(f"worker {r} (B)", pair.b, REMOTE_WORKER, far, r) for r in (2, 3)]
    scheduler.expect("READY", ATTACH * 2)
    assert scheduler.expect("CALLS", 60) == ["300"]
    scheduler.expect("PENDING", EXIT)
    workers[1].kill()
    killed = time.monotonic()
    said = scheduler.expect("PEERDIED", EXIT)
    assert time.monotonic() - killed < 1.0 + 5
    assert "worker" in " ".join(said)
    assert scheduler.expect("LOCAL", EXIT) == ["0"]
    assert scheduler.expect("LOCAL", EXIT) == ["0"]
    scheduler.ok(EXIT)
    assert workers[0].expect("DONE", EXIT) == ["2"]
    workers[0].ok(EXIT)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", ["reader", "mirror"])
def test_a_killed_reader_or_mirror_across_the_link_is_a_dead_reader(
    pair: Pair, kids: Children, victim: str
) -> None:
    """SIGKILL the remote reader (or the mirror carrying the slot) in B: the writer in A gets
    PeerDied for the slot within the heartbeat (plus a margin); the mirror's own readers
    get every message that arrived, in order, then PeerDied."""
    beat = 1.0
    writer = kids.start(
        "writer (A)", pair.a, WRITE_INTS, f"tcp://{pair.a_ip}:0", -1, beat, 1 << 16, 256
    )
    (address,) = writer.expect("ADDR", ATTACH)
    far = f"tcp://{pair.a_ip}:{port_of(address)}"
    local = None
    if victim == "reader":
        target = kids.start("reader (B)", pair.b, READ_INTS, far, 0, beat, 1000)
    else:
        name = f"netns-mirror-{os.getpid()}"
        target = kids.start("mirror (B)", pair.b, MIRROR, far, 0, 1, name)
        target.expect("MIRROR", ATTACH)
        local = kids.start("mirror's reader (B)", pair.b, READ_LOCAL_INTS, name, 0)
    writer.expect("ATTACHED", ATTACH)
    (local or target).expect("GOT", ATTACH)  # the stream flows
    target.kill()
    killed = time.monotonic()
    words = writer.expect("PEERDIED", EXIT)
    assert float(words[2]) - killed < beat + 3  # the child's clock is the same monotonic one
    assert "remote reader" in " ".join(words)
    writer.expect("CLOSED", EXIT)
    writer.ok(EXIT)
    if local is not None:  # the mirror died: its reader got a gapless prefix, then PeerDied
        local.expect("PEERDIED", EXIT)
        local.ok(EXIT)

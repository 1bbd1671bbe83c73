"""The transports compared: aioshmq and its peers, each as a one-way channel with async ends.

A channel is made in the parent and handed to child processes as a spawn argument; each
process then opens the end it uses, inside its event loop.  Peers without an async API
(multiprocessing.Queue, faster-fifo, vLLM's MessageQueue) block the loop in their calls: each
end has its process to itself, so that takes the loop from nobody, and it is how those queues
are fastest.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import importlib
import importlib.util
import os
import pickle
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any, TypeVar

import anyio

import aioshmq

from .procs import CTX

R = TypeVar("R")

STOP: Any = None  # the last message of every stream: the receiver ends its loop on it
SYNC_TIMEOUT = 30.0  # seconds a blocking put/get of a peer waits before giving up
CONNECT_TIMEOUT = 10.0  # seconds a receiver waits for the sender's ring to exist


class Sender:
    """The sending end of a channel."""

    blocking = False  #: sends with ``send_sync`` from a thread without an event loop

    def send_sync(self, obj: Any, timeout: float) -> None:
        raise NotImplementedError

    def send_many_sync(self, objs: list[Any], timeout: float) -> None:
        """``send_many`` without an event loop."""
        self.send_sync(objs, timeout)

    async def wait_ready(self) -> None:
        """Return once every receiver is attached, so that no message is sent into the void."""

    async def send(self, obj: Any) -> None:
        raise NotImplementedError

    async def send_many(self, objs: list[Any]) -> None:
        """Send a batch the way this transport batches (by default: the list as one message)."""
        await self.send(objs)

    def stats(self) -> dict[str, int]:
        """Counters worth reporting (aioshmq's wake-ups), read before ``close``."""
        return {}

    def close(self) -> None:
        pass


class Receiver:
    """The receiving end of a channel."""

    read = "get"  #: how messages are read: "get", or "lease" (zero-copy) where available
    blocking = False  #: receives with ``recv_sync`` from a thread without an event loop

    def recv_sync(self, timeout: float) -> Any:
        raise NotImplementedError

    def recv_many_sync(self, limit: int, timeout: float) -> list[Any]:
        """``recv_many`` without an event loop."""
        obj = self.recv_sync(timeout)
        return obj if isinstance(obj, list) else [obj]

    async def recv(self) -> Any:
        raise NotImplementedError

    async def recv_many(self, limit: int) -> list[Any]:
        """At least one message; a list sent as one message is unpacked."""
        obj = await self.recv()
        return obj if isinstance(obj, list) else [obj]

    async def recv_with(self, use: Callable[[Any], R]) -> R:
        """Receive one message and return ``use(message)``; the message is valid during it."""
        return use(await self.recv())

    def stats(self) -> dict[str, int]:
        """Counters worth reporting (aioshmq's wake-ups), read before ``close``."""
        return {}

    def close(self) -> None:
        pass


class Channel:
    """One direction of traffic, from one process to ``readers`` processes.

    ``capacity`` (bytes) and ``depth`` (messages) bound what is in flight, where the
    transport has such bounds; ``arrays`` says the messages are large payloads: uint8 numpy
    arrays, for transports that send raw buffers rather than pickles (aioshmq: or CPU torch
    tensors), read inside a lease where the transport has one.
    """

    broadcast = False  #: whether several readers each get every message

    def __init__(
        self,
        readers: int = 1,
        *,
        capacity: int = 16 << 20,
        depth: int = 1 << 16,
        arrays: bool = False,
    ) -> None:
        if readers != 1 and not self.broadcast:
            raise ValueError(f"{type(self).__name__} has one reader, not {readers}")
        self.readers = readers
        self.capacity = capacity
        self.depth = depth
        self.arrays = arrays
        self.owner = os.getpid()
        self._make()

    def _make(self) -> None:
        """Create what the channel needs in the process that makes it (the parent)."""

    def sender(self) -> Sender:
        raise NotImplementedError

    def receiver(self, index: int) -> Receiver:
        raise NotImplementedError

    def close(self) -> None:
        """Release what this process holds of the channel (each process calls it)."""


# -- aioshmq ---------------------------------------------------------------------------------


class _AioshmqSender(Sender):
    def __init__(self, writer: aioshmq.Writer[Any], reserve: bool = False) -> None:
        self._writer = writer
        # Arrays are written in place: reserve_array() of their shape and dtype, filled with
        # numpy.copyto from the array (what the memcpy floor does), published at block end.
        self._copyto: Callable[[Any, Any], None] | None = None
        if reserve:
            self._copyto = importlib.import_module("numpy").copyto
        else:  # the library's own call, with no layer of the bench's around it
            self.send = writer.put  # type: ignore[method-assign]

    async def wait_ready(self) -> None:
        await self._writer.wait_readers()

    async def send(self, obj: Any) -> None:
        if self._copyto is None or obj is STOP:
            await self._writer.put(obj)
            return
        async with self._writer.reserve_array(obj.shape, obj.dtype) as place:
            self._copyto(place, obj)

    async def send_many(self, objs: list[Any]) -> None:
        await self._writer.put_many(objs)

    def stats(self) -> dict[str, int]:
        stats = self._writer.statistics()
        return {"messages_put": stats.messages_put, "wakeups_sent": stats.wakeups_sent}

    def close(self) -> None:
        self._writer.close()


class _AioshmqReceiver(Receiver):
    def __init__(self, reader: aioshmq.Reader[Any], lease: bool) -> None:
        self._reader = reader
        # With ``lease`` (large payloads), each message is read inside ``reader.lease()``
        # (valid inside the block, viewing the ring) instead of ``get()``, which copies it
        # out; a reader without ``lease`` (a library before it) gets.
        self._lease: Callable[[], Any] | None = getattr(reader, "lease", None) if lease else None
        self.read = "get" if self._lease is None else "lease"
        self.recv = reader.get  # type: ignore[method-assign]  # no layer of the bench's

    async def recv(self) -> Any:
        return await self._reader.get()

    async def recv_many(self, limit: int) -> list[Any]:
        return await self._reader.get_many(max_messages=limit)

    async def recv_with(self, use: Callable[[Any], R]) -> R:
        if self._lease is not None:
            async with self._lease() as msg:
                return use(msg)
        return use(await self._reader.get())

    def stats(self) -> dict[str, int]:
        stats = self._reader.statistics()
        return {"messages_received": stats.messages_received, "wakeups_sent": stats.wakeups_sent}

    def close(self) -> None:
        self._reader.close()


class AioshmqChannel(Channel):
    """An aioshmq ring, made by the sender under a name chosen here, attached to by name.

    Subclasses change how it is used through the class attributes: the readers' spin, the
    serializer (readers learn it from the ring), how arrays are read and how they are written.
    """

    broadcast = True
    spin: float | None = None  #: the readers' spin before sleeping (None: the default)
    serializer = "pickle"  #: the ring's serializer, by name
    lease = True  #: read arrays inside ``reader.lease()`` (zero-copy), else with ``get()``
    reserve = False  #: write arrays in place through ``reserve_array()``, else ``put()``

    def _make(self) -> None:
        self.name = f"bench-{os.getpid()}-{secrets.token_hex(6)}"

    def _create(self) -> aioshmq.Writer[Any]:
        return aioshmq.create(
            self.capacity, self.depth, self.readers, name=self.name, serializer=self.serializer
        )

    def sender(self) -> Sender:
        return _AioshmqSender(self._create(), self.arrays and self.reserve)

    def receiver(self, index: int) -> Receiver:
        return _AioshmqReceiver(_attach(self.name, index, self.spin), self.arrays and self.lease)


class _AioshmqSyncSender(_AioshmqSender):
    """``put_sync`` itself: ``put_sync(obj, timeout)``, with no layer of the bench's around it."""

    blocking = True

    def __init__(self, writer: aioshmq.Writer[Any]) -> None:
        super().__init__(writer)
        self.send_sync = writer.put_sync  # type: ignore[method-assign]


class _AioshmqSyncReceiver(_AioshmqReceiver):
    """``get_sync`` itself: ``get_sync(timeout)``, with no layer of the bench's around it."""

    blocking = True

    def __init__(self, reader: aioshmq.Reader[Any], lease: bool) -> None:
        super().__init__(reader, lease)
        self.recv_sync = reader.get_sync  # type: ignore[method-assign]


class AioshmqSyncChannel(AioshmqChannel):
    """The same ring used from plain threads: ``put_sync`` and ``get_sync``, no event loop."""

    def sender(self) -> Sender:
        return _AioshmqSyncSender(self._create())

    def receiver(self, index: int) -> Receiver:
        return _AioshmqSyncReceiver(_attach(self.name, index, self.spin), self.arrays)


def _attach(name: str, index: int, spin: float | None = None) -> aioshmq.Reader[Any]:
    """Reader ``index`` of the local ring ``name``, once the process that makes it has."""
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while True:
        try:
            if spin is None:
                return aioshmq.connect(name, reader=index)
            return aioshmq.connect(name, reader=index, spin=spin)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)  # the sending process has not made the ring yet


# -- aioshmq's remote path (ZeroMQ over TCP) -------------------------------------------------

LOOPBACK = "tcp://127.0.0.1:0"  #: where remote senders listen: any free port on loopback


def _publish(path: str, text: str) -> None:
    """Leave ``text`` (an endpoint with its real port) in ``path`` for the other processes."""
    staged = f"{path}.{os.getpid()}"
    with open(staged, "w") as f:
        f.write(text)
    os.replace(staged, path)


def _published(path: str) -> str:
    """What ``_publish`` left in ``path``, waiting for it up to CONNECT_TIMEOUT."""
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while True:
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)  # the sending process has not bound its socket yet


class AioshmqRemoteChannel(Channel):
    """An aioshmq ring whose writer listens on TCP loopback, read by remote readers.

    The sender makes the ring with ``listen=`` on any free port and publishes the bound
    address in a file; each receiver is ``aioshmq.connect(address, reader=i, ...)``: a
    private one-slot mirror in a thread of its process, and a local reader of it.  Both
    ends hold ``secret`` (CurveZMQ: authenticated and encrypted), unless ``plain``
    (``insecure_loopback=True``: no authentication, no encryption).
    """

    broadcast = True
    plain = False

    def _make(self) -> None:
        tag = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(tempfile.gettempdir(), f"aioshmq-bench-{tag}.address")
        self.secret = None if self.plain else secrets.token_bytes(32)

    def security(self) -> dict[str, Any]:
        """The keyword arguments that give both ends the channel's security."""
        return {"insecure_loopback": True} if self.plain else {"secret": self.secret}

    def _create(self, readers: int) -> aioshmq.Writer[Any]:
        writer = aioshmq.create(
            self.capacity, self.depth, readers, listen=LOOPBACK, **self.security()
        )
        try:
            address = writer.address
            assert address is not None
            _publish(self.path, address)
        except BaseException:
            writer.close()
            raise
        return writer

    def sender(self) -> Sender:
        return _AioshmqSender(self._create(self.readers))

    def receiver(self, index: int) -> Receiver:
        address = _published(self.path)
        return _AioshmqReceiver(
            aioshmq.connect(address, reader=index, **self.security()), self.arrays
        )

    def close(self) -> None:
        _remove_own(self.owner, self.path)


class AioshmqPlainRemoteChannel(AioshmqRemoteChannel):
    """The same with ``insecure_loopback=True``: what encryption costs."""

    plain = True


class AioshmqMirrorChannel(AioshmqRemoteChannel):
    """The writer's ring holds one remote slot, held by a ``Mirror`` on the far side, which
    republishes the stream into a local ring there with ``readers`` slots: each receiver
    is a local reader of that ring.  The mirror runs in a process of its own
    (``mirror()``), started beside the receivers."""

    def _make(self) -> None:
        super()._make()
        self.mirror_name = f"bench-{os.getpid()}-{secrets.token_hex(6)}-mirror"

    def sender(self) -> Sender:
        return _AioshmqSender(self._create(1))

    def mirror(self) -> Any:
        """The far host's mirror (an ``aioshmq.remote.Mirror``), attached to the writer."""
        from aioshmq.remote import Mirror

        address = _published(self.path)
        return Mirror(address, 0, readers=self.readers, name=self.mirror_name, **self.security())

    def receiver(self, index: int) -> Receiver:
        return _AioshmqReceiver(_attach(self.mirror_name, index), self.arrays)


# -- raw pyzmq over TCP ----------------------------------------------------------------------


@dataclass(frozen=True)
class _CurveKeys:
    """A CurveZMQ key pair for each end of a channel, made where the channel is made (pyzmq's
    own ``curve_keypair``) and handed to both processes with it."""

    server: tuple[bytes, bytes]  #: public, secret
    client: tuple[bytes, bytes]

    @classmethod
    def new(cls) -> _CurveKeys:
        zmq = importlib.import_module("zmq")
        return cls(zmq.curve_keypair(), zmq.curve_keypair())


class _ZmqTcpSender(Sender):
    """Sync pyzmq: streamed from a thread without an event loop, as its users would."""

    blocking = True

    def __init__(self, channel: ZmqTcpChannel) -> None:
        zmq = importlib.import_module("zmq")
        self._arrays = channel.arrays
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        try:
            if channel.keys is not None:
                self._sock.curve_server = True
                self._sock.curve_publickey, self._sock.curve_secretkey = channel.keys.server
            self._sock.sndhwm = channel.depth
            self._sock.sndtimeo = int(SYNC_TIMEOUT * 1000)
            self._sock.bind(channel.endpoint())
            _publish(channel.path, self._sock.get_string(zmq.LAST_ENDPOINT))
        except BaseException:
            self.close()
            raise

    def send_sync(self, obj: Any, timeout: float) -> None:  # the socket's sndtimeo bounds it
        if not self._arrays:
            self._sock.send(pickle.dumps(obj, protocol=5))
            return
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        self._sock.send_multipart([head, *(b.raw() for b in buffers)], copy=False)

    async def send(self, obj: Any) -> None:
        self.send_sync(obj, SYNC_TIMEOUT)

    def close(self) -> None:
        if not self._ctx.closed:
            self._sock.close(linger=0)
            self._ctx.term()


class _ZmqTcpReceiver(Receiver):
    """Sync pyzmq: drained in a thread without an event loop, as its users would."""

    blocking = True

    def __init__(self, channel: ZmqTcpChannel) -> None:
        zmq = importlib.import_module("zmq")
        self._arrays = channel.arrays
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        try:
            if channel.keys is not None:
                self._sock.curve_serverkey = channel.keys.server[0]
                self._sock.curve_publickey, self._sock.curve_secretkey = channel.keys.client
            self._sock.rcvhwm = channel.depth
            self._sock.rcvtimeo = int(SYNC_TIMEOUT * 1000)
            self._sock.connect(_published(channel.path))
        except BaseException:
            self.close()
            raise

    def recv_sync(self, timeout: float) -> Any:  # the socket's rcvtimeo bounds it
        if not self._arrays:
            return pickle.loads(self._sock.recv())
        head, *frames = self._sock.recv_multipart(copy=False)
        return pickle.loads(head.buffer, buffers=[frame.buffer for frame in frames])

    async def recv(self) -> Any:
        return self.recv_sync(SYNC_TIMEOUT)

    def close(self) -> None:
        if not self._ctx.closed:
            self._sock.close(linger=0)
            self._ctx.term()


class ZmqTcpChannel(Channel):
    """Raw pyzmq, sync, over TCP loopback: a PUSH bound to any free port, a PULL connected.

    Every message is its pickle (protocol 5); an array's buffer travels out of band, as an
    extra frame sent with ``copy=False``.  Both high-water marks are ``depth``.
    """

    curve = False  # encrypt with CurveZMQ, as aioshmq's remote path does with a secret

    def endpoint(self) -> str:
        """Where the sender binds."""
        return LOOPBACK

    def _make(self) -> None:
        tag = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(tempfile.gettempdir(), f"aioshmq-bench-{tag}.address")
        self.keys = _CurveKeys.new() if self.curve else None

    def sender(self) -> Sender:
        return _ZmqTcpSender(self)

    def receiver(self, index: int) -> Receiver:
        return _ZmqTcpReceiver(self)

    def close(self) -> None:
        _remove_own(self.owner, self.path)


# -- multiprocessing.Queue -------------------------------------------------------------------


class _QueueSender(Sender):
    """A queue with a blocking API only: streamed from a thread without an event loop."""

    blocking = True

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def send_sync(self, obj: Any, timeout: float) -> None:
        self._queue.put(obj, True, timeout)

    async def send(self, obj: Any) -> None:
        self._queue.put(obj, timeout=SYNC_TIMEOUT)


class _QueueReceiver(Receiver):
    """A queue with a blocking API only: drained in a thread without an event loop."""

    blocking = True

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def recv_sync(self, timeout: float) -> Any:
        return self._queue.get(True, timeout)

    async def recv(self) -> Any:
        return self._queue.get(timeout=SYNC_TIMEOUT)


class MpQueueChannel(Channel):
    """A ``multiprocessing.Queue(maxsize=depth)``: a feeder thread pickles into a pipe."""

    def _make(self) -> None:
        self.queue = CTX.Queue(maxsize=self.depth)

    def sender(self) -> Sender:
        return _QueueSender(self.queue)

    def receiver(self, index: int) -> Receiver:
        return _QueueReceiver(self.queue)

    def close(self) -> None:
        # Every message was received or the run failed: never wait for the feeder at exit.
        self.queue.cancel_join_thread()
        self.queue.close()


# -- faster-fifo -----------------------------------------------------------------------------


class _FifoSender(_QueueSender):
    def send_many_sync(self, objs: list[Any], timeout: float) -> None:
        self._queue.put_many(objs, timeout=timeout)

    async def send_many(self, objs: list[Any]) -> None:
        self._queue.put_many(objs, timeout=SYNC_TIMEOUT)


class _FifoReceiver(_QueueReceiver):
    def recv_many_sync(self, limit: int, timeout: float) -> list[Any]:
        msgs: list[Any] = self._queue.get_many(max_messages_to_get=limit, timeout=timeout)
        return msgs

    async def recv_many(self, limit: int) -> list[Any]:
        msgs: list[Any] = self._queue.get_many(max_messages_to_get=limit, timeout=SYNC_TIMEOUT)
        return msgs


class FasterFifoChannel(Channel):
    """A ``faster_fifo.Queue``: a ring in shared memory behind a process-shared mutex."""

    def _make(self) -> None:
        faster_fifo = importlib.import_module("faster_fifo")
        self.queue = faster_fifo.Queue(max_size_bytes=self.capacity, maxsize=self.depth)

    def sender(self) -> Sender:
        return _FifoSender(self.queue)

    def receiver(self, index: int) -> Receiver:
        return _FifoReceiver(self.queue)


# -- iceoryx2 --------------------------------------------------------------------------------

IOX_BUFFER = 1024  #: samples a subscriber's buffer holds at most (the channel's depth if less)
IOX_SLICE = 128  #: bytes of a sample at first: a 100-byte pickle; larger ones grow the pool
IOX_STREAM = "aioshmq-bench/stream"  #: the publish-subscribe service of every channel
IOX_WAKE = "aioshmq-bench/wake"  #: its event service, where subscribers sleep
SHM_DIR = "/dev/shm"  #: where iceoryx2 names its shared memory (POSIX shm_open)


class _IoxNode:
    """One process's iceoryx2 node on a channel, with the channel's services opened.

    Every name the node gives a file starts with the channel's prefix, and its other files go
    under the channel's own root directory: so the process that made the channel can remove all
    of them, whatever state the others left them in (``IceoryxChannel.close``).
    """

    def __init__(self, channel: IceoryxChannel) -> None:
        iox2: Any = importlib.import_module("iceoryx2")
        self.iox2 = iox2
        config = iox2.config.default()
        config.global_cfg.prefix = iox2.FileName.new(channel.prefix)
        config.global_cfg.root_path = iox2.Path.new(channel.root + os.sep)
        self.node = (
            iox2.NodeBuilder.new()
            .config(config)
            .signal_handling_mode(iox2.SignalHandlingMode.Disabled)  # Python's own handlers
            .create(iox2.ServiceType.Ipc)
        )
        # Lossless: a full subscriber buffer holds the publisher back (the defaults overwrite
        # the oldest sample instead, and buffer 2 samples).
        self.stream = (
            self.node.service_builder(iox2.ServiceName.new(IOX_STREAM))
            .publish_subscribe(iox2.Slice[ctypes.c_uint8])
            .enable_safe_overflow(False)
            .subscriber_max_buffer_size(channel.buffer)
            .max_subscribers(channel.readers)
            .max_publishers(1)
            .open_or_create()
        )
        self.wake: Any = None
        if channel.sleep:
            self.wake = (
                self.node.service_builder(iox2.ServiceName.new(IOX_WAKE))
                .event()
                .max_listeners(channel.readers)
                .max_notifiers(1)
                .open_or_create()
            )

    def close(self) -> None:
        self.wake = self.stream = self.node = None  # the node last: dropped, it cleans up


class _IoxSender(Sender):
    """A publisher of each message's pickle in a loaned slice: sync, from a thread (iceoryx2's
    Python binding has no async API).  With a sleeping channel every send also notifies."""

    blocking = True

    def __init__(self, channel: IceoryxChannel) -> None:
        self._node = node = _IoxNode(channel)
        iox2 = node.iox2
        self._readers = channel.readers
        self._publisher = (
            node.stream.publisher_builder()
            .initial_max_slice_len(IOX_SLICE)
            .allocation_strategy(iox2.AllocationStrategy.PowerOfTwo)
            .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered)
            .create()
        )
        self._loan = self._publisher.loan_slice_uninit
        self._notifier: Any = None
        self._notify: Callable[[], Any] | None = None
        if node.wake is not None:
            self._notifier = node.wake.notifier_builder().create()
            self._notify = self._notifier.notify

    async def wait_ready(self) -> None:
        """Return once every subscriber (and, if they sleep, every listener) is there."""
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while not self._all_there():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._readers} iceoryx2 subscribers did not all attach")
            await anyio.sleep(0.01)
        self._publisher.update_connections()

    def _all_there(self) -> bool:
        node = self._node
        if node.stream.dynamic_config.number_of_subscribers < self._readers:
            return False
        return node.wake is None or node.wake.dynamic_config.number_of_listeners >= self._readers

    def send_sync(self, obj: Any, timeout: float) -> None:
        data = pickle.dumps(obj, protocol=5)
        sample = self._loan(len(data))
        ctypes.memmove(sample.payload_ptr, data, len(data))
        sample.assume_init().send()  # waits while a subscriber's buffer is full
        if self._notify is not None:
            self._notify()

    async def send(self, obj: Any) -> None:
        self.send_sync(obj, SYNC_TIMEOUT)

    def close(self) -> None:
        if self._notifier is not None:
            self._notifier.delete()
            self._notifier = self._notify = None
        self._publisher.delete()
        self._node.close()


class _IoxReceiver(Receiver):
    """A subscriber that unpickles each sample's slice where it lies, then releases it.  When
    its buffer is empty it polls ``receive()`` (``sched_yield`` between two polls), or, on a
    sleeping channel, waits in its event listener until the publisher notifies."""

    blocking = True

    def __init__(self, channel: IceoryxChannel) -> None:
        self._node = node = _IoxNode(channel)
        self._subscriber = node.stream.subscriber_builder().buffer_size(channel.buffer).create()
        self._listener: Any = None
        if node.wake is not None:
            self._listener = node.wake.listener_builder().create()

    def recv_sync(self, timeout: float) -> Any:
        receive = self._subscriber.receive
        sample = receive()
        if sample is None:
            sample = self._wait(receive, timeout)
        try:
            return pickle.loads(sample.payload().as_memory_view())
        finally:
            sample.delete()

    def _wait(self, receive: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        if self._listener is None:
            while (sample := receive()) is None:
                os.sched_yield()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no iceoryx2 sample in {timeout} s")
            return sample
        wait, duration = self._listener.timed_wait, self._node.iox2.Duration.from_secs_f64
        while (sample := receive()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no iceoryx2 sample in {timeout} s")
            wait(duration(left))  # every notification so far, or none by the deadline
        return sample

    async def recv(self) -> Any:
        return self.recv_sync(SYNC_TIMEOUT)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.delete()
            self._listener = None
        self._subscriber.delete()
        self._node.close()


class IceoryxChannel(Channel):
    """An iceoryx2 publish-subscribe service (its Python binding, over shared memory) whose
    samples are byte slices holding each message's pickle (protocol 5), configured lossless:
    safe overflow off, the publisher's backpressure ``RetryUntilDelivered``, and a subscriber
    buffer of ``depth`` samples, at most IOX_BUFFER.  Subscribers poll for samples, unless
    ``sleep``: then each send notifies an event service whose listener they sleep in.

    Each channel names its files with a prefix and keeps the rest under a directory of its
    own, both made here; the process that made the channel removes them at ``close``, also
    those of a process that crashed.
    """

    broadcast = True
    sleep = False  #: subscribers sleep in an event listener, and every send notifies it

    def _make(self) -> None:
        self.prefix = f"aioshmq-bench-{secrets.token_hex(6)}_"
        self.root = tempfile.mkdtemp(prefix="aioshmq-bench-iceoryx2-")
        self.buffer = max(1, min(self.depth, IOX_BUFFER))

    def sender(self) -> Sender:
        return _IoxSender(self)

    def receiver(self, index: int) -> Receiver:
        return _IoxReceiver(self)

    def leftovers(self) -> list[str]:
        """The files of this channel that exist now (in /dev/shm and under its root)."""
        found = [
            os.path.join(SHM_DIR, name)
            for name in os.listdir(SHM_DIR)
            if name.startswith(self.prefix)
        ]
        if os.path.isdir(self.root):
            found.append(self.root)
        return found

    def close(self) -> None:
        if os.getpid() != self.owner:
            return
        for path in self.leftovers():
            if path == self.root:
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


class IceoryxSleepingChannel(IceoryxChannel):
    """``IceoryxChannel`` whose subscribers sleep in its event service's listener."""

    sleep = True


# -- pyzmq -----------------------------------------------------------------------------------


class _ZmqEnd:
    def __init__(self, kind: str, address: str, hwm: int, bind: bool) -> None:
        zmq = importlib.import_module("zmq")
        self._ctx = importlib.import_module("zmq.asyncio").Context()
        self.sock = self._ctx.socket(getattr(zmq, kind))
        self.sock.setsockopt(zmq.SNDHWM if kind == "PUSH" else zmq.RCVHWM, hwm)
        if bind:
            self.sock.bind(address)
        else:
            self.sock.connect(address)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()


class _ZmqSender(Sender):
    def __init__(self, end: _ZmqEnd, arrays: bool) -> None:
        self._end = end
        self._arrays = arrays
        if not arrays:  # the library's own call, with no layer of the bench's around it
            self.send = end.sock.send_pyobj  # type: ignore[method-assign]

    async def send(self, obj: Any) -> None:
        if not self._arrays:
            await self._end.sock.send_pyobj(obj)
        elif obj is STOP:
            await self._end.sock.send(b"")
        else:
            await self._end.sock.send(obj, copy=False)

    def close(self) -> None:
        self._end.close()


class _ZmqReceiver(Receiver):
    def __init__(self, end: _ZmqEnd, arrays: bool) -> None:
        self._end = end
        self._arrays = arrays
        if not arrays:  # the library's own call, with no layer of the bench's around it
            self.recv = end.sock.recv_pyobj  # type: ignore[method-assign]

    async def recv(self) -> Any:
        if not self._arrays:
            return await self._end.sock.recv_pyobj()
        import numpy as np

        frame = await self._end.sock.recv(copy=False)
        buf = frame.buffer
        return STOP if buf.nbytes == 0 else np.frombuffer(buf, dtype=np.uint8)

    def close(self) -> None:
        self._end.close()


class ZmqChannel(Channel):
    """A zmq.asyncio PUSH socket bound to an ipc:// path, and a PULL socket connected to it.

    Objects go by ``send_pyobj``/``recv_pyobj``; arrays as their buffer with ``copy=False``.
    Both high-water marks are ``depth``.
    """

    def _make(self) -> None:
        name = f"aioshmq-bench-{os.getpid()}-{secrets.token_hex(6)}.ipc"
        self.path = os.path.join(tempfile.gettempdir(), name)

    def sender(self) -> Sender:
        return _ZmqSender(_ZmqEnd("PUSH", f"ipc://{self.path}", self.depth, True), self.arrays)

    def receiver(self, index: int) -> Receiver:
        return _ZmqReceiver(_ZmqEnd("PULL", f"ipc://{self.path}", self.depth, False), self.arrays)

    def close(self) -> None:
        _remove_own(self.owner, self.path)


# -- a bare eventfd --------------------------------------------------------------------------


class _EventfdSender(Sender):
    def __init__(self, fd: int) -> None:
        self._fd = fd

    async def send(self, obj: Any) -> None:
        os.eventfd_write(self._fd, 2 if obj is STOP else 1)


class _EventfdReceiver(Receiver):
    """Under asyncio the fd stays registered with the loop, as aioshmq's own wait fd does
    (registering it per wait would add two epoll_ctl calls to every wake-up)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._count = 0

    def _on_readable(self) -> None:
        try:
            self._count += os.eventfd_read(self._fd)
        except BlockingIOError:  # a spurious wake-up
            return
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def recv(self) -> Any:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # trio
            loop = None
        if loop is None or asyncio.current_task(loop) is None:
            while True:
                await anyio.wait_readable(self._fd)
                try:
                    value = os.eventfd_read(self._fd)
                except BlockingIOError:
                    continue
                return STOP if value >= 2 else value
        if self._loop is not loop:
            self.close()
            loop.add_reader(self._fd, self._on_readable)
            self._loop = loop
        while not self._count:
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        value, self._count = self._count, 0
        return STOP if value >= 2 else value

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None


class EventfdChannel(Channel):
    """No transport: an eventfd that one side writes and the other awaits in its event loop.

    It carries no payload (1 is a ping, 2 the end); a round trip over two of them is the
    floor for waking a peer that sleeps in its loop.
    """

    def _make(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["fd"] = reduction.DupFd(self.fd)  # passed to the child while it is spawned
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["fd"] = state["fd"].detach()
        self.__dict__.update(state)

    def sender(self) -> Sender:
        return _EventfdSender(self.fd)

    def receiver(self, index: int) -> Receiver:
        return _EventfdReceiver(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# -- vLLM's MessageQueue ---------------------------------------------------------------------

VLLM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
VLLM_MAX_CHUNKS = 10  # vLLM's default number of chunks (slots) in its ring


class _VllmSender(Sender):
    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self._ready = False

    async def wait_ready(self) -> None:
        # Collective: every reader has subscribed when it returns, and has been told so.
        if not self._ready:
            self._queue.wait_until_ready()
            self._ready = True

    async def send(self, obj: Any) -> None:
        self._queue.enqueue(obj, timeout=SYNC_TIMEOUT)

    def close(self) -> None:
        handle = self._queue.export_handle()
        self._queue = None  # its finalizer closes its sockets, and its ring is unlinked
        for address in vars(handle).values():  # zmq leaves the files of ipc:// paths it bound
            if isinstance(address, str) and address.startswith("ipc://"):
                try:
                    os.unlink(address.removeprefix("ipc://"))
                except FileNotFoundError:
                    pass


class _VllmReceiver(Receiver):
    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self._ready = False

    async def recv(self) -> Any:
        if not self._ready:  # the writer's word that every reader has subscribed
            self._queue.wait_until_ready()
            self._ready = True
        return self._queue.dequeue(timeout=SYNC_TIMEOUT)

    def close(self) -> None:
        self._queue = None


class VllmChannel(Channel):
    """vLLM's shared-memory broadcast queue (``MessageQueue``), driven by its public API.

    Its ring has a fixed number of chunks, one message each (a message too large for a chunk
    goes over a zmq socket instead): here ``depth`` chunks, at most vLLM's default of 10,
    sharing ``capacity`` bytes.  The writer makes the queue where it runs and leaves the
    queue's handle in a file named here; each reader opens the queue from that handle as the
    local reader of its index.
    """

    broadcast = True

    def _make(self) -> None:
        name = f"aioshmq-bench-{os.getpid()}-{secrets.token_hex(6)}.vllm-handle"
        self.path = os.path.join(tempfile.gettempdir(), name)
        self.chunks = min(self.depth, VLLM_MAX_CHUNKS)

    def sender(self) -> Sender:
        queue = importlib.import_module(VLLM_MODULE).MessageQueue(
            self.readers,
            self.readers,  # every reader is local: reads the ring in shared memory
            max_chunk_bytes=self.capacity // self.chunks,
            max_chunks=self.chunks,
        )
        staged = f"{self.path}.{os.getpid()}"
        with open(staged, "wb") as f:
            pickle.dump(queue.export_handle(), f)
        os.replace(staged, self.path)
        return _VllmSender(queue)

    def receiver(self, index: int) -> Receiver:
        message_queue = importlib.import_module(VLLM_MODULE).MessageQueue
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while True:
            try:
                with open(self.path, "rb") as f:
                    handle = pickle.load(f)
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)  # the sending process has not made the queue yet
                continue
            return _VllmReceiver(message_queue.create_from_handle(handle, index))

    def close(self) -> None:
        _remove_own(self.owner, self.path)


def _remove_own(owner: int, path: str) -> None:
    """Remove ``path`` if this process made it (not in a child that inherited the channel)."""
    if os.getpid() == owner:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# -- the roster ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """A transport as the report names it, what it needs installed and how it is driven."""

    name: str
    channel: type[Channel]
    how: str  #: how one message is sent and received
    batch: str  #: how a batch of 64 travels
    requires: tuple[str, ...] = ()
    imports: str | None = None  #: a module that must import, not only be installed

    def missing(self) -> str | None:
        """None if it can run here, else why not (for the report)."""
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return "not installed"
        return None if self.imports is None else _import_error(self.imports)


@functools.cache
def _import_error(module: str) -> str | None:
    """None if ``module`` imports, else why not (an installed package can lack what it needs)."""
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"not importable ({type(exc).__name__})"
    return None


AIOSHMQ = Peer("aioshmq", AioshmqChannel, "async put/get", "put_many/get_many(64)")
AIOSHMQ_SYNC = Peer("aioshmq sync", AioshmqSyncChannel, "put_sync/get_sync (no event loop)", "-")
MP_QUEUE = Peer("mp.Queue", MpQueueChannel, "sync put/get (no async API)", "a list of 64 per put")
ZMQ = Peer(
    "zmq.asyncio",
    ZmqChannel,
    "async PUSH/PULL over ipc://, send_pyobj/recv_pyobj",
    "a list of 64 per send_pyobj",
    ("zmq",),
)
FASTER_FIFO = Peer(
    "faster-fifo",
    FasterFifoChannel,
    "sync put/get (no async API)",
    "put_many/get_many(64)",
    ("faster_fifo",),
)
IOX_HOW = (
    "publish/subscribe of the pickle in a loaned slice, lossless (safe overflow off, "
    "RetryUntilDelivered, a 1024-sample subscriber buffer), sync (no async API)"
)
ICEORYX2 = Peer(
    "iceoryx2",
    IceoryxChannel,
    f"{IOX_HOW}; the subscriber polls receive(), sched_yield() between polls",
    "a list of 64 per sample, lossless as one per send",
    ("iceoryx2",),
)
ICEORYX2_ASLEEP = Peer(
    "iceoryx2",
    IceoryxSleepingChannel,
    f"{IOX_HOW}; every send notifies an event service, whose Listener the subscriber "
    "sleeps in (timed_wait) when its buffer is empty",
    "-",
    ("iceoryx2",),
)
EVENTFD = Peer("eventfd", EventfdChannel, "os.eventfd kept in the loop, no payload", "-")
VLLM = Peer(
    "vLLM",
    VllmChannel,
    "MessageQueue.enqueue/dequeue, sync (no async API)",
    "a list of 64 per enqueue",
    ("vllm",),
    VLLM_MODULE,
)


REMOTE_HOW = "put/get; the reader connect()s to tcp://127.0.0.1:PORT"
AIOSHMQ_REMOTE = Peer(
    "aioshmq", AioshmqRemoteChannel, f"{REMOTE_HOW} with secret= (CURVE)", "-", ("zmq",)
)
AIOSHMQ_PLAIN = Peer(
    "aioshmq-plain",
    AioshmqPlainRemoteChannel,
    f"{REMOTE_HOW} with insecure_loopback=True (no CURVE)",
    "-",
    ("zmq",),
)
AIOSHMQ_MIRROR = Peer(
    "aioshmq",
    AioshmqMirrorChannel,
    "one remote slot held by a Mirror process (secret=, CURVE); readers attach to it by name",
    "-",
    ("zmq",),
)
AIOSHMQ_DIRECT = Peer(
    "aioshmq-direct",
    AioshmqRemoteChannel,
    "every far reader connect()s to the writer itself (secret=, CURVE)",
    "-",
    ("zmq",),
)
ZMQ_TCP = Peer(
    "pyzmq",
    ZmqTcpChannel,
    "sync PUSH/PULL over tcp://127.0.0.1, pickle protocol 5 (no encryption)",
    "-",
    ("zmq",),
)


class ZmqIpcChannel(ZmqTcpChannel):
    """``ZmqTcpChannel`` over an ipc:// path: sync pyzmq on one host, no event loop."""

    def endpoint(self) -> str:
        return f"ipc://{self.path}.ipc"

    def close(self) -> None:
        super().close()
        _remove_own(self.owner, f"{self.path}.ipc")


ZMQ_SYNC = Peer(
    "pyzmq",
    ZmqIpcChannel,
    "sync PUSH/PULL over ipc://, pickle protocol 5 (no event loop)",
    "a list of 64 per send",
    ("zmq",),
)


class ZmqTcpCurveChannel(ZmqTcpChannel):
    """``ZmqTcpChannel`` with CurveZMQ encryption (no ZAP handler: any client key)."""

    curve = True


ZMQ_TCP_CURVE = Peer(
    "pyzmq-curve",
    ZmqTcpCurveChannel,
    "sync PUSH/PULL over tcp://127.0.0.1, pickle protocol 5, CurveZMQ encryption",
    "-",
    ("zmq",),
)


class AioshmqSleepingChannel(AioshmqChannel):
    """An aioshmq ring whose readers sleep at once (``spin=0``): every message wakes one."""

    spin = 0.0


AIOSHMQ_ASLEEP = Peer(
    "aioshmq", AioshmqSleepingChannel, "two rings, readers with spin=0", "put_many/get_many(64)"
)


class AioshmqGetChannel(AioshmqChannel):
    """An aioshmq ring whose readers ``get()`` arrays (a copy they own), never lease them."""

    lease = False


AIOSHMQ_GET = Peer("aioshmq", AioshmqGetChannel, "put/get, out of band; get() copies out", "-")


class AioshmqReserveChannel(AioshmqChannel):
    """An aioshmq ring whose writer fills each array in place, in ``reserve_array()``'s view
    of the ring (``numpy.copyto`` from the array to send), instead of ``put()``."""

    reserve = True


AIOSHMQ_RESERVE = Peer(
    "aioshmq",
    AioshmqReserveChannel,
    "reserve_array(shape, dtype) filled with numpy.copyto(view, array), lease",
    "-",
    ("numpy",),
)


class AioshmqMsgpackChannel(AioshmqChannel):
    """An aioshmq ring with ``serializer="msgpack"`` (msgspec); readers pick it up by name."""

    serializer = "msgpack"


AIOSHMQ_MSGPACK = Peer(
    "aioshmq",
    AioshmqMsgpackChannel,
    'async put/get, serializer="msgpack" (msgspec)',
    "-",
    ("msgspec",),
)

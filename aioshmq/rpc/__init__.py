"""Batched RPC from one async scheduler to N worker processes over aioshmq rings.

The scheduler's ``Client`` writes every call into one broadcast ring read by all workers;
each worker answers through a reply ring of its own.  Calls submitted in one event-loop
turn leave as one batch: one record, one publish, at most one wake-up per sleeping worker.
A call cancelled after it was sent is withdrawn in the next batch: the workers skip it, or
cut it short.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import os
import pickle
import secrets
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple, NoReturn

import anyio
from anyio.abc import TaskGroup
from anyio.lowlevel import checkpoint

from .. import remote
from ..api.open import DEFAULT_HEARTBEAT, create
from ..base.errors import Empty, PeerDied
from ..ends.end import YIELD_INTERVAL
from ..ends.reader import DEFAULT_SPIN, Reader, connect
from ..ends.writer import Writer
from ..serialize.base import Buffer, Serializer
from ..serialize.pickling import PickleSerializer
from ..serialize.resolve import SerializerSpec, passed_on, resolve

__all__ = [
    "Call",
    "Client",
    "ClientStatistics",
    "RemoteError",
    "RemoteTraceback",
    "RpcHandle",
    "serve",
    "serve_sync",
]

_log = logging.getLogger("aioshmq.rpc")

REPLY_CAPACITY = 8 << 20  #: default bytes of each worker's reply ring
FLUSH_AFTER = 0.0005  #: a worker holds finished replies back at most this long (s) for a batch
RECEIVE_BATCH = 128  #: replies the client handles per step: bounds the time between yields
POLL_AFTER = 0.0005  #: a busy worker looks for withdrawals between calls at most this often (s)
WATCH_AFTER = 0.001  #: once an async method has run this long (s), its withdrawal is watched for
_ALL = -1  # in a call message: every worker that runs the call replies
_WITHDRAW = 0  # the id of a withdrawal message: call ids start at 1
_READ = object()  # a worker's call processor has run every call it holds: read the ring
_CUT = object()  # sent to the call processor: the awaited call was withdrawn meanwhile

# A call on the wire: (id, method, args, kwargs, ranks that run it or None for all, the one
# rank that replies or _ALL).  A withdrawal: (_WITHDRAW, ids of calls sent earlier).  A
# reply: (id, ok, result) or (id, False, (exception, text)); with a pickle serializer the
# result or exception travels boxed (see _Boxed).  A worker that skipped a withdrawn call,
# or cut it short, still answers it, with (id, True, None): each call it was to answer gets
# one reply, so a reply that does not load is still matched to its call.
_Message = tuple[int, Any, tuple[Any, ...], dict[str, Any], tuple[int, ...] | None, int]
_Reply = tuple[Any, ...]


@dataclass(frozen=True)
class RpcHandle:
    """What a worker needs to serve a client: picklable, valid in any process of the user."""

    name: str
    workers: int
    serializer: str  #: the serializer's name; "custom" means ``serve`` must be given it


def _default_spin(workers: int) -> float:
    """Spin before sleeping only where every process can have a CPU: a spinning worker on a
    shared core takes the time another one needs (4 workers on 2 CPUs: twice the latency)."""
    return DEFAULT_SPIN if len(os.sched_getaffinity(0)) > workers else 0.0


def _reply_name(name: str, rank: int) -> str:
    return f"{name}.reply{rank}"


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in a worker (set as its ``__cause__``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RemoteError(Exception):
    """A worker's exception that could not travel as itself (it did not pickle and load)."""

    def __init__(self, message: str, type_name: str) -> None:
        super().__init__(message)
        self.type_name = type_name  #: the qualified name of the original exception's type

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.type_name)


# Reply values of these types always load: they travel as they are, never boxed.
_PLAIN = frozenset({int, float, str, bytes, bool, type(None)})
_CONTAINERS = frozenset({tuple, list, dict})
_LOOK_AT = 64  # items of a container looked into before it is boxed anyway


def _always_loads(value: Any, depth: int = 3) -> bool:
    """Whether ``value`` is made of builtins only (a small dict of str and numbers, say), so
    that it loads in any process and needs no box of its own: boxing costs a second pickle
    on the worker and a second load in the client."""
    kind = type(value)
    if kind in _PLAIN:
        return True
    if kind not in _CONTAINERS or depth == 0 or len(value) > _LOOK_AT:
        return False
    if kind is dict:
        return all(type(k) in _PLAIN and _always_loads(v, depth - 1) for k, v in value.items())
    return all(_always_loads(item, depth - 1) for item in value)


class _Boxed:
    """A reply's value pickled on its own, for a reply batch that travels as one pickled list.

    Loading the batch calls ``_unbox`` for each boxed value, which catches the value's own
    load error: a result or exception whose class the client cannot import fails its own
    call, not the whole batch.  The value's out-of-band buffers (numpy arrays) are passed on
    as ``PickleBuffer``s, so the batch's pickle keeps them out of band as well.
    """

    __slots__ = ("_reduced",)

    def __init__(
        self, main: Buffer, buffers: list[memoryview], type_name: str, summary: str | None
    ) -> None:
        data = main if type(main) is bytes else bytes(main)
        oob = tuple([pickle.PickleBuffer(b) for b in buffers]) if buffers else ()
        self._reduced = (_unbox, (data, oob, type_name, summary))

    def __reduce__(self) -> tuple[Any, ...]:
        return self._reduced


class _Unloadable:
    """What a boxed value that did not load in the client becomes: its call fails with it."""

    __slots__ = ("error", "summary", "type_name")

    def __init__(self, type_name: str, summary: str | None, error: Exception) -> None:
        self.type_name = type_name  #: the qualified name of the value's type
        self.summary = summary  #: for an exception, "Type: message" as the worker saw it
        self.error = error  #: why it did not load


def _unbox(main: bytes, buffers: Sequence[Any], type_name: str, summary: str | None) -> Any:
    try:
        return pickle.loads(main, buffers=buffers)
    except Exception as exc:
        return _Unloadable(type_name, summary, exc)


def _summary(exc: BaseException) -> str:
    """``Type: message`` of an exception, even one whose ``__str__`` fails."""
    try:
        text = str(exc)
    except Exception:
        text = "<str() failed>"
    return f"{type(exc).__qualname__}: {text}"


class ClientStatistics(NamedTuple):
    workers: int
    calls_submitted: int  #: calls accepted by submit() or call()
    calls_pending: int  #: submitted calls whose results have not all arrived
    batches_sent: int  #: publishes of the call ring: batches of calls made visible at once
    replies_received: int  #: replies read from the workers
    wakeups_sent: int  #: wake-up syscalls made to sleeping workers
    calls_cancelled: int  #: calls withdrawn (cancel(), or their awaiting task cancelled)
    workers_attached: int  #: workers whose slot of the call ring is held now


class Call:
    """A submitted call: ``await`` it for its result (a list, or one value with
    ``unique_reply_rank``).

    Cancelling the task that awaits it (a timeout, say) withdraws the call, as
    ``cancel()`` does: it is not sent if it is still queued; otherwise the workers are told,
    with the next batch of calls.  A worker that has not started it skips it; one running
    it as an ``async def`` under ``serve`` cancels it (the method sees the cancellation,
    its ``finally`` blocks run) and goes on with the next call; a plain method runs to its
    end and its result is dropped.
    """

    __slots__ = (
        "_client",
        "_error",
        "_errors",
        "_event",
        "_message",
        "_missing",
        "_ranks",
        "_results",
        "_unique",
        "id",
        "method",
    )

    def __init__(self, client: Client, message: _Message, ranks: tuple[int, ...], unique: int):
        self._client = client
        self._message: _Message | None = message
        self.id: int = message[0]
        self.method: str = message[1] if isinstance(message[1], str) else repr(message[1])
        self._ranks = ranks
        self._unique = unique
        self._missing = {unique} if unique != _ALL else set(ranks)
        self._results: dict[int, Any] = {}
        self._errors: dict[int, BaseException] = {}
        self._error: BaseException | None = None
        self._event: anyio.Event | None = None

    def __repr__(self) -> str:
        state = "done" if self.done() else f"waiting for workers {sorted(self._missing)}"
        return f"<aioshmq.rpc.Call {self.id} {self.method!r} {state}>"

    def done(self) -> bool:
        return not self._missing or self._error is not None

    def cancel(self) -> None:
        """Withdraw the call (see the class); awaiting it afterwards raises
        ``anyio.ClosedResourceError``.  Nothing happens if its result is in already."""
        if self.done():
            return
        client = self._client
        client._check_loop("cancel a call")
        sent = self._message is None or self in client._sending
        self._finish(anyio.ClosedResourceError(f"call {self.id} ({self.method}) was withdrawn"))
        client._withdrawn(self.id, sent)

    def _deliver(self, rank: int, ok: bool, value: Any) -> None:
        if rank not in self._missing:
            return
        if ok and type(value) is not _Unloadable:
            self._results[rank] = value
        elif ok:
            self._errors[rank] = self._unloadable_result(rank, value)
        else:
            self._errors[rank] = _rebuild(value, rank, self._client.name)
        self._missing.discard(rank)
        if not self._missing:
            self._client._pending.pop(self.id, None)
            if self._event is not None:
                self._event.set()

    def _reject(self, rank: int, error: BaseException) -> None:
        """Record ``error`` as worker ``rank``'s answer (a reply that did not load)."""
        if rank not in self._missing:
            return
        self._errors[rank] = error
        self._missing.discard(rank)
        if not self._missing:
            self._client._pending.pop(self.id, None)
            if self._event is not None:
                self._event.set()

    def _unloadable_result(self, rank: int, value: _Unloadable) -> RemoteError:
        error = RemoteError(
            f"worker {rank}'s result of call {self.id} ({self.method}), a {value.type_name} "
            f"object, could not be loaded here: {value.error}",
            value.type_name,
        )
        error.__cause__ = value.error
        return error

    def _finish(self, error: BaseException) -> None:
        self._error = error
        self._message = None
        self._client._pending.pop(self.id, None)
        if self._event is not None:
            self._event.set()

    def _outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._errors:
            raise self._errors[min(self._errors)]
        if self._unique != _ALL:
            return self._results[self._unique]
        return [self._results[rank] for rank in self._ranks]

    async def wait(self) -> Any:
        """The result; raises what the call raised in a worker, or PeerDied."""
        if self.done():
            # Like a get that finds a message: yield to the loop only now and then, so
            # collecting hundreds of finished calls costs no loop turn each.
            client = self._client
            now = time.monotonic()
            if now >= client._next_yield:
                client._next_yield = now + YIELD_INTERVAL
                await checkpoint()
            return self._outcome()
        client = self._client
        if threading.get_ident() != client._thread or _running_loop() is not client._loop:
            client._check_loop("await a call")
        if self._event is None:
            self._event = anyio.Event()
        try:
            await self._event.wait()
        except BaseException:
            self.cancel()
            raise
        return self._outcome()

    def __await__(self) -> Generator[Any, None, Any]:
        return self.wait().__await__()


def _rebuild(value: Any, rank: int, name: str) -> BaseException:
    """The exception a worker sent back, with its traceback text attached.

    One that did not load here becomes a RemoteError whose cause is the load error; the
    remote traceback is then a note.
    """
    sent, text = value
    if type(sent) is _Unloadable:
        exc: BaseException = RemoteError(sent.summary or "?", sent.type_name)
        exc.__cause__ = sent.error
        exc.add_note(f"it could not be loaded here; the remote traceback:\n{text}")
    else:
        exc = sent if isinstance(sent, BaseException) else RemoteError(repr(sent), "?")
        exc.__cause__ = RemoteTraceback(text)
    exc.add_note(f"raised in worker {rank} of aioshmq.rpc client {name!r}")
    return exc


def _check_rank(what: str, value: object, workers: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if not 0 <= value < workers:
        raise ValueError(f"{what}={value} is out of range: workers are 0..{workers - 1}")
    return value


class Client:
    """The scheduler's end: calls to ``workers`` worker processes, results back.

    Use it as ``async with Client(n) as client``: that starts its tasks (one sends batches,
    one per worker collects replies) and, on leaving, closes the rings, which stops the
    workers' ``serve``.  The tasks run in a task of the client's own, so any task may
    close it (``__aexit__`` or ``aclose``), not only the one that opened it; if the event
    loop ends first, that task closes the rings on its way out.  Pass ``client.handle`` to
    the workers.  Calls submitted before the workers attach wait for them.  ``workers`` and
    ``unique_reply_rank`` are keywords of ``call``/``submit`` themselves, never passed on to
    the method.  ``spin`` is the reply readers' (see ``aioshmq.connect``); by default they
    spin only if the scheduler and the workers each have a CPU of their own.

    With ``listen`` (and ``secret``, or ``insecure_loopback``, as for ``aioshmq.create``)
    workers on other hosts may serve it too: ``serve(client.address, rank, target,
    secret=...)`` there.  Local and remote workers mix freely.
    """

    def __init__(
        self,
        workers: int,
        *,
        capacity: int = 16 << 20,
        max_messages: int = 1 << 16,
        serializer: SerializerSpec = "pickle",
        name: str | None = None,
        spin: float | None = None,
        listen: str | None = None,
        secret: bytes | None = None,
        insecure_loopback: bool = False,
        heartbeat: float = DEFAULT_HEARTBEAT,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise TypeError(f"workers must be an int, not {type(workers).__name__}")
        if workers < 1:
            raise ValueError(f"workers={workers} is too small: it must be at least 1")
        if spin is not None and (
            isinstance(spin, bool) or not isinstance(spin, int | float) or not 0 <= spin <= 1
        ):
            raise ValueError(f"spin must be a number of seconds from 0 to 1, not {spin!r}")
        self._workers = workers
        self._spin = _default_spin(workers) if spin is None else spin
        self._ser: Serializer = resolve(serializer)
        self._calls: Writer[Any] = create(
            capacity,
            max_messages,
            workers,
            serializer=passed_on(self._ser),
            name=name or f"rpc-{secrets.token_hex(6)}",
            listen=listen,
            secret=secret,
            insecure_loopback=insecure_loopback,
            heartbeat=heartbeat,
        )
        self._secret = secret
        self._insecure = insecure_loopback
        self._heartbeat = heartbeat
        self._replies: list[Reader[Any]] = []
        self._pending: dict[int, Call] = {}
        self._outbox: list[Call] = []
        self._sending: Sequence[Call] = ()  # the calls of the batch being written now
        self._cancels: list[int] = []  # ids of sent calls withdrawn since the last batch
        self._expected: list[deque[int]] = [deque() for _ in range(workers)]
        self._ids = itertools.count(1)
        self._kick: anyio.Event | None = None
        self._ready: anyio.Event | None = None
        self._tg: TaskGroup | None = None
        self._stop: anyio.Event | None = None  # set: the host task is to end
        self._stopped: anyio.Event | None = None  # set: it ended, the rings are closed
        self._host: asyncio.Task[None] | None = None  # (asyncio keeps only weak references)
        self._failure: BaseException | None = None
        self._closed = False
        self._submitted = self._received = self._cancelled = 0
        self._next_yield = 0.0
        self._loop: object = None  # the asyncio loop running in the thread that entered it
        self._thread = 0  # that thread
        self._owner = ""  # both, in words

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<aioshmq.rpc.Client {self.name!r} workers={self._workers} {state}>"

    def __reduce__(self) -> NoReturn:
        """Never: a client runs in the process (and event loop) that made it."""
        raise TypeError(
            f"cannot pickle an aioshmq.rpc.Client: it runs in the process that made it "
            f"(client {self.name!r}).  Workers serve it from their own processes: pass "
            "client.handle to them (client.address, with listen=, on other hosts) and call "
            "aioshmq.rpc.serve(handle, rank, target) or serve_sync(...) there"
        )

    @property
    def name(self) -> str:
        return self._calls.name

    @property
    def handle(self) -> RpcHandle:
        return RpcHandle(self._calls.name, self._workers, self._ser.name)

    @property
    def address(self) -> str | None:
        """What workers on other hosts pass to ``serve`` (None without ``listen``)."""
        return self._calls.address

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Client:
        if self._stop is not None or self._closed:
            raise RuntimeError("this client was already started")
        self._ready = anyio.Event()
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        entered = anyio.Event()
        self._loop = _running_loop()
        self._thread = threading.get_ident()
        self._owner = f"{_loop_words()} in thread {threading.current_thread().name!r}"
        if _on_asyncio():
            self._host = asyncio.get_running_loop().create_task(
                self._run_host(entered), name=f"aioshmq.rpc client {self.name}"
            )
        else:
            import trio

            trio.lowlevel.spawn_system_task(
                self._run_system_host, entered, name=f"aioshmq.rpc client {self.name}"
            )
        # Until the host task has begun, its cleanup would not run if the loop ended.
        with anyio.CancelScope(shield=True):
            await entered.wait()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        # The body's own exception is not the client's: it propagates as itself.
        await self._close()
        return None

    async def aclose(self) -> None:
        """Close the client (the workers then stop serving); pending calls fail.

        Any task may call it.  Only the client's own tasks are cancelled, so calling this
        inside ``async with client:`` does not cancel the caller.
        """
        await self._close()
        await checkpoint()

    async def _close(self) -> None:
        """Fail the calls, end the host task and wait until it has closed the rings."""
        if self._stopped is not None and not self._stopped.is_set():
            self._check_loop("close it")
        self._shut(anyio.ClosedResourceError("the aioshmq.rpc client was closed"))
        if self._stop is None or self._stopped is None:  # never started: no host task
            self._release()
            return
        self._stop.set()
        if not self._stopped.is_set():
            with anyio.CancelScope(shield=True):
                await self._stopped.wait()

    async def _run_host(self, entered: anyio.Event) -> None:
        """The client's own task: it holds the task group of the client's tasks until the
        client is closed or the event loop ends, then closes the rings."""
        assert self._stop is not None and self._stopped is not None
        try:
            entered.set()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._run)
                await self._stop.wait()
                tg.cancel_scope.cancel()
        finally:
            try:
                self._shut(anyio.ClosedResourceError("the aioshmq.rpc client's event loop ended"))
                for reader in self._replies:
                    reader.close()
                with anyio.CancelScope(shield=True):
                    await self._calls.aclose()  # remote workers get the rest: off the loop
            finally:
                self._stopped.set()

    async def _run_system_host(self, entered: anyio.Event) -> None:
        """``_run_host`` as a trio system task, which must never raise: trio.run would crash."""
        try:
            await self._run_host(entered)
        except BaseException as exc:
            if not _only_cancelled(exc):
                _log.error("the task of aioshmq.rpc client %r failed", self.name, exc_info=exc)

    def _shut(self, error: BaseException) -> None:
        if not self._closed:
            self._closed = True
            self._fail(error)

    def _release(self) -> None:
        # Readers first: their goodbye reaches workers that are still serving.
        for reader in self._replies:
            reader.close()
        self._calls.close()

    def _fail(self, error: BaseException) -> None:
        """Fail every pending call and every later one with ``error``."""
        if self._failure is None:
            self._failure = error
        for call in list(self._pending.values()):
            call._finish(_fresh(self._failure))  # each its own: raised in its own task
        self._outbox.clear()
        self._cancels.clear()
        if self._ready is not None:
            self._ready.set()
        if self._kick is not None:
            self._kick.set()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise _fresh(self._failure)

    def _check_loop(self, what: str) -> None:
        """Refuse at once a use from another event loop or thread than the one that entered
        the client: its tasks and events live there, so it could only wait forever."""
        if self._stop is None or (
            threading.get_ident() == self._thread and _running_loop() is self._loop
        ):
            return
        if threading.get_ident() != self._thread:
            here = f"thread {threading.current_thread().name!r}"
        else:
            words = _loop_words()
            here = (
                "outside an event loop"
                if words == "no event loop"
                else f"another event loop ({words})"
            )
        raise RuntimeError(
            f"aioshmq.rpc client {self.name!r} belongs to the event loop that entered it "
            f"({self._owner}): it cannot {what} from {here}, where it would wait forever.  "
            "Use it from tasks of that loop (with pytest-asyncio, run the test in the loop "
            "scope of the fixture that opened the client), or open a client in this loop"
        )

    def _withdrawn(self, cid: int, sent: bool) -> None:
        """Count a withdrawn call; if it was sent, tell the workers with the next batch."""
        self._cancelled += 1
        if sent and self._failure is None:
            self._cancels.append(cid)
            if self._kick is not None:
                self._kick.set()

    # -- calls -------------------------------------------------------------------------------

    def submit(
        self,
        method: str | Callable[..., Any],
        /,
        *args: Any,
        workers: Sequence[int] | None = None,
        unique_reply_rank: int | None = None,
        **kwargs: Any,
    ) -> Call:
        """Queue ``target.method(*args, **kwargs)`` on the workers; returns at once.

        ``method`` is a method name, or a function called as ``method(target, *args,
        **kwargs)`` (it must pickle: cloudpickle for lambdas).  ``workers`` picks the ranks
        that run it (all by default); with ``unique_reply_rank`` they all run it but only
        that rank replies, and the call's result is that one value.
        """
        self._raise_failure()
        if self._closed:
            raise anyio.ClosedResourceError("the aioshmq.rpc client is closed")
        if self._stop is None:
            raise RuntimeError("start the client first: async with client: ...")
        if threading.get_ident() != self._thread or _running_loop() is not self._loop:
            self._check_loop("submit a call")
        if not (isinstance(method, str) and method) and not callable(method):
            raise TypeError(f"method must be a method name or a function, not {method!r}")
        n = self._workers
        if workers is None:
            ranks: tuple[int, ...] = tuple(range(n))
            targets = None
        else:
            ranks = tuple(_check_rank("workers[]", rank, n) for rank in workers)
            if not ranks:
                raise ValueError("workers=[] names no worker")
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"workers={list(ranks)} names a worker twice")
            targets = ranks
        unique = _ALL
        if unique_reply_rank is not None:
            unique = _check_rank("unique_reply_rank", unique_reply_rank, n)
            if unique not in ranks:
                raise ValueError(f"unique_reply_rank={unique} is not among workers={list(ranks)}")
        message: _Message = (next(self._ids), method, args, kwargs, targets, unique)
        call = Call(self, message, ranks, unique)
        self._pending[call.id] = call
        self._outbox.append(call)
        self._submitted += 1
        if self._kick is not None:
            self._kick.set()
        return call

    async def call(
        self,
        method: str | Callable[..., Any],
        /,
        *args: Any,
        workers: Sequence[int] | None = None,
        unique_reply_rank: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """``submit`` and wait: the list of the workers' results (in the order of
        ``workers``), or the one result of ``unique_reply_rank``."""
        call = self.submit(
            method, *args, workers=workers, unique_reply_rank=unique_reply_rank, **kwargs
        )
        return await call.wait()

    async def wait_workers(self, timeout: float | None = None) -> None:
        """Return once every worker has attached (PeerDied if one died meanwhile).

        With ``timeout`` (seconds), raise ``TimeoutError`` naming the workers still missing
        if they have not all attached by then.
        """
        if self._ready is None:
            raise RuntimeError("start the client first: async with client: ...")
        self._check_loop("wait for its workers")
        with anyio.move_on_after(timeout):
            await self._ready.wait()
        self._raise_failure()
        if not self._ready.is_set():
            missing = self._missing_workers()
            raise TimeoutError(
                f"aioshmq.rpc client {self.name!r}: worker{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} (of {self._workers}) did not attach within "
                f"{timeout} s: each rank needs a process that runs "
                "aioshmq.rpc.serve(client.handle, rank, target) (or serve_sync); check that "
                "those were started and are still alive"
            )

    def _missing_workers(self) -> list[int]:
        """The ranks not yet attached to the calls ring; once all are, those whose reply
        ring the client has not reached yet."""
        return self._calls.missing_readers() or list(range(len(self._replies), self._workers))

    def statistics(self) -> ClientStatistics:
        stats = self._calls.statistics()
        return ClientStatistics(
            workers=self._workers,
            calls_submitted=self._submitted,
            calls_pending=len(self._pending),
            batches_sent=stats.publishes,
            replies_received=self._received,
            wakeups_sent=stats.wakeups_sent,
            calls_cancelled=self._cancelled,
            workers_attached=stats.readers_attached,
        )

    # -- the client's tasks ------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._start()
        except Exception as exc:  # a task of the client never raises: its calls fail instead
            self._fail(exc)

    async def _start(self) -> None:
        try:
            await self._calls.wait_readers()
            for rank in range(self._workers):
                reader = await self._connect_reply(rank)
                if self._closed:  # closed meanwhile: nobody else would close this one
                    reader.close()
                    return
                self._replies.append(reader)
        except PeerDied as exc:
            self._fail(_worker_died(exc.index or 0, exc.pid, "before it was ready"))
            return
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            self._fail(exc)
            return
        assert self._tg is not None and self._ready is not None
        for rank, reader in enumerate(self._replies):
            self._tg.start_soon(self._receive, rank, reader)
        self._ready.set()
        await self._send()

    async def _connect_reply(self, rank: int) -> Reader[Any]:
        serializer = passed_on(self._ser) if self._ser.name == "custom" else None
        await checkpoint()
        slot = self._calls.remote_reader(rank)
        if slot is not None:
            return await self._connect_remote_reply(rank, slot)
        try:
            # Made in this thread, so its lock is this loop's; the broker answers at once.
            return connect(_reply_name(self.name, rank), 0, serializer=serializer, spin=self._spin)
        except (FileNotFoundError, ConnectionError) as exc:
            raise _worker_died(rank, 0, "before its reply ring was reached") from exc

    async def _connect_remote_reply(self, rank: int, slot: dict[str, Any]) -> Reader[Any]:
        """The reply ring of a worker on another host, at the address it told the calls
        ring's server right after attaching (the handshake runs off the loop)."""
        deadline = time.monotonic() + self._heartbeat
        while "reply" not in slot:
            if time.monotonic() > deadline:
                raise _worker_died(rank, 0, "before it said where its replies are")
            await anyio.sleep(0.002)  # its META follows its HELLO on the same connection
            slot = self._calls.remote_reader(rank) or {}
        address = slot["reply"]
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
            raise _worker_died(rank, 0, f"after giving a bad reply address {address!r}")
        mirror = remote.load("_mirror")
        try:
            link = await anyio.to_thread.run_sync(
                functools.partial(
                    mirror.open_link,
                    address,
                    0,
                    secret=self._secret,
                    insecure_loopback=self._insecure,
                    heartbeat=self._heartbeat,
                    timeout=10.0,
                    serializer=self._ser,
                )
            )
        except (OSError, ValueError) as exc:
            raise _worker_died(rank, 0, f"before its reply ring at {address} was reached") from exc
        return mirror.attach(link, 10.0, self._spin)  # type: ignore[no-any-return]

    async def _send(self) -> None:
        """Write what was submitted, as one batch per wake of this task; the withdrawals of
        calls sent earlier go first in it."""
        while self._failure is None:
            if not self._outbox and not self._cancels:
                self._kick = anyio.Event()
                await self._kick.wait()
                continue
            batch, self._outbox = self._outbox, []
            calls = [call for call in batch if call._message is not None]
            messages: list[Any] = [call._message for call in calls]
            cancels = len(self._cancels)
            if cancels:
                messages.insert(0, (_WITHDRAW, tuple(self._cancels)))
            elif not calls:
                continue
            self._sending = calls  # a call withdrawn meanwhile is on its way: tell the workers
            try:
                await self._calls.put_many(messages)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
                if isinstance(exc, PeerDied):
                    exc = _worker_died(exc.index or 0, exc.pid, "")
                self._fail(exc)
                return
            except Exception as exc:  # a call's arguments did not serialize
                if calls:  # none was sent: none of them is to be withdrawn at the workers
                    unsent = {call.id for call in calls}
                    self._cancels = [cid for cid in self._cancels if cid not in unsent]
                calls = self._drop_unserializable(calls, exc)
                if calls:
                    self._outbox[:0] = calls
                continue
            finally:
                self._sending = ()
            if cancels:
                del self._cancels[:cancels]
            for call in calls:
                call._message = None
                for rank in call._missing:
                    self._expected[rank].append(call.id)

    def _drop_unserializable(self, calls: list[Call], error: Exception) -> list[Call]:
        """Fail the calls whose message does not serialize; the others, to send again."""
        good = []
        for call in calls:
            try:
                self._ser.dumps(call._message)
            except Exception as exc:
                failure = TypeError(
                    f"the arguments of call {call.id} ({call.method}) "
                    f"could not be serialized: {exc}"
                )
                failure.__cause__ = exc
                call._finish(failure)
            else:
                good.append(call)
        if len(good) == len(calls):  # not a serialization problem after all
            raise error
        return good

    async def _receive(self, rank: int, reader: Reader[Any]) -> None:
        try:
            await self._receive_replies(rank, reader)
        except Exception as exc:  # a task of the client never raises: its calls fail instead
            self._fail(exc)

    async def _receive_replies(self, rank: int, reader: Reader[Any]) -> None:
        expected = self._expected[rank]
        pending = self._pending
        while True:
            try:
                replies = await reader.get_many(RECEIVE_BATCH)
            except anyio.EndOfStream:
                self._fail(_worker_died(rank, 0, "stopped serving"))
                return
            except PeerDied as exc:
                self._fail(_worker_died(rank, exc.pid, ""))
                return
            except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
                self._fail(exc)
                return
            except Exception as exc:  # a reply that did not load
                # Replies come in call order, so it answers the oldest call still expected.
                # (Boxed values load on their own, so with a pickle serializer only a reply
                # of a custom serializer, one message each, fails here.)
                if expected:
                    call = pending.get(expected.popleft())
                    if call is not None:
                        failure = RemoteError(
                            f"worker {rank}'s reply to call {call.id} ({call.method}) "
                            f"could not be loaded here: {exc}",
                            "?",
                        )
                        failure.__cause__ = exc
                        call._reject(rank, failure)
                continue
            self._received += len(replies)
            for cid, ok, value in replies:
                while expected and expected.popleft() != cid:
                    pass
                call = pending.get(cid)
                if call is not None:
                    call._deliver(rank, ok, value)


_running_loop = asyncio._get_running_loop  # this thread's running asyncio loop, or None


def _loop_words() -> str:
    """The event loop this code runs in, in words."""
    loop = _running_loop()
    if loop is not None and asyncio.current_task(loop) is not None:
        kind = "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
        return f"the {kind} event loop at {id(loop):#x}"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return "a trio run"
    return "no event loop"


def _on_asyncio() -> bool:
    """Whether this is an asyncio task (not trio, nor trio run as a guest of asyncio)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    return asyncio.current_task(loop) is not None


def _only_cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is the backend's cancellation, or a group of nothing else."""
    cancelled = anyio.get_cancelled_exc_class()
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(cancelled)[1] is None
    return isinstance(exc, cancelled)


def _fresh(error: BaseException) -> BaseException:
    """A new exception like ``error``, so that tasks raising it never share a traceback."""
    if isinstance(error, PeerDied):
        fresh: BaseException = PeerDied(
            str(error), role=error.role, pid=error.pid, index=error.index
        )
    else:
        try:
            fresh = type(error)(*error.args)
        except Exception:  # a type that cannot be rebuilt from its args
            fresh = anyio.BrokenResourceError(f"the aioshmq.rpc client failed: {error!r}")
    fresh.__cause__ = error.__cause__
    return fresh


def _worker_died(rank: int, pid: int, when: str) -> PeerDied:
    who = f"worker {rank}" + (f" (pid {pid})" if pid else "")
    what = "stopped serving" if when == "stopped serving" else f"died {when}".rstrip()
    return PeerDied(f"aioshmq.rpc: {who} {what}", role="worker", pid=pid, index=rank)


# -- the worker's side ---------------------------------------------------------------------------


def _method(target: object, method: Any) -> Callable[..., Any]:
    if not isinstance(method, str):
        return functools.partial(method, target)
    if method.startswith("_"):
        raise AttributeError(f"{method!r} is private: only public methods can be called")
    fn = getattr(target, method, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"{type(target).__qualname__} object has no method {method!r}")
    return fn  # type: ignore[no-any-return]


class _Worker:
    """What ``serve`` and ``serve_sync`` share: the rings, and turning calls into replies."""

    def __init__(
        self,
        handle: RpcHandle | str,
        rank: int,
        target: object,
        serializer: SerializerSpec | None,
        capacity: int,
        spin: float | None,
        options: _RemoteOptions | None = None,
    ) -> None:
        self.target = target
        self.type_names: dict[type, str] = {}
        self.queue: deque[Any] = deque()  # calls read from the ring, not yet run
        self.withdrawn: set[int] = set()  # ids of calls in the queue (or still in the ring)
        self.looked = 0.0  # when the ring was last read
        self.last = 0  # the id of the call run last (or being run)
        self.awaiting = 0  # the id of the call whose async method is being awaited
        self.since = 0.0  # when that began
        self.scope: anyio.CancelScope | None = None  # cancelled to cut that call short
        self.failed: Exception | None = None  # what the watcher got from the ring, for later
        if isinstance(handle, str) and handle.startswith(("tcp://", "ipc://")):
            options = options or _RemoteOptions()
            self._serve_remote(handle, rank, serializer, capacity, spin, options)
            return
        if not isinstance(handle, RpcHandle):
            raise TypeError(
                "handle must be an aioshmq.rpc.RpcHandle or a client's address "
                f"('tcp://...', 'ipc://...'), not {handle!r}"
            )
        spin = _default_spin(handle.workers) if spin is None else spin
        self.rank = _check_rank("rank", rank, handle.workers)
        if handle.serializer == "custom" and serializer is None:
            raise ValueError(
                f"client {handle.name!r} uses a custom serializer: pass the same one as "
                "serve(..., serializer=...)"
            )
        self.ser = resolve(serializer if serializer is not None else handle.serializer)
        # A pickle serializer sends a batch of replies as one pickled list: box its values.
        self.boxes = isinstance(self.ser, PickleSerializer)
        self.replies: Writer[Any] = create(
            capacity,
            1 << 16,
            1,
            serializer=passed_on(self.ser),
            name=_reply_name(handle.name, rank),
        )
        try:
            self.calls: Reader[Any] = connect(
                handle.name, rank, serializer=passed_on(self.ser), spin=spin
            )
        except BaseException:
            self.replies.close()
            raise

    def _serve_remote(
        self,
        address: str,
        rank: int,
        serializer: SerializerSpec | None,
        capacity: int,
        spin: float | None,
        options: _RemoteOptions,
    ) -> None:
        """Attach to the calls ring of a client on another host; make the reply ring there
        (listening where the client can reach it) once the client's welcome says how."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int from 0, not {rank!r}")
        self.rank = rank

        def make_replies(welcome: dict[str, Any]) -> dict[str, Any]:
            _check_rank("rank", rank, welcome["readers"])
            if serializer is None and welcome["serializer"] == "custom":
                raise ValueError(
                    f"the client at {address} uses a custom serializer: pass the same one as "
                    "serve(..., serializer=...)"
                )
            self.ser = resolve(serializer if serializer is not None else welcome["serializer"])
            self.boxes = isinstance(self.ser, PickleSerializer)
            listen = options.reply_listen or _reply_listen(address)
            self.replies = create(
                capacity,
                1 << 16,
                1,
                serializer=passed_on(self.ser),
                listen=listen,
                secret=options.secret,
                insecure_loopback=options.insecure_loopback,
                heartbeat=options.heartbeat,
            )
            return {"reply": self.replies.address}

        mirror = remote.load("_mirror")
        link = mirror.open_link(
            address,
            rank,
            secret=options.secret,
            insecure_loopback=options.insecure_loopback,
            heartbeat=options.heartbeat,
            timeout=options.timeout,
            serializer=serializer,
            meta=make_replies,
        )
        try:
            self.calls = mirror.attach(link, options.timeout, 0.0 if spin is None else spin)
        except BaseException:
            self.replies.close()
            raise

    def close(self) -> None:
        self.calls.close()
        self.replies.close()

    def start(self, message: _Message) -> tuple[Callable[[], Any] | None, bool]:
        """(what to run, whether to reply) for one call; (None, False) if not ours."""
        _cid, method, args, kwargs, targets, unique = message
        if targets is not None and self.rank not in targets:
            return None, False
        reply = unique == _ALL or unique == self.rank
        try:
            fn = _method(self.target, method)
        except AttributeError as exc:
            exc_fn = exc

            def fail() -> Any:
                raise exc_fn

            return fail, reply
        return functools.partial(fn, *args, **kwargs), reply

    def take(self, messages: list[Any], current: int = 0) -> bool:
        """Queue the calls of ``messages`` and act on the withdrawals among them; whether
        they withdraw call ``current``, which has just run (its result is then dropped)."""
        self.looked = time.monotonic()
        for message in messages:
            if not message[0]:
                break
        else:
            self.queue.extend(messages)
            return False
        cut = False
        for message in messages:
            if message[0]:
                self.queue.append(message)
                continue
            for cid in message[1]:
                if cid > self.last:  # queued, or still in the ring: skip it when it comes
                    self.withdrawn.add(cid)
                elif cid == self.awaiting and self.scope is not None:
                    self.scope.cancel()  # the method sees the cancellation where it waits
                elif cid == current:
                    cut = True
        return cut

    def read_now(self, messages: list[Any]) -> None:
        """Append every message waiting in the ring now (the next read reports its end)."""
        calls = self.calls
        while True:
            try:
                messages.append(calls.get_nowait())
            except (Empty, anyio.EndOfStream, PeerDied):
                return

    def poll(self, current: int) -> bool:
        """Between calls: take what came meanwhile; whether it withdraws call ``current``."""
        messages: list[Any] = []
        try:
            self.read_now(messages)
        finally:
            cut = self.take(messages, current)
        return cut

    def skipped(self, message: _Message) -> _Reply | None:
        """The answer to a withdrawn call that was never run, if this worker was to answer."""
        targets, unique = message[4], message[5]
        if targets is not None and self.rank not in targets:
            return None
        return (message[0], True, None) if unique == _ALL or unique == self.rank else None

    def process(self, awaits: bool) -> Generator[Any, Any, None]:
        """Run the queued calls in order and build their replies, for as long as the
        driver goes on: the one call processor of ``serve`` and ``serve_sync``, which
        differ only in how they wait.

        Yields what its driver must do: ``_READ`` when it has run every queued call (the
        driver reads the ring, then ``take``s what it read), a list of replies to send now
        (before reading, or as soon as the first of them has waited FLUSH_AFTER), or, only
        if ``awaits``, the awaitable an async method returned, whose result the driver
        sends back (or whose exception it throws in; ``_CUT`` if the call was withdrawn
        meanwhile).  Without ``awaits`` an async method is an error reply.  A withdrawn
        call is skipped, or its result dropped: it is answered with (id, True, None).
        Once POLL_AFTER has passed since the ring was last read, a call that ends looks
        at it for withdrawals.
        """
        queue, withdrawn = self.queue, self.withdrawn
        out: list[_Reply] = []
        since = poll_at = 0.0
        cid = 0
        while True:
            if not queue:
                if out:
                    yield out
                    out = []
                self.last = cid
                yield _READ
                poll_at = self.looked + POLL_AFTER
                continue
            message = queue.popleft()
            cid = message[0]
            if withdrawn and cid in withdrawn:
                withdrawn.discard(cid)
                answer = self.skipped(message)
                now = time.monotonic()
            else:
                run, reply = self.start(message)
                if run is None:
                    continue
                failure: Exception | None = None
                try:
                    result = run()
                    if inspect.isawaitable(result):
                        if not awaits:
                            close = getattr(result, "close", None)
                            if close is not None:
                                close()  # never awaited: no "was never awaited" warning
                            raise TypeError(
                                f"{message[1]!r} is async: serve it with aioshmq.rpc.serve"
                            )
                        self.last = self.awaiting = cid
                        result = yield result
                        poll_at = self.looked + POLL_AFTER
                except Exception as exc:
                    failure, result = exc, None
                now = time.monotonic()
                cut = result is _CUT
                if now > poll_at:
                    self.last = cid
                    cut = self.poll(cid) or cut
                    poll_at = now + POLL_AFTER
                if cut:
                    answer = (cid, True, None) if reply else None
                elif failure is not None:
                    answer = self.error(cid, failure, reply, message[1])
                else:
                    answer = self.result(cid, result) if reply else None
            if answer is not None:
                if not out:
                    since = now
                out.append(answer)
                if now - since > FLUSH_AFTER:
                    yield out
                    out = []

    def type_name(self, kind: type) -> str:
        # One string object per type: a batch's pickle then holds it once.
        name = self.type_names.get(kind)
        if name is None:
            if len(self.type_names) >= 256:
                self.type_names.clear()
            name = self.type_names[kind] = f"{kind.__module__}.{kind.__qualname__}"
        return name

    def result(self, cid: int, result: Any) -> _Reply:
        """The reply carrying a call's result; an error reply if it does not serialize."""
        if self.boxes and not _always_loads(result):
            try:
                main, buffers = self.ser.dumps(result)
            except Exception as exc:
                return self.unserializable(cid, exc)
            result = _Boxed(main, buffers, self.type_name(type(result)), None)
        return (cid, True, result)

    def error(self, cid: int, exc: BaseException, reply: bool, method: Any) -> _Reply | None:
        text = "".join(traceback.format_exception(exc))
        if not reply:
            _log.warning(
                "call %d (%s) raised in worker %d; no reply was asked of it:\n%s",
                cid,
                method,
                self.rank,
                text,
            )
            return None
        kind = type(exc)
        sent: Any = exc
        try:  # it must load at the caller as well as pickle here
            main, buffers = self.ser.dumps(exc)
            self.ser.loads(memoryview(main), buffers)
        except Exception:
            sent = RemoteError(_summary(exc), self.type_name(kind))
            if self.boxes:
                main, buffers = self.ser.dumps(sent)
        if self.boxes:
            sent = _Boxed(main, buffers, self.type_name(kind), _summary(exc))
        return (cid, False, (sent, text))

    def unserializable(self, cid: int, exc: Exception) -> _Reply:
        """The error reply sent in place of a result that did not serialize."""
        failure = TypeError(f"the result of call {cid} could not be serialized: {exc}")
        failure.__cause__ = exc
        answer = self.error(cid, failure, True, "")
        assert answer is not None
        return answer


@dataclass(frozen=True)
class _RemoteOptions:
    """How a worker on another host reaches its client, and where its replies listen."""

    secret: bytes | None = None
    insecure_loopback: bool = False
    heartbeat: float = DEFAULT_HEARTBEAT
    reply_listen: str | None = None
    timeout: float | None = 10.0


def _remote_options(
    handle: object,
    secret: bytes | None,
    insecure_loopback: bool,
    heartbeat: float,
    reply_listen: str | None,
) -> _RemoteOptions | None:
    if isinstance(handle, str):
        return _RemoteOptions(secret, insecure_loopback, heartbeat, reply_listen)
    if secret is not None or insecure_loopback or reply_listen is not None:
        raise ValueError(
            "secret=, insecure_loopback= and reply_listen= go with a client's address "
            "('tcp://...'), not with a handle"
        )
    return None


def _reply_listen(address: str) -> str:
    """Where a remote worker's reply ring listens: on this host's address on the route to
    the client (or a fresh ipc path beside the client's)."""
    auth = remote.load("_auth")
    if address.startswith("ipc://"):
        import tempfile

        return f"ipc://{tempfile.gettempdir()}/aioshmq-reply-{os.getpid()}-{secrets.token_hex(6)}"
    ip = auth.local_address_towards(auth.split_tcp(address)[0])
    return f"tcp://[{ip}]:0" if ":" in ip else f"tcp://{ip}:0"


async def serve(
    handle: RpcHandle | str,
    rank: int,
    target: object,
    *,
    serializer: SerializerSpec | None = None,
    capacity: int = REPLY_CAPACITY,
    spin: float | None = None,
    secret: bytes | None = None,
    insecure_loopback: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    reply_listen: str | None = None,
) -> None:
    """Serve ``target``'s methods as worker ``rank`` of a client, in call order.

    Methods may be plain or async.  Returns when the client closes or its process dies.
    A call the client withdrew (cancelled) is skipped if it has not begun; an async method
    running it is cancelled (its ``finally`` blocks run), a plain one runs to its end and
    its result is dropped.
    ``spin`` is the call ring reader's (see ``aioshmq.connect``); by default the workers
    spin only if they and the scheduler each have a CPU of their own.

    ``handle`` is the client's ``handle``, or on another host its ``address``, with the
    client's ``secret`` (or ``insecure_loopback``); the replies then travel through a ring
    of this process that listens on ``reply_listen`` (default: this host's address on the
    route to the client, any port), which the client connects to.
    """
    options = _remote_options(handle, secret, insecure_loopback, heartbeat, reply_listen)
    make = functools.partial(_Worker, handle, rank, target, serializer, capacity, spin, options)
    # Across hosts the handshakes take network time: off the event loop.
    worker = make() if options is None else await anyio.to_thread.run_sync(make)
    failure: BaseException | None = None
    try:
        try:
            async with anyio.create_task_group() as tg:
                watcher = _Watcher(worker)
                tg.start_soon(watcher.run)
                await _serve_calls(worker, watcher)
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # raised as itself: the watcher never fails
            if len(group.exceptions) != 1:
                raise
            failure = group.exceptions[0]
        if failure is not None:
            raise failure
    except PeerDied:  # the client died while a reply waited for room
        return
    finally:
        failure = None
        worker.close()


async def _serve_calls(worker: _Worker, watcher: _Watcher) -> None:
    """``serve``'s driving of ``process``: it reads the ring, sends the replies and awaits
    the async methods, each in a cancel scope that a withdrawal of its call cancels."""
    steps = worker.process(awaits=True)
    try:
        outcome: Any = None
        failure: Exception | None = None
        while True:
            with anyio.CancelScope() as scope:
                worker.scope = scope
                while True:
                    step = steps.send(outcome) if failure is None else steps.throw(failure)
                    outcome = failure = None
                    if step is _READ:
                        try:
                            if worker.failed is not None:
                                raise worker.failed
                            worker.take(await worker.calls.get_many())
                        except (anyio.EndOfStream, PeerDied):
                            return
                    elif type(step) is list:
                        await _send(worker, step)
                    else:
                        worker.since = time.monotonic()
                        watcher.started()
                        try:
                            outcome = await step
                        except Exception as exc:
                            failure = exc
                        finally:
                            worker.awaiting = 0
                            if watcher.reading is not None:
                                await watcher.stop()
                        if scope.cancel_called:  # withdrawn, though it ended by itself
                            break
            # The awaited call was withdrawn: the scope caught its cancellation (or it
            # ended anyway), and is spent.  Go on in a new one.
            outcome, failure = _CUT, None
    finally:
        steps.close()


class _Watcher:
    """``serve``'s second task.  Once an async method has run WATCH_AFTER, it reads the
    call ring until the method ends, so that a withdrawal reaches the worker at once: it
    cancels the method if its call is withdrawn, and marks queued calls to be skipped.
    (Shorter methods cost it nothing but a timer: it never reads the ring for them.)"""

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.parked: anyio.Event | None = None  # set: an async method has begun
        self.reading: anyio.CancelScope | None = None  # while it reads the ring
        self.left: anyio.Event | None = None  # set once it stopped reading
        self.cut = 0  # the id of the call it cut short last

    def started(self) -> None:
        """An async method has begun (``worker.awaiting``, ``worker.since`` say which)."""
        parked = self.parked
        if parked is not None:
            self.parked = None
            parked.set()

    async def stop(self) -> None:
        """Make it stop reading the ring, and wait until it has: the driver reads next."""
        assert self.reading is not None
        self.reading.cancel()
        self.left = left = anyio.Event()
        with anyio.CancelScope(shield=True):
            await left.wait()

    async def run(self) -> None:
        worker = self.worker
        while True:
            cid = worker.awaiting
            if not cid or cid == self.cut:
                self.parked = anyio.Event()
                await self.parked.wait()
                continue
            due = worker.since + WATCH_AFTER - time.monotonic()
            if due > 0:
                await anyio.sleep(due)
                continue
            try:
                with anyio.CancelScope() as self.reading:
                    try:
                        while worker.awaiting == cid:
                            worker.take(await worker.calls.get_many())
                            if worker.scope is not None and worker.scope.cancel_called:
                                self.cut = cid  # the driver reads next
                                break
                    except Exception as exc:  # the calls ended, or did not load: the driver
                        worker.failed = exc  # says so when it reads next
                        await anyio.sleep_forever()
            finally:
                self.reading = None
                if self.left is not None:
                    self.left.set()
                    self.left = None


async def _send(worker: _Worker, replies: list[_Reply]) -> None:
    try:
        await worker.replies.put_many(replies)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        raise
    except Exception:  # a result that does not serialize: send the rest
        for reply in replies:
            try:
                await worker.replies.put(reply)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                raise
            except Exception as exc:  # nothing was written: say why instead
                await worker.replies.put(worker.unserializable(reply[0], exc))


def serve_sync(
    handle: RpcHandle | str,
    rank: int,
    target: object,
    *,
    serializer: SerializerSpec | None = None,
    capacity: int = REPLY_CAPACITY,
    secret: bytes | None = None,
    insecure_loopback: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    reply_listen: str | None = None,
) -> None:
    """``serve`` for a plain process without an event loop: blocks until the client goes.

    Its methods are plain ones: a withdrawn call runs to its end if it has begun (its
    result is dropped), and is skipped if not."""
    options = _remote_options(handle, secret, insecure_loopback, heartbeat, reply_listen)
    worker = _Worker(handle, rank, target, serializer, capacity, 0.0, options)
    steps = worker.process(awaits=False)
    try:
        for step in steps:
            if step is _READ:
                try:
                    messages = [worker.calls.get_sync()]
                except (anyio.EndOfStream, PeerDied):
                    return
                worker.read_now(messages)  # and every other call waiting now, like get_many
                worker.take(messages)
            else:
                for reply in step:
                    _send_sync(worker, reply)
    except PeerDied:
        return
    finally:
        steps.close()
        worker.close()


def _send_sync(worker: _Worker, reply: _Reply) -> None:
    try:
        worker.replies.put_sync(reply)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        raise
    except Exception as exc:  # nothing was written: say why instead
        worker.replies.put_sync(worker.unserializable(reply[0], exc))

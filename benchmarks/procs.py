"""Child processes: started with "spawn", heard from through a pipe, always reaped."""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

CTX = multiprocessing.get_context("spawn")
READY_TIMEOUT = 90.0  # seconds for a child to start, import and open its ends (vLLM: torch)
RESULT_TIMEOUT = 60.0  # seconds for a child to finish once its stream has ended
JOIN_TIMEOUT = 10.0  # seconds for the children to exit after their results (1 s after a failure)


class ChildFailed(RuntimeError):
    """A child process raised, died, or did not answer in time."""


def run_backend(backend: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``fn(*args)`` under anyio on "asyncio", "uvloop" or "trio"."""
    if backend == "uvloop":
        return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(fn, *args, backend=backend)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time used so far by process ``pid`` (from /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


class Link:
    """The child's end of its pipe: tells the parent it is ready to be measured."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def ready(self, payload: object = None) -> None:
        self._conn.send(("ready", payload))


def _entry(conn: Connection, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Runs in the child: ``target(link, *args)``, then its result or its traceback."""
    try:
        result = target(Link(conn), *args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    else:
        conn.send(("result", result))
    finally:
        conn.close()


class Child:
    """One child process and the parent's end of its pipe."""

    def __init__(self, proc: BaseProcess, conn: Connection) -> None:
        self.proc = proc
        self.conn = conn

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def expect(self, kind: str, timeout: float) -> Any:
        """The child's next message, which must be ``kind``; ChildFailed otherwise."""
        name = self.proc.name
        if not self.conn.poll(timeout):
            raise ChildFailed(f"{name}: no {kind} message within {timeout} s")
        try:
            got, payload = self.conn.recv()
        except EOFError:
            self.proc.join(1.0)
            raise ChildFailed(f"{name} exited (code {self.proc.exitcode}) before {kind}") from None
        if got == "error":
            raise ChildFailed(f"{name} failed:\n{payload}")
        if got != kind:
            raise ChildFailed(f"{name} sent {got!r} where {kind!r} was expected")
        return payload


class Children:
    """Child processes that are always reaped: joined with a timeout, killed if they hang.

    Use as a context manager; ``ready()`` and ``results()`` block, so call them from a
    worker thread (``anyio.to_thread.run_sync``) while an event loop runs.
    """

    def __init__(self) -> None:
        self.kids: list[Child] = []

    def start(self, name: str, target: Callable[..., Any], *args: Any) -> Child:
        recv_end, send_end = CTX.Pipe(duplex=False)
        proc = CTX.Process(target=_entry, args=(send_end, target, args), name=name, daemon=True)
        try:
            proc.start()
        except BaseException:
            recv_end.close()
            raise
        finally:
            send_end.close()  # the child holds it now: its death reads as end-of-file here
        child = Child(proc, recv_end)
        self.kids.append(child)
        return child

    def ready(self, timeout: float = READY_TIMEOUT) -> list[Any]:
        return [kid.expect("ready", timeout) for kid in self.kids]

    def results(self, timeout: float = RESULT_TIMEOUT) -> list[Any]:
        return [kid.expect("result", timeout) for kid in self.kids]

    def __enter__(self) -> Children:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        deadline = time.monotonic() + (JOIN_TIMEOUT if exc_type is None else 1.0)
        for kid in self.kids:
            kid.proc.join(max(deadline - time.monotonic(), 0.0))
            if kid.proc.is_alive():
                kid.proc.kill()
                kid.proc.join(5.0)
            kid.conn.close()
            if not kid.proc.is_alive():
                kid.proc.close()
        self.kids.clear()

"""Cancellation points for the ends' hot paths: anyio's checkpoint_if_cancelled, cheaper.

An end's ``put`` or ``get`` that finds room or a message never has to wait, yet anyio's
contract (its memory streams, trio's channels) is that an ``await`` in a cancelled scope
raises before it does anything.  ``pending_checkpoint()`` answers whether it must: is a
scope around the current task cancelled, or past its deadline, up to the first shield?  It
returns what to await then (which raises the cancellation), or None.

anyio's public answer, ``current_effective_deadline()`` compared with ``current_time()``,
finds the running backend and, on asyncio under Python 3.11, the current task through
Python-level helpers on every call: about 1.2 us here, more than the rest of a put.  So on
asyncio, with an anyio whose internals this module was written and tested against
(``ANYIO_TESTED``), it reads anyio's own record of the task's cancel scopes instead, as
anyio's ``checkpoint_if_cancelled`` does, in a fraction of that.  With any other anyio, or
wherever that record is not what it expects, it uses the public API, so the answer is never
wrong, only slower.  This is the one module that reads anyio's internals.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import math
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

__all__ = ["ANYIO_TESTED", "current_task", "pending_checkpoint", "use_internals"]

Checkpoint = Callable[[], Awaitable[None]]

# The anyio releases whose asyncio backend keeps, for each task, a TaskState whose
# ``cancel_scope`` is the innermost CancelScope, each with ``_cancel_called``, ``_shield``,
# ``_deadline`` and ``_parent_scope`` (anyio's checkpoint_if_cancelled reads the same).
ANYIO_TESTED = ((4, 10), (4, 16))  # first and last minor release, both included

_get_ident = threading.get_ident
_get_running_loop = asyncio.events._get_running_loop
_current_tasks: dict[Any, Any] | None = getattr(asyncio.tasks, "_current_tasks", None)
_current_task: Callable[[Any], Any] = (
    _current_tasks.get if _current_tasks is not None else asyncio.current_task
)
current_task = _current_task  # the task a loop runs now, without a getpid()
_INF = math.inf


def _anyio_version() -> tuple[int, int]:
    try:
        major, minor = importlib.metadata.version("anyio").split(".")[:2]
        return int(major), int(minor)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0, 0)


def _task_states() -> Any:
    """anyio's per-task record of the innermost cancel scope, if this anyio is one tested."""
    if not ANYIO_TESTED[0] <= _anyio_version() <= ANYIO_TESTED[1] or _current_tasks is None:
        return None
    try:
        from anyio._backends._asyncio import _task_states as states
    except ImportError:
        return None
    return states


_states: Any = _task_states()
_on = [_states is not None]  # read on every call: whether the internals are in use

# The running loop a thread found last, that thread's id, and whether the loop says which
# thread runs it: asyncio's own lookup makes a getpid() system call every time on Python
# 3.11 (to notice a fork).  A thread runs one loop at a time, so while that loop has a
# current task in this thread, it is this thread's loop.  Replaced whole, under the GIL: a
# thread never reads another's loop with its own id.
_seen: list[Any] = [0, None, False]

# Tasks looked up lately, and their anyio states: anyio keeps them in a WeakKeyDictionary,
# whose Python-level get() costs more than the rest of this check, and the few tasks that
# use an end (a pinging and an echoing one, say) ask again and again.  A state lives as
# long as its task, so one found for a live task is still its own.
_CACHED = 64
_cache: dict[int, tuple[weakref.ref[Any], Any]] = {}


def use_internals(on: bool) -> bool:
    """Read anyio's internals (if this anyio is one tested) or always use its public API;
    returns whether the internals are now in use.  For tests of both paths."""
    _on[0] = on and _states is not None
    _cache.clear()
    _seen[:] = [0, None, False]
    return _on[0]


_TIMER_GRACE = 0.05  # s: how long past a deadline a call waits for its scope's timer


async def _deadline_passed() -> None:
    """Checkpoints for a scope whose deadline passed before its timer ran, until the timer
    has cancelled it: asyncio runs a task that yields before the timers due, and uvloop's
    timers have a millisecond grain, so the first checkpoints may return.  Bounded, should
    the timer never come."""
    give_up = anyio.current_time() + _TIMER_GRACE
    await checkpoint()
    while anyio.current_time() < give_up:
        await checkpoint()


async def _outside_a_loop() -> None:
    """Await what is awaited outside an event loop: anyio's checkpoint refuses, in words
    that vary with anyio's version, so say it in ours, naming the way out."""
    try:
        await checkpoint()
    except RuntimeError as exc:
        raise RuntimeError(
            "aioshmq's async calls must be awaited in a running event loop (asyncio, uvloop "
            "or trio, through anyio); outside one, use put_sync or get_sync"
        ) from exc


def _public() -> Checkpoint | None:
    """The answer from anyio's public API (any backend, any version, outside a loop too)."""
    try:
        deadline = anyio.current_effective_deadline()
    except Exception:
        return _outside_a_loop
    if deadline == -_INF:
        return checkpoint
    if deadline <= anyio.current_time():
        return _deadline_passed
    return None


def _trio() -> Checkpoint | None:
    trio = sys.modules["trio"]
    deadline = trio.current_effective_deadline()
    if deadline != _INF and deadline <= trio.current_time():
        return trio.lowlevel.checkpoint  # type: ignore[no-any-return]
    return None


def pending_checkpoint() -> Checkpoint | None:
    """What to await so that a pending cancellation is raised now, or None if none is.

    Never yields to the event loop unless a scope around the current task is cancelled or
    past its deadline.  The common case (this thread's loop as last time, a task seen before,
    anyio's internals in use) is answered here, walking the task's anyio cancel scopes up to
    a shield; ``_look_up`` finds the rest and comes back here.
    """
    seen = _seen
    if seen[0] == _get_ident():  # 0 while anyio's internals are not in use
        loop = seen[1]
        task = _current_task(loop)
        # A stdlib loop says which thread runs it (uvloop does not): not ours, ask again.
        if task is not None and not (seen[2] and loop._thread_id != seen[0]):
            entry = _cache.get(id(task))
            if entry is not None and entry[0]() is task:
                state = entry[1]
                if state is None:  # no anyio scope around it when last looked (plain asyncio)
                    state = _states.data.get(entry[0])  # its weak key, without the Python get
                    if state is None:
                        return None
                    _cache[id(task)] = (entry[0], state)
                try:
                    scope = state.cancel_scope
                    while scope is not None:
                        if scope._cancel_called:
                            return checkpoint
                        if scope._deadline != _INF and scope._deadline <= loop.time():
                            scope.cancel()  # what its timer, due but not run yet, is about to do
                            return checkpoint
                        if scope._shield:
                            return None
                        scope = scope._parent_scope
                except AttributeError:  # anyio's internals are not what they were
                    use_internals(False)
                    return _public()
                return None
    return _look_up()


def _look_up() -> Checkpoint | None:
    """``pending_checkpoint`` the long way: find the loop, the task and its anyio state,
    remember them, and ask again (or ask anyio's public API, or trio's)."""
    tid = _get_ident()
    loop = _get_running_loop()
    if loop is None:
        _seen[:] = [0, None, False]
        trio = sys.modules.get("trio")
        if trio is not None and trio.lowlevel.in_trio_run():
            return _trio()
        return _public()
    if not _on[0]:  # anyio's internals are not in use: _seen stays clear
        return _public()
    _seen[:] = [tid, loop, hasattr(loop, "_thread_id")]
    task = _current_task(loop)
    if task is None:  # not an asyncio task (trio in guest mode): anyio decides
        return _public()
    entry = _cache.get(id(task))
    if entry is None or entry[0]() is not task:
        if len(_cache) >= _CACHED:  # entries of tasks that ended: start afresh
            _cache.clear()
        # A task with no anyio scope around it yet (a plain asyncio task) is remembered too:
        # nothing can cancel it the anyio way until it enters one, which the first path
        # looks for in anyio's dict at each call.
        _cache[id(task)] = (weakref.ref(task), _states.get(task))
    return pending_checkpoint()  # found now, on the first path

"""Cancellation points for the ends' hot paths: anyio's checkpoint_if_cancelled, cheaper.

An end's ``put`` or ``get`` that finds room or a message never has to wait, yet anyio's
contract (its memory streams, trio's channels) is that an ``await`` in a cancelled scope
raises before it does anything.  anyio's ``checkpoint_if_cancelled()`` gives that, but finds
the running backend on every call and, on asyncio under Python 3.11, looks the current task
up through Python-level helpers: about 1.2 us here, half the cost of a whole put.
``pending_checkpoint()`` answers the same question from anyio's own task state in about
0.3 us: is a cancel scope around the current task cancelled, up to the first shield?  Where
that state is not what it expects (another anyio version, trio guest mode), it hands back
anyio's public function instead, so the answer is never wrong, only slower.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from anyio.lowlevel import checkpoint, checkpoint_if_cancelled

from ..ring import switch as _switch

__all__ = ["current_task", "pending_checkpoint"]

Checkpoint = Callable[[], Awaitable[None]]

_get_running_loop = asyncio.events._get_running_loop
_current_tasks: dict[Any, Any] | None = getattr(asyncio.tasks, "_current_tasks", None)
_current_task: Callable[[Any], Any] = (
    _current_tasks.get if _current_tasks is not None else asyncio.current_task
)
current_task = _current_task  # the task a loop runs now, without a getpid()

_states: Any
_types: tuple[Any, Any] = (None, None)  # anyio's TaskState and CancelScope (asyncio backend)
try:  # anyio's per-task record of the innermost cancel scope (asyncio backend)
    from anyio._backends._asyncio import CancelScope as _Scope
    from anyio._backends._asyncio import TaskState as _State
    from anyio._backends._asyncio import _task_states as _states

    _types = (_State, _Scope)
except ImportError:  # pragma: no cover - another anyio: the public function serves
    _states = None


# The running loop a thread found last, with that thread's id and whether the loop says which
# thread runs it: asyncio's own lookup makes a getpid() system call every time (to notice a
# fork), about a tenth of a put here.  A thread runs one loop at a time, so while that loop
# has a current task in this thread, it is this thread's loop.  One tuple, replaced whole:
# a thread never reads another's loop with its own id.
_get_ident = threading.get_ident
_seen: list[tuple[int, Any, bool]] = [(0, None, False)]

# Tasks looked up lately, and their anyio states: anyio keeps them in a WeakKeyDictionary,
# whose Python-level get() costs more than the rest of this check, and the few tasks that
# use an end (a pinging and an echoing one, say) ask again and again.  A state lives as
# long as its task, so one found for a live task is still its own.
_CACHED = 64
_cache: dict[int, tuple[Any, Any]] = {}  # id(task) -> (weakref to the task, its TaskState)
_fast = [_states is not None]  # whether anyio's task state is usable here (read, never written)


def _pending_checkpoint() -> Checkpoint | None:
    """What to await so that a pending cancellation is raised now, or None if none is.

    Never yields to the event loop unless the current task is cancelled.  The reference:
    the compiled twin answers the common case itself and calls this for the rest.
    """
    tid = _get_ident()
    seen_tid, loop, says_thread = _seen[0]
    task = None
    if seen_tid == tid:
        task = _current_task(loop)
        # A stdlib loop says which thread runs it (uvloop does not): not ours, ask again.
        if task is not None and says_thread and loop._thread_id != tid:
            task = None
    if task is None:  # not the loop this thread ran last: ask (that costs a getpid())
        loop = _get_running_loop()
        if loop is None:
            _seen[0] = (0, None, False)
            trio = sys.modules.get("trio")
            if trio is not None and trio.lowlevel.in_trio_run():
                return trio.lowlevel.checkpoint_if_cancelled  # type: ignore[no-any-return]
            return checkpoint_if_cancelled  # raises anyio's NoEventLoopError outside a loop
        _seen[0] = (tid, loop, hasattr(loop, "_thread_id"))
        task = _current_task(loop)
        if task is None:  # not an asyncio task (trio in guest mode): let anyio decide
            return checkpoint_if_cancelled
    if not _fast[0]:  # anyio's internals are not what this expects
        return checkpoint_if_cancelled
    entry = _cache.get(id(task))
    if entry is not None and entry[0]() is task:
        state = entry[1]
    else:
        state = _states.get(task)
        if state is None:  # no anyio scope around this task (yet): nothing can cancel it
            return None
        if len(_cache) >= _CACHED:  # entries of tasks that ended: start afresh
            _cache.clear()
        _cache[id(task)] = (weakref.ref(task), state)
    try:
        scope = state.cancel_scope
        while scope is not None:
            if scope._cancel_called:
                return checkpoint
            if scope._shield:
                return None
            scope = scope._parent_scope
    except AttributeError:  # anyio's internals moved: its public function from now on
        _fast[0] = False
        return checkpoint_if_cancelled
    return None


def _compiled() -> Callable[[], Checkpoint | None] | None:
    """The compiled twin of ``_pending_checkpoint``, set up to read this module's state, if
    the compiled core runs (``_switch``)."""
    if not _switch.COMPILED or _current_tasks is None:
        return None
    try:
        from . import _cancel_c
    except ImportError:  # built before it existed: the pure check serves
        return None
    _cancel_c.setup(_seen, _current_tasks, _cache, _fast, checkpoint, _pending_checkpoint, *_types)
    return _cancel_c.pending_checkpoint


pending_checkpoint: Callable[[], Checkpoint | None] = _compiled() or _pending_checkpoint

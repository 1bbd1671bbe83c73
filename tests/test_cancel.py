"""Cancellation points: every await of an end raises a pending cancellation first, as anyio's
memory streams and trio's channels do, whether or not it would have had to wait."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import sniffio

import aioshmq
from aioshmq.ends import cancel as _cancel

pytestmark = pytest.mark.anyio


async def test_receive_when_cancelled() -> None:
    """anyio's test of the same name: a receive in a cancelled scope takes nothing."""
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        for i in range(5):
            await w.put(i)
        for _ in range(5):
            with anyio.CancelScope() as scope:
                scope.cancel()
                await r.get()
                raise AssertionError("get() went through in a cancelled scope")
            assert scope.cancelled_caught
        assert [await r.get() for _ in range(5)] == list(range(5))


async def test_send_when_cancelled() -> None:
    """anyio's test of the same name: a send in a cancelled scope publishes nothing."""
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        for i in range(5):
            with anyio.CancelScope() as scope:
                scope.cancel()
                await w.put(f"hello {i}")
                raise AssertionError("put() went through in a cancelled scope")
            assert scope.cancelled_caught
        await w.put("world")
        assert r.get_nowait() == "world"
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()
        assert w.statistics().messages_put == 1


async def _lease(r: aioshmq.Reader[Any]) -> None:
    async with r.lease():
        pass


CALLS: dict[str, Callable[[aioshmq.Writer[Any], aioshmq.Reader[Any]], Awaitable[Any]]] = {
    "put": lambda w, r: w.put(1),
    "send": lambda w, r: w.send(1),
    "put_many": lambda w, r: w.put_many([1, 2]),
    "wait_readers": lambda w, r: w.wait_readers(),
    "get": lambda w, r: r.get(),
    "receive": lambda w, r: r.receive(),
    "get_many": lambda w, r: r.get_many(),
    "lease": lambda w, r: _lease(r),
}


@pytest.mark.parametrize("call", CALLS)
async def test_every_await_raises_a_pending_cancellation(call: str) -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        for i in range(3):
            await w.put(i)  # both ends have just been through a call: no yield is due
            await w.put("waiting")  # a reader's call would not have to wait either
            assert await r.get() == i
            before = w.statistics()
            with anyio.CancelScope() as scope:
                scope.cancel()
                await CALLS[call](w, r)
            assert scope.cancelled_caught, f"{call} went through in a cancelled scope"
            after = w.statistics()
            assert (after.messages_put, after.messages_in_ring) == (
                before.messages_put,
                before.messages_in_ring,
            )
            assert r.get_nowait() == "waiting"


@pytest.mark.parametrize("spin", [0, 0.001])
async def test_a_get_that_would_sleep_raises_a_pending_cancellation(spin: float) -> None:
    """On an empty ring the sleep is the cancellation point; a message that comes just as
    the get announces its sleep (so that it never sleeps) is still not taken."""
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name, spin=spin) as r:
        r._next_yield = float("inf")  # no fairness yield due: only the sleep can raise
        r._spinner.now = 0.0  # and no spin before it
        with anyio.CancelScope() as scope:
            scope.cancel()
            await r.get()
        assert scope.cancelled_caught
        ring = r._ring

        class Racing:
            """The ring, with a message put as the reader announces its sleep."""

            def __getattr__(self, name: str) -> Any:
                return getattr(ring, name)

            raced = False

            def prepare_sleep(self) -> bool:
                w.put_nowait("raced")
                Racing.raced = True
                return bool(ring.prepare_sleep())

        r._ring = Racing()  # type: ignore[assignment]
        try:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await r.get()
            assert scope.cancelled_caught
        finally:
            r._ring = ring
        await w.put("next")
        assert [await r.get() for _ in range(1 + Racing.raced)] == ["raced"] * Racing.raced + [
            "next"
        ]


async def test_a_deadline_already_past_cancels() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with anyio.move_on_after(-1) as scope:
            await w.put(1)
        assert scope.cancelled_caught
        await w.put(2)
        with anyio.move_on_after(-1) as scope:
            await r.get()
        assert scope.cancelled_caught
        assert await r.get() == 2


async def test_a_shield_inside_a_cancelled_scope_lets_calls_through() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with anyio.CancelScope() as outer:
            outer.cancel()
            with anyio.CancelScope(shield=True):
                await w.put("shielded")
                assert await r.get() == "shielded"
        assert outer.cancelled_caught is False  # nothing in it was cancelled


async def test_pending_checkpoint_sees_enclosing_scopes_up_to_a_shield(
    anyio_backend: object,
) -> None:
    trio = anyio_backend == "trio"  # there trio's own check is handed back every time
    assert _cancel.pending_checkpoint() is None or trio
    with anyio.CancelScope() as outer:
        with anyio.CancelScope():
            outer.cancel()
            found = _cancel.pending_checkpoint()
            assert found is not None
            with anyio.CancelScope(shield=True):
                assert _cancel.pending_checkpoint() is None or trio
            await found()
            raise AssertionError("the pending cancellation was not raised")


async def test_the_compiled_check_answers_as_the_pure_one(anyio_backend: object) -> None:
    """Where the compiled core runs, ``pending_checkpoint`` is its twin of the pure function:
    the same answer, object for object, in every state (the first ask fills the cache)."""
    check, pure = _cancel.pending_checkpoint, _cancel._pending_checkpoint
    if aioshmq.CORE == "compiled":
        assert check is not pure
    for _ in range(2):
        assert check() is pure()
        with anyio.CancelScope() as outer:
            with anyio.CancelScope():
                assert check() is pure()
                outer.cancel()
                assert check() is pure()
                assert check() is not None
                with anyio.CancelScope(shield=True):
                    assert check() is pure()
                    with anyio.CancelScope() as inner:
                        inner.cancel()
                        assert check() is pure()
                        assert check() is not None

    answers: dict[str, list[object]] = {}

    def in_another_thread(name: str) -> None:
        async def main() -> None:
            answers[name] = [check(), pure()]
            with anyio.CancelScope() as scope:
                scope.cancel()
                answers[name] += [check(), pure()]

        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": name == "uvloop"})

    for name in ("asyncio", "uvloop"):
        thread = threading.Thread(target=in_another_thread, args=(name,))
        thread.start()
        thread.join(10)
        a, b, c, d = answers[name]
        assert a is b is None and c is d is not None, name
        assert check() is pure()  # this thread's own answer, after the other loop's


async def test_the_compiled_check_tells_tasks_apart(anyio_backend: object) -> None:
    """Two tasks asking in turn, one in a cancelled scope (then shielded from it) and one
    not: each gets its own answer, the pure function's, whichever task asked last."""
    check, pure = _cancel.pending_checkpoint, _cancel._pending_checkpoint
    answers: dict[str, list[tuple[object, object]]] = {"cancelled": [], "free": []}
    steps = [anyio.Event() for _ in range(9)]

    async def ask(name: str, first: int) -> None:
        with anyio.CancelScope() as outer:
            if name == "cancelled":
                outer.cancel()
            with anyio.CancelScope() as inner:
                for step in range(first, 8, 2):
                    with anyio.CancelScope(shield=True):  # waits in turn, cancelled or not
                        await steps[step].wait()
                    if step >= 4:
                        inner.shield = True  # from now on the outer scope is not seen
                    answers[name].append((check(), pure()))
                    steps[step + 1].set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, "cancelled", 0)
        tg.start_soon(ask, "free", 1)
        steps[0].set()
    for name, pairs in answers.items():
        assert [a is b for a, b in pairs] == [True] * 4, name
    if anyio_backend == "trio":
        return  # both hand back trio's own check, whose answer is trio's to give
    assert [a is not None for a, _ in answers["cancelled"]] == [True, True, False, False]
    assert [a for a, _ in answers["free"]] == [None] * 4


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_compiled_check_reads_anyio_slots(anyio_backend: str) -> None:
    """On this anyio the compiled check reads the task state and the scopes from their slots
    (several times cheaper than by name); if anyio ever changes them, it reads them by name
    and answers the same: this test then says so."""
    if aioshmq.CORE != "compiled":
        pytest.skip("the pure core reads attributes by name")
    from aioshmq.ends import _cancel_c

    _cancel.pending_checkpoint()
    assert _cancel_c.direct_fields() == [
        "cancel_scope",
        "_cancel_called",
        "_shield",
        "_parent_scope",
    ]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_cheap_path_is_in_use_on_asyncio(anyio_backend: str) -> None:
    """On this anyio the check reads anyio's task state directly; if anyio ever changes
    it, the check falls back to anyio's own (slower) function: this test then says so."""
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put(1)
        assert await r.get() == 1
        assert _cancel.pending_checkpoint() is None
    assert _cancel._fast[0], "anyio's task state is not what aioshmq._cancel expects"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_tasks_taking_turns_each_get_their_own_answer(anyio_backend: str) -> None:
    """The check caches each task's state: tasks that alternate (a ping and an echo) never
    see one another's cancellation, and a task that ends leaves nothing behind."""
    answers: dict[str, list[bool]] = {"calm": [], "cancelled": []}
    turn = [anyio.Event(), anyio.Event()]

    async def ask(name: str, me: int, cancel: bool) -> None:
        with anyio.CancelScope() as scope:
            if cancel:
                scope.cancel()
            for _ in range(3):
                with anyio.CancelScope(shield=True):  # waits even in the cancelled scope
                    await turn[me].wait()
                turn[me] = anyio.Event()
                answers[name].append(_cancel.pending_checkpoint() is not None)
                turn[1 - me].set()
        assert scope.cancel_called == cancel

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, "calm", 0, False)
        tg.start_soon(ask, "cancelled", 1, True)
        await anyio.wait_all_tasks_blocked()
        turn[0].set()
    assert answers == {"calm": [False] * 3, "cancelled": [True] * 3}
    assert len(_cancel._cache) <= _cancel._CACHED


def _outcome(call: Callable[[], Any]) -> object:
    try:
        return ("returned", call())
    except BaseException as exc:  # every outcome is compared
        return ("raised", type(exc), str(exc))


def test_the_compiled_sync_calls_answer_as_the_pure_ones() -> None:
    """``put_sync`` and ``get_sync`` (C twins under the compiled core, aioshmq._cancel_c) give
    what the pure methods give in every state they check: calls they do not take, a full or
    empty ring, what pickle refuses, an array, a batch, the task lock held, a loop running,
    and a closed end.  The two are called turn about on one ring."""
    import numpy as np

    from aioshmq import Reader, Writer
    from aioshmq.api.open import PURE_SYNC

    pure_put, pure_get = PURE_SYNC
    if aioshmq.CORE == "compiled":
        assert type(Writer.put_sync).__name__ == "method_descriptor"
        assert Writer.put_sync.__doc__ == pure_put.__doc__
        assert type(Reader.get_sync).__name__ == "method_descriptor"
    with aioshmq.create(capacity=1 << 16, max_messages=2) as w, aioshmq.connect(w.name) as r:
        puts: list[Callable[..., Any]] = [w.put_sync, lambda *a, **k: pure_put(w, *a, **k)]
        gets: list[Callable[..., Any]] = [r.get_sync, lambda *a, **k: pure_get(r, *a, **k)]

        def both(
            calls: list[Callable[..., Any]], *args: Any, **kwargs: Any
        ) -> tuple[object, object]:
            return _outcome(lambda: calls[0](*args, **kwargs)), _outcome(
                lambda: calls[1](*args, **kwargs)
            )

        for calls in (puts, gets):
            for bad in ((1, 2, 3), ()):
                if calls is gets and not bad:
                    continue
                a, b = both(calls, *bad)
                assert a[:2] == b[:2] == ("raised", TypeError)
            a, b = both(calls, **{"bogus": 1})
            assert a[:2] == b[:2] == ("raised", TypeError)
        assert both(gets, timeout=0) == (("raised", TimeoutError, "aioshmq reader: timed out"),) * 2
        assert both(puts, ("t", 1)) == (("returned", None),) * 2
        assert both(puts, ("t", 2), 0)[0] == both(puts, ("t", 2), timeout=0)[1]  # full
        assert both(gets) == (("returned", ("t", 1)), ("returned", ("t", 1)))
        a, b = both(gets, timeout=0)
        assert a == b and a[0] == "raised"
        a, b = both(puts, lambda: 0)
        assert a[:2] == b[:2] and a[0] == "raised"
        for put in puts:
            put(np.arange(5))
        for get in gets:
            assert get(timeout=1).tolist() == [0, 1, 2, 3, 4]
        anyio.run(w.put_many, [1, 2])
        assert [gets[0](), gets[1]()] == [1, 2]  # the second one from the batch's rest
        w._lock.held = True
        r._lock.held = True
        try:
            assert both(puts, 3)[0] == both(puts, 3)[1]
            assert both(gets)[0] == both(gets)[1]
        finally:
            w._lock.held = r._lock.held = False

        async def in_a_loop() -> tuple[object, ...]:
            return both(puts, 4) + both(gets)

        a, b, c, d = anyio.run(in_a_loop)
        assert a == b and c == d and a[0] == c[0] == "raised"
    assert both(puts, 5)[0] == both(puts, 5)[1]
    assert both(gets)[0] == both(gets)[1]
    assert both(gets)[0][:2] == ("raised", anyio.ClosedResourceError)


def test_the_compiled_calls_call_the_core_method_a_lookup_finds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``put``, ``get``, ``put_sync`` and ``get_sync`` call the ring core's ``put_object`` and
    ``get_plain`` as a lookup by name finds them: one set on the ring itself, or on its class,
    is the one called (the compiled calls remember the class's method, and notice a change),
    and the core's own again once it is gone."""
    calls: list[str] = []

    def on_instance(ring: Any, name: str) -> None:
        real = getattr(ring, name)

        def spy(a: Any, b: Any) -> Any:
            calls.append(name)
            return real(a, b)

        monkeypatch.setattr(ring, name, spy)

    def on_class(ring: Any, name: str) -> None:
        real = getattr(type(ring), name)

        def spy(self: Any, a: Any, b: Any) -> Any:
            calls.append(name)
            return real(self, a, b)

        monkeypatch.setattr(type(ring), name, spy)

    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:

        async def put_and_get(obj: object) -> object:
            await w.put(obj)
            return await r.get()

        def round_trips(tag: str) -> list[object]:
            w.put_sync((tag, "sync"))
            return [r.get_sync(), anyio.run(put_and_get, (tag, "async"))]

        assert round_trips("before") == [("before", "sync"), ("before", "async")]
        assert calls == []
        # The class first: undone, pytest may leave the ring holding its own bound method.
        for patch in (on_class, on_instance):
            patch(w._ring, "put_object")
            patch(r._ring, "get_plain")
            assert round_trips(patch.__name__) == [
                (patch.__name__, "sync"),
                (patch.__name__, "async"),
            ]
            assert calls == ["put_object", "get_plain"] * 2, patch.__name__
            monkeypatch.undo()
            calls.clear()
            assert round_trips("after") == [("after", "sync"), ("after", "async")]
            assert calls == []


async def _awaited(call: Callable[[], Awaitable[Any]]) -> object:
    """What awaiting ``call()`` gives: what it returned or raised, or ``("waited",)`` if it
    was still waiting once every task was blocked (it is then cancelled)."""
    outcome: list[object] = []

    async def run() -> None:
        try:
            outcome.append(("returned", await call()))
        except anyio.get_cancelled_exc_class():
            outcome.append(("waited",))
            raise
        except Exception as exc:  # every outcome is compared
            outcome.append(("raised", type(exc), str(exc)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    return outcome[0]


async def test_the_compiled_put_and_get_answer_as_the_pure_ones() -> None:
    """``put`` and ``get`` (C twins under the compiled core, aioshmq._cancel_c) give what the
    pure coroutines give in every state they check: calls they do not take, room or none, a
    message or none, what pickle refuses, an array, the rest of a batch, a pending
    cancellation, pacing due, the task lock held, a closed end.  The two are awaited turn
    about on one ring."""
    import numpy as np

    from aioshmq import Reader, Writer
    from aioshmq.api.open import PURE_ASYNC

    pure_put, pure_get = PURE_ASYNC
    if aioshmq.CORE == "compiled":
        assert type(Writer.put).__name__ == "method_descriptor"
        assert Writer.put.__doc__ == pure_put.__doc__
        assert type(Reader.get).__name__ == "method_descriptor"
    w = aioshmq.create(capacity=1 << 16, max_messages=2)
    r = aioshmq.connect(w.name)
    puts: list[Callable[..., Any]] = [w.put, lambda *a, **k: pure_put(w, *a, **k)]
    gets: list[Callable[..., Any]] = [r.get, lambda *a, **k: pure_get(r, *a, **k)]

    async def both(calls: list[Callable[..., Any]], *args: Any, **kwargs: Any) -> list[object]:
        return [await _awaited(functools.partial(call, *args, **kwargs)) for call in calls]

    try:
        for calls, bad in ((puts, ()), (puts, (1, 2)), (gets, (1,))):
            a, b = await both(calls, *bad)
            assert a == b and a[:2] == ("raised", TypeError)  # type: ignore[index]
            a, b = await both(calls, *bad[:1], bogus=1)
            assert a == b and a[:2] == ("raised", TypeError)  # type: ignore[index]
        assert await both(gets) == [("waited",)] * 2
        assert await both(puts, ("t", 1)) == [("returned", None)] * 2
        assert await both(puts, ("t", 2)) == [("waited",)] * 2  # two messages at most
        assert await both(gets) == [("returned", ("t", 1))] * 2
        a, b = await both(puts, lambda: 0)
        assert a == b and a[0] == "raised"  # type: ignore[index]
        for put in puts:
            await put(np.arange(5))
        assert [(await get()).tolist() for get in gets] == [[0, 1, 2, 3, 4]] * 2
        await w.put_many([1, 2])
        assert [await gets[0](), await gets[1]()] == [1, 2]  # the second from the batch's rest
        await w.put_many([3, 4])
        assert [await gets[1](), await gets[0]()] == [3, 4]
        sent = w.statistics().messages_put
        for put, get in zip(puts, gets, strict=True):
            with anyio.CancelScope() as scope:
                scope.cancel()
                await put("cancelled")
            assert scope.cancelled_caught
            await w.put(("kept", 0))
            with anyio.CancelScope() as scope:
                scope.cancel()
                await get()
            assert scope.cancelled_caught
            assert await r.get() == ("kept", 0)
        assert w.statistics().messages_put == sent + 2
        # Pacing due: both let the loop run first, then go on, and the next pace is due
        # YIELD_INTERVAL after the clock they read; a pace whose checkpoint raised leaves it
        # due, and nothing is put or taken.
        from aioshmq.ends.end import YIELD_INTERVAL

        ran: list[str] = []

        async def other() -> None:
            ran.append("other")

        fifo = sniffio.current_async_library() == "asyncio"  # trio shuffles its run batch
        for put, get in zip(puts, gets, strict=True):
            for end, call, want in (
                (w, functools.partial(put, ("paced", 1)), None),
                (r, get, ("paced", 1)),
            ):
                end._next_yield = 0.0
                ran.clear()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(other)
                    before = time.monotonic()
                    assert await call() == want
                    if fifo:
                        assert ran == ["other"]  # the loop ran the other task first
                after = time.monotonic()
                assert before + YIELD_INTERVAL <= end._next_yield <= after + YIELD_INTERVAL
                end._next_yield = 0.0
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await call()
                assert scope.cancelled_caught and end._next_yield == 0.0
        assert r.statistics().messages_received == w.statistics().messages_put
        w._lock.held = r._lock.held = True
        try:
            assert await both(puts, 5) == [("waited",)] * 2
            assert await both(gets) == [("waited",)] * 2
        finally:
            w._lock.held = r._lock.held = False
        w.close()
        a, b = await both(puts, 6)
        assert a == b and a[:2] == ("raised", anyio.ClosedResourceError)  # type: ignore[index]
        assert await both(gets) == [("raised", anyio.EndOfStream, "")] * 2
        r.close()
        a, b = await both(gets)
        assert a == b and a[:2] == ("raised", anyio.ClosedResourceError)  # type: ignore[index]
    finally:
        r.close()
        w.close()


async def test_put_and_get_are_coroutines() -> None:
    """``put()`` and ``get()`` (compiled or pure) are coroutines: a task group or the loop
    runs them as tasks, they do nothing until awaited (and warn if never awaited), and one
    cannot be awaited twice."""
    import gc
    import sys

    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.put, "started soon")
        assert await r.get() == "started soon"
        if "asyncio" in sys.modules and sys.modules["sniffio"].current_async_library() == "asyncio":
            import asyncio

            await asyncio.get_running_loop().create_task(w.put("a task"))
            assert await asyncio.ensure_future(r.get()) == "a task"
        with pytest.warns(RuntimeWarning, match="was never awaited"):
            never = w.put("never")
            del never
            gc.collect()
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()
        once = w.put("once")
        await once
        with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
            await once
        unstarted = r.get()
        with pytest.raises(KeyError, match="thrown"):
            unstarted.throw(KeyError("thrown"))
        unstarted.close()
        assert await r.get() == "once"

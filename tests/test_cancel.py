"""Cancellation points: every await of an end raises a pending cancellation first, as anyio's
memory streams and trio's channels do, whether or not it would have had to wait."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

import aioshmq
from aioshmq.ends import cancel as _cancel

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("internals")]


@pytest.fixture(params=[True, False], ids=["internals", "public"])
def internals(request: pytest.FixtureRequest) -> Any:
    """Every test here runs twice: with the check reading anyio's internals (this anyio is
    one it was tested against) and with it using anyio's public API only."""
    if not _cancel.use_internals(request.param) and request.param:
        pytest.skip(f"anyio is not within {_cancel.ANYIO_TESTED}")
    yield request.param
    _cancel.use_internals(True)


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
    assert _cancel.pending_checkpoint() is None
    with anyio.CancelScope() as outer:
        with anyio.CancelScope():
            outer.cancel()
            found = _cancel.pending_checkpoint()
            assert found is not None
            with anyio.CancelScope(shield=True):
                assert _cancel.pending_checkpoint() is None
            await found()
            raise AssertionError("the pending cancellation was not raised")


async def test_the_check_answers_as_anyio_does(anyio_backend: object) -> None:
    """Whichever way it reads the scopes, the check says what anyio's public API says (the
    effective deadline against the time), in every state; the first ask fills its cache."""
    check = _cancel.pending_checkpoint

    def public() -> bool:
        return anyio.current_effective_deadline() <= anyio.current_time()

    for _ in range(2):
        assert (check() is not None) is public() is False
        with anyio.CancelScope() as outer:
            with anyio.CancelScope():
                assert (check() is not None) is public() is False
                outer.cancel()
                assert (check() is not None) is public() is True
                with anyio.CancelScope(shield=True):
                    assert (check() is not None) is public() is False
                    with anyio.CancelScope() as inner:
                        inner.cancel()
                        assert (check() is not None) is public() is True

    answers: dict[str, list[bool]] = {}

    def in_another_thread(name: str) -> None:
        async def main() -> None:
            answers[name] = [check() is not None]
            with anyio.CancelScope() as scope:
                scope.cancel()
                answers[name].append(check() is not None)

        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": name == "uvloop"})

    for name in ("asyncio", "uvloop"):
        thread = threading.Thread(target=in_another_thread, args=(name,))
        thread.start()
        thread.join(10)
        assert answers[name] == [False, True], name
        assert check() is None  # this thread's own answer, after the other loop's


async def test_the_check_tells_tasks_apart(anyio_backend: object) -> None:
    """Two tasks asking in turn, one in a cancelled scope (then shielded from it) and one
    not: each gets its own answer, whichever task asked last."""
    answers: dict[str, list[bool]] = {"cancelled": [], "free": []}
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
                    answers[name].append(_cancel.pending_checkpoint() is not None)
                    steps[step + 1].set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, "cancelled", 0)
        tg.start_soon(ask, "free", 1)
        steps[0].set()
    assert answers == {"cancelled": [True, True, False, False], "free": [False] * 4}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_this_anyio_is_read_directly(anyio_backend: str) -> None:
    """anyio here is one the check was written and tested against: it reads anyio's task
    state directly.  With an anyio outside ``ANYIO_TESTED`` it would use the public API
    (as the ``public`` runs of these tests do), and this test says so."""
    assert _cancel.use_internals(True), f"anyio is not within {_cancel.ANYIO_TESTED}"
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put(1)
        assert await r.get() == 1
        assert _cancel.pending_checkpoint() is None


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


@pytest.mark.parametrize("call", CALLS)
async def test_a_deadline_that_just_passed_stops_a_call(call: str) -> None:
    """A scope whose deadline passed a moment ago, before the loop could run its timer,
    stops every call as a cancelled scope does: anyio's memory streams raise there too
    (their checkpoint lets the timer run first)."""
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        for i in range(30):
            await w.put(i)
            await w.put("waiting")
            assert await r.get() == i
            with anyio.move_on_after(0.0005) as scope:
                while anyio.current_time() < scope.deadline:  # the loop never runs meanwhile
                    pass
                await CALLS[call](w, r)
            assert scope.cancelled_caught, f"{call} went through past its deadline (try {i})"
            assert r.get_nowait() == "waiting"
            with pytest.raises(aioshmq.Empty):
                r.get_nowait()


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


def test_an_anyio_not_tested_is_read_through_its_public_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An anyio outside ``ANYIO_TESTED`` (older, or a release after the last one tested)
    is never read directly: the check then uses its public API (as the ``public`` runs of
    these tests do), whatever its internals look like."""
    first, last = _cancel.ANYIO_TESTED
    for version in ((first[0], first[1] - 1), (last[0], last[1] + 1), (last[0] + 1, 0)):
        monkeypatch.setattr(_cancel, "_anyio_version", lambda version=version: version)
        assert _cancel._task_states() is None, version
    monkeypatch.setattr(_cancel, "_anyio_version", lambda: last)
    assert _cancel._task_states() is not None


def test_a_plain_asyncio_task_is_answered_and_sees_a_scope_it_enters_later() -> None:
    """A task that no anyio code started has no anyio state until it enters a cancel scope:
    the check answers it quickly meanwhile, and sees the scope once it is entered."""
    import asyncio

    async def main() -> list[bool]:
        answers = [_cancel.pending_checkpoint() is None for _ in range(3)]
        with anyio.CancelScope() as scope:
            answers.append(_cancel.pending_checkpoint() is None)
            scope.cancel()
            answers.append(_cancel.pending_checkpoint() is None)
            with anyio.CancelScope(shield=True):
                answers.append(_cancel.pending_checkpoint() is None)
        answers.append(_cancel.pending_checkpoint() is None)
        return answers

    for on in (True, False):
        _cancel.use_internals(on)
        try:
            assert asyncio.run(main()) == [True, True, True, True, False, True, True], on
        finally:
            _cancel.use_internals(True)

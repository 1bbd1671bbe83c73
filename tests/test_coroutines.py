"""The ends' async methods are coroutine functions, written once in Python over the ring
core's primitives: they behave as Python coroutines do in every edge (re-entered while
running, awaited twice, thrown into when finished), and so do the calls that need the
Python code to be the code that runs (a serializer's own pickler, a reader closed from
inside its own call, an end inherited through fork)."""

from __future__ import annotations

import inspect
import multiprocessing
import pickle
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest

import aioshmq

pytestmark = pytest.mark.anyio

ASYNC_METHODS = {
    aioshmq.Writer: ["put", "send", "put_many", "wait_readers", "aclose"],
    aioshmq.Reader: ["get", "receive", "get_many", "__anext__", "aclose"],
    aioshmq.Lease: ["__aenter__", "__aexit__"],
    aioshmq.Reservation: ["__aenter__", "__aexit__"],
}


def test_every_async_method_of_the_ends_is_a_coroutine_function() -> None:
    """A framework that decides by ``inspect.iscoroutinefunction`` (Starlette's background
    tasks, for one) awaits every one of them; no method is replaced at import."""
    for cls, names in ASYNC_METHODS.items():
        for name in names:
            method = getattr(cls, name)
            assert inspect.iscoroutinefunction(method), f"{cls.__name__}.{name}"
            assert method.__module__.startswith("aioshmq."), f"{cls.__name__}.{name}"
    for cls in (aioshmq.Writer, aioshmq.Reader):
        for name, member in vars(cls).items():
            assert (
                inspect.isfunction(member)
                or not callable(member)
                or isinstance(member, (staticmethod, classmethod, property))
            ), f"{cls.__name__}.{name} is {type(member).__name__}, not Python code"


class Reentering:
    """An object that, while it is pickled, calls ``how`` on the coroutine putting it."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.coroutine: Coroutine[Any, Any, Any] | None = None
        self.seen: list[BaseException] = []

    def __reduce__(self) -> Any:
        assert self.coroutine is not None
        try:
            if self.how == "send":
                self.coroutine.send(None)
            elif self.how == "throw":
                self.coroutine.throw(KeyError("thrown in"))
            else:
                self.coroutine.close()
        except BaseException as exc:
            self.seen.append(exc)
            raise
        return (str, ("not reached",))


@pytest.mark.parametrize("how", ["send", "throw", "close"])
async def test_a_put_reentered_from_its_own_object_refuses_as_a_coroutine_does(how: str) -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        obj = Reentering(how)
        obj.coroutine = coroutine = w.put(obj)
        with pytest.raises(aioshmq.SerializationError) as caught:
            await coroutine
        assert isinstance(caught.value.__cause__, ValueError)
        assert "coroutine already executing" in str(caught.value.__cause__)
        assert [type(e) for e in obj.seen] == [ValueError]
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()  # nothing was published
        await w.put("after")
        assert await r.get() == "after"
        assert w.statistics().messages_put == 1


_getting: dict[str, Any] = {}


def _reenter_get(how: str) -> str:
    """Loaded in the reader: calls ``how`` on the get coroutine that is loading it."""
    if how == "close the reader":
        _getting.pop("reader").close()
        return "loaded after the close"
    coroutine = _getting.pop("coroutine")
    if how == "send":
        coroutine.send(None)
    elif how == "throw":
        coroutine.throw(KeyError("thrown in"))
    else:
        coroutine.close()
    return "not reached"


class LoadedReentering:
    def __init__(self, how: str) -> None:
        self.how = how

    def __reduce__(self) -> Any:
        return (_reenter_get, (self.how,))


@pytest.mark.parametrize("how", ["send", "throw", "close"])
async def test_a_get_reentered_from_its_own_message_refuses_as_a_coroutine_does(how: str) -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put(LoadedReentering(how))
        await w.put("next")
        _getting["coroutine"] = coroutine = r.get()
        with pytest.raises(ValueError, match="coroutine already executing"):
            await coroutine
        assert await r.get() == "next"  # the bad message was taken, no other lost
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()


@pytest.mark.parametrize("way", ["get", "async for", "get_many"])
async def test_a_reader_closed_from_inside_its_own_get_says_it_is_closed(way: str) -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put(LoadedReentering("close the reader"))
        _getting["reader"] = r
        with pytest.raises(anyio.ClosedResourceError):
            if way == "get":
                await r.get()
            elif way == "get_many":
                await r.get_many()
            else:
                async for _ in r:
                    pass
        assert r._closed


async def test_a_waiting_put_awaited_by_a_second_task_refuses_it_at_once() -> None:
    """One put waiting for room, awaited by two tasks: the second is refused at once, as
    for any coroutine, and the message is published once, by the first."""
    with aioshmq.create(capacity=4096, max_messages=1) as w, aioshmq.connect(w.name) as r:
        await w.put("first")  # the ring is full: one message at most
        coroutine = w.put("second")
        refused: list[BaseException] = []

        async def first() -> None:
            await coroutine

        async def second() -> None:
            try:
                await coroutine
            except RuntimeError as exc:
                refused.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await anyio.wait_all_tasks_blocked()
            with anyio.fail_after(5):
                await second()
            assert [str(e) for e in refused] == ["coroutine is being awaited already"]
            assert await r.get() == "first"
        assert await r.get() == "second"
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()
        assert w.statistics().messages_put == 2


async def test_a_finished_call_refuses_to_be_reused_or_thrown_into() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        for call in (w.put(1), r.get()):
            await call
            with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
                call.throw(KeyError("late"))
            with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
                await call


class Counting(aioshmq.PickleSerializer):
    """A pickle serializer whose own ``pickler`` counts the objects it pickles."""

    calls = 0

    @property
    def pickler(self) -> Callable[..., Any]:
        def dumps(obj: Any, protocol: int = 5, buffer_callback: Any = None) -> bytes:
            Counting.calls += 1
            return pickle.dumps(("counted", obj), protocol, buffer_callback=buffer_callback)

        return dumps


async def test_a_serializers_own_pickler_is_used_by_every_put() -> None:
    """A PickleSerializer subclass that overrides its public ``pickler`` is honoured by
    ``put``, ``put_nowait`` and ``put_sync`` alike, whichever core runs."""
    Counting.calls = 0
    with aioshmq.create(capacity=1 << 16, serializer=Counting()) as w:
        with aioshmq.connect(w.name) as r:
            await w.put({"a": 1})
            w.put_nowait(2)
            await anyio.to_thread.run_sync(w.put_sync, 3)
            assert [await r.get() for _ in range(3)] == [
                ("counted", {"a": 1}),
                ("counted", 2),
                ("counted", 3),
            ]
    assert Counting.calls == 3


def _put_in_a_forked_child(w: aioshmq.Writer[Any], queue: Any) -> None:
    errors = []
    for name, call in (
        ("put_sync", lambda: w.put_sync("child")),
        ("put_nowait", lambda: w.put_nowait("child")),
        ("put", lambda: anyio.run(w.put, "child")),
    ):
        try:
            call()
            errors.append((name, "no error"))
        except Exception as exc:
            errors.append((name, f"{type(exc).__name__}: {exc}"))
    queue.put(errors)


def test_a_writer_inherited_through_fork_says_to_pass_the_handle() -> None:
    """Every put of a fork-inherited writer says what a fork-inherited reader says."""
    ctx = multiprocessing.get_context("fork")
    with aioshmq.create(capacity=1 << 16) as w:
        queue = ctx.Queue()
        child = ctx.Process(target=_put_in_a_forked_child, args=(w, queue))
        child.start()
        errors = queue.get(timeout=30)
        child.join(30)
        assert child.exitcode == 0
    for name, error in errors:
        assert error.startswith("ClosedResourceError"), (name, error)
        assert "inherited through fork" in error and "handle" in error, (name, error)

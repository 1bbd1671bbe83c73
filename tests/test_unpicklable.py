"""An end or an rpc client never leaves its process: pickling one (passing it to a spawned
process, say) raises a TypeError that says what to pass instead."""

from __future__ import annotations

import pickle
from typing import Any

import anyio
import pytest
from conftest import Children

import aioshmq
from aioshmq import rpc

pytestmark = pytest.mark.anyio


def _never_runs(_end: object) -> None:
    raise AssertionError("a child started with an end it cannot have")


def _reads_one(handle: aioshmq.Handle) -> None:
    with aioshmq.connect(handle, reader=1) as reader:
        if reader.get_sync(timeout=30) != "through the handle":
            raise SystemExit("the wrong message")


WRITER_SAYS = r"cannot pickle an aioshmq Writer.*writer\.handle.*aioshmq\.connect\(handle"
READER_SAYS = r"cannot pickle an aioshmq Reader.*slot 0 .*writer\.handle.*aioshmq\.connect\("


def test_pickling_an_end_says_to_pass_the_handle() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(TypeError, match=WRITER_SAYS):
            pickle.dumps(w)
        with pytest.raises(TypeError, match=READER_SAYS):
            pickle.dumps(r)
        with pytest.raises(TypeError, match=READER_SAYS):
            pickle.dumps(r.lease())  # what holds an end says the same
        w.put_nowait("still works")  # the refusal touched nothing
        assert r.get_nowait() == "still works"


@pytest.mark.timeout(60)
def test_a_spawned_process_given_an_end_is_told_to_pass_the_handle(children: Children) -> None:
    with aioshmq.create(capacity=1 << 16, readers=2) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(TypeError, match=WRITER_SAYS):
            children.start("spawn", _never_runs, w)
        with pytest.raises(TypeError, match=READER_SAYS):
            children.start("spawn", _never_runs, r)
        assert children.procs == []  # refused before any process started

        children.start("spawn", _reads_one, w.handle)  # what the error says to do
        w.wait_readers_sync(timeout=30)
        w.put_sync("through the handle")
        assert r.get_sync(timeout=5) == "through the handle"
        assert children.join() == [0]


CLIENT_SAYS = r"cannot pickle an aioshmq\.rpc\.Client.*client\.handle.*client\.address.*rpc\.serve"


async def test_pickling_an_rpc_client_says_to_pass_its_handle_or_address() -> None:
    client = rpc.Client(1)
    try:
        with pytest.raises(TypeError, match=CLIENT_SAYS):
            pickle.dumps(client)
    finally:
        await client.aclose()


@pytest.mark.timeout(60)
async def test_a_spawned_process_given_an_rpc_client_is_told_what_to_pass(
    children: Children,
) -> None:
    async with rpc.Client(1) as client:
        with pytest.raises(TypeError, match=CLIENT_SAYS):
            await anyio.to_thread.run_sync(children.start, "spawn", _never_runs, client)
        assert children.procs == []


def _cloudpickle() -> Any:
    return pytest.importorskip("cloudpickle")


def test_cloudpickle_gets_the_same_answer() -> None:
    cloudpickle = _cloudpickle()
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(TypeError, match=WRITER_SAYS):
            cloudpickle.dumps(w)
        with pytest.raises(TypeError, match=READER_SAYS):
            cloudpickle.dumps(lambda: r.get_nowait())  # an end a closure captured


def test_a_remote_reader_says_to_connect_to_the_address() -> None:
    pytest.importorskip("zmq")
    with aioshmq.create(listen="tcp://127.0.0.1:0", insecure_loopback=True) as w:
        assert w.address is not None
        with aioshmq.connect(w.address, insecure_loopback=True, timeout=10) as r:
            with pytest.raises(TypeError) as caught:
                pickle.dumps(r)
    message = str(caught.value)
    assert f"reads the stream from {w.address}" in message, message
    assert "aioshmq.connect(ADDRESS" in message, message

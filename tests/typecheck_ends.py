"""What a user's type checker sees of the README's idioms: checked by mypy in
tests/test_typing.py, never run.  Each ``type: ignore`` marks an error mypy must report
(``--strict`` warns about an ignore that is not needed, so a lost error fails the check)."""

from __future__ import annotations

from typing import Any, assert_type

import aioshmq
from aioshmq import rpc


def sync_idiom() -> None:
    with aioshmq.create(readers=1) as writer:
        assert_type(writer, aioshmq.Writer[Any])
        writer.put_sycn(1)  # type: ignore[attr-defined]
        with aioshmq.connect(writer.name) as reader:
            assert_type(reader, aioshmq.Reader[Any])
            reader.get_snyc()  # type: ignore[attr-defined]


async def async_idiom() -> None:
    async with aioshmq.create(readers=1) as writer:
        assert_type(writer, aioshmq.Writer[Any])
        writer.put_sycn(1)  # type: ignore[attr-defined]
        async with aioshmq.connect(writer.handle) as reader:
            assert_type(reader, aioshmq.Reader[Any])
            async with reader.lease() as message:
                assert_type(message, Any)
    async with rpc.Client(workers=2) as client:
        assert_type(client, rpc.Client)
        client.sumbit("forward")  # type: ignore[attr-defined]


class Job:
    """A user's message type."""

    def __init__(self, n: int) -> None:
        self.n = n


async def typed_ends() -> None:
    with aioshmq.create(readers=1, message_type=Job) as writer:
        assert_type(writer, aioshmq.Writer[Job])
        await writer.put(Job(1))
        writer.put_sync("not a job")  # type: ignore[arg-type]
        with aioshmq.connect(writer.name, message_type=Job) as reader:
            assert_type(reader, aioshmq.Reader[Job])
            assert_type(await reader.get(), Job)
            assert_type(reader.get_nowait().n, int)
            async for job in reader:
                assert_type(job, Job)
        async with await aioshmq.aconnect(writer.name, message_type=Job) as late:
            assert_type(late, aioshmq.Reader[Job])
            assert_type(await late.get_many(), list[Job])
        untyped = aioshmq.connect(writer.name)
        assert_type(untyped, aioshmq.Reader[Any])

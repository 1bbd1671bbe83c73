"""An rpc.Client held by a pytest-asyncio async-generator fixture: its setup and teardown run
in different tasks (strict mode, asyncio and uvloop loops from the conftest hook)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
import pytest_asyncio
from conftest import Children
from test_rpc import TIMEOUT, _start_whoami

from aioshmq import rpc


@pytest_asyncio.fixture
async def served_client(children: Children) -> AsyncIterator[rpc.Client]:
    """pytest-asyncio runs this fixture's setup and teardown in different tasks."""
    async with rpc.Client(1) as client:
        await _start_whoami(children, client, "asyncio")
        yield client
    assert await anyio.to_thread.run_sync(children.join, TIMEOUT) == [0]  # a clean close


@pytest.mark.asyncio
async def test_under_pytest_asyncio_an_async_generator_fixture_holds_the_client(
    served_client: rpc.Client,
) -> None:
    with anyio.fail_after(TIMEOUT):
        assert await served_client.call("whoami") == [0]
        calls = [served_client.submit("whoami") for _ in range(10)]
        assert [await call for call in calls] == [[0]] * 10

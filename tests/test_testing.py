"""The pytest plugin: user-like suites run by pytester under pytest-asyncio, anyio and xdist;
the rpc_client helper driven directly."""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path

import anyio
import pytest
import sniffio
from test_readme import _blocks

from aioshmq import PeerDied
from aioshmq.testing import rpc_client

WORKERS = '''
class Model:
    """What a user's worker processes serve."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def forward(self, xs: list[int]) -> int:
        return self.rank + sum(xs)
'''

INI = """
[pytest]
asyncio_default_fixture_loop_scope = function
filterwarnings = error
timeout = 120
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.slow  # two xdist workers, each with its spawned rpc workers: about 5 s a mode
@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_a_pytest_asyncio_suite_with_a_session_client_and_xdist(
    pytester: pytest.Pytester, mode: str
) -> None:
    """The issue's user: a session-scoped loop, an rpc client with spawned workers held by a
    session fixture (set up in one task, torn down in another), ring fixtures, ``-n 2``."""
    pytester.makeini(INI + f"asyncio_mode = {mode}\n")
    pytester.makepyfile(workers=WORKERS)
    pytester.makeconftest(
        """
        import pytest_asyncio

        from aioshmq.testing import rpc_client
        from workers import Model


        @pytest_asyncio.fixture(scope="session", loop_scope="session")
        async def client():
            async with rpc_client(Model, workers=2, method="spawn") as c:
                yield c
        """
    )
    pytester.makepyfile(
        test_calls=textwrap.dedent(
            """
            import pytest

            pytestmark = pytest.mark.asyncio(loop_scope="session")


            @pytest.mark.parametrize("n", range(6))
            async def test_forward(client, n):
                assert await client.call("forward", [n, 1]) == [n + 1, n + 2]


            @pytest.mark.parametrize("k", range(4))
            async def test_rings_never_collide(aioshmq_ring, aioshmq_name, k):
                writer, (a, b) = aioshmq_ring(readers=2, name=aioshmq_name)
                await writer.put({"k": k})
                assert await a.get() == await b.get() == {"k": k}
            """
        ),
        test_scopes=textwrap.dedent(
            """
            import asyncio

            import pytest
            import pytest_asyncio

            import aioshmq

            @pytest_asyncio.fixture(scope="module", loop_scope="module")
            async def module_writer():
                async with aioshmq.create(capacity=4096, readers=1) as writer:
                    yield writer, asyncio.get_running_loop()


            @pytest.mark.asyncio(loop_scope="module")
            @pytest.mark.parametrize("k", range(2))
            async def test_module_loop(module_writer, k):
                writer, loop = module_writer
                assert asyncio.get_running_loop() is loop  # the fixture's, shared
                async with await aioshmq.aconnect(writer.name) as r:
                    await writer.put(k)
                    assert await r.get() == k


            @pytest.mark.asyncio(loop_scope="function")
            async def test_function_loop(aioshmq_ring):
                writer, (r,) = aioshmq_ring()
                await writer.put("own loop")
                assert await r.get() == "own loop"
            """
        ),
    )
    result = _run(pytester, "-n", "2", "--aioshmq-leaks")
    result.assert_outcomes(passed=13)


def test_anyio_backends_and_the_process_reaper(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(workers=WORKERS)
    pytester.makepyfile(
        test_anyio=textwrap.dedent(
            """
            import functools

            import anyio
            import pytest

            import aioshmq

            pytestmark = pytest.mark.anyio


            @pytest.fixture(
                params=[
                    "asyncio",
                    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
                    "trio",
                ]
            )
            def anyio_backend(request):
                return request.param


            async def test_the_loop_is_the_one_asked_for(anyio_backend):
                import sniffio

                if anyio_backend == "trio":
                    assert sniffio.current_async_library() == "trio"
                else:
                    import asyncio

                    module = type(asyncio.get_running_loop()).__module__
                    assert module.startswith("uvloop") == isinstance(anyio_backend, tuple)


            def child(name):
                with aioshmq.connect(name, wait=True) as r:
                    assert r.get_sync(timeout=30) == "hello"


            async def test_a_child_reads(aioshmq_ring, aioshmq_processes):
                writer, _ = aioshmq_ring(connect=False)
                start = functools.partial(
                    aioshmq_processes.start, child, writer.name, method="forkserver"
                )
                await anyio.to_thread.run_sync(start)
                await writer.wait_readers()
                await writer.put("hello")
                assert await anyio.to_thread.run_sync(aioshmq_processes.join) == [0]


            async def test_a_failing_test_still_reaps(aioshmq_processes):
                import time

                proc = aioshmq_processes.start(time.sleep, 600, method="spawn")
                assert proc.is_alive()
                raise AssertionError("failed on purpose")
            """
        )
    )
    result = _run(pytester, "-v")
    result.assert_outcomes(passed=6, failed=3)
    result.stdout.fnmatch_lines(["*test_a_child_reads?uvloop? PASSED*"])
    result.stdout.fnmatch_lines(["*failed on purpose*"])
    assert result.duration < 120  # the sleeping children were killed, not waited for


@pytest.mark.slow  # three pytest runs, about 5 s
def test_the_leak_check_is_opt_in_and_names_the_leak(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(
        test_leaky=textwrap.dedent(
            """
            import pytest

            import aioshmq

            kept = []


            def test_leaves_a_writer_open():
                kept.append(aioshmq.create(capacity=1 << 16))


            def test_closes_what_it_opens():
                with aioshmq.create(capacity=1 << 16) as w:
                    w.drop_reader(0)


            @pytest.mark.aioshmq_leaks
            def test_marked_and_leaky():
                kept.append(aioshmq.create(capacity=1 << 16))


            def test_cleanup():
                for w in kept:
                    w.close()
            """
        )
    )
    result = _run(pytester)
    # Only the marked one is checked; a leak fails its teardown (an error, in pytest's words).
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["ERROR test_leaky.py::test_marked_and_leaky - Failed: aioshmq*"])
    result = _run(pytester, "--aioshmq-leaks")
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_leaves_a_writer_open*", "*ring memory still held*"]
    )
    pytester.makeini(INI + "aioshmq_leaks = true\n")
    _run(pytester).assert_outcomes(passed=4, errors=2)


# -- the rpc_client context manager, driven directly -------------------------------------------

START = "forkserver"  # the workers' start method in these tests: quick after the first


class AsyncModel:
    """A target with an async method (and a plain one), as a scheduler's workers serve."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    async def slow(self, seconds: float) -> int:
        await anyio.sleep(seconds)
        return self.rank

    async def loop(self) -> str:
        """The event loop this worker serves on."""
        name = sniffio.current_async_library()
        if name == "asyncio" and "uvloop" in type(asyncio.get_running_loop()).__module__:
            return "uvloop"
        return name

    def forward(self, x: int) -> int:
        return self.rank + x


class PlainModel:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def forward(self, x: int) -> int:
        return self.rank + x


def broken_model(rank: int) -> object:
    raise RuntimeError(f"no model for rank {rank}")


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_rpc_client_serves_async_methods_by_default(anyio_backend: object) -> None:
    with anyio.fail_after(30):
        async with rpc_client(AsyncModel, workers=2, method=START) as client:
            assert await client.call("slow", 0.0) == [0, 1]
            assert await client.call("forward", 10) == [10, 11]


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_rpc_client_serve_chooses_how_the_workers_serve(anyio_backend: object) -> None:
    with anyio.fail_after(30):
        async with rpc_client(PlainModel, workers=1, method=START, serve="async") as client:
            assert await client.call("forward", 1) == [1]
        async with rpc_client(AsyncModel, workers=1, method=START, serve="sync") as client:
            assert await client.call("forward", 1) == [1]
            with pytest.raises(Exception, match="'slow' is async"):
                await client.call("slow", 0.0)
    with pytest.raises(ValueError, match="serve must be 'auto', 'sync' or 'async', not 'trio'"):
        async with rpc_client(PlainModel, workers=1, method=START, serve="trio"):
            pass


@pytest.mark.anyio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_rpc_client_runs_async_workers_on_the_event_loop_asked_for(
    anyio_backend: object,
) -> None:
    with anyio.fail_after(60):
        for backend in ("asyncio", "uvloop", "trio"):
            async with rpc_client(
                AsyncModel, workers=2, method=START, worker_backend=backend
            ) as client:
                assert await client.call("loop") == [backend, backend]
    with pytest.raises(ValueError, match=r"worker_backend must be .* not 'curio'"):
        async with rpc_client(AsyncModel, workers=1, method=START, worker_backend="curio"):
            pass


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_rpc_client_fails_at_once_naming_the_exit_codes_of_workers_that_died(
    anyio_backend: object,
) -> None:
    """Both workers die before attaching (their target cannot be made): the client fails
    within seconds, not after its attach timeout, and names their exit codes."""
    start = time.monotonic()
    with anyio.fail_after(30), pytest.raises(PeerDied) as info:
        async with rpc_client(broken_model, workers=2, method=START):
            raise AssertionError("handed out a client whose workers died")
    assert time.monotonic() - start < 20
    assert "exited with code 1 before attaching" in str(info.value)
    assert info.value.role == "worker"


@pytest.mark.timeout(120)
def test_the_leak_check_blames_a_test_only_for_the_ends_it_opened(
    pytester: pytest.Pytester,
) -> None:
    """An unmarked test leaks an end in a reference cycle, which the garbage collector finds
    during the next, marked test: that test passes, and the warning about the end reaches
    pytest's summary as it would without the check; a marked test that leaks in a cycle of
    its own still fails."""
    ini = INI.replace(
        "filterwarnings = error", "filterwarnings =\n    error\n    default::ResourceWarning"
    )
    pytester.makeini(ini)
    pytester.makepyfile(
        test_cycles=textwrap.dedent(
            """
            import gc

            import pytest

            import aioshmq


            class Holder:
                def __init__(self):
                    self.me = self  # a reference cycle: only the collector frees it
                    self.writer = aioshmq.create(capacity=1 << 16)


            def test_unmarked_leaks_in_a_cycle():
                gc.disable()  # until the next test: the collector runs there
                Holder()


            @pytest.mark.aioshmq_leaks
            def test_marked_and_clean():
                gc.enable()
                assert gc.collect()  # what a collection during this test would find
                with aioshmq.create(capacity=1 << 16) as w:
                    w.drop_reader(0)


            @pytest.mark.aioshmq_leaks
            def test_marked_and_leaks_in_a_cycle():
                Holder()
            """
        )
    )
    result = _run(pytester, "-v")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*test_marked_and_clean PASSED*",
            "*ERROR at teardown of test_marked_and_leaks_in_a_cycle*",
            "*aioshmq ends collected unclosed: [[]*unclosed <aioshmq.Writer*",
            "*warnings summary*",
            "*test_marked_and_clean*",
            "*ResourceWarning: unclosed <aioshmq.Writer*",
        ]
    )


# -- the event-loop examples of docs/testing.md, run as written -------------------------------

DOCS = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


def _doc_files(*headings: str) -> dict[str, str]:
    """The files docs/testing.md shows under these headings: each python block whose first
    line names one (``# conftest.py``); blocks naming the same file are joined."""
    files: dict[str, str] = {}
    for block in _blocks(DOCS.read_text(encoding="utf-8")):
        first = block.text.partition("\n")[0]
        if block.heading in headings and block.info == "python" and first.startswith("# "):
            name = first[2:].strip()
            files[name] = files.get(name, "") + block.text
    assert files and all(name.endswith(".py") for name in files), f"{headings}: {files}"
    return files


def _write(pytester: pytest.Pytester, files: dict[str, str]) -> None:
    for name, text in files.items():
        pytester.path.joinpath(name).write_text(text, encoding="utf-8")


ON_UVLOOP = """
import asyncio

import pytest
import sniffio


@pytest.mark.asyncio(loop_scope="session")
async def test_the_session_loop_is_uvloop(client):
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_the_docs_session_client_under_pytest_asyncio(
    pytester: pytest.Pytester, mode: str, loop: str
) -> None:
    """The docs' session-scoped client (an async target, spawned workers) and its tests on
    the session's loop, on asyncio or (the docs' hook) uvloop, warnings being errors."""
    files = _doc_files("pytest-asyncio")
    expected = 1
    if loop == "uvloop":
        uvloop_files = _doc_files("uvloop under pytest-asyncio")
        files["conftest.py"] += uvloop_files.pop("conftest.py")
        files.update(uvloop_files)
        files["test_loop.py"] = ON_UVLOOP
        expected += 1
    _write(pytester, files)
    pytester.makeini(INI + f"asyncio_mode = {mode}\n")
    result = _run(pytester, "-v")
    result.assert_outcomes(passed=expected)


@pytest.mark.timeout(180)
def test_the_docs_session_client_under_anyio_on_each_backend(pytester: pytest.Pytester) -> None:
    """The docs' session-scoped client under anyio's plugin, once per backend: asyncio,
    uvloop and trio, each test on the loop asked for."""
    _write(pytester, _doc_files("anyio's plugin"))
    pytester.makepyfile(
        test_loop="""
        import pytest
        import sniffio

        pytestmark = pytest.mark.anyio


        async def test_the_loop_is_the_one_asked_for(client, anyio_backend):
            if anyio_backend == "trio":
                assert sniffio.current_async_library() == "trio"
            else:
                import asyncio

                module = type(asyncio.get_running_loop()).__module__
                assert module.startswith("uvloop") == isinstance(anyio_backend, tuple)
        """
    )
    pytester.makeini(INI)
    result = _run(pytester, "-v")
    result.assert_outcomes(passed=6)
    for backend in ("asyncio", "uvloop", "trio"):
        result.stdout.fnmatch_lines([f"*test_model.py::test_forward?{backend}? PASSED*"])

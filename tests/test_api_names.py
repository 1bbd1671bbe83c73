"""Users see only public names: in the signatures and docstrings of the public API, on the
API page the documentation builds from them, and in the errors they catch; and the README's
API list names every public name and every option of the calls that open a ring."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import pickle
import re
import subprocess
import sys
import traceback
import typing
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest

import aioshmq
import aioshmq.rpc
import aioshmq.testing

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
# One part of a name that starts with a single underscore ("_spin.Spin",
# "aioshmq._errors._Busy"); dunders ("__aexit__") are Python's own.  docs/conf.py has the same.
PRIVATE = re.compile(r"(?<!\w)_(?!_)\w+")


def _made_for_you() -> list[str]:
    """docs/conf.py's MADE_FOR_YOU: the classes whose constructors the API page hides."""
    tree = ast.parse((ROOT / "docs" / "conf.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "MADE_FOR_YOU" for target in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError("docs/conf.py has no MADE_FOR_YOU")


def _namespaces() -> list[ModuleType]:
    spaces: list[ModuleType] = [aioshmq, aioshmq.rpc, aioshmq.testing]
    if importlib.util.find_spec("zmq") is not None:  # aioshmq.remote's names need pyzmq
        spaces.append(aioshmq.remote)
    return spaces


def _signatures(function: Any) -> Iterator[str]:
    """A callable's signature as written and, where its annotations resolve, as evaluated
    (a type alias then shows what it stands for)."""
    try:
        yield str(inspect.signature(function))
    except (TypeError, ValueError):  # a builtin's, or an exception's without one of its own
        return
    try:
        yield str(inspect.signature(function, eval_str=True))
    except Exception:  # a name imported only for type checkers
        pass


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public attributes of ``cls`` that aioshmq defines (not anyio's, not object's)."""
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next(c for c in cls.__mro__ if name in vars(c))
        if not owner.__module__.startswith("aioshmq"):
            continue
        value = inspect.getattr_static(cls, name)
        if isinstance(value, property):
            value = value.fget
        elif isinstance(value, staticmethod | classmethod):
            value = value.__func__
        yield name, value


def _public_texts() -> Iterator[tuple[str, str]]:
    """(where, text) for every signature and docstring of the public API a user reads."""
    made_for_you = set(_made_for_you())
    for space in _namespaces():
        yield space.__name__, inspect.getdoc(space) or ""
        for name in space.__all__:
            obj = getattr(space, name)
            where = f"{space.__name__}.{name}"
            if isinstance(obj, ModuleType):
                continue  # aioshmq.rpc and aioshmq.remote: namespaces of their own, above
            yield where, inspect.getdoc(obj) or ""
            if inspect.isclass(obj):
                if where not in made_for_you:
                    for text in _signatures(obj):
                        yield f"{where}()", text
                for member, value in _members(obj):
                    yield f"{where}.{member}", inspect.getdoc(value) or ""
                    if callable(value):
                        for text in _signatures(value):
                            yield f"{where}.{member}", text
            elif callable(obj) and not hasattr(obj, "__origin__"):  # not a type alias
                for text in _signatures(obj):
                    yield where, text


def test_public_signatures_and_docstrings_name_no_private_name() -> None:
    found = {
        where: PRIVATE.findall(text) for where, text in _public_texts() if PRIVATE.search(text)
    }
    assert found == {}


def _classes_in(annotation: Any) -> Iterator[type]:
    if isinstance(annotation, type):
        yield annotation
    for part in (typing.get_origin(annotation), *typing.get_args(annotation)):
        if part is not None:
            yield from _classes_in(part)


def test_public_annotations_name_only_classes_users_can_import() -> None:
    """A class of aioshmq's in a public signature (``serializer: ...`` of ``create``, say)
    is one a namespace exports: users can name it in their own annotations, and read it on
    the API page.  The constructors the API page hides are not public."""
    exported = {id(getattr(space, name)) for space in _namespaces() for name in space.__all__}
    hidden = {f"{path}.__init__" for path in _made_for_you()}
    unexported: dict[str, set[str]] = {}
    for space in _namespaces():
        for name in space.__all__:
            obj = getattr(space, name)
            if isinstance(obj, ModuleType):
                continue
            where = f"{space.__name__}.{name}"
            calls = [(where, obj)] if not inspect.isclass(obj) else []
            if inspect.isclass(obj):
                calls = [(f"{where}.__init__", vars(obj).get("__init__"))]
                calls += [(f"{where}.{member}", value) for member, value in _members(obj)]
            for at, call in calls:
                if at in hidden or not callable(call):
                    continue
                try:
                    hints = typing.get_type_hints(call)
                except Exception:  # an exception class's, or a name only for type checkers
                    continue
                for hint in hints.values():
                    for cls in _classes_in(hint):
                        if cls.__module__.startswith("aioshmq") and id(cls) not in exported:
                            unexported.setdefault(f"{cls.__module__}.{cls.__qualname__}", set())
                            unexported[f"{cls.__module__}.{cls.__qualname__}"].add(at)
    assert unexported == {}


def test_the_classes_the_api_page_shows_without_a_constructor_exist() -> None:
    for path in _made_for_you():
        space, _, name = path.rpartition(".")
        assert inspect.isclass(getattr(sys.modules[space], name)), path


@pytest.mark.timeout(120)
def test_the_api_page_names_no_private_name_and_no_internal_constructor(tmp_path: Path) -> None:
    """The page as sphinx builds it (as text): docs/conf.py fails the build (-W) on a private
    name in a signature or docstring, and hides the constructors of MADE_FOR_YOU."""
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "text",
            "docs",
            tmp_path,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert build.returncode == 0, build.stderr
    page = (tmp_path / "api.txt").read_text()
    assert PRIVATE.findall(page) == []
    for path in _made_for_you():
        (line,) = [line for line in page.splitlines() if re.match(rf"class {path}\b", line)]
        assert line == f"class {path}", line  # no constructor: create() and so on make them


def test_the_readme_api_list_names_every_public_name_and_option() -> None:
    readme = (ROOT / "README.md").read_text()
    api = readme[readme.index("\n## API\n") :]
    api = api[: api.index("\n## ", 1)]
    for name in aioshmq.__all__:
        full = f"aioshmq.{name}" if isinstance(getattr(aioshmq, name), ModuleType) else name
        assert re.search(rf"`{full}[`(]", api), f"the README's API list lacks {full}"
    for call in (aioshmq.create, aioshmq.connect):
        (line,) = [line for line in api.splitlines() if line.startswith(f"- `{call.__name__}(")]
        for parameter in inspect.signature(call).parameters:
            assert re.search(rf"[(, ]{parameter}[=,)]", line), (call.__name__, parameter)
    for cls, extra in ((aioshmq.Writer, set()), (aioshmq.Reader, {"async for"})):
        (line,) = [line for line in api.splitlines() if line.startswith(f"- `{cls.__name__}`:")]
        listed = set(re.findall(r"`([^`]+)`", line.split(":", 1)[1]))
        assert listed == {name for name, _ in _members(cls)} | extra, cls.__name__


def _busy_calls() -> Iterator[tuple[str, Any]]:
    """Each way a call finds what it needs held, as (what, a call raising it)."""
    w = aioshmq.create(capacity=1 << 16)
    r = aioshmq.connect(w.name, 0)
    try:
        yield "a slot held by a live reader", lambda: aioshmq.connect(w.name, 0)
        yield "dropping a slot a live reader holds", lambda: w.drop_reader(0)
        reservation = w.reserve(8)
        reservation.__enter__()
        try:
            yield "a put while a reservation is open", lambda: w.put_nowait(1)
        finally:
            reservation.__exit__(None, None, None)
    finally:
        r.close()
        w.close(linger=0)


def test_a_busy_slot_or_end_raises_a_public_class_that_anyio_code_catches() -> None:
    for what, call in _busy_calls():
        with pytest.raises(anyio.BusyResourceError) as caught:
            call()
        exc = caught.value
        assert type(exc) is aioshmq.Busy, what
        assert "Busy" in aioshmq.__all__
        (shown,) = traceback.format_exception_only(exc)
        assert shown.startswith("aioshmq.base.errors.Busy: "), shown
        assert PRIVATE.findall(shown.split(":")[0]) == [], shown
        again = pickle.loads(pickle.dumps(exc))  # as a worker's error reaches an rpc client
        assert type(again) is aioshmq.Busy and str(again) == str(exc), what


async def test_a_blocking_call_beside_an_async_one_raises_busy() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name, spin=0) as r:
        async with anyio.create_task_group() as tg:
            tg.start_soon(r.get)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(aioshmq.Busy, match="an async get is under way"):
                await anyio.to_thread.run_sync(r.get_sync, 1)
            await w.put("done")

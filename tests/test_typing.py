"""The types users get: every ``__enter__``/``__aenter__`` returns its own type, and ends made
with ``message_type=`` carry it, so a typo in the README's idioms or a put of the wrong type
is a type error (checked with mypy, and with pyright, on tests/typecheck_ends.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _mypy(path: Path, cache: Path) -> tuple[str, int]:
    from mypy import api

    out, err, status = api.run(
        ["--strict", "--no-error-summary", "--cache-dir", str(cache), str(path)]
    )
    return out + err, status


@pytest.mark.slow  # about 15 s of mypy
def test_context_managers_return_their_own_type(tmp_path: Path) -> None:
    out, status = _mypy(HERE / "typecheck_ends.py", tmp_path / "cache")
    assert status == 0, out
    # The check can fail: the same idioms without their expected-error marks are errors.
    bare = tmp_path / "bare.py"
    text = (HERE / "typecheck_ends.py").read_text()
    bare.write_text(re.sub(r"  # type: ignore\[[a-z-]+\]", "", text))
    out, status = _mypy(bare, tmp_path / "cache")
    assert status == 1
    for typo in ("put_sycn", "get_snyc", "sumbit"):
        assert f'has no attribute "{typo}"' in out, out
    assert 'incompatible type "str"; expected "Job"' in out, out
    assert out.count("put_sycn") == 2, out  # in the sync and the async idiom alike
    assert os.fspath(bare) in out


def _pyright(path: Path, tmp: Path) -> tuple[str, int]:
    """basedpyright (pyright's checker, with node from a wheel) in pyright's strict mode."""
    import json
    import shutil
    import subprocess
    import sys

    exe = shutil.which("basedpyright", path=str(Path(sys.executable).parent))
    if exe is None:
        raise AssertionError("basedpyright is missing: pip install -e '.[test]' installs it")
    config = tmp / "pyrightconfig.json"
    config.write_text(
        json.dumps(
            {
                "typeCheckingMode": "strict",
                "pythonVersion": "3.11",
                "reportUnnecessaryTypeIgnoreComment": "error",
                "extraPaths": [str(HERE.parent)],
            }
        )
    )
    run = subprocess.run(
        [exe, "-p", str(config), "--pythonpath", sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return run.stdout + run.stderr, run.returncode


@pytest.mark.slow  # about 20 s: node starts and pyright reads anyio, trio, numpy...
def test_pyright_sees_the_same_types(tmp_path: Path) -> None:
    checked = tmp_path / "typecheck_ends.py"
    checked.write_text((HERE / "typecheck_ends.py").read_text())
    out, status = _pyright(checked, tmp_path)
    assert status == 0 and "0 errors" in out, out
    bare = tmp_path / "bare.py"
    text = checked.read_text()
    bare.write_text(re.sub(r"  # type: ignore\[[a-z-]+\]", "", text))
    out, status = _pyright(bare, tmp_path)
    assert status == 1, out
    for typo in ("put_sycn", "get_snyc", "sumbit"):
        assert f'Cannot access attribute "{typo}"' in out, out
    assert '"Literal[\'not a job\']" is not assignable to "Job"' in out, out
    # Errors on the marked lines only, and on each of them.
    marked = {i for i, line in enumerate(text.splitlines(), 1) if "# type: ignore[" in line}
    found = {int(n) for n in re.findall(r"bare\.py:(\d+):\d+ - error", out)}
    assert found == marked, out


@pytest.mark.slow  # mypy and pyright over the examples: about 30 s
def test_the_examples_are_clean_under_both_checkers(tmp_path: Path) -> None:
    examples = sorted((HERE.parent / "examples").glob("*.py"))
    assert len(examples) >= 3
    for example in examples:
        out, status = _mypy(example, tmp_path / "cache")
        assert status == 0, out
    out, status = _pyright(HERE.parent / "examples", tmp_path)
    assert status == 0 and "0 errors" in out, out


@pytest.mark.slow  # about 15 s of mypy
def test_the_compiled_core_is_what_its_stub_says() -> None:
    """mypy checks both cores against ring/core.py's Protocols, the compiled one through its
    stub: stubtest holds the stub to the built module (names, signatures, members)."""
    import subprocess
    import sys

    import aioshmq

    if aioshmq.CORE != "compiled":
        pytest.skip("the compiled core is not in use")
    done = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "aioshmq.ring.compiled"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr

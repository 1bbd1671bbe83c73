"""The types users get: every ``__enter__``/``__aenter__`` returns its own type, so a typo in
the README's idioms is a type error (checked with mypy on tests/typecheck_ends.py)."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).parent


def _mypy(path: Path, cache: Path) -> tuple[str, int]:
    from mypy import api

    out, err, status = api.run(
        ["--strict", "--no-error-summary", "--cache-dir", str(cache), str(path)]
    )
    return out + err, status


def test_context_managers_return_their_own_type(tmp_path: Path) -> None:
    out, status = _mypy(HERE / "typecheck_ends.py", tmp_path / "cache")
    assert status == 0, out
    # The check can fail: the same idioms without their expected-error marks are errors.
    bare = tmp_path / "bare.py"
    text = (HERE / "typecheck_ends.py").read_text()
    bare.write_text(text.replace("  # type: ignore[attr-defined]", ""))
    out, status = _mypy(bare, tmp_path / "cache")
    assert status == 1
    for typo in ("put_sycn", "get_snyc", "sumbit"):
        assert f'has no attribute "{typo}"' in out, out
    assert out.count("put_sycn") == 2, out  # in the sync and the async idiom alike
    assert os.fspath(bare) in out

"""The mutations of tests/mutations.py: every row names code that exists, and (slow tier)
the test beside it fails once that code is taken out."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mutations import MUTATIONS, Mutation

import aioshmq

ROOT = Path(__file__).parent.parent
HANG = 180  # seconds after which a mutant's test run counts as hung (a hang is caught)


def test_every_mutation_names_code_that_exists_once_and_a_test() -> None:
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    for m in MUTATIONS:
        source = (ROOT / m.path).read_text()
        assert source.count(m.old) == 1, f"{m.name}: found {source.count(m.old)} times"
        test_file, _, test = m.test.partition("::")
        assert re.search(rf"^(async )?def {test}\(", (ROOT / test_file).read_text(), re.M), m.name


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package and its tests (the compiled core included, as built)."""
    if os.environ.get("AIOSHMQ_PURE", "") not in ("", "0"):
        pytest.skip("run once, with the compiled core beside the pure one")
    if aioshmq.CORE != "compiled":
        pytest.skip("the compiled core is not built")
    copy = tmp_path_factory.mktemp("mutations")
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.egg-info")
    for part in ("aioshmq", "tests", "benchmarks"):
        shutil.copytree(ROOT / part, copy / part, ignore=ignore)
    for part in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / part, copy / part)
    return copy


@pytest.mark.slow
@pytest.mark.timeout(HANG * 2 + 120)
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_the_test_of_each_mutation_catches_it(tree: Path, mutation: Mutation) -> None:
    path = tree / mutation.path
    original = path.read_text()
    path.write_text(original.replace(mutation.old, mutation.new))
    try:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        if mutation.pure:
            env["AIOSHMQ_PURE"] = "1"
        if mutation.path.endswith(".c"):
            subprocess.run(
                [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                cwd=tree,
                env={**env, "AIOSHMQ_REQUIRE_CORE": "1"},
                capture_output=True,
                check=True,
                timeout=HANG,
            )
        try:
            done = subprocess.run(
                [
                    *(sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"),
                    *("--timeout", "60", mutation.test),
                ],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                timeout=HANG,
            )
            caught, said = done.returncode not in (0, 5), done.stdout[-2000:]
        except subprocess.TimeoutExpired:  # a wait turned into a hang: caught too
            caught, said = True, f"hung for {HANG} s"
        assert caught, f"{mutation.name}: {mutation.test} passed with the mutant\n{said}"
    finally:
        path.write_text(original)
        if mutation.path.endswith(".c"):  # the copy's core as it was, for the next rows
            subprocess.run(
                [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                cwd=tree,
                capture_output=True,
                check=True,
                timeout=HANG,
            )
        for leftover in os.listdir("/dev/shm"):  # what the /dev/shm mutation leaves behind
            if leftover.startswith("aioshmq-") and mutation.name.startswith("nothing survives"):
                os.unlink(os.path.join("/dev/shm", leftover))

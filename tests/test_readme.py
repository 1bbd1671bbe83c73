"""Every Python snippet in README.md and in the documentation's pages (docs/*.md) runs as
written.

Each fenced block whose info string is ``python`` (or ``py``, ``python3``) is saved as a
script on its own and run by this interpreter in a fresh process, in an empty temporary
directory, with a time limit; it must exit with status 0 and print no traceback and no
warning (a reader process that crashes prints a traceback even when the snippet's own
process exits cleanly).  Blocks are found anew on every run, whatever the README and the
pages hold: nothing here names a snippet or a page.

Expected output: a fenced block with the info string ``text`` placed right after a Python
block (only blank lines between the two) is what that snippet prints on its standard output.
It is compared line by line, trailing spaces ignored; ``...`` in it stands for any text,
including none or several lines (doctest's ELLIPSIS), for the parts that change from run to
run (pids, timings, statistics, the order of lines printed by several processes)::

    ```python
    print("ring", 1 + 1, time.time())
    ```

    ```text
    ring 2 ...
    ```

A snippet that imports a package which is not installed fails (it is never skipped),
naming the snippet and the package: the test extra installs every package the README and
the pages use.
"""

from __future__ import annotations

import ast
import doctest
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import run_in_session

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))  # the documentation's own pages
PYTHON_INFO = {"python", "py", "python3"}
OUTPUT_INFO = "text"
TIMEOUT = 60.0  # per snippet; the Quick start and RPC snippets spawn processes
FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\s`]*)")


@dataclass(frozen=True)
class Block:
    info: str
    line: int  # of the opening fence, 1-based
    heading: str
    text: str
    follows: int  # the index of the block before it when only blank lines separate them, or -1


@dataclass(frozen=True)
class Snippet:
    code: Block
    output: Block | None
    source: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.source} line {self.code.line} (under {self.code.heading!r})"


def _blocks(markdown: str) -> list[Block]:
    """The fenced blocks of ``markdown``, in order, with the heading each stands under."""
    blocks: list[Block] = []
    heading = "the top"
    lines = markdown.splitlines()
    i = 0
    last_end = -2  # the line index of the previous block's closing fence
    while i < len(lines):
        line = lines[i]
        match = FENCE.match(line)
        if match is None:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            i += 1
            continue
        fence = match["fence"]
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            closing = FENCE.match(lines[i])  # no info string, the same character, as long
            if (
                closing
                and not closing["info"]
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
            ):
                break
            body.append(lines[i])
            i += 1
        between = lines[last_end + 1 : start] if last_end >= 0 else ["x"]
        follows = len(blocks) - 1 if blocks and not any(s.strip() for s in between) else -1
        blocks.append(
            Block(match["info"].lower(), start + 1, heading, "\n".join(body) + "\n", follows)
        )
        last_end = i
        i += 1
    return blocks


def _snippets(path: Path = README) -> list[Snippet]:
    blocks = _blocks(path.read_text(encoding="utf-8"))
    snippets = []
    for n, block in enumerate(blocks):
        if block.info not in PYTHON_INFO:
            continue
        after = blocks[n + 1] if n + 1 < len(blocks) else None
        output = after if after and after.info == OUTPUT_INFO and after.follows == n else None
        snippets.append(Snippet(block, output, str(path.relative_to(ROOT))))
    return snippets


def _id(snippet: Snippet) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", snippet.code.heading.lower()).strip("-")
    prefix = "" if snippet.source == "README.md" else Path(snippet.source).stem + "-"
    return f"{prefix}{slug}-line{snippet.code.line}"


# The README's snippets, then every page's: a page owns its text, snippets included.
SNIPPETS = _snippets() + [snippet for page in PAGES for snippet in _snippets(page)]


def test_the_readme_has_python_snippets() -> None:
    """The parametrized test below is not silently empty."""
    assert SNIPPETS, "no ```python block found in README.md or docs/*.md"
    assert PAGES, "no page found in docs/"


def test_block_parser() -> None:
    """Fences, headings and the output block that belongs to a snippet."""
    text = (
        "# Title\n\n## Use\n\n```python\nprint(1)\n```\n\n```text\n1\n```\n\n"
        "Prose.\n\n```text\nnot an output\n```\n\n````python\n```\nx = 1\n````\n"
    )
    blocks = _blocks(text)
    assert [(b.info, b.heading, b.text) for b in blocks] == [
        ("python", "Use", "print(1)\n"),
        ("text", "Use", "1\n"),
        ("text", "Use", "not an output\n"),
        ("python", "Use", "```\nx = 1\n"),
    ]
    assert [b.follows for b in blocks] == [-1, 0, -1, 2]  # only a text block is an output
    assert [b.line for b in blocks] == [5, 9, 15, 19]


def _imports(code: str) -> list[str]:
    """The top-level packages the snippet imports (a snippet that does not parse has none:
    running it reports the syntax error)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return sorted(set(names))


WARNING = re.compile(r"\b\w*Warning: ")  # as the warnings module prints them


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[_id(s) for s in SNIPPETS])
def test_readme_snippet_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    code = snippet.code.text
    missing = [name for name in _imports(code) if importlib.util.find_spec(name) is None]
    assert not missing, (
        f"the snippet at {snippet.where} imports {', '.join(missing)}, not installed here: "
        "add it to the test extra in pyproject.toml"
    )
    script = tmp_path / f"snippet_line{snippet.code.line}.py"
    script.write_text(code, encoding="utf-8")
    proc = run_in_session([sys.executable, str(script)], tmp_path, TIMEOUT)
    shown = (
        f"the snippet at {snippet.where}\n{code}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert proc.returncode == 0, f"exit status {proc.returncode} from {shown}"
    assert "Traceback (most recent call last)" not in proc.stderr, f"a traceback from {shown}"
    assert not WARNING.search(proc.stderr), f"a warning printed by {shown}"
    if snippet.output is not None:
        want = "\n".join(line.rstrip() for line in snippet.output.text.splitlines()) + "\n"
        got = "\n".join(line.rstrip() for line in proc.stdout.splitlines()) + "\n"
        checker = doctest.OutputChecker()
        flags = doctest.ELLIPSIS
        if not checker.check_output(want, got, flags):
            example = doctest.Example(code, want)
            diff = checker.output_difference(example, got, flags | doctest.REPORT_UDIFF)
            pytest.fail(
                f"the snippet at {snippet.where} printed other than its ```text block at "
                f"line {snippet.output.line}:\n{diff}"
            )

"""``python -m benchmarks page RESULTS.json [RESULTS-PURE.json] > benchmarks.md``: the one page
of current figures, written from a full run's results (and the pure core's run, if given).

The page says which files it was written from; a test writes it again from them and finds the
committed page, so the page never drifts from its data.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._which import CHECKOUT
from .report import LEGEND, cell, ordered
from .results import Result, load

DEPENDENCIES = (
    "anyio",
    "numpy",
    "pyzmq",
    "faster-fifo",
    "iceoryx2",
    "vllm",
    "torch",
    "uvloop",
    "trio",
)


def _results(data: Mapping[str, Any]) -> list[Result]:
    return [Result(**r) for r in data["results"]]


def _md(text: str) -> str:
    """``text`` as it reads in a table cell or a list item (``<pid>`` is no tag)."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def _table(rows: Sequence[Result]) -> list[str]:
    """A markdown table: a row per (case, metric), a column per transport, aioshmq first."""
    peers = ordered(["aioshmq", *(r.peer for r in rows)])
    keys = ordered([(r.case, r.metric) for r in rows])
    by = {(r.case, r.metric, r.peer): r for r in rows}
    lines = [
        "| " + " | ".join(["case", "metric", *peers]) + " |",
        "| --- | --- |" + " ---: |" * len(peers),
    ]
    for case, metric in keys:
        base = by.get((case, metric, "aioshmq"))
        unit = next(r.unit for r in rows if r.case == case and r.metric == metric)
        cells = [case, f"{metric} ({unit})"]
        for peer in peers:
            result = by.get((case, metric, peer))
            if result is None:
                cells.append("")
            else:
                cells.append(cell(result, None if peer == "aioshmq" else base))
        lines.append("| " + " | ".join(_md(cell) for cell in cells) + " |")
    return lines


def _hows(rows: Sequence[Result]) -> list[str]:
    """How each transport was driven, naming the cases only where that differs between them."""
    by_peer: dict[str, dict[str, list[str]]] = {}
    for r in rows:
        if r.params.get("how") and r.value is not None:
            cases = by_peer.setdefault(r.peer, {}).setdefault(str(r.params["how"]), [])
            if r.case not in cases:
                cases.append(r.case)
    lines = []
    for peer, hows in by_peer.items():
        for how, cases in hows.items():
            where = "" if len(hows) == 1 else f" ({'; '.join(cases)})"
            lines.append(_md(f"- {peer}{where}: {how}"))
    return lines


def _failures(rows: Sequence[Result]) -> list[str]:
    return ordered(
        [
            _md(f"- failed: {r.peer}, {r.case}: {r.note}")
            for r in rows
            if r.note.startswith("failed")
        ]
    )


def _scenarios(data: Mapping[str, Any], level: str, hows: bool) -> list[str]:
    results = _results(data)
    out: list[str] = []
    for scenario in ordered([r.scenario for r in results]):
        rows = [r for r in results if r.scenario == scenario]
        title = data["titles"].get(scenario, scenario)
        out += ["", f"{level} {scenario}: {_md(title)}", "", *_table(rows)]
        notes = (_hows(rows) if hows else []) + _failures(rows)
        if notes:
            out += ["", *notes]
    return out


def _versions(machine: Mapping[str, Any]) -> str:
    versions = machine["versions"]
    there = [f"{dist} {versions[dist]}" for dist in DEPENDENCIES if versions.get(dist)]
    absent = [dist for dist in DEPENDENCIES if dist in versions and not versions[dist]]
    return ", ".join(there) + (f"; not installed: {', '.join(absent)}" if absent else "")


def _measured(data: Mapping[str, Any]) -> str:
    source = data["aioshmq"]
    commit = source["commit"] or "no git commit"
    if source["dirty"]:
        commit += ", with uncommitted changes"
    return f"aioshmq {source['version']} at {commit}; core: {source['core']}"


def _about(data: Mapping[str, Any], label: str = "") -> list[str]:
    """Rows of the table that says how a run was made and what it measured."""
    machine = data["machine"]
    rows = [
        ("command", f"`{data['command']}`"),
        ("measured", _measured(data)),
        ("when", f"started {data['started']}, {data['seconds']:.0f} s, the {data['mode']} budget"),
    ]
    if not label:
        rows += [
            (
                "machine",
                f"{machine['cpu_count']} CPUs ({machine['cpus_usable']} usable), load "
                f"{machine['loadavg_at_start'][0]:.2f} at the start, {machine['platform']}",
            ),
            ("Python", f"{machine['implementation']} {machine['python']}"),
            ("installed", _versions(machine)),
        ]
    return [f"| {label}{name} | {_md(text)} |" for name, text in rows]


REPRODUCE = """\
## How to reproduce

From a clone, with a C compiler and the Python headers (the install builds the compiled core
in place):

```sh
python3 -m venv .venv
.venv/bin/pip install -e '.[bench]'     # the peers; torch (CPU) too for the tensors rows
.venv/bin/python -m benchmarks          # a full run: minutes; keeps benchmarks/results/*.json
AIOSHMQ_PURE=1 .venv/bin/python -m benchmarks     # the same on the pure-Python core
.venv/bin/python -m benchmarks page benchmarks/results/DATE-COMMIT-compiled.json \\
    benchmarks/results/DATE-COMMIT-pure.json > benchmarks.md
```

`--only SCENARIO ...` runs some scenarios, `--quick` shortens each, `--json PATH` writes the
results there too, `--plot PATH` draws them.  Peers that are not installed are reported so.
The bench measures the installed aioshmq (here the editable install of the clone), or the
checkout named by `AIOSHMQ_BENCH_TREE`.

A change in speed is the ratio of new to old measured in one run, the two alternated (a
ratio of figures taken minutes apart on a shared VM measures the VM):

```sh
git worktree add ../old OLD_COMMIT
(cd ../old && python setup.py build_ext --inplace)
python setup.py build_ext --inplace
.venv/bin/python -m benchmarks compare ../old . --only small latency --rounds 3
```

Each round runs the chosen scenarios against the old tree, then the new one, each in fresh
processes that import that tree's `aioshmq` (the harness is this checkout's); `compare`
prints every run's figure per row and new/old, the ratio of the medians, and `--json PATH`
keeps the raw runs.
"""


def render(runs: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The page: ``runs`` is the main run (its path as named on the page, its data), and
    optionally the pure core's run after it."""
    (_, main), *rest = runs
    pure = rest[0] if rest else None
    paths = " ".join(path for path, _ in runs)
    lines = [
        "# Benchmarks",
        "",
        "<!-- Written by the command below from the results files it names: change those, or",
        "     the generator (benchmarks/page.py), not this page.",
        f"     python -m benchmarks page {paths} > benchmarks.md -->",
        "",
        "aioshmq against its peers across processes, on one machine: every figure below was",
        "measured in the run described here, and every ratio compares two figures of that run.",
        "The raw results:",
        "",
        *(f"- `{path}`" for path, _ in runs),
        "",
        "Earlier runs are in the history of `benchmarks/results/` and of this page.",
        "",
        "## The run",
        "",
        "| | |",
        "| --- | --- |",
        *_about(main),
    ]
    if pure is not None:
        lines += _about(pure[1], "pure core: ")
    lines += ["", REPRODUCE.rstrip(), "", "## Reading the tables", "", *LEGEND.splitlines()]
    lines += [
        "Each table is followed by how each transport was driven; a peer that is not",
        "installed here says so in its cells.",
    ]
    lines += _scenarios(main, "##", hows=True)
    if pure is not None:
        lines += [
            "",
            "## The pure-Python core",
            "",
            "The same scenarios with `AIOSHMQ_PURE=1`: aioshmq's pure-Python core, the reference",
            "the compiled one mirrors, in the run the table above calls the pure core's.  Its",
            "ratios compare figures of that run; each transport was driven as above.",
        ]
        lines += _scenarios(pure[1], "###", hows=False)
    return "\n".join(lines) + "\n"


def named(path: Path) -> str:
    """How the page names a results file: relative to the checkout if it is inside it."""
    absolute = os.path.abspath(path)
    inside = os.path.commonpath([absolute, CHECKOUT]) == CHECKOUT
    return os.path.relpath(absolute, CHECKOUT) if inside else str(path)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks page",
        description=(
            "Write benchmarks.md (to stdout) from a full run's results, and the pure core's "
            "run's after it if given."
        ),
    )
    parser.add_argument("results", type=Path, metavar="RESULTS.json")
    parser.add_argument("pure", type=Path, nargs="?", metavar="RESULTS-PURE.json")
    args = parser.parse_args(argv)
    paths = [args.results] + ([args.pure] if args.pure else [])
    try:
        runs = [(named(path), load(path)) for path in paths]
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if len(runs) > 1 and not str(runs[1][1]["aioshmq"]["core"]).startswith("pure"):
        parser.error(f"{args.pure}: not a run of the pure core ({runs[1][1]['aioshmq']['core']})")
    print(render(runs), end="")
    return 0

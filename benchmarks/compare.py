"""``python -m benchmarks compare OLD_TREE NEW_TREE``: two commits measured in one run.

Each tree is a checkout of the repository whose C extension is built in place
(``python setup.py build_ext --inplace``).  The chosen scenarios run ``--rounds`` times
against each tree, alternately (old, new, old, new, ...), each run a fresh
``python -m benchmarks`` process tree of this checkout's harness with that tree first on
``sys.path`` (``AIOSHMQ_BENCH_TREE`` and ``PYTHONPATH``): its children import that tree's
``aioshmq``, and nothing else of it.  Then, per row, each run's figure and the ratio of the
medians, new / old.  On a noisy machine that is the only speed change worth quoting: both
trees see the same minutes of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._which import CHECKOUT, TREE_ENV
from .report import fmt
from .results import load

TREES = ("old", "new")
PROBE = "import json, benchmarks._which as which; print(json.dumps(which.source()))"
PROBE_TIMEOUT = 120.0  # seconds to import a tree's aioshmq and say where it came from
LOWER_IS_BETTER = {"us", "ms", "% core", "B/msg"}

Row = tuple[str, str, str, str]  # scenario, case, metric, peer


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a run against ``tree``: it first on the path, this harness next."""
    path = [str(tree), CHECKOUT]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, TREE_ENV: str(tree), "PYTHONPATH": os.pathsep.join(path)}


def probe(tree: Path) -> dict[str, Any]:
    """Where a process started against ``tree`` imports aioshmq from, its core and commit."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=tree_env(tree),
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: aioshmq does not import there:\n{proc.stderr}")
    found: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return found


def check_trees(sources: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Why the two trees cannot be compared, or None."""
    for label, source in sources.items():
        core = str(source["core"])
        if not core.startswith("compiled") and not source["pure_forced"]:
            return (
                f"{label} tree {source['tree']}: aioshmq's compiled core is not built there "
                f"({core}); run `python setup.py build_ext --inplace` in it (or set "
                "AIOSHMQ_PURE=1 to compare the pure cores)"
            )
    cores = {str(source["core"]).split()[0] for source in sources.values()}
    if len(cores) > 1:
        return f"the trees run different cores ({', '.join(sorted(cores))})"
    return None


def describe(source: Mapping[str, Any]) -> str:
    commit = source["commit"] or "not a git checkout"
    if source["dirty"]:
        commit += ", with uncommitted changes"
    return f"{source['tree']} (commit {commit}; aioshmq {source['version']}, {source['core']})"


def run_once(tree: Path, flags: Sequence[str], out: Path) -> tuple[int, dict[str, Any]]:
    """One run of the harness against ``tree``: its exit code and its results.  Its progress
    and its table go to stderr: stdout is the comparison's."""
    cmd = [sys.executable, "-m", "benchmarks", *flags, "--json", str(out)]
    proc = subprocess.run(cmd, env=tree_env(tree), cwd=CHECKOUT, stdout=sys.stderr, check=False)
    if proc.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"{shlex.join(cmd)} against {tree} exited with {proc.returncode}")
    return proc.returncode, load(out)


def figures(runs: Sequence[Mapping[str, Any]]) -> dict[Row, dict[str, list[float | None]]]:
    """Each row's figures, per tree, in the order the runs were made (None: no figure)."""
    rows: dict[Row, dict[str, list[float | None]]] = {}
    rounds = {label: sum(1 for run in runs if run["tree"] == label) for label in TREES}
    seen = dict.fromkeys(TREES, 0)
    for run in runs:
        label = run["tree"]
        for r in run["data"]["results"]:
            key = (r["scenario"], r["case"], r["metric"], r["peer"])
            per_tree = rows.setdefault(key, {t: [None] * rounds[t] for t in TREES})
            per_tree[label][seen[label]] = r["value"]
        seen[label] += 1
    return rows


def ratio(per_tree: Mapping[str, Sequence[float | None]]) -> float | None:
    """The median of the new tree's figures over the median of the old tree's."""
    old = [v for v in per_tree["old"] if v is not None]
    new = [v for v in per_tree["new"] if v is not None]
    if not old or not new or statistics.median(old) == 0:
        return None
    return statistics.median(new) / statistics.median(old)


def table(runs: Sequence[Mapping[str, Any]]) -> str:
    """A block per scenario: a row per (case, metric, transport), each run's figure for each
    tree, and new / old."""
    units: dict[Row, str] = {}
    titles: dict[str, str] = {}
    for run in runs:
        titles.update(run["data"]["titles"])
        for r in run["data"]["results"]:
            units.setdefault((r["scenario"], r["case"], r["metric"], r["peer"]), r["unit"])
    rows = figures(runs)
    out: list[str] = []
    for scenario in dict.fromkeys(key[0] for key in rows):
        lines = [["case", "metric", "transport", "old", "new", "new/old"]]
        for key, per_tree in rows.items():
            if key[0] != scenario:
                continue
            _, case, metric, peer = key
            unit = units[key]
            cells = [
                " ".join("-" if v is None else fmt(v, unit) for v in per_tree[label])
                for label in TREES
            ]
            r = ratio(per_tree)
            lines.append(
                [case, f"{metric} ({unit})", peer, *cells, "" if r is None else f"{r:.2f}"]
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        out.append(f"== {scenario}: {titles.get(scenario, scenario)}")
        for n, line in enumerate(lines):
            out.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
            if n == 0:
                out.append("  ".join("-" * w for w in widths))
        out.append("")
    return "\n".join(out)


LEGEND = (
    "new/old = the median of the new tree's runs / the median of the old tree's: above 1 the\n"
    "new tree is faster for msg/s, calls/s and GB/s, slower for us, ms, % core and B/msg.\n"
    "Transports other than aioshmq run the same code against both trees: their ratios show\n"
    "what the machine alone moved meanwhile."
)


def main(argv: Sequence[str]) -> int:
    from .scenarios import SCENARIO_NAMES

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks compare",
        description=(
            "Measure two checkouts of aioshmq in one run: the chosen scenarios run against "
            "each tree in turn (old, new, old, new, ...), each run in fresh processes with "
            "that tree first on the path; then each run's figure and new/old, the ratio of "
            "the medians, per row.  Each tree's C extension must be built in place "
            "(python setup.py build_ext --inplace).  Progress goes to stderr."
        ),
    )
    parser.add_argument("old", type=Path, metavar="OLD_TREE", help="the baseline checkout")
    parser.add_argument("new", type=Path, metavar="NEW_TREE", help="the checkout to compare")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SCENARIO_NAMES,
        metavar="SCENARIO",
        help=f"run only these scenarios: {', '.join(SCENARIO_NAMES)}",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs against each tree, alternated (default 3)"
    )
    parser.add_argument("--quick", action="store_true", help="the quick budget in every run")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # for the tests
    parser.add_argument("--json", metavar="PATH", type=Path, help="write every run's results")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    trees = {"old": args.old.absolute(), "new": args.new.absolute()}
    for label, tree in trees.items():
        if not (tree / "aioshmq" / "__init__.py").is_file():
            parser.error(f"{label} tree {tree}: no aioshmq package there")
    sources = {label: probe(tree) for label, tree in trees.items()}
    if (why := check_trees(sources)) is not None:
        parser.error(why)
    flags = ["--tiny"] if args.tiny else ["--quick"] if args.quick else []
    if args.only:
        flags += ["--only", *args.only]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aioshmq-compare-") as scratch:
        for n in range(1, args.rounds + 1):
            for label, tree in trees.items():
                print(f"compare: round {n} of {args.rounds}, {label}: {tree}", file=sys.stderr)
                code, data = run_once(tree, flags, Path(scratch) / f"{label}-{n}.json")
                runs.append({"tree": label, "round": n, "returncode": code, "data": data})
    print(f"old: {describe(sources['old'])}")
    print(f"new: {describe(sources['new'])}")
    print(
        f"{args.rounds} round(s), run in the order old, new, old, new, ...; each run: "
        f"python -m benchmarks {shlex.join(flags)}\n"
    )
    print(table(runs))
    print(LEGEND)
    failed = [f"{run['tree']} run {run['round']}" for run in runs if run["returncode"]]
    if failed:
        print(f"\nmeasurements failed in: {', '.join(failed)} (their rows show -)")
    if args.json is not None:
        command = shlex.join(["python", "-m", "benchmarks", "compare", *argv])
        data = {"format": "aioshmq-bench-compare/1", "command": command, "trees": sources}
        args.json.write_text(json.dumps({**data, "runs": runs}, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if failed else 0

"""One run: the chosen scenarios in order, progress on stderr, then table, JSON and chart."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from .loops import where_main
from .procs import READY_TIMEOUT, Children
from .report import plot, table
from .results import keep, machine_info, run_data, write_json
from .scenarios import SCENARIOS, Bench
from .workload import FULL, QUICK, TINY


def run(
    *,
    quick: bool = False,
    tiny: bool = False,
    only: Sequence[str] | None = None,
    json_path: Path | None = None,
    plot_path: Path | None = None,
    command: str = "python -m benchmarks",
) -> int:
    """Run the benchmark; 0 if every measurement that could run succeeded, else 1.

    A full run (the full budget, every scenario) keeps its results in
    ``benchmarks/results/<date>-<commit>-<core>.json``; ``json_path`` gets them too."""
    budget = TINY if tiny else QUICK if quick else FULL
    # vLLM logs to stdout unless told otherwise (children inherit this): stdout is the table's.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    machine = machine_info()
    bench = Bench(budget)
    bench.say(
        f"aioshmq bench, {budget.mode} run: {machine['cpu_count']} CPUs, "
        f"load {machine['loadavg_at_start'][0]:.2f}, Python {machine['python']}, "
        f"{machine['core']} core, pid {os.getpid()}"
    )
    titles = {scenario.name: scenario.title for scenario in SCENARIOS}
    started_at = datetime.now(UTC)
    started = time.monotonic()
    for scenario in SCENARIOS:
        if only and scenario.name not in only:
            continue
        bench.say(f"[{scenario.name}] {scenario.title}")
        scenario.run(bench)
    seconds = time.monotonic() - started
    print(table(bench.results, titles))
    print(
        f"\n{budget.mode} run, {seconds:.0f} s on {machine['cpu_count']} CPUs, "
        f"aioshmq's {machine['core']} core"
    )
    sys.stdout.flush()
    data = run_data(
        bench.results,
        command=command,
        started=started_at,
        seconds=seconds,
        budget=asdict(budget),
        only=only,
        titles={name: titles[name] for name in dict.fromkeys(r.scenario for r in bench.results)},
        machine=machine,
    )
    data["aioshmq"]["file_in_children"] = _children_import()
    if json_path is not None:
        write_json(json_path, data)
        bench.say(f"wrote {json_path}")
    if budget is FULL and not only:
        bench.say(f"kept {keep(data)}")
    if plot_path is not None:
        plot(plot_path, bench.results, titles)
        bench.say(f"wrote {plot_path}")
    if bench.failures:
        bench.say(f"{bench.failures} measurement(s) failed: see above")
        return 1
    return 0


def _children_import() -> str:
    """Where the run's spawned children import aioshmq from (a child started now)."""
    with Children() as kids:
        result: str = kids.start("aioshmq-where", where_main).expect("result", READY_TIMEOUT)
    return result

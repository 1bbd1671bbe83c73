"""One run: the chosen scenarios in order, progress on stderr, then table, JSON and chart."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .report import plot, table, write_json
from .results import machine_info
from .scenarios import SCENARIOS, Bench
from .workload import FULL, QUICK, TINY


def run(
    *,
    quick: bool = False,
    tiny: bool = False,
    only: Sequence[str] | None = None,
    json_path: Path | None = None,
    plot_path: Path | None = None,
) -> int:
    """Run the benchmark; 0 if every measurement that could run succeeded, else 1."""
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
    if json_path is not None:
        write_json(
            json_path, bench.results, machine=machine, budget=asdict(budget), seconds=seconds
        )
        bench.say(f"wrote {json_path}")
    if plot_path is not None:
        plot(plot_path, bench.results, titles)
        bench.say(f"wrote {plot_path}")
    if bench.failures:
        bench.say(f"{bench.failures} measurement(s) failed: see above")
        return 1
    return 0

"""One figure of the run (or why there is none), the machine it was measured on, and a run's
results as data: what ``--json`` writes, what a full run keeps in ``benchmarks/results/``, and
what ``page`` and ``compare`` read."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aioshmq

from ._which import source

FORMAT = "aioshmq-bench/2"
RESULTS_DIR = Path(__file__).resolve().parent / "results"  #: where full runs are kept


@dataclass(frozen=True)
class Result:
    """One figure: what was measured, on which transport, and its value in ``unit``.

    ``value`` is None when there is no figure, and ``note`` says why ("not installed",
    "skipped: ...", "failed: ...").  Every figure is measured in this run.
    """

    scenario: str  #: one of the scenario names ("small", "large", ...)
    case: str  #: what varies within the scenario ("batches of 64", "1 MiB", "trio", ...)
    peer: str  #: "aioshmq", a peer's name, or a floor ("memcpy", "eventfd")
    metric: str  #: "throughput", "p50", "cpu", ...
    value: float | None
    unit: str  #: "msg/s", "GB/s", "us", "% core", "ms"
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """What the figures depend on besides the code: CPUs, load, Python, platform, versions."""
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "loadavg_at_start": list(os.getloadavg()),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "aioshmq": aioshmq.__version__,
        "core": aioshmq.CORE,
        "versions": {
            dist: _version(dist)
            for dist in (
                "anyio",
                "numpy",
                "pyzmq",
                "faster-fifo",
                "iceoryx2",
                "vllm",
                "torch",
                "uvloop",
                "trio",
                "matplotlib",
            )
        },
    }


def run_data(
    results: Sequence[Result],
    *,
    command: str,
    started: datetime,
    seconds: float,
    budget: Mapping[str, Any],
    only: Sequence[str] | None,
    titles: Mapping[str, str],
    machine: Mapping[str, Any],
) -> dict[str, Any]:
    """A run as data: how it was started, what it measured (aioshmq's commit and core), on
    what machine, and every result (scenario, case, peer, metric, value, unit, params, note)."""
    return {
        "format": FORMAT,
        "command": command,
        "started": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "mode": budget["mode"],
        "only": list(only) if only else None,
        "budget": dict(budget),
        "seconds": round(seconds, 1),
        "aioshmq": source(),
        "machine": dict(machine),
        "titles": dict(titles),
        "results": [asdict(result) for result in results],
    }


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def results_name(data: Mapping[str, Any]) -> str:
    """``<date>-<commit>-<core>.json``: the day the run started, the commit of the aioshmq it
    measured (``-dirty`` if its tracked files had changed, ``unknown`` outside git), and its
    core (``compiled`` or ``pure``)."""
    source = data["aioshmq"]
    commit = source["commit"] or "unknown"
    if source["dirty"]:
        commit += "-dirty"
    core = str(source["core"]).split()[0]
    return f"{data['started'][:10]}-{commit}-{core}.json"


def keep(data: Mapping[str, Any], directory: Path = RESULTS_DIR) -> Path:
    """Write a full run's data into ``directory`` under ``results_name``, never over another
    run's file (a second run of the day on the same commit gets ``-2``, and so on)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = results_name(data)
    path = directory / name
    n = 1
    while path.exists():
        n += 1
        path = directory / name.replace(".json", f"-{n}.json")
    write_json(path, data)
    return path


def load(path: Path) -> dict[str, Any]:
    """A run's data, as written by ``write_json`` (this format only)."""
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} results file ({data.get('format')!r})")
    return data

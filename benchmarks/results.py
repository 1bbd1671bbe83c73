"""One figure of the run (or why there is none), and the machine it was measured on."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

import aioshmq


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

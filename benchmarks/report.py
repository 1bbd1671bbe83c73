"""The report: a table per scenario, and a PNG chart (matplotlib)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from .results import Result

T = TypeVar("T")

LEGEND = (
    "(N.Nx) = aioshmq's figure / the peer's: above 1 aioshmq is better for msg/s, calls/s and\n"
    "GB/s, below 1 it is better for us, ms, % core and B/msg.  (N%) = aioshmq's GB/s as a\n"
    "share of memcpy's.  Every figure is measured in this run, on this machine."
)


COLORS = {  # one colour per transport in every chart (a name's first word, if not its own)
    "aioshmq": "#1f77b4",
    "mp.Queue": "#ff7f0e",
    "zmq.asyncio": "#2ca02c",
    "faster-fifo": "#d62728",
    "iceoryx2": "#e377c2",
    "eventfd": "#bcbd22",
    "memcpy": "#7f7f7f",
    "vLLM": "#9467bd",
    "ticker": "#17becf",
    "aioshmq-plain": "#aec7e8",
    "aioshmq-direct": "#393b79",
    "pyzmq": "#98df8a",
    "aioshmq numpy": "#ffbb78",
    "aioshmq put": "#ffbb78",
    "aioshmq pickle": "#ffbb78",
}
FLOORS = {"memcpy"}  # shown as the share of it that aioshmq reaches
LOG_SCALE = {"large"}  # memcpy is ten times anything else there


def fmt(value: float, unit: str) -> str:
    """A figure with the precision that its unit deserves."""
    if unit in ("msg/s", "calls/s"):
        if value >= 1e6:
            return f"{value / 1e6:.2f}M"
        return f"{value / 1e3:.1f}k" if value >= 1e3 else f"{value:.0f}"
    if unit in ("us", "B/msg"):
        return f"{value:.1f}"
    return f"{value:.2f}"


def cell(result: Result, base: Result | None) -> str:
    """A peer's figure, with aioshmq's ratio (or share of memcpy) to it."""
    if result.value is None:
        return result.note.split(":")[0] if result.note.startswith("failed") else result.note
    text = fmt(result.value, result.unit)
    if base is None or base.value is None or result.value == 0:
        return text
    if result.peer in FLOORS:
        return f"{text} ({100 * base.value / result.value:.0f}%)"
    return f"{text} ({base.value / result.value:.1f}x)"


def ordered(items: Iterable[T]) -> list[T]:
    """``items`` without repeats, in the order each first came."""
    return list(dict.fromkeys(items))


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
            lines.append(
                f"{peer}: {how}" if len(hows) == 1 else f"{peer} ({', '.join(cases)}): {how}"
            )
    return lines


def table(results: Sequence[Result], titles: Mapping[str, str]) -> str:
    """One block per scenario: a row per (case, metric), a column per transport."""
    out: list[str] = []
    for scenario in ordered([r.scenario for r in results]):
        rows = [r for r in results if r.scenario == scenario]
        peers = ordered(["aioshmq", *(r.peer for r in rows)])
        keys = ordered([f"{r.case}\0{r.metric}" for r in rows])
        by = {(r.case, r.metric, r.peer): r for r in rows}
        lines = [["case", "metric", *peers]]
        for key in keys:
            case, metric = key.split("\0")
            base = by.get((case, metric, "aioshmq"))
            unit = next(r.unit for r in rows if r.case == case and r.metric == metric)
            line = [case, f"{metric} ({unit})"]
            for peer in peers:
                result = by.get((case, metric, peer))
                if result is None:
                    line.append("")
                elif peer == "aioshmq":
                    line.append(cell(result, None))
                else:
                    line.append(cell(result, base))
            lines.append(line)
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        out.append(f"== {scenario}: {titles.get(scenario, scenario)}")
        for n, line in enumerate(lines):
            out.append(
                "  ".join(
                    cell.ljust(width) for cell, width in zip(line, widths, strict=True)
                ).rstrip()
            )
            if n == 0:
                out.append("  ".join("-" * width for width in widths))
        hows = _hows(rows)
        failures = ordered(
            [f"{r.peer}, {r.case}: {r.note}" for r in rows if r.note.startswith("failed")]
        )
        for how in hows:
            out.append(f"  - {how}")
        for failure in failures:
            out.append(f"  ! {failure}")
        out.append("")
    out.append(LEGEND)
    return "\n".join(out)


def plot_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot(path: Path, results: Sequence[Result], titles: Mapping[str, str]) -> None:
    """A bar chart per scenario (its first unit only), one bar per transport and row."""
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    scenarios = ordered([r.scenario for r in results])
    cols = min(3, len(scenarios))
    nrows = (len(scenarios) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4.2 * nrows), squeeze=False)
    for ax, scenario in zip(axes.flat, scenarios, strict=False):
        rows = [r for r in results if r.scenario == scenario]
        unit = rows[0].unit
        rows = [r for r in rows if r.unit == unit]
        keys = ordered([f"{r.case}\0{r.metric}" for r in rows])
        peers = ordered(["aioshmq", *(r.peer for r in rows)])
        by = {(f"{r.case}\0{r.metric}", r.peer): r for r in rows}
        width = 0.8 / len(peers)
        for j, peer in enumerate(peers):
            xs, heights = [], []
            for i, key in enumerate(keys):
                result = by.get((key, peer))
                if result is not None and result.value is not None:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    heights.append(result.value)
            if xs:
                color = COLORS.get(peer) or COLORS.get(peer.split()[0], "#8c564b")
                ax.bar(xs, heights, width, label=peer, color=color)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([key.replace("\0", "\n") for key in keys], fontsize=7)
        ax.set_title(f"{scenario}: {titles.get(scenario, scenario)}", fontsize=9)
        ax.set_ylabel(unit + (", log scale" if scenario in LOG_SCALE else ""))
        if scenario in LOG_SCALE:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(scenarios) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

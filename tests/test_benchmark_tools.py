"""Every measurement tool in benchmarks/tools/ runs, briefly, and prints what it says it does.

A tool that no test runs rots: each one here runs for a moment (the slow tier) as a module
from the checkout, against the installed aioshmq, and its output is read back: its rows are
all there, its figures parse, and the arithmetic it reports holds.  No figure is judged.
Multi-process tools are given their start method on the command line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import run_in_session

import aioshmq  # the installed package: imported before this checkout is put on the path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pytest puts tests/ there; benchmarks/ is the checkout's
    sys.path.append(str(ROOT))

from benchmarks.tools.call_cost import total  # noqa: E402

TOOLS = ROOT / "benchmarks" / "tools"
NOT_MEASUREMENTS = {"__init__", "mutations"}  # mutations.py tests the C core, run by hand
TIMEOUT = 60  # seconds for one tool's short run (a few seconds each on 2 idle CPUs)
FIGURE = r"(-?\d+(?:\.\d+)?)"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT + 5)]


def run_tool(name: str, *args: str) -> list[str]:
    """``python -m benchmarks.tools.NAME ARGS`` from the checkout: its output lines."""
    cmd = [sys.executable, "-m", f"benchmarks.tools.{name}", *args]
    proc = run_in_session(cmd, ROOT, TIMEOUT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout.splitlines()


def figures(pattern: str, line: str) -> list[float]:
    found = re.fullmatch(pattern.replace("F", FIGURE), line)
    assert found, (pattern, line)
    return [float(x) for x in found.groups()]


SMOKE = {  # each tool, and the test that runs it
    "broadcast_cpu",
    "call_cost",
    "copy_floor",
    "harness_floor",
    "hotpath",
    "large_stream",
    "latency_pair",
    "wake_cycle",
}


def test_every_measurement_tool_has_a_smoke_run() -> None:
    tools = {path.stem for path in TOOLS.glob("*.py")} - NOT_MEASUREMENTS
    assert tools == SMOKE


def test_hotpath_reports_each_call_and_its_share_beside_pickle() -> None:
    lines = run_tool("hotpath", "--count", "2000")
    assert lines[0] == f"core: {aioshmq.CORE}; 2000 x the bench's 100-byte dict"
    assert len(lines) == 9, lines
    for line in lines[1:3]:
        put, dumps, rest, get, loads, rest_get = figures(
            r"put F us = pickle.dumps F \+ F   get F us = pickle.loads F \+ F", line
        )
        assert put == pytest.approx(dumps + rest, abs=0.016)
        assert get == pytest.approx(loads + rest_get, abs=0.016)
    for line in lines[3:5]:
        figures(r"put_many F us   get_many F us   \(a message, in 64s\)", line)
    for line in lines[5:7]:
        figures(r"put_nowait F us   get_nowait F us", line)
    for line in lines[7:9]:
        figures(r"put_sync F us   get_sync F us", line)


@pytest.mark.parametrize("call", ["put", "get", "nowait"])
def test_call_cost_moves_every_message_through_its_loop(call: str) -> None:
    """The loop that callgrind counts (valgrind itself takes minutes: not run here)."""
    lines = run_tool("call_cost", call, "--inner", "--count", "4000")
    assert lines == [f"core: {aioshmq.CORE}; {call}: 4010 messages put, 4010 received"]


def test_call_cost_reads_the_total_from_callgrind_output() -> None:
    out = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 936599466\n\ntotals: 1\n"
    assert total(out) == 936599466
    with pytest.raises(ValueError, match="no summary"):
        total("events: Ir\n")


def test_harness_floor_reports_both_sides_of_each_row() -> None:
    lines = run_tool("harness_floor", "--batches", "64", "--rounds", "1")
    rows = ["dict, one per put", "dict, batches of 64", "tuple, one per put"]
    rows.append("tuple, batches of 64")
    assert [line[:24].rstrip() for line in lines[1:]] == rows
    for line in lines[1:]:
        writer, writer_rate, reader, reader_rate = figures(r".{24} +F  \(FM\) +F  \(FM\)", line)
        assert writer_rate == pytest.approx(1 / writer, rel=0.1, abs=0.01)
        assert reader_rate == pytest.approx(1 / reader, rel=0.1, abs=0.01)


def test_broadcast_cpu_reports_every_reader_of_each_run() -> None:
    args = ["--readers", "1", "2", "--seconds", "0.2", "--rounds", "1", "--warmup", "500"]
    lines = run_tool("broadcast_cpu", *args, "--start-method", "spawn")
    assert lines[0].startswith(f"core: {aioshmq.CORE}; ")
    figures(
        r"1 reader : +Fk msg/s \(CPU bound +Fk\); CPU per message: writer F ns, "
        r"readers F ns; CPUs busy F of \d+",
        lines[1],
    )
    figures(
        r"2 readers: +Fk msg/s \(CPU bound +Fk, F% of the last 1-reader run\); CPU per "
        r"message: writer F ns, readers F, F ns; CPUs busy F of \d+",
        lines[2],
    )


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_wake_cycle_reports_aioshmq_and_the_bare_eventfds(loop: str) -> None:
    lines = run_tool("wake_cycle", "--rounds", "200", *(["--uvloop"] if loop == "uvloop" else []))
    figures(rf"{loop}: F, F us a round trip", lines[0])
    figures(rf"{loop}, bare eventfds: F, F us a round trip", lines[1])


def test_latency_pair_reports_the_three_ping_pongs() -> None:
    args = ["--rounds", "400", "--warmup", "100", "--start-method", "spawn"]
    lines = run_tool("latency_pair", *args)
    assert [line.split()[0] for line in lines] == ["eventfd", "kept", "aioshmq", "ratio"]
    for line in lines[:3]:
        _, cpu, user, kernel = figures(
            r"\w+ +p50 +F us   pinging process CPU +F us/trip \(user +F, kernel +F\)", line
        )
        assert cpu == pytest.approx(user + kernel, abs=0.16)
    figures(r"ratio Fx the eventfd floor, Fx the kept-registered one, on asyncio", lines[3])


def test_large_stream_accounts_for_every_payload() -> None:
    args = ["--sizes", "256", "--seconds", "0.2", "--start-method", "spawn"]
    (line,) = run_tool("large_stream", *args)
    found = re.search(r"payloads at each place in the ring \{([^}]*)\}", line)
    assert found, line
    shares = [float(part.split(": ")[1].rstrip("%")) for part in found.group(1).split(", ")]
    assert shares and sum(shares) == pytest.approx(100, abs=len(shares))
    assert line.startswith("256 KiB: ") and "numpy.copyto into 1, 2 and 4 slots" in line


def test_copy_floor_reports_both_hand_overs() -> None:
    (line,) = run_tool("copy_floor", "--sizes", "64", "--count", "200")
    figures(
        r"64 KiB: memcpy F GB/s; through 4 slots to another process, last byte read F GB/s "
        r"\(F%\), copied out F GB/s \(F%\)",
        line,
    )

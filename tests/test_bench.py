"""``python -m benchmarks`` runs end to end: every scenario yields figures (none timed here);
``compare`` runs two trees alternately, and ``page`` writes benchmarks.md from a run's results."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from conftest import run_in_session

import aioshmq  # the installed package: imported before this checkout is put on the path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pytest puts tests/ there; benchmarks/ is the checkout's
    sys.path.append(str(ROOT))

from benchmarks import rpc as _rpc  # noqa: E402
from benchmarks.page import render  # noqa: E402
from benchmarks.peers import (  # noqa: E402
    ICEORYX2,
    MP_QUEUE,
    VLLM,
    AioshmqChannel,
    AioshmqGetChannel,
    AioshmqMsgpackChannel,
    AioshmqReserveChannel,
    Channel,
    IceoryxSleepingChannel,
    Peer,
    _AioshmqReceiver,
)
from benchmarks.procs import CTX, Children, Link, run_backend  # noqa: E402
from benchmarks.results import keep, load, results_name  # noqa: E402
from benchmarks.scenarios import SCENARIO_NAMES, _stream  # noqa: E402
from benchmarks.workload import TINY, Workload, small_tuple  # noqa: E402

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HAS_ZMQ = importlib.util.find_spec("zmq") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_MSGSPEC = importlib.util.find_spec("msgspec") is not None
HAS_ICEORYX2 = importlib.util.find_spec("iceoryx2") is not None
# Where vLLM is installed its readers import torch, seconds each: the tiny run takes minutes.
TINY_TIMEOUT = 400 if HAS_VLLM else 55
# The remote scenario alone: about 30 s on 2 busy CPUs (17 processes start for its wire rows).
REMOTE_TIMEOUT = 150
# tensors, reserve and serializers: about 20 s on 2 idle CPUs, most of it the 4 tensor
# readers importing torch.
NEW_PATHS_TIMEOUT = 90
EVERY_TIMEOUT = TINY_TIMEOUT + REMOTE_TIMEOUT + NEW_PATHS_TIMEOUT


@pytest.mark.timeout(EVERY_TIMEOUT + 5)
@pytest.mark.parametrize(
    "only",
    [
        # The plumbing, in seconds.
        pytest.param(("small", "lag"), id="small-and-lag", marks=pytest.mark.slow),
        pytest.param(("rpc",), id="rpc", marks=pytest.mark.slow),
        pytest.param(SCENARIO_NAMES, id="every-scenario", marks=pytest.mark.slow),
    ],
)
def test_bench_tiny_run_reports_every_scenario(tmp_path: Path, only: tuple[str, ...]) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--tiny", "--json", str(out)]
    every = only == SCENARIO_NAMES
    if not every:
        cmd += ["--only", *only]
    if HAS_MATPLOTLIB:
        cmd += ["--plot", str(tmp_path / "bench.png")]
    proc = run_in_session(cmd, ROOT, EVERY_TIMEOUT if every else TINY_TIMEOUT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    data = json.loads(out.read_text())
    assert data["mode"] == "tiny"
    _check_which_aioshmq(data)
    assert data["machine"]["cpu_count"] >= 1
    assert data["machine"]["python"] == sys.version.split()[0]
    results = data["results"]
    assert {r["scenario"] for r in results} == set(only)
    for scenario in only:
        mine = [r for r in results if r["scenario"] == scenario and r["peer"] == "aioshmq"]
        assert mine, f"no aioshmq result for {scenario}"
        for r in mine:
            if r["note"].startswith("not installed"):  # uvloop or trio (idle), numpy
                continue
            assert isinstance(r["value"], float) and r["value"] >= 0, r
    for r in results:
        assert set(r) >= {"scenario", "case", "peer", "metric", "value", "unit", "params"}
        absent = r["note"].startswith(("not installed", "not importable"))
        assert isinstance(r["value"], float) or absent, r
    # Every peer is either measured or said to be missing, and mp.Queue is always there.
    if "small" in only:
        assert any(r["peer"] == "mp.Queue" and r["value"] is not None for r in results)
    if "large" in only:
        assert any(r["peer"] == "memcpy" and r["value"] is not None for r in results)
    if "latency" in only:
        assert any(r["peer"] == "eventfd" and r["value"] is not None for r in results)
    for scenario in only:
        assert f"== {scenario}:" in proc.stdout
    if "small" in only:
        assert "[small]" in proc.stderr and "mp.Queue" in proc.stderr
    _check_measured_only(proc.stdout + proc.stderr + out.read_text(), results)
    if "rpc" in only:
        _check_rpc_figures(results)
    if every:
        _check_vllm_rows(results)
        _check_iceoryx2_rows(results)
        _check_remote_rows(results)
        _check_new_path_rows(results, only)
    if HAS_MATPLOTLIB:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _check_page(data, only)


def _check_which_aioshmq(data: dict[str, Any]) -> None:
    """The run and its spawned children measured the aioshmq this test imports (the installed
    one), not a folder of the checkout that happened to be on their path."""
    source = data["aioshmq"]
    assert source["file"] == source["file_in_children"] == aioshmq.__file__, source
    assert source["core"] == aioshmq.CORE and data["format"] == "aioshmq-bench/2"
    # The command as typed, the core's switch before it when it is set (AIOSHMQ_PURE=1).
    assert re.fullmatch(r"(AIOSHMQ_PURE=\S+ )?python -m benchmarks .*", data["command"])


def _check_page(data: dict[str, Any], only: tuple[str, ...]) -> None:
    """The page written from a run: one table per scenario, a row per case and metric, and
    within the length a reader can take in."""
    page = render([("run.json", data)])
    assert len(page.splitlines()) <= 400
    for scenario in only:
        assert f"\n## {scenario}: {data['titles'][scenario]}\n" in page
    for r in data["results"]:
        assert f"| {r['case']} | {r['metric']} ({r['unit']}) |" in page, r


def _check_measured_only(output: str, results: list[dict[str, Any]]) -> None:
    """Every figure was measured in this run: none is quoted from elsewhere, and nothing
    cites a document that is not part of the repository."""
    assert "design.md" not in output and "quoted" not in output
    for r in results:
        assert "reference" not in r, r
        for text in (r["peer"], r["case"], r["note"]):
            assert "quoted" not in text.lower() and "reference" not in text.lower(), r


VLLM_ROWS = {  # where vLLM's MessageQueue is measured, when vllm imports
    ("small", "one per put", "throughput"),
    ("small", "batches of 64", "throughput"),
    ("small", "one per put, a tuple", "throughput"),
    ("small", "batches of 64, a tuple", "throughput"),
    ("large", "512 KiB", "throughput"),
    ("large", "1 MiB", "throughput"),
    ("large", "64 MiB", "throughput"),
    ("latency", "round trip", "p50"),
    ("latency", "round trip", "p99"),
    ("broadcast", "1 -> 1 reader", "throughput"),
    ("broadcast", "1 -> 2 readers", "throughput"),
    ("broadcast", "1 -> 4 readers", "throughput"),
    ("idle", "asyncio", "cpu"),
}


def _check_vllm_rows(results: list[dict[str, Any]]) -> None:
    """vLLM has a row wherever it is compared: measured in this run if vllm imports here,
    else missing the way any other peer that is not installed is."""
    mine = [r for r in results if r["peer"] == "vLLM"]
    assert {(r["scenario"], r["case"], r["metric"]) for r in mine} == VLLM_ROWS, mine
    (note,) = {r["note"] for r in mine}  # measured everywhere, or nowhere for one reason
    if not HAS_VLLM:
        assert note == "not installed"
    assert note in ("", "not installed") or note.startswith("not importable"), note
    for r in mine:
        if note:
            assert r["value"] is None, r
        else:
            assert isinstance(r["value"], float) and r["value"] >= 0 and r["params"]["how"], r
    broadcast = [r for r in mine if r["scenario"] == "broadcast"]
    assert sorted(r["params"]["readers"] for r in broadcast) == [1, 2, 4]


ICEORYX2_ROWS = {  # where iceoryx2 is measured, when it is installed
    *(("small", case, "throughput") for case in ("one per put", "batches of 64")),
    *(("small", case, "throughput") for case in ("one per put, a tuple", "batches of 64, a tuple")),
    *(("broadcast", f"1 -> {n} reader{'s' if n > 1 else ''}", "throughput") for n in (1, 2, 4)),
    *(
        ("latency", f"round trip, peer asleep{where}", metric)
        for where in (
            "",
            ", unpinned",
            ", both on one CPU",
            ", 2 busy processes beside",
            ", uvloop",
        )
        for metric in ("p50", "p99")
    ),
    ("idle", "asyncio", "cpu"),
}


def _check_iceoryx2_rows(results: list[dict[str, Any]]) -> None:
    """iceoryx2 has a row wherever it can share one with aioshmq: measured in this run if it
    is installed, else missing; where it sleeps, aioshmq and the eventfd floor took turns
    with it."""
    mine = [r for r in results if r["peer"] == "iceoryx2"]
    assert {(r["scenario"], r["case"], r["metric"]) for r in mine} == ICEORYX2_ROWS, mine
    for r in mine:
        if not HAS_ICEORYX2:
            assert r["value"] is None and r["note"] == "not installed", r
            continue
        assert isinstance(r["value"], float) and r["value"] >= 0, r
        assert "lossless" in r["params"]["how"] or r["scenario"] == "idle", r
        if r["scenario"] == "latency":
            assert r["params"]["taking_turns_with"] == ["aioshmq", "eventfd"], r
    asleep = [r for r in results if r["case"].startswith("round trip, peer asleep")]
    for r in asleep:
        if r["peer"] == "aioshmq" and HAS_ICEORYX2:
            assert r["params"]["taking_turns_with"] == ["eventfd", "iceoryx2"], r


def _check_rpc_figures(results: list[dict[str, Any]]) -> None:
    """The rpc scenario gives p50, p99 and calls/s for aioshmq and zmq.asyncio (if installed),
    from sessions that made calls and counted some, and aioshmq's p50 and p99 of a cancelled
    call's round trip."""
    cancelled_case = "a cancelled call, then the next"
    rows = [r for r in results if r["scenario"] == "rpc" and r["case"] != cancelled_case]
    wanted = {
        ("one call at a time", "p50", "us"),
        ("one call at a time", "p99", "us"),
        ("256 calls in flight", "throughput", "calls/s"),
    }
    for peer in ("aioshmq", "zmq.asyncio"):
        mine = [r for r in rows if r["peer"] == peer]
        assert {(r["case"], r["metric"], r["unit"]) for r in mine} == wanted, mine
        if peer == "zmq.asyncio" and not HAS_ZMQ:
            assert all(r["value"] is None and r["note"] == "not installed" for r in mine)
            continue
        for r in mine:
            assert isinstance(r["value"], float) and r["value"] > 0, r
            params = r["params"]
            assert params["workers"] == 4 and params["window"] == 256
            assert params["round_trips"] >= 1 and all(n >= 1 for n in params["calls_counted"])
            assert params["calls"] > 256
        if peer == "aioshmq":
            stats = mine[0]["params"]["client_stats"]
            assert stats["calls_submitted"] == mine[0]["params"]["calls"]
            assert stats["replies_received"] == 4 * stats["calls_submitted"]
            assert stats["calls_cancelled"] == 0
    # A session of its own: each echo call follows a hold call, cancelled in the workers
    # (each of the 4 answers it, with nothing); aioshmq only.
    cancelled = [r for r in results if r["scenario"] == "rpc" and r["case"] == cancelled_case]
    assert {(r["peer"], r["metric"], r["unit"]) for r in cancelled} == {
        ("aioshmq", "p50", "us"),
        ("aioshmq", "p99", "us"),
    }, cancelled
    for r in cancelled:
        assert isinstance(r["value"], float) and r["value"] > 0, r
        params = r["params"]
        assert params["workers"] == 4 and params["round_trips"] >= 1
        stats = params["client_stats"]
        assert stats["calls_submitted"] == 2 * params["calls"]
        assert stats["calls_cancelled"] == params["calls"]
        assert stats["replies_received"] == 4 * stats["calls_submitted"]


PAIRED = ("aioshmq", "pyzmq-curve", "aioshmq-plain", "pyzmq")  # encrypted, then plain
REMOTE_ROWS = {  # (case, metric, unit): the transports measured there
    ("100 B, 1 -> 1 remote reader", "throughput", "msg/s"): set(PAIRED),
    ("64 MiB arrays", "throughput", "GB/s"): set(PAIRED),
    ("round trip", "p50", "us"): set(PAIRED),
    ("round trip", "p99", "us"): set(PAIRED),
    ("1 far reader", "wire bytes", "B/msg"): {"aioshmq", "aioshmq-direct", "pyzmq"},
    ("8 far readers", "wire bytes", "B/msg"): {"aioshmq", "aioshmq-direct"},
}


def _check_remote_rows(results: list[dict[str, Any]]) -> None:
    """Every row of the remote scenario, each measured (or pyzmq, or numpy for the arrays,
    said to be missing); through one mirror the stream crosses the network once for all 8
    far readers, directly once for each of them."""
    rows = [r for r in results if r["scenario"] == "remote"]
    got: dict[tuple[str, str, str], set[str]] = {}
    for r in rows:
        got.setdefault((r["case"], r["metric"], r["unit"]), set()).add(r["peer"])
    assert got == REMOTE_ROWS, got
    for r in rows:
        if r["note"].startswith("not installed"):
            assert not HAS_ZMQ or r["case"] == "64 MiB arrays", r
            continue
        assert isinstance(r["value"], float) and r["value"] > 0, r
        assert r["params"]["how"], r
        if r["peer"].startswith("aioshmq"):
            assert ("insecure_loopback=True" in r["params"]["how"]) == (
                r["peer"] == "aioshmq-plain"
            ), r
    if not HAS_ZMQ:
        return
    wire = {(r["case"], r["peer"]): r for r in rows if r["metric"] == "wire bytes"}
    mirrored, direct = wire["8 far readers", "aioshmq"], wire["8 far readers", "aioshmq-direct"]
    assert mirrored["params"]["readers"] == direct["params"]["readers"] == 8
    assert mirrored["params"]["network"] == direct["params"]["network"]
    assert direct["value"] > 4 * mirrored["value"], (mirrored, direct)
    # Each message (a 100-byte pickle) is on the wire at least once.
    assert all(r["value"] >= 100 for r in wire.values()), wire


NEW_PATHS = ("tensors", "reserve", "serializers")
TENSOR_SIZES = [f"{n >> 20} MiB" for n in dict.fromkeys((16 << 20, TINY.tensor_bytes))]


def _new_path_rows(only: tuple[str, ...]) -> dict[tuple[str, str, str, str], set[str]]:
    """(scenario, case, metric, unit): the columns of the new paths' scenarios among ``only``."""
    rows: dict[tuple[str, str, str, str], set[str]] = {}
    if "tensors" in only:
        for size in TENSOR_SIZES:
            for read in ("get", "lease"):
                key = ("tensors", f"{size}, put + {read}", "throughput", "GB/s")
                rows[key] = {"aioshmq", "aioshmq numpy"}
    if "reserve" in only:
        rows["reserve", "64 MiB", "throughput", "GB/s"] = {"aioshmq", "aioshmq put", "memcpy"}
    if "serializers" in only:
        for case in ("one per put", "one per put, a tuple"):
            rows["serializers", case, "throughput", "msg/s"] = {"aioshmq", "aioshmq pickle"}
    return rows


def _check_new_path_rows(results: list[dict[str, Any]], only: tuple[str, ...]) -> None:
    """Every row of tensors (a tensor beside the array it wraps, read by get and by lease,
    in a ring 4 times the size), reserve (reserve_array beside put and memcpy) and
    serializers (msgpack beside pickle): measured, or torch or msgspec said to be missing."""
    rows = [r for r in results if r["scenario"] in NEW_PATHS]
    got: dict[tuple[str, str, str, str], set[str]] = {}
    for r in rows:
        got.setdefault((r["scenario"], r["case"], r["metric"], r["unit"]), set()).add(r["peer"])
    assert got == _new_path_rows(only), got
    for r in rows:
        params = r["params"]
        if r["note"]:
            missing = "not installed (torch)" if r["scenario"] == "tensors" else "not installed"
            assert r["note"] == missing and r["value"] is None, r
            assert not (HAS_TORCH if r["scenario"] == "tensors" else HAS_MSGSPEC), r
            continue
        assert isinstance(r["value"], float) and r["value"] > 0 and params["how"], r
        if r["scenario"] == "tensors":
            assert params["payload"] == ("tensor" if r["peer"] == "aioshmq" else "array"), r
            assert r["case"].endswith(f"put + {params['read']}"), r
            assert params["capacity"] == 4 * params["bytes"], r
        elif r["scenario"] == "reserve" and r["peer"] != "memcpy":
            assert ("reserve_array" in params["how"]) == (r["peer"] == "aioshmq"), r
            assert params["read"] == "lease" and params["capacity"] == 4 * params["bytes"], r
        elif r["scenario"] == "serializers":
            assert params["serializer"] == ("msgpack" if r["peer"] == "aioshmq" else "pickle"), r


@pytest.mark.timeout(NEW_PATHS_TIMEOUT + 5)
@pytest.mark.parametrize(
    "only",
    [
        pytest.param(("reserve", "serializers"), id="reserve-and-serializers"),  # seconds
        # Its readers import torch, seconds each: the every-scenario run has it too.
        pytest.param(("tensors",), id="tensors", marks=pytest.mark.slow),
    ],
)
def test_bench_tiny_run_reports_the_rows_of_the_new_paths(
    tmp_path: Path, only: tuple[str, ...]
) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks", "--tiny", "--only", *only]
    proc = run_in_session([*cmd, "--json", str(out)], ROOT, NEW_PATHS_TIMEOUT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    data = json.loads(out.read_text())
    _check_which_aioshmq(data)
    results = data["results"]
    assert {r["scenario"] for r in results} == set(only)
    _check_new_path_rows(results, only)
    for scenario, case, _, _ in _new_path_rows(only):
        assert f"== {scenario}:" in proc.stdout and case in proc.stdout
    _check_measured_only(proc.stdout + proc.stderr + out.read_text(), results)


async def _through(channel: Channel, obj: Any, use: Callable[[Any], Any]) -> tuple[str, Any]:
    """Send ``obj`` through ``channel`` within this process: how its receiver read it, and
    ``use(message)``, called while the message is valid."""
    try:
        tx = channel.sender()
        try:
            rx = channel.receiver(0)
            try:
                await tx.send(obj)
                return rx.read, await rx.recv_with(use)
            finally:
                rx.close()
        finally:
            tx.close()
    finally:
        channel.close()


# torch warns (once a process) when it wraps the read-only ring; aioshmq._torch's filter for
# that is set when it is first imported, and pytest drops it after the test that imported it.
@pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("kind", ["array", "tensor"])
@pytest.mark.parametrize(
    ("channel", "read"), [(AioshmqGetChannel, "get"), (AioshmqChannel, "lease")]
)
async def test_payloads_are_read_by_get_or_inside_a_lease_as_the_channel_says(
    anyio_backend: str, kind: str, channel: type[Channel], read: str
) -> None:
    pytest.importorskip("numpy")
    if kind == "tensor":
        pytest.importorskip("torch")
    workload = Workload(kind, 1 << 20)  # type: ignore[arg-type]
    got = await _through(
        channel(1, capacity=4 << 20, depth=16, arrays=True),
        workload.make(0),
        lambda msg: (workload.check(msg, 0), type(msg).__name__)[1],
    )
    assert got == (read, "ndarray" if kind == "array" else "Tensor")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_reserve_channel_writes_each_array_in_place(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("numpy")
    reserved: list[tuple[Any, Any]] = []
    reserve_array = aioshmq.Writer.reserve_array

    def spy(writer: Any, shape: Any, dtype: Any, **kwargs: Any) -> Any:
        reserved.append((shape, dtype))
        return reserve_array(writer, shape, dtype, **kwargs)

    monkeypatch.setattr(aioshmq.Writer, "reserve_array", spy)
    workload = Workload("array", 1 << 20)
    array = workload.make(0)
    got = await _through(
        AioshmqReserveChannel(1, capacity=4 << 20, depth=16, arrays=True),
        array,
        lambda msg: (workload.check(msg, 0), bytes(msg) == array.tobytes())[1],
    )
    assert got == ("lease", True)
    assert reserved == [(array.shape, array.dtype)]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("channel", "arrives_as"), [(AioshmqMsgpackChannel, list), (AioshmqChannel, tuple)]
)
async def test_the_msgpack_channel_sends_msgpack(
    anyio_backend: str, channel: type[Channel], arrives_as: type
) -> None:
    pytest.importorskip("msgspec")
    sent = small_tuple(7)
    _, got = await _through(channel(1), sent, lambda msg: msg)
    assert type(got) is arrives_as and list(got) == list(sent)  # msgpack has no tuples


@pytest.mark.slow  # the every-scenario run checks the same rows in the slow tier too
@pytest.mark.timeout(REMOTE_TIMEOUT + 5)
def test_bench_tiny_remote_run_reports_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks", "--tiny", "--only", "remote"]
    proc = run_in_session([*cmd, "--json", str(out)], ROOT, REMOTE_TIMEOUT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    results = json.loads(out.read_text())["results"]
    assert {r["scenario"] for r in results} == {"remote"}
    _check_remote_rows(results)
    assert "== remote:" in proc.stdout
    for case, _, _ in REMOTE_ROWS:
        assert case in proc.stdout
    _check_measured_only(proc.stdout + proc.stderr + out.read_text(), results)


def test_a_peer_is_missing_where_it_is_not_installed_or_does_not_import() -> None:
    if not HAS_VLLM:
        assert VLLM.missing() == "not installed"
    broken = Peer("broken", MP_QUEUE.channel, "-", "-", ("json",), "json.aioshmq_bench_no_such")
    assert broken.missing() == "not importable (ModuleNotFoundError)"
    absent = Peer("absent", MP_QUEUE.channel, "-", "-", ("aioshmq_bench_no_such",), "json")
    assert absent.missing() == "not installed"
    assert Peer("json", MP_QUEUE.channel, "-", "-", ("json",), "json.decoder").missing() is None


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_iceoryx2_delivers_every_message_to_every_reader_through_a_full_buffer() -> None:
    """Its defaults overwrite the oldest sample when a subscriber falls behind; the bench's
    channel must hold the publisher back instead.  A 4-sample buffer and 2 spawned readers
    (the bench's start method) make the publisher wait thousands of times in 20,000
    messages: each reader checks the order of every message, and all must arrive."""
    pytest.importorskip("iceoryx2")
    assert CTX.get_start_method() == "spawn"
    messages = 20_000
    stream = run_backend(
        "asyncio",
        partial(_stream, ICEORYX2, Workload("small"), readers=2, min_messages=messages, depth=4),
    )
    assert stream.counted == messages
    assert [report["count"] for report in stream.reports] == [messages, messages]


def _open_then_die(link: Link, channel: Channel) -> None:
    """A child that opens its end of ``channel`` (files of its own appear) and is killed."""
    channel.receiver(0)
    link.ready()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_iceoryx2_channel_removes_its_files_after_a_reader_is_killed() -> None:
    pytest.importorskip("iceoryx2")
    channel = IceoryxSleepingChannel(1)
    try:
        tx = channel.sender()
        with Children() as kids:  # spawned
            kid = kids.start("iceoryx2-killed-reader", _open_then_die, channel)
            kids.ready()
            kid.proc.join(30)
            assert kid.proc.exitcode == -signal.SIGKILL
        shm = [path for path in channel.leftovers() if path.startswith("/dev/shm/")]
        assert shm and channel.root in channel.leftovers()
        tx.close()
    finally:
        channel.close()
    assert channel.leftovers() == []
    assert not os.path.exists(channel.root)


@pytest.mark.slow
@pytest.mark.timeout(NEW_PATHS_TIMEOUT + 5)
def test_a_clone_in_a_folder_named_aioshmq_does_not_shadow_the_installed_package(
    tmp_path: Path,
) -> None:
    """Run from inside a clone (a folder named aioshmq, whose own aioshmq/ is not built:
    here it cannot even be imported) with the clone's parent on the path too, the bench and
    its spawned children still measure the installed aioshmq."""
    clone = tmp_path / "aioshmq"
    (clone / "aioshmq").mkdir(parents=True)
    (clone / "aioshmq" / "__init__.py").write_text("raise ImportError('the clone, not built')\n")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks", "--tiny", "--only", "serializers"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.run(
        [*cmd, "--json", str(out)],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=NEW_PATHS_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    _check_which_aioshmq(json.loads(out.read_text()))


def _tree(where: Path, built: bool = True) -> Path:
    """A tree holding a copy of the aioshmq this test imports (its built core with it, or
    not): what ``compare`` wants of a checkout, without a checkout's other files."""
    package = Path(aioshmq.__file__).parent
    skip = shutil.ignore_patterns("__pycache__", *(() if built else ("*.so",)))
    shutil.copytree(package, where / "aioshmq", ignore=skip)
    return where


COMPARE_TIMEOUT = 120  # 4 tiny runs of one scenario: about 15 s on 2 idle CPUs


@pytest.mark.slow
@pytest.mark.timeout(COMPARE_TIMEOUT + 5)
def test_compare_runs_the_trees_alternately_and_reports_new_over_old(tmp_path: Path) -> None:
    old, new = _tree(tmp_path / "old"), _tree(tmp_path / "new")
    out = tmp_path / "compare.json"
    cmd = [sys.executable, "-m", "benchmarks", "compare", str(old), str(new), "--tiny"]
    cmd += ["--only", "serializers", "--rounds", "2", "--json", str(out)]
    proc = run_in_session(cmd, ROOT, COMPARE_TIMEOUT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [(run["tree"], run["round"]) for run in runs] == [
        ("old", 1),
        ("new", 1),
        ("old", 2),
        ("new", 2),
    ]
    for run in runs:  # each run, and the children it spawned, imported its own tree's
        tree = old if run["tree"] == "old" else new
        where = str(tree / "aioshmq" / "__init__.py")
        source = run["data"]["aioshmq"]
        assert source["file"] == source["file_in_children"] == where, source
        assert run["data"]["only"] == ["serializers"] and run["data"]["mode"] == "tiny"
    assert data["trees"]["old"]["tree"] == str(old) and data["trees"]["new"]["tree"] == str(new)
    assert f"old: {old} (" in proc.stdout and f"new: {new} (" in proc.stdout
    for r in runs[0]["data"]["results"]:
        figures = {
            label: [
                next(
                    x["value"]
                    for x in run["data"]["results"]
                    if (x["case"], x["metric"], x["peer"]) == (r["case"], r["metric"], r["peer"])
                )
                for run in runs
                if run["tree"] == label
            ]
            for label in ("old", "new")
        }
        ratio = statistics.median(figures["new"]) / statistics.median(figures["old"])
        row = re.compile(
            rf"^{re.escape(r['case'])}\s+{re.escape(r['metric'])} \(msg/s\)\s+"
            rf"{re.escape(r['peer'])}\s{{2,}}.*\s{ratio:.2f}$",
            re.MULTILINE,
        )
        assert row.search(proc.stdout), (r, ratio, proc.stdout)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_compare_refuses_a_tree_without_aioshmq_or_without_its_built_core(tmp_path: Path) -> None:
    built = _tree(tmp_path / "built")
    (tmp_path / "empty").mkdir()
    cmd = [sys.executable, "-m", "benchmarks", "compare", str(tmp_path / "empty"), str(built)]
    proc = run_in_session(cmd, ROOT, 30)
    assert proc.returncode == 2 and "no aioshmq package there" in proc.stderr, proc.stderr
    unbuilt = _tree(tmp_path / "unbuilt", built=False)
    env = {key: value for key, value in os.environ.items() if key != "AIOSHMQ_PURE"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "compare", str(unbuilt), str(built)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "build_ext --inplace" in proc.stderr and str(unbuilt) in proc.stderr


@pytest.mark.slow  # milliseconds; in the slow tier with the bench's other new checks
def test_a_full_run_is_kept_under_its_date_commit_and_core(tmp_path: Path) -> None:
    data: dict[str, Any] = {
        "format": "aioshmq-bench/2",
        "started": "2026-12-07T10:00:00Z",
        "aioshmq": {"commit": "abc1234", "dirty": False, "core": "compiled"},
        "results": [],
    }
    assert results_name(data) == "2026-12-07-abc1234-compiled.json"
    first, second = keep(data, tmp_path), keep(data, tmp_path)
    assert [first.name, second.name] == [
        "2026-12-07-abc1234-compiled.json",
        "2026-12-07-abc1234-compiled-2.json",
    ]
    assert load(first) == load(second) == data
    pure = {
        **data,
        "aioshmq": {"commit": None, "dirty": None, "core": "pure (AIOSHMQ_PURE is set)"},
    }
    assert results_name(pure) == "2026-12-07-unknown-pure.json"
    dirty = {**data, "aioshmq": {**data["aioshmq"], "dirty": True}}
    assert results_name(dirty) == "2026-12-07-abc1234-dirty-compiled.json"


PAGE_SOURCE = re.compile(r"^ +python -m benchmarks page (\S+(?: \S+)?) > benchmarks\.md -->$")


@pytest.mark.slow  # milliseconds; in the slow tier with the bench's other new checks
def test_the_committed_page_is_what_page_writes_from_the_committed_results() -> None:
    page = (ROOT / "benchmarks.md").read_text()
    comment = page[: page.index("-->") + 3].splitlines()
    found = [m for line in comment if (m := PAGE_SOURCE.match(line))]
    assert found, "benchmarks.md does not say which results it was written from"
    paths = found[0].group(1).split()
    assert all(path.startswith("benchmarks/results/") for path in paths), paths
    runs = [(path, load(ROOT / path)) for path in paths]
    assert render(runs) == page, "benchmarks.md drifted: run python -m benchmarks page again"
    assert len(page.splitlines()) <= 400
    main = runs[0][1]
    assert main["mode"] == "full" and main["only"] is None and main["aioshmq"]["commit"]
    assert all(run["aioshmq"]["file"] == run["aioshmq"]["file_in_children"] for _, run in runs)


PUBLIC_MODULES = {"aioshmq", "aioshmq.rpc", "aioshmq.remote", "aioshmq.testing"}
ALLOWED_PRIVATE = {"_asdict", "_exit"}  # namedtuple's and os's: public despite the underscore
NOT_HARNESS = {"mutations.py"}  # tests the C core itself, by its files


def _privates(path: Path) -> list[str]:
    """What ``path`` uses of aioshmq beyond its public API: modules other than the public
    ones, names of ``aioshmq`` outside ``aioshmq.__all__``, and underscored attributes of
    anything but the code's own objects."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            modules = [node.value] if node.value.startswith("aioshmq.") else []
        for module in modules:
            if module.split(".")[0] == "aioshmq" and module not in PUBLIC_MODULES:
                found.append(f"{path.name}:{getattr(node, 'lineno', '?')}: {module}")
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id == "aioshmq":
            if node.attr not in aioshmq.__all__ and not node.attr.startswith("__"):
                found.append(f"{path.name}:{node.lineno}: aioshmq.{node.attr}")
        elif node.attr.startswith("_") and not node.attr.startswith("__"):
            own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            own = own or (isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super")
            if not own and node.attr not in ALLOWED_PRIVATE:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.slow  # milliseconds; in the slow tier with the bench's other new checks
def test_the_harness_and_its_tools_use_only_aioshmqs_public_api() -> None:
    """Module paths inside aioshmq change: the bench and its tools must not depend on them."""
    paths = [p for p in (ROOT / "benchmarks").rglob("*.py") if p.name not in NOT_HARNESS]
    assert len(paths) > 10
    assert [found for path in paths for found in _privates(path)] == []


def test_bench_only_rejects_an_unknown_scenario() -> None:
    cmd = [sys.executable, "-m", "benchmarks", "--only", "nonsense"]
    proc = run_in_session(cmd, ROOT, 30)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


@pytest.mark.parametrize("kind", ["small", "tuple"])
def test_a_batch_is_the_messages_one_by_one_and_its_check_finds_one_out_of_order(
    kind: str,
) -> None:
    workload = Workload(kind)  # type: ignore[arg-type]
    batch = workload.make_batch(5, 4)
    assert batch == [workload.make(seq) for seq in range(5, 9)]
    assert len({id(msg) for msg in batch}) == 4  # each made afresh
    workload.check_batch(batch, 5)
    batch[2], batch[3] = batch[3], batch[2]
    with pytest.raises(AssertionError, match="message 7 arrived as 8"):
        workload.check_batch(batch, 5)
    with pytest.raises(AssertionError, match="message 4 arrived as 5"):
        workload.check(workload.make(5), 4)


def test_a_payload_check_finds_a_damaged_array() -> None:
    workload = Workload("array", 1000)
    array = workload.make(0)
    assert workload.make_batch(0, 2) == [array, array]  # one payload, sent again and again
    workload.check_batch([array, array], 0)
    with pytest.raises(AssertionError, match="array 1 arrived damaged"):
        workload.check_batch([array, array[:-1]], 0)


class _LeasingReader:
    """Stands in for a future ``aioshmq.Reader`` with a zero-copy ``lease()``."""

    def __init__(self) -> None:
        self.inside = False
        self.leases = 0

    @asynccontextmanager
    async def lease(self) -> Any:
        self.inside = True
        self.leases += 1
        try:
            yield b"leased"
        finally:
            self.inside = False

    async def get(self) -> Any:
        raise AssertionError("get() used although the reader can lease")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_large_payloads_are_read_through_a_lease_when_the_reader_has_one(
    anyio_backend: str,
) -> None:
    reader = _LeasingReader()
    rx = _AioshmqReceiver(reader, lease=True)  # type: ignore[arg-type]
    assert rx.read == "lease"
    seen = await rx.recv_with(lambda msg: (msg, reader.inside))
    assert seen == (b"leased", True)  # used while the lease was held
    assert reader.leases == 1 and not reader.inside


class _FakeScheduler:
    """Answers every call after a short delay, as 4 workers would, and counts what is in
    flight: the window must keep exactly WINDOW calls there until the clock stops."""

    def __init__(self) -> None:
        self.inflight = 0
        self.most = 0
        self.calls = 0

    async def call(self, x: Any) -> list[Any]:
        return [x] * _rpc.WORKERS

    async def submit(self, x: Any) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self.inflight += 1
        self.calls += 1
        self.most = max(self.most, self.inflight)

        def reply() -> None:
            self.inflight -= 1
            future.set_result([x] * _rpc.WORKERS)

        loop.call_later(0.0001 * (self.calls % 3), reply)
        return future


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_rpc_window_keeps_its_calls_in_flight_and_counts_after_the_warmup(
    anyio_backend: str,
) -> None:
    scheduler = _FakeScheduler()
    session = _rpc.Session()
    await _rpc._window(scheduler, TINY, session)
    assert scheduler.most == _rpc.WINDOW
    assert scheduler.inflight == 0  # every call was awaited, the drained ones too
    assert session.calls == scheduler.calls
    (counted,) = session.counted
    assert 1 <= counted <= session.calls - TINY.warmup_messages
    assert session.rates[0] > 0
    await _rpc._round_trips(scheduler, TINY, session)
    assert 1 <= len(session.samples) <= TINY.round_trips
    assert session.calls == scheduler.calls + TINY.warmup_round_trips + len(session.samples)

"""Shared memory ownership: reserved up front, freed with its last user, even after SIGKILL."""

from __future__ import annotations

import errno
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aioshmq
from aioshmq.memory import segment as _segment
from aioshmq.ring.layout import Layout

RING = 256 << 20
MiB = 1 << 20
# Children import the aioshmq under test, not whichever one their working directory holds.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(aioshmq.__file__)))


def _python(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a new interpreter; it is killed if it outlives ``timeout``."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=PACKAGE_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _fd_links(pid: int) -> dict[str, str]:
    """Where each fd of the process points (fds closed while looking are left out)."""
    links = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links[f"/proc/{pid}/fd/{fd}"] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
    return links


def _holders(name: str, pids: list[int]) -> list[str]:
    """The fds and mappings of the ring's memfd in the given processes (ours, never others')."""
    tag = f"memfd:aioshmq:{name}"
    found = []
    for pid in pids:
        try:
            found += [fd for fd, target in _fd_links(pid).items() if tag in target]
            with open(f"/proc/{pid}/maps") as maps:
                found += [f"/proc/{pid}/maps" for line in maps if tag in line]
        except OSError:
            continue
    return found


def _memfd_fd(pid: int, name: str) -> str:
    """The /proc path of an fd of the ring's memfd in the process."""
    links = [fd for fd, target in _fd_links(pid).items() if f"memfd:aioshmq:{name}" in target]
    assert links, f"process {pid} has no fd of ring {name!r}"
    return links[0]


def _rss_shmem() -> int:
    """Shared memory mapped into this process and present, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem line in /proc/self/status")


def _dev_shm_in_use(pid: int) -> set[str]:
    """Files under /dev/shm that the process has open or mapped."""
    found = {target for target in _fd_links(pid).values() if target.startswith("/dev/shm/")}
    with open(f"/proc/{pid}/maps") as maps:
        found |= {line.split(None, 5)[5].strip() for line in maps if " /dev/shm/" in line}
    return found


def test_memory_is_reserved_at_creation_and_freed_at_close() -> None:
    """Every page is reserved (and mapped) by create; close lets go of the last reference.

    Only this process ever holds the memfd, which has no name: once its fd and mapping
    here are gone, nothing keeps the memory.
    """
    mapped_before = _rss_shmem()
    w = aioshmq.create(capacity=RING)
    try:
        assert os.stat(_memfd_fd(os.getpid(), w.name)).st_blocks * 512 >= RING
        assert _rss_shmem() - mapped_before > RING * 0.9  # mapped now, not on first use
    finally:
        w.close()
    assert not _holders(w.name, [os.getpid()])
    assert _rss_shmem() - mapped_before < RING * 0.1


@pytest.mark.timeout(120)
def test_nothing_survives_sigkill_of_every_process() -> None:
    """A writer and a reader in two processes, both killed: no file, no memory is left.

    The ring's memfd is only ever held by those two (checked while they run); once both
    are dead and this process holds none of it, its memory is gone.
    """
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, aioshmq
            w = aioshmq.create(capacity={RING})
            w.put_sync(b"x" * 1000)
            print(w.name, flush=True)
            sys.stdin.read()
        """),
        ],
        cwd=PACKAGE_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    reader = None
    try:
        assert writer.stdout is not None
        name = writer.stdout.readline().strip()
        reader = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(f"""
                import aioshmq
                r = aioshmq.connect({name!r})
                print(r.get_sync(timeout=30)[:1].decode(), flush=True)
                r.get_sync()
            """),
            ],
            cwd=PACKAGE_ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert reader.stdout is not None
        assert reader.stdout.readline().strip() == "x"
        held = _holders(name, [os.getpid(), writer.pid, reader.pid])
        assert {h.split("/")[2] for h in held} == {str(writer.pid), str(reader.pid)}
        assert os.stat(_memfd_fd(writer.pid, name)).st_blocks * 512 >= RING
        assert not _dev_shm_in_use(writer.pid) and not _dev_shm_in_use(reader.pid)
    finally:
        for proc in (writer, reader):
            if proc is not None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                for stream in (proc.stdin, proc.stdout):
                    if stream is not None:
                        stream.close()
    assert (writer.returncode, reader.returncode) == (-signal.SIGKILL, -signal.SIGKILL)
    assert not _holders(name, [os.getpid()]), "this process holds the ring's memory"
    assert not [f for f in os.listdir("/dev/shm") if name in f]


def test_no_dev_shm_files_ever() -> None:
    before = _dev_shm_in_use(os.getpid())
    with aioshmq.create(capacity=1 << 20) as w, aioshmq.connect(w.name):
        assert _dev_shm_in_use(os.getpid()) <= before
        assert not [f for f in os.listdir("/dev/shm") if w.name in f]


@pytest.mark.parametrize("capacity", [1 << 46])
def test_too_big_for_memory(capacity: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before any of it is reserved: no fallocate of it, nothing left held."""
    reserved: list[int] = []
    fallocate = os.posix_fallocate

    def spy(fd: int, offset: int, length: int) -> None:
        reserved.append(length)
        if length > 16 << 20:  # should the check ever be missed, keep the machine alive
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", spy)
    mapped_before = _rss_shmem()
    with pytest.raises(MemoryError, match=f"capacity={capacity}"):
        aioshmq.create(capacity=capacity)
    assert sum(reserved) < 16 << 20
    assert _rss_shmem() - mapped_before < 16 << 20


# -- the memory limit lookup, on fake trees -----------------------------------------------

DIR = object()  # in a fake tree: a directory where a file should be, so reading it fails


def _fake_root(
    tmp_path: Path,
    cgroup: str,
    mounts: list[str],
    files: dict[str, object],
    mem_available: int | None = 8 << 30,
) -> dict[str, str]:
    """A fake /proc and /sys under tmp_path; the arguments that point the lookup at it.

    ``mounts`` are mountinfo lines from the mount root on; ``files`` maps paths under the
    fake root to their text (or DIR).
    """
    proc = tmp_path / "proc"
    proc.mkdir()
    if mem_available is not None:
        (proc / "meminfo").write_text(
            f"MemTotal: 16000000 kB\nMemFree: 100 kB\nMemAvailable: {mem_available // 1024} kB\n"
        )
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/root rw\n"
        + "".join(f"{30 + i} 22 0:{40 + i} {line}\n" for i, line in enumerate(mounts))
    )
    for rel, text in files.items():
        path = tmp_path / rel
        if text is DIR:
            path.mkdir(parents=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(text))
    return {
        "meminfo": str(proc / "meminfo"),
        "cgroup": str(proc / "cgroup"),
        "mountinfo": str(proc / "mountinfo"),
        "root": str(tmp_path),
    }


def test_lookup_v2_ancestor_holds_the_tightest_limit(tmp_path: Path) -> None:
    """Every cgroup up to the top counts; "max" is no limit; inactive page cache is free."""
    top = "sys/fs/cgroup"
    paths = _fake_root(
        tmp_path,
        "0::/user.slice/app.slice/job.scope\n",
        ["/ /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate"],
        {
            f"{top}/memory.stat": "anon 1\n",  # the root cgroup has no memory.max
            f"{top}/user.slice/memory.max": 1 << 30,
            f"{top}/user.slice/memory.current": 900 * MiB,
            f"{top}/user.slice/app.slice/memory.max": 512 * MiB,
            f"{top}/user.slice/app.slice/memory.current": 400 * MiB,
            f"{top}/user.slice/app.slice/memory.stat": f"anon 1\ninactive_file {100 * MiB}\n",
            f"{top}/user.slice/app.slice/job.scope/memory.max": "max\n",
            f"{top}/user.slice/app.slice/job.scope/memory.current": 300 * MiB,
        },
    )
    bound = _segment.available_memory(**paths)
    assert bound is not None
    assert bound.available == 124 * MiB
    assert bound.source == (
        f"memory cgroup v2 {tmp_path / top / 'user.slice'}: "
        f"memory.max {1 << 30}, {900 * MiB} in use"
    )

    (tmp_path / top / "user.slice/memory.current").write_text(str(2 << 30))
    bound = _segment.available_memory(**paths)
    assert bound is not None and bound.available == 0  # over its limit: nothing is free


def test_lookup_v1_under_a_container_mount_root(tmp_path: Path) -> None:
    """Inside a container the hierarchy is mounted from the container's cgroup: the path in
    /proc/self/cgroup is relative to that mount root, not to the mount point."""
    top = "sys/fs/cgroup/memory"
    paths = _fake_root(
        tmp_path,
        "12:memory:/docker/a b/worker\n5:cpu,cpuacct:/docker/a b\n0::/\n",
        [
            r"/docker/a\040b /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory",
            r"/docker/a\040b /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct",
            "/ /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw",
        ],
        {
            f"{top}/memory.limit_in_bytes": 256 * MiB,
            f"{top}/memory.usage_in_bytes": 100 * MiB,
            f"{top}/memory.stat": f"cache 1\ntotal_inactive_file {44 * MiB}\n",
            f"{top}/worker/memory.limit_in_bytes": 9223372036854771712,  # v1's "no limit"
            f"{top}/worker/memory.usage_in_bytes": 30 * MiB,
            # Where the cgroup would be if the mount root were ignored:
            f"{top}/docker/a b/worker/memory.limit_in_bytes": MiB,
            f"{top}/docker/a b/worker/memory.usage_in_bytes": 0,
            "sys/fs/cgroup/cpu,cpuacct/worker/memory.limit_in_bytes": MiB,
        },
    )
    bound = _segment.available_memory(**paths)
    assert bound == _segment.MemoryBound(
        200 * MiB,
        f"memory cgroup v1 {tmp_path / top}: memory.limit_in_bytes {256 * MiB}, {56 * MiB} in use",
    )


def test_lookup_without_limits_is_mem_available(tmp_path: Path) -> None:
    top = "sys/fs/cgroup"
    paths = _fake_root(
        tmp_path,
        "4:memory:/a/b\n0::/a/b\n",
        [
            "/ /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory",
            "/ /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw",
        ],
        {
            f"{top}/memory/memory.limit_in_bytes": 9223372036854771712,
            f"{top}/memory/a/memory.limit_in_bytes": 9223372036854771712,
            f"{top}/memory/a/b/memory.limit_in_bytes": 9223372036854771712,
            f"{top}/memory/a/b/memory.usage_in_bytes": 5 * MiB,
            f"{top}/unified/a/memory.max": "max\n",
            f"{top}/unified/a/b/memory.max": "max\n",
        },
        mem_available=3 << 30,
    )
    assert _segment.available_memory(**paths) == _segment.MemoryBound(
        3 << 30, f"MemAvailable in {paths['meminfo']}"
    )


def test_lookup_unreadable_is_no_limit(tmp_path: Path) -> None:
    """A file that cannot be read or parsed is no limit, and never an error."""
    top = "sys/fs/cgroup"
    paths = _fake_root(
        tmp_path,
        "0::/a/b/c\n",
        ["/ /sys/fs/cgroup rw - cgroup2 cgroup2 rw"],
        {
            f"{top}/a/b/c/memory.max": DIR,
            f"{top}/a/b/c/memory.current": 0,
            f"{top}/a/b/memory.max": "lots\n",
            f"{top}/a/b/memory.current": 0,
            f"{top}/a/memory.max": 300 * MiB,
            f"{top}/a/memory.current": DIR,  # the limit alone still bounds
            f"{top}/a/memory.stat": "inactive_file many\n",
        },
    )
    bound = _segment.available_memory(**paths)
    assert bound is not None
    assert (bound.available, bound.source.split(":")[0]) == (
        300 * MiB,
        f"memory cgroup v2 {tmp_path / top / 'a'}",
    )

    mem_only = _segment.MemoryBound(8 << 30, f"MemAvailable in {paths['meminfo']}")
    for broken in ("cgroup", "mountinfo"):
        assert _segment.available_memory(**{**paths, broken: str(tmp_path / "nowhere")}) == (
            mem_only
        )
    outside = tmp_path / "outside"
    outside.write_text("0::/../elsewhere\n")
    assert _segment.available_memory(**{**paths, "cgroup": str(outside)}) == mem_only
    garbage = tmp_path / "garbage"
    garbage.write_text("MemAvailable: lots kB\n")
    assert _segment.available_memory(**{**paths, "meminfo": str(garbage)}) == bound
    nothing = {key: str(tmp_path / "nowhere") for key in ("meminfo", "cgroup", "mountinfo")}
    assert _segment.available_memory(**nothing) is None


def test_refusal_names_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    source = "memory cgroup v2 /sys/fs/cgroup/job: memory.max 1048576, 0 in use"
    monkeypatch.setattr(_segment, "available_memory", lambda: _segment.MemoryBound(MiB, source))
    size = Layout(4 * MiB, 1, 1).size
    with pytest.raises(MemoryError) as info:
        aioshmq.create(capacity=4 * MiB)
    assert str(info.value) == (
        f"capacity={4 * MiB} needs {size} bytes of shared memory, "
        f"but only {MiB} are available ({source})"
    )


# -- real limits --------------------------------------------------------------------------


def _own_cgroup(version: int) -> Path | None:
    """This process's cgroup directory in the v1 memory or the v2 hierarchy, if mounted."""
    path = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            hier, controllers, cg = line.rstrip("\n").split(":", 2)
            if (version == 2 and hier == "0") or (
                version == 1 and "memory" in controllers.split(",")
            ):
                path = cg
    if path is None:
        return None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            rest = fields[fields.index("-") + 1 :]
            if version == 2 and rest[0] != "cgroup2":
                continue
            if version == 1 and (rest[0] != "cgroup" or "memory" not in rest[2].split(",")):
                continue
            mount_root = fields[3].replace("\\040", " ").rstrip("/")
            if path == mount_root or path.startswith(mount_root + "/"):
                return Path(fields[4].replace("\\040", " "), path[len(mount_root) :].lstrip("/"))
    return None


@pytest.fixture
def memory_cgroup() -> Iterator[tuple[int, Path]]:
    """A new memory cgroup limited to 256 MiB, made under this process's own (v2 where its
    memory controller is available there, else v1); removed once the test is over."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    reasons = []
    for version, limit_file in ((2, "memory.max"), (1, "memory.limit_in_bytes")):
        parent = _own_cgroup(version)
        if parent is None:
            reasons.append(f"no cgroup v{version} hierarchy with the memory controller")
            continue
        if version == 2:
            try:
                enabled = (parent / "cgroup.subtree_control").read_text().split()
            except OSError as exc:
                reasons.append(f"cgroup v2 {parent}: {exc}")
                continue
            if "memory" not in enabled:
                reasons.append(f"cgroup v2 {parent} does not give its children memory limits")
                continue
        elif not (parent / limit_file).exists():
            reasons.append(f"no memory controller in {parent}")
            continue
        child = parent / f"aioshmq-test-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            child.mkdir()
        except OSError as exc:
            reasons.append(f"cannot make a cgroup under {parent}: {exc}")
            continue
        try:
            try:
                (child / limit_file).write_text(str(256 * MiB))
            except OSError as exc:
                reasons.append(f"cannot limit cgroup {child}: {exc}")
                continue
            yield version, child
            return
        finally:
            child.rmdir()  # its processes have exited: every test waits for its child
    pytest.skip("; ".join(reasons))


@pytest.mark.timeout(180)
def test_memory_cgroup_limit_is_refused_not_oom_killed(memory_cgroup: tuple[int, Path]) -> None:
    """A ring larger than the cgroup allows raises MemoryError (the machine has far more
    free); without the check the child would be OOM-killed inside posix_fallocate."""
    version, cgroup = memory_cgroup
    child = _python(
        """
        import os, sys
        with open(sys.argv[1], "w") as f:
            f.write(str(os.getpid()))
        import aioshmq
        try:
            aioshmq.create(capacity=300 << 20)
        except MemoryError as exc:
            print("refused:", exc, flush=True)
        else:
            print("created", flush=True)
        with aioshmq.create(capacity=16 << 20) as w, aioshmq.connect(w.name) as r:
            w.put_sync(b"x" * 1000)
            print("small ring:", len(r.get_sync(timeout=10)), flush=True)
        """,
        str(cgroup / "cgroup.procs"),
        timeout=120,
    )
    assert child.returncode == 0, f"child ended with {child.returncode}: {child.stderr}"
    refusal, small = child.stdout.splitlines()
    size = Layout(300 * MiB, 1, 1).size
    assert refusal.startswith(f"refused: capacity={300 * MiB} needs {size} bytes")
    assert f"memory cgroup v{version} {cgroup}:" in refusal
    assert small == "small ring: 1000"


_FDS = textwrap.dedent("""
    def fds():
        return {
            f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}"
            for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")
        }

    def ring_mapped():
        with open("/proc/self/maps") as maps:
            return [line for line in maps if "memfd:aioshmq" in line]

    def limit_address_space(room):
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + room, resource.RLIM_INFINITY))

    def report(exc):
        cause = exc.__cause__
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "cause": [type(cause).__name__, getattr(cause, "errno", None)],
        }
""")


def _report(child: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert child.returncode == 0, f"child ended with {child.returncode}: {child.stderr}"
    result: dict[str, Any] = json.loads(child.stdout)
    return result


def _under_rlimit_as(call: str) -> dict[str, Any]:
    """What ``call`` raised in a child whose address space has 32 MiB to spare, and the fds
    and ring mappings it left there."""
    child = _python(
        _FDS
        + textwrap.dedent(f"""
    import json, os, resource, aioshmq
    before = fds()
    limit_address_space(32 << 20)
    try:
        {call}
    except BaseException as exc:
        result = report(exc)
    else:
        result = {{"type": None}}
    result["left"] = sorted(fds() - before) + ring_mapped()
    print(json.dumps(result))
    """)
    )
    return _report(child)


@pytest.mark.timeout(120)
def test_create_under_rlimit_as_is_memory_error() -> None:
    """An address space too small for the mapping: MemoryError (from the ENOMEM), and the
    memfd, reserved by then, is closed."""
    capacity = 128 * MiB
    result = _under_rlimit_as(f"aioshmq.create(capacity={capacity})")
    assert result["type"] == "MemoryError", result
    assert result["message"].startswith(
        f"cannot map the ring's {Layout(capacity, 1, 1).size} bytes of shared memory"
    )
    assert "RLIMIT_AS" in result["message"]
    assert result["cause"] == ["OSError", errno.ENOMEM]
    assert result["left"] == []


@pytest.mark.timeout(120)
def test_attach_under_rlimit_as_is_memory_error() -> None:
    """A reader whose address space cannot take the ring: MemoryError, no fd or mapping left
    behind, and the writer goes on serving other readers."""
    with aioshmq.create(capacity=128 * MiB) as w:
        size = os.stat(_memfd_fd(os.getpid(), w.name)).st_size
        result = _under_rlimit_as(f"aioshmq.connect({w.name!r})")
        assert result["type"] == "MemoryError", result
        assert result["message"].startswith(f"cannot map the ring's {size} bytes of shared memory")
        assert result["cause"] == ["OSError", errno.ENOMEM]
        assert result["left"] == []
        with aioshmq.connect(w.name, timeout=10) as r:
            w.put_sync({"after": 1})
            assert r.get_sync(timeout=10) == {"after": 1}

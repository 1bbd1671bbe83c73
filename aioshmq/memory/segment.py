"""Ownership of one ring's shared memory: an anonymous memfd mapping that cannot leak."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import resource
from collections.abc import Iterator
from typing import NamedTuple, Protocol

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

# cgroup v1 shows "no limit" as the largest page count times the page size (about 2**63).
_V1_UNLIMITED = 1 << 62


class _Releasable(Protocol):
    def release(self) -> None: ...


class Segment:
    """A mapping of a memfd, with a u64 view for counters and a byte view for data.

    memfd has no name to leak and is not limited by the size of /dev/shm; its memory goes
    back to the system when the last fd and the last mapping are gone, whichever process
    held them and however it ended.  The fd is closed as soon as the mapping exists, or
    fails to (or kept by the writer, which hands it to readers).
    """

    __slots__ = ("_map", "_views", "buf", "data", "fd", "words")

    def __init__(self, fd: int, size: int, *, keep_fd: bool) -> None:
        # Map every page now: the first pass through a large ring would otherwise take a
        # page fault every 4 KiB inside put and get.
        try:
            self._map = _map_shared(fd, size)
        finally:
            if not keep_fd:
                os.close(fd)
        self.buf = memoryview(self._map)
        self.words = self.buf[: size - size % 8].cast("Q")
        self.data = self.buf  # narrowed to the data area by create() and the reader
        self._views: list[_Releasable] = []
        self.fd = fd if keep_fd else -1

    @classmethod
    def create(cls, size: int, data_offset: int, name: str, what: str) -> Segment:
        """A new segment of ``size`` bytes whose data area starts at ``data_offset``, every
        page reserved; ``name`` names the memfd (as /proc shows it), ``what`` the ring in
        errors (its capacity, say)."""
        bound = available_memory()
        if bound is not None and size > bound.available:
            # Reserving more than is free would push the machine, or the memory cgroup this
            # process runs in, into the OOM killer.
            raise MemoryError(
                f"{what} needs {size} bytes of shared memory, "
                f"but only {bound.available} are available ({bound.source})"
            )
        fd = os.memfd_create(f"aioshmq:{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            try:
                # Reserve every page now: a full tmpfs or memory cgroup fails here, not with
                # SIGBUS at some later write.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise MemoryError(
                        f"cannot reserve {size} bytes of shared memory for a ring of "
                        f"{what}: {exc.strerror}"
                    ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            seg = cls(fd, size, keep_fd=True)
        except BaseException:
            os.close(fd)
            raise
        seg.data = seg.buf[data_offset:size]
        return seg

    @classmethod
    def attach(cls, fd: int) -> Segment:
        """Map a segment received from a writer; takes ownership of ``fd``, even on error."""
        try:
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size, keep_fd=False)

    def protect_data(self, offset: int) -> None:
        """Make the data area, from ``offset`` (page-aligned) on, read-only in this process:
        what a reader leases cannot be written through, by numpy, torch or anything else,
        so one reader cannot change a message the others still read."""
        self.data = self.buf[offset:].toreadonly()
        length = len(self.buf) - offset
        if length <= 0:
            return
        anchor = ctypes.c_char.from_buffer(self._map)
        try:
            address = ctypes.addressof(anchor) + offset
        finally:
            del anchor  # its export of the mapping ends here
        if _libc.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(length), mmap.PROT_READ):
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect of the ring's data area failed: {os.strerror(err)}")

    def data_words(self) -> memoryview:
        """The data area as u64 words; released by ``close()``."""
        v = self.data.cast("Q")
        self._views.append(v)
        return v

    @property
    def mapping(self) -> mmap.mmap:
        """The mapping itself: a view taken of it keeps it mapped until released."""
        return self._map

    def track(self, user: _Releasable) -> None:
        """Release ``user`` (a view, a ring core) first when the segment closes."""
        self._views.append(user)

    def close(self) -> None:
        """Unmap, or leave the unmapping to the GC while a caller still holds a view."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for v in self._views:
            v.release()
        self.data.release()
        self.words.release()
        self.buf.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes with it


def _map_shared(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of ``fd``; MemoryError where this process's address space has no room
    (RLIMIT_AS, say), rather than a bare ENOMEM."""
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        shown = "" if limit == resource.RLIM_INFINITY else f" (RLIMIT_AS is {limit} bytes)"
        raise MemoryError(
            f"cannot map the ring's {size} bytes of shared memory into this process: "
            f"{exc.strerror}{shown}"
        ) from exc


class MemoryBound(NamedTuple):
    """How much memory one limit leaves for a new ring, and which limit that is."""

    available: int  #: bytes
    source: str  #: "MemAvailable in /proc/meminfo", or the memory cgroup and its numbers


def available_memory(
    meminfo: str = "/proc/meminfo",
    cgroup: str = "/proc/self/cgroup",
    mountinfo: str = "/proc/self/mountinfo",
    root: str = "/",
) -> MemoryBound | None:
    """The tightest bound on the memory this process can still take: MemAvailable, or the
    limit of its memory cgroup or of an ancestor, whichever leaves least.

    In a container or a systemd slice the machine's MemAvailable can be far more than the
    cgroup allows, and going past the cgroup's limit gets the process OOM-killed instead of
    refused.  v1 and v2 hierarchies both count.  ``root`` is prepended to the mount points
    read from ``mountinfo`` (tests point every path at a fake tree).  Whatever cannot be
    read is no limit; None where nothing is.
    """
    bounds: list[MemoryBound] = []
    try:
        with open(meminfo, "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    kib = int(line.split()[1])
                    bounds.append(MemoryBound(kib * 1024, f"MemAvailable in {meminfo}"))
                    break
    except (OSError, ValueError, IndexError):
        pass
    for version, top, parts in _memory_cgroups(cgroup, mountinfo, root):
        for depth in range(len(parts), -1, -1):
            bound = _cgroup_bound(version, os.path.join(top, *parts[:depth]))
            if bound is not None:
                bounds.append(bound)
    return min(bounds, key=lambda b: b.available, default=None)


def _memory_cgroups(cgroup: str, mountinfo: str, root: str) -> Iterator[tuple[int, str, list[str]]]:
    """(version, directory of the cgroup a mount shows at its top, path components from
    there to this process's own cgroup) for the v1 memory hierarchy and for v2."""
    paths: dict[int, str] = {}
    try:
        with open(cgroup, encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and not parts[1]:
                    paths[2] = parts[2]
                elif "memory" in parts[1].split(","):
                    paths[1] = parts[2]
        if not paths:
            return
        mounts = _cgroup_mounts(mountinfo)
    except (OSError, ValueError):
        return
    for version, path in paths.items():
        best: tuple[str, str] | None = None  # the mount whose root holds path most closely
        for mount_version, mount_root, mount_point in mounts:
            if mount_version != version:
                continue
            base = mount_root.rstrip("/")
            if (path == base or path.startswith(base + "/")) and (
                best is None or len(mount_root) > len(best[0])
            ):
                best = (mount_root, mount_point)
        if best is None:
            continue
        parts = [p for p in path[len(best[0].rstrip("/")) :].split("/") if p]
        if ".." in parts:
            continue  # outside what this cgroup namespace shows
        yield version, os.path.normpath(os.path.join(root, best[1].lstrip("/"))), parts


def _cgroup_mounts(mountinfo: str) -> list[tuple[int, str, str]]:
    """(version, mount root, mount point) of each v1 memory and each v2 cgroup mount."""
    mounts = []
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            try:
                sep = fields.index("-", 6)
            except ValueError:
                continue
            rest = fields[sep + 1 :]
            if rest and rest[0] == "cgroup2":
                version = 2
            elif rest[:1] == ["cgroup"] and len(rest) > 2 and "memory" in rest[2].split(","):
                version = 1
            else:
                continue
            mounts.append((version, _unescape(fields[3]), _unescape(fields[4])))
    return mounts


def _unescape(field: str) -> str:
    """A mountinfo path, whose spaces, tabs, newlines and backslashes are octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_bound(version: int, directory: str) -> MemoryBound | None:
    """What one cgroup's memory limit leaves free; None where it has no readable limit.

    Inactive page cache counts as free, as it does in MemAvailable: the kernel reclaims it
    before the cgroup's OOM killer runs.
    """
    if version == 2:
        files = ("memory.max", "memory.current", "inactive_file")  # memory.max may be "max"
    else:
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    limit = _read_int(os.path.join(directory, files[0]))
    if limit is None or (version == 1 and limit >= _V1_UNLIMITED):
        return None
    usage = _read_int(os.path.join(directory, files[1])) or 0  # the limit alone still bounds
    in_use = max(usage - _stat(os.path.join(directory, "memory.stat"), files[2]), 0)
    return MemoryBound(
        max(limit - in_use, 0),
        f"memory cgroup v{version} {directory}: {files[0]} {limit}, {in_use} in use",
    )


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _stat(path: str, key: str) -> int:
    """One counter of a memory.stat file; 0 where it cannot be read."""
    try:
        with open(path, "rb") as f:
            for line in f:
                name, _, value = line.partition(b" ")
                if name == key.encode():
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0

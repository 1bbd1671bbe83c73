"""Ownership of one ring's shared memory: an anonymous memfd mapping that cannot leak."""

from __future__ import annotations

import errno
import mmap
import os

from ._layout import Layout

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class Segment:
    """A mapping of a memfd, with a u64 view for counters and a byte view for data.

    memfd has no name to leak and is not limited by the size of /dev/shm; its memory goes
    back to the system when the last fd and the last mapping are gone, whichever process
    held them and however it ended.  The fd is closed as soon as the mapping exists (or
    kept by the writer, which hands it to readers).
    """

    __slots__ = ("_map", "_views", "buf", "data", "fd", "words")

    def __init__(self, fd: int, size: int, *, keep_fd: bool) -> None:
        # Map every page now: the first pass through a large ring would otherwise take a
        # page fault every 4 KiB inside put and get.
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        self.buf = memoryview(self._map)
        self.words = self.buf[: size - size % 8].cast("Q")
        self.data = self.buf  # narrowed to the data area by create() and the reader
        self._views: list[memoryview] = []
        self.fd = fd if keep_fd else -1
        if not keep_fd:
            os.close(fd)

    @classmethod
    def create(cls, layout: Layout, name: str) -> Segment:
        available = _available_memory()
        if available is not None and layout.size > available:
            # Reserving more than is free would push the machine into the OOM killer.
            raise MemoryError(
                f"capacity={layout.capacity} needs {layout.size} bytes of shared memory, "
                f"but only {available} are available"
            )
        fd = os.memfd_create(f"aioshmq:{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, layout.size)
            try:
                # Reserve every page now: a full tmpfs or memory cgroup fails here, not with
                # SIGBUS at some later write.
                os.posix_fallocate(fd, 0, layout.size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise MemoryError(
                        f"cannot reserve {layout.size} bytes of shared memory for a ring of "
                        f"capacity={layout.capacity}: {exc.strerror}"
                    ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            seg = cls(fd, layout.size, keep_fd=True)
        except BaseException:
            os.close(fd)
            raise
        seg.data = seg.buf[layout.data_offset : layout.size]
        return seg

    @classmethod
    def attach(cls, fd: int) -> Segment:
        """Map a segment received from a writer; takes ownership of ``fd``."""
        try:
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size, keep_fd=False)

    def data_words(self) -> memoryview:
        """The data area as u64 words; released by ``close()``."""
        v = self.data.cast("Q")
        self._views.append(v)
        return v

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


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None

"""Same-host payloads as files in /dev/shm: the source writes a segment, the sink maps it and copies out.

Plain files + mmap rather than multiprocessing.shared_memory: that module's resource tracker unlinks segments
it merely attached to when the attaching process exits. Segment names carry their owner (`Owner`: the pid, for
people, and a random id), and each owner holds an flock on a lock file of its own for as long as it lives, so a
restarted source removes what a killed one left behind (sweep_orphans) by the lock, never by the pid: workers in
pods share the host's /dev/shm from PID namespaces of their own, where one pod's pid means nothing to another
(each worker is PID 1 of its pod; until 2026-12-07 a killed one's segments stayed for good, and a live one's in
another namespace could be swept). This module must never decide lifetimes; the source does.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import mmap
import os
import re
import secrets
import uuid

from .buffers import advise_hugepages

log = logging.getLogger("rackserve.kvtransfer")
PREFIX = "rackserve-kv-"
# <pid>-<owner id>-<segment id>; a reader also takes an older producer's <pid>-<segment id>
_NAME = re.compile(rf"^{PREFIX}\d+-[0-9a-f]+(?:-[0-9a-f]+)?$")
_OWNED = re.compile(rf"^({PREFIX}\d+-[0-9a-f]{{16}})(?:-[0-9a-f]+|\.lock)$")


class Owner:
    """One source's claim on its segments: an flock held on `<PREFIX><pid>-<id>.lock` while the process lives
    (the kernel drops it when the process dies, however it dies), and the names of the segments it makes."""

    def __init__(self, directory: str, pid: int | None = None) -> None:
        self.stem = f"{PREFIX}{os.getpid() if pid is None else pid}-{secrets.token_hex(8)}"
        self.lock_path = os.path.join(directory, self.stem + ".lock")
        # locked under a temporary name, then renamed: a sweeper never sees the lock file unlocked
        making = os.path.join(directory, f".{self.stem}.{os.getpid()}")
        self._fd = os.open(making, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(making, self.lock_path)
        except BaseException:
            os.close(self._fd)
            with contextlib.suppress(OSError):
                os.unlink(making)
            raise

    def segment_name(self) -> str:
        return f"{self.stem}-{uuid.uuid4().hex}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.lock_path)
        with contextlib.suppress(OSError):
            os.close(self._fd)


class Segment:
    """A writable segment owned by the source; unlink() removes the name, close() the mapping."""

    def __init__(self, directory: str, name: str, payload: bytes | bytearray | memoryview) -> None:
        self.path = os.path.join(directory, name)
        self.name = name
        self.size = len(payload)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            by_write = not _tmpfs_huge_on_advice()
            if by_write:  # write(2) fills the pages in the kernel: no page fault per 4 KiB (0.55x the time)
                _write_all(fd, memoryview(payload).cast("B"))
            os.ftruncate(fd, max(self.size, 1))
            self.map = mmap.mmap(fd, max(self.size, 1))
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        if not by_write:  # huge pages only for a mapping that asks: copy through the advised mapping
            advise_hugepages(self.map)
            self.map[: self.size] = payload

    def view(self) -> memoryview:
        return memoryview(self.map)[: self.size]

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        try:
            self.map.close()
        except BufferError:  # a view still exported: the mapping goes with its last view
            log.debug("shm segment %s still has views; left to the garbage collector", self.name)


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], done)


@functools.cache
def _tmpfs_huge_on_advice() -> bool:
    """Whether shared memory gets transparent huge pages only where a mapping asks (shmem_enabled = advise):
    then a segment is filled through an advised mapping, otherwise by write(2), which takes whatever pages the
    kernel's policy gives any write."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return "[advise]" in f.read()
    except OSError:
        return False


def copy_out(directory: str, name: str, into: memoryview) -> None:
    """Copy the whole segment `name` into `into` (its size must match)."""
    if not _NAME.match(name):
        raise FileNotFoundError(f"not a rackserve segment name: {name!r}")
    fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if len(into) == 0:
            return
        if size < len(into):
            raise ValueError(f"segment {name} holds {size} bytes, expected {len(into)}")
        with mmap.mmap(fd, len(into), prot=mmap.PROT_READ) as m:
            into[:] = m  # one memcpy
    finally:
        os.close(fd)


def _owner_gone(directory: str, stem: str) -> bool:
    """Whether the owner `stem` is gone: its lock file is missing (closed, or swept) or can be locked."""
    try:
        fd = os.open(os.path.join(directory, stem + ".lock"), os.O_RDWR)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its owner lives
    finally:
        os.close(fd)
    return True


def sweep_orphans(directory: str) -> int:
    """Remove the segments (and lock files) of owners that are gone; returns how many segments. Segments of an
    older producer (named by pid alone) are left alone: a pid cannot say whether their owner lives."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    owners: dict[str, list[str]] = {}
    for name in names:
        m = _OWNED.match(name)
        if m:
            owners.setdefault(m.group(1), []).append(name)
    for stem, owned in owners.items():
        if not _owner_gone(directory, stem):
            continue
        # segments first, the lock file last: a sweep cut short leaves the lock file to find the rest again
        for name in sorted(owned, key=lambda n: n.endswith(".lock")):
            try:
                os.unlink(os.path.join(directory, name))
                removed += not name.endswith(".lock")
            except OSError:
                pass
    if removed:
        log.info("removed %d shm segments left by dead producers in %s", removed, directory)
    return removed

"""Memory that KV transfers read from and write into: anonymous mappings advised to use transparent huge pages.

Why: a NIXL/UCX READ on one host is a process_vm_readv that pins the source pages one page at a time; over 4 KiB
pages that costs ~25 % of a 64 MiB pull, over 2 MiB pages almost nothing (measured: bench/kvtransfer_bench.py).
A fresh receive buffer also takes 512x fewer page faults. Where the kernel gives no huge pages (THP "never")
these are plain anonymous mappings and everything still works. This module must never decide what to copy.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE_BYTES = 2 << 20


def hugepage_buffer(size: int) -> mmap.mmap:
    """A zeroed, writable anonymous mapping of at least `size` bytes (rounded up to whole huge pages)."""
    length = max(HUGE_PAGE_BYTES, -(-size // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)
    m = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_hugepages(m)
    return m


def allocate(size: int) -> memoryview:
    """A zeroed writable buffer of exactly `size` bytes: huge-page backed from one huge page up, else a
    bytearray (a small payload would waste most of a 2 MiB page)."""
    if size < HUGE_PAGE_BYTES:
        return memoryview(bytearray(size))
    return memoryview(hugepage_buffer(size))[:size]  # the view keeps the mapping alive


def advise_hugepages(m: mmap.mmap) -> None:
    """Ask for transparent huge pages on a mapping (a no-op where the kernel or platform does not offer them)."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


def address_of(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (for NIXL descriptors)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)

"""Device memory that KV copies in transit may take beside a worker's KV cache.

A GPU worker's KV cache is sized to the memory its plan gives it; two kinds of KV copy sit outside that plan for a
while: a prefill worker's device copy of a prompt's KV, kept for device-direct readers (cuda_ipc, NIXL VRAM) until
one has read it, and a decode (or prefix-pulling) worker's device-direct pull, held until the engine has written it
into its blocks. Each side counts its copies against a DeviceBudget, which the worker's KV memory plan sets aside;
a copy that would not fit is not made (the host bytes are used instead), so copies in transit never take memory
the plan gave the cache or the forward pass.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any


class DeviceBudget:
    """At most `cap` bytes (None: no limit) of device copies reserved at once. Thread-safe: engine, publishing
    and pulling threads reserve, any thread gives back."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._held = 0

    @property
    def held(self) -> int:
        """Bytes reserved now (copies being made, and those alive)."""
        return self._held

    def reserve(self, nbytes: int) -> DeviceRoom | None:
        """Room for a copy of nbytes, or None if it would not fit beside what is held."""
        with self._lock:
            if self.cap is not None and self._held + nbytes > self.cap:
                return None
            self._held += nbytes
        return DeviceRoom(self, nbytes)

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes


class DeviceRoom:
    """Room reserved in a DeviceBudget: give() returns it, once however often it is called."""

    def __init__(self, budget: DeviceBudget, nbytes: int) -> None:
        self._budget, self.nbytes = budget, nbytes
        self._given = False
        self._lock = threading.Lock()

    def give(self) -> None:
        with self._lock:
            if self._given:
                return
            self._given = True
        self._budget._give(self.nbytes)

    def give_with(self, copy: Any) -> None:
        """Give the room back when `copy` (the tensor it was reserved for) is garbage: whoever drops it last."""
        weakref.finalize(copy, self.give)

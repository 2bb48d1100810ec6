"""Block bookkeeping of the paged KV cache: which block holds what, who uses it, and what may be evicted.

Blocks are reference-counted. A block that is full and computed gets its chained hash (block_hash.py) and enters
the prefix cache; when its last user lets go it stays cached but becomes *free*, and free blocks are reused in
least-recently-freed order — reusing a cached block evicts its hash. Every store and eviction is recorded as a
`KvEvent` so the router's global prefix index can follow along.

The tensors themselves live in model.PagedKvCache; this room only hands out block ids.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal


class NoFreeBlocksError(RuntimeError):
    """The cache has fewer free blocks than an operation needs."""


@dataclass(frozen=True)
class KvEvent:
    kind: Literal["stored", "evicted"]
    block_hash: int
    parent_hash: int  # ROOT_HASH for a first block; lets an index rebuild chains
    block_id: int


@dataclass
class BlockState:
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int = 0


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[BlockState] = field(init=False)
    _free: OrderedDict[int, None] = field(init=False)  # head = evicted first
    _cached: dict[int, int] = field(init=False)  # block hash -> block id
    _events: list[KvEvent] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [BlockState() for _ in range(self.num_blocks)]
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached = {}
        self._events = []

    # ---------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, hashes: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of a chain of block hashes."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        for h in hashes:
            bid = self._cached.get(h)
            if bid is None:
                break
            found.append(bid)
        return found

    def free_after_acquiring(self, cached_ids: list[int]) -> int:
        """How many blocks would be free after taking these cached ones (some of them may sit in the free list)."""
        return self.num_free - sum(1 for b in cached_ids if self.blocks[b].ref_count == 0)

    # ---------------------------------------------------------------- mutations
    def acquire(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by lookup_prefix."""
        for b in block_ids:
            st = self.blocks[b]
            if st.ref_count == 0:
                del self._free[b]
            st.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            st = self.blocks[b]
            if st.block_hash is not None:
                self._evict(b)
            st.ref_count = 1
            out.append(b)
        return out

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; blocks nobody uses become free (later blocks are evicted first)."""
        for b in reversed(block_ids):
            st = self.blocks[b]
            if st.ref_count <= 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            st.ref_count -= 1
            if st.ref_count == 0:
                if st.block_hash is None or not self.enable_prefix_caching:
                    self._free[b] = None
                    self._free.move_to_end(b, last=False)  # uncached blocks are the cheapest to reuse
                else:
                    self._free[b] = None

    def commit(self, block_id: int, block_hash: int, parent_hash: int) -> None:
        """Register a full, computed block under its chained hash (no-op if that hash is cached already)."""
        if not self.enable_prefix_caching:
            return
        st = self.blocks[block_id]
        if st.block_hash is not None or block_hash in self._cached:
            return
        st.block_hash, st.parent_hash = block_hash, parent_hash
        self._cached[block_hash] = block_id
        self._events.append(KvEvent("stored", block_hash, parent_hash, block_id))

    def _evict(self, b: int) -> None:
        st = self.blocks[b]
        assert st.block_hash is not None
        del self._cached[st.block_hash]
        self._events.append(KvEvent("evicted", st.block_hash, st.parent_hash, b))
        st.block_hash = None

    def drain_events(self) -> list[KvEvent]:
        ev, self._events = self._events, []
        return ev

    def cached_hashes(self) -> list[int]:
        """Every hash the cache holds now (for a router that subscribes late and needs a snapshot)."""
        return list(self._cached)

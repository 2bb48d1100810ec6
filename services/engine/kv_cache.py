"""Block bookkeeping of the paged KV cache: which block holds what, who uses it, and what may be evicted.

Blocks are reference-counted. A block that is full and computed gets its chained hash (block_hash.py) and enters
the prefix cache; when its last user lets go it stays cached but becomes *free*, and free blocks are reused in
least-recently-freed order — reusing a cached block evicts its hash. Every store and eviction is recorded as a
`KvEvent` so the router's global prefix index can follow along.

With a second tier (kv_tier.HostKvTier), an evicted block's K/V moves there instead of vanishing, and a lookup
that misses the primary pool can continue into it: `take_tier2` removes the blocks to restore, the scheduler
allocates primary blocks for them and `commit_restored` makes each a normal cached block again (same chained
hash, same parent). Events name the tier: `stored`/`evicted` keep their meaning for the primary pool (computed
into it / left it); `offloaded` follows an `evicted` when the block went to tier 2, `restored` is tier 2 -> primary
(not computed), `dropped` is a block leaving tier 2 for good. With a disk tier below (kv_disk.DiskKvTier), those
three events carry `tier="disk"` for it: a block the host tier pushes out goes on to disk (`dropped` host, then
`offloaded` disk), with the host tier off an evicted block goes straight there, and a lookup continues
pool -> host -> disk (`take_disk`).

The tensors themselves live in model.PagedKvCache (and the tier); this room only hands out block ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from services.engine.kv_disk import DiskKvTier
    from services.engine.kv_tier import EncodedBlock, HostKvTier, TierEntry

KvEventKind = Literal["stored", "evicted", "offloaded", "restored", "dropped"]
KvTierName = Literal["host", "disk"]


class NoFreeBlocksError(RuntimeError):
    """The cache has fewer free blocks than an operation needs."""


@dataclass(frozen=True)
class KvEvent:
    kind: KvEventKind
    block_hash: int
    parent_hash: int  # ROOT_HASH for a first block; lets an index rebuild chains
    block_id: int
    tier: KvTierName = "host"  # which tier offloaded / restored / dropped concern


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
    tier2: HostKvTier | None = None
    disk: DiskKvTier | None = None
    read_block: Callable[[int], torch.Tensor] | None = None  # one pool block's K/V (to encode for the disk)
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

    def lookup_tier2(self, hashes: list[int]) -> int:
        """How many leading hashes (the ones after the primary pool's prefix) tier 2 holds; counts the rest as
        tier-2 misses."""
        if self.tier2 is None or not self.enable_prefix_caching:
            return 0
        n = 0
        while n < len(hashes) and hashes[n] in self.tier2:
            n += 1
        return n

    def lookup_disk(self, hashes: list[int]) -> int:
        """How many leading hashes (the ones after the pool's and tier 2's) the disk tier can restore; its files
        are read and checked now, so a corrupt one is a miss."""
        if self.disk is None or not self.enable_prefix_caching:
            return 0
        n = self.disk.lookup(hashes)
        self._report_disk_lost()
        return n

    def count_tier2_misses(self, num_blocks: int) -> None:
        """Prompt blocks past the pool's prefix found in no tier (each tier on counts them as its misses)."""
        if self.tier2 is not None:
            self.tier2.misses += num_blocks
        if self.disk is not None:
            self.disk.misses += num_blocks

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
        if self.tier2 is not None and self.tier2.discard(block_hash) is not None:
            # recomputed while a copy sat in tier 2 (an earlier block of its chain was gone): one tier at a time
            self._events.append(KvEvent("dropped", block_hash, parent_hash, -1))
        if self.disk is not None and self.disk.discard(block_hash) is not None:
            self._events.append(KvEvent("dropped", block_hash, parent_hash, -1, "disk"))

    def take_tier2(self, hashes: list[int]) -> list[TierEntry]:
        """Remove blocks from tier 2 to restore them (before allocating their primary blocks, so the evictions
        that allocation causes cannot push them out)."""
        assert self.tier2 is not None
        return [self.tier2.take(h) for h in hashes]

    def take_disk(self, hashes: list[int]) -> list[TierEntry]:
        """The same for the disk tier (lookup_disk has read and checked these files)."""
        assert self.disk is not None
        try:
            return [self.disk.take(h) for h in hashes]
        finally:
            self._report_disk_lost()

    def commit_restored(
        self, block_ids: list[int], hashes: list[int], parents: list[int], tier: KvTierName = "host"
    ) -> None:
        """Freshly allocated blocks now hold restored K/V: cached under their hashes again, like computed ones (a
        hash computed into another block while this one was being written stays with that block)."""
        for b, h, parent in zip(block_ids, hashes, parents, strict=True):
            st = self.blocks[b]
            assert st.block_hash is None
            if h in self._cached:
                continue
            st.block_hash, st.parent_hash = h, parent
            self._cached[h] = b
            self._events.append(KvEvent("restored", h, parent, b, tier))

    def report_lost(self, hashes: list[int], parents: list[int], tier: KvTierName) -> None:
        """Blocks taken from a tier to be restored whose restore failed: they are in no tier now (dropped)."""
        for h, parent in zip(hashes, parents, strict=True):
            self._events.append(KvEvent("dropped", h, parent, -1, tier))

    def _report_disk_lost(self) -> None:
        """Blocks the disk tier forgot when their files read unsound (a miss, deleted): dropped, so the router's
        index stops counting them as this worker's."""
        assert self.disk is not None
        for h, parent in self.disk.take_lost():
            self._events.append(KvEvent("dropped", h, parent, -1, "disk"))

    def _evict(self, b: int) -> None:
        st = self.blocks[b]
        assert st.block_hash is not None
        del self._cached[st.block_hash]
        self._events.append(KvEvent("evicted", st.block_hash, st.parent_hash, b))
        if self.tier2 is not None:  # its K/V is still in the pool: copy it out before the block is reused
            for h, entry in self.tier2.put(st.block_hash, st.parent_hash, b):
                self._events.append(KvEvent("dropped", h, entry.parent_hash, -1))
                if self.disk is not None:  # pushed out of host memory: on to disk
                    self._to_disk(h, entry.parent_hash, entry.data, -1)
            self._events.append(KvEvent("offloaded", st.block_hash, st.parent_hash, b))
        elif self.disk is not None:  # no host tier: the block goes to disk in the tier-2 codec
            from services.engine.kv_tier import encode_block, host_copy

            assert self.read_block is not None
            data = encode_block(self.disk.codec, self.read_block(b), host_copy)
            self._to_disk(st.block_hash, st.parent_hash, data, b)
        st.block_hash = None

    def _to_disk(self, block_hash: int, parent_hash: int, data: EncodedBlock, block_id: int) -> None:
        assert self.disk is not None
        for h, parent in self.disk.put(block_hash, parent_hash, data):
            self._events.append(KvEvent("dropped", h, parent, -1, "disk"))
        if block_hash in self.disk:
            self._events.append(KvEvent("offloaded", block_hash, parent_hash, block_id, "disk"))

    def drain_events(self) -> list[KvEvent]:
        ev, self._events = self._events, []
        return ev

    def cached_hashes(self) -> list[int]:
        """Every hash the cache holds now (for a router that subscribes late and needs a snapshot)."""
        return list(self._cached)

    def tier2_hashes(self) -> list[int]:
        """Every hash tier 2 holds now (the snapshot's second part)."""
        return self.tier2.hashes() if self.tier2 is not None else []

    def disk_hashes(self) -> list[int]:
        """Every hash the disk tier holds now (the snapshot's third part; after a restart, what it kept)."""
        return self.disk.hashes() if self.disk is not None else []

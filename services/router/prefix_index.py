"""The global prefix index: which workers hold which KV blocks, by chained block hash.

Fed by the workers' stored/evicted block events (services.router.server) — or by a simulator calling the same
methods. A lookup walks the request's hash chain (services.engine.block_hash) from the first block and, for
every worker, counts the leading blocks it holds: a prefix cache can only reuse a contiguous run from the start.
Each hash maps to a bitmask of worker slots, so one dict lookup per block answers for all workers at once.

Memory is bounded by `max_entries` (worker, block) pairs: past it, new stored blocks are not indexed (the index
then under-reports a cache, never over-reports one) and `dropped` counts them. A worker's entries vanish with
`remove_worker` (its lease expired, it drained, or it restarted with a new epoch).

Tiers: `stored`/`evicted` follow a worker's primary KV pool (what `overlaps` answers for); a worker with a second
tier also reports blocks `offloaded` to it, `restored` from it (back in the pool) and `tier2_dropped` from it, and
`tiered_overlaps` says, per worker, how many leading blocks its pool holds and how many more its tier 2 holds
right after them (what a restore instead of a recompute would cover). Tier-2 entries count against the same
`max_entries`.

This room is plain data: no I/O, no clock, no request state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

DEFAULT_MAX_ENTRIES = 8_000_000


class PrefixIndex:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self.dropped = 0  # stored blocks not indexed because the index was full
        self._owners: dict[int, int] = {}  # block hash -> bitmask of worker slots holding it
        self._blocks: dict[str, set[int]] = {}  # worker id -> the hashes it holds (for eviction and removal)
        self._slot: dict[str, int] = {}
        self._worker_of_slot: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._entries = 0
        self._tier2: dict[str, set[int]] = {}  # worker id -> the hashes its second tier holds

    # ------------------------------------------------------------------------------------------ updates

    def _admit(self, mine: set[int], hashes: Iterable[int]) -> Iterator[int]:
        """Add the hashes `mine` lacks while the index has room (counting the rest as dropped); yield each added."""
        for h in hashes:
            if h in mine:
                continue
            if self._entries >= self.max_entries:
                self.dropped += 1
                continue
            mine.add(h)
            self._entries += 1
            yield h

    def stored(self, worker_id: str, hashes: Iterable[int]) -> None:
        bit = 1 << self._slot_of(worker_id)
        owners = self._owners
        for h in self._admit(self._blocks[worker_id], hashes):
            owners[h] = owners.get(h, 0) | bit

    def evicted(self, worker_id: str, hashes: Iterable[int]) -> None:
        mine = self._blocks.get(worker_id)
        if mine is None:
            return
        keep = ~(1 << self._slot[worker_id])
        for h in hashes:
            if h in mine:
                mine.discard(h)
                self._unset(h, keep)

    def offloaded(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Blocks that entered the worker's tier 2 (its `evicted` from the pool comes separately)."""
        for _ in self._admit(self._tier2.setdefault(worker_id, set()), hashes):
            pass

    def tier2_dropped(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Blocks that left the worker's tier 2 (pushed out, or recomputed into its pool)."""
        mine = self._tier2.get(worker_id)
        if mine is None:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                self._entries -= 1

    def restored(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Blocks brought back from the worker's tier 2 into its pool."""
        self.tier2_dropped(worker_id, hashes)
        self.stored(worker_id, hashes)

    def remove_worker(self, worker_id: str) -> None:
        """Forget every block of worker_id (both tiers) and free its slot."""
        self._entries -= len(self._tier2.pop(worker_id, ()))
        mine = self._blocks.pop(worker_id, None)
        if mine is None:
            return
        slot = self._slot.pop(worker_id)
        keep = ~(1 << slot)
        for h in mine:
            self._unset(h, keep)
        del self._worker_of_slot[slot]
        self._free_slots.append(slot)

    def clear_worker(self, worker_id: str) -> None:
        """Forget worker_id's blocks but keep it known (a new snapshot of its cache follows)."""
        self.remove_worker(worker_id)

    # ------------------------------------------------------------------------------------------ queries

    def overlaps(self, hashes: Sequence[int]) -> dict[str, int]:
        """worker id -> number of leading blocks of `hashes` it holds; workers holding none are left out."""
        found: dict[str, int] = {}
        owners = self._owners
        alive = -1
        for depth, h in enumerate(hashes):
            held = owners.get(h, 0)
            lost = alive & ~held if depth else 0
            if lost:
                self._record(found, lost, depth)
            alive = alive & held
            if not alive:
                return found
        if hashes and alive:
            self._record(found, alive, len(hashes))
        return found

    def tiered_overlaps(self, hashes: Sequence[int]) -> dict[str, tuple[int, int]]:
        """worker id -> (leading blocks of `hashes` in its pool, the blocks right after those in its tier 2);
        workers holding neither are left out."""
        found = {w: (d, 0) for w, d in self.overlaps(hashes).items()}
        for w, mine in self._tier2.items():
            if not mine:
                continue
            d0 = found.get(w, (0, 0))[0]
            d1 = 0
            while d0 + d1 < len(hashes) and hashes[d0 + d1] in mine:
                d1 += 1
            if d0 + d1:
                found[w] = (d0, d1)
        return found

    def has_tier2(self) -> bool:
        """Does any worker's tier 2 hold a block (else `tiered_overlaps` is `overlaps`)?"""
        return any(self._tier2.values())

    def tier2_blocks_of(self, worker_id: str) -> int:
        return len(self._tier2.get(worker_id, ()))

    def blocks_of(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def workers(self) -> list[str]:
        return sorted(self._blocks)

    def __len__(self) -> int:
        """(worker, block) entries indexed."""
        return self._entries

    # ------------------------------------------------------------------------------------------ internals

    def _slot_of(self, worker_id: str) -> int:
        slot = self._slot.get(worker_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[worker_id] = slot
            self._worker_of_slot[slot] = worker_id
            self._blocks[worker_id] = set()
        return slot

    def _unset(self, h: int, keep: int) -> None:
        left = self._owners.get(h, 0) & keep
        if left:
            self._owners[h] = left
        else:
            self._owners.pop(h, None)
        self._entries -= 1

    def _record(self, found: dict[str, int], mask: int, depth: int) -> None:
        while mask:
            low = mask & -mask
            found[self._worker_of_slot[low.bit_length() - 1]] = depth
            mask ^= low

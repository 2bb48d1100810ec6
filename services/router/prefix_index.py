"""The global prefix index: which workers hold which KV blocks, by chained block hash.

Fed by the workers' stored/evicted block events (services.router.server) — or by a simulator calling the same
methods. A lookup walks the request's hash chain (services.engine.block_hash) from the first block and, for
every worker, counts the leading blocks it holds: a prefix cache can only reuse a contiguous run from the start.
Each hash maps to a bitmask of worker slots, so one dict lookup per block answers for all workers at once.

Memory is bounded by `max_entries` (worker, block) pairs: past it, new stored blocks are not indexed (the index
then under-reports a cache, never over-reports one) and `dropped` counts them. A worker's entries vanish with
`remove_worker` (its lease expired, it drained, or it restarted with a new epoch).

Tiers: `stored`/`evicted` follow a worker's primary KV pool (what `overlaps` answers for); a worker with a second
tier also reports blocks `offloaded` to it, `restored` from it (back in the pool) and `tier2_dropped` from it,
each naming the tier (`HOST`: host memory; `DISK`: the local-disk tier below it). `tier_runs(hashes, starts)`
says, per worker, how many blocks right after `starts[worker]` (the run its pool — and whatever the caller counts
as soon cached — already covers) its tiers hold, split host / disk: what a restore instead of a recompute would
cover, without walking the pool again. `tiered_overlaps` is the pool run and the tier run together. Tier entries
count against the same `max_entries`.

This room is plain data: no I/O, no clock, no request state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

DEFAULT_MAX_ENTRIES = 8_000_000
HOST, DISK = "host", "disk"  # the tiers below a worker's pool, nearest first (KvBlockEvent.Tier)
TIERS = (HOST, DISK)
_EMPTY: frozenset[int] = frozenset()


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
        # tier -> worker id -> the hashes that tier of the worker holds
        self._tiers: dict[str, dict[str, set[int]]] = {t: {} for t in TIERS}

    # ------------------------------------------------------------------------------------------ updates

    def _admit(self, mine: set[int], hashes: Iterable[int]) -> list[int]:
        """Add the hashes `mine` lacks while the index has room (counting the rest as dropped); the ones added.
        The iterable is read whole first: one that raises changes nothing."""
        added: list[int] = []
        for h in list(hashes):
            if h in mine:
                continue
            if self._entries >= self.max_entries:
                self.dropped += 1
                continue
            mine.add(h)
            self._entries += 1
            added.append(h)
        return added

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

    def _tier(self, tier: str) -> dict[str, set[int]]:
        found = self._tiers.get(tier)
        if found is None:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        return found

    def offloaded(self, worker_id: str, hashes: Iterable[int], tier: str = HOST) -> None:
        """Blocks that entered one of the worker's tiers (its `evicted` from the pool comes separately)."""
        self._admit(self._tier(tier).setdefault(worker_id, set()), hashes)

    def tier2_dropped(self, worker_id: str, hashes: Iterable[int], tier: str = HOST) -> None:
        """Blocks that left one of the worker's tiers (pushed out, moved down, or recomputed into its pool)."""
        mine = self._tier(tier).get(worker_id)
        if mine is None:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                self._entries -= 1

    def restored(self, worker_id: str, hashes: Sequence[int], tier: str = HOST) -> None:
        """Blocks brought back from one of the worker's tiers into its pool."""
        self.tier2_dropped(worker_id, hashes, tier)
        self.stored(worker_id, hashes)

    def remove_worker(self, worker_id: str) -> None:
        """Forget every block of worker_id (both tiers) and free its slot."""
        for by_worker in self._tiers.values():
            self._entries -= len(by_worker.pop(worker_id, ()))
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

    def tier_runs(self, hashes: Sequence[int], starts: Mapping[str, int]) -> dict[str, tuple[int, int]]:
        """worker id -> (host blocks, disk blocks) of the contiguous run of `hashes` its tiers hold from block
        `starts.get(worker, 0)` on (the caller's pool run: no second walk of the pool); workers whose tiers
        hold none of that run are left out."""
        host, disk = self._tiers[HOST], self._tiers[DISK]
        found: dict[str, tuple[int, int]] = {}
        n = len(hashes)
        for w in sorted(set(host) | set(disk)):
            in_host, in_disk = host.get(w, _EMPTY), disk.get(w, _EMPTY)
            if not in_host and not in_disk:
                continue
            at = starts.get(w, 0)
            h_n = d_n = 0
            while at < n:
                h = hashes[at]
                if h in in_host:
                    h_n += 1
                elif h in in_disk:
                    d_n += 1
                else:
                    break
                at += 1
            if h_n or d_n:
                found[w] = (h_n, d_n)
        return found

    def tiered_overlaps(self, hashes: Sequence[int]) -> dict[str, tuple[int, int]]:
        """worker id -> (leading blocks of `hashes` in its pool, the blocks right after those in its tiers);
        workers holding neither are left out."""
        found = {w: (d, 0) for w, d in self.overlaps(hashes).items()}
        pool = {w: d for w, (d, _) in found.items()}
        for w, (h_n, d_n) in self.tier_runs(hashes, pool).items():
            found[w] = (pool.get(w, 0), h_n + d_n)
        return found

    def has_tier2(self) -> bool:
        """Does any worker's tier below the pool hold a block (else `tier_runs` finds nothing)?"""
        return any(mine for by_worker in self._tiers.values() for mine in by_worker.values())

    def tier2_blocks_of(self, worker_id: str, tier: str = HOST) -> int:
        return len(self._tier(tier).get(worker_id, ()))

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

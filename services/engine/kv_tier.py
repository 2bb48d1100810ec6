"""The host tier of the KV cache (tier 2): blocks evicted from the primary pool, kept by block hash.

When the BlockManager reuses a free block that still holds a cached prefix, its K/V comes here instead of
vanishing; a later prefix lookup that misses the primary pool but finds the next blocks here brings them back
into freshly allocated primary blocks (kv_cache.BlockManager drives both moves and records their events).

One concept: a bounded store in host memory — `capacity_bytes`, least recently used out first, each block kept in
one codec (services/engine/kv_codec.py owns the arithmetic):

    bf16   lossless: the cache's own dtype as is (bf16 on a bf16 engine, fp32 on an fp32 one); on a GPU worker
           this is pinned host memory, so a restore is one DMA
    fp8    E4M3 with one fp32 scale per head_dim row: ~1.9x the blocks of bf16 in the same bytes
    nvfp4  NVFP4 along head_dim (e4m3 scale per 16 elements, one fp32 scale per block): ~3.6x

A block is in one tier at a time: it leaves this one when it is restored, when it is recomputed into the primary
pool, or when newer blocks push it out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine import kv_codec
from services.engine.config import TIER2_CODECS
from services.engine.nvfp4.recipe import NVFP4Tensor

EncodedBlock = (
    torch.Tensor | tuple[torch.Tensor, torch.Tensor] | NVFP4Tensor
)  # bf16 | (fp8 scales, codes) | nvfp4


@dataclass
class TierEntry:
    parent_hash: int
    nbytes: int
    data: EncodedBlock
    tier: str = "host"  # where it was taken from: host | disk (kv_disk.DiskKvTier)


@dataclass(frozen=True)
class TierStats:
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int  # blocks restored from this tier
    misses: int  # prompt blocks found in neither tier (looked up past the primary pool's prefix, not here)
    restores: int  # restore operations (one per admitted request that restored blocks)
    restore_s: float  # seconds spent restoring, in all
    overlapped: int = 0  # restores written beside an engine step (the request waited; the others ran)


class HostKvTier:
    """Blocks by hash in host memory, LRU-bounded by bytes. `read_block(block_id)` gives one primary block's K/V
    [layers, 2, kv_heads, block_size, head_dim] on the engine's device."""

    def __init__(
        self,
        capacity_bytes: int,
        codec: str,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        read_block: Callable[[int], torch.Tensor],
        pin_memory: bool = False,
    ) -> None:
        if codec not in TIER2_CODECS:
            raise ValueError(f"kv_tier2_codec must be one of {TIER2_CODECS}, got {codec!r}")
        self.codec = codec
        self.block_shape = block_shape
        self.dtype = dtype
        self.pin_memory = pin_memory
        self._read = read_block
        self.block_nbytes = self.encoded_block_bytes(codec, block_shape, dtype)
        # what a block costs the host: its encoded bytes, or on a GPU worker the pinned allocations holding them,
        # which torch's caching host allocator rounds up to powers of two (a 5 MiB block pins 8 MiB) and keeps
        # pinned once freed; capacity is counted in these, so the flag bounds the memory really pinned
        self.block_charge = (
            sum(_pow2_ceil(n) for n in encoded_block_parts(codec, block_shape, dtype))
            if pin_memory
            else self.block_nbytes
        )
        if capacity_bytes < self.block_charge:
            raise ValueError(
                f"kv_tier2_bytes={capacity_bytes} cannot hold one KV block: a block takes {self.block_charge} "
                f"bytes in codec {codec!r}{' (pinned)' if pin_memory else ''} (0 turns the tier off)"
            )
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, TierEntry] = OrderedDict()  # head = least recently used
        self.used_bytes = 0
        self.hits = self.misses = self.restores = self.overlapped = 0
        self.restore_s = 0.0
        self.restore_observer: Callable[[float], None] | None = None  # e.g. a metrics histogram

    @staticmethod
    def encoded_block_bytes(codec: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Host bytes one block takes in `codec` (what capacity is counted in)."""
        return encoded_block_bytes(codec, block_shape, dtype)

    # ------------------------------------------------------------------------------------------ queries
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(self) -> list[int]:
        return list(self._entries)

    def stats(self) -> TierStats:
        return TierStats(
            self.capacity_bytes, self.used_bytes, len(self._entries), self.hits, self.misses,
            self.restores, self.restore_s, self.overlapped,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ mutations
    def put(self, block_hash: int, parent_hash: int, block_id: int) -> list[tuple[int, TierEntry]]:
        """Keep primary block `block_id` (about to be reused) under its hash. Returns the (hash, entry) pairs
        pushed out to make room, least recently used first (a disk tier below may keep them)."""
        self.discard(block_hash)
        dropped: list[tuple[int, TierEntry]] = []
        while self.used_bytes + self.block_charge > self.capacity_bytes:
            h, e = self._entries.popitem(last=False)
            self.used_bytes -= self.block_charge
            dropped.append((h, e))
        block = self._read(block_id)
        self._entries[block_hash] = TierEntry(
            parent_hash, self.block_nbytes, encode_block(self.codec, block, self._host)
        )
        self.used_bytes += self.block_charge
        return dropped

    def take(self, block_hash: int) -> TierEntry:
        """Remove a block to restore it (decode() it later); KeyError if it is not here."""
        e = self._entries.pop(block_hash)
        self.used_bytes -= self.block_charge
        return e

    def discard(self, block_hash: int) -> tuple[int, int] | None:
        """Drop a block (it is in the primary pool again); its (hash, parent) if it was here."""
        e = self._entries.pop(block_hash, None)
        if e is None:
            return None
        self.used_bytes -= self.block_charge
        return block_hash, e.parent_hash

    def decode(self, entries: list[TierEntry], device: torch.device) -> torch.Tensor:
        """Taken blocks as [n, layers, 2, kv_heads, block_size, head_dim] in the cache dtype on `device`."""
        return decode_entries(entries, self.dtype, device)

    def observe_restore(self, num_blocks: int, seconds: float, overlapped: bool = False) -> None:
        self.hits += num_blocks
        self.restores += 1
        self.overlapped += overlapped
        self.restore_s += seconds
        if self.restore_observer is not None:
            self.restore_observer(seconds)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t  # read_block copies (index_select): these bytes are the tier's own already
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_memory)
        host.copy_(t)
        return host


def encoded_block_bytes(codec: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes one block takes in `codec` (what the host and disk tiers' capacities are counted in): its host
    tensors, and nvfp4's 4-byte fp32 tensor scale."""
    return sum(encoded_block_parts(codec, block_shape, dtype)) + (4 if codec == "nvfp4" else 0)


def encoded_block_parts(codec: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> list[int]:
    """Bytes of each host tensor `encode_block` makes for one block (nvfp4's tensor scale is an ordinary CPU
    scalar, not among them)."""
    elems = 1
    for d in block_shape:
        elems *= d
    if codec == "bf16":
        return [elems * torch.empty(0, dtype=dtype).element_size()]
    if codec == "fp8":
        return list(kv_codec.fp8_nbytes(block_shape))
    if codec == "nvfp4":
        from services.engine.nvfp4.recipe import BLOCK_SIZE, padded_size

        rows = elems // block_shape[-1]
        kp = padded_size(block_shape[-1])
        return [rows * kp // 2, rows * (kp // BLOCK_SIZE)]
    raise ValueError(f"unknown tier-2 codec {codec!r}")


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def encode_block(
    codec: str, block: torch.Tensor, host: Callable[[torch.Tensor], torch.Tensor]
) -> EncodedBlock:
    """One pool block in a tier codec (kv_codec's arithmetic), each tensor moved to host memory by `host`."""
    if codec == "bf16":
        return host(block)
    if codec == "fp8":
        scale, q = kv_codec.fp8_encode(block)
        return host(scale), host(q)
    q4 = kv_codec.nvfp4_encode(block)
    return NVFP4Tensor(host(q4.packed), host(q4.scales), q4.global_scale.cpu(), q4.shape)


def decode_entries(entries: list[TierEntry], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Taken blocks as [n, layers, 2, kv_heads, block_size, head_dim] in the cache dtype on `device`."""
    out = []
    for e in entries:
        d = e.data
        if isinstance(d, NVFP4Tensor):
            out.append(kv_codec.nvfp4_decode(d.to(device), dtype))
        elif isinstance(d, tuple):
            scale, q = d  # from pinned memory on a GPU worker: queued, not waited for
            out.append(
                kv_codec.fp8_decode(
                    scale.to(device, non_blocking=True), q.to(device, non_blocking=True), dtype
                )
            )
        else:
            out.append(d.to(device, non_blocking=True))
    return torch.stack(out)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in (unpinned) host memory, for a tier that writes them out at once."""
    return t if t.device.type == "cpu" else t.cpu()

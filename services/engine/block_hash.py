"""The one definition of a KV block's identity: chained block hashes.

hash(block i) = H(hash(block i-1), token ids of block i). Equal hashes mean equal token prefixes, so a block
hash names a reusable piece of KV cache anywhere in the cluster. The engine's prefix cache, the router's global
prefix index and the simulator all import this module; nothing else may compute a block hash.

The value is deterministic across processes and machines (sha256, not Python's salted hash()).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0  # the parent of a sequence's first block

_HASH_VERSION = b"rackserve-block-v1"


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash; a 63-bit non-negative int (fits proto int64/uint64)."""
    h = hashlib.sha256(_HASH_VERSION)
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every *full* block of token_ids (a trailing partial block has no hash)."""
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out

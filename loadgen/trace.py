"""Mooncake trace replay: hash ids become deterministic token blocks, so the trace's prefix sharing is real.

The FAST'25 trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of 512-token blocks) has no text.
Each hash id maps to one block of token ids drawn from a generator seeded by (seed, hash id): equal ids give equal
blocks, so requests that share a prefix of ids share a prefix of tokens and therefore the chained block hashes of
services/engine/block_hash.py. `scale` shrinks the trace for a small model: a 512-token block becomes 512/scale
tokens (keep it a multiple of the engine's KV block size so shared blocks stay aligned), lengths shrink by the same
factor, outputs by `output_scale`, and time by `time_scale` (0.5 = twice as fast).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict

import numpy as np

from loadgen.workload import TOKEN_HI, TOKEN_LO, RequestSpec

TRACE_BLOCK_TOKENS = 512
# The trace ships inside the package (loadgen/traces/README.md names its origin and licence).
DEFAULT_TRACE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "traces", "mooncake_synthetic_trace.jsonl"
)


def load_records(path: str = DEFAULT_TRACE, limit: int | None = None) -> list[dict]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no trace at {path} (pass --trace PATH)")
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if limit is not None and len(out) >= limit:
                    break
    return out


def block_tokens(hash_id: int, n: int, seed: int = 0) -> list[int]:
    """The token ids of the block a hash id names (the first n of them)."""
    rng = np.random.default_rng([seed & 0xFFFF_FFFF, hash_id & 0xFFFF_FFFF_FFFF, 1 if hash_id < 0 else 0])
    return rng.integers(TOKEN_LO, TOKEN_HI, size=n).tolist()


def mooncake(
    records: list[dict],
    scale: int = 32,
    output_scale: float = 1.0,
    time_scale: float = 1.0,
    seed: int = 0,
    max_output_tokens: int | None = None,
    materialize: bool = True,
) -> list[RequestSpec]:
    """One RequestSpec per trace record, token-id prompts, arrival at timestamp × time_scale. With
    `materialize=False` the token ids are left out (the simulator derives block hashes from the hash ids through
    `TraceBlockHasher`, which is what makes a full-size replay cheap)."""
    if scale < 1 or TRACE_BLOCK_TOKENS % scale:
        raise ValueError(f"--scale must divide {TRACE_BLOCK_TOKENS}, got {scale}")
    per_block = TRACE_BLOCK_TOKENS // scale
    specs = []
    for i, rec in enumerate(records):
        n_in = max(1, math.ceil(rec["input_length"] / scale))
        ids: list[int] | None = _record_tokens(i, rec, n_in, per_block, seed) if materialize else None
        n_out = max(1, round(rec["output_length"] / output_scale))
        if max_output_tokens is not None:
            n_out = min(n_out, max_output_tokens)
        specs.append(
            RequestSpec(
                f"mc-{i}",
                n_in,
                n_out,
                arrival_s=rec["timestamp"] / 1000.0 * time_scale,
                token_ids=ids,
                tags={
                    "hash_ids": ",".join(map(str, _block_ids(i, rec, n_in, per_block))),
                    "trace_block_tokens": str(per_block),
                    "trace_seed": str(seed),
                },
            )
        )
    return specs


def _block_ids(i: int, rec: dict, n_in: int, per_block: int) -> list[int]:
    """The hash id of each trace block of the (scaled) prompt; ids past the record's list are unique to it."""
    n_blocks = math.ceil(n_in / per_block)
    ids = list(rec["hash_ids"][:n_blocks])
    return ids + [-(i + 1) * 1_000_000 - k for k in range(n_blocks - len(ids))]


def _record_tokens(i: int, rec: dict, n_in: int, per_block: int, seed: int) -> list[int]:
    ids: list[int] = []
    for h in _block_ids(i, rec, n_in, per_block):
        ids += block_tokens(h, min(per_block, n_in - len(ids)), seed)
    return ids


class TraceBlockHasher:
    """The engine's chained block hashes of a trace request, computed from its hash ids without building the
    whole prompt: equal (parent, hash id) pairs give equal hashes, so each is computed once. Same values as
    block_hashes(spec.token_ids, block_size) — the engine's own function does the hashing.

    `shared(block_size)` is one hasher per block size for the whole process, its memo bounded (least recently
    used out past MEMO_HASHES block hashes in all): a planner replays overlapping windows of the same requests
    every interval, and drawing each block's tokens again was a fifth of a decision's time."""

    MEMO_HASHES = 1 << 19  # the shared memo's bound: ~40 MiB (65,536 trace blocks of 8 KV blocks)
    _shared: dict[int, TraceBlockHasher] = {}
    _shared_lock = threading.Lock()

    def __init__(self, block_size: int, max_hashes: int | None = None) -> None:
        self.block_size = block_size
        self.max_hashes = max_hashes
        self._memo: OrderedDict[tuple[int, int, int, int], list[int]] = OrderedDict()
        self._hashes = 0  # held in the memo, in all
        self._lock = threading.Lock()

    @classmethod
    def shared(cls, block_size: int) -> TraceBlockHasher:
        with cls._shared_lock:
            found = cls._shared.get(block_size)
            if found is None:
                found = cls._shared[block_size] = cls(block_size, cls.MEMO_HASHES)
            return found

    def hashes(self, spec: RequestSpec) -> list[int]:
        per_block = int(spec.tags["trace_block_tokens"])
        seed = int(spec.tags["trace_seed"])
        if per_block % self.block_size:
            raise ValueError(
                f"trace blocks of {per_block} tokens do not align with KV blocks of {self.block_size}"
            )
        with self._lock:  # a shared hasher may serve replays on several threads
            return self._chain(spec, seed, per_block)

    def _chain(self, spec: RequestSpec, seed: int, per_block: int) -> list[int]:
        from services.engine.block_hash import ROOT_HASH, block_hashes

        out: list[int] = []
        parent, left = ROOT_HASH, spec.input_tokens
        for h in map(int, spec.tags["hash_ids"].split(",")):
            n = min(per_block, left)
            key = (seed, parent, h, n)  # a block's tokens depend on the seed too
            got = self._memo.get(key)
            if got is None:
                got = self._memo[key] = block_hashes(block_tokens(h, n, seed), self.block_size, parent)
                self._hashes += max(1, len(got))  # an empty entry (a tail under one KV block) counts too
                while self.max_hashes is not None and self._hashes > self.max_hashes and len(self._memo) > 1:
                    self._hashes -= max(1, len(self._memo.popitem(last=False)[1]))
            elif self.max_hashes is not None:
                self._memo.move_to_end(key)
            out += got
            left -= n
            if n < per_block or not got:
                break
            parent = got[-1]
        return out

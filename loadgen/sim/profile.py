"""Cost models as data: how long a prefill chunk, a decode step and a KV transfer take on some hardware.

A profile is a JSON file in loadgen/profiles/. `source` says where its numbers come from — measured on this
machine's real cluster (loadgen/measure_profile.py) or written from published figures — and the simulator copies
it into every report, so a number is never read without its provenance.

  prefill_s(new, ctx)   = prefill_overhead_s + new / prefill_tokens_per_s + new * (ctx + new/2) * attn_s_per_token_pair
  decode_step_s(b, ctx) = decode_base_s + b * decode_per_seq_s + ctx * decode_per_ctx_token_s   (ctx: batch's tokens)
  transfer_s(bytes, link) = links[link].latency_s + bytes / (links[link].gbps * 1e9)
  restore_s(blocks)     = host_link.latency_s + blocks * block_size * kv_bytes_per_token / (host_link.gbps * 1e9)

A profile may give each worker a host-memory KV tier (`host_tier_blocks`, 0: none) and the host link a restore
crosses (`host_link`, e.g. PCIe between GPU and host memory); a simulated cluster uses it when its config asks
(`ClusterConfig.host_tier`), as a real cluster does with `--kv-tier2-bytes`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from services.router.cost_model import LOCAL, SAME_NODE, SAME_RACK, SAME_ZONE

PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles")
# The router's link classes (services/router/cost_model.py) that a simulated cluster has: it models one zone, so
# a transfer across racks is `same_zone`; `local` (one worker prefills and decodes) moves nothing.
PROFILE_LINKS = (SAME_NODE, SAME_RACK, SAME_ZONE)


@dataclass(frozen=True)
class Link:
    gbps: float  # GB/s (bytes, not bits)
    latency_s: float


@dataclass(frozen=True)
class Profile:
    name: str
    source: str  # "measured: …" or "published figures: …"
    model: str
    block_size: int
    kv_bytes_per_token: int
    kv_capacity_blocks: int  # per worker
    prefill_tokens_per_s: float
    prefill_overhead_s: float
    attn_s_per_token_pair: float
    max_prefill_chunk_tokens: int  # chunked prefill: tokens per step
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    max_batch: int
    links: dict[str, Link] = field(default_factory=dict)
    workers_per_node: int = 8
    nodes_per_rack: int = 1
    host_tier_blocks: int = 0  # per worker: KV blocks its host-memory tier holds (0: the profile has no tier)
    host_link: Link | None = None  # GPU <-> host memory, what a restore from the host tier crosses
    notes: str = ""

    def prefill_s(self, new_tokens: int, ctx_tokens: int) -> float:
        return (
            self.prefill_overhead_s
            + new_tokens / self.prefill_tokens_per_s
            + new_tokens * (ctx_tokens + new_tokens / 2) * self.attn_s_per_token_pair
        )

    def decode_step_s(self, batch: int, ctx_tokens: int) -> float:
        return self.decode_base_s + batch * self.decode_per_seq_s + ctx_tokens * self.decode_per_ctx_token_s

    def transfer_s(self, nbytes: int, link: str) -> float:
        if link == LOCAL:
            return 0.0
        lk = self.links[link]
        return lk.latency_s + nbytes / (lk.gbps * 1e9)

    def restore_s(self, blocks: int) -> float:
        """Bringing `blocks` back from the host tier into the pool."""
        if self.host_link is None or not blocks:
            return 0.0
        nbytes = blocks * self.block_size * self.kv_bytes_per_token
        return self.host_link.latency_s + nbytes / (self.host_link.gbps * 1e9)

    def to_dict(self) -> dict:
        return asdict(self)


def load_profile(name_or_path: str) -> Profile:
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        known = sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
        raise FileNotFoundError(
            f"no profile {name_or_path!r}; known: {', '.join(known)} (or give a .json path)"
        )
    with open(path) as f:
        raw = json.load(f)
    raw["links"] = {k: Link(**v) for k, v in raw.get("links", {}).items()}
    if raw.get("host_link") is not None:
        raw["host_link"] = Link(**raw["host_link"])
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    missing = [c for c in PROFILE_LINKS if c not in raw["links"]]
    if missing:
        raise ValueError(f"profile {path}: links lacks {missing}")
    if raw.get("host_tier_blocks", 0) and raw.get("host_link") is None:
        raise ValueError(f"profile {path}: host_tier_blocks needs a host_link (the restore's bandwidth)")
    return Profile(**raw)

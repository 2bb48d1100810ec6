"""The cost model behind the TTFT-estimate policy: every parameter a named setting, calibrated online.

An estimate of time to first token for one (prefill worker, decode worker) plan is the sum of five terms:

  queue_s      prompt tokens already waiting on the prefilling worker (its load report plus this router's
               pending reservations), divided by that worker's prefill rate
  prefill_s    this request's uncached tokens / the prefill rate, plus a per-request overhead
  restore_s    the prompt's blocks the worker holds in its tiers (right after those in its pool), brought back
               instead of recomputed: their tokens / the prefill rate × `tier2_restore_fraction` (host tier) or
               × `disk_restore_fraction` (disk tier)
  pull_s       a peer pull, when the plan has one: the prompt's blocks past what the worker holds (pool, tiers)
               that another prefill worker's pool holds, copied from it instead of recomputed:
               `peer_pull_overhead_s` + link latency + their KV bytes / link bandwidth (topology class of the
               two workers). It is chosen only when cheaper than computing those tokens, and it does not wait
               for the source's queue (the source's engine step is not involved)
  transfer_s   remote plans only: link latency + KV bytes / link bandwidth, by topology class
  admission_s  the decode worker's wait before the request joins its batch: none when it is idle, else half
               a step (the one running), plus one step per request already waiting there, plus
               `kv_full_wait_s` when its free KV blocks (less those this router reserved) cannot hold it

Prefill on the decode worker itself (conditional disaggregation, "local") has no transfer term but runs at the
decode worker's rate, which is `decode_prefill_slowdown` times slower than a prefill worker's until measured
(a decode worker interleaves chunks of the prompt with its decode batch), and it delays that worker's running
streams: `interference_s` = local prefill time × running streams × `interference_weight` is added to the
local plan's score (not to the TTFT estimate).

Rates are calibrated online per worker (`RateMeter`): a worker's stored-block events count the tokens it
computed, and its load reports say when it was busy, so tokens / busy seconds is its measured prefill rate
(an exponential moving average over measurements spanning `rate_min_busy_s` each). Decode step times come
measured in the load reports. Link parameters per topology class are settings.

This room is arithmetic only: no I/O, no clock of its own (callers pass `now`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

# Topology classes, nearest first: the one list of their names, for the router and the simulator alike.
# "local" is prefill on the decode worker itself (no transfer).
LOCAL, SAME_NODE, SAME_RACK, SAME_ZONE, CROSS_ZONE = (
    "local",
    "same_node",
    "same_rack",
    "same_zone",
    "cross_zone",
)
LINK_CLASSES = (LOCAL, SAME_NODE, SAME_RACK, SAME_ZONE, CROSS_ZONE)
REMOTE_LINK_CLASSES = LINK_CLASSES[1:]  # the classes a KV transfer crosses


def setting(default: float | int | str, help: str, flag: str = "") -> Any:
    """A settings-dataclass field whose metadata makes it a flag: `--<name>` (or `flag`) with this help."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class CostSettings:
    """Every weight of the estimate, with the default an operator starts from; each is a router flag of the
    same name (`--prefill-tokens-per-s`, …)."""

    prefill_tokens_per_s: float = setting(4000.0, "a prefill worker's prompt tokens/s until measured")
    prefill_overhead_s: float = setting(0.004, "per request: scheduling, first step, first-token sampling")
    remote_overhead_s: float = setting(
        0.015, "a disaggregated plan's extra RPC, KV-handle bookkeeping and pull setup"
    )
    decode_prefill_slowdown: float = setting(
        1.5, "a decode worker prefills this many times slower than a prefill worker, until measured"
    )
    interference_weight: float = setting(
        0.05, "share of a local prefill's time charged per running decode stream on that worker"
    )
    default_step_s: float = setting(0.02, "a decode step when the worker has not reported one")
    kv_full_wait_s: float = setting(1.0, "admission wait when the decode worker's free KV blocks are too few")
    kv_bytes_per_token: int = setting(
        23040, "KV bytes of a token when the worker does not say (SmolLM2-135M bf16: 30 layers*3*64*2*2)"
    )
    same_node_bytes_per_s: float = setting(10e9, "link bandwidth, same node (shared memory / NVLink)")
    same_node_latency_s: float = setting(0.0005, "link latency, same node")
    same_rack_bytes_per_s: float = setting(12.5e9, "link bandwidth, same rack (100 Gb/s RDMA)")
    same_rack_latency_s: float = setting(0.001, "link latency, same rack")
    same_zone_bytes_per_s: float = setting(5e9, "link bandwidth, same zone, across racks")
    same_zone_latency_s: float = setting(0.002, "link latency, same zone")
    cross_zone_bytes_per_s: float = setting(1e9, "link bandwidth, across zones")
    cross_zone_latency_s: float = setting(0.01, "link latency, across zones")
    unlabeled_link: str = setting(SAME_RACK, "the link class assumed when a worker has no topology labels")
    tier2_restore_fraction: float = setting(
        0.1,
        "a tier-2 prefix block's restore time as a share of computing it at the worker's prefill rate "
        "(docs/kv-tiers.md: a bf16 restore reached the first token in 0.10x a recompute's time on CPU)",
    )
    disk_restore_fraction: float = setting(
        0.3,
        "a disk-tier prefix block's restore time as a share of computing it (an assumption until measured: "
        "a local NVMe read is about 3x slower than a host-memory copy, docs/routing.md)",
    )
    peer_pull_overhead_s: float = setting(
        0.015, "a peer pull's fixed cost on top of the link's: one remote RPC plus the pull's setup"
    )
    rate_ewma_alpha: float = setting(0.3, "calibration: weight of a new prefill-rate measurement")
    rate_min_busy_s: float = setting(0.2, "calibration: busy seconds one prefill-rate measurement spans")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"cost setting {f.name} must be >= 0, got {value}")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("cost setting prefill_tokens_per_s must be > 0")
        if self.unlabeled_link not in REMOTE_LINK_CLASSES:
            raise ValueError(f"cost setting unlabeled_link must be one of {REMOTE_LINK_CLASSES}")

    def link(self, link_class: str) -> tuple[float, float]:
        """(bytes per second, latency seconds) of a topology class."""
        if link_class == LOCAL:
            return float("inf"), 0.0
        return getattr(self, f"{link_class}_bytes_per_s"), getattr(self, f"{link_class}_latency_s")


class Placed(Protocol):
    """Anything with topology labels (a WorkerState); an empty label is unknown."""

    node: str
    rack: str
    zone: str


def link_class(a: Placed, b: Placed, unlabeled: str = SAME_RACK) -> str:
    """The nearest topology level two workers share, from their node/rack/zone labels (runs per plan: no
    allocation)."""
    if not (a.node or a.rack or a.zone) or not (b.node or b.rack or b.zone):
        return unlabeled
    if a.node and a.node == b.node:
        return SAME_NODE
    if a.rack and a.rack == b.rack:
        return SAME_RACK
    if a.zone and a.zone == b.zone:
        return SAME_ZONE
    return CROSS_ZONE


class RateMeter:
    """One worker's measured prefill rate: tokens it computed (from stored-block events) per busy second."""

    def __init__(self, alpha: float = 0.3, min_busy_s: float = 0.2) -> None:
        self.alpha = alpha
        self.min_busy_s = min_busy_s
        self.tokens_per_s = 0.0  # 0: not measured yet
        self._busy_since: float | None = None
        self._tokens = 0
        self._busy_s = 0.0

    def computed(self, tokens: int) -> None:
        """Blocks this worker just stored (computed, not reused) hold `tokens` tokens."""
        if self._busy_since is not None:
            self._tokens += tokens

    def load(self, busy: bool, now: float) -> None:
        """A load report at `now`: is there prompt work queued or running on the worker?"""
        if self._busy_since is not None:
            self._busy_s += now - self._busy_since
        self._busy_since = now if busy else None
        if self._busy_s >= self.min_busy_s and self._tokens > 0:
            measured = self._tokens / self._busy_s
            self.tokens_per_s = (
                measured
                if not self.tokens_per_s
                else self.alpha * measured + (1 - self.alpha) * self.tokens_per_s
            )
            self._tokens, self._busy_s = 0, 0.0

"""Routing policies as plain objects over a snapshot of worker state — no network, no clock.

NOTE: this is the simulator's own minimal policy protocol, written because the router's policy interface
(services/router/policy.py, branch `router`) did not exist when the simulator was built. Its shape follows the
router's brief (worker state the policy reads → query → decision with reason and estimated TTFT) so that swapping
in the router's objects is an adapter, not a rewrite. Block hashes come from services/engine/block_hash.py.

Policies (what each one's published rule is):
  round_robin   next worker in turn (prefill and decode pools separately)
  least_loaded  prefill: fewest queued prefill tokens; decode: fewest running+waiting requests
  cache_only    prefill: longest cached prefix (ties: least loaded); ignores queues
  dynamo        Dynamo KV router: argmin overlap_weight·(queued prefill blocks + uncached blocks of the request)
                + active decode blocks  (overlap_score_weight 1.0, temperature 0)
  sglang        sgl-router cache-aware: when loads are imbalanced (max-min > 32 and max > 1.0001·min) the
                shortest queue; else the longest prefix match if match rate > 0.5; else the smallest cache
  ttft          rackserve: minimum estimated TTFT = queue wait + prefill of uncached tokens + KV transfer over
                the link + decode admission wait, counting queued requests' blocks as (soon) cached; also decides
                conditional disaggregation (prefill on the decode worker when that is sooner)
  ttft_no_pending  the same estimate without counting queued requests' blocks (the seed's counter-example 3)
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class WorkerState:
    worker_id: str
    role: str  # prefill | decode
    node: str
    rack: str
    queued_prefill_tokens: int  # uncached tokens waiting or running in prefill here
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    active_blocks: int
    cached_blocks: int
    match: Callable[[Sequence[int]], int]  # cached prefix length, in blocks, of a block-hash list
    pending_match: Callable[[Sequence[int]], int] = field(default=lambda h: 0)  # … counting queued requests
    est_step_s: float = 0.0  # the decode step time now


@dataclass(frozen=True)
class RouteQuery:
    request_id: str
    block_hashes: Sequence[int]
    num_tokens: int
    block_size: int


@dataclass(frozen=True)
class Decision:
    prefill: str | None  # None: the decode worker prefills (aggregated)
    decode: str
    reason: str
    estimated_ttft_s: float | None = None


class CostModel:
    """What the TTFT policy needs to know about time: compute rates and links (a profile, or calibrated rates)."""

    def __init__(
        self,
        prefill_s: Callable[[int, int], float],
        transfer_s: Callable[[int, str], float],
        kv_bytes_per_token: int,
        link: Callable[[WorkerState, WorkerState], str],
    ) -> None:
        self.prefill_s, self.transfer_s, self.kv_bytes_per_token, self.link = (
            prefill_s,
            transfer_s,
            kv_bytes_per_token,
            link,
        )


def spread(q: RouteQuery, w: WorkerState) -> int:
    """A tie-break that differs per request but not per run: equal candidates share the load instead of the
    lowest id taking everything (and two router replicas agree without talking)."""
    return zlib.crc32(f"{q.request_id}/{w.worker_id}".encode())


class Policy:
    name = "base"

    def route(
        self, q: RouteQuery, prefill: Sequence[WorkerState], decode: Sequence[WorkerState], disagg: bool
    ) -> Decision:
        raise NotImplementedError

    @staticmethod
    def least_busy_decode(decode: Sequence[WorkerState]) -> WorkerState:
        return min(decode, key=lambda w: (w.running + w.waiting, w.active_blocks, w.worker_id))


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._p, self._d = itertools.count(), itertools.count()

    def route(self, q, prefill, decode, disagg):  # type: ignore[no-untyped-def]
        d = decode[next(self._d) % len(decode)]
        p = prefill[next(self._p) % len(prefill)].worker_id if disagg and prefill else None
        return Decision(p, d.worker_id, "round_robin")


class LeastLoaded(Policy):
    name = "least_loaded"

    def route(self, q, prefill, decode, disagg):  # type: ignore[no-untyped-def]
        if disagg and prefill:
            p = min(prefill, key=lambda w: (w.queued_prefill_tokens, spread(q, w)))
            return Decision(p.worker_id, self.least_busy_decode(decode).worker_id, "least_queue")
        d = min(decode, key=lambda w: (w.queued_prefill_tokens, w.running + w.waiting, spread(q, w)))
        return Decision(None, d.worker_id, "least_queue")


class CacheOnly(Policy):
    name = "cache_only"

    def route(self, q, prefill, decode, disagg):  # type: ignore[no-untyped-def]
        pool = prefill if disagg and prefill else decode
        best = max(pool, key=lambda w: (w.match(q.block_hashes), -w.queued_prefill_tokens, spread(q, w)))
        if disagg and prefill:
            return Decision(best.worker_id, self.least_busy_decode(decode).worker_id, "cache_hit")
        return Decision(None, best.worker_id, "cache_hit")


class Dynamo(Policy):
    """Dynamo's KV router cost (lib/kv-router selector): overlap_weight·prefill_blocks + decode_blocks."""

    name = "dynamo"

    def __init__(self, overlap_score_weight: float = 1.0) -> None:
        self.w = overlap_score_weight

    def _cost(self, w: WorkerState, q: RouteQuery) -> float:
        n_blocks = -(-q.num_tokens // q.block_size)
        prefill_blocks = w.queued_prefill_tokens / q.block_size + n_blocks - w.match(q.block_hashes)
        return self.w * prefill_blocks + w.active_blocks + n_blocks

    def route(self, q, prefill, decode, disagg):  # type: ignore[no-untyped-def]
        pool = prefill if disagg and prefill else decode
        best = min(pool, key=lambda w: (self._cost(w, q), spread(q, w)))
        if disagg and prefill:
            d = min(decode, key=lambda w: (w.active_blocks, w.worker_id))
            return Decision(best.worker_id, d.worker_id, "dynamo_cost")
        return Decision(None, best.worker_id, "dynamo_cost")


class SgLang(Policy):
    """sgl-router's cache-aware policy with its defaults (cache_threshold 0.5, balance thresholds 32 / 1.0001)."""

    name = "sglang"

    def __init__(
        self, cache_threshold: float = 0.5, abs_threshold: int = 32, rel_threshold: float = 1.0001
    ) -> None:
        self.cache_threshold, self.abs_threshold, self.rel_threshold = (
            cache_threshold,
            abs_threshold,
            rel_threshold,
        )

    def _pick(self, pool: Sequence[WorkerState], q: RouteQuery) -> tuple[WorkerState, str]:
        loads = [w.running + w.waiting for w in pool]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            return min(pool, key=lambda w: (w.running + w.waiting, spread(q, w))), "least_queue"
        n = max(1, len(q.block_hashes))
        best = max(pool, key=lambda w: (w.match(q.block_hashes), spread(q, w)))
        if best.match(q.block_hashes) / n > self.cache_threshold:
            return best, "cache_hit"
        return min(pool, key=lambda w: (w.cached_blocks, spread(q, w))), "smallest_cache"

    def route(self, q, prefill, decode, disagg):  # type: ignore[no-untyped-def]
        if disagg and prefill:
            p, reason = self._pick(prefill, q)
            return Decision(p.worker_id, self.least_busy_decode(decode).worker_id, reason)
        d, reason = self._pick(decode, q)
        return Decision(None, d.worker_id, reason)


class TtftEstimate(Policy):
    """rackserve's score: the plan with the smallest estimated time to first token (DESIGN.md §5)."""

    name = "ttft"

    def __init__(self, cost: CostModel, count_pending: bool = True, conditional: bool = True) -> None:
        self.cost, self.count_pending, self.conditional = cost, count_pending, conditional

    def _prefill_terms(self, w: WorkerState, q: RouteQuery) -> tuple[float, float]:
        hit = w.pending_match(q.block_hashes) if self.count_pending else w.match(q.block_hashes)
        cached_tokens = min(hit * q.block_size, q.num_tokens - 1)
        queue_s = self.cost.prefill_s(w.queued_prefill_tokens, 0) if w.queued_prefill_tokens else 0.0
        return queue_s, self.cost.prefill_s(q.num_tokens - cached_tokens, cached_tokens)

    def route(self, q, prefill, decode, disagg):  # type: ignore[no-untyped-def]
        best: tuple[float, int, str, str | None, str] | None = None
        nbytes = q.num_tokens * self.cost.kv_bytes_per_token
        for d in decode:
            admit_s = d.est_step_s if d.free_blocks * q.block_size < q.num_tokens else 0.0
            if not disagg or not prefill or self.conditional:
                queue_s, compute_s = self._prefill_terms(d, q)
                # a local prefill also stalls the decode batch's steps: count one step per chunk as its cost
                est = queue_s + compute_s + admit_s + d.est_step_s
                cand = (est, spread(q, d), d.worker_id, None, "local_prefill")
                best = cand if best is None or cand[:2] < best[:2] else best
            if disagg and prefill:
                for p in prefill:
                    queue_s, compute_s = self._prefill_terms(p, q)
                    transfer = self.cost.transfer_s(nbytes, self.cost.link(p, d))
                    est = queue_s + compute_s + transfer + admit_s
                    reason = "cache_hit" if p.match(q.block_hashes) else "least_queue"
                    cand = (est, spread(q, p) ^ spread(q, d), d.worker_id, p.worker_id, reason)
                    best = cand if best is None or cand[:2] < best[:2] else best
        assert best is not None
        return Decision(best[3], best[2], best[4], best[0])


POLICY_NAMES = ("round_robin", "least_loaded", "cache_only", "dynamo", "sglang", "ttft", "ttft_no_pending")


def make_policy(name: str, cost: CostModel) -> Policy:
    if name == "ttft":
        return TtftEstimate(cost)
    if name == "ttft_no_pending":
        p = TtftEstimate(cost, count_pending=False)
        p.name = name
        return p
    table: dict[str, Callable[[], Policy]] = {
        "round_robin": RoundRobin,
        "least_loaded": LeastLoaded,
        "cache_only": CacheOnly,
        "dynamo": Dynamo,
        "sglang": SgLang,
    }
    if name not in table:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return table[name]()

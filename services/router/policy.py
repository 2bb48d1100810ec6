"""Routing policies: plain objects that turn (a view of the workers, a request) into a Decision.

Every policy has the same interface, `policy.route(view, query) -> Decision`, reads only the data below and
does no I/O, so the live router (services.router.server) and the load generator's simulator run the very same
objects. To drive one without a network:

    from services.router.policy import ClusterView, RouteQuery, WorkerState, make_policy
    from services.router.prefix_index import PrefixIndex

    index = PrefixIndex()
    workers = {
        "p0": WorkerState("p0", "prefill", rack="r1", queued_prefill_tokens=800),
        "d0": WorkerState("d0", "decode", rack="r1"),
    }
    index.stored("p0", block_hashes(prompt, 16))          # what worker events would have said
    view = ClusterView(workers, index)
    decision = make_policy("ttft", mode="auto").route(view, RouteQuery("req-1", token_ids=prompt))
    decision.prefill, decision.decode, decision.reason, decision.chosen.terms, decision.runner_up

A simulator that wants this router's anti-herding should also keep a `Reservations` (services.router.
reservations) and call `reserve(decision, query, now)` after each route and `on_load(worker_id, now)` when a
worker reports: that is exactly what the live router does (services.router.state.RouterState wraps it all).

Policies (`--policy`, the names of `REGISTRY`): ttft (the default: the TTFT estimate of services.router.
cost_model), round_robin, least_loaded, cache_overlap, dynamo_kv (Dynamo KV-router cost, softmax temperature)
and sgl_cache_aware (sgl-router's cache-aware policy). Each takes its knobs as one frozen settings dataclass
(`Policy.Settings`: `TtftSettings`, `DynamoKvSettings`, …) whose fields are the router's flags, as CostSettings'
are. `mode` (agg | disagg | auto) decides which plan shapes are allowed: agg = the decode worker prefills;
disagg = a prefill worker prefills whenever one is eligible; auto = ttft compares both, the baselines use the
prompt-length threshold `disagg_min_prompt_tokens`.

This room must never do I/O, read a clock or hold request state beyond a policy's own turn counter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from services.engine.block_hash import block_hashes
from services.router.cost_model import LINK_CLASSES, CostSettings, link_class, setting
from services.router.prefix_index import PrefixIndex

MODES = ("agg", "disagg", "auto")  # the one list of plan-shape modes (router, launcher, simulator)
DEFAULT_MODE = "auto"
DEFAULT_POLICY = "ttft"
DEFAULT_DISAGG_MIN_PROMPT_TOKENS = 256  # baselines in auto mode: the shortest prompt prefilled remotely


class NoWorkerError(LookupError):
    """No eligible decode worker: the caller answers UNAVAILABLE."""


# ------------------------------------------------------------------------------------------ inputs


@dataclass
class WorkerState:
    """What a policy may know about one worker: identity (etcd), load (its last report), this router's
    pending reservations on it, and its measured prefill rate. Mutable: the router updates it in place."""

    worker_id: str
    role: str  # prefill | decode
    epoch: int = 0
    endpoint: str = ""
    block_size: int = 16
    capacity_blocks: int = 0
    fingerprint: str = ""
    node: str = ""
    rack: str = ""
    zone: str = ""
    kv_bytes_per_token: int = 0  # 0: use CostSettings.kv_bytes_per_token
    # its KV cache's dtype (fp32, bf16, …; "": not said): the model fingerprint does not include it
    kv_dtype: str = ""
    max_model_len: int = 0  # its context length in tokens (0: not said)
    healthy: bool = True  # False: draining, reported failed, or otherwise not to be chosen
    # load, from the worker's last LoadSnapshot
    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    free_blocks: int = -1  # -1: not reported yet (treated as capacity_blocks)
    step_s: float = 0.0
    # measured prefill tokens/s (0: not measured; CostSettings gives the default)
    prefill_tokens_per_s: float = 0.0
    # this router's reservations since the worker's last load report
    pending_requests: int = 0
    pending_prefill_tokens: int = 0
    pending_decode_blocks: int = 0

    @property
    def topology(self) -> dict[str, str]:
        return {k: v for k, v in (("node", self.node), ("rack", self.rack), ("zone", self.zone)) if v}

    @property
    def load(self) -> int:
        """Requests on the worker, counting this router's pending ones (the least-loaded measure)."""
        return self.waiting + self.running + self.pending_requests

    def free_blocks_now(self) -> int:
        if self.free_blocks < 0 and not self.capacity_blocks:
            return 1 << 30  # nothing known: never assume the cache is full
        free = self.capacity_blocks if self.free_blocks < 0 else self.free_blocks
        return free - self.pending_decode_blocks


@dataclass
class RouteQuery:
    """One request to place. Give token_ids (hashes are computed per block size), or num_tokens plus
    block_hashes keyed by block size (a simulator that hashed already)."""

    request_id: str
    token_ids: Sequence[int] = ()
    num_tokens: int = -1  # -1: len(token_ids)
    block_hashes: dict[int, list[int]] = field(default_factory=dict)
    exclude: frozenset[str] = frozenset()  # workers that just failed this request
    need_prefill: bool = True  # False: resuming with KV that exists elsewhere; never disaggregate
    fingerprint: str = ""  # only workers serving this model (empty: any, but prefill and decode must match)

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = len(self.token_ids)

    def hashes(self, block_size: int) -> list[int]:
        found = self.block_hashes.get(block_size)
        if found is None:
            found = self.block_hashes[block_size] = block_hashes(self.token_ids, block_size)
        return found


@dataclass
class ClusterView:
    """The workers and the prefix index, plus blocks this router's pending requests will soon have cached."""

    workers: dict[str, WorkerState]
    index: PrefixIndex
    pending_overlaps: Callable[[RouteQuery], dict[str, int]] | None = None

    def eligible(self, role: str, query: RouteQuery) -> list[WorkerState]:
        """Workers of `role` that may be chosen for query, ordered by worker id: a worker whose context cannot hold
        the prompt (it refuses one of max_model_len tokens or more) is not."""
        found = [
            w
            for w in self.workers.values()
            if w.role == role
            and w.healthy
            and w.worker_id not in query.exclude
            and (not query.fingerprint or w.fingerprint == query.fingerprint)
            and (not w.max_model_len or query.num_tokens < w.max_model_len)
        ]
        return sorted(found, key=lambda w: w.worker_id)

    def overlaps(self, query: RouteQuery) -> dict[str, int]:
        """worker id -> leading blocks of the prompt it holds (indexed, or soon by a pending request)."""
        return self.split_overlaps(query)[1]

    def split_overlaps(self, query: RouteQuery) -> tuple[dict[str, int], dict[str, int]]:
        """(worker id -> leading blocks of the prompt its pool holds now, the same counting what this router's
        pending requests will soon have computed there): one walk of the index per block size."""
        pool: dict[str, int] = {}
        for size in sorted({w.block_size for w in self.workers.values()}):
            for worker_id, n in self.index.overlaps(query.hashes(size)).items():
                w = self.workers.get(worker_id)
                if w is not None and w.block_size == size:
                    pool[worker_id] = n
        found = dict(pool)
        if self.pending_overlaps is not None:
            for worker_id, n in self.pending_overlaps(query).items():
                if n > found.get(worker_id, 0):
                    found[worker_id] = n
        return pool, found

    def tier2_overlaps(self, query: RouteQuery, overlaps: dict[str, int]) -> Tiers:
        """worker id -> (host-tier blocks, disk-tier blocks) of the prompt its tiers hold right after the
        leading run `overlaps` (this view's `overlaps(query)`) counts for it: what a restore would bring back
        instead of a recompute. The walk starts where that run ends (the pool is not walked again)."""
        found: Tiers = {}
        if not self.index.has_tier2():
            return found
        for size in sorted({w.block_size for w in self.workers.values()}):
            for worker_id, run in self.index.tier_runs(query.hashes(size), overlaps).items():
                w = self.workers.get(worker_id)
                if w is not None and w.block_size == size:
                    found[worker_id] = run
        return found


Tiers = dict[str, tuple[int, int]]  # worker id -> (host blocks, disk blocks) right after its pool's run


# ------------------------------------------------------------------------------------------ outputs


@dataclass(frozen=True)
class Pull:
    """A planned peer pull: before prefilling, copy the prompt's blocks [start_block, start_block + blocks)
    from `source` (a prefill worker whose pool holds them) instead of recomputing them."""

    source: str
    start_block: int  # the blocks before it the prefilling worker already has (pool, tiers, pending)
    blocks: int
    tokens: int  # prompt tokens those blocks spare from computing (the last prompt token is always computed)
    pull_s: float  # the estimate: overhead + link latency + KV bytes / link bandwidth
    compute_s: float  # computing those tokens on the prefilling worker instead
    link: str  # the topology class between the two workers

    @property
    def saved_s(self) -> float:
        return self.compute_s - self.pull_s

    @property
    def deadline_s(self) -> float:
        """Past this the pull is not worth waiting for: computing the blocks would have been done (and never
        less than twice the estimate, so a pull is not abandoned over an estimate's small error)."""
        return max(self.compute_s, 2 * self.pull_s)


@dataclass(frozen=True)
class PlanScore:
    """One plan — who prefills (None: the decode worker itself) and who decodes — and its estimate.

    terms (seconds unless named): queue_s, pull_s, prefill_s, restore_s, transfer_s, admission_s,
    interference_s, plus cached_tokens (the pool's hit), tier2_tokens (restored from the worker's tiers, of
    which disk_tokens from its disk tier), pulled_tokens (copied from a peer: `pull` says from whom) and
    uncached_tokens (computed);
    estimated_ttft_s = queue + pull + prefill + restore + transfer + admission;
    score = what the policy minimised (for ttft: estimate + interference; for a baseline: its own cost)."""

    prefill: str | None
    decode: str
    terms: dict[str, float]
    estimated_ttft_s: float
    score: float
    pull: Pull | None = None

    @property
    def prefilling_worker(self) -> str:
        return self.prefill or self.decode


@dataclass(frozen=True)
class Decision:
    policy: str
    reason: str  # cache_hit | tier2_hit | least_queue | least_compute | topology | local_prefill | …
    chosen: PlanScore
    runner_up: PlanScore | None = None
    detail: str = ""  # the rule in words, e.g. "auto: prompt 12 < 256 tokens"

    @property
    def prefill(self) -> str | None:
        return self.chosen.prefill

    @property
    def decode(self) -> str:
        return self.chosen.decode

    @property
    def estimated_ttft_s(self) -> float:
        return self.chosen.estimated_ttft_s


# ------------------------------------------------------------------------------------------ shared pieces


def rendezvous(request_id: str, key: str) -> int:
    """A per-request pseudo-random rank of `key`: replicas that see the same request agree, different
    requests spread (highest random weight hashing)."""
    digest = hashlib.blake2b(f"{request_id}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Side(NamedTuple):
    """The prefilling worker's part of a plan: seconds, and the prompt's tokens by where they come from."""

    queue_s: float
    prefill_s: float  # computing the uncached tokens, plus the per-request overheads
    restore_s: float  # bringing the tiers' run back into the pool
    cached: int  # in the pool already
    restored: int  # from the worker's tiers (host and disk)
    uncached: int  # computed
    disk: int = 0  # of `restored`, from the disk tier
    pull: Pull | None = None  # the prompt's next blocks copied from a peer first (`pulled` tokens)

    @property
    def pull_s(self) -> float:
        return self.pull.pull_s if self.pull is not None else 0.0

    @property
    def pulled(self) -> int:
        return self.pull.tokens if self.pull is not None else 0

    @property
    def busy_s(self) -> float:
        """The worker's own time on this prompt (compute + restore)."""
        return self.prefill_s + self.restore_s

    @property
    def ttft_s(self) -> float:
        """Its share of the TTFT: the pull (a transfer, not the worker's compute), the queue, the compute."""
        return self.queue_s + self.pull_s + self.busy_s


@dataclass(frozen=True)
class PullSources:
    """The prefill workers a prompt's blocks could be pulled from: (leading blocks their pool holds, worker),
    longest first — what the index says now (blocks a pending request will compute are not there to copy)."""

    runs: list[tuple[int, WorkerState]]
    min_blocks: int

    @classmethod
    def of(cls, pool: dict[str, int], prefills: list[WorkerState], min_blocks: int) -> PullSources:
        runs = [(pool[p.worker_id], p) for p in prefills if pool.get(p.worker_id, 0) >= max(1, min_blocks)]
        return cls(sorted(runs, key=lambda r: (-r[0], r[1].worker_id)), min_blocks)


class Estimator:
    """The TTFT terms of one plan, from CostSettings and the workers' state."""

    def __init__(self, settings: CostSettings) -> None:
        self.s = settings
        self._links = {cls: settings.link(cls) for cls in LINK_CLASSES}

    def prefill_rate(self, w: WorkerState, local: bool) -> float:
        if w.prefill_tokens_per_s > 0:
            return w.prefill_tokens_per_s
        rate = self.s.prefill_tokens_per_s
        return rate / self.s.decode_prefill_slowdown if local and self.s.decode_prefill_slowdown > 0 else rate

    def best_pull(
        self, query: RouteQuery, a: WorkerState, have: int, sources: PullSources, rate: float
    ) -> Pull | None:
        """The peer pull that saves worker `a` the most time over computing the same tokens, or None. `have`:
        the prompt's leading blocks a holds (pool, tiers, pending). Sources are prefill workers other than a,
        of a's model fingerprint, block size and KV dtype (a puller refuses blocks of another dtype), holding at
        least `min_blocks` blocks more than a does. Runs for every candidate of a decision: one tight loop, one
        Pull built."""
        runs = sources.runs
        need = max(1, sources.min_blocks)
        if not runs or runs[0][0] - have < need:
            return None  # longest first: nobody holds enough more than a does
        top = max(0, query.num_tokens - 1)
        bs = a.block_size
        kv = a.kv_bytes_per_token or self.s.kv_bytes_per_token
        overhead, unlabeled, links = self.s.peer_pull_overhead_s, self.s.unlabeled_link, self._links
        have_tokens = min(have * bs, top)
        best: tuple[float, WorkerState, int, int, float, str] | None = None
        for run, b in runs:
            extra = run - have
            if extra < need:
                break
            if b is a or b.fingerprint != a.fingerprint or b.block_size != bs or b.kv_dtype != a.kv_dtype:
                continue
            tokens = min(run * bs, top) - have_tokens
            if tokens <= 0:
                continue
            cls = link_class(a, b, unlabeled)
            bytes_per_s, latency_s = links[cls]
            pull_s = overhead + latency_s + extra * bs * kv / bytes_per_s
            saved = tokens / rate - pull_s
            if saved > 0 and (best is None or saved > best[0]):
                best = (saved, b, extra, tokens, pull_s, cls)
        if best is None:
            return None
        _, b, extra, tokens, pull_s, cls = best
        return Pull(b.worker_id, have, extra, tokens, pull_s, tokens / rate, cls)

    def prefill_side(
        self,
        query: RouteQuery,
        w: WorkerState,
        overlaps: dict[str, int],
        local: bool,
        tier2: Tiers | None = None,
        sources: PullSources | None = None,
    ) -> Side:
        """The prefilling side of a plan on w: its queue, compute, restore from its tiers, and — when `sources`
        is given and it pays — a pull of the next blocks from a peer."""
        rate = self.prefill_rate(w, local)
        n = query.num_tokens
        top = max(0, n - 1)
        bs = w.block_size
        pool = overlaps.get(w.worker_id, 0)
        host, disk = (tier2 or {}).get(w.worker_id, (0, 0))
        cached = min(pool * bs, top)
        from_host = min((pool + host) * bs, top) - cached
        from_disk = min((pool + host + disk) * bs, top) - cached - from_host
        pull = None
        if sources is not None:
            pull = self.best_pull(query, w, pool + host + disk, sources, rate)
        uncached = n - cached - from_host - from_disk - (pull.tokens if pull is not None else 0)
        queue_s = (w.queued_prefill_tokens + w.pending_prefill_tokens) / rate
        prefill_s = uncached / rate + self.s.prefill_overhead_s + (0.0 if local else self.s.remote_overhead_s)
        restore_s = (
            from_host * self.s.tier2_restore_fraction + from_disk * self.s.disk_restore_fraction
        ) / rate
        return Side(queue_s, prefill_s, restore_s, cached, from_host + from_disk, uncached, from_disk, pull)

    def admission_s(self, query: RouteQuery, d: WorkerState) -> float:
        step_s = d.step_s or self.s.default_step_s
        need = -(-max(query.num_tokens, 1) // d.block_size)
        full = self.s.kv_full_wait_s if d.free_blocks_now() < need else 0.0
        # an idle worker starts it at once; a busy one at the end of its current step (half a step on average),
        # after the requests already waiting there
        busy = 0.5 if d.running or d.pending_requests else 0.0
        return (busy + d.waiting) * step_s + full

    def transfer_s(self, query: RouteQuery, p: WorkerState, d: WorkerState) -> tuple[float, str]:
        cls = link_class(p, d, self.s.unlabeled_link)
        bytes_per_s, latency_s = self._links[cls]
        kv_bytes = query.num_tokens * (d.kv_bytes_per_token or self.s.kv_bytes_per_token)
        return latency_s + kv_bytes / bytes_per_s, cls

    def plan(
        self,
        query: RouteQuery,
        p: WorkerState | None,
        d: WorkerState,
        overlaps: dict[str, int],
        tier2: Tiers | None = None,
        sources: PullSources | None = None,
    ) -> PlanScore:
        local = p is None
        side = self.prefill_side(query, p or d, overlaps, local, tier2, sources)
        transfer_s = 0.0 if p is None else self.transfer_s(query, p, d)[0]
        admission_s = self.admission_s(query, d)
        interference_s = side.busy_s * d.running * self.s.interference_weight if local else 0.0
        ttft = side.ttft_s + transfer_s + admission_s
        terms = {
            "queue_s": side.queue_s,
            "pull_s": side.pull_s,
            "prefill_s": side.prefill_s,
            "restore_s": side.restore_s,
            "transfer_s": transfer_s,
            "admission_s": admission_s,
            "interference_s": interference_s,
            "cached_tokens": float(side.cached),
            "tier2_tokens": float(side.restored),
            "disk_tokens": float(side.disk),
            "pulled_tokens": float(side.pulled),
            "uncached_tokens": float(side.uncached),
        }
        return PlanScore(
            p.worker_id if p else None, d.worker_id, terms, ttft, ttft + interference_s, side.pull
        )


Candidate = tuple[float, "WorkerState | None", WorkerState]


def compatible(p: WorkerState, d: WorkerState) -> bool:
    """A prefill worker's KV is readable by the decode worker: same model fingerprint, block size and KV dtype
    (the fingerprint hashes the weights as float32, so a bfloat16 and a float32 worker of one model share it; the
    decode worker refuses the other dtype's KV, after the prefill and its copy)."""
    return p.fingerprint == d.fingerprint and p.block_size == d.block_size and p.kv_dtype == d.kv_dtype


def shape_rule(mode: str, query: RouteQuery, prefills: list[WorkerState]) -> tuple[bool | None, str]:
    """(remote?, why): True/False forced by the mode or the facts; None: the policy decides (ttft, auto)."""
    if mode == "agg":
        return False, "mode agg"
    if not query.need_prefill:
        return False, "no prefill needed"
    if not prefills:
        return False, f"mode {mode} but no eligible prefill worker"
    if mode == "disagg":
        return True, "mode disagg"
    return None, "auto"


def threshold_rule(query: RouteQuery, min_tokens: int) -> tuple[bool, str]:
    if query.num_tokens >= min_tokens:
        return True, f"auto, prompt {query.num_tokens} >= {min_tokens} tokens"
    return False, f"auto, prompt {query.num_tokens} < {min_tokens} tokens"


def term_reason(winner: PlanScore, runner_up: PlanScore | None) -> str:
    """The term that most separates the winner from the runner-up, as a reason."""
    if runner_up is None:
        return "only_candidate"
    if winner.pull is not None and winner.score + winner.pull.saved_s >= runner_up.score:
        return "peer_pull"  # without the pull (computing those blocks instead) the winner would not have won
    if (winner.prefill is None) != (runner_up.prefill is None):
        return "local_prefill" if winner.prefill is None else "remote_prefill"
    savings = {
        name: runner_up.terms[name] - winner.terms[name]
        for name in ("queue_s", "prefill_s", "transfer_s", "admission_s", "interference_s")
    }
    # the prompt's own time: computing what is not cached, restoring what is in its tiers, pulling from a peer
    savings["prefill_s"] += runner_up.terms["restore_s"] - winner.terms["restore_s"]
    savings["prefill_s"] += runner_up.terms["pull_s"] - winner.terms["pull_s"]
    best = max(savings, key=lambda k: savings[k])
    if savings[best] <= 0:
        return "near_best_spread"
    if best == "prefill_s":
        if winner.terms["cached_tokens"] > runner_up.terms["cached_tokens"]:
            return "cache_hit"  # the pool holds more of the prompt
        if winner.terms["tier2_tokens"] > runner_up.terms["tier2_tokens"]:
            return "tier2_hit"  # tier 2 holds more of it: restored instead of recomputed
        if winner.terms["pulled_tokens"] > runner_up.terms["pulled_tokens"]:
            return "peer_pull"
        return "least_compute"
    return {
        "queue_s": "least_queue",
        "transfer_s": "topology",
        "admission_s": "decode_admission",
        "interference_s": "least_interference",
    }[best]


# ------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class PolicySettings:
    """A policy's own knobs (none for the simplest baselines). Each field is a router flag of its name (or of
    its metadata's `flag`), so `RACKSERVE_<FLAG>` and the Helm values reach it too."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"policy setting {f.name} must be >= 0, got {value}")


@dataclass(frozen=True)
class TtftSettings(PolicySettings):
    near_best_ratio: float = setting(0.05, "plans within this fraction of the best are spread by request id")
    near_best_s: float = setting(0.002, "… or within this many seconds of the best")
    near_best_max: int = setting(8, "… at most this many of the best plans")
    peer_pull: bool = setting(
        True, "plan prefix pulls: prefill on one worker after copying the prompt's cached blocks from a peer"
    )
    peer_pull_min_blocks: int = setting(4, "a peer pull is planned only for at least this many blocks")


@dataclass(frozen=True)
class DynamoKvSettings(PolicySettings):
    overlap_weight: float = setting(1.0, "dynamo_kv: weight of prefill blocks against decode blocks")
    temperature: float = setting(
        0.0, "dynamo_kv: softmax temperature (0: the lowest cost)", flag="router-temperature"
    )


@dataclass(frozen=True)
class SglCacheAwareSettings(PolicySettings):
    cache_threshold: float = setting(0.3, "sgl_cache_aware: prefix match rate that routes by cache")
    balance_abs_threshold: int = setting(64, "sgl_cache_aware: load gap that means imbalance")
    balance_rel_threshold: float = setting(1.5, "sgl_cache_aware: load ratio that means imbalance")


def setting_flag(f: dataclasses.Field[Any]) -> str:
    """The command-line flag of a settings field (CostSettings' or a policy's)."""
    return "--" + (f.metadata.get("flag") or f.name.replace("_", "-"))


# ------------------------------------------------------------------------------------------ base

S = TypeVar("S", bound=PolicySettings)


class Ranked(NamedTuple):
    """A baseline's ranking: workers best first, and the rule that ordered them (the decision's reason)."""

    workers: list[WorkerState]
    reason: str


class Policy(Generic[S]):
    """Shared frame: eligibility, plan shape by mode, explanation. Subclasses pick workers."""

    name: ClassVar[str] = ""
    reason: ClassVar[str] = ""  # a baseline's reason: the name of its one rule
    Settings: ClassVar[type[PolicySettings]] = PolicySettings  # the type of `options`

    def __init__(
        self,
        options: S,
        mode: str = DEFAULT_MODE,
        settings: CostSettings | None = None,
        disagg_min_prompt_tokens: int = DEFAULT_DISAGG_MIN_PROMPT_TOKENS,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if type(options) is not self.Settings:
            raise TypeError(f"{self.name} takes {self.Settings.__name__}, got {type(options).__name__}")
        self.options: S = options
        self.mode = mode
        self.settings = settings or CostSettings()
        self.estimator = Estimator(self.settings)
        self.disagg_min_prompt_tokens = disagg_min_prompt_tokens

    def route(self, view: ClusterView, query: RouteQuery) -> Decision:
        decodes = view.eligible("decode", query)
        if not decodes:
            raise NoWorkerError("no decode workers")
        prefills = view.eligible("prefill", query) if query.need_prefill else []
        remote, why = shape_rule(self.mode, query, prefills)
        return self.decide(view, query, prefills, decodes, remote, why)

    def decide(
        self,
        view: ClusterView,
        query: RouteQuery,
        prefills: list[WorkerState],
        decodes: list[WorkerState],
        remote: bool | None,
        why: str,
    ) -> Decision:
        """Baselines: the threshold rule settles auto; then pick the prefilling and decoding workers."""
        if remote is None:
            remote, why = threshold_rule(query, self.disagg_min_prompt_tokens)
        overlaps = view.overlaps(query)
        if remote:
            ranked_p, reason = self.rank(view, query, prefills, overlaps, prefilling=True)
            d = self.rank(view, query, decodes, overlaps, prefilling=False).workers[0]
            compatible_p = [p for p in ranked_p if compatible(p, d)]
            if not compatible_p:
                remote, why = False, f"{why}; no prefill worker compatible with {d.worker_id}"
            else:
                chosen = self.estimator.plan(query, compatible_p[0], d, overlaps)
                runner = (
                    self.estimator.plan(query, compatible_p[1], d, overlaps)
                    if len(compatible_p) > 1
                    else None
                )
                return Decision(self.name, reason, chosen, runner, f"disagg: {why}")
        ranked_d, reason = self.rank(view, query, decodes, overlaps, prefilling=True)
        chosen = self.estimator.plan(query, None, ranked_d[0], overlaps)
        runner = self.estimator.plan(query, None, ranked_d[1], overlaps) if len(ranked_d) > 1 else None
        return Decision(self.name, reason, chosen, runner, f"agg: {why}")

    def rank(
        self,
        view: ClusterView,
        query: RouteQuery,
        workers: list[WorkerState],
        overlaps: dict[str, int],
        prefilling: bool,
    ) -> Ranked:
        """A baseline's one rule: workers best first, and why; `prefilling` says whether the worker runs the
        prompt (the reason of a decision is that of its prefilling worker's ranking)."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ baselines


class RoundRobin(Policy[PolicySettings]):
    """Each role's next worker id after the last one chosen, in id order, so a changing set stays fair."""

    name = "round_robin"
    reason = "next_in_turn"

    def __init__(self, options: PolicySettings, *args: Any, **kw: Any) -> None:
        super().__init__(options, *args, **kw)
        self._last: dict[str, str] = {}  # the policy's own turn counter: its only state

    def rank(
        self,
        view: ClusterView,
        query: RouteQuery,
        workers: list[WorkerState],
        overlaps: dict[str, int],
        prefilling: bool,
    ) -> Ranked:
        role = workers[0].role
        last = self._last.get(role, "")
        turn = next((i for i, w in enumerate(workers) if w.worker_id > last), 0)
        ranked = workers[turn:] + workers[:turn]
        self._last[role] = ranked[0].worker_id
        return Ranked(ranked, self.reason)


class LeastLoaded(Policy[PolicySettings]):
    """Fewest waiting + running requests (counting this router's pending ones); ties spread by request id."""

    name = reason = "least_loaded"

    def rank(
        self,
        view: ClusterView,
        query: RouteQuery,
        workers: list[WorkerState],
        overlaps: dict[str, int],
        prefilling: bool,
    ) -> Ranked:
        return Ranked(
            sorted(workers, key=lambda w: (w.load, -rendezvous(query.request_id, w.worker_id))), self.reason
        )


class CacheOverlap(Policy[PolicySettings]):
    """Most leading prompt blocks cached on the prefilling worker; ties by load, then request id."""

    name = "cache_overlap"
    reason = "cache_hit"

    def rank(
        self,
        view: ClusterView,
        query: RouteQuery,
        workers: list[WorkerState],
        overlaps: dict[str, int],
        prefilling: bool,
    ) -> Ranked:
        def key(w: WorkerState) -> tuple[int, int, int]:
            cached = overlaps.get(w.worker_id, 0) if prefilling else 0
            return (-cached, w.load, -rendezvous(query.request_id, w.worker_id))

        return Ranked(sorted(workers, key=key), self.reason)


class DynamoKv(Policy[DynamoKvSettings]):
    """Dynamo's KV router cost (lib/kv-router selector): per worker
    logit = overlap_weight · potential_prefill_blocks + potential_decode_blocks, where prefill blocks are the
    worker's queued prompt blocks plus this request's uncached blocks, and decode blocks its active blocks plus
    this request's blocks. Temperature 0: the lowest logit; > 0: softmax over the negated logits normalised to
    [0, 1], sampled with a draw derived from the request id (so replicas agree on a request)."""

    name = "dynamo_kv"
    reason = "dynamo_cost"
    Settings = DynamoKvSettings

    def logit(self, query: RouteQuery, w: WorkerState, overlaps: dict[str, int], prefilling: bool) -> float:
        bs = w.block_size
        request_blocks = -(-query.num_tokens // bs)
        cached = overlaps.get(w.worker_id, 0) if prefilling else request_blocks
        queued_blocks = (w.queued_prefill_tokens + w.pending_prefill_tokens) / bs
        prefill_blocks = queued_blocks + max(0, request_blocks - cached)
        decode_blocks = w.active_decode_blocks + w.pending_decode_blocks + request_blocks
        return self.options.overlap_weight * prefill_blocks + decode_blocks

    def rank(
        self,
        view: ClusterView,
        query: RouteQuery,
        workers: list[WorkerState],
        overlaps: dict[str, int],
        prefilling: bool,
    ) -> Ranked:
        logits = {w.worker_id: self.logit(query, w, overlaps, prefilling) for w in workers}
        ranked = sorted(
            workers, key=lambda w: (logits[w.worker_id], -rendezvous(query.request_id, w.worker_id))
        )
        temperature = self.options.temperature
        if temperature <= 0 or len(workers) < 2:
            return Ranked(ranked, self.reason)
        lo, hi = min(logits.values()), max(logits.values())
        span = (hi - lo) or 1.0
        weights = [math.exp(-((logits[w.worker_id] - lo) / span) / temperature) for w in ranked]
        draw = rendezvous(query.request_id, "dynamo_kv") / 2**64 * sum(weights)
        for i, weight in enumerate(weights):
            draw -= weight
            if draw <= 0:
                return Ranked([ranked[i], *ranked[:i], *ranked[i + 1 :]], self.reason)
        return Ranked(ranked, self.reason)


class SglCacheAware(Policy[SglCacheAwareSettings]):
    """sgl-router's cache-aware policy. If the load is imbalanced — max − min > balance_abs_threshold and
    max > balance_rel_threshold · min, load = requests on the worker — the least-loaded worker. Otherwise, if
    the best prefix match covers more than cache_threshold of the prompt, the worker with that match; else the
    worker with the most room for new cache (the smallest indexed tree). Defaults are sgl-router's."""

    name = "sgl_cache_aware"
    reason = "cache_hit"
    Settings = SglCacheAwareSettings

    def rank(
        self,
        view: ClusterView,
        query: RouteQuery,
        workers: list[WorkerState],
        overlaps: dict[str, int],
        prefilling: bool,
    ) -> Ranked:
        tie = {w.worker_id: -rendezvous(query.request_id, w.worker_id) for w in workers}
        by_load = sorted(workers, key=lambda w: (w.load, tie[w.worker_id]))
        if not prefilling:
            return Ranked(by_load, "balance")  # a decode worker is chosen by load alone
        opts = self.options
        lo, hi = by_load[0].load, by_load[-1].load
        if hi - lo > opts.balance_abs_threshold and hi > opts.balance_rel_threshold * lo:
            return Ranked(by_load, "balance")

        def matched(w: WorkerState) -> int:
            return min(overlaps.get(w.worker_id, 0) * w.block_size, query.num_tokens)

        by_match = sorted(workers, key=lambda w: (-matched(w), tie[w.worker_id]))
        if query.num_tokens and matched(by_match[0]) / query.num_tokens > opts.cache_threshold:
            return Ranked(by_match, "cache_hit")
        index = view.index
        return Ranked(
            sorted(workers, key=lambda w: (index.blocks_of(w.worker_id), tie[w.worker_id])), "most_cache_room"
        )


# ------------------------------------------------------------------------------------------ rackserve


class TtftEstimate(Policy[TtftSettings]):
    """The minimum estimated TTFT over every (prefill worker | local, decode worker) plan the mode allows,
    by the cost model; among the `near_best_max` best plans within `near_best_ratio` / `near_best_s` of the
    best, the one ranked highest for this request id (so router replicas with the same stale view do not
    herd)."""

    name = "ttft"
    Settings = TtftSettings

    def decide(
        self,
        view: ClusterView,
        query: RouteQuery,
        prefills: list[WorkerState],
        decodes: list[WorkerState],
        remote: bool | None,
        why: str,
    ) -> Decision:
        pool, overlaps = view.split_overlaps(query)
        tier2 = view.tier2_overlaps(query, overlaps)
        opts = self.options
        # prefill workers only can be pull sources (they own the KV they serve); eligible ones (healthy, not
        # excluded, of the query's model) — a puller also checks the source's fingerprint against its own
        sources = PullSources.of(pool, prefills, opts.peer_pull_min_blocks) if opts.peer_pull else None
        est = self.estimator
        weight = self.settings.interference_weight
        admission = {d.worker_id: est.admission_s(query, d) for d in decodes}
        # (score, prefilling worker or None for local, decode worker); PlanScores only for the two that matter
        candidates: list[Candidate] = []
        if remote is not True:
            for d in decodes:
                side = est.prefill_side(query, d, overlaps, True, tier2, sources)
                score = side.ttft_s + admission[d.worker_id] + side.busy_s * d.running * weight
                candidates.append((score, None, d))
        if remote is not False:
            candidates += self._remote_candidates(
                query, prefills, decodes, overlaps, tier2, admission, sources
            )
        if not candidates:  # disagg forced but nothing compatible
            why = f"{why}; no prefill worker compatible with any decode worker"
            return self.decide(view, query, prefills, decodes, False, why)
        best = min(c[0] for c in candidates)
        bar = best * (1 + opts.near_best_ratio) + opts.near_best_s
        rid = query.request_id
        near_max = max(1, opts.near_best_max)
        near = heapq.nsmallest(near_max, (c for c in candidates if c[0] <= bar), key=lambda c: c[0])
        chosen_c = max(
            near, key=lambda c: rendezvous(rid, f"{c[1].worker_id if c[1] else ''}|{c[2].worker_id}")
        )
        others = [c for c in candidates if c is not chosen_c]
        runner_c = min(others, key=lambda c: c[0]) if others else None
        chosen = est.plan(query, chosen_c[1], chosen_c[2], overlaps, tier2, sources)
        runner_up = est.plan(query, runner_c[1], runner_c[2], overlaps, tier2, sources) if runner_c else None
        shape = "agg" if chosen.prefill is None else "disagg"
        if chosen.pull is not None:
            pull = chosen.pull
            why = f"{why}; pull {pull.blocks} blocks from {pull.source} ({pull.link})"
        return Decision(self.name, term_reason(chosen, runner_up), chosen, runner_up, f"{shape}: {why}")

    def _remote_candidates(
        self,
        query: RouteQuery,
        prefills: list[WorkerState],
        decodes: list[WorkerState],
        overlaps: dict[str, int],
        tier2: Tiers,
        admission: dict[str, float],
        sources: PullSources | None = None,
    ) -> list[Candidate]:
        """Per decode worker, the prefill workers whose plan could be near-best for it, scored.

        A remote plan's score is side(p) + transfer(link class of p and d) + admission(d), so for a decode
        worker only the best few prefill workers of each topology group (same node, rack, zone, unlabeled, any)
        matter: P·D pairs become at most 5 groups × 3 per decode worker, picked once per distinct decode-worker label
        set, which keeps a decision well under a millisecond at 64 workers."""
        est = self.estimator
        side: dict[str, float] = {}
        for p in prefills:
            side[p.worker_id] = est.prefill_side(query, p, overlaps, False, tier2, sources).ttft_s
        groups: dict[tuple[str, str], list[WorkerState]] = {}
        for p in sorted(prefills, key=lambda p: side[p.worker_id]):
            for label, value in (("node", p.node), ("rack", p.rack), ("zone", p.zone)):
                if value:
                    groups.setdefault((label, value), []).append(p)
            # an unlabeled worker's link to anyone is --unlabeled-link, nearer than the labeled workers in "any"
            # but the decode worker's own groups can be: the best few of "any" would hide it
            if not (p.node or p.rack or p.zone):
                groups.setdefault(("unlabeled", ""), []).append(p)
            groups.setdefault(("any", ""), []).append(p)
        keep = 3  # best few of each group: the near-best set of a burst spreads over more than one
        # decode workers with the same labels and KV format see the same prefill candidates: pick them once
        by_key: dict[tuple[str, str, str, str, int, int], list[tuple[float, WorkerState]]] = {}
        out: list[Candidate] = []
        for d in decodes:
            key = (d.node, d.rack, d.zone, d.fingerprint, d.block_size, d.kv_bytes_per_token)
            scored = by_key.get(key)
            if scored is None:
                scored = by_key[key] = [
                    (side[p.worker_id] + est.transfer_s(query, p, d)[0], p)
                    for p in self._picks(d, groups, keep)
                ]
                if len(scored) < keep:  # the best few were incompatible: look at the rest
                    seen = {p.worker_id for _, p in scored}
                    scored += [
                        (side[p.worker_id] + est.transfer_s(query, p, d)[0], p)
                        for p in prefills
                        if p.worker_id not in seen and compatible(p, d)
                    ][:keep]
            base = admission[d.worker_id]
            out += [(x + base, p, d) for x, p in scored]
        return out

    @staticmethod
    def _picks(
        d: WorkerState, groups: dict[tuple[str, str], list[WorkerState]], keep: int
    ) -> list[WorkerState]:
        """The best `keep` compatible prefill workers of each topology group d belongs to, nearest first."""
        seen: set[str] = set()
        picked: list[WorkerState] = []
        for key in (("node", d.node), ("rack", d.rack), ("zone", d.zone), ("unlabeled", ""), ("any", "")):
            if key[0] in ("node", "rack", "zone") and not key[1]:
                continue
            for p in groups.get(key, [])[:keep]:
                if p.worker_id not in seen and compatible(p, d):
                    seen.add(p.worker_id)
                    picked.append(p)
        return picked


# Every policy by its `--policy` name; the order is the order of --help and of the simulator's tables.
REGISTRY: dict[str, type[Policy[Any]]] = {
    cls.name: cls for cls in (TtftEstimate, RoundRobin, LeastLoaded, CacheOverlap, DynamoKv, SglCacheAware)
}
POLICIES = tuple(REGISTRY)


def make_policy(
    name: str = DEFAULT_POLICY,
    mode: str = DEFAULT_MODE,
    *,
    settings: CostSettings | None = None,
    disagg_min_prompt_tokens: int = DEFAULT_DISAGG_MIN_PROMPT_TOKENS,
    options: PolicySettings | None = None,
    **knobs: float,
) -> Policy[Any]:
    """A policy by its `--policy` name. `options` is its settings dataclass (`REGISTRY[name].Settings`); or
    give single knobs by field name (`overlap_weight=4.0`), each replacing its default."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    if options is None:
        options = cls.Settings()
    if knobs:
        known = {f.name for f in fields(cls.Settings)}
        if unknown := sorted(set(knobs) - known):
            raise TypeError(
                f"{name} has no setting {', '.join(unknown)} (it has: {', '.join(sorted(known))})"
            )
        options = dataclasses.replace(options, **knobs)
    return cls(options, mode, settings, disagg_min_prompt_tokens)

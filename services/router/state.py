"""RouterState: everything one router knows, and the one place a decision is made — without any network.

It holds the live workers (WorkerState), the global prefix index, this router's pending reservations, each
worker's measured prefill rate and the failure exclusions, and routes a RouteQuery with the configured policy.
The gRPC server (services.router.server) feeds it from etcd and the workers' Subscribe streams; the load
generator's simulator feeds it from its simulated workers through the same methods:

    state = RouterState(make_policy("ttft", mode="auto"))
    state.add_worker(WorkerState("p0", "prefill", epoch=1, rack="r1"))
    state.on_stored("p0", hashes, now)          # a worker's stored-block event
    state.on_load("p0", now, waiting=0, running=1, queued_prefill_tokens=512)
    decision = state.route(RouteQuery("req-1", token_ids=prompt), now)

A worker reported as failed is excluded until it re-registers with a new epoch, or `failure_exclusion_s`
passes (a safety valve: a report can blame a healthy but slow worker).

This room holds no request state beyond short-lived reservations, and never does I/O or reads a clock.
"""

from __future__ import annotations

from dataclasses import replace

from services.router.cost_model import RateMeter
from services.router.policy import ClusterView, Decision, Policy, RouteQuery, WorkerState
from services.router.prefix_index import DEFAULT_MAX_ENTRIES, HOST, PrefixIndex
from services.router.reservations import DEFAULT_ARRIVAL_GRACE_S, DEFAULT_TTL_S, Reservations

DEFAULT_FAILURE_EXCLUSION_S = 10.0
LOAD_FIELDS = ("waiting", "running", "queued_prefill_tokens", "active_decode_blocks", "free_blocks", "step_s")


class RouterState:
    def __init__(
        self,
        policy: Policy,
        index_max_entries: int = DEFAULT_MAX_ENTRIES,
        reservation_ttl_s: float = DEFAULT_TTL_S,
        reservation_grace_s: float = DEFAULT_ARRIVAL_GRACE_S,
        failure_exclusion_s: float = DEFAULT_FAILURE_EXCLUSION_S,
    ) -> None:
        self.policy = policy
        self.workers: dict[str, WorkerState] = {}
        self.index = PrefixIndex(index_max_entries)
        self.reservations = Reservations(reservation_ttl_s, reservation_grace_s)
        self.failure_exclusion_s = failure_exclusion_s
        self._meters: dict[str, RateMeter] = {}
        self._failed: dict[str, tuple[int, float]] = {}  # worker id -> (epoch reported, excluded until)
        self.view = ClusterView(self.workers, self.index, self.reservations.pending_overlaps(self.workers))

    # ------------------------------------------------------------------------------------------ membership

    def add_worker(self, worker: WorkerState) -> None:
        """A worker appeared (or re-registered). A new epoch is a new process: its old state is dropped."""
        old = self.workers.get(worker.worker_id)
        if old is not None and old.epoch != worker.epoch:
            self.remove_worker(worker.worker_id)
            old = None
        if old is not None:  # the same process again (e.g. after etcd re-list): keep its load and blocks
            for name in (
                "endpoint",
                "capacity_blocks",
                "fingerprint",
                "node",
                "rack",
                "zone",
                "kv_bytes_per_token",
            ):
                setattr(old, name, getattr(worker, name))
            return
        failed = self._failed.get(worker.worker_id)
        if failed is not None and failed[0] != worker.epoch:
            del self._failed[worker.worker_id]
        self.workers[worker.worker_id] = worker
        s = self.policy.settings
        self._meters[worker.worker_id] = RateMeter(s.rate_ewma_alpha, s.rate_min_busy_s)

    def remove_worker(self, worker_id: str) -> None:
        """The worker left (lease expired, drained): its index entries and reservations go with it."""
        self.workers.pop(worker_id, None)
        self._meters.pop(worker_id, None)
        self.index.remove_worker(worker_id)
        self.reservations.forget(worker_id)

    def report_failure(self, worker_id: str, now: float) -> None:
        w = self.workers.get(worker_id)
        epoch = w.epoch if w is not None else 0
        self._failed[worker_id] = (epoch, now + self.failure_exclusion_s)

    # ------------------------------------------------------------------------------------------ worker events

    def on_load(self, worker_id: str, now: float, **load: float) -> None:
        """A LoadSnapshot: fields of LOAD_FIELDS. It reflects requests reserved before it (minus a grace)."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        for name in LOAD_FIELDS:
            if name in load:
                setattr(w, name, type(getattr(w, name))(load[name]))
        self.reservations.on_load(w, now)
        meter = self._meters[worker_id]
        meter.load(busy=w.queued_prefill_tokens > 0, now=now)
        if meter.tokens_per_s:
            w.prefill_tokens_per_s = meter.tokens_per_s

    def on_stored(self, worker_id: str, hashes: list[int], computed: bool = True) -> None:
        """Blocks the worker cached; `computed`: it computed them now (not a snapshot of its existing cache)."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        self.index.stored(worker_id, hashes)
        if computed:
            self._meters[worker_id].computed(len(hashes) * w.block_size)

    def on_evicted(self, worker_id: str, hashes: list[int]) -> None:
        self.index.evicted(worker_id, hashes)

    def on_offloaded(self, worker_id: str, hashes: list[int], tier: str = HOST) -> None:
        """Blocks that entered one of the worker's tiers (host, or disk below it); their eviction from the pool
        is on_evicted."""
        if worker_id in self.workers:
            self.index.offloaded(worker_id, hashes, tier)

    def on_restored(self, worker_id: str, hashes: list[int], tier: str = HOST) -> None:
        """Blocks back in the worker's pool from one of its tiers: cached again, but not computed (no rate
        sample)."""
        if worker_id in self.workers:
            self.index.restored(worker_id, hashes, tier)

    def on_tier2_dropped(self, worker_id: str, hashes: list[int], tier: str = HOST) -> None:
        self.index.tier2_dropped(worker_id, hashes, tier)

    def forget_blocks(self, worker_id: str) -> None:
        """Before a fresh snapshot of the worker's cache (its event stream reopened)."""
        self.index.clear_worker(worker_id)

    # ------------------------------------------------------------------------------------------ routing

    def route(self, query: RouteQuery, now: float) -> Decision:
        """Decide, then reserve the chosen workers. NoWorkerError when no decode worker is eligible."""
        self.reservations.expire(self.workers, now)
        for worker_id, (epoch, until) in list(self._failed.items()):
            w = self.workers.get(worker_id)
            if now >= until or (w is not None and w.epoch != epoch):
                del self._failed[worker_id]
        if self._failed:
            query = replace(query, exclude=query.exclude | frozenset(self._failed))
        decision = self.policy.route(self.view, query)
        self.reservations.reserve(decision, query, self.workers, now)
        return decision

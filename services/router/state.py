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
passes (a safety valve: a report can blame a healthy but slow worker). A worker whose event stream has said
nothing for `silent_after_s` (it sends its load every second; a frozen, dead or stuck process stops) is excluded
until it speaks again — where the caller feeds `heard` and `lost` (the simulator's workers never go silent).

This room holds no request state beyond short-lived reservations, and never does I/O or reads a clock.
"""

from __future__ import annotations

from dataclasses import replace

from services.router.cost_model import RateMeter
from services.router.policy import ClusterView, Decision, Policy, RouteQuery, WorkerState
from services.router.prefix_index import DEFAULT_MAX_ENTRIES, HOST, PrefixIndex
from services.router.reservations import DEFAULT_ARRIVAL_GRACE_S, DEFAULT_TTL_S, Reservations

DEFAULT_FAILURE_EXCLUSION_S = 10.0
DEFAULT_SILENT_AFTER_S = 3.0  # three missed load heartbeats (services.runtime.worker.LOAD_HEARTBEAT_S)
LOAD_FIELDS = ("waiting", "running", "queued_prefill_tokens", "active_decode_blocks", "free_blocks", "step_s")


class RouterState:
    def __init__(
        self,
        policy: Policy,
        index_max_entries: int = DEFAULT_MAX_ENTRIES,
        reservation_ttl_s: float = DEFAULT_TTL_S,
        reservation_grace_s: float = DEFAULT_ARRIVAL_GRACE_S,
        failure_exclusion_s: float = DEFAULT_FAILURE_EXCLUSION_S,
        silent_after_s: float = DEFAULT_SILENT_AFTER_S,
    ) -> None:
        self.policy = policy
        self.workers: dict[str, WorkerState] = {}
        self.index = PrefixIndex(index_max_entries)
        self.reservations = Reservations(reservation_ttl_s, reservation_grace_s)
        self.failure_exclusion_s = failure_exclusion_s
        self._meters: dict[str, RateMeter] = {}
        self._failed: dict[str, tuple[int, float]] = {}  # worker id -> (epoch reported, excluded until)
        self.silent_after_s = silent_after_s
        self._heard: dict[str, float] = {}  # worker id -> when its event stream last said anything
        self.view = ClusterView(self.workers, self.index, self.reservations.pending_overlaps(self.workers))

    # ------------------------------------------------------------------------------------------ membership

    def add_worker(self, worker: WorkerState, now: float | None = None) -> None:
        """A worker appeared (or re-registered). A new epoch is a new process: its old state is dropped. With
        `now`, it must be heard from (`heard`) within silent_after_s of it, and then as often, to be routed to."""
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
                "kv_dtype",
            ):
                setattr(old, name, getattr(worker, name))
            return
        failed = self._failed.get(worker.worker_id)
        if failed is not None and failed[0] != worker.epoch:
            del self._failed[worker.worker_id]
        self.workers[worker.worker_id] = worker
        if now is not None:
            self._heard[worker.worker_id] = now
        s = self.policy.settings
        self._meters[worker.worker_id] = RateMeter(s.rate_ewma_alpha, s.rate_min_busy_s)

    def remove_worker(self, worker_id: str) -> None:
        """The worker left (lease expired, drained): its index entries and reservations go with it."""
        self.workers.pop(worker_id, None)
        self._heard.pop(worker_id, None)
        self._meters.pop(worker_id, None)
        self.index.remove_worker(worker_id)
        self.reservations.forget(worker_id)

    def report_failure(self, worker_id: str, now: float, epoch: int = 0) -> bool:
        """Exclude the worker (the process of `epoch`, 0: the current one) for failure_exclusion_s. False, and
        nothing kept, for a worker this router does not know or a process that is gone already."""
        w = self.workers.get(worker_id)
        if w is None or (epoch and epoch != w.epoch):
            return False
        self._failed[worker_id] = (w.epoch, now + self.failure_exclusion_s)
        return True

    # ------------------------------------------------------------------------------------------ worker events

    def heard(self, worker_id: str, now: float) -> None:
        """The worker's event stream said something (any event: a load heartbeat comes every second)."""
        if worker_id in self._heard:
            self._heard[worker_id] = now

    def lost(self, worker_id: str) -> None:
        """The worker's event stream failed: not routed to until it is heard from again."""
        if worker_id in self._heard:
            self._heard[worker_id] = float("-inf")

    def silent(self, now: float) -> list[str]:
        """The workers not heard from for more than silent_after_s, by id."""
        return sorted(w for w, t in self._heard.items() if now - t > self.silent_after_s)

    def on_load(self, worker_id: str, now: float, **load: float) -> None:
        """A LoadSnapshot: fields of LOAD_FIELDS. It reflects requests reserved before it (minus a grace), unless
        it repeats the worker's last one."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        changed = False
        for name in LOAD_FIELDS:
            if name in load:
                value = type(getattr(w, name))(load[name])
                changed = changed or value != getattr(w, name)
                setattr(w, name, value)
        # A worker repeats its last snapshot as its heartbeat while its engine is inside a step, and a request that
        # reached it meanwhile is in no snapshot before that step ends (seconds, for a long prompt on a CPU): a
        # repeat says the worker is alive, not that it counts what was routed to it since. Its reservations stay
        # until a snapshot that differs, or their TTL.
        if changed:
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
        excluded = frozenset(self._failed).union(self.silent(now))
        if excluded:
            query = replace(query, exclude=query.exclude | excluded)
        decision = self.policy.route(self.view, query)
        self.reservations.reserve(decision, query, self.workers, now)
        return decision

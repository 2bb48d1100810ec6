"""A deterministic discrete-event simulation of a rackserve cluster: no network, no model, only time.

What it models, and how simply:
- frontend: at most `max_inflight` requests admitted; the rest wait in FIFO order (queue time).
- routing: the live router's policy objects (services/router/policy.py) over an exact view of every worker's
  state and a PrefixIndex fed by the workers' cache events (loadgen/sim/routing.py).
- prefill workers: FIFO, chunked prefill (`max_prefill_chunk_tokens` per step, several requests per step),
  prefix cache of chained block hashes (services/engine/block_hash.py) with LRU eviction; the cache holds what
  running requests do not (capacity in blocks), and a starting request's prefix hit is its own at once (never
  evicted to make room for the rest of its prompt). The prefill emits the first token.
- KV transfer: the prompt's KV bytes over the link class between the two workers (same node / rack / across
  racks); transfers queue on the sending and the receiving worker's one NIC.
- host tier (`ClusterConfig.host_tier`, capacity and host link from the profile): a block the pool evicts moves
  to the worker's host tier (LRU, its own capacity) instead of vanishing; a prompt whose next blocks are there
  restores them instead of recomputing, the restore's time (the profile's host link) added to the step that
  starts the request. Offloads, restores and drops are KV events to the router's index, as on a real worker.
- peer pulls: when the router's plan has a `pull` (services/router/policy.py), the prefilling worker first
  copies those blocks from the source's pool over the link class between them (on both workers' NICs); the
  request waits for the pull, then prefills. Blocks the source evicted meanwhile are recomputed instead.
- decode workers: continuous batching up to `max_batch`, admission by free KV blocks (prompt + output reserved);
  a worker in aggregated mode also runs prefill chunks, and those chunks stall its decode steps — the
  interference that disaggregation removes.
- failures: at a given time a worker dies; its queued and running requests migrate (re-routed; a request that
  was decoding is rebuilt by a local prefill of prompt + emitted tokens on its new decode worker), up to
  `migration_limit` times, else it fails.
Same workload, config and seed → the same results, bit for bit (no wall clock, no unordered iteration).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadgen.report import RequestResult
from loadgen.sim.profile import Profile
from loadgen.sim.routing import SimRouter
from loadgen.workload import RequestSpec
from services.router.cost_model import LOCAL, SAME_NODE, SAME_RACK, SAME_ZONE
from services.router.policy import DEFAULT_MODE, MODES


@dataclass
class ClusterConfig:
    prefill_workers: int = 1
    decode_workers: int = 1
    mode: str = DEFAULT_MODE  # the router's mode: agg (no prefill pool) | disagg | auto (the policy decides)
    policy: str = "ttft"
    max_inflight: int = 1_000_000
    migration_limit: int = 3
    failures: list[tuple[float, str]] = field(default_factory=list)  # (time s, worker id)
    seed: int = 0
    placement: dict[str, tuple[str, str]] = field(default_factory=dict)  # worker id → (node, rack) override
    rate_error: float = 1.0  # the router believes prefill runs this many times faster than it does
    host_tier: bool = (
        False  # each worker gets the profile's host-memory KV tier (a real worker's --kv-tier2-bytes)
    )
    peer_pull: bool = True  # the TTFT policy may plan prefix pulls between workers (the router's --peer-pull)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.decode_workers < 1:
            raise ValueError("at least one decode worker")
        if self.mode != "agg" and self.prefill_workers < 1:
            raise ValueError(f"mode {self.mode} needs at least one prefill worker")


@dataclass
class Req:
    spec: RequestSpec
    hashes: list[int]
    arrival_s: float
    prefill_worker: str | None = None
    decode_worker: str = ""
    input_tokens: int = 0  # tokens to prefill now (prompt, or prompt + emitted after a migration)
    cached_tokens: int = 0
    remaining_prefill: int = 0
    token_times: list[float] = field(default_factory=list)
    t_admit: float | None = None
    t_prefill_start: float | None = None
    t_first: float | None = None
    t_transfer_end: float | None = None
    t_decode_start: float | None = None
    t_done: float | None = None
    migrations: int = 0
    failed: str | None = None
    blocks_held: int = 0
    held_from_start: int = 0  # its leading blocks the worker had when its prefill started (held since)
    first_cached: int | None = None
    estimated_ttft_s: float | None = None  # the router's estimate at the first decision
    pull_until: float | None = None  # waiting for a peer pull to land before its prefill may start
    pull_end_block: int = 0  # the block after the last one that pull brings
    restore_s: float = 0.0  # its restore from the host tier, charged to the step that starts it
    pulled_blocks: int = 0  # blocks a peer pull brought (in its cached prefix)
    restored_blocks: int = 0  # blocks its prefill restored from the host tier

    @property
    def emitted(self) -> int:
        return len(self.token_times)


class Worker:
    def __init__(self, sim: Simulator, worker_id: str, role: str, node: str, rack: str) -> None:
        self.sim, self.worker_id, self.role, self.node, self.rack = sim, worker_id, role, node, rack
        self.capacity = sim.profile.kv_capacity_blocks
        self.tier_capacity = sim.profile.host_tier_blocks if sim.cfg.host_tier else 0
        self.tier: OrderedDict[int, None] = OrderedDict()  # host-tier blocks, LRU: oldest first
        self.used = 0  # blocks held by requests here
        self.cache: OrderedDict[int, None] = OrderedDict()  # free cached blocks, LRU: oldest first
        self.held: dict[int, int] = {}  # computed blocks that requests here still hold (shareable too): refs
        self.prefill_queue: deque[Req] = deque()
        self.pending: Counter[int] = Counter()  # block hashes of queued prefills (soon cached)
        self.incoming: Counter[int] = Counter()  # block hashes a peer pull is copying here right now
        self.admit_queue: deque[Req] = deque()
        self.running: list[Req] = []
        self.busy = False
        self.dead = False
        self.draining = False  # takes no new work; what it holds runs to the end (a planner's scale-down)
        self.nic_free_s = 0.0
        self.queued_tokens = 0

    # ---- KV blocks -------------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache and h not in self.held:
                break
            n += 1
        return n

    def pending_match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache and h not in self.held and self.pending[h] <= 0:
                break
            n += 1
        return n

    def _fit_cache(self) -> None:
        gone = []
        while self.cache and len(self.cache) > self.capacity - self.used:
            gone.append(self.cache.popitem(last=False)[0])
        gone = [h for h in gone if h not in self.held]
        if gone:
            self.sim.router.evicted(self.worker_id, gone)
            if self.tier_capacity:
                self._offload(gone)

    def _offload(self, hashes: list[int]) -> None:
        """Evicted pool blocks enter the host tier; its own LRU pushes the oldest out for good."""
        tier = self.tier
        for h in hashes:
            tier[h] = None
            tier.move_to_end(h)
        self.sim.router.offloaded(self.worker_id, hashes)
        dropped = []
        while len(tier) > self.tier_capacity:
            dropped.append(tier.popitem(last=False)[0])
        if dropped:
            self.sim.router.tier_dropped(self.worker_id, dropped)

    def tier_run(self, hashes: Sequence[int], start: int) -> int:
        """How many of `hashes` from `start` on the host tier holds, contiguously."""
        n = 0
        while start + n < len(hashes) and hashes[start + n] in self.tier:
            n += 1
        return n

    def restore(self, hashes: list[int]) -> None:
        """Host tier -> the starting request's blocks (allocate reserved them): cached again, not computed, and
        held by it like its pool hit."""
        for h in hashes:
            self.tier.pop(h, None)
        self.hold(hashes)
        self.sim.router.restored(self.worker_id, hashes)

    def receive(self, hashes: list[int]) -> None:
        """Blocks a peer pull copied here: cached in the pool (a stored event: the router can route to them),
        the chain's head the most recent, as `release` leaves a prompt's blocks."""
        new = [h for h in hashes if h not in self.cache and h not in self.held]
        for h in reversed(hashes):
            if h in self.cache:
                self.cache.move_to_end(h)
            elif h not in self.held:
                self.cache[h] = None
        self._drop_from_tier(new)
        if new:
            self.sim.router.stored(self.worker_id, new)
        self._fit_cache()

    def _drop_from_tier(self, hashes: list[int]) -> None:
        """Blocks now in the pool again by other means (computed, pulled) leave the host tier."""
        if not self.tier:
            return
        gone = [h for h in hashes if self.tier.pop(h, 0) is None]
        if gone:
            self.sim.router.tier_dropped(self.worker_id, gone)

    def allocate(self, blocks: int, pin: Sequence[int] = ()) -> bool:
        """Reserve `blocks` for a request; False when they are not free. `pin`: the blocks among them it finds
        here (its prefix hit), held from now on, as a real pool gives a hit block a reference rather than a new
        block: making room for the rest never evicts them (until 2026-12-06 it could — a long prompt on a full
        pool evicted its own least recent prefix and then found it gone)."""
        if self.used + blocks > self.capacity:
            return False
        self.used += blocks
        self.hold(pin)
        self._fit_cache()
        return True

    def hold(self, hashes: Sequence[int]) -> None:
        """A request's reference to each block: out of the free LRU until the last holder releases it."""
        held, cache = self.held, self.cache
        for h in hashes:
            held[h] = held.get(h, 0) + 1
            cache.pop(h, None)

    def release(self, blocks: int, hashes: list[int]) -> None:
        """A request lets go of its blocks: each one nobody else holds is free and cached (most recent), last block
        first, so that its prefix's head is the most recent and its tail is evicted first — as the engine's
        KvCache.release (and vLLM's) frees them. A chain evicted head first would leave its tail in the pool,
        unreachable (a lookup stops at the first missing block), until 2026-12-06."""
        self.used -= blocks
        held, cache = self.held, self.cache
        for h in reversed(hashes):
            n = held.get(h, 0) - 1
            if n > 0:
                held[h] = n
                continue
            held.pop(h, None)
            cache[h] = None
            cache.move_to_end(h)
        self._fit_cache()

    def computed(self, hashes: list[int], held_already: int = 0) -> None:
        """A prefill finished (or KV arrived): the request holds its blocks, the first `held_already` of which it
        held from its start (`allocate`'s pin); the new ones are announced to the router's index (a worker's
        KV-stored event)."""
        held, cache = self.held, self.cache
        rest = hashes[held_already:]
        new = [h for h in rest if h not in held and h not in cache]
        self.hold(rest)
        self._drop_from_tier(new)
        if new:
            self.sim.router.stored(self.worker_id, new)

    def step_estimate_s(self) -> float:
        """The decode step time now (what this worker's load report would say)."""
        ctx = sum(r.input_tokens + r.emitted for r in self.running)
        return self.sim.profile.decode_step_s(max(1, len(self.running)), ctx)


class Simulator:
    def __init__(self, profile: Profile, cfg: ClusterConfig) -> None:
        self.profile, self.cfg = profile, cfg
        self.router = SimRouter(profile, cfg.policy, cfg.mode, cfg.rate_error, cfg.peer_pull)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.workers: dict[str, Worker] = {}
        per_node, per_rack = profile.workers_per_node, profile.workers_per_node * profile.nodes_per_rack
        k = 0
        for role, n in (
            ("prefill", cfg.prefill_workers if cfg.mode != "agg" else 0),
            ("decode", cfg.decode_workers),
        ):
            for i in range(n):
                wid = f"{role}-{i}"
                node, rack = cfg.placement.get(wid, (f"node{k // per_node}", f"rack{k // per_rack}"))
                self.workers[wid] = Worker(self, wid, role, node, rack)
                self.router.add_worker(self.workers[wid])
                k += 1
        self.frontend_queue: deque[Req] = deque()
        self.inflight = 0
        self.reqs: list[Req] = []
        self.route_reasons: Counter[str] = Counter()
        # peer pulls planned, blocks they landed, blocks their source had lost (recomputed); host-tier restores
        self.kv_moves: Counter[str] = Counter()

    def warm(self, worker_id: str, hashes: list[int]) -> None:
        """Put blocks in a worker's prefix cache before the run (a scenario's starting state)."""
        w = self.workers[worker_id]
        w.computed(hashes)
        w.release(0, hashes)

    # ---- event loop ------------------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn))

    def link_class(self, a: Worker, b: Worker) -> str:
        if a.worker_id == b.worker_id:
            return LOCAL
        if a.node == b.node:
            return SAME_NODE
        return SAME_RACK if a.rack == b.rack else SAME_ZONE  # one simulated zone

    def run(self, specs: Sequence[RequestSpec], hashes: Sequence[list[int]]) -> list[RequestResult]:
        for spec, hs in zip(specs, hashes, strict=True):
            r = Req(spec, hs, spec.arrival_s, input_tokens=spec.input_tokens)
            self.reqs.append(r)
            self.at(spec.arrival_s, functools.partial(self._arrive, r))
        for t, wid in self.cfg.failures:
            self.at(t, functools.partial(self._fail_worker, wid))
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()
        return [self._result(r) for r in self.reqs]

    # ---- frontend and routing -------------------------------------------------------------------------------
    def _arrive(self, r: Req) -> None:
        self.frontend_queue.append(r)
        self._admit()

    def _admit(self) -> None:
        while self.frontend_queue and self.inflight < self.cfg.max_inflight:
            r = self.frontend_queue.popleft()
            self.inflight += 1
            r.t_admit = self.now
            self._route(r)

    def _alive(self, role: str, exclude: set[str]) -> list[Worker]:
        return [
            w
            for w in self.workers.values()
            if w.role == role and not w.dead and not w.draining and w.worker_id not in exclude
        ]

    # ---- scaling: workers joining and draining mid-run (the planner's experiments) ----------------------------
    def add_worker(self, role: str) -> Worker:
        """A new, empty worker of `role`, routable from now on. It takes a free accelerator: the first node with
        fewer than `workers_per_node` workers still holding one (a drained worker frees its slot once idle),
        as a scheduler bin-packing GPU pods would place it; not a node past every worker ever started."""
        n = sum(1 for w in self.workers.values() if w.role == role)
        wid = f"{role}-{n}"
        held = Counter(
            w.node for w in self.workers.values() if not w.dead and not (w.draining and self.idle(w))
        )
        k = next(i for i in itertools.count() if held[f"node{i}"] < self.profile.workers_per_node)
        node, rack = self.cfg.placement.get(wid, (f"node{k}", f"rack{k // self.profile.nodes_per_rack}"))
        w = self.workers[wid] = Worker(self, wid, role, node, rack)
        self.router.add_worker(w)
        return w

    def drain_worker(self, worker_id: str) -> None:
        """Like SIGTERM on a real worker: out of routing at once, its queued and running requests finish."""
        self.workers[worker_id].draining = True
        self.router.worker_draining(worker_id)

    def idle(self, w: Worker) -> bool:
        """Nothing queued, running or being sent: a draining worker may stop."""
        return not (w.prefill_queue or w.admit_queue or w.running or w.busy) and w.nic_free_s <= self.now

    def _route(self, r: Req, exclude: frozenset[str] = frozenset(), local_only: bool = False) -> None:
        if not self._alive("decode", set(exclude)):
            return self._finish(r, failed="no live decode worker")
        d = self.router.route(r.spec.request_id, r.hashes, r.input_tokens, exclude, local_only)
        self.route_reasons[d.reason] += 1
        r.decode_worker, r.prefill_worker = d.decode, d.prefill
        r.estimated_ttft_s = r.estimated_ttft_s if r.estimated_ttft_s is not None else d.estimated_ttft_s
        target = self.workers[d.prefill or d.decode]
        pull = d.chosen.pull
        if pull is not None:
            self._pull(self.workers[pull.source], target, r, pull.start_block, pull.blocks)
        self._enqueue_prefill(target, r)

    # ---- peer pulls ------------------------------------------------------------------------------------------
    @staticmethod
    def _awaits_pull(w: Worker, r: Req) -> bool:
        at = w.match(r.hashes)
        return at < len(r.hashes) and w.incoming[r.hashes[at]] > 0

    def _pull(self, src: Worker, dst: Worker, r: Req, start: int, blocks: int) -> None:
        """Copy r's blocks [start, start + blocks) from src's pool to dst over their link (both NICs busy);
        r's prefill waits for it. What src no longer holds when the copy is read is recomputed instead."""
        p = self.profile
        hashes = r.hashes[start : start + blocks]
        begin = max(self.now, src.nic_free_s, dst.nic_free_s)
        end = begin + p.transfer_s(blocks * p.block_size * p.kv_bytes_per_token, self.link_class(src, dst))
        src.nic_free_s = dst.nic_free_s = end
        r.pull_until, r.pull_end_block = end, start + blocks
        dst.incoming.update(hashes)
        self.kv_moves["pulls"] += 1

        def landed() -> None:
            dst.incoming.subtract(hashes)
            if r.pull_until != end:
                return  # migrated meanwhile (a newer plan owns it)
            r.pull_until = None
            if dst.dead or r.prefill_worker != dst.worker_id and r.decode_worker != dst.worker_id:
                return
            have = 0 if src.dead else src.match(hashes)
            if have:
                dst.receive(hashes[:have])
            r.pulled_blocks += have
            self.kv_moves["pulled_blocks"] += have
            self.kv_moves["pull_lost_blocks"] += len(hashes) - have
            self._kick(dst)

        self.at(end, landed)

    # ---- prefill ---------------------------------------------------------------------------------------------
    def _enqueue_prefill(self, w: Worker, r: Req) -> None:
        if math.ceil((r.input_tokens + r.spec.output_tokens) / self.profile.block_size) > w.capacity:
            return self._finish(r, failed=f"{r.input_tokens} prompt tokens exceed a worker's KV capacity")
        have = w.match(r.hashes)
        if r.pull_until is not None:  # the planned pull will have brought the blocks up to its end
            have = max(have, r.pull_end_block)
        est_cached = min(have * self.profile.block_size, r.input_tokens - 1)
        r.remaining_prefill = r.input_tokens - est_cached  # re-estimated when it starts
        w.queued_tokens += r.remaining_prefill
        w.pending.update(r.hashes)
        w.prefill_queue.append(r)
        self._kick(w)

    def _start_prefill(self, w: Worker, r: Req) -> bool:
        """Look up the cache, reserve blocks; False when the blocks are not there yet."""
        bs = self.profile.block_size
        need = math.ceil(r.input_tokens / bs)
        if w.role == "decode":
            need = math.ceil((r.input_tokens + r.spec.output_tokens) / bs)
        hit = w.match(r.hashes)
        if not w.allocate(need, pin=r.hashes[:hit]):
            return False
        r.blocks_held = need
        if w.tier and (k := w.tier_run(r.hashes, hit)):  # the next blocks are in its host tier: restore them
            w.restore(r.hashes[hit : hit + k])
            r.restore_s += self.profile.restore_s(k)
            r.restored_blocks += k
            self.kv_moves["restored_blocks"] += k
            hit += k
        r.held_from_start = hit  # the pool's hit and what the tier restored: held since the start
        cached = min(hit * bs, r.input_tokens - 1)
        w.queued_tokens -= r.remaining_prefill
        r.cached_tokens = cached
        if r.first_cached is None:
            r.first_cached = cached
        r.remaining_prefill = r.input_tokens - cached
        w.queued_tokens += r.remaining_prefill
        if r.t_prefill_start is None:
            r.t_prefill_start = self.now
        return True

    def _kick(self, w: Worker) -> None:
        if w.busy or w.dead:
            return
        p = self.profile
        budget = p.max_prefill_chunk_tokens
        chunks: list[tuple[Req, int]] = []
        step_s = 0.0
        for r in list(w.prefill_queue):
            if budget <= 0:
                break
            if r.pull_until is not None:
                continue  # its peer pull has not landed yet (a real worker enqueues it once pulled)
            if w.incoming and r.t_prefill_start is None and self._awaits_pull(w, r):
                continue  # its next blocks are being pulled here for another request: reuse them once landed
            if r.t_prefill_start is None or r.blocks_held == 0:
                if not self._start_prefill(w, r):
                    break  # FIFO: later requests wait for blocks too
            n = min(budget, r.remaining_prefill)
            done = r.input_tokens - r.remaining_prefill
            step_s += n / p.prefill_tokens_per_s + n * (done + n / 2) * p.attn_s_per_token_pair
            step_s += r.restore_s  # its restore from the host tier, before its first chunk
            r.restore_s = 0.0
            chunks.append((r, n))
            budget -= n
        if chunks:
            step_s += p.prefill_overhead_s
        batch: list[Req] = []
        if w.role == "decode":
            if w.admit_queue:
                self._admit_decode(w)
            batch = w.running[: p.max_batch]
        if batch:
            # a step per token of every request is most of a replay's events: a list, not a generator of
            # `emitted` properties (the same integer sum)
            step_s += p.decode_step_s(len(batch), sum([r.input_tokens + len(r.token_times) for r in batch]))
        elif not chunks:
            return
        w.busy = True
        self.at(self.now + step_s, functools.partial(self._step_done, w, chunks, batch))

    def _step_done(self, w: Worker, chunks: list[tuple[Req, int]], batch: list[Req]) -> None:
        w.busy = False
        if w.dead:
            return
        for r, n in chunks:
            r.remaining_prefill -= n
            w.queued_tokens -= n
            if r.remaining_prefill == 0:
                w.prefill_queue.remove(r)
                w.pending.subtract(r.hashes)
                self._prefill_finished(w, r)
        now, wid = self.now, w.worker_id
        for r in batch:
            if r.decode_worker != wid or r.t_done is not None:
                continue  # migrated away during the step
            times = r.token_times
            times.append(now)
            if len(times) >= r.spec.output_tokens:
                w.running.remove(r)
                w.release(r.blocks_held, r.hashes)
                self._finish(r)
        self._kick(w)

    def _prefill_finished(self, w: Worker, r: Req) -> None:
        w.computed(r.hashes, r.held_from_start)
        if not r.token_times:
            r.token_times.append(self.now)  # the prefill emits the first token
            r.t_first = self.now
        if r.emitted >= r.spec.output_tokens:
            w.release(r.blocks_held, r.hashes)
            return self._finish(r)
        if w.role == "decode":  # aggregated: it decodes here, its blocks already reserved
            r.t_transfer_end = r.t_decode_start = self.now
            w.running.append(r)
            return
        # disaggregated: ship the KV over this worker's NIC, then the decode worker admits it
        d = self.workers[r.decode_worker]
        nbytes = r.input_tokens * self.profile.kv_bytes_per_token
        start = max(self.now, w.nic_free_s, d.nic_free_s)  # one NIC each side: sends and receives queue
        end = start + self.profile.transfer_s(nbytes, self.link_class(w, d))
        w.nic_free_s = d.nic_free_s = end
        held = r.blocks_held

        def arrived() -> None:
            if not w.dead:
                w.release(held, r.hashes)
            if r.t_done is not None or r.decode_worker != d.worker_id:
                return
            if d.dead:
                return self._migrate(r, d)
            r.t_transfer_end = self.now
            r.blocks_held = 0
            d.admit_queue.append(r)
            self._kick(d)

        self.at(end, arrived)

    def _admit_decode(self, d: Worker) -> None:
        bs = self.profile.block_size
        while d.admit_queue and len(d.running) < self.profile.max_batch:
            r = d.admit_queue[0]
            need = math.ceil((r.input_tokens + r.spec.output_tokens) / bs)
            if not d.allocate(need):
                break
            d.admit_queue.popleft()
            d.computed(r.hashes)  # the pulled KV blocks are in its cache now
            r.blocks_held = need
            r.t_decode_start = self.now
            d.running.append(r)

    # ---- failures and migration ----------------------------------------------------------------------------
    def _fail_worker(self, wid: str) -> None:
        w = self.workers[wid]
        w.dead = True
        self.router.worker_died(wid)
        # requests still prefilling elsewhere or in transfer towards it migrate when their KV arrives
        victims = list(w.prefill_queue) + list(w.admit_queue) + list(w.running)
        w.prefill_queue.clear()
        w.admit_queue.clear()
        w.running.clear()
        for r in sorted(victims, key=lambda r: r.spec.request_id):
            self._migrate(r, w)

    def _migrate(self, r: Req, dead: Worker) -> None:
        if r.t_done is not None:
            return
        r.migrations += 1
        if r.migrations > self.cfg.migration_limit:
            return self._finish(r, failed=f"migration limit {self.cfg.migration_limit} reached")
        # rebuild: prefill prompt + emitted tokens again, on the new decode worker itself
        r.input_tokens = r.spec.input_tokens + r.emitted
        r.blocks_held = 0
        r.t_decode_start = None
        self._route(r, exclude=frozenset({dead.worker_id}), local_only=r.emitted > 0)

    # ---- results -------------------------------------------------------------------------------------------
    def _finish(self, r: Req, failed: str | None = None) -> None:
        r.t_done = self.now
        r.failed = failed
        self.inflight -= 1
        self._admit()

    def _result(self, r: Req) -> RequestResult:
        t = r.token_times
        ok = r.failed is None and r.t_done is not None and bool(t)
        phases = None
        if ok and r.t_prefill_start is not None and r.t_first is not None:
            end_transfer = r.t_transfer_end if r.t_transfer_end is not None else r.t_first
            phases = {
                "queue": r.t_prefill_start - r.arrival_s,
                "prefill": r.t_first - r.t_prefill_start,
                "transfer": max(0.0, end_transfer - r.t_first),
                "decode": max(0.0, t[-1] - end_transfer),
            }
        return RequestResult(
            request_id=r.spec.request_id,
            input_tokens=r.spec.input_tokens,
            output_tokens=len(t),
            requested_output_tokens=r.spec.output_tokens,
            start_s=r.arrival_s,
            ok=ok,
            status=200 if ok else 503,
            error=r.failed,
            ttft_s=t[0] - r.arrival_s if t else None,
            itl_s=[b - a for a, b in zip(t, t[1:], strict=False)],
            e2e_s=(t[-1] if t else (r.t_done or r.arrival_s)) - r.arrival_s,
            phases_s=phases,
            cached_tokens=r.first_cached,
        )


def block_hashes_for(specs: Sequence[RequestSpec], block_size: int) -> list[list[int]]:
    """Each request's chained block hashes by the engine's own function (trace requests via their hash ids, through
    the process's shared hasher: its memo outlives the call)."""
    from loadgen.trace import TraceBlockHasher
    from services.engine.block_hash import block_hashes

    tracer = TraceBlockHasher.shared(block_size)
    out = []
    for s in specs:
        if s.token_ids is not None:
            out.append(block_hashes(s.token_ids, block_size))
        elif "hash_ids" in s.tags:
            out.append(tracer.hashes(s))
        else:
            raise ValueError(f"request {s.request_id}: the simulator needs token ids or trace hash ids")
    return out


def simulate(
    specs: Sequence[RequestSpec],
    profile: Profile,
    cfg: ClusterConfig,
    hashes: Sequence[list[int]] | None = None,
) -> tuple[list[RequestResult], Simulator]:
    sim = Simulator(profile, cfg)
    results = sim.run(specs, hashes if hashes is not None else block_hashes_for(specs, profile.block_size))
    return results, sim

"""The simulator's router: the live router's own policy objects (services.router.policy) over the simulated
workers' state — not copies.

`SimRouter` plays the part of services.router.state.RouterState with an exact, instant view: before each
decision every worker's WorkerState is refreshed from the simulation (as if a load report had just arrived),
and the PrefixIndex is fed the workers' cache insertions and evictions as they happen (the KV block events).
Blocks of requests queued on a worker count as (soon) cached there through the view's `pending_overlaps`, as
the router's reservations do; `ttft_no_pending` turns that off (scenario burst_same_prefix, docs/routing.md).

The cost model's settings come from the profile, so the TTFT policy estimates with the simulated hardware's
rates (a host-tier restore's share of a recompute from the profile's host link, a peer pull over its links);
`rate_error` skews the prefill rate the policy believes (1.3 = it thinks workers are 30% faster). Only the TTFT
policy plans peer pulls (`peer_pull`, the router's --peer-pull); tiers are the workers' (loadgen/sim/engine.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.router.cost_model import SAME_NODE, SAME_RACK, SAME_ZONE, CostSettings
from services.router.policy import (
    POLICIES,
    ClusterView,
    Decision,
    Policy,
    RouteQuery,
    WorkerState,
    make_policy,
)
from services.router.prefix_index import HOST, PrefixIndex

if TYPE_CHECKING:
    from loadgen.sim.engine import Worker
    from loadgen.sim.profile import Profile

POLICY_NAMES = (*POLICIES, "ttft_no_pending")
ZONE = "zone0"  # one zone: across racks is the profile's same_zone link


def cost_settings(profile: Profile, rate_error: float = 1.0) -> CostSettings:
    links = profile.links
    return CostSettings(
        prefill_tokens_per_s=profile.prefill_tokens_per_s * rate_error,
        prefill_overhead_s=profile.prefill_overhead_s,
        remote_overhead_s=0.0,  # the simulated transfer has only the link's latency and bandwidth
        decode_prefill_slowdown=1.0,  # a simulated decode worker prefills at the profile's rate
        default_step_s=profile.decode_base_s,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        same_node_bytes_per_s=links[SAME_NODE].gbps * 1e9,
        same_node_latency_s=links[SAME_NODE].latency_s,
        same_rack_bytes_per_s=links[SAME_RACK].gbps * 1e9,
        same_rack_latency_s=links[SAME_RACK].latency_s,
        same_zone_bytes_per_s=links[SAME_ZONE].gbps * 1e9,
        same_zone_latency_s=links[SAME_ZONE].latency_s,
        cross_zone_bytes_per_s=links[SAME_ZONE].gbps * 1e9,
        cross_zone_latency_s=links[SAME_ZONE].latency_s,
        # a host-tier restore as a share of computing the same tokens, from the profile's host link
        tier2_restore_fraction=(
            profile.prefill_tokens_per_s * profile.kv_bytes_per_token / (profile.host_link.gbps * 1e9)
            if profile.host_link is not None
            else CostSettings().tier2_restore_fraction
        ),
        peer_pull_overhead_s=0.0,  # a simulated pull has only the link's latency and bandwidth, like a transfer
    )


class SimRouter:
    def __init__(
        self, profile: Profile, policy: str, mode: str, rate_error: float = 1.0, peer_pull: bool = True
    ) -> None:
        if policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICY_NAMES)}")
        self.profile = profile
        self.count_pending = policy != "ttft_no_pending"
        self.rate_error = rate_error
        self.settings = cost_settings(profile, rate_error)
        name = "ttft" if policy == "ttft_no_pending" else policy
        self.policy: Policy = make_policy(name, mode=mode, settings=self.settings)
        if name == "ttft":  # only the TTFT policy plans pulls
            self.policy = make_policy(name, mode=mode, settings=self.settings, peer_pull=peer_pull)
        self.index = PrefixIndex()
        self.states: dict[str, WorkerState] = {}
        self._workers: dict[str, Worker] = {}

    # ---- the workers' events ---------------------------------------------------------------------------------
    def add_worker(self, w: Worker) -> None:
        self._workers[w.worker_id] = w
        self.states[w.worker_id] = WorkerState(
            w.worker_id,
            w.role,
            block_size=self.profile.block_size,
            capacity_blocks=w.capacity,
            node=w.node,
            rack=w.rack,
            zone=ZONE,
            kv_bytes_per_token=self.profile.kv_bytes_per_token,
            prefill_tokens_per_s=self.profile.prefill_tokens_per_s * self.rate_error,
        )

    def stored(self, worker_id: str, hashes: list[int]) -> None:
        self.index.stored(worker_id, hashes)

    def evicted(self, worker_id: str, hashes: list[int]) -> None:
        self.index.evicted(worker_id, hashes)

    def offloaded(self, worker_id: str, hashes: list[int]) -> None:
        self.index.offloaded(worker_id, hashes, HOST)

    def restored(self, worker_id: str, hashes: list[int]) -> None:
        self.index.restored(worker_id, hashes, HOST)

    def tier_dropped(self, worker_id: str, hashes: list[int]) -> None:
        self.index.tier2_dropped(worker_id, hashes, HOST)

    def worker_draining(self, worker_id: str) -> None:
        """No new work for it (its cached blocks are of no use to a request that cannot go there)."""
        self.index.remove_worker(worker_id)
        self.states[worker_id].healthy = False

    def worker_died(self, worker_id: str) -> None:
        self.index.remove_worker(worker_id)
        self.states[worker_id].healthy = False

    # ---- a decision ------------------------------------------------------------------------------------------
    def _refresh(self) -> None:
        for wid, w in self._workers.items():
            s = self.states[wid]
            s.waiting = len(w.prefill_queue) + len(w.admit_queue)
            s.running = len(w.running)
            s.queued_prefill_tokens = w.queued_tokens
            s.active_decode_blocks = w.used if w.role == "decode" else 0
            s.free_blocks = w.capacity - w.used
            s.step_s = w.step_estimate_s()

    def _pending(self, query: RouteQuery) -> dict[str, int]:
        found = {}
        for wid, w in self._workers.items():
            if not w.dead and w.pending and (n := w.pending_match(query.hashes(self.profile.block_size))):
                found[wid] = n
        return found

    def route(
        self, request_id: str, hashes: list[int], num_tokens: int, exclude: frozenset[str], local_only: bool
    ) -> Decision:
        self._refresh()
        pending: Callable[[RouteQuery], dict[str, int]] | None = self._pending if self.count_pending else None
        view = ClusterView(self.states, self.index, pending_overlaps=pending)
        query = RouteQuery(
            request_id,
            num_tokens=num_tokens,
            block_hashes={self.profile.block_size: hashes},
            exclude=exclude,
            need_prefill=not local_only,
        )
        return self.policy.route(view, query)

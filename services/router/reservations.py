"""Pending reservations: a routed request counts against its workers at once, before their next load report.

Without them a burst herds: every request of the burst sees the same last report and picks the same worker.
`reserve` adds the request's uncached prompt tokens to its prefilling worker, one request and its KV blocks to
its decode worker, and remembers its block hashes as soon-to-be-cached on the prefilling worker (docs/routing.md:
queued requests' blocks count as cached where they are queued). A reservation clears when it expires, or when
the worker sends a load report taken after the request had time to arrive there (the report then counts it) —
a report that differs from its last one: a repeat is a heartbeat from inside an engine step (RouterState.on_load).

This room is plain data with the caller's clock: no I/O.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from services.router.policy import Decision, RouteQuery, WorkerState

DEFAULT_TTL_S = 5.0  # a reservation never outlives this, even if its worker stops reporting
DEFAULT_ARRIVAL_GRACE_S = 0.05  # a load report this soon after a reservation may not count it yet


@dataclass
class _Reservation:
    at: float
    worker_id: str
    requests: int
    prefill_tokens: int
    decode_blocks: int
    hashes: tuple[int, ...]


class Reservations:
    def __init__(
        self, ttl_s: float = DEFAULT_TTL_S, arrival_grace_s: float = DEFAULT_ARRIVAL_GRACE_S
    ) -> None:
        self.ttl_s = ttl_s
        self.arrival_grace_s = arrival_grace_s
        self._by_worker: dict[str, deque[_Reservation]] = {}
        self._hashes: dict[str, Counter[int]] = {}
        self._oldest = float("inf")  # no reservation is older than this (a lower bound)

    def reserve(
        self, decision: Decision, query: RouteQuery, workers: dict[str, WorkerState], now: float
    ) -> None:
        chosen = decision.chosen
        prefilling = workers.get(chosen.prefilling_worker)
        decode = workers.get(chosen.decode)
        if prefilling is not None and query.need_prefill:
            hashes = tuple(query.hashes(prefilling.block_size)) if query.num_tokens else ()
            self._add(
                prefilling, _Reservation(now, prefilling.worker_id, 1, int(chosen.terms.get("uncached_tokens", 0)),
                                         0, hashes)
            )  # fmt: skip
        if decode is not None:
            blocks = -(-max(query.num_tokens, 1) // decode.block_size)
            same = prefilling is decode and query.need_prefill
            self._add(decode, _Reservation(now, decode.worker_id, 0 if same else 1, 0, blocks, ()))

    def on_load(self, worker: WorkerState, now: float) -> None:
        """A load report from `worker` arrived at `now`: reservations it already reflects are dropped."""
        self._drop_older_than(worker, now - self.arrival_grace_s)

    def expire(self, workers: dict[str, WorkerState], now: float) -> None:
        if now - self.ttl_s < self._oldest:
            return  # nothing old enough (the common case: skip the walk over every worker)
        for worker_id in list(self._by_worker):
            w = workers.get(worker_id)
            if w is None:
                self.forget(worker_id)
            else:
                self._drop_older_than(w, now - self.ttl_s)
        self._oldest = min((q[0].at for q in self._by_worker.values() if q), default=float("inf"))

    def forget(self, worker_id: str) -> None:
        self._by_worker.pop(worker_id, None)
        self._hashes.pop(worker_id, None)

    def pending_overlaps(self, workers: dict[str, WorkerState]) -> Callable[[RouteQuery], dict[str, int]]:
        """A ClusterView.pending_overlaps function over these reservations."""

        def overlaps(query: RouteQuery) -> dict[str, int]:
            found: dict[str, int] = {}
            for worker_id, counts in self._hashes.items():
                w = workers.get(worker_id)
                if w is None or not counts:
                    continue
                n = 0
                for h in query.hashes(w.block_size):
                    if h not in counts:
                        break
                    n += 1
                if n:
                    found[worker_id] = n
            return found

        return overlaps

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_worker.values())

    def _add(self, w: WorkerState, r: _Reservation) -> None:
        self._by_worker.setdefault(w.worker_id, deque()).append(r)
        self._oldest = min(self._oldest, r.at)
        w.pending_requests += r.requests
        w.pending_prefill_tokens += r.prefill_tokens
        w.pending_decode_blocks += r.decode_blocks
        if r.hashes:
            self._hashes.setdefault(w.worker_id, Counter()).update(r.hashes)

    def _drop_older_than(self, w: WorkerState, cutoff: float) -> None:
        queue = self._by_worker.get(w.worker_id)
        while queue and queue[0].at <= cutoff:
            r = queue.popleft()
            w.pending_requests -= r.requests
            w.pending_prefill_tokens -= r.prefill_tokens
            w.pending_decode_blocks -= r.decode_blocks
            if r.hashes:
                counts = self._hashes[w.worker_id]
                counts.subtract(r.hashes)
                for h in r.hashes:
                    if counts.get(h, 0) <= 0:
                        counts.pop(h, None)

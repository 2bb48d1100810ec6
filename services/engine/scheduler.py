"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step has a token budget. Running sequences go first (a decode needs one token; a sequence still in its
prompt gets a chunk), then waiting ones are admitted in arrival order while the budget, the sequence limit and
the free KV blocks allow (prompts longer than the budget are prefilled in chunks across steps). A request that
brings its KV (imported from a prefill worker) gets its blocks at admission too: while the pool is full it waits
in the queue, in order, and never fails for it. When a running
sequence needs a block and none is free, the most recently admitted sequence is preempted: its blocks are
released and it is recomputed later from its tokens (prefix caching usually makes that cheap). With a second KV
tier, the blocks of a prefix that follow the primary pool's hit and sit in tier 2 are restored at admission:
they take freshly allocated blocks, count as cached tokens, and a disk tier continues the same run after tier 2
(pool -> host -> disk). When the step has other work (`async_restore`), the request waits in `restoring` while the
runner writes those blocks beside the step; `complete_restore` then caches them under their hashes and makes it
running. With nothing else to run, the runner writes them before the step. A request admitted with imported KV
does the same (`importing`): the running sequences do not wait for a long prompt's KV to be written.

The scheduler's decision is a `SchedulerOutput`: plain data the runner executes and a log or test can read.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from services.engine.block_hash import ROOT_HASH, block_hashes
from services.engine.kv_cache import BlockManager, KvTierName
from services.engine.kv_tier import TierEntry
from services.engine.sampling import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RESTORING = "restoring"  # admitted; its tier blocks are being written beside the step
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    arrival_s: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks committed so far
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: str | int | None = None  # the stop string or token that ended it
    hold_kv: bool = False  # keep blocks after finishing until released (prefill workers, for transfer)
    num_preemptions: int = 0
    first_token_s: float | None = None
    # KV that arrives with the request (imported from a prefill worker): the tokens it covers and the blocks it
    # needs. They are allocated at admission, not at arrival, so a full pool means waiting in the queue.
    import_tokens: int = 0
    import_blocks: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    start: int  # tokens before this chunk that are already in the cache
    num_tokens: int  # tokens computed in this step
    samples: bool  # this chunk reaches the end of the sequence, so a token is sampled after it


@dataclass(frozen=True)
class RestoreGroup:
    """One tier's run of a prompt's blocks coming back into the pool: fresh block ids, the entries taken from the
    tier, and the hashes and parents they are cached under once written."""

    block_ids: list[int]
    entries: list[TierEntry]
    hashes: list[int]
    parents: list[int]
    tier: KvTierName


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str]
    num_batched_tokens: int
    imported: list[str] = field(default_factory=list)  # admitted now with imported KV: write it first
    # blocks brought back from tier 2 or disk for a request in this step's chunks, one tier per item (host
    # first): already cached, so write them before the step
    restored: list[RestoreGroup] = field(default_factory=list)
    # requests now restoring, with their groups: write them beside the step, then complete_restore(request_id)
    restoring: list[tuple[str, list[RestoreGroup]]] = field(default_factory=list)
    # admitted now with imported KV while the step has other work: write it beside the step, then
    # complete_restore(request_id) (they wait in `restoring`, with no tier groups)
    importing: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        async_restore: bool = False,
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.async_restore = async_restore
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.restoring: dict[str, tuple[Request, list[RestoreGroup]]] = {}
        self._restoring_hashes: set[int] = set()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.restoring)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        bs = self.blocks.block_size

        imported: list[str] = []
        restored: list[RestoreGroup] = []
        restoring: list[tuple[str, list[RestoreGroup]]] = []
        importing: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            need = self.blocks.blocks_for(req.num_computed_tokens + n) - len(req.block_ids)
            while need > self.blocks.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            if need > 0:
                req.block_ids += self.blocks.allocate(need)
            start = req.num_computed_tokens
            chunks.append(ScheduledChunk(req.request_id, start, n, start + n == req.num_tokens))
            budget -= n
            i += 1

        while (
            self.waiting and budget > 0 and len(self.running) + len(self.restoring) < self.max_num_seqs
            and not preempted
        ):  # fmt: skip
            req = self.waiting[0]
            cached: list[int] = []
            hashes: list[int] = []
            n_restore = n_disk = 0
            if req.import_blocks:  # it brought its KV: blocks for it and this chunk, or keep waiting
                start = req.import_tokens
                n = min(req.num_tokens - start, budget)
                need = max(req.import_blocks, self.blocks.blocks_for(start + n))
                if need > self.blocks.free_after_acquiring([]):
                    break
                self.waiting.popleft()
                req.block_ids = self.blocks.allocate(need)
                req.num_computed_tokens = start
                req.import_tokens = req.import_blocks = 0
                if self.async_restore and chunks:  # the step has other work: its KV is written beside it
                    req.status = RequestStatus.RESTORING
                    self.restoring[req.request_id] = (req, [])
                    importing.append(req.request_id)
                    continue
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                imported.append(req.request_id)
                chunks.append(ScheduledChunk(req.request_id, start, n, start + n == req.num_tokens))
                budget -= n
                continue
            if not req.block_ids:  # fresh or preempted: look for its prefix in the cache
                # leave at least one token to compute, so the step yields logits to sample from
                hashes = block_hashes(req.all_ids[: req.num_tokens - 1], bs)
                cached = self.blocks.lookup_prefix(hashes)
                n_restore = self.blocks.lookup_tier2(hashes[len(cached) :])
                n_disk = self.blocks.lookup_disk(hashes[len(cached) + n_restore :])
                n_restore += n_disk
                if len(cached) < len(hashes) and hashes[len(cached)] in self._restoring_hashes:
                    break  # its next block is being restored for another request: wait for it, don't recompute it
            hit = len(cached) + n_restore
            start = max(req.num_computed_tokens, hit * bs)
            n = min(req.num_tokens - start, budget)
            need = self.blocks.blocks_for(start + n) - len(req.block_ids) - len(cached)
            if need > self.blocks.free_after_acquiring(cached):
                break
            self.waiting.popleft()
            if hashes:
                self.blocks.count_tier2_misses(len(hashes) - hit)
            n_host = n_restore - n_disk
            entries = self.blocks.take_tier2(hashes[len(cached) : len(cached) + n_host]) if n_host else []
            entries += self.blocks.take_disk(hashes[hit - n_disk : hit]) if n_disk else []
            if cached:
                self.blocks.acquire(cached)
                req.block_ids = list(cached)
            if hit:
                req.hashes = hashes[:hit]
                req.num_computed_tokens = start
                if not req.output_ids:
                    req.num_cached_tokens = start
            fresh = self.blocks.allocate(need)
            req.block_ids += fresh
            if n_restore:
                ids = fresh[:n_restore]
                parents = [hashes[k - 1] if k else ROOT_HASH for k in range(len(cached), hit)]
                run = hashes[len(cached) : hit]
                spans: tuple[tuple[KvTierName, int, int], ...] = (
                    ("host", 0, n_host),
                    ("disk", n_host, n_restore),
                )
                groups = [  # one per tier, host first: the runner times each tier's restore
                    RestoreGroup(ids[a:b], entries[a:b], run[a:b], parents[a:b], tier)
                    for tier, a, b in spans
                    if b > a
                ]
                if self.async_restore and chunks:  # the step has other work: restore beside it, run it after
                    req.status = RequestStatus.RESTORING
                    self.restoring[req.request_id] = (req, groups)
                    self._restoring_hashes.update(h for g in groups for h in g.hashes)
                    restoring.append((req.request_id, groups))
                    continue
                for g in groups:
                    self.blocks.commit_restored(g.block_ids, g.hashes, g.parents, g.tier)
                restored += groups
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req.request_id, start, n, start + n == req.num_tokens))
            budget -= n
        return SchedulerOutput(
            chunks, preempted, self.max_num_batched_tokens - budget, imported, restored, restoring, importing
        )

    def complete_restore(self, request_id: str) -> Request:
        """Its blocks are written: cache them under their hashes (others may hit them now) and run it."""
        req, groups = self.restoring.pop(request_id)
        for g in groups:
            self._restoring_hashes.difference_update(g.hashes)
            self.blocks.commit_restored(g.block_ids, g.hashes, g.parents, g.tier)
        if req.status is RequestStatus.RESTORING:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        return req

    def fail_restore(self, request_id: str) -> Request:
        """Its blocks' write failed: nothing of it is cached, and the tier copies it took are lost (reported
        dropped). The engine finishes the request next."""
        req, groups = self.restoring.pop(request_id)
        for g in groups:
            self._restoring_hashes.difference_update(g.hashes)
            self.blocks.report_lost(g.hashes, g.parents, g.tier)
        return req

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.release(req.block_ids)
        req.block_ids, req.hashes = [], []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def on_computed(self, req: Request, n: int) -> None:
        """After a step: advance the sequence and commit the blocks it filled to the prefix cache."""
        req.num_computed_tokens += n
        bs = self.blocks.block_size
        full = req.num_computed_tokens // bs
        ids = req.all_ids
        while len(req.hashes) < full:
            k = len(req.hashes)
            parent = req.hashes[-1] if req.hashes else ROOT_HASH
            h = block_hashes(ids[k * bs : (k + 1) * bs], bs, parent)[0]
            self.blocks.commit(req.block_ids[k], h, parent)
            req.hashes.append(h)

    def finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        # (the engine completes a restoring request's restore before it finishes it: its blocks are being written)
        if not req.hold_kv:
            self.release_kv(req)

    def release_kv(self, req: Request) -> None:
        if req.block_ids:
            self.blocks.release(req.block_ids)
            req.block_ids = []

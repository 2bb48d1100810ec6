"""Prefix pulls between workers: before prefilling a prompt, copy its cached prefix blocks from a peer's pool.

A `PrefixPull` (from the router's plan, carried by a PrefillRequest or a local-prefill DecodeRequest) names a
peer prefill worker and the chained hashes of the prompt's blocks [start_block, start_block + n). `PrefixPuller`
checks those hashes against the prompt's own (engine/block_hash.py owns the hash: a plan that names other blocks
is refused), pins what this pool already caches of the prompt, asks the peer to hold and publish the rest
(`PrefillWorker.ExportPrefix`), pulls the bytes with this worker's KvSink, writes them into fresh pool blocks
and commits them under their hashes (`LLMEngine.import_prefix`). From then on they are ordinary cached prefix
blocks, pinned until the request's prefill is admitted, so the normal admission takes them as a prefix hit.
The peer's hold is released in the background (its TTL frees it if that Release is lost).

Every failure — the peer dead or slow past the pull's deadline, nothing held there, bytes that do not fit, a
plan naming other blocks, no free blocks — logs one line, counts `rackserve_peer_pulls{outcome=fallback_<cause>}`
and leaves the pool as it was: the prompt is then simply recomputed. A short match is not a failure: the blocks
the peer had are exact, so the matched run is imported and the rest recomputed. Nothing partial is ever
committed: a block enters the cache only with all of its bytes written.

This room pulls and imports only; it never decides whether a pull is worth it (the router does).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from services.engine.block_hash import ROOT_HASH, block_hashes
from services.engine.engine import KvMismatchError
from services.engine.kv_cache import NoFreeBlocksError
from services.kvtransfer import (
    KvSink,
    TransferError,
    TransferIntegrityError,
    TransferTicket,
    TransferTimeout,
)
from services.rpc import pb, pb_grpc
from services.runtime import wire
from services.runtime.async_engine import AsyncEngine
from services.runtime.channels import ChannelPool
from services.runtime.tasks import BackgroundTasks
from services.telemetry import metrics

log = logging.getLogger("rackserve.prefix_pull")

DEFAULT_PULL_DEADLINE_S = 2.0  # a PrefixPull without deadline_s: ExportPrefix + transfer + import within this
HOLD_SUFFIX = ":prefix-pull"  # hold ids: the request id, this and a count, on the puller and on the peer


class PullFailed(Exception):
    """A pull that cannot go on; `cause` names the outcome (fallback_<cause>)."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


@dataclass
class PullResult:
    outcome: str  # pulled | local | fallback_<cause>
    first_block: int = 0  # the first block imported from the peer
    blocks: int = 0  # blocks imported from the peer (and committed here)
    seconds: float = 0.0
    source_worker_id: str = ""
    detail: str = ""
    hold_id: str | None = None  # the engine hold pinning the prompt's prefix here; release after admission

    def pulled_tokens(self, block_size: int, cached_tokens: int) -> int:
        """Prompt tokens served from the peer's blocks, given the admission's cached tokens (a prefix hit that
        stopped short of them counts only what it took)."""
        start = self.first_block * block_size
        return max(0, min(self.blocks * block_size, cached_tokens - start))


class PrefixPuller:
    """Runs the PrefixPull of a request before its prefill, on a prefill or decode worker."""

    def __init__(
        self,
        engine: AsyncEngine,
        sink: KvSink,
        channels: ChannelPool,
        role: str,
        preference: Sequence[str],
        default_deadline_s: float = DEFAULT_PULL_DEADLINE_S,
        release_timeout_s: float = 2.0,
        hold_ttl_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self.sink = sink
        self.channels = channels
        self.role = role
        self.preference = tuple(preference)
        self.default_deadline_s = default_deadline_s
        self.release_timeout_s = release_timeout_s
        self.hold_ttl_s = hold_ttl_s
        self._releases = BackgroundTasks()
        self._pulls = itertools.count(1)
        assert engine.engine is not None
        self.layout = engine.engine.kv_layout
        for outcome in metrics.PEER_PULL_OUTCOMES:  # a zero per outcome from the start: rate() reads 0
            metrics.PEER_PULLS.labels(role, outcome)

    async def pull(self, request_id: str, plan: pb.PrefixPull, token_ids: Sequence[int]) -> PullResult:
        """Run the pull for a prompt about to be prefilled (token_ids: everything the prefill computes). Never
        raises for the pull's own failures: the result says what happened and the prefill recomputes."""
        t0 = time.perf_counter()
        hold_id = f"{request_id}{HOLD_SUFFIX}-{next(self._pulls)}"  # unique here and on the peer
        result = PullResult("fallback_refused", source_worker_id=plan.source.worker_id)
        try:
            result = await self._pull(hold_id, plan, list(token_ids))
        except PullFailed as e:
            result.outcome, result.detail = f"fallback_{e.cause}", str(e)
        except Exception as e:  # noqa: BLE001 - any failure recomputes; the line names it
            result.outcome, result.detail = "fallback_refused", f"{type(e).__name__}: {e}"
        except BaseException:  # cancelled (the caller went away): unpin here without waiting, then go
            self._releases.spawn(self.engine.release(hold_id), name=f"unpin {hold_id}")
            raise
        if result.outcome.startswith("fallback_"):
            # unpin whatever this pool pinned for the pull (idempotent; after an import the deadline cut short,
            # which the engine still runs first: its blocks are whole, they stay cached like computed ones)
            await self.engine.release(hold_id)
            result.hold_id = None
        result.seconds = time.perf_counter() - t0
        result.source_worker_id = plan.source.worker_id
        metrics.PEER_PULLS.labels(self.role, result.outcome).inc()
        if result.outcome == "pulled":
            metrics.PEER_PULL_BLOCKS.labels(self.role).inc(result.blocks)
            metrics.PEER_PULL_S.labels(self.role).observe(result.seconds)
            log.info(
                "request %s: pulled prefix blocks [%d, %d) from %s in %.4fs",
                request_id, result.first_block, result.first_block + result.blocks,
                plan.source.worker_id, result.seconds,
            )  # fmt: skip
        elif result.outcome != "local":
            log.warning(
                "request %s: prefix pull from %s failed (%s: %s); recomputing",
                request_id, plan.source.worker_id, result.outcome, result.detail,
            )  # fmt: skip
        return result

    async def release(self, result: PullResult) -> None:
        """Unpin the prompt's prefix here (after the request's prefill was admitted, or on failure)."""
        if result.hold_id is not None:
            hold_id, result.hold_id = result.hold_id, None
            await self.engine.release(hold_id)

    async def _pull(self, hold_id: str, plan: pb.PrefixPull, tokens: list[int]) -> PullResult:
        bs = self.layout.block_size
        start, asked = plan.start_block, list(plan.block_hashes)
        own = block_hashes(tokens, bs)
        if start < 0 or own[start : start + len(asked)] != asked or not asked:
            raise PullFailed(
                "mismatch",
                f"the plan names {len(asked)} block hashes from block {start}; they are not this prompt's "
                f"({len(own)} full blocks)",
            )
        # the admission leaves the last token to compute: a block holding it is never a hit, so never pulled
        usable = min(start + len(asked), (len(tokens) - 1) // bs)
        if usable <= start:
            raise PullFailed(
                "empty", f"no block from {start} on is reusable for a {len(tokens)}-token prompt"
            )
        # pin what this pool has of the prompt already, so the pulled blocks land behind a prefix that stays
        local = len(await self.engine.call(lambda e: e.hold_cached_prefix(hold_id, own[:usable])))
        result = PullResult("local", hold_id=hold_id if local else None)
        if local >= usable:
            return result  # everything is here already (a stale plan, or a second request of the prompt)
        # Fewer than the plan's start_block: the router counted blocks as this worker's that its pool lacks (in
        # its host or disk tier, or still to be computed by a request queued here). Pulled blocks behind that gap
        # would never be hit (the admission restores a tier's run after the pool's, never the pool after a
        # tier's), so ask from the first block this pool lacks: the source's run covers them too (the router's
        # index counts a run from the prompt's first block). Until 2026-12-07 such a pull was refused
        # (fallback_prefix_gone) and every block it planned to copy was recomputed. The router priced and timed
        # the blocks from start_block on: a gap up to as many blocks at most doubles the copy (and its deadline
        # with it); a longer one is refused as before (restoring it from the tier and computing the planned
        # blocks costs less than copying them all, and a copy many times the planned one would miss its deadline).
        planned = usable - start
        gap = max(start - local, 0)
        if gap > planned:
            raise PullFailed(
                "prefix_gone",
                f"this pool holds {local} of the {start} blocks before the {planned} pulled ones: too long a gap",
            )
        deadline_s = plan.deadline_s if plan.deadline_s > 0 else self.default_deadline_s
        deadline_s *= (gap + planned) / planned
        want = own[local:usable]
        try:
            async with asyncio.timeout(deadline_s):
                exported = await self._export(plan.source, hold_id, want, deadline_s)
                if exported is None:
                    raise PullFailed("empty", f"{plan.source.worker_id} holds none of the blocks")
                try:
                    matched, data = await self._transfer(exported, deadline_s)
                finally:
                    self._release_source(plan.source, hold_id)
                parent = own[local - 1] if local else ROOT_HASH
                hashes = want[:matched]
                await self._import(hold_id, hashes, parent, data)
        except NoFreeBlocksError as e:
            raise PullFailed("no_space", str(e)) from e
        except KvMismatchError as e:
            raise PullFailed("layout", str(e)) from e
        except TimeoutError as e:
            raise PullFailed("deadline", f"not done within its {deadline_s:g}s deadline") from e
        result.hold_id = hold_id
        result.outcome, result.first_block, result.blocks = "pulled", local, matched
        return result

    async def _import(self, hold_id: str, hashes: list[int], parent: int, data: Any) -> int:
        """Write the pulled blocks into this pool beside the engine's steps (the restore thread), then commit
        them. One task begins, waits and finishes, and a deadline or cancellation here does not stop it: the
        write's own pin is always dropped, after the write (its blocks, whole, stay cached). Its error comes
        back as a value, raised here: an expected failure (no space, another layout) is the pull's outcome, not
        a background task's failure."""

        async def begin_wait_finish() -> int | Exception:
            try:
                job = await self.engine.call(lambda e: e.begin_import_prefix(hold_id, hashes, parent, data))
                with contextlib.suppress(Exception):  # finish raises the write's error, if any
                    await asyncio.wrap_future(job.written)
                return await self.engine.call(lambda e: e.finish_import_prefix(job))
            except Exception as e:  # noqa: BLE001 - handed to the pull, which names its outcome
                return e

        done = await asyncio.shield(self._releases.spawn(begin_wait_finish(), name=f"import {hold_id}"))
        if isinstance(done, Exception):
            raise done
        return done

    async def _export(
        self, source: pb.WorkerRef, hold_id: str, hashes: list[int], deadline_s: float
    ) -> pb.ExportPrefixResponse | None:
        stub = pb_grpc.PrefillWorkerStub(self.channels.get(source.endpoint, source.epoch))
        request = pb.ExportPrefixRequest(request_id=hold_id, block_hashes=hashes, ttl_s=self.hold_ttl_s)
        try:
            response: pb.ExportPrefixResponse = await stub.ExportPrefix(
                request, metadata=(("x-request-id", hold_id),), timeout=deadline_s
            )
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise PullFailed("deadline", f"ExportPrefix: {e.details()}") from e
            cause = "unavailable" if code == grpc.StatusCode.UNAVAILABLE else "refused"
            raise PullFailed(cause, f"ExportPrefix: {code.name}: {e.details()}") from e
        if response.matched_blocks <= 0 or not response.HasField("kv"):
            return None
        if response.matched_blocks > len(hashes):
            self._release_source(source, hold_id)
            raise PullFailed("refused", f"matched {response.matched_blocks} of {len(hashes)} asked blocks")
        return response

    async def _transfer(self, exported: pb.ExportPrefixResponse, deadline_s: float) -> tuple[int, object]:
        """The held blocks' bytes, checked: the handle against this engine's layout, the size against the
        matched blocks, the checksum by the sink."""
        handle, matched = exported.kv, exported.matched_blocks
        bs = self.layout.block_size
        try:
            wire.check_kv_handle(self.layout, handle, matched * bs)
        except KvMismatchError as e:
            raise PullFailed("layout", str(e)) from e
        if handle.num_tokens != matched * bs:
            raise PullFailed(
                "layout", f"handle covers {handle.num_tokens} tokens, {matched} blocks have more"
            )
        try:
            ticket = TransferTicket.from_json(handle.transfer_endpoint, handle.agent_metadata)
            if ticket.encoding != "raw":
                # lossy (--kv-compress on a peer that encodes its exports): committed under the exact blocks'
                # hashes, these bytes would change every later answer that hits them here
                raise PullFailed("layout", f"the peer's blocks come {ticket.encoding}-encoded, not exact")
            backend = self.sink.choose(ticket, self.preference)
            pulled = await self.sink.pull(ticket, deadline_s, backend=backend, device=self.engine.device)
        except TransferIntegrityError as e:
            raise PullFailed("data_loss", str(e)) from e
        except TransferTimeout as e:
            raise PullFailed("deadline", str(e)) from e
        except (TransferError, ValueError) as e:
            raise PullFailed("unavailable", f"{type(e).__name__}: {e}") from e
        return matched, pulled.data

    def _release_source(self, source: pb.WorkerRef, hold_id: str) -> None:
        """Tell the peer it may unpin the blocks (fire and forget with a deadline: its TTL covers a lost one)."""

        async def release() -> None:
            try:
                await pb_grpc.PrefillWorkerStub(self.channels.get(source.endpoint, source.epoch)).Release(
                    pb.ReleaseRequest(request_id=hold_id),
                    metadata=(("x-request-id", hold_id),),
                    timeout=self.release_timeout_s,
                )
            except grpc.aio.AioRpcError as e:
                log.info("Release of prefix hold %r on %s failed (%s); its TTL frees it",
                         hold_id, source.worker_id, e.code().name)  # fmt: skip

        self._releases.spawn(release(), name=f"release {hold_id}")

    async def close(self) -> None:
        await self._releases.wait()


__all__ = ["DEFAULT_PULL_DEADLINE_S", "PrefixPuller", "PullResult"]

"""Prefix pulls between workers: a prefill worker copies a prompt's cached prefix blocks from a peer's pool
instead of recomputing them, and answers exactly what a cold run answers — and when the pull cannot happen (the
plan names other blocks, the peer holds nothing, the peer is SIGKILLed as the pull begins) it recomputes and
still answers the same.

The engine half runs in-process on the real SmolLM2 model (export_prefix's matching and pinning, import_prefix
into another engine); the worker half runs real processes: etcd, prefill workers A and B (and B2, started with
`--debug-die-in transfer`), a decode worker that gives the cold references and decodes the continuation from
A's KV (it runs without a prefix cache, so each of its runs is a cold one), and a decode worker that prefills
locally and pulls as well. The frontend half runs the real app in front of them, with a router that answers a
plan carrying a PrefixPull (the real router's pricing of pulls is not part of this test).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from services.engine import engine as engine_module
from services.engine.block_hash import block_hashes
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_cache import NoFreeBlocksError
from services.engine.loader import LoadedModel
from services.engine.model_files import smollm2_gguf_path
from services.engine.sampling import SamplingParams
from services.engine.tokenizer import Tokenizer
from services.rpc import pb, pb_grpc
from services.runtime.async_engine import AsyncEngine
from services.runtime.prefix_pull import PrefixPuller
from tests.support.cluster import (
    WORKER_FLAGS,
    LocalCluster,
    Proc,
    decode,
    greedy,
    local_cluster,
    run,
    start_process,
    token_ids,
    wait_for_load,
)
from tests.support.markers import starts_processes

BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SHARED = (
    "The history of the lighthouse keepers of the northern coast is a story of patience. Every night for two "
    "hundred years a keeper climbed the stairs, trimmed the wick and watched the sea. Their logbooks record "
    "storms, wrecks, rescues and the slow arrival of electricity."
)
TEXTS = {
    "a": SHARED + " When the last keeper left, the light went on by itself. Summarize what the keepers did:",
    "a2": SHARED + " The museum in town keeps the logbooks now. Which storms do the logbooks describe?",
    "b": "A recipe for bread needs flour, water, salt and yeast. Mix them, knead the dough for ten minutes, let "
    "it rise until it doubles, shape it, let it rise again and bake it in a hot oven until the crust is brown and "
    "it sounds hollow when tapped. Bakers have argued for centuries about hydration and about the temperature of "
    "the water. Explain why the dough must rest twice before baking:",
    "c": "Rivers carve valleys over millions of years: water carries sand and stones that grind the rock, floods "
    "move boulders, and frost splits the walls in winter. Over time the river cuts deeper while the walls fall "
    "back, and the layers of rock that were laid down long ago are exposed one after another, each with its "
    "own colour. Describe how a canyon forms, step by step, from the first rain:",
    "d": "A chess opening is a sequence of moves at the start of the game. Players study openings to reach "
    "positions they understand, and each opening has a name, a history and famous games. Some openings give up "
    "a pawn for quick development, others build a solid wall of pawns and wait for the opponent to overreach. "
    "Name three openings and say what each one aims for:",
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> dict[str, list[int]]:
    out = {k: tok.encode(v) for k, v in TEXTS.items()}
    assert all(len(p) > 4 * BS for p in out.values()), {k: len(p) for k, p in out.items()}
    return out


# ---- the engine: export_prefix / import_prefix ----------------------------------------------------------------


def engine(smollm2: LoadedModel, blocks: int = 24) -> LLMEngine:
    cfg = EngineConfig(dtype="float32", block_size=BS, num_kv_blocks=blocks, max_num_batched_tokens=256)
    return LLMEngine(smollm2, cfg)


def run_counting_hits(e: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    """Run one prompt greedily on `e`: its tokens, and how many of its prompt tokens the prefix cache served."""
    e.add_request("r", prompt, GREEDY)
    out: list[int] = []
    cached = -1
    while "r" in e.requests:
        for o in e.step():
            out += o.new_token_ids
            cached = o.num_cached_tokens
    return out, cached


@pytest.mark.parametrize(
    "form",
    ["bytes", "raw tensor, some blocks already here", "bytes in 2-block chunks, one block already here"],
)
def test_an_exported_prefix_imported_into_another_engine_gives_the_cold_runs_tokens(
    smollm2: LoadedModel, prompts: dict[str, list[int]], form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host bytes, or the same bytes as a flat uint8 tensor (what a NIXL read of device memory delivers) into a
    pool that already caches the first blocks: only the missing ones are written, and the tokens are the cold
    run's. Host bytes are written a chunk of blocks at a time (on a GPU: each chunk one pinned upload); with a
    block cached in the middle, a chunk's blocks are not one run of the payload."""
    a = prompts["a"]
    cold = engine(smollm2).generate([a], GREEDY)[0]
    src, dst = engine(smollm2), engine(smollm2)
    src.generate([a], GREEDY)
    hashes = block_hashes(a[: len(a) - 1], BS)
    export = src.export_prefix("peer-1", hashes)
    assert export is not None and export.block_hashes == hashes
    assert len(export.data) == len(hashes) * src.kv.block_bytes
    if form == "bytes":
        assert dst.import_prefix("pull-1", hashes, 0, export.data) == len(hashes)
    elif form.startswith("bytes in"):
        assert len(hashes) >= 4
        monkeypatch.setattr(engine_module, "STAGE_CHUNK_BYTES", 2 * dst.kv.block_bytes)
        bb = src.kv.block_bytes
        assert dst.import_prefix("pull-0", hashes[1:2], hashes[0], export.data[bb : 2 * bb]) == 1
        dst.release_kv("pull-0")
        assert dst.import_prefix("pull-1", hashes, 0, export.data) == len(hashes) - 1  # [0, 2], [3, ...]
    else:
        first = export.data[: 2 * src.kv.block_bytes]
        assert dst.import_prefix("pull-0", hashes[:2], 0, first) == 2
        dst.release_kv("pull-0")
        raw = torch.frombuffer(bytearray(export.data), dtype=torch.uint8)
        assert dst.import_prefix("pull-1", hashes, 0, raw) == len(hashes) - 2
    dst.release_kv("pull-1")  # unpinned: still cached, so the admission hits them
    src.release_kv("peer-1")
    out, cached = run_counting_hits(dst, a)
    assert out == cold
    assert cached == len(hashes) * BS  # the whole pulled prefix was a hit; only the last block was computed


def test_a_pulled_prefix_written_beside_the_steps_is_hit_only_once_written_even_if_its_hold_went_meanwhile(
    smollm2: LoadedModel, prompts: dict[str, list[int]]
) -> None:
    """A worker writes a pulled prefix on its restore thread while its engine steps other requests
    (begin_import_prefix). Until finish_import_prefix the blocks are not in the prefix cache, so no prompt can
    hit a block not yet written; a release of the pull's hold meanwhile (its deadline passed) does not hand the
    blocks to another request under the write; once finished they are cached and the prompt's run is the cold
    run's."""
    a, b = prompts["a"], prompts["b"]
    cold = engine(smollm2).generate([a], GREEDY)[0]
    cold_b = engine(smollm2).generate([b], GREEDY)[0]
    src, dst = engine(smollm2), engine(smollm2, blocks=40)
    src.generate([a], GREEDY)
    hashes = block_hashes(a[: len(a) - 1], BS)
    export = src.export_prefix("peer-1", hashes)
    assert export is not None
    job = dst.begin_import_prefix("pull-1", hashes, 0, export.data)
    assert dst.blocks.lookup_prefix(hashes[:1]) == []  # not cached before it is written
    dst.release_kv("pull-1")  # the pull gave up; the write's own pin keeps its blocks
    dst.add_request("b", b, GREEDY)  # another prompt takes free blocks while the write runs
    out_b: list[int] = []
    while "b" in dst.requests:
        for o in dst.step():
            out_b += o.new_token_ids
    assert out_b == cold_b
    job.written.result(timeout=30)
    assert dst.finish_import_prefix(job) == len(hashes)
    assert len(dst.blocks.lookup_prefix(hashes)) == len(hashes)  # whole: cached like computed blocks
    out, cached = run_counting_hits(dst, a)
    assert out == cold and cached == len(hashes) * BS
    assert dst.stats().free_blocks == 40


@pytest.mark.parametrize("meanwhile", ["another pull", "a local prefill"])
def test_a_prefix_cached_meanwhile_by_other_blocks_is_what_the_pulls_hold_pins(
    smollm2: LoadedModel, prompts: dict[str, list[int]], meanwhile: str
) -> None:
    """While a pull writes its blocks beside the steps, the same prefix may be cached by other blocks: a second,
    overlapping pull that finishes first, or the worker prefilling the prompt itself. The pull then commits
    nothing of its own: its hold pins the blocks that are cached (so the prompt, when its prefill is admitted,
    still hits them, whatever the pool had to evict meanwhile), and its written copies go back to the free
    blocks."""
    a = prompts["a"]
    cold = engine(smollm2).generate([a], GREEDY)[0]
    src, dst = engine(smollm2), engine(smollm2, blocks=40)
    src.generate([a], GREEDY)
    hashes = block_hashes(a[: len(a) - 1], BS)
    n = len(hashes)
    export = src.export_prefix("peer-1", hashes)
    assert export is not None
    late = dst.begin_import_prefix("pull-late", hashes, 0, export.data)
    if meanwhile == "another pull":
        first = dst.begin_import_prefix("pull-first", hashes, 0, export.data)
        first.written.result(timeout=30)
        assert dst.finish_import_prefix(first) == n
        dst.release_kv("pull-first")  # its prompt ran and ended: the blocks are only cached now
    else:
        assert dst.generate([a], GREEDY)[0] == cold  # computed and committed while the pull writes
    late.written.result(timeout=30)
    assert dst.finish_import_prefix(late) == 0  # nothing of its own committed
    cached = dst.blocks.lookup_prefix(hashes)
    assert len(cached) == n and not set(cached) & set(late.fresh)
    assert dst.stats().free_blocks == 40 - n  # the hold pins the cached blocks; the copies are free again
    taken = dst.blocks.allocate(dst.blocks.num_free)  # the pool under pressure evicts all it may
    assert dst.blocks.lookup_prefix(hashes) == cached
    dst.blocks.release(taken)
    out, hit = run_counting_hits(dst, a)
    assert out == cold and hit == n * BS
    dst.release_kv("pull-late")
    assert dst.stats().free_blocks == 40


def test_a_pulled_prefix_that_finds_no_room_fails_as_the_pulls_outcome_not_as_a_failed_background_task(
    smollm2: LoadedModel, prompts: dict[str, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's import (begin, wait for the write, finish) runs as one shielded task so a pull's deadline
    cannot cut it in half; an expected failure in it (a pool with no room) reaches the pull as its error, to be
    named as the pull's outcome (no_space), with no ERROR line of a failed background task, and pins nothing."""
    a = prompts["a"]
    src = engine(smollm2)
    src.generate([a], GREEDY)
    hashes = block_hashes(a[: len(a) - 1], BS)
    export = src.export_prefix("peer-1", hashes)
    assert export is not None and len(hashes) > 2

    async def scenario() -> None:
        eng = await AsyncEngine.start(lambda: engine(smollm2, blocks=2))
        try:
            puller = PrefixPuller(eng, None, None, "prefill", ())  # type: ignore[arg-type]
            with pytest.raises(NoFreeBlocksError):
                await puller._import("pull-1", hashes, 0, export.data)
            await asyncio.sleep(0.05)  # the task's end has been logged, if it logs
            assert not await eng.call(lambda e: e.holds_prefix("pull-1"))
            assert await eng.call(lambda e: e.stats().free_blocks) == 2
        finally:
            await eng.close()

    with caplog.at_level("DEBUG"):
        asyncio.run(scenario())
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_export_prefix_holds_the_longest_exact_run_and_pins_it_against_eviction(
    smollm2: LoadedModel, prompts: dict[str, list[int]]
) -> None:
    a, a2 = prompts["a"], prompts["a2"]
    long = prompts["b"] + prompts["c"] + prompts["d"]
    e = engine(smollm2, blocks=12)
    e.generate([a], GREEDY)
    ha, ha2 = block_hashes(a, BS), block_hashes(a2, BS)
    shared = next(i for i, (x, y) in enumerate(zip(ha, ha2, strict=False)) if x != y)
    assert shared >= 2  # the prompts share their first blocks, then differ
    # asked from a mid-prompt block on: the run from there, as far as this pool has the chain
    mid = e.export_prefix("mid", ha2[1:])
    assert mid is not None and mid.block_hashes == ha2[1:shared]
    # a first hash the pool does not hold: nothing held at all
    assert e.export_prefix("none", ha2[shared:]) is None
    assert not e.holds_prefix("none")
    with pytest.raises(ValueError, match="already in use"):
        e.export_prefix("mid", ha2[1:])
    # nor may a request take a hold's id: releasing the one would free the other
    with pytest.raises(ValueError, match="duplicate request id 'mid'"):
        e.add_request("mid", a, GREEDY)
    assert e.holds_prefix("mid") and "mid" not in e.requests
    # pinned: a prompt that needs every free block cannot evict the held ones
    free = e.blocks.num_free
    assert len(long) >= free * BS
    e.generate([long[: free * BS - 1]], SamplingParams(max_tokens=1, temperature=0))  # takes every free block
    assert e.blocks.lookup_prefix([ha[0]]) == []  # block 0 was not held: evicted
    assert [e.blocks.lookup_prefix([h]) != [] for h in ha[1:shared]] == [True] * (shared - 1)  # held: kept
    e.release_kv("mid")
    assert not e.holds_prefix("mid")
    assert e.blocks.num_free == e.blocks.num_blocks  # every reference returned


def test_import_prefix_refuses_bytes_that_do_not_fit_and_leaves_the_pool_as_it_was(
    smollm2: LoadedModel, prompts: dict[str, list[int]]
) -> None:
    a = prompts["a"]
    src, dst = engine(smollm2), engine(smollm2, blocks=3)
    src.generate([a], GREEDY)
    hashes = block_hashes(a[: len(a) - 1], BS)
    export = src.export_prefix("x", hashes)
    assert export is not None and len(hashes) > 3
    with pytest.raises(NoFreeBlocksError):
        dst.import_prefix("p", hashes, 0, export.data)
    with pytest.raises(ValueError, match="bytes"):
        dst.import_prefix("p", hashes[:2], 0, export.data)
    assert dst.blocks.num_cached == 0 and dst.blocks.num_free == 3 and not dst.holds_prefix("p")


# ---- real processes -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
@starts_processes
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = str(tmp_path_factory.mktemp("peer_pull"))
    flags = [*WORKER_FLAGS, "--kv-prefix-pull-deadline-s", "20"]

    def start(etcd_url: str) -> list[Proc]:
        return [
            start_process("services.prefill.server", "prefill-a", etcd_url, log_dir, *flags),
            start_process("services.prefill.server", "prefill-b", etcd_url, log_dir, *flags),
            start_process(
                "services.prefill.server",
                "prefill-b2",
                etcd_url,
                log_dir,
                *flags,
                "--debug-die-in",
                "transfer",
            ),
            # its decode workers' KV goes over the wire fp8-encoded (lossy); the prefixes it exports must not
            start_process(
                "services.prefill.server", "prefill-z", etcd_url, log_dir, *flags, "--kv-compress", "fp8"
            ),
            # a decode worker that prefills locally (agg) and keeps a prefix cache: it pulls too
            start_process("services.decode.server", "decode-p", etcd_url, log_dir, *flags),
            # no prefix cache: every reference it computes is a cold run, whatever it saw before
            start_process(
                "services.decode.server", "decode-d", etcd_url, log_dir, *WORKER_FLAGS, "--no-prefix-caching"
            ),
        ]

    with local_cluster(log_dir, start, {"prefill": 4, "decode": 2}) as c:
        yield c


def metric(endpoint: str, name: str, **labels: str) -> float:
    text = httpx.get(f"http://{endpoint}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def ref(cluster: LocalCluster, worker_id: str) -> pb.WorkerRef:
    info = cluster.infos[worker_id]
    return pb.WorkerRef(worker_id=worker_id, endpoint=info.endpoint, role=info.role, epoch=info.epoch)


def cold(cluster: LocalCluster, rid: str, prompt: list[int]) -> list[int]:
    """The prompt's tokens computed from scratch by the decode worker (it has no prefix cache)."""
    req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=greedy(12, ignore_eos=True))
    chunks = run(lambda: decode(cluster.endpoints["decode-d"], req), 120)
    assert chunks[0].cached_tokens == 0
    return token_ids(chunks)


def prefill(
    cluster: LocalCluster, worker_id: str, rid: str, prompt: list[int], pull: pb.PrefixPull | None = None
) -> pb.PrefillResponse:
    async def call() -> pb.PrefillResponse:
        async with grpc.aio.insecure_channel(cluster.endpoints[worker_id]) as channel:
            req = pb.PrefillRequest(request_id=rid, token_ids=prompt, params=greedy(12, ignore_eos=True))
            if pull is not None:
                req.prefix_pull.CopyFrom(pull)
            response: pb.PrefillResponse = await pb_grpc.PrefillWorkerStub(channel).Prefill(req, timeout=60)
            return response

    return run(call, 90)


def release(cluster: LocalCluster, worker_id: str, rid: str) -> None:
    async def call() -> None:
        async with grpc.aio.insecure_channel(cluster.endpoints[worker_id]) as channel:
            await pb_grpc.PrefillWorkerStub(channel).Release(pb.ReleaseRequest(request_id=rid), timeout=10)

    run(call, 20)


def continuation(
    cluster: LocalCluster, rid: str, prompt: list[int], response: pb.PrefillResponse
) -> list[int]:
    """Decode after the prefill's first token from its KV (disaggregated), as the frontend would."""
    req = pb.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        emitted_token_ids=[response.first_token.token_id],
        params=greedy(12, ignore_eos=True),
        kv=response.kv,
    )
    return [
        response.first_token.token_id,
        *token_ids(run(lambda: decode(cluster.endpoints["decode-d"], req), 120)),
    ]


def all_free(load: pb.LoadSnapshot) -> bool:
    return load.free_blocks == load.total_blocks


def pulls(cluster: LocalCluster, outcome: str) -> float:
    ep = cluster.infos["prefill-a"].metrics_endpoint
    return metric(ep, "rackserve_peer_pulls_total", role="prefill", outcome=outcome)


def test_a_prefill_pulls_the_prefix_from_a_peer_and_answers_the_cold_runs_tokens(
    cluster: LocalCluster, prompts: dict[str, list[int]]
) -> None:
    a = prompts["a"]
    want = cold(cluster, "a-cold", a)
    warm = prefill(cluster, "prefill-b", "a-warm", a)
    assert warm.cached_tokens == 0 and warm.first_token.token_id == want[0]
    release(cluster, "prefill-b", "a-warm")
    hashes = block_hashes(a, BS)
    before = pulls(cluster, "pulled")
    pull = pb.PrefixPull(source=ref(cluster, "prefill-b"), start_block=0, block_hashes=hashes, deadline_s=20)
    got = prefill(cluster, "prefill-a", "a-pulled", a, pull)
    usable = (len(a) - 1) // BS  # the block holding the last prompt token is always computed
    assert got.pulled_tokens == usable * BS
    assert got.cached_tokens == usable * BS
    assert continuation(cluster, "a-pulled", a, got) == want
    assert pulls(cluster, "pulled") == before + 1
    b_metrics = cluster.infos["prefill-b"].metrics_endpoint
    assert metric(b_metrics, "rackserve_prefix_exports_total", outcome="held") >= 1
    assert metric(b_metrics, "rackserve_prefix_export_blocks_total") >= usable
    # nothing stays pinned: B's hold went with the puller's Release, A's with the decode's ack
    for worker in ("prefill-b", "prefill-a"):
        run(lambda w=worker: wait_for_load(cluster.endpoints[w], pb_grpc.PrefillWorkerStub, all_free), 20)

    # a second prompt sharing the first blocks: A has them now, so the plan pulls only from the first block it
    # lacks (mid-prompt), and B exports that run by its chained hashes
    a2 = prompts["a2"]
    want2 = cold(cluster, "a2-cold", a2)
    warm2 = prefill(cluster, "prefill-b", "a2-warm", a2)
    release(cluster, "prefill-b", "a2-warm")
    assert warm2.first_token.token_id == want2[0]
    h2 = block_hashes(a2, BS)
    shared = next(i for i, (x, y) in enumerate(zip(hashes, h2, strict=False)) if x != y)
    pull2 = pb.PrefixPull(source=ref(cluster, "prefill-b"), start_block=shared, block_hashes=h2[shared:])
    got2 = prefill(cluster, "prefill-a", "a2-pulled", a2, pull2)
    usable2 = (len(a2) - 1) // BS
    assert got2.cached_tokens == usable2 * BS
    assert got2.pulled_tokens == (usable2 - shared) * BS
    assert continuation(cluster, "a2-pulled", a2, got2) == want2


def test_a_pull_naming_other_blocks_is_refused_and_the_prompt_recomputed(
    cluster: LocalCluster, prompts: dict[str, list[int]]
) -> None:
    b, d = prompts["b"], prompts["d"]
    want = cold(cluster, "b-cold", b)
    warm = prefill(cluster, "prefill-b", "d-warm", d)  # B holds d's blocks; the plan names them for prompt b
    release(cluster, "prefill-b", "d-warm")
    assert warm.cached_tokens == 0
    before = pulls(cluster, "fallback_mismatch")
    pull = pb.PrefixPull(source=ref(cluster, "prefill-b"), start_block=0, block_hashes=block_hashes(d, BS))
    got = prefill(cluster, "prefill-a", "b-mismatch", b, pull)
    assert got.pulled_tokens == 0 and got.cached_tokens == 0
    assert continuation(cluster, "b-mismatch", b, got) == want
    assert pulls(cluster, "fallback_mismatch") == before + 1


def test_a_peer_killed_as_the_pull_begins_means_a_recompute_with_the_same_tokens(
    cluster: LocalCluster, prompts: dict[str, list[int]]
) -> None:
    c = prompts["c"]
    want = cold(cluster, "c-cold", c)
    warm = prefill(
        cluster, "prefill-b2", "c-warm", c
    )  # Prefill itself is fine; the first pull of its KV kills it
    release(cluster, "prefill-b2", "c-warm")
    assert warm.first_token.token_id == want[0]
    before = pulls(cluster, "fallback_unavailable") + pulls(cluster, "fallback_deadline")
    pull = pb.PrefixPull(source=ref(cluster, "prefill-b2"), start_block=0, block_hashes=block_hashes(c, BS))
    got = prefill(cluster, "prefill-a", "c-pulled", c, pull)
    assert cluster.procs["prefill-b2"].popen.wait(timeout=30) == -9  # it really died (SIGKILL) mid-pull
    assert got.pulled_tokens == 0 and got.cached_tokens == 0
    assert continuation(cluster, "c-pulled", c, got) == want
    assert pulls(cluster, "fallback_unavailable") + pulls(cluster, "fallback_deadline") == before + 1


def test_a_peer_that_holds_nothing_means_a_recompute(
    cluster: LocalCluster, prompts: dict[str, list[int]]
) -> None:
    f = list(reversed(prompts["d"]))  # a prompt nobody has computed
    want = cold(cluster, "f-cold", f)
    before = pulls(cluster, "fallback_empty")
    pull = pb.PrefixPull(source=ref(cluster, "prefill-b"), start_block=0, block_hashes=block_hashes(f, BS))
    got = prefill(cluster, "prefill-a", "f-pulled", f, pull)
    assert got.pulled_tokens == 0 and got.cached_tokens == 0
    assert continuation(cluster, "f-pulled", f, got) == want
    assert pulls(cluster, "fallback_empty") == before + 1
    # the same plan again: A computed f itself meanwhile, so nothing needs pulling (and nothing is asked of B)
    before_local = pulls(cluster, "local")
    again = prefill(cluster, "prefill-a", "f-again", f, pull)
    assert again.pulled_tokens == 0 and again.cached_tokens == (len(f) - 1) // BS * BS
    assert again.first_token.token_id == want[0]
    assert pulls(cluster, "local") == before_local + 1


@pytest.mark.parametrize(("start", "pulled"), [(2, True), (3, False)])
def test_a_pull_behind_blocks_this_worker_lacks_pulls_those_blocks_too_unless_they_outnumber_the_plans(
    cluster: LocalCluster, prompts: dict[str, list[int]], start: int, pulled: bool
) -> None:
    """The router starts a pull after the blocks it counts as the puller's: its pool's, but also its host and
    disk tiers' and those a request queued there will compute. The pool lacks those when the pull runs, and
    pulled blocks behind that gap could never be hit, so the puller asks from its first missing block (until
    2026-12-07 it refused, `fallback_prefix_gone`, and recomputed every block the router planned to copy) —
    unless the gap is longer than the planned blocks (3 before 1 here): that copy would be many times the one
    the router priced and timed, so it is refused and the answer computed, the cold run's tokens either way."""
    # new to everyone (another test computes d reversed: shifted by a token, every block hash differs)
    g = (prompts["b"][::-1] if pulled else prompts["d"][::-1][1:])[: 5 * BS]
    want = cold(cluster, f"g{start}-cold", g)
    warm = prefill(cluster, "prefill-b", f"g{start}-warm", g)
    release(cluster, "prefill-b", f"g{start}-warm")
    assert warm.first_token.token_id == want[0]
    before = pulls(cluster, "pulled"), pulls(cluster, "fallback_prefix_gone")
    a = cluster.endpoints["prefill-a"]
    free = run(lambda: wait_for_load(a, pb_grpc.PrefillWorkerStub, lambda s: True)).free_blocks
    h = block_hashes(g, BS)
    pull = pb.PrefixPull(source=ref(cluster, "prefill-b"), start_block=start, block_hashes=h[start:])
    got = prefill(cluster, "prefill-a", f"g{start}-pulled", g, pull)  # A lacks the blocks before start too
    usable = (len(g) - 1) // BS
    assert got.pulled_tokens == usable * BS * pulled and got.cached_tokens == usable * BS * pulled
    assert continuation(cluster, f"g{start}-pulled", g, got) == want
    assert (pulls(cluster, "pulled"), pulls(cluster, "fallback_prefix_gone")) == (
        before[0] + pulled,
        before[1] + (not pulled),
    )
    # nothing of the pull stays pinned (A may hold an earlier test's unreleased prefill until its TTL)
    run(lambda: wait_for_load(cluster.endpoints["prefill-b"], pb_grpc.PrefillWorkerStub, all_free), 20)
    run(lambda: wait_for_load(a, pb_grpc.PrefillWorkerStub, lambda s: s.free_blocks >= free), 20)


def pulled_on_decode(
    cluster: LocalCluster, source: str, tag: str, tokens: list[int]
) -> tuple[list[int], list[pb.DecodeChunk]]:
    """The cold run's tokens, and the chunks of decode-p prefilling `tokens` locally with their prefix pulled from
    `source` (which computed and released it first)."""
    want = cold(cluster, f"{tag}-cold", tokens)
    prefill(cluster, source, f"{tag}-warm", tokens)
    release(cluster, source, f"{tag}-warm")
    pull = pb.PrefixPull(source=ref(cluster, source), start_block=0, block_hashes=block_hashes(tokens, BS))
    req = pb.DecodeRequest(
        request_id=f"{tag}-pulled",
        prompt_token_ids=tokens,
        params=greedy(12, ignore_eos=True),
        prefix_pull=pull,
    )
    return want, run(lambda: decode(cluster.endpoints["decode-p"], req), 120)


def test_a_local_prefill_on_a_decode_worker_pulls_the_prefix_and_streams_the_cold_runs_tokens(
    cluster: LocalCluster, prompts: dict[str, list[int]]
) -> None:
    h = prompts["a"][::-1]  # new to every worker
    want, chunks = pulled_on_decode(cluster, "prefill-b", "h", h)
    usable = (len(h) - 1) // BS
    assert chunks[0].pulled_tokens == usable * BS and chunks[0].cached_tokens == usable * BS
    assert token_ids(chunks) == want
    ep = cluster.infos["decode-p"].metrics_endpoint
    assert metric(ep, "rackserve_peer_pulls_total", role="decode", outcome="pulled") == 1
    assert metric(ep, "rackserve_peer_pull_blocks_total", role="decode") == usable
    run(lambda: wait_for_load(cluster.endpoints["decode-p"], pb_grpc.DecodeWorkerStub, all_free), 20)


def test_a_prefix_pulled_from_a_peer_that_compresses_its_wire_kv_is_exact(
    cluster: LocalCluster, prompts: dict[str, list[int]]
) -> None:
    """`--kv-compress fp8` is lossy and meant for the transfer only, but pulled blocks are committed to the
    puller's prefix cache under the exact blocks' hashes: an encoded export answered other tokens than the cold
    run (this prompt from its first token on, until 2026-12-07), on the pull and on every later hit of those
    blocks. The peer exports the exact bytes whatever its wire encoding."""
    a = prompts["a"]
    want, chunks = pulled_on_decode(cluster, "prefill-z", "z", a)
    usable = (len(a) - 1) // BS
    assert chunks[0].pulled_tokens == usable * BS
    assert token_ids(chunks) == want
    # a later request of the prompt hits the pulled blocks, with no pull: the same tokens
    again = pb.DecodeRequest(request_id="z-again", prompt_token_ids=a, params=greedy(12, ignore_eos=True))
    chunks = run(lambda: decode(cluster.endpoints["decode-p"], again), 120)
    assert chunks[0].cached_tokens == usable * BS
    assert token_ids(chunks) == want


class PlanRouter(pb_grpc.RouterServicer):
    """Answers the plan it is given: the stand-in for a router that prices peer pulls."""

    def __init__(self) -> None:
        self.plan = pb.RoutePlan()

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RoutePlan:  # noqa: N802
        return self.plan


class Workers:
    def __init__(self, workers: list[pb.WorkerInfo]) -> None:
        self._workers = workers

    def workers(self, role: str) -> list[pb.WorkerInfo]:
        return [w for w in self._workers if w.role == role]

    def suppress(self, worker_id: str, seconds: float) -> None:
        pass


def test_the_frontend_sends_the_plans_prefix_pull_and_records_the_pulled_tokens(
    cluster: LocalCluster, prompts: dict[str, list[int]], tok: Tokenizer
) -> None:
    import uvicorn

    from services.frontend.app import FrontendConfig, create_app
    from services.frontend.coordinator import Coordinator
    from services.runtime.channels import ChannelPool
    from tests.support.etcd import free_port

    disagg, agg = prompts["a2"][::-1], prompts["c"][::-1]  # new to every worker (reversed: no test used them)
    wants = {"disagg": cold(cluster, "fe-d-cold", disagg), "agg": cold(cluster, "fe-a-cold", agg)}
    for rid, prompt in (("fe-d-warm", disagg), ("fe-a-warm", agg)):
        prefill(cluster, "prefill-b", rid, prompt)
        release(cluster, "prefill-b", rid)
    router = PlanRouter()
    port = free_port()

    async def body() -> dict[str, tuple[dict[str, object], dict[str, object]]]:
        server = grpc.aio.server()
        pb_grpc.add_RouterServicer_to_server(router, server)
        router_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        infos = [cluster.infos[w] for w in ("prefill-a", "prefill-b", "decode-d", "decode-p")]
        directory = Workers(
            [*infos, pb.WorkerInfo(worker_id="r", role="router", endpoint=f"127.0.0.1:{router_port}")]
        )
        app = create_app(
            FrontendConfig(served_model_name="m", request_timeout_s=120), tok, directory,
            Coordinator(directory, ChannelPool()),
        )  # fmt: skip
        http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.get_running_loop().create_task(http.serve())
        out = {}
        try:
            while not http.started:
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
                for mode, prompt in (("disagg", disagg), ("agg", agg)):
                    pull = pb.PrefixPull(
                        source=ref(cluster, "prefill-b"), start_block=0, block_hashes=block_hashes(prompt, BS)
                    )
                    router.plan = pb.RoutePlan(
                        decode=ref(cluster, "decode-d" if mode == "disagg" else "decode-p")
                    )
                    if mode == "disagg":
                        router.plan.prefill.CopyFrom(ref(cluster, "prefill-a"))
                    router.plan.prefix_pull.CopyFrom(pull)
                    req = {
                        "model": "m",
                        "prompt": prompt,
                        "max_tokens": 12,
                        "temperature": 0,
                        "ignore_eos": True,
                    }
                    r = await client.post("/v1/completions", json=req)
                    assert r.status_code == 200, r.text
                    rid = r.headers["x-rackserve-request-id"]
                    timeline = await client.get(f"/v1/requests/{rid}/timeline")
                    out[mode] = (r.json(), timeline.json())
        finally:
            http.should_exit = True
            await serving
            await server.stop(0)
        return out

    got = run(body, 300)
    for mode, prompt in (("disagg", disagg), ("agg", agg)):
        answer, timeline = got[mode]
        usable = (len(prompt) - 1) // BS
        assert answer["choices"][0]["text"] == tok.decode(wants[mode])
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == usable * BS
        assert timeline["pulled_tokens"] == usable * BS
        assert timeline["prefix_pull"] == {
            "source": "prefill-b",
            "start_block": 0,
            "blocks": len(block_hashes(prompt, BS)),
            "pulled_tokens": usable * BS,
        }


def test_export_prefix_holds_the_blocks_until_its_ttl_and_answers_empty_for_unknown_hashes(
    cluster: LocalCluster, prompts: dict[str, list[int]]
) -> None:
    k = prompts["a"] + prompts["b"]  # warmed here as a whole, whatever B evicted before
    prefill(cluster, "prefill-b", "k-warm", k)
    release(cluster, "prefill-b", "k-warm")
    hashes = block_hashes(k, BS)
    ep = cluster.endpoints["prefill-b"]

    async def export(rid: str, asked: list[int]) -> pb.ExportPrefixResponse:
        async with grpc.aio.insecure_channel(ep) as channel:
            req = pb.ExportPrefixRequest(request_id=rid, block_hashes=asked, ttl_s=2.0)
            response: pb.ExportPrefixResponse = await pb_grpc.PrefillWorkerStub(channel).ExportPrefix(
                req, timeout=20
            )
            return response

    got = run(lambda: export("k-export", hashes), 30)
    assert got.matched_blocks == len(hashes) and got.kv.num_tokens == len(hashes) * BS
    assert got.kv.producer_worker_id == "prefill-b" and got.kv.transfer_endpoint
    # held (pinned) now; with no Release, its TTL frees every block
    run(
        lambda: wait_for_load(
            ep, pb_grpc.PrefillWorkerStub, lambda s: s.free_blocks == s.total_blocks - len(hashes)
        )
    )
    run(lambda: wait_for_load(ep, pb_grpc.PrefillWorkerStub, all_free, timeout_s=20), 30)
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # a second hold of the same id while held is refused
        run(lambda: _two_exports(ep, hashes), 30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    empty = run(lambda: export("k-none", [h ^ 1 for h in hashes]), 30)  # hashes no block has
    assert empty.matched_blocks == 0 and not empty.HasField("kv")
    # the last block alone is an exact run (its hash chains it); the blocks asked after it are not its children
    backwards = run(lambda: export("k-back", list(reversed(hashes))), 30)
    assert backwards.matched_blocks == 1 and list(backwards.kv.block_ids) == list(got.kv.block_ids[-1:])


async def _two_exports(endpoint: str, hashes: list[int]) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.PrefillWorkerStub(channel)
        for _ in range(2):
            req = pb.ExportPrefixRequest(request_id="k-twice", block_hashes=hashes, ttl_s=30.0)
            await stub.ExportPrefix(req, timeout=20)

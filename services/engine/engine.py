"""The engine every prefill and decode worker runs: requests in, tokens out, one step at a time.

`LLMEngine.step()` asks the scheduler for a decision, turns it into one batched forward pass (the runner part of
this file builds the token, position and attention metadata tensors), samples where a sequence reached its end,
applies stop conditions and returns what changed. KV blocks can be exported to bytes and imported into another
engine (`export_kv` / `import_kv`); the `KvLayout` they carry is checked field by field, so a cache from a
different model, dtype or block size is refused, never reinterpreted.

Prefix pulls between workers move cached blocks by hash, not by request: `export_prefix` pins the longest cached
run of asked chained hashes under a hold id and copies its bytes out; `import_prefix` writes a peer's blocks into
fresh pool blocks and commits them under their hashes, so the next admission of that prompt is an ordinary prefix
hit. Both keep their blocks pinned under the hold id until `release_kv(hold_id)`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from services.engine.block_hash import ROOT_HASH
from services.engine.config import EngineConfig, ModelConfig, torch_dtype
from services.engine.device import (
    MemoryPlan,
    host_tensor_to_device,
    host_to_device,
    memory_in_use,
    plan_kv_memory,
    resolve_device,
    step_token_budget,
)
from services.engine.host_bytes import bytes_of, view_of
from services.engine.kv_cache import BlockManager, KvEvent, NoFreeBlocksError
from services.engine.kv_disk import DiskKvTier
from services.engine.kv_tier import HostKvTier, TierStats, decode_entries
from services.engine.loader import ACTIVATION_SCALE_SUFFIX, LoadedModel, load_model, model_fingerprint
from services.engine.model import AttnMetadata, PagedKvCache, PrefillSegment, Transformer
from services.engine.sampling import (
    RowContext,
    Sampled,
    SamplingParams,
    sample_batch,
    unpack_bitmask,
    worst_case_batch,
)
from services.engine.scheduler import Request, RequestStatus, RestoreGroup, Scheduler, SchedulerOutput
from services.engine.structured import GrammarError, Grammars, Matcher
from services.engine.varlen import SDPA_FRESH_MIN_TOKENS, PrefillChunk, plan_prefill

if TYPE_CHECKING:
    from services.engine.cuda_graphs import DecodeGraphs

log = logging.getLogger("rackserve.engine")


class PromptTooLongError(ValueError):
    """A prompt (plus what it may generate) does not fit the context."""


class KvMismatchError(ValueError):
    """A KV payload was produced for another model, dtype or layout; it must be refused, not reinterpreted."""


class KvWriteError(RuntimeError):
    """Writing a request's KV into its blocks beside the step (an import, a tier restore) failed, e.g. out of
    device memory: that request ends with this error (LLMEngine.take_failures); the engine and its other
    requests go on."""


@dataclass(frozen=True)
class KvLayout:
    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    layout: str = PagedKvCache.LAYOUT
    # where the cache lives ("cpu" or "cuda"). Exported bytes are the same whatever the device (the staged
    # paths: TCP, shm, NIXL from host memory), so a CPU/GPU pair may exchange them; only device-direct handles
    # (CUDA IPC, NIXL VRAM) need the same kind on both ends, and they check it with same_device=True.
    device_kind: str = "cpu"

    def check_compatible(self, other: KvLayout, same_device: bool = False) -> None:
        for name in self.__dataclass_fields__:
            if name == "device_kind" and not same_device:
                continue
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise KvMismatchError(
                    f"KV {name} mismatch: this engine has {mine!r}, the payload has {theirs!r}"
                )


@dataclass
class KvExport:
    """The KV of a sequence's first `len(token_ids)` tokens: whole blocks in order, block-major bytes."""

    layout: KvLayout
    token_ids: list[int]
    # host bytes (staged: export_kv gives a memoryview onto them), or the blocks tensor of export_kv_blocks
    # (device-direct)
    data: bytes | memoryview | torch.Tensor
    device_blocks: torch.Tensor | None = None  # export_kv on a GPU: the same blocks, still on the device

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, torch.Tensor):
            return self.data.numel() * self.data.element_size()
        return len(self.data)

    @property
    def num_blocks(self) -> int:
        return -(-len(self.token_ids) // self.layout.block_size)


@dataclass
class PrefixExport:
    """Cached blocks pinned under a hold for a peer (`export_prefix`): block-major bytes, in the asked order."""

    block_ids: list[int]
    block_hashes: list[int]
    data: bytes | memoryview
    device_blocks: torch.Tensor | None = None  # on a GPU: the same blocks, still on the device (cuda_ipc)


@dataclass
class PrefixImport:
    """A pulled prefix being written into fresh blocks (begin_import_prefix): `written` completes when the bytes
    are in place; then finish_import_prefix commits them."""

    hold_id: str
    pin_id: str
    fresh: list[int]  # the blocks written, one per entry of `missing`
    missing: list[int]  # indexes into hashes of the blocks the pool did not cache
    hashes: Sequence[int]
    parents: list[int]
    written: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Sampled] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class EngineStats:
    waiting: int
    running: int
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    kv_usage: float
    prefix_hits_tokens: int
    prefix_query_tokens: int
    preemptions: int
    step_s: float  # exponential average of recent step times
    batch_size: int
    block_bytes: int = 0  # bytes of one primary block
    tier2: TierStats | None = None  # the host tier, when it is on
    disk: TierStats | None = None  # the disk tier, when it is on
    weight_bytes: int = 0  # the model's weights as held (NVFP4 packed), each tensor once
    memory_plan: MemoryPlan | None = None  # a GPU worker's start-up plan (device.plan_kv_memory)


class LLMEngine:
    def __init__(
        self,
        model: str | os.PathLike[str] | LoadedModel,
        config: EngineConfig | None = None,
        tokenizer: object | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        self.device = device = resolve_device(
            cfg.device
        )  # before any weight is read: a missing GPU fails fast
        if device.type == "cuda":
            # this thread's current device: Triton launches on it and torch.cuda.graph captures on it, whatever
            # device the tensors name, so cuda:1 must be current for an engine on cuda:1 (the engine is built on
            # the thread that steps it)
            torch.cuda.set_device(device)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        # what the device holds before this engine's weights: the KV plan counts only what the engine adds
        in_use_at_start = memory_in_use(device) if device.type == "cuda" else 0
        loaded = model if isinstance(model, LoadedModel) else load_model(model)
        self.model_config: ModelConfig = loaded.config
        self.model_path = loaded.source
        self.dtype = torch_dtype(cfg.dtype)
        self._nonfinite: torch.Tensor | None = None  # W4A4: set on the device by a NaN/Inf activation
        self.memory_plan: MemoryPlan | None = None  # how a GPU's memory was shared out at start-up
        quant_id = "none"
        kw: dict[str, object] = {}
        weights = loaded.weights  # what the fingerprint hashes
        if cfg.quant == "nvfp4" or loaded.quantization != "none":
            from services.engine.nvfp4 import QUANT_RECIPE_ID

            quant_id = QUANT_RECIPE_ID
            kw = {"cache_dequantized": cfg.nvfp4_cache_dequantized and device.type == "cpu"}
            # packed weights stay packed in HBM (no dequantized copy); FP4 tensor cores where the GPU has them, a
            # probe GEMM on them gives the recipe's product and --nvfp4-gemm allows (blackwell.py: choose_gemm)
            from services.engine.nvfp4.blackwell import choose_gemm, nonfinite_flag

            w4a4, why = choose_gemm(cfg.nvfp4_gemm, device, loaded.nvfp4_activations)
            kw["w4a4"] = w4a4
            log.info("NVFP4 GEMM on %s: %s (%s)", device, "W4A4" if w4a4 else "W4A16", why)
            if w4a4 and device.type == "cuda":
                self._nonfinite = nonfinite_flag(device)  # before any graph is captured
            if loaded.quantization != "none":
                # a pre-quantized checkpoint runs as it was quantized: its bytes are never requantized
                log.info(
                    "%s is pre-quantized (%s); runs as NVFP4 whatever --quant says",
                    loaded.source,
                    loaded.quantization,
                )
                quant_id = f"{loaded.quantization}:{QUANT_RECIPE_ID}"
                if cfg.nvfp4_method != "rtn":
                    raise ValueError(
                        f"nvfp4_method={cfg.nvfp4_method!r}: {loaded.source} is pre-quantized and runs with the "
                        "bytes it holds; the method applies only to quantizing at load"
                    )
            else:
                from services.engine.nvfp4.methods import method_id

                kw["method"] = cfg.nvfp4_method
                quant_id += method_id(cfg.nvfp4_method)
            static = {name for name in loaded.weights if name.endswith(ACTIVATION_SCALE_SUFFIX)}
            if w4a4:
                # quantized activations make another function of the same weights: its KV is another model's
                quant_id += ":w4a4"
                log.info(
                    "W4A4 activation tensor scales: %s",
                    f"static, the checkpoint's ({len(static)} projections)"
                    if static
                    else "one per call, from its amax (no static scales in the weights)",
                )
            elif static:  # unused static activation scales leave the function, and the fingerprint, alone
                weights = {name: t for name, t in weights.items() if name not in static}
        elif cfg.nvfp4_gemm != "auto":
            raise ValueError(
                f"nvfp4_gemm={cfg.nvfp4_gemm!r} needs NVFP4 weights (--quant nvfp4 or an NVFP4 checkpoint)"
            )
        self.fingerprint = model_fingerprint(loaded.config, weights, quant_id)
        self.attention_backend = _attention_backend(
            cfg.attention_backend, device, loaded.config.head_dim, cfg.block_size
        )
        self.model = Transformer(
            loaded.config,
            loaded.weights,
            self.dtype,
            cfg.quant,
            cpu_kernels=None if cfg.cpu_kernels else False,
            device=device,
            triton_decode=self.attention_backend == "triton",
            **kw,
        )
        self.weight_bytes = _weight_bytes(self.model)
        log.info(
            "model on %s: %.3f GiB of weights (%s, quant %s), attention %s",
            device, self.weight_bytes / (1 << 30), cfg.dtype, cfg.quant, self.attention_backend,
        )  # fmt: skip
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(loaded)
        self.max_model_len = min(cfg.max_model_len or loaded.config.max_context, loaded.config.max_context)
        self.max_num_batched_tokens = step_token_budget(cfg.max_num_batched_tokens, device)
        if self.max_num_batched_tokens < cfg.block_size:
            raise ValueError(f"max_num_batched_tokens must be at least block_size ({cfg.block_size})")
        log.info(
            "step token budget %d%s", self.max_num_batched_tokens,
            "" if cfg.max_num_batched_tokens else f" (the default on {device.type})",
        )  # fmt: skip

        per_block = PagedKvCache.bytes_per_block(loaded.config, cfg.block_size, self.dtype)
        num_blocks = cfg.num_kv_blocks or max(1, (cfg.kv_cache_bytes or 1 << 30) // per_block)
        if device.type == "cuda" and not cfg.num_kv_blocks and not cfg.kv_cache_bytes:
            # on a GPU the cache takes what is left of --gpu-memory-utilization after weights and activations
            peak = self._profile_activation_bytes(loaded.config, cfg)
            if self._wants_graphs(cfg):  # their private pool is not in the eager steps' peak
                from services.engine.cuda_graphs import graph_pool_bytes

                peak += graph_pool_bytes(loaded.config, cfg.max_num_seqs, self.dtype.itemsize)
            plan = plan_kv_memory(
                device, cfg.gpu_memory_utilization, self.weight_bytes, peak, per_block, in_use_at_start,
                cfg.kv_transit_bytes,
            )  # fmt: skip
            num_blocks = plan.kv_blocks
            self.memory_plan = plan
            log.info("%s", plan.describe())
        if device.type == "cuda" and self.attention_backend == "triton":
            import services.engine.triton_attention as triton_attention

            t0 = time.perf_counter()
            mc = loaded.config
            heights = triton_attention.warm_up_prefill(
                mc.num_heads, mc.num_kv_heads, mc.head_dim, cfg.block_size, self.dtype, device
            )
            log.info("prefill kernel compiled for %s-row tiles in %.1f s", heights, time.perf_counter() - t0)
        scratch = 1 if device.type == "cuda" else 0
        self.kv = PagedKvCache(loaded.config, num_blocks, cfg.block_size, self.dtype, device, scratch)
        log.info(
            "paged KV cache on %s: %d blocks of %d tokens, %.3f GiB",
            device, num_blocks, cfg.block_size, num_blocks * per_block / (1 << 30),
        )  # fmt: skip
        if self.max_model_len > num_blocks * cfg.block_size:
            # a sequence longer than the whole cache would preempt itself and wait for blocks forever; vLLM refuses
            # to start, this serves the contexts it can hold (and says so: discovery advertises the shorter one)
            log.warning(
                "context length %d tokens capped at %d: the KV cache holds no more (%d blocks of %d)",
                self.max_model_len, num_blocks * cfg.block_size, num_blocks, cfg.block_size,
            )  # fmt: skip
            self.max_model_len = num_blocks * cfg.block_size
        self.tier2: HostKvTier | None = None
        if cfg.kv_tier2_bytes:
            self.tier2 = HostKvTier(
                cfg.kv_tier2_bytes,
                cfg.kv_tier2_codec,
                (
                    loaded.config.num_layers,
                    2,
                    loaded.config.num_kv_heads,
                    cfg.block_size,
                    loaded.config.head_dim,
                ),
                self.dtype,
                self.kv.read_block,
                pin_memory=device.type == "cuda",
            )
            log.info(
                "KV tier 2 in host memory: %.3f GiB, codec %s, %d blocks",
                cfg.kv_tier2_bytes / (1 << 30), cfg.kv_tier2_codec,
                cfg.kv_tier2_bytes // self.tier2.block_charge,
            )  # fmt: skip
        self.disk: DiskKvTier | None = None
        if cfg.kv_disk_bytes:
            shape = (
                loaded.config.num_layers,
                2,
                loaded.config.num_kv_heads,
                cfg.block_size,
                loaded.config.head_dim,
            )
            self.disk = DiskKvTier(
                cfg.kv_disk_path, cfg.kv_disk_bytes, cfg.kv_tier2_codec, shape, self.dtype, self.fingerprint,
                cfg.block_size,
            )  # fmt: skip
            log.info(
                "KV disk tier at %s: %.3f GiB, codec %s, %d blocks kept from before",
                cfg.kv_disk_path, cfg.kv_disk_bytes / (1 << 30), cfg.kv_tier2_codec, len(self.disk),
            )  # fmt: skip
        self.blocks = BlockManager(
            num_blocks, cfg.block_size, cfg.enable_prefix_caching, self.tier2, self.disk, self.kv.read_block
        )
        self.scheduler = Scheduler(
            self.blocks, cfg.max_num_seqs, self.max_num_batched_tokens, async_restore=cfg.kv_async_restore
        )
        # restores written beside the step: one worker thread (and a side stream on CUDA), jobs by request id
        self._restorer: concurrent.futures.ThreadPoolExecutor | None = None
        self._restore_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._export_stream: torch.cuda.Stream | None = None  # copies of exports off the engine thread (GPU)
        self._write_pins = itertools.count(1)  # pulled prefixes being written: each write's own pin
        self._restore_jobs: dict[str, tuple[concurrent.futures.Future[list[float]], list[RestoreGroup]]] = {}
        # requests ended by a failed write beside the step (take_failures)
        self._failures: list[tuple[str, KvWriteError]] = []
        self.requests: dict[str, Request] = {}
        self.kv_layout = KvLayout(
            model_fingerprint=self.fingerprint,
            num_layers=loaded.config.num_layers,
            num_kv_heads=loaded.config.num_kv_heads,
            head_dim=loaded.config.head_dim,
            block_size=cfg.block_size,
            dtype=cfg.dtype,
            device_kind=device.type,
        )
        self._eos_ids = set(getattr(self.tokenizer, "stop_token_ids", ()) or ())
        if loaded.config.eos_token_id is not None:
            self._eos_ids.add(loaded.config.eos_token_id)
        self._grammars = self.grammars = Grammars(
            self.tokenizer, loaded.config.vocab_size, sorted(self._eos_ids)
        )  # `grammars`: for compiling a request's grammar off the engine thread (AsyncEngine.compile_grammar)
        self._matchers: dict[str, Matcher] = {}  # request id → its grammar's state, for constrained requests
        self._prefix_hits = self._prefix_queries = self._preemptions = 0
        self._step_s = 0.0
        self._last_batch = 0
        self._pending_kv: dict[
            str, bytes | memoryview | torch.Tensor
        ] = {}  # request id -> imported KV waiting for its blocks
        self._prefix_holds: dict[
            str, list[int]
        ] = {}  # hold id -> blocks pinned for a prefix pull (either end)
        self.graphs: DecodeGraphs | None = None
        self.graphs_error = ""  # why decode steps run eagerly though graphs were wanted (a failed capture)
        if self._wants_graphs(cfg):
            from services.engine.cuda_graphs import DecodeGraphs

            t0 = time.perf_counter()
            try:
                self.graphs = DecodeGraphs(self.model, self.kv, self.max_model_len, cfg.max_num_seqs)
            except Exception as e:  # noqa: BLE001 - the worker serves, eagerly, and says why
                self.graphs_error = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                log.exception("CUDA graph capture failed; decode steps run eagerly (slower at small batch)")
            else:
                log.info(
                    "CUDA graphs captured for decode batch sizes %s in %.1f s (--enforce-eager turns them off)",
                    self.graphs.buckets, time.perf_counter() - t0,
                )  # fmt: skip

    def _wants_graphs(self, cfg: EngineConfig) -> bool:
        return self.device.type == "cuda" and not cfg.enforce_eager and self.attention_backend == "triton"

    @torch.inference_mode()
    def _profile_activation_bytes(self, mc: ModelConfig, cfg: EngineConfig) -> int:
        """Peak memory of the largest step: a prefill of max_num_batched_tokens tokens into a throw-away cache,
        then the logits of a full batch and the sampler over them with every processor on. Leaves the allocator
        empty."""
        dev = self.device
        # a full step: the whole budget, as sequences of at most max_model_len (a step of several shorter ones
        # takes the budget, not one sequence's length)
        n, seq = self.max_num_batched_tokens, min(self.max_num_batched_tokens, self.max_model_len)
        nb = -(-n // cfg.block_size)
        scratch = PagedKvCache(mc, nb, cfg.block_size, self.dtype, dev)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        segments = [PrefillSegment(a, min(a + seq, n)) for a in range(0, n, seq)]
        meta = AttnMetadata(slot_mapping=torch.arange(n, device=dev), prefills=segments)
        positions = torch.arange(n, device=dev) % seq
        hidden = self.model(torch.zeros(n, dtype=torch.long, device=dev), positions, meta, scratch)
        # then the sampler over a full batch's logits, every processor on (it keeps several fp32 and int64 copies
        # of the logits alive at once: tens of bytes per logit, 2 GB at 256 sequences of a 128k vocabulary)
        logits = self.model.logits(hidden[-1:].expand(cfg.max_num_seqs, -1).contiguous())
        del hidden
        params, indices, rows = worst_case_batch(cfg.max_num_seqs, mc.vocab_size)
        sample_batch(logits, params, indices, rows)
        del logits
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        del scratch
        torch.cuda.empty_cache()
        return peak

    # ------------------------------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        output_ids: Sequence[int] = (),
        kv: KvExport | None = None,
        hold_kv: bool = False,
    ) -> Request:
        """Queue a request. output_ids are tokens already emitted (a resumed request continues after them);
        kv, if given, is imported so the tokens it covers need no recompute."""
        if self.id_in_use(request_id):
            raise ValueError(f"duplicate request id {request_id!r}: a request or a prefix hold has it")
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt + list(output_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
        # ids the sampler indexes the logits with: out of range, on a GPU a device-side assert ends the worker
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("forced_token_ids", params.forced_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} holds {bad[0]}, outside the vocabulary (size {vocab})")
        total = len(prompt) + len(output_ids)
        if total >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt of {total} tokens does not fit the context length of {self.max_model_len} tokens"
            )
        req = Request(request_id, prompt, params.with_seed(), list(output_ids), hold_kv=hold_kv)
        if len(req.output_ids) >= params.max_tokens:
            raise ValueError(
                f"already {len(req.output_ids)} tokens emitted, max_tokens is {params.max_tokens}"
            )
        if params.structured_kind:
            if self.tokenizer is None:
                raise GrammarError("constrained decoding needs the model's tokenizer; this engine has none")
            # the grammar's state after the tokens already emitted (a resumed request replays them; forced ones
            # are the prompt's)
            self._matchers[request_id] = self._grammars.matcher(
                params.structured_kind, params.structured_spec, req.output_ids[len(params.forced_token_ids) :]
            )
        if kv is not None:
            self._import_into(req, kv)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        if request_id in self._restore_jobs:
            self._collect_restores(only=request_id)  # its blocks are being written: let that finish first
            self._failures = [f for f in self._failures if f[0] != request_id]  # aborted anyway
        self._matchers.pop(request_id, None)
        self._pending_kv.pop(request_id, None)
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")
        if req is not None:
            # no longer in self.requests, so nothing could release it later: a request that holds its KV
            # (hold_kv, a prefill worker's) aborted before it finished lets go of its blocks here too
            self.scheduler.release_kv(req)

    def release_kv(self, request_id: str) -> None:
        """Let go of a finished request's held KV blocks, or of a prefix hold of that id (they stay in the prefix
        cache until evicted)."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.release_kv(req)
        pinned = self._prefix_holds.pop(request_id, None)
        if pinned is not None:
            self.blocks.release(pinned)

    def holds_prefix(self, hold_id: str) -> bool:
        return hold_id in self._prefix_holds

    def id_in_use(self, request_id: str) -> bool:
        """Whether a live or held request or a prefix hold has this id: release_kv(id) frees all of them, so one
        id names one thing."""
        return request_id in self.requests or request_id in self._prefix_holds

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self._restore_jobs:
            self._collect_restores()
        decision = self.scheduler.schedule()
        self._preemptions += len(decision.preempted)
        for g in decision.restored:
            self._write_restored(g)
        for request_id, groups in decision.restoring:
            self._restore_jobs[request_id] = (self._beside(self._restore_job, groups), groups)
        for request_id in decision.imported:
            self._write_imported(request_id)
        for request_id in decision.importing:  # its KV, written beside the step like a restore
            data, ids, nblocks = self._imported_payload(request_id)
            self._restore_jobs[request_id] = (self._beside(self._import_job, ids, data, nblocks), [])
        if decision.empty:
            if self._restore_jobs:  # nothing else to run: wait for a restore, the next step runs its request
                concurrent.futures.wait(
                    [f for f, _ in self._restore_jobs.values()], return_when="FIRST_COMPLETED"
                )
                self._collect_restores()
            return []
        sampled = self._execute(decision)
        outputs = []
        for chunk in decision.chunks:
            req = self.requests[chunk.request_id]
            self.scheduler.on_computed(req, chunk.num_tokens)
            if not chunk.samples:
                continue
            s = sampled[chunk.request_id]
            outputs.append(self._append_token(req, s))
        dt = time.perf_counter() - t0
        self._step_s = dt if self._step_s == 0 else 0.8 * self._step_s + 0.2 * dt
        self._last_batch = len(decision.chunks)
        return outputs

    def _append_token(self, req: Request, s: Sampled) -> RequestOutput:
        if req.first_token_s is None:
            req.first_token_s = time.monotonic()
            self._prefix_queries += len(req.prompt_ids)
            self._prefix_hits += req.num_cached_tokens
        req.output_ids.append(s.token_id)
        p = req.params
        n_out = len(req.output_ids)
        # forced tokens (echo's teacher forcing) are the prompt's: the grammar, min_tokens and the penalties start
        # after them, as for the same request not forced
        n_forced = len(p.forced_token_ids)
        reason: str | None = None
        stop_reason: str | int | None = None
        matcher = self._matchers.get(req.request_id) if n_out > n_forced else None
        if matcher is not None and matcher.accept(s.token_id) and matcher.terminated:
            reason, stop_reason = "stop", s.token_id  # the grammar is complete (it accepted end-of-sequence)
        elif n_out - n_forced >= p.min_tokens and n_out > n_forced:
            if s.token_id in p.stop_token_ids:
                reason, stop_reason = "stop", s.token_id
            elif not p.ignore_eos and s.token_id in self._eos_ids:
                reason, stop_reason = "stop", s.token_id
        # Stop strings are the frontend's (it detokenizes anyway, incrementally, and cancels the call).
        if reason is None and (n_out >= p.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        out = RequestOutput(
            req.request_id,
            [s.token_id],
            finished=reason is not None,
            finish_reason=reason,
            stop_reason=stop_reason,
            logprobs=[s] if p.logprobs is not None else [],
            num_prompt_tokens=len(req.prompt_ids),
            num_cached_tokens=req.num_cached_tokens,
        )
        if reason is not None:
            self._matchers.pop(req.request_id, None)
            self.scheduler.finish(req, reason, stop_reason)
            if not req.hold_kv:
                del self.requests[req.request_id]
        return out

    def _h2d(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A host list as a tensor on the engine's device (device.host_to_device)."""
        return host_to_device(values, dtype, self.device)

    @torch.inference_mode()
    def _execute(self, decision: SchedulerOutput) -> dict[str, Sampled]:
        """The runner: one forward pass over every chunk of the step, then sampling where chunks end a sequence.

        Metadata is built on the host and copied to the device once per tensor; a step of single-token decodes
        only replays a captured CUDA graph when one fits (cuda_graphs.py)."""
        bs = self.kv.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        triton = self.attention_backend == "triton"
        varlen: list[PrefillChunk] = []  # triton: chunks attended in one launch per layer
        for chunk in decision.chunks:
            req = self.requests[chunk.request_id]
            row = len(tokens)
            a, b = chunk.start, chunk.start + chunk.num_tokens
            tokens += req.all_ids[a:b]
            positions += range(a, b)
            slots += [req.block_ids[p // bs] * bs + p % bs for p in range(a, b)]
            table = req.block_ids[: -(-b // bs)]
            if chunk.num_tokens == 1 and a > 0:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(b)
            elif a == 0 and (not triton or chunk.num_tokens >= SDPA_FRESH_MIN_TOKENS):
                prefills.append(PrefillSegment(row, row + chunk.num_tokens))
            elif triton:  # the varlen kernel reads the blocks in place (its K/V are written first)
                varlen.append(PrefillChunk(row, chunk.num_tokens, a, table))
            else:
                ids = self._h2d(table)
                qpos = torch.arange(a, b, device=self.device)
                prefills.append(PrefillSegment(row, row + chunk.num_tokens, self.kv.gather_index(ids), qpos))
            if chunk.samples:
                sample_rows.append(row + chunk.num_tokens - 1)
                sample_reqs.append(req)
        nb = max((len(t) for t in decode_tables), default=0)
        padded_tables = [t + [t[0]] * (nb - len(t)) for t in decode_tables]  # padding: any valid block id
        logits: torch.Tensor | None = None
        if self.graphs is not None and not prefills and not varlen and self.graphs.fits(len(tokens), nb):
            logits = self.graphs.run(tokens, positions, slots, padded_tables, decode_lens)
            if len(sample_rows) != len(tokens):  # a prompt's one-token chunk before its end: a row, no sample
                logits = logits[self._h2d(sample_rows)] if sample_rows else None
        else:
            meta = AttnMetadata(slot_mapping=self._h2d(slots), prefills=prefills)
            if varlen:
                meta.varlen = plan_prefill(varlen, self.dtype, bs, self.device)
            if decode_rows:
                meta.decode_rows = self._h2d(decode_rows)
                meta.decode_tables = self._h2d([x for t in padded_tables for x in t], torch.int32).view(
                    -1, nb
                )
                meta.decode_lens = self._h2d(decode_lens, torch.int32)
            hidden = self.model(self._h2d(tokens), self._h2d(positions), meta, self.kv)
            if sample_rows:
                picked = hidden if len(sample_rows) == hidden.shape[0] else hidden[self._h2d(sample_rows)]
                logits = self.model.logits(picked)
        if logits is None:
            return {}
        picks = sample_batch(
            logits,
            [r.params for r in sample_reqs],
            [len(r.output_ids) for r in sample_reqs],
            [self._row_context(r) for r in sample_reqs],
        )
        if self._nonfinite is not None:  # read after sampling's own copy to the host: no extra wait
            from services.engine.nvfp4.blackwell import raise_if_nonfinite

            raise_if_nonfinite(self.device)
        return {r.request_id: s for r, s in zip(sample_reqs, picks, strict=True)}

    def _row_context(self, req: Request) -> RowContext:
        """What the request's processors read: its tokens, and end-of-sequence held back until min_tokens."""
        p = req.params
        forced = min(len(p.forced_token_ids), len(req.output_ids))  # echo's forced tokens are the prompt's
        prompt, output = req.prompt_ids + req.output_ids[:forced], req.output_ids[forced:]
        banned: list[int] = []
        if len(output) < p.min_tokens:
            banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self._eos_ids))
        matcher = self._matchers.get(req.request_id)
        mask = matcher.bitmask() if matcher else None
        if banned and mask is not None:
            allowed = unpack_bitmask(mask, self.model_config.vocab_size).nonzero().flatten().tolist()
            if set(allowed) <= set(banned):
                # the grammar is complete and may only end: min_tokens cannot make it longer, and banning the end
                # left no token at all (greedy took token 0, a draw the last one). The grammar wins.
                banned = []
        return RowContext(prompt, output, banned, mask)

    # ------------------------------------------------------------------------------------------ helpers
    def generate(
        self, prompts: Iterable[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion with continuous batching; returns the generated token ids per prompt."""
        prompts = list(prompts)
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {i: [] for i in ids}
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        while any(rid in self.requests for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id] += out.new_token_ids
            failed = [e for rid, e in self._failures if rid in results]
            if failed:
                raise failed[0]
        return [results[i] for i in ids]

    def drain_kv_events(self) -> list[KvEvent]:
        return self.blocks.drain_events()

    def stats(self) -> EngineStats:
        return EngineStats(
            waiting=len(self.scheduler.waiting) + len(self.scheduler.restoring),
            running=len(self.scheduler.running),
            free_blocks=self.blocks.num_free,
            total_blocks=self.blocks.num_blocks,
            cached_blocks=self.blocks.num_cached,
            kv_usage=self.blocks.usage,
            prefix_hits_tokens=self._prefix_hits,
            prefix_query_tokens=self._prefix_queries,
            preemptions=self._preemptions,
            step_s=self._step_s,
            batch_size=self._last_batch,
            block_bytes=self.kv.block_bytes,
            tier2=self.tier2.stats() if self.tier2 is not None else None,
            disk=self.disk.stats() if self.disk is not None else None,
            weight_bytes=self.weight_bytes,
            memory_plan=self.memory_plan,
        )

    # ------------------------------------------------------------------------------------------ KV export/import
    def export_kv(self, request_id: str, num_tokens: int | None = None) -> KvExport:
        """The KV of a live or held request's first num_tokens computed tokens (default: all computed), copied out
        here, on the engine's thread. A worker copies off the thread instead: begin_export, then
        ExportJob.copy_out elsewhere, then release_kv of the pin."""
        job = self._export_job(request_id, num_tokens)
        host, device = job.copy_out(keep_device=True, own_stream=False)
        return KvExport(job.layout, job.token_ids, host, device)

    def begin_export(self, pin_id: str, request_id: str, num_tokens: int | None = None) -> ExportJob:
        """Pin a live or held request's blocks under pin_id and return the job that copies them out, to run on
        another thread: the engine steps on meanwhile (a 32 k-token prompt's copy is hundreds of milliseconds
        that no other request would step in), and the pin keeps the blocks from being freed and reused — by a
        release of the request, its hold's expiry — before the copy has read them. release_kv(pin_id) once the
        job is done."""
        job = self._export_job(request_id, num_tokens)
        self._pin(pin_id, job.block_ids)
        return self._off_thread(job)

    def _off_thread(self, job: ExportJob) -> ExportJob:
        """On a GPU, the stream a copy off the engine thread runs on (one per engine: a stream per copy would
        strand freed memory in the allocator's per-stream pools) and the point of this thread's stream it must
        come after (the steps that wrote the blocks; not the ones queued later)."""
        if self.device.type == "cuda":
            if self._export_stream is None:
                self._export_stream = torch.cuda.Stream(self.device)
            job.stream, job.ready = self._export_stream, torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(self.device))
        return job

    def _export_job(self, request_id: str, num_tokens: int | None) -> ExportJob:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"no live or held request {request_id!r}")
        n = req.num_computed_tokens if num_tokens is None else num_tokens
        if n > req.num_computed_tokens or n <= 0:
            raise ValueError(
                f"request {request_id!r} has {req.num_computed_tokens} computed tokens, asked for {n}"
            )
        nblocks = -(-n // self.kv.block_size)
        return ExportJob(self.kv, self.kv_layout, list(req.block_ids[:nblocks]), req.all_ids[:n])

    def _pin(self, pin_id: str, block_ids: list[int]) -> None:
        if self.id_in_use(pin_id):
            raise ValueError(f"hold id {pin_id!r} is already in use on this worker")
        self.blocks.acquire(block_ids)
        self._prefix_holds[pin_id] = list(block_ids)

    def export_kv_blocks(self, request_id: str, num_tokens: int | None = None) -> torch.Tensor:
        """The blocks covering a live or held request's first num_tokens computed tokens, copied out on the
        engine's device: [n, layers, 2, kv_heads, block_size, head_dim] (the export order). A device-direct
        transfer (CUDA IPC) shares this tensor; export_kv stages it to host bytes."""
        job = self._export_job(request_id, num_tokens)
        return self.kv.read_blocks(self._h2d(job.block_ids))

    # ------------------------------------------------------------------------------------------ prefix pulls
    def hold_cached_prefix(
        self, hold_id: str, hashes: Sequence[int], parent: int | None = ROOT_HASH
    ) -> list[int]:
        """Pin, under hold_id, the longest run of cached blocks whose chained hashes are `hashes` from the first:
        each block's recorded parent is the hash before it (and the first one's is `parent`; None: a run that
        starts mid-prompt whose parent the asker did not name — its own hash already chains it). Returns the
        pinned block ids (maybe none; then nothing is held)."""
        if self.id_in_use(hold_id):
            raise ValueError(f"hold id {hold_id!r} is already in use on this worker")
        found: list[int] = []
        for h in hashes:
            bid = self.blocks.lookup_prefix([h])
            if not bid or (parent is not None and self.blocks.blocks[bid[0]].parent_hash != parent):
                break
            found.append(bid[0])
            parent = h
        if found:
            self.blocks.acquire(found)
            self._prefix_holds[hold_id] = found
        return found

    def export_prefix(
        self, hold_id: str, hashes: Sequence[int], parent: int | None = None
    ) -> PrefixExport | None:
        """Pin the longest cached run of `hashes` (hold_cached_prefix) and copy its blocks out, here on the
        engine's thread: staged host bytes, plus the device copy on a GPU. None (and no hold) when the pool has
        not even the first block. A worker copies off the thread: begin_prefix_export."""
        job = self.begin_prefix_export(hold_id, hashes, parent)
        if job is None:
            return None
        host, device = job.copy_out(keep_device=True, own_stream=False)
        return PrefixExport(job.block_ids, list(hashes[: len(job.block_ids)]), host, device)

    def begin_prefix_export(
        self, hold_id: str, hashes: Sequence[int], parent: int | None = None
    ) -> ExportJob | None:
        """Pin the longest cached run of `hashes` under hold_id and return the job that copies it out on another
        thread (the hold keeps the blocks until release_kv(hold_id); take a second pin for the copy itself if
        the hold can be released meanwhile, as begin_export does). None (and no hold) when nothing is cached."""
        ids = self.hold_cached_prefix(hold_id, hashes, parent)
        if not ids:
            return None
        return self._off_thread(ExportJob(self.kv, self.kv_layout, ids, []))

    def pin_held(self, pin_id: str, hold_id: str) -> None:
        """A second pin on what hold_id pins, released by release_kv(pin_id): an off-thread copy's own."""
        self._pin(pin_id, self._prefix_holds[hold_id])

    def import_prefix(
        self,
        hold_id: str,
        hashes: Sequence[int],
        parent: int,
        data: bytes | bytearray | memoryview | torch.Tensor,
    ) -> int:
        """Write a peer's blocks (block-major, the export order; `hashes` their chained hashes, `parent` the
        first one's parent) into this pool and commit them as cached prefix blocks, pinned under hold_id (which
        may already pin this prompt's earlier blocks) until release_kv(hold_id). Blocks the pool already caches
        are kept, not overwritten. Returns how many blocks it committed. Here, on the engine's thread: a worker
        writes beside the step instead (begin_import_prefix, then finish_import_prefix)."""
        job = self.begin_import_prefix(hold_id, hashes, parent, data, beside=False)
        return self.finish_import_prefix(job)

    def begin_import_prefix(
        self,
        hold_id: str,
        hashes: Sequence[int],
        parent: int,
        data: bytes | bytearray | memoryview | torch.Tensor,
        beside: bool = True,
    ) -> PrefixImport:
        """import_prefix's first half: check the payload, pin the blocks already cached and take fresh ones for
        the rest under hold_id, and start writing the payload into them — on the restore thread (beside the
        engine's steps; on a GPU on the restore stream, after what this stream was asked before) unless
        `beside` is False. The fresh blocks are also pinned under the job's own id, so a release of the hold
        meanwhile cannot hand them to another request under the write. Then finish_import_prefix(job)."""
        n = len(hashes)
        size = data.numel() * data.element_size() if isinstance(data, torch.Tensor) else len(memoryview(data))
        if size != n * self.kv.block_bytes:
            raise KvMismatchError(
                f"prefix payload has {size} bytes, {n} blocks need {n * self.kv.block_bytes}"
            )
        self._check_payload_dtype(data)
        if not self.config.enable_prefix_caching:
            raise ValueError("this worker runs without a prefix cache: pulled blocks could never be hit")
        parents = [parent, *hashes[:-1]]
        have = [self.blocks.lookup_prefix([h]) for h in hashes]
        keep = [b[0] for b in have if b]
        missing = [i for i, b in enumerate(have) if not b]
        if keep:  # out of the free list first, so allocating the others cannot evict them
            self.blocks.acquire(keep)
        try:
            fresh = self.blocks.allocate(len(missing))
        except NoFreeBlocksError:
            self.blocks.release(keep)
            raise
        self._prefix_holds.setdefault(hold_id, []).extend(keep + fresh)
        job = PrefixImport(
            hold_id, f"{hold_id}\x00write-{next(self._write_pins)}", fresh, missing, hashes, parents
        )
        if not missing:
            job.written.set_result(None)
            return job
        self._pin(job.pin_id, fresh)
        if not beside:
            self._write_prefix(job, data, n)
            job.written.set_result(None)
            return job
        job.written = self._beside(self._on_restore_stream, lambda: self._write_prefix(job, data, n))
        return job

    def _write_prefix(
        self, job: PrefixImport, data: bytes | bytearray | memoryview | torch.Tensor, n: int
    ) -> None:
        only = job.missing if len(job.missing) < n else None
        self._write_payload(job.fresh, data, n, only)

    def finish_import_prefix(self, job: PrefixImport) -> int:
        """import_prefix's second half, once job.written is done: commit the written blocks under their hashes
        (cached prefix blocks from now on, even if the hold was released meanwhile: their bytes are whole) and
        drop the write's pin. A block whose hash was cached meanwhile by another block (an overlapping pull
        finished first, or a local prefill computed it) is not committed: the hold, if still there, pins that
        block instead, and the written copy goes back to the free blocks. A write that failed commits nothing
        and raises its error. Returns how many blocks were committed."""
        committed = 0
        try:
            job.written.result()  # raises the write's error
            held = self._prefix_holds.get(job.hold_id)
            for b, i in zip(job.fresh, job.missing, strict=True):
                other = self.blocks.lookup_prefix([job.hashes[i]])
                if other and other[0] != b:
                    if held is not None and b in held:
                        self.blocks.acquire(other)
                        held[held.index(b)] = other[0]
                        self.blocks.release([b])
                    continue
                self.blocks.commit(b, job.hashes[i], job.parents[i])
                committed += 1
        finally:
            self.release_kv(job.pin_id)
        return committed

    def _import_into(self, req: Request, kv: KvExport) -> None:
        self.kv_layout.check_compatible(kv.layout, same_device=isinstance(kv.data, torch.Tensor))
        n = len(kv.token_ids)
        if req.all_ids[:n] != kv.token_ids:
            raise KvMismatchError("KV payload covers different tokens than the request's prompt and output")
        if n >= req.num_tokens + 1 or n == 0:
            raise KvMismatchError(f"KV payload covers {n} tokens; the request has {req.num_tokens}")
        nblocks = kv.num_blocks
        size = kv.nbytes
        if size != nblocks * self.kv.block_bytes:
            raise KvMismatchError(
                f"KV payload has {size} bytes, {nblocks} blocks need {nblocks * self.kv.block_bytes}"
            )
        self._check_payload_dtype(kv.data)
        if n == req.num_tokens:
            # a step must compute at least the last token to produce logits: keep all but that token
            n -= 1
        if nblocks > self.blocks.num_blocks:  # could never be admitted: refuse rather than wait forever
            raise NoFreeBlocksError(
                f"cannot import KV for {req.request_id!r}: {nblocks} blocks, the whole cache has "
                f"{self.blocks.num_blocks}"
            )
        # The blocks are allocated when the scheduler admits the request, not now: a full pool is a wait in the
        # queue (the bytes wait here), never a failure.
        req.import_tokens, req.import_blocks = n, nblocks
        data = kv.data
        if isinstance(data, torch.Tensor) and data.is_cuda and nblocks > self.blocks.num_free:
            # a device-direct payload that must wait for blocks would wait in GPU memory outside the cache's plan
            # (and the frontend admits more KV in flight than the pool holds): it waits in host memory instead
            data = data.cpu()
        self._pending_kv[req.request_id] = data

    def _tier(self, g: RestoreGroup) -> HostKvTier | DiskKvTier:
        tier = self.disk if g.tier == "disk" else self.tier2
        assert tier is not None
        return tier

    def _write_restored(self, g: RestoreGroup) -> None:
        """The scheduler restored blocks from tier 2 or disk into fresh primary blocks for a request in this step:
        decode and write their K/V before it runs (the disk tier's files were read at admission, when the lookup
        checked them)."""
        # this stream only: a write beside the steps on the restore stream (an import) is not this restore's time
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:
            stream.synchronize()
        t0 = time.perf_counter()
        self._write_group(g)
        if stream is not None:
            stream.synchronize()  # the restore's own time, not whatever the stream ran before
        self._tier(g).observe_restore(len(g.block_ids), time.perf_counter() - t0)

    def _write_group(self, g: RestoreGroup) -> None:
        """Decode a group's tier entries and write them into its pool blocks (on the current stream)."""
        self.kv.write_blocks(self._h2d(g.block_ids), decode_entries(g.entries, self.dtype, self.device))

    def _restore_job(self, groups: list[RestoreGroup]) -> list[float]:
        """On the restore thread, beside the step: decode and write each group's blocks (on CUDA on a side stream,
        waited for here, so the blocks are in place once the job is done). Their seconds, one per group."""
        stream = self._restore_stream
        times = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for g in groups:
                t0 = time.perf_counter()
                try:
                    self._write_group(g)
                finally:  # failed or not, nothing of it is left queued when its blocks are released
                    if stream is not None:
                        stream.synchronize()
                times.append(time.perf_counter() - t0)
        return times

    def _collect_restores(self, only: str | None = None) -> None:
        """Finished restores (or, with `only`, that one, waited for): their blocks join the prefix cache and their
        requests run from the next step. Timed on this, the engine's, thread."""
        for request_id, (future, groups) in list(self._restore_jobs.items()):
            if (only is not None and request_id != only) or (only is None and not future.done()):
                continue
            try:
                times = future.result()
            except Exception as e:  # noqa: BLE001 - that request's failure, not the engine's
                del self._restore_jobs[request_id]
                self._fail_write(request_id, e)
                continue
            del self._restore_jobs[request_id]
            for g, dt in zip(groups, times, strict=True):
                self._tier(g).observe_restore(len(g.block_ids), dt, overlapped=True)
            self.scheduler.complete_restore(request_id)

    def _fail_write(self, request_id: str, cause: Exception) -> None:
        """A write beside the step failed (its stream was synchronized: nothing of it is still queued): the
        request ends with a KvWriteError and its blocks go back uncached."""
        log.error("request %s: writing its KV beside the step failed: %s", request_id, cause)
        self.scheduler.fail_restore(request_id)
        self._matchers.pop(request_id, None)
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, "abort")
            if req.hold_kv:
                self.scheduler.release_kv(req)
        err = KvWriteError(
            f"writing the KV of request {request_id!r} failed: {type(cause).__name__}: {cause}"
        )
        err.__cause__ = cause
        self._failures.append((request_id, err))

    def take_failures(self) -> list[tuple[str, KvWriteError]]:
        """Requests ended since the last call because their KV could not be written (each with its error): a
        server fails their streams with it."""
        out, self._failures = self._failures, []
        return out

    def _write_imported(self, request_id: str) -> None:
        """The scheduler just gave an importing request its blocks: copy the KV it brought into them."""
        data, ids, nblocks = self._imported_payload(request_id)
        self._write_payload(ids, data, nblocks)

    def _imported_payload(self, request_id: str) -> tuple[bytes | memoryview | torch.Tensor, list[int], int]:
        """An admitted request's imported KV, the blocks it goes to and how many."""
        data = self._pending_kv.pop(request_id)
        size = data.numel() * data.element_size() if isinstance(data, torch.Tensor) else len(data)
        nblocks = size // self.kv.block_bytes
        return data, list(self.requests[request_id].block_ids[:nblocks]), nblocks

    def _import_job(
        self, ids: list[int], data: bytes | memoryview | torch.Tensor, nblocks: int
    ) -> list[float]:
        """On the restore thread, beside the step: write an imported payload into its fresh blocks. No tier
        groups to time: []."""
        self._on_restore_stream(lambda: self._write_payload(ids, data, nblocks))
        return []

    def _beside(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run fn(*args) on the restore thread, beside the engine's steps (a tier restore, an import, a pulled
        prefix). On a GPU the restore stream first waits for what this thread's stream was asked to do so far
        (with those blocks too)."""
        if self._restorer is None:
            # the engine's GPU is the thread's current device: a stream context entered on a fresh thread would
            # otherwise touch device 0 (and create a CUDA context there) on an engine that runs on cuda:N
            device = self.device
            self._restorer = concurrent.futures.ThreadPoolExecutor(
                1,
                thread_name_prefix="kv-restore",
                initializer=(lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None,
            )
        if self._restore_stream is not None:
            self._restore_stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._restorer.submit(fn, *args)

    def _on_restore_stream(self, write: Callable[[], None]) -> None:
        """Run a write on the restore thread's stream (CUDA) and wait for it: its blocks are in place on return."""
        stream = self._restore_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                write()
            finally:  # failed or not, nothing of it is left queued when its blocks are released
                if stream is not None:
                    stream.synchronize()

    def _check_payload_dtype(self, data: bytes | bytearray | memoryview | torch.Tensor) -> None:
        """A tensor payload holds blocks in the cache's dtype or their raw bytes (uint8); host bytes are raw."""
        if isinstance(data, torch.Tensor) and data.dtype not in (torch.uint8, self.kv.dtype):
            raise KvMismatchError(f"KV blocks are {data.dtype}, this engine's cache is {self.kv.dtype}")

    def _write_payload(
        self,
        ids: list[int],
        data: bytes | bytearray | memoryview | torch.Tensor,
        nblocks: int,
        only: list[int] | None = None,
    ) -> None:
        """Write a KV payload of `nblocks` blocks (export order), or just the blocks `only` names, into the pool
        blocks `ids` (on the current stream). A device tensor (device-direct: CUDA IPC, NIXL VRAM) is read where
        it lies, in the cache's dtype or as its raw bytes (uint8; its dtype was checked at admission:
        `_check_payload_dtype`); host bytes (staged) are read in place on a CPU and, into a GPU's cache, go up
        STAGE_CHUNK_BYTES at a time through pinned memory, so an import takes a chunk of device and pinned
        memory outside the cache's plan, not its whole size."""
        shape = (nblocks, *self.kv.data.shape[:3], self.kv.block_size, self.kv.data.shape[-1])
        if isinstance(data, torch.Tensor):
            if data.dtype != self.kv.dtype:  # its raw bytes
                data = data.reshape(-1).view(self.kv.dtype)
            src = (data if data.device.type == "cpu" else data.to(self.device)).view(shape)
        else:  # host bytes, read in place (only read: copied into the cache or uploaded)
            src = view_of(data, torch.uint8).view(self.kv.dtype).view(shape)
        if src.is_cuda:  # device-direct: on this engine's GPU now
            part = src if only is None else src[torch.tensor(only, device=src.device)]
            self.kv.write_blocks(self._h2d(ids), part)
            return
        rows = list(range(nblocks)) if only is None else only
        per = max(1, STAGE_CHUNK_BYTES // self.kv.block_bytes)
        for lo in range(0, len(rows), per):
            chunk = rows[lo : lo + per]
            run = chunk == list(range(chunk[0], chunk[0] + len(chunk)))
            host = src[chunk[0] : chunk[0] + len(chunk)] if run else src[torch.tensor(chunk)]
            self.kv.write_blocks(self._h2d(ids[lo : lo + per]), host_tensor_to_device(host, self.device))


# a GPU's KV goes to the host (an export's staging) and comes from it (an import's upload) this much at a time
STAGE_CHUNK_BYTES = 64 << 20


def staged_bytes(blocks: torch.Tensor) -> memoryview:
    """Freshly copied-out blocks (read_blocks) as host bytes for the byte transports: on a CPU the tensor's own
    memory (no copy: nothing else holds it); from a GPU, on the current stream, STAGE_CHUNK_BYTES at a time
    (device_to_host). The view keeps the memory alive."""
    flat = blocks.reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = device_to_host(flat.split(STAGE_CHUNK_BYTES), flat.numel(), flat.device, STAGE_CHUNK_BYTES)
    return bytes_of(flat)


def device_to_host(
    parts: Iterable[torch.Tensor], total: int, device: torch.device, chunk_bytes: int
) -> torch.Tensor:
    """Flat uint8 device tensors (each at most chunk_bytes, made on the current stream), in order, into one
    pageable host buffer of `total` bytes, through two pinned bounce buffers: the copy engine fills pinned
    memory at full speed (pageable memory it stages in pieces, synchronously) while the chunk before is copied
    on into the buffer. The pinned memory taken, and kept by torch's host cache, is two chunks, not the whole
    export rounded up to a power of two for as long as its publication lives. Returns when every byte is in
    the buffer."""
    host = torch.empty(total, dtype=torch.uint8)
    stream = torch.cuda.current_stream(device)
    size = min(chunk_bytes, total)
    with torch.cuda.device(device):  # the pinned buffers' context is this GPU's, on any thread
        bounce = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    offset = 0
    pending: tuple[Any, torch.Tensor, int] | None = None  # (its copy's event, the bounce slice, host offset)

    def land(p: tuple[Any, torch.Tensor, int]) -> None:
        done, buf, at = p
        done.synchronize()
        host[at : at + buf.numel()].copy_(buf)

    for k, part in enumerate(parts):
        n = part.numel()
        if n > size:
            raise ValueError(f"a {n}-byte part is larger than the {size}-byte bounce buffer")
        buf = bounce[k % 2][:n]  # used two parts ago, landed one part ago: free again
        buf.copy_(part, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        if pending is not None:
            land(pending)  # the part before, while this one's copy runs
        pending, offset = (done, buf, offset), offset + n
    if pending is not None:
        land(pending)
    if offset != total:
        raise ValueError(f"{offset} bytes copied to the host, {total} expected")
    return host


@dataclass
class ExportJob:
    """Blocks of the cache to copy out (begin_export / begin_prefix_export), in the export order. copy_out may
    run on any thread while the engine steps: the blocks are pinned, so nothing writes them, and on a GPU its
    copies run on a stream of their own that waits for the steps queued before it (those that wrote them)."""

    kv: PagedKvCache
    layout: KvLayout
    block_ids: list[int]
    token_ids: list[int]
    stream: Any = None  # GPU: the engine's export stream, and the event on the engine's stream to wait for
    ready: Any = None

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * self.kv.block_bytes

    def copy_out(self, keep_device: bool, own_stream: bool = True) -> tuple[memoryview, torch.Tensor | None]:
        """The blocks as host bytes, and on a GPU with keep_device the whole device copy they came through (for
        device-direct readers in other processes: cuda_ipc, NIXL VRAM; None where the device has no memory for
        it now). Without keep_device a GPU's blocks are gathered and go to the host STAGE_CHUNK_BYTES at a time
        (device_to_host), so the copy never takes more device or pinned memory than that. A job from
        begin_export copies on the engine's export stream, after the steps queued before the pin;
        own_stream=False copies on the current stream instead:
        for a device copy that this process's current stream will read (the allocator would otherwise hand its
        memory to the export stream's next allocation while that stream's reads are still queued)."""
        kv = self.kv
        if kv.device.type == "cpu":
            return staged_bytes(kv.read_blocks(torch.tensor(self.block_ids, dtype=torch.long))), None
        # the export stream, after the steps that wrote these blocks: the gather and the copy to the host then
        # overlap the engine's next steps instead of queuing ahead of them
        stream = torch.cuda.current_stream(kv.device)
        if own_stream and self.stream is not None:
            stream = self.stream
            stream.wait_event(self.ready)
        with torch.cuda.device(kv.device), torch.cuda.stream(stream):
            ids = torch.tensor(self.block_ids, dtype=torch.long, device=kv.device)
            if keep_device:
                try:
                    data = kv.read_blocks(ids)
                except torch.cuda.OutOfMemoryError:  # no room on the device now: the host bytes alone
                    data = None
                if data is not None:
                    return staged_bytes(data), data
            per = max(1, STAGE_CHUNK_BYTES // kv.block_bytes)
            parts = (
                kv.read_blocks(ids[i : i + per]).reshape(-1).view(torch.uint8)
                for i in range(0, len(self.block_ids), per)
            )
            host = device_to_host(parts, self.nbytes, kv.device, per * kv.block_bytes)
            return bytes_of(host), None


def _attention_backend(wanted: str, device: torch.device, head_dim: int, block_size: int) -> str:
    """auto: the Triton paged kernel on CUDA (where Triton imports and takes the model's head_dim and the cache's
    block size), torch ops elsewhere. "triton" on a CPU runs Triton's interpreter (TRITON_INTERPRET=1) — for
    tests, far too slow to serve; asked for with a shape it cannot take, it is a start-up error naming it."""
    if wanted == "torch" or (wanted == "auto" and device.type != "cuda"):
        return "torch"
    import services.engine.triton_attention as triton_attention

    why = triton_attention.unsupported_shape(head_dim, block_size)
    if why:
        if wanted == "triton":
            raise ValueError(f"attention backend 'triton' cannot serve this model: {why}")
        log.warning(
            "the Triton attention kernels cannot serve this model (%s): attention runs on torch ops", why
        )
        return "torch"

    if not triton_attention.available():
        if wanted == "triton":
            raise RuntimeError(
                "attention backend 'triton' was asked for, but Triton cannot run here "
                "(not installed, or no CUDA device and TRITON_INTERPRET is not set)"
            )
        log.warning("Triton is unavailable on %s: decode attention runs on torch ops (gather + SDPA)", device)
        return "torch"
    return "triton"


def _weight_bytes(model: torch.nn.Module) -> int:
    from services.engine.nvfp4 import weight_memory_bytes

    return weight_memory_bytes(model)


def _load_tokenizer(loaded: LoadedModel) -> object | None:
    from services.engine.tokenizer import Tokenizer

    if loaded.source_format == "memory":  # built in code (tests, tools): no tokenizer files exist
        return None
    if loaded.source_format == "gguf":
        return Tokenizer.from_gguf(loaded.source)
    return Tokenizer.from_hf_dir(loaded.source)


__all__ = [
    "EngineConfig",
    "KvExport",
    "KvLayout",
    "KvMismatchError",
    "LLMEngine",
    "PrefixExport",
    "PromptTooLongError",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
]

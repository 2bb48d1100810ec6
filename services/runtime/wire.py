"""Translation between the wire (rackserve.v1 messages) and the engine's own types, in one place.

proto3 cannot tell an unset number from zero, so the defaults that matter are decided here: `top_p` 0 means
"off" (1.0), `repetition_penalty` 0 means "off" (1.0), `logprobs` < 0 means none. Everything else passes
through and the engine validates it.

This room must never do I/O or hold state.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.engine.config import SUPPORTED_DTYPES, torch_dtype
from services.engine.engine import KvLayout, KvMismatchError, RequestOutput
from services.engine.kv_cache import KvEvent
from services.engine.sampling import SamplingParams
from services.rpc import pb
from services.runtime.async_engine import LoadStats

KV_DTYPES = {"bfloat16": pb.KV_DTYPE_BF16, "float32": pb.KV_DTYPE_FP32}
KV_DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32"}  # WorkerInfo.kv_dtype, as docs/design.md spells them
KV_DTYPE_BYTES = {name: torch_dtype(name).itemsize for name in SUPPORTED_DTYPES}


def kv_bytes_per_token(layout: KvLayout) -> int:
    """WorkerInfo.kv_bytes_per_token: K and V of every layer for one token, as the cache holds them."""
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * KV_DTYPE_BYTES[layout.dtype]


def sampling_params(p: pb.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams; a ValueError names the offending field."""
    try:
        return SamplingParams(
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p or 1.0,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=p.seed,
            stop_token_ids=tuple(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            min_tokens=p.min_tokens,
            logprobs=None if p.logprobs < 0 else p.logprobs,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty or 1.0,
            logit_bias=tuple(sorted(p.logit_bias.items())),
            forced_token_ids=tuple(p.forced_token_ids),
            structured_kind=p.structured_kind,
            structured_spec=p.structured_spec,
        )
    except ValueError as e:
        raise ValueError(f"invalid params: {e}") from e


def tokens(out: RequestOutput, first_index: int) -> list[pb.Token]:
    """The output's new tokens, numbered from first_index (their position in the whole output)."""
    msgs = []
    for i, token_id in enumerate(out.new_token_ids):
        t = pb.Token(token_id=token_id, index=first_index + i)
        sampled = out.logprobs[i] if i < len(out.logprobs) else None
        if sampled is not None and sampled.logprob is not None:
            t.has_logprob = True
            t.logprob = sampled.logprob
            for tid, lp in sampled.top_logprobs or ():
                t.top_logprobs.add(token_id=tid, logprob=lp)
        msgs.append(t)
    return msgs


def stop_reason(out: RequestOutput) -> str:
    return "" if out.stop_reason is None else str(out.stop_reason)


def kv_handle(
    layout: KvLayout,
    request_id: str,
    block_ids: list[int],
    num_tokens: int,
    producer_worker_id: str,
    producer_epoch: int,
    expires_unix_ms: int,
) -> pb.KvHandle:
    return pb.KvHandle(
        request_id=request_id,
        producer_worker_id=producer_worker_id,
        producer_epoch=producer_epoch,
        block_ids=block_ids,
        num_tokens=num_tokens,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=KV_DTYPES[layout.dtype],
        layout=layout.layout,
        model_fingerprint=layout.model_fingerprint,
        expires_unix_ms=expires_unix_ms,
    )


def check_kv_handle(layout: KvLayout, kv: pb.KvHandle, num_prompt_tokens: int) -> None:
    """Refuse a handle this engine cannot read as is: KvMismatchError (INVALID_ARGUMENT) naming the field.
    The payload is checked again on import; this check runs before any byte moves."""
    theirs = {
        "model_fingerprint": kv.model_fingerprint,
        "dtype": pb.KvDtype.Name(kv.dtype),
        "layout": kv.layout,
        "block_size": kv.block_size,
        "num_layers": kv.num_layers,
        "num_kv_heads": kv.num_kv_heads,
        "head_dim": kv.head_dim,
    }
    mine = {
        "model_fingerprint": layout.model_fingerprint,
        "dtype": pb.KvDtype.Name(KV_DTYPES[layout.dtype]),
        "layout": layout.layout,
        "block_size": layout.block_size,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
    }
    for name, value in theirs.items():
        if value != mine[name]:
            raise KvMismatchError(
                f"KvHandle.{name} mismatch: this worker has {mine[name]!r}, the handle has {value!r}"
            )
    if not 0 < kv.num_tokens <= num_prompt_tokens:
        raise KvMismatchError(
            f"KvHandle.num_tokens is {kv.num_tokens}; it must cover 1..{num_prompt_tokens} prompt tokens"
        )
    if len(kv.block_ids) != -(-kv.num_tokens // kv.block_size):
        raise KvMismatchError(
            f"KvHandle.block_ids has {len(kv.block_ids)} blocks; {kv.num_tokens} tokens of "
            f"{kv.block_size} per block need {-(-kv.num_tokens // kv.block_size)}"
        )
    if not kv.transfer_endpoint:
        raise KvMismatchError("KvHandle.transfer_endpoint is empty: the producer published nothing to pull")


def load_snapshot(s: LoadStats) -> pb.LoadSnapshot:
    return pb.LoadSnapshot(
        waiting=s.waiting,
        running=s.running,
        queued_prefill_tokens=s.queued_prefill_tokens,
        active_decode_blocks=s.active_decode_blocks,
        free_blocks=s.free_blocks,
        total_blocks=s.total_blocks,
        step_s=s.step_s,
        kv_usage=s.kv_usage,
    )


_KV_EVENT_KINDS = {
    "stored": pb.KvBlockEvent.STORED,
    "evicted": pb.KvBlockEvent.EVICTED,
    "offloaded": pb.KvBlockEvent.OFFLOADED,
    "restored": pb.KvBlockEvent.RESTORED,
    "dropped": pb.KvBlockEvent.DROPPED,
}


_KV_TIERS = {"host": pb.KvBlockEvent.HOST, "disk": pb.KvBlockEvent.DISK}


def kv_block_events(events: list[KvEvent]) -> Iterator[pb.KvBlockEvent]:
    """Consecutive events of one kind (and tier) in one message; stored blocks only while they chain parent to
    child. `tier` is set on offloaded / restored / dropped; stored and evicted always concern the pool."""
    kind: tuple[str, str] | None = None
    msg: pb.KvBlockEvent | None = None
    for ev in events:
        chained = (
            msg is not None
            and (ev.kind, ev.tier) == kind
            and (ev.kind != "stored" or ev.parent_hash == msg.block_hashes[-1])
        )
        if not chained:
            if msg is not None:
                yield msg
            kind = (ev.kind, ev.tier)
            msg = pb.KvBlockEvent(kind=_KV_EVENT_KINDS[ev.kind], parent_hash=ev.parent_hash)
            if ev.kind in ("offloaded", "restored", "dropped"):
                msg.tier = _KV_TIERS[ev.tier]
        assert msg is not None
        msg.block_hashes.append(ev.block_hash)
    if msg is not None:
        yield msg

"""PrefixPuller's checks on what a peer exports, before any byte moves (no processes: a fake sink)."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from services.engine.engine import KvLayout
from services.kvtransfer.ticket import TransferTicket
from services.rpc import pb
from services.runtime import wire
from services.runtime.prefix_pull import PrefixPuller, PullFailed

LAYOUT = KvLayout("fp-1", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


class RecordingSink:
    def __init__(self) -> None:
        self.pulled: list[TransferTicket] = []

    def choose(self, ticket: TransferTicket, preference: Any) -> str:
        return "tcp"

    async def pull(self, ticket: TransferTicket, deadline_s: float, **kwargs: Any) -> object:
        self.pulled.append(ticket)
        return types.SimpleNamespace(data=b"\0" * ticket.raw_size)


@pytest.mark.parametrize("encoding", ["fp8", "nvfp4"])
def test_an_encoded_export_from_a_peer_is_refused_before_it_is_pulled(encoding: str) -> None:
    """A peer of an older release encodes its exports with its --kv-compress (lossy); committed here under the
    exact blocks' hashes, those bytes would change every later answer that hits them. The puller refuses such an
    export (fallback_layout: the request recomputes) and moves none of its bytes."""
    sink = RecordingSink()
    engine = types.SimpleNamespace(engine=types.SimpleNamespace(kv_layout=LAYOUT), device="cpu")
    puller = PrefixPuller(engine, sink, None, "prefill", ["tcp"])  # type: ignore[arg-type]
    matched = 2
    raw = matched * LAYOUT.block_size * 1024
    handle = wire.kv_handle(LAYOUT, "r-pull", [0, 1], matched * LAYOUT.block_size, "prefill-b", 1, 0)

    def exported(enc: str) -> pb.ExportPrefixResponse:
        ticket = TransferTicket("r-pull", raw // 2, "", "127.0.0.1:1", {"tcp": "127.0.0.1:1"}, enc, raw)
        handle.transfer_endpoint = ticket.to_json()
        return pb.ExportPrefixResponse(matched_blocks=matched, kv=handle)

    with pytest.raises(PullFailed, match=f"{encoding}-encoded") as failed:
        asyncio.run(puller._transfer(exported(encoding), 1.0))
    assert failed.value.cause == "layout" and sink.pulled == []
    # the exact bytes are pulled
    assert asyncio.run(puller._transfer(exported("raw"), 1.0))[0] == matched and len(sink.pulled) == 1

"""CUDA graphs of decode steps: at small batch a decode step is ~30 layers x a dozen kernels whose launch
overhead is the whole step, so each batch-size bucket's forward (embedding to logits) is captured once after
warm-up and replayed with new inputs.

A graph reads fixed device buffers: token ids, positions, KV slots, block tables (as wide as the longest context
allows) and context lengths. A step of n sequences runs the smallest bucket b >= n; rows n..b-1 are padding that
decodes a dummy token whose K/V goes to the cache's scratch block (PagedKvCache.scratch_block), never to a block
the BlockManager hands out, and whose logits are dropped. Only decode-only steps use graphs; a step with prefill
work runs eagerly. Everything in the captured forward must stay free of host synchronisation — the Triton
paged-attention kernel, the projections (cuBLAS or the Triton W4A16 GEMM), rotary, the KV write and the norms are.
"""

from __future__ import annotations

import torch

from services.engine.config import ModelConfig
from services.engine.model import AttnMetadata, PagedKvCache, Transformer

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def buckets_for(max_batch: int) -> list[int]:
    """The batch sizes captured: every bucket below max_batch, then max_batch itself."""
    return sorted({b for b in BUCKETS if b < max_batch} | {max_batch})


def graph_pool_bytes(config: ModelConfig, max_batch: int, element_size: int) -> int:
    """Device memory the decode graphs keep in their private pool, which the profiled peak of eager steps does not
    cover, so the KV plan sets it aside: the one logits output every graph writes (fp32), and the largest bucket's
    transient activations — its logits before that copy, the residual stream, attention and MLP activations —
    with room for the allocator's rounding. The smaller buckets reuse the largest one's memory."""
    big = buckets_for(max_batch)[-1]
    logits = big * config.vocab_size * 4
    width = 6 * config.hidden_size + 3 * config.intermediate_size + 2 * config.num_heads * config.head_dim
    return 2 * logits + big * width * max(element_size, 4) + (64 << 20)


class DecodeGraphs:
    def __init__(self, model: Transformer, kv: PagedKvCache, max_model_len: int, max_batch: int) -> None:
        if kv.scratch_block is None:
            raise ValueError("CUDA-graph decode needs a KV cache with a scratch block for padded rows")
        self.model, self.kv = model, kv
        self.buckets = buckets_for(max_batch)
        self.max_blocks = -(-max_model_len // kv.block_size)
        dev, big = kv.device, self.buckets[-1]
        self._scratch = kv.scratch_block
        self.tokens = torch.zeros(big, dtype=torch.long, device=dev)
        self.positions = torch.zeros(big, dtype=torch.long, device=dev)
        self.slots = torch.full((big,), self._scratch * kv.block_size, dtype=torch.long, device=dev)
        self.tables = torch.full((big, self.max_blocks), self._scratch, dtype=torch.int32, device=dev)
        self.lens = torch.ones(big, dtype=torch.int32, device=dev)
        self.rows = torch.arange(big, device=dev)
        # the one output every graph copies its rows' logits into: one buffer, not one per bucket, so the pool
        # holds the largest bucket's transients once (a 128k vocabulary at 512 sequences: 0.25 GiB, not 1.3)
        self.logits = torch.empty(big, model.config.vocab_size, dtype=torch.float32, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    def fits(self, num_seqs: int, num_blocks: int) -> bool:
        return 0 < num_seqs <= self.buckets[-1] and num_blocks <= self.max_blocks

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttnMetadata(
            slot_mapping=self.slots[:b],
            decode_rows=self.rows[:b],
            decode_tables=self.tables[:b],
            decode_lens=self.lens[:b],
        )
        return self.model.logits(self.model(self.tokens[:b], self.positions[:b], meta, self.kv))

    def _step(self, b: int) -> None:
        """What bucket b's graph holds: the forward of its rows, their logits into the shared output."""
        self.logits[:b].copy_(self._forward(b))

    @torch.inference_mode()
    def _capture(self) -> None:
        # warm-up on a side stream first: Triton compiles and autotunes, cuBLAS picks its algorithms, outside capture
        side = torch.cuda.Stream(self.kv.device)
        side.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(side):
            for b in self.buckets:
                self._step(b)
        torch.cuda.current_stream(self.kv.device).wait_stream(side)
        torch.cuda.synchronize(self.kv.device)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first, so the smaller graphs reuse its memory pool
            g = torch.cuda.CUDAGraph()
            # thread_local: a CUDA call another thread of the process makes meanwhile (a NIXL/UCX progress thread,
            # started before the engine on a worker) is not an error of this capture, as it is in "global" mode
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                self._step(b)
            self._graphs[b] = g
        torch.cuda.synchronize(self.kv.device)

    @torch.inference_mode()
    def run(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        lens: list[int],
    ) -> torch.Tensor:
        """Logits [n, vocab] (float32) of one decode-only step of n sequences; tables are padded to one width."""
        n = len(tokens)
        b = next(x for x in self.buckets if x >= n)
        nb = len(tables[0])
        host = torch.empty(4 * n + n * nb, dtype=torch.long, pin_memory=self.kv.device.type == "cuda")
        host[:n] = torch.tensor(tokens)
        host[n : 2 * n] = torch.tensor(positions)
        host[2 * n : 3 * n] = torch.tensor(slots)
        host[3 * n : 4 * n] = torch.tensor(lens)
        host[4 * n :] = torch.tensor(tables).view(-1)
        dev = host.to(self.kv.device, non_blocking=True)  # one upload for the whole step's metadata
        self.tokens[:n].copy_(dev[:n])
        self.positions[:n].copy_(dev[n : 2 * n])
        self.slots[:n].copy_(dev[2 * n : 3 * n])
        self.lens[:n].copy_(dev[3 * n : 4 * n])
        self.tables[:b].fill_(self._scratch)
        self.tables[:n, :nb].copy_(dev[4 * n :].view(n, nb))
        if b > n:  # padding rows: a dummy token at position 0 of the scratch block
            self.tokens[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self._scratch * self.kv.block_size)
            self.lens[n:b].fill_(1)
        self._graphs[b].replay()
        return self.logits[:n]  # read before the next replay overwrites it (the sampler copies what it keeps)

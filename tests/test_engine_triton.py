"""The engine with decode attention on the Triton paged kernel gives the tokens of the torch path.

This is the GPU worker's attention backend (`--attention-backend triton`, the default on CUDA) driven through the
real engine — scheduler, block tables over scattered blocks, chunked prefill mixed with decodes, prefix-cache hits,
a mid-run KV import — on Triton's CPU interpreter. TRITON_INTERPRET must be set before triton is imported and
other test modules import triton for real, so the engines run in a child process (this file as a script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]


def _child() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(REPO))
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.sampling import SamplingParams
    from tests.conftest import tiny_llama

    model = tiny_llama(seed=3, layers=2)
    shared = list(range(7, 39))  # two whole blocks every prompt but the last shares: prefix-cache hits
    prompts = [shared + [1, 2, 3], shared + list(range(50, 71)), list(range(100, 105)), shared[:20]]
    params = [SamplingParams(max_tokens=12, temperature=0)] * 3 + [
        SamplingParams(max_tokens=12, temperature=0.8, seed=11)
    ]
    result = {}
    for backend in ("torch", "triton"):
        cfg = EngineConfig(
            dtype="float32",
            num_kv_blocks=48,
            block_size=16,
            max_num_batched_tokens=32,  # the long prompts prefill in chunks, beside running decodes
            attention_backend=backend,
        )
        eng = LLMEngine(model, cfg)
        assert eng.attention_backend == backend
        # scatter the free list so block tables are not contiguous
        eng.blocks.allocate(5)
        outs = eng.generate(prompts, params)
        # continue a prompt from imported KV (the decode side of disaggregation)
        src = LLMEngine(model, cfg)
        src.add_request("p", prompts[1], SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
        while src.has_unfinished():
            src.step()
        eng.add_request("d", prompts[1], SamplingParams(max_tokens=8, temperature=0), kv=src.export_kv("p"))
        got: list[int] = []
        while eng.has_unfinished():
            for o in eng.step():
                got += o.new_token_ids
        result[backend] = {"generate": outs, "imported": got, "hits": eng.stats().prefix_hits_tokens}
    print(json.dumps(result))


def test_triton_decode_attention_in_the_engine_gives_the_torch_paths_tokens():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, __file__, "--child"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["triton"]["generate"] == res["torch"]["generate"]
    assert res["triton"]["imported"] == res["torch"]["imported"]
    assert all(len(t) == 12 for t in res["triton"]["generate"])
    assert res["triton"]["hits"] > 0  # the shared prefix was served from the cache, not recomputed


if __name__ == "__main__" and "--child" in sys.argv:
    _child()

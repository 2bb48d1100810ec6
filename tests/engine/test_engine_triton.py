"""The engine with decode attention on the Triton paged kernel gives the tokens of the torch path.

This is the GPU worker's attention backend (`--attention-backend triton`, the default on CUDA) driven through the
real engine — scheduler, block tables over scattered blocks, chunked prefill mixed with decodes, prefix-cache hits,
a mid-run KV import — on Triton's CPU interpreter. TRITON_INTERPRET must be set before triton is imported and
other test modules import triton for real, so the engines run in a child process (this file as a script).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.cluster  # starts a child interpreter under TRITON_INTERPRET

pytest.importorskip("triton")


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
    from services.engine.cuda_graphs import DecodeGraphs
    from services.engine.model import PagedKvCache

    class EagerGraphs(DecodeGraphs):
        """DecodeGraphs with each "graph" an eager call over the same static buffers: what the graph replays,
        minus CUDA. It pins the bucket choice, the padding rows and their scratch-block writes."""

        def _capture(self) -> None:
            self.replayed: list[int] = []
            for b in self.buckets:
                self._graphs[b] = _Replay(self, b)  # type: ignore[assignment]

    class _Replay:
        def __init__(self, owner: EagerGraphs, b: int) -> None:
            self.owner, self.b = owner, b

        def replay(self) -> None:
            self.owner._step(self.b)
            self.owner.replayed.append(self.b)

    result = {}
    for backend in ("torch", "triton", "graphs"):
        cfg = EngineConfig(
            dtype="float32",
            num_kv_blocks=48,
            block_size=16,
            max_num_batched_tokens=32,  # the long prompts prefill in chunks, beside running decodes
            attention_backend="torch" if backend == "torch" else "triton",
        )
        eng = LLMEngine(model, cfg)
        if (
            backend == "graphs"
        ):  # a cache with the scratch block graphs pad into; buckets 2 and 5: 1, 3, 4 pad
            eng.kv = PagedKvCache(model.config, 48, 16, eng.kv.dtype, "cpu", scratch_blocks=1)
            eng.graphs = EagerGraphs(eng.model, eng.kv, eng.max_model_len, max_batch=5)
            eng.graphs.buckets = [2, 5]
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
        if backend == "graphs":
            assert eng.graphs is not None
            scratch = eng.kv.scratch_block
            result[backend]["scratch_written"] = bool(eng.kv.data[:, :, :, scratch].abs().sum() > 0)
            result[backend]["replayed"] = sorted(set(eng.graphs.replayed))  # type: ignore[attr-defined]
    # a step of decodes that also carries another prompt's one-token chunk before its end: budget 16, 15 running
    # sequences, so the long prompt prefills one token per step beside them — decode rows, one of which samples
    # nothing, in a step the graphs replay
    crowd = [[200 + i, 201 + i] for i in range(15)] + [list(range(150, 190))]
    for backend in ("torch", "graphs"):
        cfg = EngineConfig(dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=16,
                           max_num_seqs=16, attention_backend="torch" if backend == "torch" else "triton")  # fmt: skip
        eng = LLMEngine(model, cfg)
        if backend == "graphs":
            eng.kv = PagedKvCache(model.config, 64, 16, eng.kv.dtype, "cpu", scratch_blocks=1)
            eng.graphs = EagerGraphs(eng.model, eng.kv, eng.max_model_len, max_batch=16)
            eng.graphs.buckets = [16]
        for i, p in enumerate(crowd[:15]):
            eng.add_request(f"c{i}", p, SamplingParams(max_tokens=40, temperature=0))
        tokens: dict[str, list[int]] = {}
        replays = steps = 0
        while eng.has_unfinished():
            steps += 1
            if (
                steps == 3
            ):  # the 15 short prompts prefilled (30 tokens, two steps): from here each step decodes
                eng.add_request("long", crowd[15], SamplingParams(max_tokens=4, temperature=0))
            for o in eng.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            replays = eng.graphs.replayed.count(16) if eng.graphs else 0  # type: ignore[attr-defined]
        result[backend]["crowd"] = [tokens[f"c{i}"] for i in range(15)] + [tokens["long"]]
        result[backend]["crowd_replayed"] = replays
    # a step of six short prompts at once: on the Triton backend their attention is one launch per layer
    import services.engine.triton_attention as triton_attention

    launches: list[int] = []  # chunks per varlen launch
    varlen = triton_attention.paged_prefill_varlen

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        launches.append(kwargs["plan"].seqs.shape[1] if "plan" in kwargs else args[3].seqs.shape[1])
        return varlen(*args, **kwargs)

    triton_attention.paged_prefill_varlen = counted  # type: ignore[assignment]
    many = [list(range(20 + 7 * i, 23 + 9 * i)) for i in range(6)]  # 3 .. 13 tokens
    for backend in ("torch", "triton"):
        cfg = EngineConfig(dtype="float32", num_kv_blocks=48, block_size=16, max_num_batched_tokens=256,
                           attention_backend=backend)  # fmt: skip
        eng = LLMEngine(model, cfg)
        eng.blocks.allocate(3)
        for i, p in enumerate(many):
            eng.add_request(f"m{i}", p, SamplingParams(max_tokens=3, temperature=0))
        launches.clear()
        first = eng.step()
        result[backend]["many_first_step"] = {"launches": list(launches), "sampled": len(first)}
        toks: dict[str, list[int]] = {o.request_id: list(o.new_token_ids) for o in first}
        while eng.has_unfinished():
            for o in eng.step():
                toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        result[backend]["many"] = [toks[f"m{i}"] for i in range(6)]
    print(json.dumps(result))


_child_proc: list[tuple[subprocess.Popen[bytes], Any, Any]] = []


def start_early() -> None:
    """The child (~40 s alone on the interpreter), started when the suite's selection is known (conftest), so it
    runs beside the tests before this module's; its output goes to files (a pipe nobody reads could fill)."""
    if _child_proc:
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, __file__, "--child"], stdout=out, stderr=err, env=env, cwd=REPO)
    _child_proc.append((proc, out, err))
    # a session that ends before this module runs (-x, a Ctrl-C) does not leave it running
    atexit.register(lambda: proc.poll() is None and proc.kill())


@pytest.fixture(scope="module")
def res() -> Iterator[dict]:
    """Both engines' outputs, from one child process."""
    start_early()
    proc, out, err = _child_proc[0]
    try:
        proc.wait(timeout=600)
        out.seek(0)
        err.seek(0)
        assert proc.returncode == 0, err.read().decode(errors="replace")[-3000:]
        yield json.loads(out.read().decode().strip().splitlines()[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()


def test_triton_decode_attention_in_the_engine_gives_the_torch_paths_tokens(res):
    assert res["triton"]["generate"] == res["torch"]["generate"]
    assert res["triton"]["imported"] == res["torch"]["imported"]
    assert all(len(t) == 12 for t in res["triton"]["generate"])
    assert res["triton"]["hits"] > 0  # the shared prefix was served from the cache, not recomputed


def test_a_step_of_six_prompts_attends_in_one_launch_per_layer_with_the_torch_paths_tokens(res):
    """Six short prompts admitted together prefill in one step; on the Triton backend each of the model's two
    layers attends over all six chunks in one launch (not one per prompt per layer), and every prompt's tokens
    are the torch path's."""
    assert res["triton"]["many_first_step"] == {"launches": [6, 6], "sampled": 6}
    assert res["torch"]["many_first_step"]["launches"] == []
    assert res["triton"]["many"] == res["torch"]["many"]
    assert all(len(t) == 3 for t in res["triton"]["many"])


def test_a_graph_step_carrying_a_prompts_one_token_chunk_samples_only_the_rows_that_end_a_chunk(res):
    """15 sequences decode and a 40-token prompt gets the one token of budget left each step: a decode-only step
    the graphs replay, one of whose rows is mid-prompt and samples nothing. Every sequence's tokens are the torch
    path's (before the fix the step raised: the graph's logits had one row more than the sampled requests)."""
    assert res["graphs"]["crowd"] == res["torch"]["crowd"]
    assert [len(t) for t in res["graphs"]["crowd"]] == [40] * 15 + [4]
    assert res["graphs"]["crowd_replayed"] > 0


def test_decode_graph_buffers_pad_into_the_scratch_block_and_keep_the_tokens(res):
    """The CUDA-graph runner's static buffers, bucket choice and padded rows (replayed eagerly here: no CUDA)
    decode exactly what the eager engine decodes; padding writes only the scratch block."""
    assert res["graphs"]["generate"] == res["torch"]["generate"]
    assert res["graphs"]["imported"] == res["torch"]["imported"]
    assert res["graphs"]["scratch_written"]  # the padded rows' K/V went to the scratch block
    assert res["graphs"]["replayed"] == [2, 5]  # 4 sequences (padded to 5), at the end 1 (padded to 2)


if __name__ == "__main__" and "--child" in sys.argv:
    _child()

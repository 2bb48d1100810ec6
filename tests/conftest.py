"""Shared fixtures: the real SmolLM2 model (loaded once per session) and a tiny random Llama for fast mechanics."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from services.engine.config import ModelConfig  # noqa: E402
from services.engine.loader import LoadedModel, load_gguf  # noqa: E402
from services.engine.model_files import smollm2_gguf_path  # noqa: E402
from tests.support.markers import ATTR  # noqa: E402

pytest_plugins = ["tests.support.etcd"]  # the real-etcd fixture (etcd_server) for every test module

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2(gguf_path: str) -> LoadedModel:
    return load_gguf(gguf_path)


@pytest.fixture(scope="session")
def hf_model(gguf_path: str):
    """Hugging Face transformers' own reading of the same GGUF, float32 — the correctness reference."""
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(gguf_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()


def tiny_llama(seed: int = 0, vocab: int = 256, layers: int = 2, tie: bool = True) -> LoadedModel:
    """A random 2-layer Llama small enough that scheduling tests run in milliseconds per step."""
    cfg = ModelConfig(
        architecture="llama",
        num_layers=layers,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=vocab,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_context=512,
        tie_embeddings=tie,
        eos_token_id=None,
    )
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w = {"embed_tokens": r(vocab, 64, scale=1.0), "norm": 1 + r(64, scale=0.05)}
    for i in range(layers):
        p = f"layers.{i}"
        w |= {
            f"{p}.q_proj": r(64, 64),
            f"{p}.k_proj": r(32, 64),
            f"{p}.v_proj": r(32, 64),
            f"{p}.o_proj": r(64, 64),
            f"{p}.gate_proj": r(128, 64),
            f"{p}.up_proj": r(128, 64),
            f"{p}.down_proj": r(64, 128),
            f"{p}.input_layernorm": 1 + r(64, scale=0.05),
            f"{p}.post_attention_layernorm": 1 + r(64, scale=0.05),
        }
    if not tie:
        w["lm_head"] = r(vocab, 64)
    return LoadedModel(config=cfg, weights=w, source="tiny-llama", source_format="memory")


# ------------------------------------------------------------------ the `cluster` marker and `make test-fast`
# A test that starts a process (a service, etcd, helm, openssl, a child interpreter) is marked `cluster`: every
# test under tests/cluster/ is, and elsewhere the mark is explicit. `make test-fast` runs the rest with
# RACKSERVE_TEST_FAST=1, under which starting a process inside a test is an error naming the test — so a
# missing mark shows up at once instead of slowing the inner loop.
CLUSTER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster")
_FAST = os.environ.get("RACKSERVE_TEST_FAST") == "1"
_running: list[str] = []  # the nodeid of the test being set up or run


def _uses_a_process_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(getattr(d.func, ATTR, False) for defs in info.name2fixturedefs.values() for d in defs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if str(item.path).startswith(CLUSTER_DIR + os.sep) or _uses_a_process_fixture(item):
            item.add_marker(pytest.mark.cluster)


def pytest_collection_finish(session: pytest.Session) -> None:
    """A test module may define `start_early()`: a long child process it needs (one that computes alone, a
    single-threaded minute), started here, once the selection is known, so that it runs beside the tests before
    it instead of alone when the module's turn comes. Only for modules with a selected test; never when only
    collecting."""
    if session.config.option.collectonly or _FAST:
        return
    for module in {id(m): m for m in (getattr(i, "module", None) for i in session.items) if m}.values():
        start = getattr(module, "start_early", None)
        if callable(start):
            start()


def _refuse_processes() -> None:
    import subprocess

    real_init = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):  # type: ignore[no-untyped-def]
        if _running:
            raise RuntimeError(
                f"make test-fast starts no processes, but {_running[-1]} ran {args!r}: mark it @pytest.mark.cluster"
            )
        real_init(self, args, *a, **kw)

    subprocess.Popen.__init__ = guarded  # type: ignore[method-assign]

    import multiprocessing.process

    real_start = multiprocessing.process.BaseProcess.start

    def guarded_start(self):  # type: ignore[no-untyped-def]
        if _running:
            raise RuntimeError(
                f"make test-fast starts no processes, but {_running[-1]} started {self!r}: mark it cluster"
            )
        real_start(self)

    multiprocessing.process.BaseProcess.start = guarded_start  # type: ignore[method-assign]


if _FAST:
    # The engine builds its fused CPU kernels on first use (a compiler run, cached on disk): build them here,
    # before any test, so that only what a test itself starts counts against it.
    from services.engine import cpu_ops  # noqa: E402

    cpu_ops.load()
    _refuse_processes()


def _while_running(item: pytest.Item):  # type: ignore[no-untyped-def]
    _running.append(item.nodeid)
    try:
        return (yield)
    finally:
        _running.pop()


# a test's own phases (fixture setup included); collection and teardown are not the test starting something
pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_while_running)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_while_running)

"""Device selection: `--device auto|cpu|cuda|cuda:N`, and never a silent CPU run when a GPU was asked for.

On this CPU-only machine `cuda` must fail at start-up with a message naming the device, both in the engine and
in a real worker process; `auto` must pick the CPU and say so in the KV layout it advertises. The GPU paths
themselves are checked by `make gpu-check` on a GPU machine (scripts/gpu_check.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.device import DeviceUnavailableError, parse_device_spec, resolve_device
from services.engine.engine import KvLayout, KvMismatchError, LLMEngine
from services.engine.sampling import SamplingParams
from tests.conftest import tiny_llama

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize(
    ("spec", "want"),
    [("auto", ("auto", None)), ("cpu", ("cpu", None)), ("cuda", ("cuda", None)), ("CUDA:1", ("cuda", 1))],
)
def test_device_specs_parse(spec, want):
    assert parse_device_spec(spec) == want


@pytest.mark.parametrize("spec", ["gpu", "cpu:0", "cuda:", "cuda:x", "auto:1", ""])
def test_malformed_device_is_refused_in_the_config(spec):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EngineConfig(device=spec)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
def test_auto_means_cpu_without_a_gpu_and_the_layout_says_so():
    assert resolve_device("auto") == torch.device("cpu")
    eng = LLMEngine(tiny_llama(), EngineConfig(dtype="float32", device="auto", num_kv_blocks=16))
    assert eng.device.type == "cpu" and eng.kv.data.device.type == "cpu"
    assert eng.kv_layout.device_kind == "cpu"
    assert eng.kv.scratch_block is None  # graphs (and their scratch block) are CUDA-only
    assert len(eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0]) == 4


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_asking_for_cuda_without_one_fails_naming_the_device(spec):
    with pytest.raises(DeviceUnavailableError, match=f"device '{spec}' was asked for") as e:
        LLMEngine(tiny_llama(), EngineConfig(dtype="float32", device=spec, num_kv_blocks=16))
    assert "--device cpu" in str(e.value)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
@pytest.mark.cluster
def test_a_decode_worker_asked_for_cuda_exits_at_start_with_the_reason():
    """The real worker process, as a GPU pod without a visible GPU would start it: it must not come up on CPU."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "decode", "--etcd", "http://127.0.0.1:1", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "device 'cuda' was asked for" in proc.stderr


def test_staged_kv_bytes_cross_devices_but_device_handles_need_the_same_kind():
    base = dict(
        model_fingerprint="f", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32"
    )
    cpu, gpu = KvLayout(**base, device_kind="cpu"), KvLayout(**base, device_kind="cuda")
    cpu.check_compatible(gpu)  # host bytes: the same format whichever device wrote them
    with pytest.raises(KvMismatchError, match="device_kind mismatch"):
        cpu.check_compatible(gpu, same_device=True)


def test_export_kv_blocks_is_the_tensor_the_staged_bytes_come_from():
    """export_kv (staged bytes) and export_kv_blocks (device tensor) are the same blocks; importing either — or
    their raw bytes as a flat uint8 tensor, what a NIXL read of device memory delivers — into a second engine
    continues with the same tokens as the engine that computed the prompt."""
    cfg = EngineConfig(dtype="float32", num_kv_blocks=32, device="cpu")
    src, dst_a, dst_b, dst_c = (LLMEngine(tiny_llama(), cfg) for _ in range(4))
    prompt = list(range(1, 40))
    greedy = SamplingParams(max_tokens=6, temperature=0)
    want = src.generate([prompt], greedy)[0]
    src.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
    while src.has_unfinished():
        src.step()
    staged = src.export_kv("p", len(prompt))
    blocks = src.export_kv_blocks("p", len(prompt))
    assert blocks.shape[0] == staged.num_blocks and blocks.view(torch.uint8).numpy().tobytes() == staged.data
    kept = bytes(staged.data)
    src.kv.data.zero_()  # the pool's blocks reused by other requests: the staged bytes are the export's own
    assert bytes(staged.data) == kept and torch.count_nonzero(
        torch.frombuffer(bytearray(kept), dtype=torch.uint8)
    )
    device_direct = type(staged)(src.kv_layout, staged.token_ids, blocks)
    raw = torch.frombuffer(bytearray(staged.data), dtype=torch.uint8)
    raw_bytes = type(staged)(src.kv_layout, staged.token_ids, raw)
    for dst, kv in ((dst_a, staged), (dst_b, device_direct), (dst_c, raw_bytes)):
        dst.add_request("d", prompt, greedy, kv=kv)
        got: list[int] = []
        while dst.has_unfinished():
            for out in dst.step():
                got += out.new_token_ids
        assert got == want


GIB = 1 << 30


class FakeGpu:
    """torch.cuda's memory queries over a scripted 80 GiB device shared by processes: `used` is every process's."""

    def __init__(self) -> None:
        self.total, self.used, self.reserved = 80 * GIB, 0, 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(
            torch.cuda, "mem_get_info", lambda device=None: (self.total - self.used, self.total)
        )
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)


def _worker_plans(gpu: FakeGpu, share: float, weights: int, peak: int, block: int):
    """One worker's start on the shared GPU: context, weights, a plan, then the cache it allocates."""
    from services.engine.device import memory_in_use, plan_kv_memory

    gpu.reserved = 0  # a new process: its allocator holds nothing yet
    gpu.used += GIB // 2  # its CUDA context
    at_start = memory_in_use(torch.device("cuda"))
    gpu.used += weights
    gpu.reserved = weights
    plan = plan_kv_memory(torch.device("cuda"), share, weights, peak, block, at_start)
    gpu.used += plan.kv_budget_bytes
    return plan


def test_workers_sharing_a_gpu_each_get_their_share_whichever_plans_first(monkeypatch):
    """`rackserve up` gives two workers on one GPU 0.45 each: the second plans after the first has taken its
    weights and cache, and must still get its own share — not count the first worker's memory against it."""
    gpu = FakeGpu()
    gpu.install(monkeypatch)
    block = 2 * 1024 * 1024
    first = _worker_plans(gpu, 0.45, 16 * GIB, 2 * GIB, block)
    second = _worker_plans(gpu, 0.45, 16 * GIB, 2 * GIB, block)
    # 0.45 x 80 GiB = 36 GiB, less 16 GiB of weights and a 2 GiB peak: 18 GiB of cache each
    assert first.kv_budget_bytes == second.kv_budget_bytes == 18 * GIB
    assert second.other_bytes == first.kv_budget_bytes + 16 * GIB + GIB  # the first worker's, both contexts
    assert gpu.used + 2 * 2 * GIB <= gpu.total  # both caches and both peaks fit the device


def test_a_plan_never_takes_more_than_is_free_and_refuses_when_nothing_is(monkeypatch):
    from services.engine.device import plan_kv_memory

    gpu = FakeGpu()
    gpu.install(monkeypatch)
    gpu.used = 70 * GIB  # another tenant holds most of the device
    at_start = gpu.used
    gpu.used += 4 * GIB
    gpu.reserved = 4 * GIB
    plan = plan_kv_memory(torch.device("cuda"), 0.9, 4 * GIB, GIB, GIB, at_start)
    assert plan.kv_budget_bytes == 5 * GIB  # 6 GiB free, less the peak: not 0.9 x 80 - 4 - 1 = 67 GiB
    gpu.used = 79 * GIB
    with pytest.raises(DeviceUnavailableError, match="no GPU memory is left for the KV cache"):
        plan_kv_memory(torch.device("cuda"), 0.9, 4 * GIB, GIB, GIB, at_start)


def test_weights_built_on_the_device_before_the_engine_still_count_as_its_own(monkeypatch):
    from services.engine.device import plan_kv_memory

    gpu = FakeGpu()
    gpu.install(monkeypatch)
    gpu.used = gpu.reserved = 16 * GIB  # weights made on the GPU by the caller, then the engine starts
    plan = plan_kv_memory(torch.device("cuda"), 0.5, 16 * GIB, 2 * GIB, GIB, gpu.used)
    assert plan.kv_budget_bytes == (40 - 16 - 2) * GIB


# a worker stand-in for `rackserve up`'s placement tests: a real process that takes the worker's argv, ignores
# SIGTERM (a draining worker finishing its streams) and lives until killed
_WORKER_STANDIN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"


class UpWorkers:
    """`rackserve up`'s launcher (services.launcher.Cluster) starting workers on a machine of `gpus` GPUs: each
    worker a real process given the argv `up` builds for it, read back as that worker's engine config."""

    def __init__(self, argv: list[str], gpus: int) -> None:
        import argparse

        from services.launcher import Cluster, add_arguments, engine_flags, gpu_placement

        up = argparse.ArgumentParser()
        add_arguments(up)
        self.args = up.parse_args(argv)
        self.cluster = Cluster(self.args)
        self.cluster.placement = gpu_placement(self.args, lambda: gpus)
        engine = engine_flags(self.args, self.cluster.placement)
        self.cluster._worker_cmd = ([sys.executable, "-c", _WORKER_STANDIN], [], engine)

    def add(self, role: str) -> EngineConfig:
        import argparse

        from services.runtime.args import add_engine_arguments, engine_config

        proc = self.cluster.add_worker(role)
        worker = argparse.ArgumentParser()
        add_engine_arguments(worker)
        args = list(proc.popen.args)  # the lifeline (services.launcher.lifeline), then `python -c CODE`, ...
        argv = args[args.index("-c") + 2 :]  # ... the role, then the worker's flags
        assert argv[0] == role
        known, _ = worker.parse_known_args(argv[1:])
        return engine_config(known)

    def close(self) -> None:
        for p in self.cluster.live():
            p.popen.kill()
            p.popen.wait()


@pytest.mark.cluster  # real stand-in worker processes
@pytest.mark.parametrize(
    ("argv", "gpus", "want"),
    [
        # every worker its own GPU while there are GPUs enough
        (["--device", "cuda", "--prefill", "2", "--decode", "6"], 8, [(f"cuda:{i}", 0.9) for i in range(8)]),
        # one GPU: the workers split its memory rather than each taking 90 %
        (["--device", "cuda", "--prefill", "1", "--decode", "1"], 1, [("cuda:0", 0.45)] * 2),
        # more workers than GPUs: fewest workers first, each GPU's share sized for the most it holds
        (["--device", "cuda", "--prefill", "2", "--decode", "1"], 2, [(f"cuda:{i}", 0.45) for i in (0, 1, 0)]),
        (["--prefill", "1", "--decode", "1"], 4, [("cuda:0", 0.9), ("cuda:1", 0.9)]),  # auto on a GPU machine
        # cuda:N asks for that GPU: everyone on it
        (["--device", "cuda:1", "--prefill", "1", "--decode", "2"], 4, [("cuda:1", 0.3)] * 3),
    ],
)  # fmt: skip
def test_rackserve_up_spreads_gpu_workers_over_the_visible_gpus_each_with_its_part_of_one(argv, gpus, want):
    """`rackserve up --device cuda` on a GPU box starts every worker on a GPU of its own while there are GPUs
    enough (vLLM and SGLang users start one engine per GPU), and workers sharing a GPU split its
    --gpu-memory-utilization. A GPU worker's cache is left to its memory plan: no --kv-cache-bytes (the CPU
    demo's 256 MiB would give each worker 256 MiB of an 80 GB GPU)."""
    up = UpWorkers(argv, gpus)
    try:
        roles = ["prefill"] * up.args.prefill + ["decode"] * up.args.decode
        got = [up.add(role) for role in roles]
        ready = up.cluster.describe_gpus()  # the line `up` prints when the cluster is ready
    finally:
        up.close()
    assert [(c.device, round(c.gpu_memory_utilization, 4)) for c in got] == want
    assert ready.startswith("  GPUs: prefill-0 cuda:") and f"decode-0 {want[up.args.prefill][0]}" in ready
    assert all(c.kv_cache_bytes == 0 for c in got)  # planned on the device


@pytest.mark.cluster  # real stand-in worker processes
def test_rackserve_up_places_the_planners_workers_beside_the_running_ones_and_a_draining_one_keeps_its_gpu():
    """With --planner the workers come and go: a GPU's share is sized for the most workers `up` may run
    (--max-prefill + --max-decode over the GPUs), so a worker added later fits beside the running ones; it goes
    to the GPU with the fewest, and a draining worker (SIGTERMed, finishing its streams) still holds its GPU's
    memory until it has exited."""
    import signal

    argv = ["--device", "cuda", "--planner", "--prefill", "1", "--decode", "1", "--max-prefill", "2"]
    up = UpWorkers([*argv, "--max-decode", "2"], gpus=2)
    try:
        placed = [up.add("prefill").device, up.add("decode").device, up.add("decode").device]
        assert placed == ["cuda:0", "cuda:1", "cuda:0"]
        draining = up.cluster.drain_worker("decode", 1)  # the newest decode worker, on cuda:0
        assert draining.gpu == 0 and draining.popen.poll() is None
        added = up.add("prefill")
        assert (added.device, round(added.gpu_memory_utilization, 4)) == ("cuda:1", 0.45)
        draining.popen.send_signal(signal.SIGKILL)  # it has exited: its GPU takes the next one
        draining.popen.wait()
        assert up.add("decode").device == "cuda:0"
    finally:
        up.close()


@pytest.mark.cluster  # real stand-in worker processes
def test_rackserve_up_without_a_gpu_runs_cpu_workers_and_refuses_cuda_naming_it():
    """`auto` on a machine without a GPU gives CPU workers with the demo's 256 MiB cache each (a size given is
    passed on); `--device cuda` there stops `up` before any worker starts, naming the device."""
    for argv in ([], ["--device", "cpu"]):
        up = UpWorkers(argv, gpus=0)
        try:
            cfg = up.add("decode")
        finally:
            up.close()
        assert cfg.device == (argv[1] if argv else "auto") and cfg.kv_cache_bytes == 256 << 20
    up = UpWorkers(["--device", "cpu", "--kv-cache-bytes", str(8 << 30)], gpus=4)
    try:
        assert up.add("prefill").kv_cache_bytes == 8 << 30
    finally:
        up.close()
    with pytest.raises(SystemExit, match="--device cuda but no GPU is visible"):
        UpWorkers(["--device", "cuda"], gpus=0)
    with pytest.raises(SystemExit, match="device must be auto, cpu, cuda or cuda:N"):
        UpWorkers(["--device", "gpu0"], gpus=4)  # refused by `up` itself, before any worker starts


def test_kv_copies_in_transit_come_out_of_the_cache_plan(monkeypatch):
    """KV copies a GPU worker holds beside its cache get their room out of the KV plan, not from memory the plan
    gave the cache: a prefill worker's device copies kept for cuda_ipc and NIXL VRAM readers
    (--kv-device-copy-bytes) and a pulling worker's device-direct pulls not yet written (--kv-device-pull-bytes;
    a prefill worker pulls peers' prefixes too), 2 GiB each unless set. A worker with only host backends (or
    NIXL that is not installed) holds none and plans none."""
    import argparse

    from services.engine.device import plan_kv_memory
    from services.runtime.args import add_engine_arguments, add_kv_transfer_arguments, engine_config

    gpu = FakeGpu()
    gpu.install(monkeypatch)
    gpu.used = gpu.reserved = 16 * GIB
    plan = plan_kv_memory(torch.device("cuda"), 0.5, 16 * GIB, 2 * GIB, GIB, gpu.used, reserved_bytes=3 * GIB)
    assert (
        plan.kv_budget_bytes == (40 - 16 - 2 - 3) * GIB and "KV copies in transit 3.00 GiB" in plan.describe()
    )

    def reserve(role: str, argv: list[str]) -> int:
        parser = argparse.ArgumentParser()
        add_engine_arguments(parser)
        add_kv_transfer_arguments(parser, role)
        return engine_config(parser.parse_args(argv)).kv_transit_bytes

    import services.runtime.args as args_mod

    monkeypatch.setattr(args_mod, "nixl_installed", lambda: True)
    assert reserve("prefill", []) == 4 << 30
    assert reserve("prefill", ["--kv-device-copy-bytes", str(1 << 30)]) == 3 << 30
    assert reserve("prefill", ["--kv-device-copy-bytes", "0", "--kv-device-pull-bytes", "0"]) == 0
    assert reserve("prefill", ["--kv-backends", "tcp,shm"]) == 0  # nothing device-direct could come or go
    assert reserve("prefill", ["--kv-backends", "tcp,nixl"]) == 4 << 30
    assert reserve("decode", []) == 2 << 30
    assert reserve("decode", ["--kv-device-pull-bytes", str(1 << 30)]) == 1 << 30
    assert reserve("decode", ["--kv-backends", "tcp,shm"]) == 0
    monkeypatch.setattr(args_mod, "nixl_installed", lambda: False)  # NIXL cannot load: the cache keeps it
    assert reserve("prefill", ["--kv-backends", "tcp,shm,nixl"]) == 0
    assert reserve("decode", ["--kv-backends", "tcp,shm,nixl"]) == 0
    assert reserve("prefill", ["--kv-backends", "tcp,nixl,cuda_ipc"]) == 4 << 30


def test_a_llama3_gguf_with_rope_freqs_builds_on_another_device_than_the_cpu():
    """llama.cpp stores Llama 3.x's frequency scaling as a `rope_freqs` tensor. The model moves each weight to its
    device as it builds, and computes the rotary tables on the CPU: the factors must come back to the CPU first
    (on a GPU the division mixed devices and every Llama 3.x GGUF failed to load). The meta device stands in for
    the GPU: another device than the CPU, with no memory behind it."""
    from services.engine.model import Transformer

    loaded = tiny_llama()
    factors = torch.linspace(1.0, 8.0, loaded.config.head_dim // 2)
    weights = dict(loaded.weights) | {"rope_freqs": factors}
    elsewhere = Transformer(loaded.config, weights, device="meta")
    assert elsewhere.rope_cos.device.type == "meta" and elsewhere.embed.weight.device.type == "meta"
    scaled, plain = Transformer(loaded.config, weights), Transformer(loaded.config, loaded.weights)
    assert not torch.equal(scaled.rope_cos, plain.rope_cos)  # the factors are applied


def test_a_model_the_triton_kernels_cannot_take_runs_on_torch_ops_or_is_refused_when_triton_is_asked_for():
    """The paged-attention kernels take power-of-two head_dims 16..256 and block sizes 8..128. On a GPU `auto`
    gave them any model, which then failed at its first decode step; now such a model runs on torch ops (said in
    the log), and asking for `triton` with it is a start-up error naming the shape."""
    from services.engine.engine import _attention_backend

    cuda = torch.device("cuda")  # only its type is read: no CUDA call is made
    assert _attention_backend("auto", cuda, 96, 16) == "torch"
    assert _attention_backend("auto", cuda, 128, 256) == "torch"
    with pytest.raises(ValueError, match="block_size 256 must be a power of two in 8..128"):
        LLMEngine(tiny_llama(), EngineConfig(num_kv_blocks=8, block_size=256, attention_backend="triton"))


@pytest.mark.parametrize("total_gib, want", [(80, 8192), (141, 8192), (48, 2048), (24, 2048)])
def test_the_step_token_budget_defaults_by_device_and_a_given_one_wins(monkeypatch, total_gib, want):
    """0 (the flag's default) is vLLM's choice for an OpenAI server: 512 tokens a step on a CPU, 2,048 on a GPU,
    8,192 on one of 70 GiB or more; a budget given is used as given."""
    from types import SimpleNamespace

    from services.engine.device import step_token_budget

    props = SimpleNamespace(total_memory=total_gib << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    assert step_token_budget(0, torch.device("cuda", 0)) == want
    assert step_token_budget(0, torch.device("cpu")) == 512
    assert step_token_budget(96, torch.device("cuda", 0)) == 96


def test_a_cpu_engine_by_default_schedules_512_tokens_a_step():
    """The scheduler gets the resolved budget, not the flag's 0 (which would schedule nothing, ever)."""
    eng = LLMEngine(
        tiny_llama(seed=1, layers=1), EngineConfig(dtype="float32", num_kv_blocks=96, block_size=16)
    )
    assert eng.max_num_batched_tokens == 512
    eng.add_request("a", list(range(1, 251)) * 2, SamplingParams(max_tokens=2, temperature=0))
    eng.add_request("b", list(range(3, 40)), SamplingParams(max_tokens=2, temperature=0))
    first = eng.step()  # 500 + 12 of b's 37 tokens: a's prompt done, b chunked
    assert [o.request_id for o in first] == ["a"]
    steps = 1
    while eng.has_unfinished() and steps < 10:
        eng.step()
        steps += 1
    assert not eng.has_unfinished()


def test_the_activation_profile_runs_a_whole_budget_even_past_the_context_length(monkeypatch):
    """The KV plan leaves the activations of the largest step: a budget of 256 tokens with a 64-token context is
    four 64-token sequences in one step, not one of 64 (which left a big GPU's 8,192-token steps 1/4 of their
    memory with --max-model-len 2048)."""
    eng = LLMEngine(
        tiny_llama(seed=1, layers=1),
        EngineConfig(
            dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=64, max_num_batched_tokens=256
        ),
    )
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    seen = {}
    forward = eng.model.forward

    def spy(tokens, positions, meta, kv):  # type: ignore[no-untyped-def]
        seen.update(tokens=tokens.shape[0], segments=[(s.start, s.end) for s in meta.prefills],
                    max_position=int(positions.max()))  # fmt: skip
        return forward(tokens, positions, meta, kv)

    monkeypatch.setattr(eng.model, "forward", spy)
    eng._profile_activation_bytes(eng.model_config, eng.config)
    assert seen == {
        "tokens": 256,
        "segments": [(0, 64), (64, 128), (128, 192), (192, 256)],
        "max_position": 63,
    }

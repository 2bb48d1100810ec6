"""--nvfp4-gemm: whether NVFP4 layers also quantize their activations (W4A4) or keep them 16-bit (W4A16).

The choice changes the answer, so it is the operator's (auto, w4a16, w4a4), it enters the model fingerprint (a
W4A4 worker's KV is another model's), a W4A16 checkpoint is served as W4A16 by auto, and w4a4 is never
silently W4A16: on a CPU it is emulated with the recipe, on a GPU without FP4 tensor cores it is refused.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.loader import LoadedModel, load_model
from services.engine.nvfp4 import NVFP4Linear, blackwell, dequantize, quantize
from services.engine.nvfp4.blackwell import choose_gemm
from services.engine.nvfp4.calibration import quantize_model
from services.engine.sampling import SamplingParams
from services.runtime.args import add_engine_arguments, engine_config
from tests.conftest import tiny_llama
from tests.engine.nvfp4.test_nvfp4_methods import _engine
from tests.engine.test_model_correctness import prompt_logits

PROMPTS = [[5, 17, 42, 99, 3, 8], [200, 1, 2], list(range(40, 70))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CUDA0 = torch.device("cuda", 0)
NO_FP4 = "compute capability 9.0 < 10.0 has no block-scaled FP4 tensor cores"


@pytest.mark.parametrize(
    ("asked", "declared", "gpu_reason", "want"),
    [
        ("auto", "", None, True),  # FP4 tensor cores and a probe that passed
        ("auto", "nvfp4", None, True),
        ("auto", "16bit", None, False),  # an NVFP4A16 checkpoint was calibrated for 16-bit activations
        ("auto", "", NO_FP4, False),  # Hopper: W4A16
        ("w4a16", "", None, False),
        ("w4a4", "16bit", None, True),  # asked for explicitly: the operator's call
    ],
)
def test_the_gemm_on_a_gpu_follows_the_flag_the_checkpoint_and_the_part(
    monkeypatch, asked, declared, gpu_reason, want
):
    monkeypatch.setattr(blackwell, "blackwell_unavailable_reason", lambda device=None: gpu_reason)
    monkeypatch.setattr(blackwell.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    use, why = choose_gemm(asked, CUDA0, declared)
    assert use is want and why


def test_a_gpu_with_fp4_tensor_cores_that_still_runs_w4a16_says_so(monkeypatch, caplog):
    """auto on compute capability 10+ whose probe failed: W4A16, with a warning naming why; on a Hopper part,
    where W4A16 is the only choice, no warning."""
    probe = "a probe FP4 GEMM failed: RuntimeError: no kernel"
    monkeypatch.setattr(blackwell, "blackwell_unavailable_reason", lambda device=None: probe)
    for capability, warned in (((10, 0), True), ((9, 0), False)):
        monkeypatch.setattr(
            blackwell.torch.cuda, "get_device_capability", lambda device=None, c=capability: c
        )
        caplog.clear()
        with caplog.at_level("WARNING", logger=blackwell.__name__):
            assert choose_gemm("auto", CUDA0) == (False, probe)
        assert any(probe in r.getMessage() for r in caplog.records) is warned, capability


def test_w4a4_asked_of_a_gpu_without_fp4_tensor_cores_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(blackwell, "blackwell_unavailable_reason", lambda device=None: NO_FP4)
    with pytest.raises(ValueError, match="--nvfp4-gemm w4a4 on cuda:0: compute capability 9.0"):
        choose_gemm("w4a4", CUDA0)


def test_a_cpu_runs_w4a16_unless_asked_and_then_emulates_w4a4():
    cpu = torch.device("cpu")
    assert choose_gemm("auto", cpu, "nvfp4")[0] is False
    assert choose_gemm("w4a16", cpu)[0] is False
    use, why = choose_gemm("w4a4", cpu)
    assert use and "emulated" in why


def test_an_emulated_w4a4_engine_gives_the_tokens_of_its_activations_quantized_by_the_recipe():
    """The W4A4 engine on a CPU equals the dense model of the dequantized weights whose every projection sees
    its input quantized and dequantized by the recipe first (one tensor scale per call), and is another model
    than the W4A16 engine: another fingerprint, other logits."""
    model = tiny_llama()
    w4a4 = _engine(model, quant="nvfp4", nvfp4_gemm="w4a4")
    w4a16 = _engine(model, quant="nvfp4", nvfp4_gemm="w4a16")
    assert w4a16.fingerprint == _engine(model, quant="nvfp4").fingerprint  # auto on a CPU is W4A16
    assert w4a4.fingerprint != w4a16.fingerprint
    layers = [m for m in w4a4.model.modules() if isinstance(m, NVFP4Linear)]
    assert layers and all(m.w4a4 for m in layers)

    # reference: dense weights = the bytes the engine quantizes at load (quantize_model), dequantized; inputs
    # quantized by forward hooks
    dense = dict(model.weights) | {name: dequantize(q) for name, q in quantize_model(model, "rtn").items()}
    ref = _engine(LoadedModel(config=model.config, weights=dense, source="ref", source_format="memory"))
    seen: list[int] = []

    def quantize_input(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        seen.append(x.shape[0])
        return (dequantize(quantize(x.reshape(-1, x.shape[-1]))).reshape(x.shape).to(x.dtype),)

    hooks = []
    for blk in ref.model.blocks:
        for proj in (blk.attn.wqkv, blk.attn.wo, blk.ffn.w_gate_up, blk.ffn.w_down):
            hooks.append(proj.register_forward_pre_hook(quantize_input))
    want = ref.generate(PROMPTS, GREEDY)
    assert seen  # the hooks ran
    assert w4a4.generate(PROMPTS, GREEDY) == want
    ids = torch.tensor(PROMPTS[2])
    assert torch.equal(prompt_logits(w4a4.model, ids), prompt_logits(ref.model, ids))  # float32: the same ops
    for h in hooks:
        h.remove()
    assert not torch.equal(prompt_logits(w4a4.model, ids), prompt_logits(w4a16.model, ids))


def test_a_layer_a_gpu_would_run_w4a16_is_not_emulated_as_w4a4():
    """The FP4 GEMM needs in_features % 32 and out_features % 16; a GPU runs other layers W4A16, so the CPU's
    emulation does too, and the two compute the same function under the same fingerprint."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 48, generator=g)
    odd = quantize(torch.randn(24, 48, generator=g))
    assert torch.equal(NVFP4Linear(odd, w4a4=True)(x), NVFP4Linear(odd)(x))
    even = quantize(torch.randn(32, 64, generator=g))
    x = torch.randn(4, 64, generator=g)
    assert not torch.equal(NVFP4Linear(even, w4a4=True)(x), NVFP4Linear(even)(x))


def test_nvfp4_gemm_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="nvfp4_gemm must be one of"):
        EngineConfig(nvfp4_gemm="w4a8")
    with pytest.raises(ValueError, match="nvfp4_gemm='w4a4' needs NVFP4 weights"):
        _engine(tiny_llama(), nvfp4_gemm="w4a4")


def test_the_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config(parser.parse_args([])).nvfp4_gemm == "auto"
    assert engine_config(parser.parse_args(["--nvfp4-gemm", "w4a16"])).nvfp4_gemm == "w4a16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--nvfp4-gemm", "fp8"])


def test_rackserve_up_gives_every_worker_its_quantization_flags():
    from services.launcher import add_arguments, engine_flags

    worker = argparse.ArgumentParser()
    add_engine_arguments(worker)
    up = argparse.ArgumentParser()
    add_arguments(up)
    argv = ["--quant", "nvfp4", "--nvfp4-method", "four_over_six", "--nvfp4-gemm", "w4a4"]
    cfg = engine_config(worker.parse_args(engine_flags(up.parse_args(argv), None)))
    assert (cfg.quant, cfg.nvfp4_method, cfg.nvfp4_gemm) == ("nvfp4", "four_over_six", "w4a4")
    plain = engine_config(worker.parse_args(engine_flags(up.parse_args([]), None)))
    assert (plain.quant, plain.nvfp4_method, plain.nvfp4_gemm) == ("none", "rtn", "auto")
    with pytest.raises(SystemExit, match="rackserve up: nvfp4_method='mse' needs quant='nvfp4'"):
        engine_flags(up.parse_args(["--nvfp4-method", "mse"]), None)


@pytest.mark.slow  # writes and loads a checkpoint
@pytest.mark.parametrize(
    ("qcfg", "declared"),
    [
        # llm-compressor's NVFP4A16 scheme (what `rackserve quantize` writes): weights only
        ({"config_groups": {"group_0": {"input_activations": None}}}, "16bit"),
        # its NVFP4 scheme: 4-bit float activations too
        ({"config_groups": {"group_0": {"input_activations": {"num_bits": 4, "type": "float"}}}}, "nvfp4"),
        ({"config_groups": {"group_0": {"input_activations": {"num_bits": 8, "type": "float"}}}}, ""),
    ],
)
def test_a_compressed_tensors_checkpoint_declares_its_activations(tmp_path, qcfg, declared):
    from tests.engine.nvfp4.test_nvfp4_checkpoint_serving import write_checkpoint

    write_checkpoint(tmp_path, "compressed-tensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] |= qcfg
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(tmp_path).nvfp4_activations == declared


@pytest.mark.slow  # writes and loads a checkpoint
@pytest.mark.parametrize("where", ["config.json", "hf_quant_config.json"])
def test_a_modelopt_nvfp4_checkpoint_declares_w4a4(tmp_path, where):
    from tests.engine.nvfp4.test_nvfp4_checkpoint_serving import write_checkpoint

    write_checkpoint(tmp_path, "modelopt")
    assert load_model(tmp_path).nvfp4_activations == ""  # says nothing: the device decides
    if where == "config.json":
        cfg = json.loads((tmp_path / "config.json").read_text())
        cfg["quantization_config"]["quant_algo"] = "NVFP4"
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    else:
        (tmp_path / where).write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    assert load_model(tmp_path).nvfp4_activations == "nvfp4"


@pytest.mark.slow  # writes and loads a checkpoint
@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_what_rackserve_quantize_writes_is_served_w4a16_by_auto(tmp_path, layout, monkeypatch):
    """Its weights were quantized for 16-bit activations (gptq calibrates on them): the checkpoint says so in
    either layout, though ModelOpt's quant_algo NVFP4 alone would mean W4A4, and auto on FP4 tensor cores obeys."""
    from services.engine.nvfp4.export import write_checkpoint

    model = tiny_llama()
    write_checkpoint(model, quantize_model(model, "rtn"), tmp_path, layout, "rtn")
    declared = load_model(tmp_path).nvfp4_activations
    assert declared == "16bit"
    # exports written before the key existed were quantized for 16-bit activations as well
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["quantization_config"]["rackserve"]["activations"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(tmp_path).nvfp4_activations == "16bit"
    monkeypatch.setattr(blackwell, "blackwell_unavailable_reason", lambda device=None: None)
    assert choose_gemm("auto", CUDA0, declared)[0] is False

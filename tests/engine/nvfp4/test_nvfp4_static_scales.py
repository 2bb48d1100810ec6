"""W4A4 under a checkpoint's static activation scales, as vLLM serves ModelOpt and compressed-tensors NVFP4.

A W4A4 checkpoint carries, per projection, the tensor scale its input activations are quantized under
(ModelOpt `input_scale` = amax / 2688, compressed-tensors `input_global_scale` = 2688 / amax), calibrated on
sample text. The engine reads it and quantizes with it, so a row's product no longer depends on the rows
batched with it (with a scale per call, one large activation anywhere in the batch coarsens every row).
`rackserve quantize --activations nvfp4` calibrates and writes such checkpoints.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from services.cli import main as cli_main
from services.engine.loader import LoadedModel, load_model
from services.engine.model import AttnMetadata, PagedKvCache, PrefillSegment, Transformer
from services.engine.nvfp4 import NVFP4Linear, blackwell, dequantize, quantize
from services.engine.nvfp4.blackwell import choose_gemm
from services.engine.nvfp4.calibration import calibration_windows, quantize_model
from services.engine.nvfp4.checkpoint import input_scale_from, input_scale_to
from services.engine.nvfp4.export import _hf_name
from services.engine.nvfp4.recipe import global_scale_for_amax
from tests.conftest import tiny_llama
from tests.engine.nvfp4.test_nvfp4_methods import GREEDY, PROMPTS, _dense_hf_dir, _engine, _tok
from tests.engine.test_model_correctness import prompt_logits

CUDA0 = torch.device("cuda", 0)
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _layer(seed: int = 0, amax: float = 4.0) -> tuple[torch.Tensor, NVFP4Linear, NVFP4Linear]:
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(32, 64, generator=g))
    static = NVFP4Linear(w, w4a4=True, input_scale=global_scale_for_amax(torch.tensor(amax)))
    return torch.randn(3, 64, generator=g), static, NVFP4Linear(w, w4a4=True)


def test_a_static_scale_makes_a_rows_product_independent_of_its_batch():
    x, static, per_call = _layer()
    loud = torch.randn(2, 64, generator=torch.Generator().manual_seed(9)) * 40  # one outlier-heavy request
    batch = torch.cat([x, loud])
    # what it computes: the input quantized under the static scale, dequantized, times the dequantized weight
    g = static.input_scale
    assert g is not None
    w_hat = dequantize(static.weight_nvfp4)
    assert torch.equal(static(batch), F.linear(dequantize(quantize(batch, global_scale=g)), w_hat))
    # a row's quantized input is its own: alone or batched, the product differs only in the GEMM's summation
    # order; the scale per call is the batch's, and the loud rows coarsen the quiet ones
    static_drift = (static(batch)[:3] - static(x)).abs().max()
    per_call_drift = (per_call(batch)[:3] - per_call(x)).abs().max()
    print(f"drift: static {float(static_drift):.3g}, per call {float(per_call_drift):.3g}")
    assert static_drift <= 1e-5 * static(x).abs().max()
    assert per_call_drift > 1e-2 * per_call(x).abs().max()


def test_an_activation_beyond_the_calibrated_range_is_clipped_to_it():
    """Block scales saturate at E4M3's 448 and codes at E2M1's 6: under g_e = 2688 / 4, nothing exceeds 4."""
    g = global_scale_for_amax(torch.tensor(4.0))
    x = torch.tensor([[100.0, -7.0, 2.0] + [0.0] * 13])
    assert dequantize(quantize(x, global_scale=g))[0, :3].tolist() == [4.0, -4.0, 2.0]


def test_a_static_scale_keeps_its_fp32_bits_through_dtype_and_device_moves():
    _, static, _ = _layer(amax=3.3)
    bits = static.input_scale.clone()  # type: ignore[union-attr]
    static.to(torch.bfloat16)
    assert static.input_scale is not None and static.input_scale.dtype == torch.float32
    assert torch.equal(static.input_scale, bits)
    assert "static input_scale" in repr(static)
    with pytest.raises(ValueError, match="input_scale must be finite and positive"):
        NVFP4Linear(static.weight_nvfp4, input_scale=torch.tensor(0.0))


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_the_two_layouts_spell_the_scale_as_their_exports_do(layout):
    g = global_scale_for_amax(torch.tensor(13.0))
    written = input_scale_to(layout, g, "model.layers.0.self_attn.q_proj")
    (name, t), = written.items()  # fmt: skip
    if layout == "modelopt":
        assert name.endswith(".input_scale") and float(t) == pytest.approx(13.0 / 2688, rel=2**-22)
        assert _same_scale(input_scale_from(layout, t, name), g, layout)  # one fp32 reciprocal there and back
    else:
        assert name.endswith(".input_global_scale") and torch.equal(t, g.reshape(1))
        assert torch.equal(input_scale_from(layout, t, name), g)
    for bad in (torch.tensor([0.0]), torch.tensor([float("nan")]), torch.ones(2)):
        with pytest.raises(ValueError, match="q_proj"):
            input_scale_from(layout, bad, "model.layers.0.self_attn.q_proj.input_scale")


KINDS = {"q_proj": "attn.wqkv", "o_proj": "attn.wo", "gate_proj": "ffn.w_gate_up", "down_proj": "ffn.w_down"}


def _amax_by_hooks(model: LoadedModel) -> dict[str, torch.Tensor]:
    """max |x| of each fused projection's input over the calibration windows, by forward hooks on a dense
    float32 engine (not the calibration code under test), as g_e per canonical projection name."""
    engine = _engine(model)
    amax: dict[str, torch.Tensor] = {}
    for i, blk in enumerate(engine.model.blocks):
        for part, attr in KINDS.items():
            key = f"layers.{i}.{part}"

            def hook(_m, args, key=key):
                amax[key] = torch.maximum(amax.get(key, torch.tensor(0.0)), args[0].abs().max())

            blk.get_submodule(attr).register_forward_pre_hook(hook)
    for ids in calibration_windows(_tok()):
        prompt_logits(engine.model, ids)
    return {k: global_scale_for_amax(a) for k, a in amax.items()}


def _same_scale(got: torch.Tensor, want: torch.Tensor, layout: str) -> bool:
    """Equal, or for ModelOpt (which stores 1 / g_e) at most one fp32 ulp away."""
    if layout == "compressed-tensors":
        return torch.equal(got, want)
    inf = torch.tensor(float("inf"))
    return any(torch.equal(got, v) for v in (want, torch.nextafter(want, inf), torch.nextafter(want, -inf)))


def _w4a4_checkpoint(tmp_path, layout: str):
    model = tiny_llama(vocab=49152)  # the SmolLM2 tokenizer's ids, so the calibration text runs through it
    src = _dense_hf_dir(tmp_path, model)
    out = tmp_path / layout
    argv = ["quantize", "--model", str(src), "--out", str(out), "--layout", layout, "--activations", "nvfp4"]
    assert cli_main(argv) == 0
    return load_model(src), out


@pytest.mark.slow  # calibrates, writes and loads a checkpoint
@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_rackserve_quantize_writes_a_w4a4_checkpoint_served_under_its_scales(tmp_path, layout, monkeypatch):
    dense, out = _w4a4_checkpoint(tmp_path, layout)
    want = _amax_by_hooks(dense)
    assert len({float(g) for g in want.values()}) == len(want)  # every projection its own scale
    # the checkpoint: each projection's scale in its layout's spelling (q/k/v and gate/up share their input's),
    # the activations declared
    tensors = load_file(str(out / "model.safetensors"))
    suffix = "input_global_scale" if layout == "compressed-tensors" else "input_scale"
    siblings = {"q_proj": ("k_proj", "v_proj"), "gate_proj": ("up_proj",), "o_proj": (), "down_proj": ()}
    for name, g in want.items():
        layer, _, part = name.rpartition(".")
        for n in (part, *siblings[part]):
            t = tensors[f"{_hf_name(f'{layer}.{n}')}.{suffix}"]
            assert torch.equal(
                t, g.reshape(1) if layout == "compressed-tensors" else torch.div(1, g).reshape(1)
            )
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["rackserve"]["activations"] == "nvfp4"
    if layout == "compressed-tensors" and importlib.util.find_spec("compressed_tensors") is not None:
        from compressed_tensors.quantization import QuantizationConfig

        scheme = QuantizationConfig.model_validate({k: v for k, v in qcfg.items() if k != "rackserve"})
        inputs = scheme.config_groups["group_0"].input_activations
        assert inputs is not None and (inputs.num_bits, inputs.group_size, inputs.dynamic) == (4, 16, "local")

    loaded = load_model(out)
    assert loaded.nvfp4_activations == "nvfp4"
    monkeypatch.setattr(blackwell, "blackwell_unavailable_reason", lambda device=None: None)
    assert choose_gemm("auto", CUDA0, loaded.nvfp4_activations)[0] is True  # W4A4 on FP4 tensor cores
    monkeypatch.undo()

    served = _engine(loaded, nvfp4_gemm="w4a4")
    assert sum(isinstance(m, NVFP4Linear) for m in served.model.modules()) == 4 * dense.config.num_layers
    for name, g in want.items():  # every layer of every block holds its own projection's scale
        layer, _, part = name.rpartition(".")
        served_mod = served.model.blocks[int(layer.split(".")[1])].get_submodule(KINDS[part])
        assert served_mod.input_scale is not None and _same_scale(served_mod.input_scale, g, layout), name

    # the served function: the dense model of the dequantized weights whose projections see their input
    # quantized under the checkpoint's scale
    weights = dict(dense.weights) | {n: dequantize(q) for n, q in quantize_model(dense, "rtn").items()}
    ref = _engine(LoadedModel(config=dense.config, weights=weights, source="ref", source_format="memory"))
    for i, blk in enumerate(ref.model.blocks):
        for mod, served_mod in zip(
            (blk.attn.wqkv, blk.attn.wo, blk.ffn.w_gate_up, blk.ffn.w_down),
            (served.model.blocks[i].attn.wqkv, served.model.blocks[i].attn.wo,
             served.model.blocks[i].ffn.w_gate_up, served.model.blocks[i].ffn.w_down),
            strict=True,
        ):  # fmt: skip
            g = served_mod.input_scale

            def quantize_input(_m, args, g=g):
                x = args[0]
                return (dequantize(quantize(x.reshape(-1, x.shape[-1]), global_scale=g)).reshape(x.shape),)

            mod.register_forward_pre_hook(quantize_input)
    assert served.generate(PROMPTS, GREEDY) == ref.generate(PROMPTS, GREEDY)
    ids = torch.tensor(PROMPTS[0])
    assert torch.equal(prompt_logits(served.model, ids), prompt_logits(ref.model, ids))


def _batched_logits(model: Transformer, prompts: list[list[int]]) -> torch.Tensor:
    """The prompts prefilled together in one forward; the first prompt's logits."""
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    starts = [sum(len(q) for q in prompts[:i]) for i in range(len(prompts))]
    segments = [PrefillSegment(s, s + len(p)) for s, p in zip(starts, prompts, strict=True)]
    kv = PagedKvCache(model.config, -(-len(ids) // 16) + len(prompts), 16, model.dtype)
    meta = AttnMetadata(slot_mapping=torch.arange(len(ids)), prefills=segments)
    return model.logits(model(ids, positions, meta, kv))[: len(prompts[0])]


@pytest.mark.slow  # calibrates, writes and loads a checkpoint
def test_a_requests_logits_do_not_depend_on_its_batch_under_static_scales(tmp_path):
    """Prefilled alone or beside another request, a prompt gets the same logits from the W4A4 checkpoint (up to
    the GEMMs' summation order); the same weights under a scale per call give other logits when batched."""
    dense, out = _w4a4_checkpoint(tmp_path, "compressed-tensors")
    static = _engine(load_model(out), nvfp4_gemm="w4a4").model
    per_call = _engine(dense, quant="nvfp4", nvfp4_gemm="w4a4").model
    quiet, other = PROMPTS[0], [7, 300, 4000, 12, 45000, 9, 31, 2] * 4
    drift = {}
    for name, model in (("static", static), ("per call", per_call)):
        alone = _batched_logits(model, [quiet])
        drift[name] = float((_batched_logits(model, [quiet, other]) - alone).abs().max() / alone.abs().max())
    print(drift)
    assert drift["static"] <= 1e-5 and drift["per call"] > 1e-3


def test_fused_parts_calibrated_apart_share_the_scale_that_clips_none_of_them():
    from services.engine.model import input_scale

    big, small = global_scale_for_amax(torch.tensor(8.0)), global_scale_for_amax(torch.tensor(2.0))
    names = ["layers.0.gate_proj", "layers.0.up_proj"]
    w = {f"{names[0]}.input_scale": small, f"{names[1]}.input_scale": big}
    assert torch.equal(input_scale(w, names), big)  # the larger amax: g_e of 8
    assert input_scale({}, names) is None
    with pytest.raises(ValueError, match="up_proj"):
        input_scale({f"{names[0]}.input_scale": small}, names)


def test_parts_with_their_own_weight_scales_each_take_the_groups_activation_scale(tmp_path):
    """q/k/v quantized apart (three weight tensor scales) load side by side (ConcatLinear), each part under
    the group's static activation scale; the served logits are those of every part quantizing its input so."""
    from services.engine.model import ConcatLinear
    from services.engine.nvfp4.export import write_checkpoint

    model = tiny_llama()
    quantized = {n: quantize(w) for n, w in model.weights.items() if n.rpartition(".")[2] in _PROJECTIONS}
    scales = {n: global_scale_for_amax(torch.tensor(3.0 + i)) for i, n in enumerate(sorted(quantized))}
    for i in range(model.config.num_layers):  # one input, one scale: the loader would take the smallest
        for n in ("k_proj", "v_proj"):
            scales[f"layers.{i}.{n}"] = scales[f"layers.{i}.q_proj"]
        scales[f"layers.{i}.up_proj"] = scales[f"layers.{i}.gate_proj"]
    write_checkpoint(model, quantized, tmp_path, "compressed-tensors", "rtn", _tok(), input_scales=scales)
    served = _engine(load_model(tmp_path), nvfp4_gemm="w4a4")
    qkv = served.model.blocks[1].attn.wqkv
    assert isinstance(qkv, ConcatLinear)
    assert [float(p.input_scale) for p in qkv.parts] == [float(scales["layers.1.q_proj"])] * 3
    g = scales["layers.1.q_proj"]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    x_hat = dequantize(quantize(x, global_scale=g))
    want = torch.cat(
        [F.linear(x_hat, dequantize(quantized[f"layers.1.{n}"])) for n in ("q_proj", "k_proj", "v_proj")], -1
    )
    assert torch.equal(qkv(x), want)


def test_the_gpu_route_hands_the_static_scale_to_the_fp4_gemm(monkeypatch):
    """NVFP4Linear on a (stood-in) Blackwell GPU passes its scale to w4a4_matmul, which quantizes under it; the
    quantizer without Triton gives the recipe's bytes under it too."""
    import sys

    from services.engine.nvfp4 import linear

    x, static, _ = _layer(amax=2.5)
    seen = []
    monkeypatch.setattr(linear, "blackwell_unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(linear, "prepare_weight", lambda w: "prepared")
    monkeypatch.setattr(linear, "w4a4_matmul", lambda x, w, g=None: seen.append((w, g)) or x)
    static._forward_w4a4(x)
    assert seen and seen[0][0] == "prepared" and torch.equal(seen[0][1], static.input_scale)
    monkeypatch.setitem(sys.modules, "services.engine.nvfp4.triton_kernels", None)  # Triton missing
    q = blackwell._quantize_activations(x, static.input_scale)
    want = quantize(x, global_scale=static.input_scale)
    assert torch.equal(q.packed, want.packed) and torch.equal(q.scales, want.scales)
    assert torch.equal(q.global_scale, static.input_scale)


def test_static_scales_enter_the_fingerprint_only_where_they_change_the_function():
    model = tiny_llama()
    packed = {n: quantize(w) for n, w in model.weights.items() if n.rpartition(".")[2] in _PROJECTIONS}
    plain = LoadedModel(config=model.config, weights=dict(model.weights) | packed, source="ckpt",
                        source_format="memory", quantization="nvfp4:compressed-tensors")  # fmt: skip
    scaled = dataclasses.replace(
        plain,
        weights=plain.weights
        | {f"{n}.input_scale": global_scale_for_amax(torch.tensor(5.0)) for n in packed},
    )
    assert _engine(scaled).fingerprint == _engine(plain).fingerprint  # W4A16: the scales are not used
    assert _engine(scaled, nvfp4_gemm="w4a4").fingerprint != _engine(plain, nvfp4_gemm="w4a4").fingerprint

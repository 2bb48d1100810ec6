"""Smoothing before quantizing (`rackserve quantize --smooth ALPHA`): the same function in float32, a smaller
quantization error on the model's real layers, and a checkpoint any reader serves as an ordinary NVFP4 one."""

from __future__ import annotations

import dataclasses
import json
from typing import cast

import pytest
import torch

from services.cli import main as cli_main
from services.engine.loader import load_model
from services.engine.nvfp4 import dequantize, quantize
from services.engine.nvfp4.calibration import (
    _observe_inputs,
    calibrate_input_scales,
    calibration_windows,
    channel_amax,
    collect_hessians,
    observe,
    quantize_model,
)
from services.engine.nvfp4.smoothing import factors, smooth_model
from tests.conftest import tiny_llama
from tests.engine.nvfp4.test_nvfp4_methods import GREEDY, PROMPTS, _dense_hf_dir, _engine, _smollm2, _tok
from tests.engine.test_model_correctness import prompt_logits


def _with_attention_bias(model):
    """tiny_llama with q/k/v biases (added after the smoothed product: they stay as they are)."""
    g = torch.Generator().manual_seed(3)
    w = dict(model.weights)
    for i in range(model.config.num_layers):
        for n, rows in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
            w[f"layers.{i}.{n}.bias"] = torch.randn(rows, generator=g) * 0.3
    cfg = dataclasses.replace(model.config, attention_bias=True)
    return dataclasses.replace(model, config=cfg, weights=w)


@pytest.mark.parametrize("bias", [False, True])
def test_a_smoothed_model_computes_the_same_function_in_float32(bias):
    model = tiny_llama(layers=2)
    if bias:
        model = _with_attention_bias(model)
    windows = [torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    amax = channel_amax(model, windows)
    assert set(amax) == {
        f"layers.{i}.{a}" for i in range(2) for a in ("attn.wqkv", "attn.wo", "ffn.w_gate_up", "ffn.w_down")
    }
    smoothed = smooth_model(model, amax, 0.5)
    # the norm-fed projections and their norms were rescaled; o, down and the embeddings were not
    for n in (
        "q_proj",
        "k_proj",
        "v_proj",
        "gate_proj",
        "up_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ):
        assert not torch.equal(smoothed.weights[f"layers.1.{n}"], model.weights[f"layers.1.{n}"]), n
    for name in ("layers.1.o_proj", "layers.1.down_proj", "embed_tokens", "norm"):
        assert torch.equal(smoothed.weights[name], model.weights[name]), name
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(9))
    want = prompt_logits(_engine(model).model, ids)
    got = prompt_logits(_engine(smoothed).model, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * float(want.abs().max()))


def test_at_alpha_1_every_channel_of_every_smoothed_input_reaches_the_same_maximum():
    """s = max|x_j| / its max: the smoothed model's norm-fed inputs, on the calibration windows, all peak at the
    original's largest value, in every layer; a factor from another layer's (or projection's) maxima would not."""
    model = tiny_llama(layers=3)
    windows = [torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    before = channel_amax(model, windows)
    after = channel_amax(smooth_model(model, before, 1.0), windows)
    for i in range(3):
        for attr in ("attn.wqkv", "ffn.w_gate_up"):
            key = f"layers.{i}.{attr}"
            torch.testing.assert_close(after[key], before[key].max().expand_as(after[key]), rtol=1e-5, atol=0)
        down = f"layers.{i}.ffn.w_down"  # not smoothed: its input is the same function
        torch.testing.assert_close(after[down], before[down], rtol=1e-5, atol=0)


def test_factors_follow_the_activations_and_leave_dead_channels_alone():
    act = torch.tensor([1.0, 100.0, 0.0, 4.0, 50.0])
    w = torch.ones(3, 5)
    w[:, 4] = 0  # a pruned column: what its activation is changes nothing
    s = factors(act, w, 0.5)
    assert float(s.max()) == 1.0 and float(s[1]) == 1.0  # the outlier channel moves the most into W
    # no activation or no weight: the largest factor, so that neither its input nor its norm weight grows
    assert float(s[2]) == float(s[4]) == 1.0
    assert float(s[0]) == pytest.approx(0.1) and float(s[3]) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="not finite"):
        factors(torch.tensor([1.0, float("inf")]), torch.ones(2, 2), 0.5)
    with pytest.raises(ValueError, match="alpha must be in"):
        smooth_model(tiny_llama(), {}, 0.0)


def _inputs(model, windows, keys):
    """The real inputs of the chosen fused projections (`layers.{i}.{attr}`) over the windows."""
    xs: dict[str, list[torch.Tensor]] = {}

    def observe(key, x):
        if key in keys:
            xs.setdefault(key, []).append(x)

    _observe_inputs(model, windows, observe)
    return {k: torch.cat(v) for k, v in xs.items()}


def test_smoothing_lowers_the_w4a4_output_error_of_smollm2s_own_gate_up_projections():
    """On SmolLM2's fused gate/up at the first, a middle and the last layer, with inputs from the calibration
    texts: (x / s) and (W * s), both NVFP4-quantized, give the layer's output closer than x and W quantized as
    they are. Held-out perplexity is in bench/nvfp4_w4a4_bench.py."""
    loaded = _smollm2()
    windows = calibration_windows(_tok(), window=128, max_windows=2)
    keys = {f"layers.{i}.ffn.w_gate_up": i for i in (0, 15, 29)}
    err = {"plain": 0.0, "smoothed": 0.0}
    for key, x in _inputs(loaded, windows, keys).items():
        parts = [loaded.weights[f"layers.{keys[key]}.{n}"] for n in ("gate_proj", "up_proj")]
        w = torch.cat([cast(torch.Tensor, t) for t in parts]).float()
        y = x @ w.T
        s = factors(x.abs().amax(dim=0), w, 0.75)
        for name, (xs, ws) in (("plain", (x, w)), ("smoothed", (x / s, w * s))):
            y_hat = dequantize(quantize(xs)) @ dequantize(quantize(ws)).T
            err[name] += float(((y_hat - y) ** 2).sum() / (y**2).sum())
    assert err["smoothed"] < 0.85 * err["plain"], err  # measured: 0.72x


def test_one_calibration_pass_collects_what_separate_passes_do():
    """`quantize --method gptq --activations nvfp4` takes its Hessians and channel maxima from one forward of the
    windows: the same tensors as a pass for each."""
    model = tiny_llama(layers=2)
    windows = [torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    both = observe(model, windows, hessians=True, amax=True)
    assert both.hessians is not None and both.amax is not None
    hessians, amax = collect_hessians(model, windows), channel_amax(model, windows)
    assert set(both.hessians) == set(hessians) == set(both.amax) == set(amax)
    for k in hessians:
        assert torch.equal(both.hessians[k], hessians[k]) and torch.equal(both.amax[k], amax[k]), k
    # and what they are, from every input kept whole: 2 X^T X / n and max |x| per channel over all windows
    seen: dict[str, list[torch.Tensor]] = {}
    _observe_inputs(model, windows, lambda key, x: seen.setdefault(key, []).append(x.clone()))
    for k, xs in seen.items():
        x = torch.cat(xs).double()
        torch.testing.assert_close(both.hessians[k].double(), 2 * x.T @ x / x.shape[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(both.amax[k].double(), x.abs().amax(0)), k
    only = observe(model, windows, amax=True)
    assert only.hessians is None and only.amax is not None
    with pytest.raises(ValueError, match="hessians, amax or both"):
        observe(model, windows)


@pytest.mark.slow  # calibrates, writes and loads checkpoints
def test_rackserve_quantize_smooth_writes_the_smoothed_model_quantized(tmp_path, capsys):
    model = tiny_llama(vocab=49152)  # the SmolLM2 tokenizer's ids, so the calibration text runs through it
    src = _dense_hf_dir(tmp_path, model)
    out = tmp_path / "smoothed"
    argv = ["quantize", "--model", str(src), "--out", str(out), "--smooth", "0.5", "--activations", "nvfp4"]
    assert cli_main(argv) == 0
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["rackserve"]["smooth_alpha"] == 0.5
    # what it serves: the smoothed model (calibrated on the same text) quantized at load, and the static
    # activation scales of the smoothed model, not the original's
    dense = load_model(src)
    windows = calibration_windows(_tok())
    smoothed = smooth_model(dense, channel_amax(dense, windows), 0.5)
    back = load_model(out)
    assert torch.equal(back.weights["layers.0.input_layernorm"], smoothed.weights["layers.0.input_layernorm"])
    want, unsmoothed = calibrate_input_scales(smoothed, windows), calibrate_input_scales(dense, windows)
    for name in ("layers.0.q_proj", "layers.1.gate_proj", "layers.1.down_proj"):
        assert torch.equal(back.weights[f"{name}.input_scale"], want[name]), name
    assert not torch.equal(want["layers.1.gate_proj"], unsmoothed["layers.1.gate_proj"])
    at_load = _engine(smoothed, quant="nvfp4")
    assert _engine(back).generate(PROMPTS, GREEDY) == at_load.generate(PROMPTS, GREEDY)
    capsys.readouterr()
    bad = ["quantize", "--model", str(src), "--out", str(tmp_path / "x"), "--smooth", "1.5"]
    assert cli_main(bad) == 2
    assert "alpha must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.slow  # calibrates, runs gptq, writes and loads a checkpoint
def test_gptq_with_smoothing_quantizes_the_smoothed_model_under_its_own_hessians(tmp_path):
    """The recipe docs/nvfp4-quality.md recommends (`--method gptq --smooth A --activations nvfp4`): gptq's
    Hessians and the static scales are the smoothed model's inputs, not the original's."""
    src = _dense_hf_dir(tmp_path, tiny_llama(vocab=49152))
    out = tmp_path / "gptq-smoothed"
    argv = ["quantize", "--model", str(src), "--method", "gptq", "--smooth", "0.9", "--activations", "nvfp4"]
    assert cli_main([*argv, "--out", str(out)]) == 0
    rackserve = json.loads((out / "config.json").read_text())["quantization_config"]["rackserve"]
    assert (rackserve["smooth_alpha"], rackserve["activations"], rackserve["gptq"]["act_order"]) == (
        0.9,
        "nvfp4",
        True,
    )
    dense = load_model(src)
    windows = calibration_windows(_tok())
    smoothed = smooth_model(dense, channel_amax(dense, windows), 0.9)
    want = quantize_model(smoothed, "gptq", collect_hessians(smoothed, windows), act_order=True)
    back = load_model(out)
    for name, q in want.items():
        got = back.weights[name]
        assert torch.equal(got.packed, q.packed) and torch.equal(got.scales, q.scales), name  # type: ignore[union-attr]
    # the original model's Hessians would have written other codes: the test tells them apart
    stale = quantize_model(smoothed, "gptq", collect_hessians(dense, windows), act_order=True)
    assert any(not torch.equal(stale[n].packed, q.packed) for n, q in want.items())
    scales = calibrate_input_scales(smoothed, windows)
    for name in ("layers.0.q_proj", "layers.1.up_proj", "layers.1.o_proj"):
        assert torch.equal(back.weights[f"{name}.input_scale"], scales[name]), name

"""The Triton NVFP4 kernels, run on CPU by Triton's interpreter and compared with the torch reference.

Quantize must give the reference's bytes exactly (codes, scales, tensor scale). The W4A16 GEMM must match
x @ dequantize(W).T within fp32 summation-order tolerance, and exactly when x is the identity (which reads the
dequantized weight straight out of the kernel).

TRITON_INTERPRET must be set before triton is imported, and other test modules may import triton for real,
so the kernels run in one child process (this file run as a script) on inputs this process writes to disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.markers import starts_processes
from tests.support.paths import REPO

ANCHOR = [2688.0] + [0.0] * 15
TIES = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def student_t(df: float, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.distributions.StudentT(df).sample(shape)


def e4m3_sweep() -> torch.Tensor:
    """One row per candidate block scale m: [2688, 0...] then a block with amax 6m, so v = g*(6m/6) ~ m.

    m runs over every E4M3 value, every midpoint between neighbours, one fp32 ulp either side of each
    midpoint, and 200 log-uniform values; the kernel's bit-op rounding must agree with torch's cast on all.
    """
    values = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    inf = torch.tensor(float("inf"))
    randoms = torch.exp(torch.empty(200).uniform_(-12, 6, generator=gen(15)))
    m = torch.cat([values, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf), randoms])
    rows = torch.zeros(m.numel(), 32)
    rows[:, 0] = 2688.0
    rows[:, 16] = (6 * m).clamp(max=2688.0)
    return rows


def e2m1_sweep() -> torch.Tensor:
    """Scale-1 blocks (amax 6, g_e = 1) holding every E2M1 threshold, one ulp either side, and randoms."""
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    inf = torch.tensor(float("inf"))
    y = torch.cat([thresholds, torch.nextafter(thresholds, inf), torch.nextafter(thresholds, -inf)])
    y = torch.cat([y, -y, torch.empty(219).uniform_(-6, 6, generator=gen(16))])  # 261 = 29 blocks of 9
    blocks = torch.zeros(29, 16)
    blocks[:, 0] = 6.0
    blocks[:, 1:10] = y.reshape(29, 9)
    return torch.cat([torch.tensor(ANCHOR).expand(29, 16), blocks], dim=1)


QUANTIZE_CASES = [
    "edge_cases",
    "e4m3_sweep",
    "e2m1_sweep",
    "all_zero",
    "negative_zero",
    "k_not_multiple_of_16",
    "gaussian",
    "student_t_df1.5",
    "tiny_amax",
    "bf16",
    "fp16_3d",
    "ones",
]


def quantize_cases() -> dict[str, torch.Tensor]:
    up = torch.nextafter(torch.tensor(TIES), torch.tensor(float("inf"))).tolist()
    down = torch.nextafter(torch.tensor(TIES), torch.tensor(float("-inf"))).tolist()
    edge_rows = [
        ANCHOR + TIES + [-t for t in TIES] + [0.0] * 16,
        ANCHOR + up + down + [0.0] * 16,
        ANCHOR + [6 * 1.0625] + [0.0] * 15 + [6 * 1.1875] + [0.0] * 15,  # E4M3 midpoints
        ANCHOR + [6 * 2.0**-10, -(2.0**-12)] + [0.0] * 14 + [18 * 2.0**-10] + [0.0] * 15,  # zero / subnormal
        ANCHOR + [6 * 2.0**-9, -6 * 2.0**-9, 2.0**-9, 2.0**-11] + [0.0] * 12 + [90 * 2.0**-10] + [0.0] * 15,
        ANCHOR + [6.375, -6.375, -0.0] + [0.0] * 13 + [0.0] * 16,  # saturation, -0.0
    ]
    return {
        "edge_cases": torch.tensor(edge_rows),
        "e4m3_sweep": e4m3_sweep(),
        "e2m1_sweep": e2m1_sweep(),
        "all_zero": torch.zeros(4, 32),
        "negative_zero": torch.full((2, 16), -0.0),
        "k_not_multiple_of_16": torch.randn(37, 200, generator=gen(0)),
        "gaussian": torch.randn(256, 1024, generator=gen(1)),
        "student_t_df1.5": student_t(1.5, (64, 512), seed=14),
        "tiny_amax": torch.randn(16, 64, generator=gen(2)) * 1e-20,
        "bf16": torch.randn(64, 200, generator=gen(3)).to(torch.bfloat16),
        "fp16_3d": torch.randn(2, 3, 48, generator=gen(4)).to(torch.float16),
        "ones": torch.ones(3, 20),
    }


def gemm_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        "fp32": (torch.randn(8, 256, generator=gen(5)), torch.randn(64, 256, generator=gen(6))),
        "bf16": (
            torch.randn(8, 256, generator=gen(7)).to(torch.bfloat16),
            torch.randn(64, 256, generator=gen(8)),
        ),
        "ragged": (torch.randn(5, 100, generator=gen(9)), torch.randn(37, 100, generator=gen(10))),
        "batched_3d": (torch.randn(2, 3, 64, generator=gen(11)), torch.randn(32, 64, generator=gen(12))),
        "identity": (torch.eye(64), torch.randn(48, 64, generator=gen(13)) * 3),
    }


# static activation scales (a W4A4 checkpoint's): g_e of an amax below the input's, so the largest values clip
STATIC_SCALE_CASES = {"gaussian": 1.5, "student_t_df1.5": 4.0, "edge_cases": 2688.0, "bf16": 0.75}


def run_interpreted(inputs_path: Path, outputs_path: Path) -> None:
    """Child process: quantize and multiply every case with the Triton kernels."""
    from services.engine.nvfp4.recipe import global_scale_for_amax, quantize
    from services.engine.nvfp4.triton_kernels import quantize_triton, w4a16_matmul

    inputs = torch.load(inputs_path)
    out: dict[str, object] = {"quantize": {}, "gemm": {}, "gemm_per_byte": {}, "static": {}}
    for name, x in inputs["quantize"].items():
        q = quantize_triton(x)
        out["quantize"][name] = (q.packed, q.scales, q.global_scale, q.shape)  # type: ignore[index]
    for name, amax in STATIC_SCALE_CASES.items():
        g = global_scale_for_amax(torch.tensor(amax))
        q = quantize_triton(inputs["quantize"][name], global_scale=g)
        out["static"][name] = (q.packed, q.scales, q.global_scale)  # type: ignore[index]
    bad = torch.ones(4, 32)
    bad[1, 3] = float("nan")
    try:
        quantize_triton(bad)
        out["nan_checked"] = ""
    except ValueError as e:
        out["nan_checked"] = str(e)
    flag = torch.zeros((), dtype=torch.bool)
    quantize_triton(torch.ones(4, 32), nonfinite=flag)
    out["flag_after_finite"] = bool(flag)
    quantize_triton(
        bad, nonfinite=flag
    )  # the serving path's activations: flagged on the device, no host read
    out["flag_after_nan"] = bool(flag)
    quantize_triton(torch.ones(4, 32), nonfinite=flag)
    out["flag_stays"] = bool(flag)
    for name, (x, w) in inputs["gemm"].items():
        tiles = (16, 32, 64) if name == "ragged" else None  # partial tiles in M, N and K
        out["gemm"][name] = w4a16_matmul(x, quantize(w), tiles=tiles, scale_tile=True)  # type: ignore[index]
        # the pre-Hopper way of loading the block scales (one load per weight byte)
        per_byte = w4a16_matmul(x, quantize(w), tiles=tiles, scale_tile=False)
        out["gemm_per_byte"][name] = per_byte  # type: ignore[index]
    torch.save(out, outputs_path)


@pytest.fixture(scope="module")
@starts_processes
def interpreted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton")
    inputs = {"quantize": quantize_cases(), "gemm": gemm_cases()}
    assert list(inputs["quantize"]) == QUANTIZE_CASES
    torch.save(inputs, tmp / "inputs.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp / "inputs.pt"), str(tmp / "outputs.pt")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreted kernels failed:\n{proc.stdout}\n{proc.stderr}"
    return inputs, torch.load(tmp / "outputs.pt")


@pytest.mark.parametrize("name", QUANTIZE_CASES)
def test_triton_quantize_is_bit_exact_with_the_reference(interpreted, name):
    from services.engine.nvfp4 import quantize

    inputs, outputs = interpreted
    x = inputs["quantize"][name]
    packed, scales, global_scale, shape = outputs["quantize"][name]
    ref = quantize(x)
    assert shape == ref.shape
    assert torch.equal(global_scale, ref.global_scale)
    assert torch.equal(scales, ref.scales), f"{int((scales != ref.scales).sum())} scale bytes differ"
    assert torch.equal(packed, ref.packed), f"{int((packed != ref.packed).sum())} code bytes differ"


@pytest.mark.parametrize("name", list(STATIC_SCALE_CASES))
def test_triton_quantize_under_a_static_scale_gives_the_references_bytes(interpreted, name):
    """W4A4 activations under a checkpoint's static tensor scale, values beyond its amax included (they clip)."""
    from services.engine.nvfp4 import quantize
    from services.engine.nvfp4.recipe import global_scale_for_amax

    inputs, outputs = interpreted
    g = global_scale_for_amax(torch.tensor(STATIC_SCALE_CASES[name]))
    packed, scales, global_scale = outputs["static"][name]
    ref = quantize(inputs["quantize"][name], global_scale=g)
    assert torch.equal(global_scale, g)
    assert torch.equal(scales, ref.scales), f"{int((scales != ref.scales).sum())} scale bytes differ"
    assert torch.equal(packed, ref.packed), f"{int((packed != ref.packed).sum())} code bytes differ"


def test_triton_quantize_edge_cases_hit_the_hand_computed_bytes(interpreted):
    # Spot-check the kernel directly against hand-derived bytes too (see test_nvfp4_recipe.py).
    _, outputs = interpreted
    packed, scales, _, _ = outputs["quantize"]["edge_cases"]
    assert packed[0].tolist()[8:16] == [0x07, 0x22, 0x44, 0x66, 0x8F, 0xAA, 0xCC, 0xEE]
    assert scales[2].tolist() == [0x7E, 0x38, 0x3A]
    assert scales[3].tolist() == [0x7E, 0x00, 0x02]
    assert scales[4].tolist() == [0x7E, 0x01, 0x08]
    assert packed[5].tolist()[8:10] == [0xF7, 0x08]


@pytest.mark.parametrize("name", ["fp32", "ragged", "batched_3d"])
def test_triton_w4a16_fp32_matches_dequantized_matmul(interpreted, name):
    from services.engine.nvfp4 import dequantize, quantize

    inputs, outputs = interpreted
    x, w = inputs["gemm"][name]
    out = outputs["gemm"][name]
    expected = x @ dequantize(quantize(w)).T
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_triton_w4a16_bf16_matches_within_one_bf16_rounding(interpreted):
    from services.engine.nvfp4 import dequantize, quantize

    inputs, outputs = interpreted
    x, w = inputs["gemm"]["bf16"]
    out = outputs["gemm"]["bf16"]
    assert out.dtype == torch.bfloat16
    expected = x.float() @ dequantize(quantize(w)).T
    torch.testing.assert_close(out.float(), expected, rtol=2.0**-7, atol=1e-3)


def test_triton_w4a16_reads_the_exact_dequantized_weight(interpreted):
    from services.engine.nvfp4 import dequantize, quantize

    inputs, outputs = interpreted
    _, w = inputs["gemm"]["identity"]
    assert torch.equal(outputs["gemm"]["identity"], dequantize(quantize(w)).T)


def test_a_nan_input_is_refused_by_default_and_flagged_on_the_device_on_the_activation_path(interpreted):
    """Quantizing a NaN raises with its count (the check reads amax on the host); W4A4 activations set a device
    flag instead (no host sync per linear), which a finite call never sets and never clears."""
    _, outputs = interpreted
    assert "input has 1 non-finite value(s)" in outputs["nan_checked"]
    assert (outputs["flag_after_finite"], outputs["flag_after_nan"], outputs["flag_stays"]) == (
        False,
        True,
        True,
    )


@pytest.mark.parametrize("name", list(gemm_cases()))
def test_triton_w4a16_loads_scales_per_byte_before_hopper_with_the_same_bits(interpreted, name):
    """sm_80/89 load each block scale per weight byte (widening a scale tile spills there): the same products,
    so the same output bit for bit, in every case (partial tiles, bf16, 3-D)."""
    _, outputs = interpreted
    assert torch.equal(outputs["gemm_per_byte"][name], outputs["gemm"][name])


@pytest.mark.parametrize(
    "arch, m, want",
    [
        (90, 32, (64, 64, 128, 4)),
        (80, 32, (64, 64, 128, 8)),
        (89, 64, (64, 64, 128, 8)),
        (80, 1, (16, 64, 128, 4)),
    ],
)
def test_gemm_tiles_take_eight_warps_at_mid_batch_before_hopper(arch, m, want):
    from services.engine.nvfp4.triton_kernels import _gemm_tiles

    assert _gemm_tiles(m, n=16384, arch=arch) == want


if __name__ == "__main__":
    run_interpreted(Path(sys.argv[1]), Path(sys.argv[2]))

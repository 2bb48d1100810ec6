"""`scripts/gpu_check.py --device cpu --smoke`: every step of the GPU acceptance check, at toy sizes on the CPU.

The GPU run happens on a machine reached briefly in one call, so its logic is proven here: the engine's greedy
tokens equal transformers' on the same seeded weights (batched and continuous), the throughput table is filled
against transformers and the bound, and two real worker processes hand KV from prefill to decode with the
aggregated run's tokens. A real run of the script, its report files read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO

pytestmark = pytest.mark.cluster  # starts scripts/gpu_check.py as a process

SCRIPT = REPO / "scripts" / "gpu_check.py"


def run(*args: str, out: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = os.environ | {"OUT": str(out), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cpu_smoke_run_passes_every_step_and_writes_the_report(tmp_path):
    # the watchdog (budget + grace = 180 s) stops a hang first and dumps its stacks into the output below
    r = run("--device", "cpu", "--smoke", "--budget-s", "150", "--grace-s", "30", out=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = {s["step"].split(":")[0]: s for s in report["steps"]}
    assert [s["step"].split(":")[0] for s in report["steps"]] == ["step 1", "step 2", "step 4", "step 3"]
    assert steps["step 1"]["status"] == "skipped"  # the NVFP4 kernels need CUDA
    assert all(steps[k]["status"] == "ok" for k in ("step 2", "step 3", "step 4")), r.stdout[-4000:]

    fp32 = steps["step 2"]["data"]["smollm2-135m float32"]
    assert fp32["batched_identical"] == fp32["continuous_identical"] == 8
    assert fp32["top1_agreement"] == 1.0 and fp32["max_logit_diff"] < 1e-3
    for label in ("smollm2-135m bfloat16", "smollm2-135m bfloat16 nvfp4", "llama3.1-8b bfloat16 nvfp4"):
        assert 0 < steps["step 2"]["data"][label]["top1_agreement"] <= 1, label

    rows = steps["step 3"]["data"]["rows"]
    assert [(x["format"], x["phase"]) for x in rows] == [
        (f, p) for f in ("bf16", "nvfp4") for p in ["decode"] * 3 + ["prefill"]
    ]
    assert all(x["engine_tok_s"] > 0 and x["weight_bytes"] > 0 for x in rows)
    nvfp4, bf16 = rows[4]["weight_bytes"], rows[0]["weight_bytes"]
    assert nvfp4 < bf16  # packed NVFP4 projections are read per step, not a dequantized copy

    staged = steps["step 4"]["data"]["staged"]
    assert staged["equal"] == staged["prompts"] == 8 and staged["largest_bytes"] > 0
    # the import once more while another sequence decodes: written beside its step, both as they run alone
    assert steps["step 4"]["data"]["import_beside"] == {"beside": True, "imported": "equal", "other": "equal"}
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| model | format | phase | batch / tokens | engine tok/s |" in md
    assert "CUDA IPC path: skipped, it needs CUDA" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_asking_for_cuda_without_it_is_a_clear_error_not_a_cpu_run(tmp_path):
    r = run("--device", "cuda", out=tmp_path, timeout=120)
    assert r.returncode != 0
    assert "--device cuda asked for, but torch.cuda.is_available() is False" in r.stdout + r.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_module", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_check  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_the_import_beside_check_forgives_a_near_tie_and_nothing_else():
    """On the GPU the workers run bf16, and beside another sequence a request decodes at batch 2 where its run
    alone was batch 1: the kernels may round the other way where the top two tokens were a near-tie (likelier
    still with the check's random weights). A divergence there is no fault of the written KV; one where the
    reference was sure is, and so is a run of another length."""
    agree = load_gpu_check().agree
    assert agree([5, 6, 7], [5, 6, 7], [9.0, 9.0, 9.0]) == (True, "equal")
    ok, said = agree([5, 6, 8, 1], [5, 6, 7, 2], [9.0, 9.0, 0.01, 9.0])
    assert ok and "near-tie" in said and "token 2" in said
    ok, said = agree([5, 9, 7], [5, 6, 7], [9.0, 0.8, 0.01])
    assert not ok and "DIFFERENT from token 1" in said
    assert agree([5, 6], [5, 6, 7], [9.0, 9.0, 9.0])[0] is False


def test_a_staged_kv_larger_than_shared_memory_is_skipped_and_said_not_written(tmp_path):
    """A container's /dev/shm is 64 MB unless given more; the 4,000-token prompt's KV is ~92 MB, and a write past
    the mount's end kills the prefill worker with SIGBUS. The check measures the mount first."""
    gpu_check = load_gpu_check()
    res = gpu_check.StepResult("4")
    assert gpu_check.shm_fits(res, 4096, 0, 16, where=str(tmp_path))
    assert res.lines == [] and res.status == "ok"
    assert not gpu_check.shm_fits(res, 10**18, 7, 4000, where=str(tmp_path))
    assert res.status == "ok"  # a skip, not a failure
    assert len(res.lines) == 1 and "prompt 7 (4000 tokens" in res.lines[0] and "skipped" in res.lines[0]

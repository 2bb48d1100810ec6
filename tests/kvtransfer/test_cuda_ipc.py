"""CUDA IPC sharing of device tensors (services/kvtransfer/cuda_ipc.py).

On the CPU: the description's JSON shape and every refusal (CPU tensor, another node, the exporting process,
no CUDA, malformed fields). With CUDA: a real second process opens a tensor this one exported and reads its bytes
(skipped without CUDA; `make gpu-check` step 4 also moves KV over this path between two engine processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from services.kvtransfer import cuda_ipc
from services.kvtransfer.cuda_ipc import CudaIpcUnavailable, check_description, describe, open_described
from services.kvtransfer.ticket import node_id
from tests.support.paths import REPO

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def description(**changes: object) -> dict:
    """A well-formed description as another process on this node would send it (JSON round-tripped)."""
    d = {
        "format": cuda_ipc.FORMAT,
        "node": node_id(),
        "pid": os.getpid() + 1,
        "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
        "device_index": 0,
        "handle": "AAAA",
        "storage_size_bytes": 4 * 6 * 2,
        "storage_offset_bytes": 0,
        "ref_counter_handle": "",
        "ref_counter_offset": 0,
        "event_handle": "",
        "event_sync_required": False,
        "dtype": "bfloat16",
        "shape": [4, 6],
        "strides": [6, 1],
        "offset": 0,
    }
    d |= changes
    return json.loads(json.dumps(d))


def test_a_cpu_tensor_is_refused_naming_its_device():
    with pytest.raises(CudaIpcUnavailable, match="cpu"):
        describe(torch.zeros(4))


def test_a_well_formed_description_passes_the_check_after_json():
    check_description(description())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "pickle"}, "format"),
        ({"handle": 5}, "'handle'"),
        ({"pid": True}, "'pid'"),
        ({"dtype": "complex64"}, "dtype"),
        ({"shape": [4, 6, 1]}, "shape"),
        ({"strides": [-6, 1]}, "shape or strides"),
        ({"offset": 1}, "past the end"),
        ({"shape": [5, 6]}, "past the end"),
    ],
)
def test_malformed_descriptions_are_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        check_description(description(**changes))
    with pytest.raises(ValueError, match=message):
        open_described(description(**changes))


def test_a_missing_field_is_named():
    d = description()
    del d["storage_size_bytes"]
    with pytest.raises(ValueError, match="storage_size_bytes"):
        open_described(d)


def test_another_node_is_refused_before_touching_cuda():
    with pytest.raises(CudaIpcUnavailable, match="node other-host/1234"):
        open_described(description(node="other-host/1234"))


def test_the_exporting_process_is_refused():
    with pytest.raises(CudaIpcUnavailable, match="process that exported it"):
        open_described(description(pid=os.getpid()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_without_cuda_opening_is_refused_clearly():
    with pytest.raises(CudaIpcUnavailable, match=r"torch.cuda.is_available\(\) is False"):
        open_described(description())


# ------------------------------------------------------------------------------------------ with CUDA

PRODUCER = textwrap.dedent(
    """
    import json, sys, torch
    from services.kvtransfer.cuda_ipc import describe
    base = torch.arange(4 * 1024 * 1024, dtype=torch.float32, device="cuda").to(torch.bfloat16)
    view = base.view(1024, 4096)[3:10, 5:4005]  # a strided view at an offset inside a larger allocation
    torch.cuda.synchronize()
    print(json.dumps({"desc": describe(view), "sum": float(view.float().sum())}), flush=True)
    sys.stdin.readline()  # keep the allocation alive until the consumer is done
    """
)


@needs_cuda
def test_a_second_process_reads_the_exported_tensor_exactly():
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        msg = json.loads(proc.stdout.readline())
        desc = msg["desc"]
        assert set(desc) == set(cuda_ipc._FIELDS)
        assert desc["shape"] == [7, 4000] and desc["strides"] == [4096, 1] and desc["offset"] == 3 * 4096 + 5
        t = open_described(desc)
        assert t.dtype == torch.bfloat16 and t.shape == (7, 4000) and t.is_cuda
        want = (
            torch.arange(4 * 1024 * 1024, dtype=torch.float32)
            .to(torch.bfloat16)
            .view(1024, 4096)[3:10, 5:4005]
        )
        assert torch.equal(t.cpu(), want)
        assert float(t.float().sum()) == msg["sum"]
        del t
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_cuda
def test_describe_in_the_exporting_process_cannot_be_opened_there():
    t = torch.ones(16, device="cuda")
    with pytest.raises(CudaIpcUnavailable, match="process that exported it"):
        open_described(describe(t))

"""Same-node GPU→GPU KV transfer by CUDA IPC handle: share a device tensor with another process without pickle.

`describe(tensor)` returns a JSON-able dict naming the tensor's CUDA allocation (the IPC memory handle torch's
caching allocator gives out for it, as torch.multiprocessing does), where the tensor lies inside it (storage
offset, shape, strides, dtype) and which physical GPU and node it is on. `open_described(desc)` in another
process on the same node maps that allocation into its own address space and returns a tensor viewing the
producer's memory: the consumer then copies device-to-device into its own cache, which is what UCX's `cuda_ipc`
transport does for NIXL on one node.

Lifetime: the producer must keep the tensor alive until the consumer has copied out of it (the consumer tells it
so). torch's IPC reference counter, carried in the description, keeps the allocation from being reused by the
producer's caching allocator while a consumer still has it open. Refused with `CudaIpcUnavailable`: no CUDA in
this process, another node, a GPU this process cannot see, or the producer's own process (CUDA cannot open an
IPC handle in the process that exported it).
"""

from __future__ import annotations

import base64
import os
from typing import Any

import torch

from .ticket import node_id

FORMAT = "rackserve-cuda-ipc/1"
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int32, torch.int64)
}
_FIELDS = {
    "format": str,
    "node": str,
    "pid": int,
    "device_uuid": str,
    "device_index": int,
    "handle": str,
    "storage_size_bytes": int,
    "storage_offset_bytes": int,
    "ref_counter_handle": str,
    "ref_counter_offset": int,
    "event_handle": str,
    "event_sync_required": bool,
    "dtype": str,
    "shape": list,
    "strides": list,
    "offset": int,
}


class CudaIpcUnavailable(RuntimeError):
    """This pair of processes cannot share device memory by IPC handle; the message says why."""


def _b64(b: bytes | None) -> str:
    return base64.b64encode(b or b"").decode("ascii")


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    """The JSON-able description of a CUDA tensor another process on this node can open (see module doc)."""
    if tensor.device.type != "cuda":
        raise CudaIpcUnavailable(f"CUDA IPC shares device memory; this tensor is on {tensor.device}")
    if tensor.dtype not in _DTYPES.values():
        raise ValueError(f"dtype {tensor.dtype} is not shareable here (supported: {', '.join(_DTYPES)})")
    (
        device,
        handle,
        size_bytes,
        offset_bytes,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = tensor.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
    index = int(device)
    return {
        "format": FORMAT,
        "node": node_id(),
        "pid": os.getpid(),
        "device_uuid": _device_uuid(index),
        "device_index": index,
        "handle": _b64(handle),
        "storage_size_bytes": int(size_bytes),
        "storage_offset_bytes": int(offset_bytes),
        "ref_counter_handle": _b64(ref_handle),
        "ref_counter_offset": int(ref_offset),
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "strides": list(tensor.stride()),
        "offset": int(tensor.storage_offset()),
    }


def check_description(desc: dict[str, Any]) -> None:
    """Raise ValueError naming the first missing or mistyped field of a description."""
    if desc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} description (format {desc.get('format')!r})")
    for name, kind in _FIELDS.items():
        if name not in desc:
            raise ValueError(f"CUDA IPC description lacks {name!r}")
        v = desc[name]
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ValueError(
                f"CUDA IPC description field {name!r} is {type(v).__name__}, not {kind.__name__}"
            )
    if desc["dtype"] not in _DTYPES:
        raise ValueError(f"CUDA IPC description has unknown dtype {desc['dtype']!r}")
    if len(desc["shape"]) != len(desc["strides"]) or not all(
        isinstance(x, int) and x >= 0 for x in desc["shape"] + desc["strides"]
    ):
        raise ValueError("CUDA IPC description has a malformed shape or strides")
    elem = _DTYPES[desc["dtype"]].itemsize
    last = desc["offset"] + sum((n - 1) * s for n, s in zip(desc["shape"], desc["strides"], strict=True))
    if 0 not in desc["shape"] and (last + 1) * elem > desc["storage_size_bytes"]:
        raise ValueError("CUDA IPC description reaches past the end of its storage")


def _local_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if _device_uuid(i) == uuid:
            return i
    raise CudaIpcUnavailable(
        f"the producer's GPU {uuid} is not visible to this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
    )


def open_described(desc: dict[str, Any]) -> torch.Tensor:
    """A tensor viewing the producer's device memory described by `desc` (made by describe() elsewhere)."""
    check_description(desc)
    if desc["node"] != node_id():
        raise CudaIpcUnavailable(f"the tensor is on node {desc['node']}, this process is on {node_id()}")
    if desc["pid"] == os.getpid():
        raise CudaIpcUnavailable("CUDA cannot open an IPC handle in the process that exported it")
    if not torch.cuda.is_available():
        raise CudaIpcUnavailable("CUDA IPC needs CUDA; torch.cuda.is_available() is False in this process")
    # The handle names an allocation on a physical GPU; CUDA_VISIBLE_DEVICES may number it differently here.
    index = _local_index(desc["device_uuid"])
    torch.cuda._lazy_init()  # type: ignore[no-untyped-call]
    storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
        index,
        base64.b64decode(desc["handle"]),
        desc["storage_size_bytes"],
        desc["storage_offset_bytes"],
        base64.b64decode(desc["ref_counter_handle"]),
        desc["ref_counter_offset"],
        base64.b64decode(desc["event_handle"]),
        desc["event_sync_required"],
    )
    dtype = _DTYPES[desc["dtype"]]
    t = torch.empty(0, dtype=dtype, device=f"cuda:{index}")
    return t.set_(storage, desc["offset"], desc["shape"], desc["strides"])


__all__ = ["FORMAT", "CudaIpcUnavailable", "check_description", "describe", "open_described"]

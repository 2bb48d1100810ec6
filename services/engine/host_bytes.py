"""Tensors to and from host bytes for the KV wire formats, with torch doing the copying.

The wire codecs (services/kvtransfer/codec.py, services/engine/nvfp4/kv.py) run on threads beside an event loop
that serves other requests. `bytes.join`, `ndarray.tobytes()` and `bytearray(buffer)` copy while holding the
GIL, tens of milliseconds for a long prompt's KV, and the loop waits that long; torch's copies let it run. So:
read a buffer in place where it can be, and build a payload in one buffer torch fills.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch


def view_of(payload: bytes | bytearray | memoryview, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """The payload's bytes from `offset` on as a flat tensor of `dtype`, without a copy. Read-only payloads
    (bytes) are viewed too: the caller must only read the tensor."""
    raw = memoryview(payload).cast("B")[offset:]
    if len(raw) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():  # "the given buffer is not writable": it is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=dtype)


def joined(parts: Sequence[bytes | torch.Tensor]) -> memoryview:
    """The parts' bytes one after another in one new host buffer (tensors as their raw bytes, from any
    device). The view keeps the buffer alive."""
    flat = [p.contiguous().reshape(-1).view(torch.uint8) if isinstance(p, torch.Tensor) else p for p in parts]
    out = torch.empty(sum(len(p) if isinstance(p, bytes) else p.numel() for p in flat), dtype=torch.uint8)
    at = 0
    for p in flat:
        n = len(p) if isinstance(p, bytes) else p.numel()
        out[at : at + n].copy_(view_of(p, torch.uint8) if isinstance(p, bytes) else p)
        at += n
    return bytes_of(out)


def bytes_of(t: torch.Tensor) -> memoryview:
    """A host tensor's own bytes (made contiguous first if it is not), writable; the view keeps it alive."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]

"""Where the engine computes: parsing `--device`, refusing a device that is not there, and sizing the paged KV
cache from the GPU memory left after the weights and the activations of the largest step.

`auto` means CUDA when torch sees a GPU, else the CPU. Asking for CUDA where there is none is an error that
names the device and what torch sees — a GPU pod must never fall back to CPU inference silently.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

log = logging.getLogger("rackserve.engine")

_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")
GIB = float(1 << 30)


class DeviceUnavailableError(RuntimeError):
    """The configured device does not exist on this machine (or this torch build cannot use it)."""


def parse_device_spec(spec: str) -> tuple[str, int | None]:
    m = _SPEC.match(spec.strip().lower())
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def resolve_device(spec: str) -> torch.device:
    kind, index = parse_device_spec(spec)
    if kind == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA support"
            if torch.version.cuda is None
            else "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES or the pod's nvidia.com/gpu request)"
        )
        raise DeviceUnavailableError(
            f"device {spec!r} was asked for, but {why}; use --device cpu to run on CPU"
        )
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise DeviceUnavailableError(
            f"device {spec!r} was asked for, but only {count} CUDA device(s) are visible"
        )
    return torch.device("cuda", torch.cuda.current_device() if index is None else index)


@dataclass(frozen=True)
class MemoryPlan:
    """How the GPU's memory is shared out; logged at start-up."""

    total_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    other_bytes: (
        int  # used on the device by anything but this process's torch tensors (other processes, context)
    )
    kv_budget_bytes: int
    kv_blocks: int

    def describe(self) -> str:
        return (
            f"GPU memory {self.total_bytes / GIB:.1f} GiB: weights {self.weights_bytes / GIB:.2f} GiB, "
            f"activation peak {self.activation_peak_bytes / GIB:.2f} GiB, other {self.other_bytes / GIB:.2f} GiB "
            f"-> KV cache {self.kv_blocks} blocks ({self.kv_budget_bytes / GIB:.2f} GiB)"
        )


def plan_kv_memory(
    device: torch.device, utilization: float, weights_bytes: int, activation_peak_bytes: int, block_bytes: int
) -> MemoryPlan:
    """KV blocks that fit in `utilization` of the device after what is in use now (the weights, the CUDA
    context, other processes) and the profiled activation peak of the largest step — vLLM's rule. Call it with
    the allocator's cache emptied, so that "in use" is what is really held."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    other = max(0, used - weights_bytes)
    budget = int(total * utilization) - used - activation_peak_bytes
    blocks = max(0, budget // block_bytes)
    plan = MemoryPlan(total, weights_bytes, activation_peak_bytes, other, blocks * block_bytes, blocks)
    if blocks < 1:
        raise DeviceUnavailableError(
            f"no GPU memory is left for the KV cache on {device}: {plan.describe()}; "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens or use a smaller model"
        )
    return plan

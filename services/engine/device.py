"""Where the engine computes: parsing `--device`, refusing a device that is not there, and sizing the paged KV
cache from the GPU memory left after the weights and the activations of the largest step.

`auto` means CUDA when torch sees a GPU, else the CPU. Asking for CUDA where there is none is an error that
names the device and what torch sees — a GPU pod must never fall back to CPU inference silently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.config import parse_device_spec

log = logging.getLogger("rackserve.engine")

GIB = float(1 << 30)


class DeviceUnavailableError(RuntimeError):
    """The configured device does not exist on this machine (or this torch build cannot use it)."""


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
    other_bytes: int  # in use on the device when this engine began: other processes, this process's context
    kv_budget_bytes: int
    kv_blocks: int
    # kept out of the KV cache for KV copies in transit (EngineConfig.kv_transit_bytes)
    reserved_bytes: int = 0

    def describe(self) -> str:
        return (
            f"GPU memory {self.total_bytes / GIB:.1f} GiB: weights {self.weights_bytes / GIB:.2f} GiB, "
            f"activation peak {self.activation_peak_bytes / GIB:.2f} GiB, in use before it "
            f"{self.other_bytes / GIB:.2f} GiB"
            + (f", KV copies in transit {self.reserved_bytes / GIB:.2f} GiB" if self.reserved_bytes else "")
            + f" -> KV cache {self.kv_blocks} blocks ({self.kv_budget_bytes / GIB:.2f} GiB)"
        )


# A step's token budget when --max-num-batched-tokens is 0, vLLM's defaults for an OpenAI server: on a CPU a
# step of 512 tokens already takes long enough to stall the decodes beside it; a GPU runs 2,048 in about the time
# of a decode step's weight reads, and a GPU of 70 GiB or more (H100, H200, B200) 8,192 (fewer, larger steps:
# a long prompt prefills in fewer chunks).
CPU_STEP_TOKENS = 512
GPU_STEP_TOKENS = 2048
BIG_GPU_STEP_TOKENS = 8192
BIG_GPU_BYTES = 70 << 30


def step_token_budget(configured: int, device: torch.device) -> int:
    """--max-num-batched-tokens as given, or (0) the device's default."""
    if configured:
        return configured
    if device.type != "cuda":
        return CPU_STEP_TOKENS
    total = torch.cuda.get_device_properties(device).total_memory
    return BIG_GPU_STEP_TOKENS if total >= BIG_GPU_BYTES else GPU_STEP_TOKENS


def memory_in_use(device: torch.device) -> int:
    """Bytes in use on the device now, by every process (and this one's CUDA context, created by the call)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def plan_kv_memory(
    device: torch.device,
    utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    block_bytes: int,
    in_use_at_start: int = 0,
    reserved_bytes: int = 0,
) -> MemoryPlan:
    """KV blocks that fit in this engine's `utilization` of the device, vLLM's rule: what the engine itself has
    taken since it began (`in_use_at_start`, measured before its weights came: its weights, buffers and cached
    allocations) and the profiled activation peak of the largest step come out of `total x utilization`; what
    other processes held then does not, so workers sharing a GPU at 0.45 each both get their share whichever
    plans first. reserved_bytes (KV copies in transit: the device copies a prefill worker keeps for device-direct
    readers, device-direct pulls not yet written) come out of it too. Never more than is free now. Call it with
    the allocator's cache emptied, so that "in use" is what is really held."""
    free, total = torch.cuda.mem_get_info(device)
    # at least what this process's allocator holds: weights built on the device before the engine began count
    own = max(total - free - in_use_at_start, torch.cuda.memory_reserved(device))
    budget = min(int(total * utilization) - own, free) - activation_peak_bytes - reserved_bytes
    blocks = max(0, budget // block_bytes)
    plan = MemoryPlan(
        total,
        weights_bytes,
        activation_peak_bytes,
        in_use_at_start,
        blocks * block_bytes,
        blocks,
        reserved_bytes,
    )
    if blocks < 1:
        raise DeviceUnavailableError(
            f"no GPU memory is left for the KV cache on {device}: {plan.describe()}, {free / GIB:.2f} GiB free; "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens, --kv-device-copy-bytes or "
            "--kv-device-pull-bytes, or use a smaller model"
        )
    return plan


def host_to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A host list as a tensor on `device`: on CUDA through pinned memory, asynchronously (the copy is queued on
    the stream ahead of the kernels that read it, so the host never waits for the GPU to catch up, as it would for
    a copy from ordinary memory); on the CPU the tensor itself."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_tensor_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, as host_to_device moves a list: on CUDA from pinned memory (torch's caching host
    allocator; reused once the queued copy is done), asynchronously; on the CPU the tensor itself."""
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)

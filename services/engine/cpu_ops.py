"""The engine's fused CPU kernels (csrc/cpu_ops.cpp): build on first use, load with ctypes, call on tensors.

Why: at decode batch sizes the pre-packed GEMMs take only part of a step; the rest is ~40 small torch ops per
layer (norms, rotary, the KV write, the block gather, SDPA, silu) whose dispatch and extra passes over memory
cost as much again. Four kernels replace them (see the C++ file for what each fuses).

The library is compiled once per (source, compiler, CPU) with the system C++ compiler — `-O3 -march=native` —
into a cache directory ($RACKSERVE_KERNEL_CACHE, else ~/.cache/rackserve/kernels, else the temp dir), written
under a temporary name and renamed, so workers starting together never load a half-written file. No compiler,
a failed build, a non-x86/ARM oddity: `load()` returns None with the reason logged once, and the model runs its
torch path (model.py), which computes the same thing.

ctypes releases the GIL for the duration of each call; the OpenMP regions inside run on the libgomp torch has
already loaded (same soname), i.e. torch's own thread pool and `torch.set_num_threads`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("rackserve.engine")

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_ops.cpp"
ABI_VERSION = 1
# -fno-math-errno -fno-trapping-math let floor() vectorize (neither changes a result); no other fast-math, and
# no FMA contraction, so elementwise results round exactly as torch's do. 512-bit vectors where the CPU has them.
CXX_FLAGS = (
    "-O3", "-march=native", "-mprefer-vector-width=512", "-std=c++20", "-fopenmp", "-ffp-contract=off",
    "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC",
)  # fmt: skip
MAX_HEAD_DIM = 256
MAX_GQA_GROUP = 64
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}

_p = ctypes.c_void_p
_i = ctypes.c_int64
_SIGNATURES: dict[str, list[type]] = {
    "rs_rms_norm": [ctypes.c_int, _p, _p, _p, _i, _i, ctypes.c_float],
    "rs_add_rms_norm": [ctypes.c_int, _p, _p, _p, _p, _i, _i, ctypes.c_float],
    "rs_rope_store": [ctypes.c_int, _p, _i, _p, _p, _p, _p, _p, _p, _i, _i, _i, _i],
    "rs_paged_decode_attention": [
        ctypes.c_int,
        _p,
        _i,
        _p,
        _p,
        _p,
        _i,
        _p,
        _p,
        _i,
        _i,
        _i,
        _i,
        _i,
        _i,
        ctypes.c_float,
    ],  # fmt: skip
    "rs_silu_mul": [ctypes.c_int, _p, _p, _i, _i],
}


class CpuOpsUnavailable(RuntimeError):
    """The fused kernels cannot be built or loaded here."""


def _cache_dir() -> Path:
    env = os.environ.get("RACKSERVE_KERNEL_CACHE")
    candidates = [Path(env)] if env else []
    candidates += [
        Path.home() / ".cache" / "rackserve" / "kernels",
        Path(tempfile.gettempdir()) / "rackserve-kernels",
    ]
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise CpuOpsUnavailable(f"no writable kernel cache directory among {[str(c) for c in candidates]}")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise CpuOpsUnavailable("no C++ compiler (g++/c++, or $CXX) to build the fused CPU kernels")
    return cxx


def build(force: bool = False) -> Path:
    """Compile the library if this (source, compiler, CPU) has no build yet; return its path."""
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CpuOpsUnavailable(f"C++ compiler {cxx} does not run: {exc}") from exc
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), cxx, version, " ".join(CXX_FLAGS), _cpu_signature()]).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"rackserve_cpu_ops-{key}.so"
    if out.exists() and not force:
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [cxx, *CXX_FLAGS, str(SOURCE), "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CpuOpsUnavailable(f"building the fused CPU kernels failed: {exc}") from exc
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise CpuOpsUnavailable(
            f"building the fused CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}"
        )
    os.replace(tmp, out)
    return out


@functools.cache
def load() -> ctypes.CDLL | None:
    """The loaded library, or None (reason logged once) when it cannot be built or loaded here."""
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
        if lib.rs_abi_version() != ABI_VERSION:
            raise CpuOpsUnavailable(f"{path} has ABI {lib.rs_abi_version()}, this code expects {ABI_VERSION}")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
    except (CpuOpsUnavailable, OSError) as exc:
        log.warning("fused CPU kernels unavailable, the model runs its torch path: %s", exc)
        return None
    log.info("fused CPU kernels loaded from %s", path)
    return lib


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether a model of this shape and dtype can run on the kernels (and the library loads)."""
    return (
        dtype in _DTYPE_CODE
        and head_dim % 2 == 0
        and head_dim <= MAX_HEAD_DIM
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GQA_GROUP
        and load() is not None
    )


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise CpuOpsUnavailable("the fused CPU kernels are not loaded")
    return lib


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _check(t: torch.Tensor, dtype: torch.dtype | None, name: str) -> None:
    """A contiguous CPU tensor of `dtype` (None: of a dtype the kernels compute in, fp32 or bf16)."""
    ok_dtype = t.dtype in _DTYPE_CODE if dtype is None else t.dtype == dtype
    if not ok_dtype or not t.is_contiguous() or t.device.type != "cpu":
        want = dtype or "float32/bfloat16"
        raise ValueError(f"{name}: need a contiguous CPU {want} tensor, got {t.dtype} {tuple(t.stride())}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x ([rows, hidden]) with an fp32 weight; same dtype out."""
    _check(x, None, "x")
    _check(weight, torch.float32, "weight")
    out = torch.empty_like(x)
    _lib().rs_rms_norm(_DTYPE_CODE[x.dtype], _ptr(x), _ptr(weight), _ptr(out), x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += delta (in place, rounded to its dtype), then RMSNorm of the new residual."""
    _check(residual, None, "residual")
    _check(delta, residual.dtype, "delta")
    _check(weight, torch.float32, "weight")
    out = torch.empty_like(residual)
    _lib().rs_add_rms_norm(
        _DTYPE_CODE[residual.dtype], _ptr(residual), _ptr(delta), _ptr(weight), _ptr(out),
        residual.shape[0], residual.shape[1], eps,
    )  # fmt: skip
    return out


def rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Rotate q and k of qkv ([tokens, (nh + 2 nkv) * hd]) in place by their positions (cos/sin: rope_tables),
    and write each token's k and v into the layer's paged cache ([nkv * blocks, block_size, hd]) at its slot."""
    hd = cos.shape[1]
    _check(qkv, None, "qkv")
    _check(k_cache, qkv.dtype, "k_cache")
    _check(v_cache, qkv.dtype, "v_cache")
    _check(positions, torch.int64, "positions")
    _check(cos, torch.float32, "cos")
    _check(sin, torch.float32, "sin")
    _check(slots, torch.int64, "slots")
    num_slots = k_cache.numel() // (num_kv_heads * hd)
    _lib().rs_rope_store(
        _DTYPE_CODE[qkv.dtype], _ptr(qkv), qkv.shape[0], _ptr(positions), _ptr(cos), _ptr(sin),
        _ptr(k_cache), _ptr(v_cache), _ptr(slots), num_heads, num_kv_heads, hd, num_slots,
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    q: [batch, nh * hd] (rows may be strided, e.g. the q columns of the fused projection's output);
    k_cache/v_cache: one layer, [nkv * blocks, block_size, hd]; tables: int32 [batch, max_blocks] block ids;
    lens: int32 [batch] context lengths (the new token's K/V already stored). Returns [batch, nh * hd].
    """
    hd = k_cache.shape[-1]
    if q.stride(1) != 1 or q.dtype != k_cache.dtype:
        raise ValueError("q must have unit column stride and the cache's dtype")
    _check(k_cache, q.dtype, "k_cache")
    _check(v_cache, q.dtype, "v_cache")
    _check(tables, torch.int32, "tables")
    _check(lens, torch.int32, "lens")
    batch = q.shape[0]
    out = torch.empty(batch, num_heads * hd, dtype=q.dtype)
    num_slots = k_cache.numel() // (num_kv_heads * hd)
    _lib().rs_paged_decode_attention(
        _DTYPE_CODE[q.dtype], _ptr(q), q.stride(0), _ptr(k_cache), _ptr(v_cache), _ptr(tables), tables.shape[1],
        _ptr(lens), _ptr(out), batch, num_heads, num_kv_heads, hd, k_cache.shape[1], num_slots, scale,
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [rows, 2 f] (gate | up); returns [rows, f]."""
    _check(gate_up, None, "gate_up")
    f = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], f, dtype=gate_up.dtype)
    _lib().rs_silu_mul(_DTYPE_CODE[gate_up.dtype], _ptr(gate_up), _ptr(out), gate_up.shape[0], f)
    return out

"""NVFP4 for rackserve: the recipe of docs/nvfp4.md, its kernels, and the pieces the engine plugs in.

Rooms:
- recipe.py        the reference quantize/dequantize in plain torch — the definition every path must match
- layouts.py       linear and 128x4-swizzled block-scale layouts
- triton_kernels   Triton quantize (bit-exact) and W4A16 dequant-GEMM (imports triton; load lazily)
- cuda_kernels     loader for the CUDA quantize kernel in cuda/ (built on first use, GPU machines only)
- blackwell.py     W4A4 through torch._scaled_mm on FP4 tensor cores (compute capability >= 10.0)
- linear.py        NVFP4Linear, the engine's drop-in Linear
- checkpoint.py    ModelOpt and compressed-tensors checkpoint layouts (one tensor)
- prequantized.py  a whole pre-quantized Llama state dict into canonical names; fusing q/k/v, gate/up rows
- kv.py            NVFP4 wire format for KV transfers
- smoothing.py     SmoothQuant's migration folded into the norms before quantizing (`rackserve quantize --smooth`)

Importing this package never imports Triton or compiles anything.
"""

from .checkpoint import detect_layout, from_compressed_tensors, from_modelopt, load_nvfp4_weight
from .kv import dequantize_kv_from_wire, quantize_kv_for_wire
from .layouts import swizzle_scales, unswizzle_scales
from .linear import NVFP4Linear, weight_memory_bytes
from .prequantized import fuse_rows, load_prequantized_weights
from .recipe import QUANT_RECIPE_ID, NVFP4Tensor, dequantize, quantize

__all__ = [
    "QUANT_RECIPE_ID",
    "NVFP4Linear",
    "NVFP4Tensor",
    "dequantize",
    "dequantize_kv_from_wire",
    "detect_layout",
    "from_compressed_tensors",
    "from_modelopt",
    "fuse_rows",
    "load_nvfp4_weight",
    "load_prequantized_weights",
    "quantize",
    "quantize_kv_for_wire",
    "swizzle_scales",
    "unswizzle_scales",
    "weight_memory_bytes",
]

"""A GGUF file's metadata and tensors, read in one pass over a memory map.

The `gguf` package's `GGUFReader` builds a numpy view for every part of every field: for a vocabulary of 49 k
tokens and as many merges that is over a million views and ~5.5 s of CPU, spent twice by each worker (the model
and the tokenizer) and once by the frontend. This reader decodes the header with `struct` into plain Python
values (~0.1 s) and maps each tensor's bytes without copying them; dequantization stays with `gguf.quants`.
Its output is checked field by field and byte by byte against `GGUFReader` in tests/engine/test_gguf_file.py.

Format (GGUF v2 and v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64; each
metadata entry a string key, a u32 value type and the value; each tensor a string name, u32 dims, u64 per dim
(innermost first), u32 ggml type, u64 offset into the data section, which starts at the next multiple of
`general.alignment` (32) after the tensor list.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value type -> struct format of one value (8: string and 9: array are read by hand)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_STRUCTS = {fmt: struct.Struct("<" + fmt) for fmt in (*_SCALARS.values(), "I", "Q")}  # compiled once
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
# tensor types whose values numpy holds as they are (the rest are rows of bytes for gguf.quants)
_PLAIN_TENSORS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # as the file lists it: innermost dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # F32/F16/...: the values, outermost dimension first; quantized: uint8 rows of blocks


class GgufFile:
    """`fields` (key -> int, float, bool, str or list), `tensors` (in file order), `get(key, default)`.
    Raises ValueError naming the file for a bad magic, an unsupported version or a truncated file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)  # type: ignore[arg-type]
        self._pos = 0
        try:
            self.fields, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"{self.path}: truncated or corrupt GGUF ({e})") from e

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    # ---- parsing ----------------------------------------------------------------------------------------------

    def _take(self, fmt: str) -> Any:
        layout = _STRUCTS[fmt]
        (value,) = layout.unpack_from(self._buf, self._pos)
        self._pos += layout.size
        return value

    def _string(self) -> str:
        n = self._take("Q")
        end = self._pos + n
        if end > len(self._buf):
            raise ValueError(f"{self.path}: truncated GGUF (a string runs past the end of the file)")
        text = bytes(self._buf[self._pos : end]).decode("utf-8")
        self._pos = end
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._take(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            sub, n = self._take("I"), self._take("Q")
            if sub in _NUMPY:  # numbers: one read of the whole array
                dtype = np.dtype(_NUMPY[sub]).newbyteorder("<")
                end = self._pos + n * dtype.itemsize
                if end > len(self._buf):
                    raise ValueError(f"{self.path}: truncated GGUF (an array runs past the end of the file)")
                out = np.frombuffer(self._buf, dtype=dtype, count=n, offset=self._pos).tolist()
                self._pos = end
                return out
            return [self._value(sub) for _ in range(n)]
        raise ValueError(f"{self.path}: unknown GGUF value type {kind} at byte {self._pos}")

    def _parse(self) -> tuple[dict[str, Any], list[GgufTensor]]:
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ValueError(
                f"{self.path}: not a GGUF file (magic {bytes(self._buf[:4])!r}, expected b'GGUF')"
            )
        self._pos = 4
        version = self._take("I")
        if version not in (2, 3):
            if version & 0xFFFF == 0:
                raise ValueError(f"{self.path}: a big-endian GGUF, which this reader does not support")
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_fields = self._take("Q"), self._take("Q")
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            fields[key] = self._value(self._take("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._take("Q") for _ in range(self._take("I")))
            infos.append((name, dims, GGMLQuantizationType(self._take("I")), self._take("Q")))
        align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0:
            raise ValueError(f"{self.path}: general.alignment is {align!r}, not a positive integer")
        start = -(-self._pos // align) * align
        tensors = [self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos]
        return fields, tensors

    def _tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, at: int) -> GgufTensor:
        rows = tuple(reversed(dims))  # outermost first, as numpy lays them out
        block, nbytes = GGML_QUANT_SIZES[kind]
        if kind in _PLAIN_TENSORS:
            dtype = np.dtype(_PLAIN_TENSORS[kind]).newbyteorder("<")
            shape, size = rows, int(np.prod(rows, dtype=np.int64)) * dtype.itemsize
        else:
            if dims[0] % block:
                raise ValueError(
                    f"{self.path}: tensor {name} has rows of {dims[0]}, not whole {kind.name} blocks"
                )
            dtype = np.dtype(np.uint8)
            shape = (*rows[:-1], dims[0] // block * nbytes)
            size = int(np.prod(shape, dtype=np.int64))
        if at + size > len(self._map):
            raise ValueError(f"{self.path}: truncated GGUF (tensor {name} runs past the end of the file)")
        data = self._map[at : at + size].view(dtype).reshape(shape)
        return GgufTensor(name, dims, kind, data)

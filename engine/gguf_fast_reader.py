"""A small GGUF reader: metadata and tensor views in well under a second.

``gguf.GGUFReader`` builds numpy views for every element of every metadata array; on a file with
a 262k-token vocabulary (Gemma 3) that takes ~19 s per open on these machines. This reader walks
the header with ``struct`` over one memory map, decodes numeric arrays with ``np.frombuffer`` and
string arrays with one loop, and exposes tensors the way ``engine.gguf_common.dequantize_tensor`` reads them
(``name``, ``shape`` in GGUF order, ``tensor_type``, ``data`` as the raw typed/byte array).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_MISSING = object()


@dataclass
class GGUFTensor:
    """One tensor: ``shape`` in GGUF order (innermost first), ``data`` a view into the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


class FastGGUF:
    """Parsed GGUF file: ``fields`` (key -> Python value; arrays as lists) and ``tensors``.

    Raises ``ValueError`` naming the file when it is not a GGUF file or is truncated.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self.fields, self.tensors = self._parse()
        except (struct.error, ValueError, KeyError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a valid GGUF file: {self.path}: {exc or type(exc).__name__}") from exc

    def meta(self, key: str, default: Any = _MISSING) -> Any:
        """Value of metadata ``key``; ``ValueError`` when it is absent and no default is given."""
        if key in self.fields:
            return self.fields[key]
        if default is _MISSING:
            raise ValueError(f"GGUF metadata key {key!r} is missing in {self.path}")
        return default

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        if self._pos + n > len(self._buf):
            raise ValueError("string runs past the end of the file")
        s = self._buf[self._pos : self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._read("<I"), self._read("<Q")
            if etype in _NUMPY:
                arr = np.frombuffer(self._buf, dtype=_NUMPY[etype], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(etype) for _ in range(count)]
        return self._read(_SCALARS[vtype])

    def _parse(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if self._buf[:4] != b"GGUF":
            raise ValueError(f"bad magic {self._buf[:4]!r} (expected b'GGUF')")
        self._pos = 4
        version, n_tensors, n_kv = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        fields = {}
        for _ in range(n_kv):
            key = self._string()
            fields[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name, n_dims = self._string(), self._read("<I")
            dims = tuple(self._read("<Q") for _ in range(n_dims))
            infos.append((name, dims, GGMLQuantizationType(self._read("<I")), self._read("<Q")))
        align = int(fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        tensors = []
        for name, dims, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            rows = tuple(reversed(dims[1:]))
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                dt = np.float32 if qtype == GGMLQuantizationType.F32 else np.float16
                shape, dtype = (*rows, dims[0]), dt
            else:
                shape, dtype = (*rows, dims[0] // block * type_size), np.uint8
            count = int(np.prod(shape))
            if start + offset + count * np.dtype(dtype).itemsize > len(self._buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = np.frombuffer(self._buf, dtype=dtype, count=count, offset=start + offset).reshape(shape)
            tensors.append(GGUFTensor(name, dims, qtype, data))
        return fields, tensors

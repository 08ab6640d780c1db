"""A checkpoint's tensors read on access, in the dtype they are stored in.

``engine.loader`` returns a :class:`CheckpointTensors`: a read-only mapping from HuggingFace names to
sources that know each tensor's shape and dtype and read it on demand. For a HF folder the source is
a :class:`StoredTensor` (file, byte range, stored dtype): a lookup reads that tensor's bytes from its
shard straight into a new CPU tensor of the stored dtype (bfloat16 stays bfloat16), and no float32
copy is made. For a GGUF file it is ``engine.gguf_source.GGUFSource``: a lookup dequantizes that one
tensor to float32 (the quantization's own math). Nothing is held between lookups: the model
(``engine.model``) converts each tensor to the serving dtype and layout as it takes it, so a load
holds the built model plus about one fused group of weights, never the checkpoint.

The bytes are read with ``readinto`` rather than through a memory map: a mapped shard's pages count
in the process's resident set as long as the map lives, so mapping every shard for the whole load
would show the checkpoint's size again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

# safetensors dtype codes -> torch dtypes (the ones torch has; others are refused when read)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100_000_000  # the safetensors format's own limit on the JSON header


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors shard: ``nbytes`` bytes at absolute ``offset`` of ``path``, stored
    as ``code`` (the header's dtype code), shaped ``shape``. ``dtype``: the torch dtype, None for a
    code torch does not have (reading it raises ``ValueError``)."""

    path: Path
    code: str
    shape: tuple[int, ...]
    offset: int

    @property
    def dtype(self) -> torch.dtype | None:
        return SAFETENSORS_DTYPES.get(self.code)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def split(self, sizes: list[int]) -> tuple[StoredTensor, ...]:
        """The tensor's rows cut into consecutive blocks of ``sizes`` rows (``sum(sizes)`` is the row
        count), each its own byte range: ``torch.Tensor.split``'s contract, reading nothing."""
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        parts, row = [], 0
        for n in sizes:
            parts.append(replace(self, shape=(n, *self.shape[1:]), offset=self.offset + row * row_bytes))
            row += n
        return tuple(parts)

    def read(self) -> torch.Tensor:
        """A new CPU tensor of the stored dtype holding the bytes (the one copy this read makes);
        ``ValueError`` for a dtype torch lacks or a file shorter than the header said."""
        if self.dtype is None:
            raise ValueError(f"{self.path}: tensor dtype {self.code} is not supported")
        out = torch.empty(self.shape, dtype=self.dtype)
        if out.numel() == 0:
            return out
        buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with self.path.open("rb", buffering=0) as f:
            f.seek(self.offset)
            got = _read_into(f, buf)
        if got != len(buf):
            raise ValueError(f"not a valid safetensors file: {self.path}: truncated tensor data")
        return out


def _read_into(f, buf: memoryview) -> int:
    """Fill ``buf`` from unbuffered file ``f``; the bytes read (short only at the end of the file).
    One ``read`` call returns at most about 2 GiB on Linux, less than a large embedding."""
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])
        if not n:
            break
        got += n
    return got


def read_header(path: Path) -> tuple[dict, int]:
    """``(header, data start)``: the JSON header of safetensors file ``path`` (``__metadata__``
    dropped) and the byte offset its data offsets count from; ``ValueError``
    ``not a valid safetensors file: ...`` for a header that is short, not a JSON object, or names
    a byte range outside the file or not the size of its shape and dtype."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"not a valid safetensors file: {path}: bad header length")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a valid safetensors file: {path}: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"not a valid safetensors file: {path}: header is not a JSON object")
    header.pop("__metadata__", None)
    for key, entry in header.items():
        _check_entry(path, key, entry, size - 8 - n)
    return header, 8 + n


def _check_entry(path: Path, key: str, entry, data_size: int) -> None:
    """``ValueError`` unless ``entry`` has a dtype, a shape and in-file data offsets of its size."""
    try:
        code, shape = entry["dtype"], [int(d) for d in entry["shape"]]
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a valid safetensors file: {path}: bad entry for {key!r}") from exc
    if not 0 <= begin <= end <= data_size:
        raise ValueError(f"not a valid safetensors file: {path}: {key!r} lies outside the file")
    dtype = SAFETENSORS_DTYPES.get(code)
    if dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"not a valid safetensors file: {path}: {key!r} has the wrong byte count")


def shard_tensors(files: list[Path]) -> dict[str, StoredTensor]:
    """Every tensor of the shards ``files`` by name (headers only; a later shard's name wins)."""
    out: dict[str, StoredTensor] = {}
    for f in files:
        header, data = read_header(f)
        for key, e in header.items():
            out[key] = StoredTensor(f, e["dtype"], tuple(int(d) for d in e["shape"]), data + int(e["data_offsets"][0]))
    return out


class TensorSource(Protocol):
    """What :class:`CheckpointTensors` reads: a shape and dtype known without reading, and ``read()``,
    a new CPU tensor of that shape and dtype on every call."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype | None: ...

    def read(self) -> torch.Tensor: ...


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """Read-only mapping name -> tensor, each lookup a fresh read of the source (``StoredTensor``'s
    ``read``: the stored dtype, on CPU). Names, ``shape`` and ``dtype`` come from the headers alone.
    Two names may share one source (a tied LM head): their lookups are equal, not the same object."""

    def __init__(self, sources: Mapping[str, TensorSource]) -> None:
        self._sources = dict(sources)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._sources[name].read()

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape, reading nothing."""
        return self._sources[name].shape

    def dtype(self, name: str) -> torch.dtype | None:
        """Tensor ``name``'s stored dtype (None: one torch lacks), reading nothing."""
        return self._sources[name].dtype

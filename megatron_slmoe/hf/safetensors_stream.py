"""Write a safetensors file one tensor at a time.

``safetensors.torch.save_file`` needs every tensor in memory at once; an export of a model with
hundreds of experts per layer must not. The format is a little-endian u64 header length, a JSON
header (dtype, shape and byte range of every tensor, in file order) and the raw bytes; the header
depends only on names, dtypes and shapes, so it is written first and each tensor is made
(``produce()``) and written in turn. Peak memory: one tensor.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.utils.atomic import fsync_path

DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
               torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its name, dtype and shape up front, its values from ``produce()``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class WindowedReader:
    """``get_tensor`` / ``get_slice`` of one safetensors file, reopened after every
    ``unmap_after_bytes`` read: safetensors maps the file, and the pages a read touched stay
    resident until the file is closed, so reading a large file whole would hold it all."""

    def __init__(self, path: str, unmap_after_bytes: int = 64 * 2**20) -> None:
        self.path, self.unmap_after_bytes = path, unmap_after_bytes
        self._handle, self._read = None, 0

    def _open(self):
        from safetensors import safe_open

        if self._handle is not None and self._read > self.unmap_after_bytes:
            self.close()
        if self._handle is None:
            try:
                self._handle, self._read = safe_open(self.path, framework="pt", device="cpu"), 0
            except Exception as err:  # noqa: BLE001  (safetensors raises untyped errors)
                reason = " ".join(str(err).split())[:200]
                raise HFCheckpointError(f"{self.path}: not a readable safetensors file "
                                        f"({reason}; truncated or damaged?)") from None
        return self._handle

    def keys(self):
        return self._open().keys()

    def get_slice(self, name: str):
        return self._open().get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self._open().get_tensor(name)
        self._read += tensor.nbytes
        return tensor

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle = None

    def __enter__(self) -> "WindowedReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_streamed(path: str, tensors: Sequence[PlannedTensor],
                   metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write ``tensors`` into the safetensors file ``path`` (a staging path: the caller renames
    it into place), producing one at a time; returns the file size. A produced tensor whose
    dtype or shape differs from its plan is a RuntimeError (a bug, not bad input)."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(encoded)))
        fh.write(encoded)
        for t in tensors:
            value = t.produce()
            if value.dtype != t.dtype or tuple(value.shape) != tuple(t.shape):
                raise RuntimeError(f"{t.name}: produced {value.dtype} {list(value.shape)}, "
                                   f"planned {t.dtype} {list(t.shape)}")
            fh.write(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        fh.flush()
    fsync_path(path)
    return os.path.getsize(path)

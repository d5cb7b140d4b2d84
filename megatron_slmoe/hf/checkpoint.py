"""A Hugging Face checkpoint directory, read lazily: ``config.json`` and safetensors shards.

``HFCheckpoint.open(directory)`` reads ``config.json`` and the *headers* of the shards (the
8-byte length and the JSON table at the start of a safetensors file: names, dtypes, shapes, byte
ranges) and checks them before any tensor data is touched: a shard the index names but that is
missing, a truncated shard (its table claims bytes past the end of the file), a tensor the index
places in a file that does not hold it, a tensor in two shards. Each is one
:class:`HFCheckpointError` line naming the file and the tensor. Shards may come with
``model.safetensors.index.json`` or without it (one or several ``*.safetensors`` files).

Reading is by slice (``safe_open(...).get_slice``): only the requested rows/columns of a tensor are
copied out of the file. A file is memory-mapped while it is read, and the mapped pages a read
touches count towards the process's resident memory until the file is unmapped, so
:class:`SliceReader` unmaps (closes) a file once the reads since it was opened have touched more
than ``unmap_after_bytes`` (64 MiB): beyond its own shard, a rank holds at most that plus one
source tensor. (Closing after every tensor would bound it by one tensor, at the cost of parsing a
shard's header once per tensor, which dominated load time.)

Block-scaled FP8 weights (DeepSeek-V3, Kimi-K2: ``float8_e4m3fn`` with a ``<name>_scale_inv``
tensor of one fp32 scale per ``weight_block_size`` block) are dequantised slice by slice as they
are read (``ops.quantized_weights.dequantize_block_fp8``).

Weights packed by compressed-tensors (``<name>_packed`` with ``<name>_scale``: Kimi K3's MXFP4
experts, uint8 nibbles with an E8M0 byte per 32 inputs; Kimi-K2.5's INT4 ``pack-quantized``,
int32 words of eight nibbles with a scale per group) appear in the catalogue under ``<name>``
with their logical shape as well, so the family tables name them as any weight; a read decodes
the slice (rows, and columns at group boundaries) with ``ops.quantized_weights``;
``read_packed`` gives the same slice as stored (packed values and scales, nothing decoded), for
experts held packed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from megatron_slmoe.families.errors import HFCheckpointError
from megatron_slmoe.ops.quantized_weights import (
    INT4,
    MXFP4,
    MXFP4_GROUP,
    decode_int4,
    decode_mxfp4,
    dequantize_block_fp8,
)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"

_FP8 = ("F8_E4M3", "F8_E5M2")
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit on the JSON table


PACKED_SUFFIX, PACKED_SCALE_SUFFIX = "_packed", "_scale"
_PACKED_FORMATS = {"U8": (MXFP4, 2), "I32": (INT4, 8)}  # packed dtype -> (format, values/element)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its shard, dtype (safetensors spelling, or the packed format of a
    compressed-tensors weight), shape (the logical one for a packed weight), byte range."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    packed: Optional[str] = None
    """A packed weight: the key of its packed tensor (its scales: :attr:`scale`)."""
    scale: Optional[str] = None
    group: int = 0
    """Inputs per scale of a packed weight."""

    @property
    def is_fp8(self) -> bool:
        return self.dtype in _FP8


def _packed_weights(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The logical weights of compressed-tensors' packed pairs (``<name>_packed`` and
    ``<name>_scale``), each checked: a packed tensor without its scale, or a scale whose size
    does not fit the packed tensor, is one line."""
    found = {}
    for key, info in tensors.items():
        if not key.endswith("weight" + PACKED_SUFFIX):
            continue
        name = key[:-len(PACKED_SUFFIX)]
        if info.dtype not in _PACKED_FORMATS or len(info.shape) != 2:
            raise HFCheckpointError(f"{info.file}: tensor {key} is {info.dtype} "
                                    f"{list(info.shape)}; a packed weight is 2-D uint8 (MXFP4) "
                                    f"or int32 (INT4 pack-quantized)")
        scale = tensors.get(name + PACKED_SCALE_SUFFIX)
        if scale is None:
            raise HFCheckpointError(f"{info.file}: tensor {key} has no {name}"
                                    f"{PACKED_SCALE_SUFFIX} in any shard (a packed weight needs "
                                    f"its scales)")
        fmt, per_element = _PACKED_FORMATS[info.dtype]
        rows, columns = info.shape[0], info.shape[1] * per_element
        groups = scale.shape[1] if len(scale.shape) == 2 else 0
        group = MXFP4_GROUP if fmt == MXFP4 else (columns // groups if groups else 0)
        if (len(scale.shape) != 2 or scale.shape[0] != rows or not group
                or groups * group != columns):
            raise HFCheckpointError(f"{scale.file}: tensor {name}{PACKED_SCALE_SUFFIX} has shape "
                                    f"{list(scale.shape)}; {key} {list(info.shape)} ({fmt}, "
                                    f"{columns} inputs) needs [{rows}, "
                                    f"{columns // (group or MXFP4_GROUP)}]")
        found[name] = TensorInfo(info.file, fmt, (rows, columns), info.nbytes + scale.nbytes,
                                 packed=key, scale=name + PACKED_SCALE_SUFFIX, group=group)
    return found


def _read_header(path: str) -> dict[str, TensorInfo]:
    """The tensor table of one shard, checked against the file's size (truncation)."""
    name = os.path.basename(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFCheckpointError(f"{path}: truncated safetensors file ({size} bytes, no "
                                        f"header)")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER or 8 + length > size:
                raise HFCheckpointError(f"{path}: truncated or not a safetensors file (header of "
                                        f"{length} bytes, file of {size})")
            table = json.loads(f.read(length))
    except OSError as err:
        raise HFCheckpointError(f"{path}: cannot read ({err.strerror or err})") from None
    except (ValueError, UnicodeDecodeError):
        raise HFCheckpointError(f"{path}: not a safetensors file (unreadable header)") from None
    if not isinstance(table, dict):
        raise HFCheckpointError(f"{path}: not a safetensors file (header is not a table)")
    data_bytes = size - 8 - length
    tensors = {}
    for key, entry in table.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise HFCheckpointError(f"{path}: tensor {key}: malformed header entry") from None
        if end > data_bytes:
            raise HFCheckpointError(f"{path}: truncated: tensor {key} needs bytes up to "
                                    f"{8 + length + end}, the file has {size}")
        tensors[key] = TensorInfo(name, dtype, shape, end - begin)
    return tensors


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise HFCheckpointError(f"{path}: no {what} in the checkpoint directory") from None
    except OSError as err:
        raise HFCheckpointError(f"{path}: cannot read {what} ({err.strerror})") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise HFCheckpointError(f"{path}: {what} is not valid JSON ({err})") from None


class HFCheckpoint:
    """config.json and the tensor catalogue of a Hugging Face checkpoint directory."""

    def __init__(self, directory: str, config: dict, tensors: dict[str, TensorInfo]) -> None:
        self.directory = directory
        self.config = config
        self.tensors = tensors

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "HFCheckpoint":
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise HFCheckpointError(f"{directory}: no such checkpoint directory")
        config = _read_json(os.path.join(directory, CONFIG_FILE), "config.json")
        if not isinstance(config, dict):
            raise HFCheckpointError(f"{os.path.join(directory, CONFIG_FILE)}: not a JSON object")
        return cls(directory, config, _catalogue(directory))

    @property
    def config_path(self) -> str:
        return os.path.join(self.directory, CONFIG_FILE)

    def path(self, info: TensorInfo) -> str:
        return os.path.join(self.directory, info.file)

    def where(self, key: str) -> str:
        """``<file>: tensor <key>`` for messages."""
        info = self.tensors.get(key)
        return f"{self.path(info) if info else self.directory}: tensor {key}"

    def scale_of(self, key: str) -> Optional[str]:
        """The block-scale tensor of an FP8 weight (``<key>_scale_inv``), checked to exist."""
        scale = key + SCALE_SUFFIX
        if scale not in self.tensors:
            raise HFCheckpointError(f"{self.where(key)} is FP8 but {scale} is in no shard "
                                    f"(block-scaled FP8 needs its weight_scale_inv)")
        return scale

    def fp8_block_size(self) -> tuple[int, int]:
        quant = self.config.get("quantization_config") or {}
        block = quant.get("weight_block_size")
        if (quant.get("quant_method") != "fp8" or not isinstance(block, list) or len(block) != 2
                or not all(isinstance(n, int) and n > 0 for n in block)):
            raise HFCheckpointError(f"{self.config_path}: the checkpoint holds FP8 tensors but "
                                    f"quantization_config is not block-scaled fp8 with a "
                                    f"weight_block_size [rows, cols] (got {quant!r})")
        return block[0], block[1]


def _catalogue(directory: str) -> dict[str, TensorInfo]:
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index_path):
        index = _read_json(index_path, "the safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFCheckpointError(f"{index_path}: no weight_map in the index")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not isinstance(name, str) or os.path.basename(name) != name:
                raise HFCheckpointError(f"{index_path}: weight_map names {name!r}, not a file in "
                                        f"the checkpoint directory")
            if not os.path.isfile(os.path.join(directory, name)):
                example = next(k for k, v in weight_map.items() if v == name)
                raise HFCheckpointError(f"{os.path.join(directory, name)}: missing shard (the "
                                        f"index places tensor {example} in it)")
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise HFCheckpointError(f"{directory}: no *.safetensors shards and no {INDEX_FILE}")
        weight_map = None
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        for key, info in _read_header(os.path.join(directory, name)).items():
            if key in tensors:
                raise HFCheckpointError(f"{os.path.join(directory, name)}: tensor {key} is also "
                                        f"in {tensors[key].file}")
            tensors[key] = info
    if weight_map is not None:
        for key, name in weight_map.items():
            info = tensors.get(key)
            if info is None or info.file != name:
                raise HFCheckpointError(f"{os.path.join(directory, name)}: tensor {key} is not in "
                                        f"this shard, though {INDEX_FILE} places it there")
    tensors.update(_packed_weights(tensors))
    return tensors


# --- reading slices ------------------------------------------------------------------------------


Index = tuple  # of slices and ints, one per leading dimension


def _as_slices(index: Index, shape: Sequence[int]) -> list[slice]:
    """An index of slices/ints over ``shape`` as one unit-step slice per dimension."""
    out = []
    for dim, size in enumerate(shape):
        item = index[dim] if dim < len(index) else slice(None)
        if isinstance(item, int):
            out.append(slice(item, item + 1))
        else:
            start, stop, step = item.indices(size)
            if step != 1:
                raise ValueError("only unit-step slices are read")
            out.append(slice(start, stop))
    return out


class SliceReader:
    """Reads slices of a checkpoint's tensors.

    ``read(key, index)`` returns the sub-tensor ``tensor[index]`` (``index``: unit-step slices or
    ints per leading dimension) as a fresh tensor (FP8 weights dequantised to fp32). Reads should
    go file by file: a file is unmapped when a read moves to another file, when the reads since it
    was opened touched more than ``unmap_after_bytes`` (see the module doc), and by :meth:`close`.
    """

    def __init__(self, checkpoint: HFCheckpoint, unmap_after_bytes: int = 64 * 2**20) -> None:
        self.checkpoint = checkpoint
        self.unmap_after_bytes = unmap_after_bytes
        self._handle = None
        self._handle_file: Optional[str] = None
        self._touched = 0  # bytes of the file the reads since opening may have mapped in
        self.bytes_read = 0

    def __enter__(self) -> "SliceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the open file: the pages read from it leave resident memory."""
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle = self._handle_file = None
        self._touched = 0

    def _file(self, key: str):
        from safetensors import safe_open

        info = self.checkpoint.tensors[key]
        if info.file != self._handle_file or self._touched > self.unmap_after_bytes:
            self.close()
        if self._handle is None:
            path = self.checkpoint.path(info)
            try:
                handle = safe_open(path, framework="pt")
                self._handle = handle.__enter__()
            except Exception as err:  # safetensors raises its own untyped errors
                raise HFCheckpointError(f"{path}: cannot open ({' '.join(str(err).split())})") \
                    from None
            self._handle_file = info.file
        return self._handle

    def _raw(self, key: str, slices: list[slice]) -> torch.Tensor:
        info = self.checkpoint.tensors[key]
        try:
            handle = self._file(key)
            # The rows a read spans are mapped in whole (a column slice touches every row).
            rows = slices[0].stop - slices[0].start if slices else 1
            self._touched += info.nbytes * rows // max(1, info.shape[0] if info.shape else 1)
            return handle.get_slice(key)[tuple(slices)]
        except HFCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001
            raise HFCheckpointError(f"{self.checkpoint.where(key)}: cannot read "
                                    f"({' '.join(str(err).split())})") from None

    def read(self, key: str, index: Index = ()) -> torch.Tensor:
        info = self.checkpoint.tensors.get(key)
        if info is None:
            raise HFCheckpointError(f"{self.checkpoint.directory}: tensor {key} is in no shard")
        slices = _as_slices(index, info.shape)
        for dim, (s, size) in enumerate(zip(slices, info.shape)):
            if not 0 <= s.start <= s.stop <= size:
                raise HFCheckpointError(f"{self.checkpoint.where(key)}: rows {s.start}:{s.stop} "
                                        f"of dim {dim} are outside its shape {list(info.shape)}")
        if info.packed is not None:
            values = self._unpacked(key, info, slices)
        elif not info.is_fp8:
            values = self._raw(key, slices)
        else:
            values = self._dequantized(key, info, slices)
        squeeze = [d for d, item in enumerate(index) if isinstance(item, int)]
        for d in reversed(squeeze):
            values = values.squeeze(d)
        self.bytes_read += values.numel() * values.element_size()
        return values

    def read_packed(self, key: str, index: Index = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, scale) of the slice ``[rows, cols]`` of the packed weight ``key`` (its logical
        name and coordinates), as stored: nothing decoded. Columns are cut at group bounds; a
        block-FP8 weight gives its FP8 values and the scale_inv blocks the slice starts in (rows
        and columns cut at block bounds)."""
        info = self.checkpoint.tensors.get(key)
        if info is None:
            raise HFCheckpointError(f"{self.checkpoint.directory}: tensor {key} is in no shard")
        if info.packed is None and not info.is_fp8:
            raise HFCheckpointError(f"{self.checkpoint.where(key)} is {info.dtype}, not a packed "
                                    f"weight")
        slices = _as_slices(index, info.shape)
        for dim, (s, size) in enumerate(zip(slices, info.shape)):
            if not 0 <= s.start <= s.stop <= size:
                raise HFCheckpointError(f"{self.checkpoint.where(key)}: rows {s.start}:{s.stop} "
                                        f"of dim {dim} are outside its shape {list(info.shape)}")
        if info.is_fp8:
            packed, scale = self._fp8_slices(key, info, slices, aligned=True)
        else:
            packed, scale = self._packed_slices(key, info, slices)
        self.bytes_read += sum(t.numel() * t.element_size() for t in (packed, scale))
        return packed, scale

    def _packed_slices(self, key: str, info: TensorInfo, slices: list[slice]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = slices
        per_element = _PACKED_FORMATS[self.checkpoint.tensors[info.packed].dtype][1]
        if cols.start % info.group or (cols.stop % info.group and cols.stop != info.shape[1]):
            raise HFCheckpointError(f"{self.checkpoint.where(key)}: columns {cols.start}:"
                                    f"{cols.stop} cut its {info.dtype} groups of {info.group}")
        packed = self._raw(info.packed, [rows, slice(cols.start // per_element,
                                                     cols.stop // per_element)])
        scale = self._raw(info.scale, [rows, slice(cols.start // info.group,
                                                   math.ceil(cols.stop / info.group))])
        return packed, scale

    def _unpacked(self, key: str, info: TensorInfo, slices: list[slice]) -> torch.Tensor:
        """The slice of a packed weight, decoded (MXFP4 exactly in fp32; INT4 in its scales'
        dtype, as compressed-tensors computes it)."""
        packed, scale = self._packed_slices(key, info, slices)
        if info.dtype == MXFP4:
            return decode_mxfp4(packed, scale)
        return decode_int4(packed, scale, info.group)

    def _dequantized(self, key: str, info: TensorInfo, slices: list[slice]) -> torch.Tensor:
        values, scales = self._fp8_slices(key, info, slices)
        rows, cols = slices
        return dequantize_block_fp8(values, scales, rows, cols, self.checkpoint.fp8_block_size())

    def _fp8_slices(self, key: str, info: TensorInfo, slices: list[slice], aligned: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 values of the slice and the scale_inv blocks it touches (``aligned``: the
        slice must start on block bounds)."""
        if len(info.shape) != 2:
            raise HFCheckpointError(f"{self.checkpoint.where(key)}: FP8 tensor of shape "
                                    f"{list(info.shape)}; block scales are defined for 2-D weights")
        block = self.checkpoint.fp8_block_size()
        scale_key = self.checkpoint.scale_of(key)
        scale_info = self.checkpoint.tensors[scale_key]
        want = tuple(math.ceil(n / b) for n, b in zip(info.shape, block))
        if scale_info.shape != want:
            raise HFCheckpointError(f"{self.checkpoint.where(scale_key)} has shape "
                                    f"{list(scale_info.shape)}; weight {key} {list(info.shape)} "
                                    f"in blocks of {list(block)} needs {list(want)}")
        if aligned and any(s.start % b or (s.stop % b and s.stop != n)
                           for s, b, n in zip(slices, block, info.shape)):
            raise HFCheckpointError(f"{self.checkpoint.where(key)}: rows/columns "
                                    f"{[(s.start, s.stop) for s in slices]} cut its FP8 blocks of "
                                    f"{list(block)}")
        values = self._raw(key, slices)
        scale_slices = [slice(s.start // b, math.ceil(s.stop / b)) for s, b in zip(slices, block)]
        return values, self._raw(scale_key, scale_slices)


"""The tensors of a Hugging Face model directory, read from their safetensors headers, a row range at a time.

In a safetensors file (the format's specification, github.com/huggingface/safetensors) an
8-byte header length and a JSON header give each tensor's dtype, shape and byte range; its data
is row-major, so a run of rows of dim 0 is one contiguous byte range. :class:`SafetensorsFiles`
parses the headers and reads those ranges through pyarrow's filesystems, so the same code serves
a local directory and object storage (``s3://``, ``gs://``, ...): what lets each rank read only
its own shard (:mod:`.hf_import`).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ray_titan import storage
from ray_titan.checkpoint.hf_config import INDEX, SINGLE, HFCheckpointError
from ray_titan.checkpoint.manifest import _outside
from ray_titan.models.gpt_oss.mxfp4 import dequantize_mxfp4

__all__ = ["MAX_HEADER_BYTES", "SafetensorsFiles"]

MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header (and ``model.safetensors.index.json``) read, in bytes: the
``safetensors`` library's own limit (its ``MAX_HEADER_SIZE``). Real headers are kilobytes to a
few megabytes (about 100 bytes per tensor); the length is checked before anything is read, so a
damaged or hostile length is refused without reading or allocating it."""

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "U8": torch.uint8}
_PACKED = ("_blocks", "_scales")
"""Suffixes of an MXFP4-packed tensor's two parts (gpt-oss's expert weights; uint8, the only
tensors of that dtype a checkpoint may hold: ``ray_titan.models.gpt_oss.mxfp4``)."""


@dataclass(frozen=True)
class _Entry:
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


class SafetensorsFiles:
    """The tensors of a Hugging Face checkpoint, by name, read from their safetensors headers.

    Files: those ``model.safetensors.index.json`` names, else ``model.safetensors``; ``extra``:
    side files read too when present (the router bias; :meth:`read_extra` adds more later).
    Only headers are read at construction (8-byte length + JSON per file, at most
    :data:`MAX_HEADER_BYTES`); :meth:`read_rows` reads one contiguous byte range. Works on a
    local directory or any URI pyarrow's filesystems read. Raises :class:`HFCheckpointError`
    naming the file: no weights file, an unreadable, malformed or oversized header or index, a
    tensor the index places in a file that lacks it.

    Own parsing rather than ``safetensors.safe_open``: that opens local paths only, and the
    same code must read object storage; the header length is capped at the library's limit.
    """

    def __init__(self, path: str, extra: tuple[str, ...] = ()):
        self.path = path
        self.entries: dict[str, _Entry] = {}
        self._files: dict[str, Any] = {}
        index_file = storage.join(path, INDEX)
        if storage.exists(index_file):
            try:
                fs, p = storage.resolve(index_file)
                with fs.open_input_file(p) as f:
                    if f.size() > MAX_HEADER_BYTES:
                        raise ValueError(f"{f.size()} bytes; valid: at most {MAX_HEADER_BYTES} (MAX_HEADER_BYTES)")
                    weight_map = json.loads(f.read())["weight_map"]
                if not (isinstance(weight_map, dict)
                        and all(isinstance(v, str) for v in weight_map.values())):
                    raise ValueError("weight_map is not an object of tensor name -> file name")
            except Exception as e:
                raise HFCheckpointError(f"{index_file} is unreadable: {type(e).__name__}: {e}") from None
            # The checkpoint manifest's rule (name only: a Hugging Face cache's snapshot files are
            # symbolic links into its blobs), for every file before any is opened.
            for key, name in weight_map.items():
                if (why := _outside(name)) is not None:
                    raise HFCheckpointError(
                        f"{index_file}: weight_map places {key} in {name!r}, {why}; valid: a file name relative "
                        f"to {path}, without '..'")
            for name in sorted(set(weight_map.values())):
                self._read_header(name)
            for key, name in weight_map.items():
                if key not in self.entries or self.entries[key].file != name:
                    raise HFCheckpointError(f"{index_file} places {key} in {name}, which does not hold it")
        elif storage.exists(storage.join(path, SINGLE)):
            self._read_header(SINGLE)
        else:
            raise HFCheckpointError(f"{path} has neither {INDEX} nor {SINGLE}")
        self.model_keys = set(self.entries)
        self.read_extra(extra)

    def read_extra(self, names: tuple[str, ...]) -> None:
        """Read the headers of the side files ``names`` that exist (the router bias)."""
        for name in names:
            if name not in self._files and storage.exists(storage.join(self.path, name)):
                self._read_header(name)

    def _open(self, name: str):
        if name not in self._files:
            fs, p = storage.resolve(storage.join(self.path, name))
            self._files[name] = fs.open_input_file(p)
        return self._files[name]

    def _read_header(self, name: str) -> None:
        file = storage.join(self.path, name)
        try:
            f = self._open(name)
            size = f.size()
            (n,) = struct.unpack("<Q", f.read_at(8, 0))
            # Checked before the read: a damaged length is refused without reading it.
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file's {size} bytes")
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"header length {n} exceeds {MAX_HEADER_BYTES} bytes (MAX_HEADER_BYTES; real "
                                 "headers are kilobytes to a few megabytes)")
            header = json.loads(f.read_at(n, 8))
            if not isinstance(header, dict):
                raise ValueError(f"the header holds a {type(header).__name__}, not a JSON object")
        except FileNotFoundError:
            raise HFCheckpointError(f"{file} does not exist") from None
        except Exception as e:
            raise HFCheckpointError(f"{file} is not a readable safetensors file: {type(e).__name__}: {e}") from None
        header.pop("__metadata__", None)
        for key, h in header.items():
            try:
                begin, end = h["data_offsets"]
                shape = tuple(h["shape"])
                if not all(type(x) is int for x in (begin, end, *shape)):
                    raise TypeError("data_offsets and shape must be integers")
                entry = _Entry(name, str(h["dtype"]), shape, 8 + n + begin, end - begin)
            except Exception as e:
                raise HFCheckpointError(f"{file}: tensor {key}'s header entry is malformed: "
                                        f"{type(e).__name__}: {e}") from None
            if entry.dtype not in _DTYPES:
                raise HFCheckpointError(
                    f"{file}: tensor {key} has dtype {entry.dtype}; supported: {sorted(_DTYPES)}"
                )
            if (min(entry.shape, default=0) < 0 or begin < 0 or entry.nbytes != math.prod(entry.shape)
                    * _DTYPES[entry.dtype].itemsize or 8 + n + end > size):
                raise HFCheckpointError(f"{file}: tensor {key}'s bytes do not match its shape {list(entry.shape)}")
            self.entries[key] = entry

    def packed(self, key: str) -> tuple[_Entry, _Entry] | None:
        """The MXFP4 ``(blocks, scales)`` entries that hold ``key`` when the files have those
        instead of ``key`` itself (gpt-oss's released expert weights), else None."""
        if key in self.entries:
            return None
        parts = tuple(self.entries.get(key + suffix) for suffix in _PACKED)
        return (parts[0], parts[1]) if parts[0] is not None and parts[1] is not None else None

    def read_rows(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of dim 0 of tensor ``key`` (all of it by default), in the
        file's dtype, as a new CPU tensor; an MXFP4-packed ``key`` (:meth:`packed`) is
        dequantised to fp32 as transformers does (``ray_titan.models.gpt_oss.mxfp4``)."""
        if self.packed(key) is not None:
            blocks, scales = (self.read_rows(key + suffix, start, stop) for suffix in _PACKED)
            return dequantize_mxfp4(blocks, scales)
        e = self.entries[key]
        if not e.shape:
            start, stop, row_bytes = 0, 1, e.nbytes
        else:
            stop = e.shape[0] if stop is None else stop
            row_bytes = e.nbytes // e.shape[0] if e.shape[0] else 0
        data = self._open(e.file).read_at((stop - start) * row_bytes, e.start + start * row_bytes)
        dtype = _DTYPES[e.dtype]
        t = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        return t.reshape(e.shape) if not e.shape else t.reshape(stop - start, *e.shape[1:])

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


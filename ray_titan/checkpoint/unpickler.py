"""Reading a checkpoint without unrestricted pickle: DCP's ``.metadata`` through an unpickler
that builds only DCP's own metadata classes, non-tensor values with ``torch.load(weights_only=True)``,
and checks that the metadata points only into the files the manifest lists."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ray_titan.checkpoint.manifest import CheckpointError, _outside

MAX_METADATA_BYTES = 2 * 2**30
"""DCP's ``.metadata``: about 150 bytes per saved chunk (tensors × shards): tens of MB for a
405B model on hundreds of ranks, hundreds of MB at tens of thousands of shards. DCP itself
unpickles it whole on every rank."""



# The classes and objects DCP's ``.metadata`` pickles, by (module, name), and nothing else: no
# module is trusted as a whole (a module's namespace holds what it imports, ``os`` included), and a
# dotted name (protocol 4 resolves ``STACK_GLOBAL "m" "os.system"`` attribute by attribute) is
# never looked up. Resolved here once, so unpickling imports nothing and calls no ``getattr``.
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    import collections
    import pathlib

    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md
    import torch.serialization

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_md, name)
        for name in ("Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
                     "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                     "_MEM_FORMAT_ENCODING")
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # layout by name
    allowed.update({("pathlib", n): getattr(pathlib, n) for n in ("PosixPath", "PurePosixPath")})
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed.update({("torch", n): getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)})
    return allowed


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _allowed_globals()
"""Every global a checkpoint's ``.metadata`` may name: ``(module, name) -> object``."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: builds only the objects of :data:`ALLOWED_GLOBALS` (DCP's
    metadata dataclasses, ``torch.Size``, dtypes, layouts, paths) from plain data, and refuses any
    other global, a dotted name, an extension code or a persistent id with
    ``pickle.UnpicklingError`` (Python docs, pickle, "Restricting Globals"). Nothing else a pickle
    can call exists on its stack, so a crafted file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        obj = ALLOWED_GLOBALS.get((module, name)) if "." not in name else None
        if obj is None:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a persistent id")


def load_metadata(path: str | Path) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint directory ``path``, read with
    :class:`MetadataUnpickler`. Raises :class:`CheckpointError` for a missing or unreadable file,
    a refused global, or anything that is not DCP ``Metadata``."""
    path = Path(path)
    try:
        with open(path / ".metadata", "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_METADATA_BYTES:
                raise CheckpointError(f"checkpoint {path}: .metadata has {size} bytes; valid: at most "
                                      f"{MAX_METADATA_BYTES} (MAX_METADATA_BYTES); not a checkpoint this "
                                      "ray_titan wrote")
            metadata = MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: DCP metadata file .metadata is missing") from None
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: .metadata is unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path}: .metadata holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def check_metadata(metadata: Metadata, path: str | Path, files: dict[str, Any]) -> None:
    """Refuse DCP metadata that does not describe this checkpoint's files: every entry is DCP's
    tensor or bytes metadata under a string key; every storage entry points into a file the
    manifest lists (``files``: name -> ``{"bytes", ...}``), within its size, with no transform
    (ray_titan writes none). Raises :class:`CheckpointError` naming the path and the entry."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: .metadata {what}; not a checkpoint this ray_titan wrote")

    sdm = metadata.state_dict_metadata
    if not isinstance(sdm, dict):
        raise bad(f"has state_dict_metadata of type {type(sdm).__name__}")
    for key, md in sdm.items():
        if not isinstance(key, str) or not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise bad(f"has entry {key!r} of type {type(md).__name__}")
        if isinstance(md, TensorStorageMetadata) and not isinstance(md.size, torch.Size):
            raise bad(f"gives {key!r} a size of type {type(md.size).__name__}")
    if not isinstance(metadata.storage_data, dict):
        raise bad(f"has storage_data of type {type(metadata.storage_data).__name__}")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"has a storage entry {type(index).__name__} -> {type(info).__name__}")
        name, offset, length = info.relative_path, info.offset, info.length
        why = _outside(name)
        if why is not None:
            raise bad(f"points {index.fqn!r} to {name!r}, {why} (outside the checkpoint)")
        entry = files.get(name)
        if entry is None:
            raise bad(f"points {index.fqn!r} to {name!r}, which the manifest does not list")
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
                and offset + length <= entry["bytes"]):
            raise bad(f"points {index.fqn!r} to bytes {offset!r}+{length!r} of {name} ({entry['bytes']} bytes)")
        if getattr(info, "transform_descriptors", None):
            raise bad(f"asks for transforms {info.transform_descriptors!r} on {index.fqn!r}")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_metadata(str(self.path))
        # DCP opens <path>/<relative_path> for each storage entry: none may lead outside.
        for index, info in getattr(metadata, "storage_data", {}).items():
            why = _outside(getattr(info, "relative_path", None))
            if why is not None:
                raise CheckpointError(f"checkpoint {self.path}: .metadata points {getattr(index, 'fqn', index)!r} "
                                      f"to {getattr(info, 'relative_path', None)!r}, {why} (outside the checkpoint)")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor values with ``torch.load(weights_only=True)``
    (plain containers and numbers only) instead of unrestricted pickle."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

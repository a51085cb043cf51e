"""Sharded checkpoints of the whole training state with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``step-NNNNNNNN`` holding:

- the DCP files: ``.metadata`` and one ``__<rank>_0.distcp`` per rank. Keys are flat, prefixed by
  what they belong to: ``model.<fqn>`` (FSDP2 shards as ``DTensor``), ``optimizer.state.<fqn>.*``
  and ``optimizer.param_groups.<fqn>.*`` (torch's flattened optimizer state dict, keyed by the
  whole model's parameter names, so it reshards across pp, dp_replicate, dp_shard, tp and ep: every
  tensor is saved with its global shape), ``lr_scheduler.*``,
  ``dataloader.*`` (the stream position, the same on every rank), ``train.step`` and
  ``rng.rank<r>.*`` (each rank's torch RNG state);
- ``reports/rank<r>.json``: the metric reports rank ``r`` had not yet seen on disk at the collector
  (resent after a restart, so a worker crash loses no metrics);
- ``hf/`` (``HF_DIR``), written by rank 0: the job's Hugging Face tokenizer files
  (``data.tokenizer_path`` as ``tokenizer.json``, and ``TOKENIZER_FILES`` beside it) and
  ``checkpoint.initial_load_hf``'s ``config.json``, read once when the job starts: what
  ``ray-titan export`` writes beside the weights, so that it reads nothing outside the checkpoint;
- ``ray_titan_checkpoint.json`` (the manifest), written last: step, mesh, model, optimizer, data
  settings, and every file's size and CRC-32. A directory without a valid manifest, or whose
  files do not match it, is incomplete or corrupt and is never loaded or picked as the latest.
  Every name the manifest lists, and every file DCP's ``.metadata`` points into, must be a
  relative path inside the directory (no absolute path, ``..`` or symbolic link): a checkpoint
  cannot make ray_titan stat, read or copy a file elsewhere.

Under Ray every rank writes its share to a local staging directory and hands it to
``ray.train.report(checkpoint=...)``, which copies all ranks' files into one directory under the
run's storage path and keeps the latest ``keep_latest_k``; a restarted worker group gets the
latest from ``ray.train.get_checkpoint()``. Without Ray the ranks write straight to
``<run_dir>/checkpoints``.

Loading unpickles nothing unrestricted: DCP's ``.metadata`` is read with an unpickler that only
builds DCP's own metadata classes, and non-tensor values with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import stat
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ray_titan.fault import all_finite

__all__ = [
    "ALLOWED_GLOBALS",
    "HF_DIR",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "MAX_METADATA_BYTES",
    "TOKENIZER_FILES",
    "CheckpointError",
    "Checkpointer",
    "LocalCheckpointStorage",
    "MetadataUnpickler",
    "ModelParts",
    "RayTrainCheckpointStorage",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "check_compatible",
    "check_metadata",
    "checkpoint_candidates",
    "find_latest",
    "load_metadata",
    "read_manifest",
    "remove_staging",
    "resolve_checkpoint",
    "saved_reports",
    "staging_root",
    "step_dir_name",
]

MANIFEST = "ray_titan_checkpoint.json"
HF_DIR = "hf"
"""The checkpoint's subdirectory holding the job's Hugging Face tokenizer files and the imported
``config.json`` (what ``ray-titan export`` writes beside the weights)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
"""The tokenizer files kept in a checkpoint's ``hf/`` and copied beside an export: the job's
``data.tokenizer_path`` (as ``tokenizer.json``) and those of the others beside it."""

# Files read whole are size-checked first against these bounds, so a huge or sparse file where a
# small one belongs is refused at once instead of read into memory; each is far above real sizes.
# (A Hugging Face config.json's and tokenizer.json's: storage.MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES.)
MAX_MANIFEST_BYTES = 64 * 2**20
"""A checkpoint's manifest: about 100 bytes per file it lists (a ``.distcp`` and a metrics report
per rank), so about 1 MB at 10,000 ranks."""
MAX_METADATA_BYTES = 2 * 2**30
"""DCP's ``.metadata``: about 150 bytes per saved chunk (tensors × shards): tens of MB for a
405B model on hundreds of ranks, hundreds of MB at tens of thousands of shards. DCP itself
unpickles it whole on every rank."""
FORMAT = 2
"""2: the data position is (epoch, document, offset); 1 saved the loader's unread tokens."""
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this job; the message names
    the path and the problem."""


def step_dir_name(step: int) -> str:
    """``step-NNNNNNNN``: sorts by step."""
    return f"step-{step:08d}"


def _outside(name: Any) -> str | None:
    """Why ``name`` (a file a checkpoint's manifest or ``.metadata`` names) could be outside the
    checkpoint directory, from the name alone; None for a relative path without ``..``."""
    if not isinstance(name, str) or not name or "\0" in name:
        return "not a file name"
    if PurePosixPath(name).is_absolute():
        return "an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "a path with '..'"
    return None


def _inside(path: Path, name: Any) -> Path:
    """``path / name`` for a file the manifest of checkpoint ``path`` lists, after checking, before
    anything outside the checkpoint is opened or stat'ed, that it stays inside: a relative path
    without ``..`` through no symbolic link (ray_titan writes none; one could point anywhere), each
    component ``lstat``-ed from the top. Raises :class:`CheckpointError` naming the checkpoint, the
    entry and why; a missing component is left to the caller's "missing" check."""
    why = _outside(name)
    if why is None:
        at = path
        for part in PurePosixPath(name).parts:
            at = at / part
            try:
                if stat.S_ISLNK(os.lstat(at).st_mode):
                    why = f"a path through the symbolic link {at.relative_to(path).as_posix()}"
                    break
            except OSError:
                break
    if why is not None:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} lists {name!r}, {why}; a checkpoint's files are relative paths "
            "inside its directory, without '..' or symbolic links; not a checkpoint this ray_titan wrote"
        )
    return path / name


# -- reading without unrestricted pickle ------------------------------------------------------

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


# -- manifest and completeness ----------------------------------------------------------------

def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_entries(directory: Path) -> dict[str, dict[str, int]]:
    """Every file under ``directory`` but the manifest: relative name -> bytes and CRC-32."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"):
            out[p.relative_to(directory).as_posix()] = {"bytes": p.stat().st_size, "crc32": _crc32(p)}
    return out


def read_manifest(path: str | Path, verify_checksums: bool = False) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` after checking that it is complete: the manifest
    exists and parses, every name it lists is a file inside ``path`` (relative, without ``..``, through
    no symbolic link: checked for all before any is stat'ed), and each exists with its size (and
    CRC-32 when ``verify_checksums``). Raises :class:`CheckpointError` naming the path and the
    problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no {MANIFEST} (a save that did not finish, "
            "or not a ray_titan checkpoint)"
        )
    size = mpath.stat().st_size
    if size > MAX_MANIFEST_BYTES:  # checked before the read: a huge file is not read into memory
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} has {size} bytes; valid: at most {MAX_MANIFEST_BYTES} "
                              "(MAX_MANIFEST_BYTES); not a checkpoint this ray_titan wrote")
    try:
        manifest = json.loads(mpath.read_text())
        files, step = manifest["files"], int(manifest["step"])
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt: {type(e).__name__}: {e}") from None
    if manifest.get("format") not in (1, FORMAT):
        raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r}; this ray_titan reads 1, {FORMAT}")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists no DCP .metadata")
    # Every name first: nothing outside the checkpoint is stat'ed (its size would be disclosed) or read.
    checked = {name: _inside(path, name) for name in files}
    for name, entry in files.items():
        if not (isinstance(entry, dict) and all(isinstance(entry.get(k), int) for k in ("bytes", "crc32"))):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt: the entry of {name} is {entry!r}, "
                                  "not {'bytes': <int>, 'crc32': <int>}")
    for name, entry in files.items():
        f = checked[name]
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if f.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has {f.stat().st_size} bytes, the manifest says {entry['bytes']}"
            )
        if verify_checksums and _crc32(f) != entry["crc32"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} fails its CRC-32 check")
    manifest["step"] = step
    return manifest


def saved_reports(path: Path, from_rank: int = 0) -> dict[int, list[dict[str, Any]]]:
    """The metric reports checkpoint ``path`` holds (``reports/rank<r>.json``: what rank ``r``
    had not yet seen on disk at the collector when it saved), by rank, for ranks >= ``from_rank``;
    empty where there are none. Raises ``OSError``/``ValueError`` for an unreadable file."""
    out = {}
    for f in sorted((path / "reports").glob("rank*.json")):
        if f.stem[4:].isdigit() and int(f.stem[4:]) >= from_rank:
            out[int(f.stem[4:])] = json.loads(f.read_text())
    return out


def find_latest(directory: str | Path) -> Path | None:
    """The complete checkpoint with the highest step among ``directory``'s ``step-*`` children
    (incomplete or corrupt ones are skipped), or None."""
    directory = Path(directory)
    candidates = sorted(directory.glob("step-*"), reverse=True) if directory.is_dir() else []
    for p in candidates:
        try:
            read_manifest(p)
            return p
        except CheckpointError:
            continue
    return None


def checkpoint_candidates(path: str | Path, setting: str = "checkpoint.load_path") -> list[Path]:
    """The checkpoints ``path`` may mean, the one to try first first: ``[path]`` if it is a
    checkpoint (it has a manifest or DCP metadata, or is named ``step-*``), else the complete
    ones (manifest and file sizes checked) in it or in its ``checkpoints/``, newest first.
    Raises :class:`CheckpointError` naming ``setting`` (where the path came from) and the path
    when there is none."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{setting} = {str(path)!r} does not exist")
    if (path / MANIFEST).exists() or (path / ".metadata").exists() or path.name.startswith("step-"):
        read_manifest(path)
        return [path]
    for d in (path, path / "checkpoints"):
        complete = [p for p in sorted(d.glob("step-*"), reverse=True) if _is_complete(p)] if d.is_dir() else []
        if complete:
            return complete
    raise CheckpointError(f"{setting} = {str(path)!r} holds no complete checkpoint (step-* with {MANIFEST})")


def _is_complete(path: Path) -> bool:
    try:
        read_manifest(path)
        return True
    except CheckpointError:
        return False


def resolve_checkpoint(path: str | Path, setting: str = "checkpoint.load_path") -> Path:
    """``path`` itself if it is a checkpoint (it has a manifest or DCP metadata), else the latest
    complete checkpoint in it or in its ``checkpoints/``. Raises :class:`CheckpointError` naming
    ``setting`` (where the path came from) and the path."""
    return checkpoint_candidates(path, setting)[0]


def _hf_files(cfg) -> dict[str, bytes]:
    """What a checkpoint of job ``cfg`` keeps in ``hf/`` for an export, by file name: the job's
    Hugging Face tokenizer (``data.tokenizer_path``, as ``tokenizer.json``) and the other
    :data:`TOKENIZER_FILES` beside it, and ``checkpoint.initial_load_hf``'s ``config.json``. Small
    files (kilobytes to tens of MB). Raises :class:`CheckpointError` naming the setting and the
    file that cannot be read."""
    from ray_titan import storage

    wanted: list[tuple[str, str, str, bool]] = []  # (name in hf/, file, setting, required)
    tokenizer = cfg.data.tokenizer_path if cfg.data.tokenizer == "huggingface" else None
    if tokenizer:
        wanted.append((TOKENIZER_FILES[0], tokenizer, "data.tokenizer_path", True))
        wanted += [(n, storage.sibling(tokenizer, n), "data.tokenizer_path", False) for n in TOKENIZER_FILES[1:]]
    if cfg.checkpoint.initial_load_hf:
        wanted.append(("config.json", storage.join(cfg.checkpoint.initial_load_hf, "config.json"),
                       "checkpoint.initial_load_hf", True))
    out = {}
    for name, file, setting, required in wanted:
        bound, what = ((storage.MAX_TOKENIZER_BYTES, "MAX_TOKENIZER_BYTES") if name == TOKENIZER_FILES[0]
                       else (storage.MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES"))
        try:
            if required or storage.exists(file):
                out[name] = storage.read_bytes(file, bound, what)
        except Exception as e:
            raise CheckpointError(f"{setting}: cannot read {file} to keep it in the checkpoints (for "
                                  f"ray-titan export): {type(e).__name__}: {e}") from None
    return out


def _job_manifest(cfg, vocab_size: int) -> dict[str, Any]:
    p = cfg.parallelism
    return {
        # tp and dp_replicate only where they exist: a mesh without them reads as before.
        "mesh": {"pp": p.pp, "dp_shard": p.dp_shard, "stages_per_rank": p.stages_per_rank,
                 **{a: getattr(p, a) for a in ("dp_replicate", "tp") if getattr(p, a) > 1}},
        "world_size": cfg.world_size,
        "model": {"name": cfg.model.name, "flavor": cfg.model.flavor, "vocab_size": vocab_size},
        "optimizer": cfg.optimizer.name,
        "data": {"source": cfg.data.source, "path": cfg.data.path, "text_column": cfg.data.text_column,
                 "tokenizer": cfg.data.tokenizer, "seed": cfg.training.seed,
                 # Only where set, so that checkpoints of a single text source stay loadable.
                 **({"format": cfg.data.format} if cfg.data.format != "text" else {}),
                 **({"sources": [s.model_dump() for s in cfg.data.sources]} if cfg.data.sources else {})},
        "total_steps": cfg.training.steps,
    }


def check_compatible(manifest: dict[str, Any], cfg, vocab_size: int, path: str | Path, model_only: bool) -> None:
    """Refuse a checkpoint DCP cannot load into this job: another model or vocabulary (tensor
    shapes differ), another optimizer (its state differs), other data (the saved position would
    be meaningless), or no steps left. Any mesh is fine: DCP reshards. Raises
    :class:`CheckpointError`."""
    here = _job_manifest(cfg, vocab_size)
    if manifest["model"] != here["model"]:
        raise CheckpointError(
            f"checkpoint {path} holds model {manifest['model']}, this job builds {here['model']}: "
            "DCP reshards across meshes, not across model shapes; use the same model.name, model.flavor and tokenizer"
        )
    if model_only:
        return
    if manifest["format"] == 1:
        raise CheckpointError(
            f"checkpoint {path} was saved by an earlier ray_titan (format 1), which stored the data position "
            "as unread tokens; take its weights with checkpoint.load_model_only = true"
        )
    if manifest["optimizer"] != here["optimizer"]:
        raise CheckpointError(
            f"checkpoint {path} holds {manifest['optimizer']} optimizer state, this job uses "
            f"optimizer.name = {here['optimizer']!r}; use the same optimizer or checkpoint.load_model_only = true"
        )
    if manifest["data"] != here["data"]:
        raise CheckpointError(
            f"checkpoint {path} was saved reading data {manifest['data']}, this job reads {here['data']}: "
            "the saved data position would not apply; use the same data settings and training.seed, "
            "or checkpoint.load_model_only = true"
        )
    if manifest["step"] >= cfg.training.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {manifest['step']} but training.steps = {cfg.training.steps}: "
            "nothing left to train; raise training.steps"
        )


# -- the training state -------------------------------------------------------------------------

class ModelParts(nn.Module):
    """This rank's pipeline stages seen as one module with the whole model's parameter names.

    Stage modules are copies of the whole model with the absent parts removed; their
    ``ModuleDict`` children (``layers``) are merged and the other children (embedding, norm,
    head) taken from the stage that has them. Holds references only.
    """

    def __init__(self, stages: Iterable[nn.Module]):
        super().__init__()
        for stage in stages:
            for name, child in stage.named_children():
                if isinstance(child, nn.ModuleDict):
                    if name not in self._modules:
                        self.add_module(name, nn.ModuleDict())
                    # ModuleDict.update accepts a ModuleDict at runtime; torch annotates it Mapping only.
                    cast(nn.ModuleDict, self._modules[name]).update(child)  # type: ignore[arg-type]
                elif self._modules.get(name, child) is not child:
                    raise ValueError(f"two pipeline stages on this rank both hold {name!r}")
                else:
                    self.add_module(name, child)


class LocalCheckpointStorage:
    """Checkpoints written straight to ``directory`` (shared by the ranks; no Ray). Rank 0 keeps
    the latest ``keep`` complete ones (0: all)."""

    shared = True

    def __init__(self, directory: str | Path, keep: int):
        self.directory, self.keep = Path(directory), keep

    def resume_from(self) -> Path | None:
        return None  # each launch is a new run; checkpoint.load_path continues an old one

    def begin(self, step: int, rank: int) -> Path:
        return self.directory / step_dir_name(step)

    def commit(self, step: int, write_dir: Path, rank: int, metrics: dict[str, Any]) -> None:
        if rank == 0 and self.keep:
            complete = [p for p in sorted(self.directory.glob("step-*")) if (p / MANIFEST).exists()]
            newest = complete[-1] if complete else write_dir
            for p in sorted(self.directory.glob("step-*")):
                if p < newest and p not in complete[-self.keep:]:
                    shutil.rmtree(p, ignore_errors=True)


class RayTrainCheckpointStorage:
    """Checkpoints handed to Ray Train: each rank writes to a local staging directory, then
    ``ray.train.report(checkpoint=...)`` copies every rank's files into
    ``<storage_path>/<name>/step-NNNNNNNN`` (Ray keeps ``CheckpointConfig.num_to_keep``)."""

    shared = False

    def __init__(self, run_dir: str | Path | None = None):
        self.run_dir = run_dir

    def resume_from(self):
        """The checkpoint a restarted worker group resumes from: Ray Train's latest, or a newer
        complete one in ``<run_dir>/checkpoints``. Ray's controller learns of a checkpoint only
        when it next polls the workers (every ~2 s), so a worker that dies right after a save
        can leave Ray one checkpoint behind what is safely on disk."""
        import ray.train

        ckpt = ray.train.get_checkpoint()
        local = _local_dir(self.run_dir)
        if local is None or not (local / "checkpoints").is_dir():
            return ckpt
        known = _step_of(Path(ckpt.path).name) if ckpt is not None else 0
        for p in sorted((local / "checkpoints").glob("step-*"), reverse=True):
            if _step_of(p.name) <= known:
                break
            if _is_complete(p):  # sizes here; rank 0 checks the CRC-32s when it loads
                return ray.train.Checkpoint.from_directory(str(p))
        return ckpt

    def begin(self, step: int, rank: int) -> Path:
        """A fresh staging directory for this rank's share of ``step``, under the run directory
        (:func:`staging_root`), after removing what a worker killed while saving left there."""
        root = staging_root(self.run_dir)
        for old in root.glob(f"*-rank{rank}"):
            shutil.rmtree(old, ignore_errors=True)
        write_dir = root / f"{step_dir_name(step)}-rank{rank}"
        write_dir.mkdir(parents=True, exist_ok=True)
        return write_dir

    def commit(self, step: int, write_dir: Path, rank: int, metrics: dict[str, Any]) -> None:
        import ray.train

        try:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(write_dir)),
                             checkpoint_dir_name=step_dir_name(step))
        finally:
            shutil.rmtree(write_dir, ignore_errors=True)


def _write_failure(step: int, write_dir: Path, e: BaseException, rank: int = 0) -> str:
    """Why writing checkpoint files failed, in words, for ``rank``'s message.

    ``e`` may be DCP's :class:`CheckpointException`, which collects every failed rank's error:
    this rank's own is reported if it has one, else the lowest failed rank's (named). torch's zip
    writer reports a full disk as "unexpected pos" (the ``OSError`` with ``ENOSPC`` is only its
    ``__context__``, and lost when DCP sends it to another rank), so the error chain is searched
    for an ``OSError`` and the free space at ``write_dir`` is measured and said."""
    where = ""
    if isinstance(e, CheckpointException) and e.failures:
        failed = rank if rank in e.failures else min(e.failures)
        where = "" if failed == rank else f" on rank {failed}"
        e = e.failures[failed][0]
    seen: list[BaseException] = []
    link: BaseException | None = e
    while link is not None and link not in seen:  # __cause__/__context__ may form a cycle
        seen.append(link)
        link = link.__cause__ or link.__context__
    e = next((x for x in seen if isinstance(x, OSError) and x.strerror), e)
    cause = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).strip().splitlines() or [""])[-1]
    head = f"step {step}: writing the checkpoint to {write_dir} failed{where}: {type(e).__name__}: {cause}"
    try:
        free = shutil.disk_usage(next(p for p in (write_dir, *write_dir.parents) if p.exists())).free
    except (OSError, StopIteration):
        return head
    full = "; the filesystem is full" if free < (1 << 20) else ""
    return f"{head} ({free / 2**20:.1f} MiB free there{full})"


STAGING = ".checkpoint_staging"


def staging_root(run_dir: str | Path | None) -> Path:
    """Where ranks stage a checkpoint before Ray Train copies it into ``checkpoints/``:
    ``<run_dir>/.checkpoint_staging`` (a remote run directory: the same under this node's local
    staging directory, :func:`ray_titan.storage.staging_dir`; no run directory: the system's temp
    directory). Removed by the driver however the run ends (:func:`remove_staging`)."""
    from ray_titan import storage

    if run_dir is None:
        return Path(tempfile.gettempdir()) / "ray_titan" / STAGING
    local = storage.local_path(run_dir)
    return (local if local is not None else storage.staging_dir(str(run_dir))) / STAGING


def remove_staging(run_dir: str | Path) -> None:
    """Remove every rank's checkpoint staging of the run (what a save interrupted by Ctrl-C, a
    SIGTERM or a crash left behind; model-sized on a real run)."""
    shutil.rmtree(staging_root(run_dir), ignore_errors=True)


def _step_of(name: str) -> int:
    try:
        return int(name.removeprefix("step-"))
    except ValueError:
        return -1


def _local_dir(run_dir: str | Path | None) -> Path | None:
    if run_dir is None:
        return None
    from ray_titan import storage

    return storage.local_path(run_dir)


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


class Checkpointer:
    """Saves and restores this rank's share of the training state.

    Args:
        cfg: the job. ``stages``: this rank's stage modules. ``loader``: a ``PackedLoader``.
        reporter: the metrics reporter (its unacknowledged reports go into each checkpoint).
        storage: :class:`RayTrainCheckpointStorage`, :class:`LocalCheckpointStorage`, or None
            (no checkpoints saved; ``checkpoint.load_path`` is still honoured).
        vocab_size: the tokenizer's, recorded in the manifest.
    """

    def __init__(self, cfg, rank: int, stages: Iterable[nn.Module], optimizer, scheduler, loader,
                 reporter, storage, vocab_size: int, device: torch.device):
        self.cfg, self.rank = cfg, rank
        stages = list(stages)
        self.parts = ModelParts(stages)
        self.optimizer, self.scheduler, self.loader = optimizer, scheduler, loader
        self.reporter, self.storage, self.device = reporter, storage, device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.job = _job_manifest(cfg, vocab_size)
        # What an export to Hugging Face needs (ray_titan.hf): the model's arguments (a Hugging
        # Face checkpoint's sizes are no flavor), the tokenizer files, the imported config.json.
        args = getattr(stages[0], "args", None) if stages else None
        if dataclasses.is_dataclass(args) and not isinstance(args, type):
            self.job["model_args"] = dataclasses.asdict(args)
        self.job["tokenizer_path"] = cfg.data.tokenizer_path
        self.job["initial_load_hf"] = cfg.checkpoint.initial_load_hf
        # Read once, here: each checkpoint keeps a copy (export takes nothing from outside it).
        self.hf_files: dict[str, bytes] = {}
        if rank == 0 and storage is not None and cfg.checkpoint.enable:
            try:  # rank 0 alone reads them: raising here would leave the other ranks waiting
                self.hf_files = _hf_files(cfg)
            except CheckpointError as e:
                print(f"ray_titan: warning: {e}; the checkpoints carry no hf/ files, and an export of "
                      "them has no tokenizer", flush=True)
        self.resumed_from: str | None = None
        self.restarted = False
        """True when this worker group resumed its own run's checkpoint (a restart)."""

    # -- state dicts -------------------------------------------------------------------------
    def _state(self, step: int, model_only: bool, same_mesh: bool,
               metadata: Metadata | None = None) -> dict[str, Any]:
        sd: dict[str, Any] = {f"model.{k}": v for k, v in get_model_state_dict(self.parts).items()}
        if model_only:
            return sd
        osd = get_optimizer_state_dict(self.parts, self.optimizer, options=_OPTIM_OPTIONS)
        sd.update({f"optimizer.{k}": v for k, v in osd.items()})
        sd.update({f"lr_scheduler.{k}": v for k, v in self.scheduler.state_dict().items()})
        for k, v in self.loader.state_dict().items():  # ints, and arrays whose length varies
            key = f"dataloader.{k}"
            if isinstance(v, np.ndarray):
                v = torch.from_numpy(v)
                md = metadata.state_dict_metadata.get(key) if metadata is not None else None
                if isinstance(md, TensorStorageMetadata):  # size the slot from the checkpoint
                    v = torch.empty(md.size, dtype=v.dtype)
            sd[key] = v
        sd["train.step"] = step
        if same_mesh:
            sd.update(_rng_state(self.rank, self.device))
        return sd

    # -- save ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether ``step`` is a checkpoint step: every ``checkpoint.interval`` and the last."""
        c = self.cfg.checkpoint
        return self.storage is not None and c.enable and (step % c.interval == 0 or step == self.cfg.training.steps)

    def save(self, step: int) -> None:
        """Write the state after ``step`` (every rank calls this at the same step). Raises
        :class:`CheckpointError`, writing nothing, if a parameter or optimizer state is not finite
        on some rank: such a checkpoint could only resume a broken run. Raises
        :class:`CheckpointError` on every rank, after removing this rank's files, when writing fails
        on any rank (the message names the directory, the cause and the MiB free there)."""
        state = self._state(step, False, True)
        if not all_finite([v for k, v in state.items() if k.startswith(("model.", "optimizer.state."))
                           and isinstance(v, torch.Tensor)], self.device):
            raise CheckpointError(f"step {step}: parameters or optimizer state are not finite; no checkpoint written")
        write_dir = self.storage.begin(step, self.rank)
        try:
            dcp.save(state, storage_writer=FileSystemWriter(str(write_dir)), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as err:
            # DCP raises CheckpointException (a BaseException) on every rank when any rank fails.
            own = err.failures.get(self.rank) if isinstance(err, CheckpointException) else None
            interrupted = own is not None and not isinstance(own[0], Exception)
            why = "" if interrupted else _write_failure(step, write_dir, err, self.rank)  # free space before removal
            shutil.rmtree(write_dir, ignore_errors=True)  # its space goes back to the metrics
            if own is not None and interrupted:
                raise own[0] from err  # this rank was interrupted (KeyboardInterrupt, SystemExit)
            raise CheckpointError(why) from err
        reports = self.reporter.unacknowledged() if hasattr(self.reporter, "unacknowledged") else []
        why = ""
        try:
            rdir = write_dir / "reports"
            rdir.mkdir(parents=True, exist_ok=True)
            (rdir / f"rank{self.rank}.json").write_text(json.dumps(reports))
            for name, data in self.hf_files.items():  # rank 0's only; listed in the manifest like the rest
                (write_dir / HF_DIR).mkdir(exist_ok=True)
                (write_dir / HF_DIR / name).write_bytes(data)
        except OSError as err:
            why = _write_failure(step, write_dir, err, self.rank)
        if self.world > 1:  # every rank learns of a failed write, or the others would wait in the gather
            failed = torch.tensor([1.0 if why else 0.0], device=self.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if failed.item() and not why:
                why = f"step {step}: another rank could not write its files of this checkpoint; nothing kept"
        if why:
            shutil.rmtree(write_dir, ignore_errors=True)
            raise CheckpointError(why)
        entries = {} if self.storage.shared else _file_entries(write_dir)
        gathered: list[Any] | None = [entries]
        if self.world > 1:
            gathered = [None] * self.world if self.rank == 0 else None
            dist.gather_object(entries, gathered, dst=0)
        if self.rank == 0:
            files: dict[str, Any] = {}
            if self.storage.shared:
                files = _file_entries(write_dir)
            else:
                assert gathered is not None  # rank 0 gathers every rank's entries
                for e in gathered:
                    files.update(e)
            manifest = {"format": FORMAT, "step": step, "saved_at": time.time(), **self.job, "files": files}
            tmp = write_dir / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, write_dir / MANIFEST)
        if self.world > 1 and self.storage.shared:
            dist.barrier()
        self.storage.commit(step, write_dir, self.rank, {"step": step})

    # -- restore ---------------------------------------------------------------------------------
    def restore(self) -> int:
        """Load the checkpoint this run starts from, if any, and return its step (0: none).

        A restarted worker group resumes its own run's latest checkpoint (from Ray Train);
        otherwise ``checkpoint.load_path``. Raises :class:`CheckpointError` for a missing,
        incomplete, corrupt or unfitting checkpoint.
        """
        own = self.storage.resume_from() if self.storage is not None else None
        if own is not None:
            with own.as_directory() as d:
                return self._load(Path(d), model_only=False, own=True)
        if self.cfg.checkpoint.load_path:
            path = resolve_checkpoint(self.cfg.checkpoint.load_path)
            return self._load(path, model_only=self.cfg.checkpoint.load_model_only, own=False)
        return 0

    def _load(self, path: Path, model_only: bool, own: bool) -> int:
        problem = None
        if self.rank == 0:  # one check, shared with every rank
            try:
                # CRC-32 of every file: pre-flight did it for checkpoint.load_path; a restarted
                # worker group's own checkpoint is checked here, once, on rank 0.
                manifest = read_manifest(path, verify_checksums=own)
                check_metadata(load_metadata(path), path, manifest["files"])
                check_compatible(manifest, self.cfg, self.job["model"]["vocab_size"], path, model_only or own)
            except CheckpointError as e:
                problem = str(e)
        problem = _broadcast(problem)
        if problem:
            raise CheckpointError(problem)
        manifest = read_manifest(path)
        same_mesh = manifest["mesh"] == self.job["mesh"]
        reader = SafeFileSystemReader(str(path))
        metadata = reader.read_metadata()
        sd = self._state(0, model_only, same_mesh, metadata)
        # A checkpoint saved on CPU holds no CUDA generator state: not a reason to refuse it.
        reseed = _drop_missing_device_rng(sd, metadata.state_dict_metadata, self.rank)
        # A tied model's last-stage head copy, saved without pipeline stages as the embedding only.
        head, emb = "model.output.weight", "model.tok_embeddings.weight"
        tied_copy = head in sd and head not in metadata.state_dict_metadata and emb not in sd
        if tied_copy:
            sd[emb] = sd.pop(head)
        _check_keys(sd, metadata, path)
        try:
            dcp.load(sd, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=not dist.is_initialized())
        except CheckpointError:
            raise
        except Exception as e:  # a layout DCP cannot reshard into this mesh
            raise CheckpointError(
                f"checkpoint {path} (saved on mesh {manifest['mesh']}) could not be loaded into this job's mesh "
                f"{self.job['mesh']}: {e}; load it on the mesh that saved it, or with checkpoint.load_model_only = true"
            ) from e
        if tied_copy:
            sd[head] = sd.pop(emb)
        if not all_finite([v for k, v in sd.items() if k.startswith("model.") and isinstance(v, torch.Tensor)],
                          self.device):
            raise CheckpointError(f"checkpoint {path} holds non-finite model weights; load an earlier checkpoint")
        set_model_state_dict(self.parts, {k[6:]: v for k, v in sd.items() if k.startswith("model.")})
        self.resumed_from, self.restarted = str(path), own
        if model_only:
            return 0
        set_optimizer_state_dict(self.parts, self.optimizer,
                                 {k[10:]: v for k, v in sd.items() if k.startswith("optimizer.")},
                                 options=_OPTIM_OPTIONS)
        self.scheduler.load_state_dict({k[13:]: v for k, v in sd.items() if k.startswith("lr_scheduler.")})
        self.loader.load_state_dict({k[len("dataloader."):]: v.numpy() if isinstance(v, torch.Tensor) else v
                                     for k, v in sd.items() if k.startswith("dataloader.")})
        if same_mesh:
            _restore_rng(sd, self.rank, self.device, self.cfg.training.seed, int(sd["train.step"]))
            if reseed and self.rank == 0:
                print(f"ray_titan: checkpoint {path} was saved on CPU and holds no CUDA generator state: each "
                      "rank's CUDA generator is seeded from training.seed, the step and the rank (random ops on "
                      "the GPU, e.g. dropout, do not continue the saved run's stream)", file=sys.stderr, flush=True)
        if own and hasattr(self.reporter, "resend"):  # same run: metrics not yet on disk at the save
            world = dist.get_world_size() if dist.is_initialized() else 1
            saved = saved_reports(path)
            # An elastic group that shrank: rank 0 delivers the lost ranks' reports too.
            ranks = [self.rank] + ([r for r in saved if r >= world] if self.rank == 0 else [])
            for r in ranks:
                if saved.get(r):
                    self.reporter.resend(saved[r])
        return int(sd["train.step"])


def _rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random generator states as a checkpoint keeps them: ``rng.rank<r>.cpu``
    (``torch.get_rng_state``), and ``rng.rank<r>.cuda`` when ``device`` is a CUDA device."""
    sd = {f"rng.rank{rank}.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        sd[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state(device)
    return sd


def _drop_missing_device_rng(sd: dict[str, Any], saved: Any, rank: int) -> bool:
    """Remove the CUDA generator key from the state ``sd`` to load when the checkpoint (whose
    keys are ``saved``) lacks it, as one saved on CPU does; True if removed. The opposite case
    needs nothing: a CUDA checkpoint loaded on CPU has a key ``sd`` does not ask for, and DCP
    loads only the keys asked for."""
    key = f"rng.rank{rank}.cuda"
    if key in sd and key not in saved:
        del sd[key]
        return True
    return False


def _device_rng_seed(seed: int, step: int, rank: int) -> int:
    """The CUDA generator seed of ``rank`` resuming at ``step`` from a checkpoint that holds no
    CUDA generator state: deterministic in (``training.seed``, step, rank), distinct per rank."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0])


def _restore_rng(sd: dict[str, Any], rank: int, device: torch.device, seed: int, step: int) -> None:
    """Set this rank's generators from a loaded state (:func:`_rng_state`'s keys): the CPU one
    always; on CUDA the CUDA one from its saved state, or, when the checkpoint has none (saved
    on CPU), seeded with :func:`_device_rng_seed`."""
    torch.set_rng_state(sd[f"rng.rank{rank}.cpu"])
    if device.type != "cuda":
        return
    key = f"rng.rank{rank}.cuda"
    if key in sd:
        torch.cuda.set_rng_state(sd[key], device)
    else:
        with torch.cuda.device(device):
            torch.cuda.manual_seed(_device_rng_seed(seed, step, rank))


def _check_keys(sd: dict[str, Any], metadata: Metadata, path: Path) -> None:
    """Every value this job needs is in the checkpoint with the same shape (clear errors where
    DCP's own would be obscure)."""
    have = metadata.state_dict_metadata
    missing = [k for k in sd if k not in have]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} value(s) this job needs: {shown}")
    for k, v in sd.items():
        md = have[k]
        if isinstance(v, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {path}: {k} is not a tensor in the checkpoint")
            if tuple(md.size) != tuple(v.shape):
                raise CheckpointError(
                    f"checkpoint {path}: {k} has shape {tuple(md.size)} in the checkpoint, {tuple(v.shape)} in this job"
                )

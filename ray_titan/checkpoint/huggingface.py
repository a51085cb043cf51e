"""Hugging Face checkpoints in and out: ``config.json`` + safetensors + ``tokenizer.json``.

**Import** (``checkpoint.initial_load_hf = "<dir or URI>"``): :func:`resolve_hf_job` takes the
model family and arguments from the directory's ``config.json`` (``model_type`` picks the family
in ``ray_titan.models.registry``, whose state-dict adapter reads the rest) and its
``tokenizer.json``; :func:`check_hf_checkpoint` compares every tensor name, shape and dtype in
the safetensors headers with what the model needs, before any worker starts; on the workers
:func:`load_hf_weights` fills each rank's parameters of its pipeline stages after they are
sharded (FSDP2, expert parallel), reading only this rank's rows.

How a rank reads only its slice: a parameter's local chunk is the one DCP's planner would read
(``DTensor.__create_chunk_list__``: offsets and sizes in the whole tensor); FSDP2 and expert
parallelism shard dim 0, so a chunk is a run of rows, and in a safetensors file a run of rows is
one contiguous byte range (row-major data after a JSON header; the format's specification,
github.com/huggingface/safetensors). :class:`SafetensorsFiles` parses the headers and reads those
ranges through pyarrow's filesystems, so the same code serves a local directory and object
storage (``s3://``, ``gs://``, ...). The adapter's row permutation (q/k rotary layout) maps
ray_titan's rows to Hugging Face rows of the same head, read as the covering range; routed
experts stacked on dim 0 read one Hugging Face tensor per local expert. DCP's
``HuggingFaceStorageReader`` was not used: it opens files with ``safe_open`` (local paths only)
and loads tensors under their checkpoint names and shapes, whereas a rank here needs Hugging
Face rows that land in other rows (the q/k permutation can cross a shard boundary) or in a
slice of a stacked tensor.

**Export** (``ray-titan export``, ``checkpoint.last_save_hf``): :func:`export_hf` streams a
ray_titan DCP checkpoint into ``config.json``, ``model-0000i-of-0000N.safetensors`` shards with
``model.safetensors.index.json``, and the tokenizer files: one shard's tensors at a time are
loaded from the sharded checkpoint with DCP (only their keys), mapped by the adapter and
written with ``safetensors``, so no process holds the whole model. (DCP's
``HuggingFaceStorageWriter`` writes the state dict it is given in one call, which would hold
the whole model.) The MoE router's ``expert_bias`` goes to a side file (``ROUTER_BIAS_FILE`` of
``ray_titan.models.deepseek_v2.state_dict_adapter``) when it is not all zeros; tied models write the embedding
once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ray_titan import storage
from ray_titan.checkpoint.manifest import (
    HF_DIR,
    TOKENIZER_FILES,
    CheckpointError,
    _outside,
    read_manifest,
    resolve_checkpoint,
)
from ray_titan.checkpoint.unpickler import SafeFileSystemReader, SafeLoadPlanner, check_metadata, load_metadata
from ray_titan.config.schema import ConfigError, JobConfig
from ray_titan.models.gpt_oss.mxfp4 import dequantize_mxfp4, packed_shapes
from ray_titan.models.registry import ModelSpec, build_model, get_model_args, get_spec, spec_for_hf
from ray_titan.models.rope import RopeScaling
from ray_titan.models.state_dict_adapter import HFConfigError, Source
from ray_titan.parallel import local_tensor

__all__ = [
    "CONFIG",
    "INDEX",
    "TOKENIZER_FILES",
    "ExportResult",
    "HFCheckpointError",
    "SafetensorsFiles",
    "check_hf_checkpoint",
    "export_hf",
    "hf_model",
    "job_model_args",
    "load_hf_weights",
    "read_hf_config",
    "resolve_hf_job",
    "save_last_hf",
]

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header (and ``model.safetensors.index.json``) read, in bytes: the
``safetensors`` library's own limit (its ``MAX_HEADER_SIZE``). Real headers are kilobytes to a
few megabytes (about 100 bytes per tensor); the length is checked before anything is read, so a
damaged or hostile length is refused without reading or allocating it."""

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "U8": torch.uint8}
_NAMES = {v: k for k, v in _DTYPES.items()}
_PACKED = ("_blocks", "_scales")
"""Suffixes of an MXFP4-packed tensor's two parts (gpt-oss's expert weights; uint8, the only
tensors of that dtype a checkpoint may hold: ``ray_titan.models.gpt_oss.mxfp4``)."""
_EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint directory cannot be used; the message names the file and the
    problem."""


# -- config.json ------------------------------------------------------------------------------

def read_hf_config(path: str) -> dict[str, Any]:
    """``<path>/config.json`` as a dict (``path``: a local directory or a URI pyarrow reads).
    Raises :class:`HFCheckpointError` when it is missing, unreadable, larger than
    :data:`~ray_titan.storage.MAX_CONFIG_BYTES` (checked before it is read) or not a JSON
    object."""
    file = storage.join(path, CONFIG)
    try:
        text = storage.read_text(file, storage.MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES; a config.json is kilobytes")
    except storage.FileTooLargeError as e:
        raise HFCheckpointError(str(e)) from None
    except FileNotFoundError:
        raise HFCheckpointError(f"{file} does not exist (a Hugging Face model directory has a config.json)") from None
    except Exception as e:
        raise HFCheckpointError(f"{file} is unreadable: {type(e).__name__}: {e}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{file} holds a {type(config).__name__}, not a JSON object")
    return config


def hf_model(path: str) -> tuple[ModelSpec, Any]:
    """The family (its :class:`ModelSpec`) and model arguments ``path``'s ``config.json``
    describes. Raises :class:`HFCheckpointError` naming the file: no or an unsupported
    ``model_type`` (listing the supported ones), a ``quantization_config`` the family does not
    dequantise, any number outside its field's range, whether or not the family reads it
    (``StateDictAdapter.check_config``: ``SIZE_FIELDS``, ``FLOAT_FIELDS``; checked before
    anything is sized by it), or a field the family cannot build."""
    return _hf_model(path)[:2]


def _hf_model(path: str) -> tuple[ModelSpec, Any, dict[str, Any]]:
    config = read_hf_config(path)
    file = storage.join(path, CONFIG)
    try:
        spec = spec_for_hf(config.get("model_type", ""))
    except KeyError as e:
        raise HFCheckpointError(f"{file}: {e.args[0]}") from None
    try:
        spec.hf.check_config(config)  # every family: its quantisation, every number in range
        return spec, spec.hf.args_from_hf(config), config
    except HFConfigError as e:
        raise HFCheckpointError(f"{file}: {e}") from None


def _absolute(path: str) -> str:
    local = storage.local_path(path)
    return str(local) if local is not None else path


def resolve_hf_job(cfg: JobConfig) -> JobConfig:
    """With ``checkpoint.initial_load_hf``: a copy of ``cfg`` whose ``model.name`` is the family of
    the checkpoint's ``config.json``, whose ``model.flavor`` is ``hf`` (or the flavor set in the
    config, once checked to agree), and whose tokenizer is the checkpoint's ``tokenizer.json``
    unless ``data.tokenizer`` or ``data.tokenizer_path`` is set. Without it, ``cfg`` unchanged.

    Call it where the job is loaded (the driver, the launcher, the memory plan): it tells settings
    given by the user from defaults; a config it returned comes back unchanged. Raises
    :class:`ConfigError` naming ``checkpoint.initial_load_hf`` and the file, or the disagreeing
    setting, the field and both values.
    """
    src = cfg.checkpoint.initial_load_hf
    if not src:
        return cfg
    src = _absolute(src)
    storage.probe_location("checkpoint.initial_load_hf", src, cfg.job.storage_timeout_s)
    try:
        spec, args = hf_model(src)
    except HFCheckpointError as e:
        raise ConfigError(f"checkpoint.initial_load_hf = {src!r}: {e}") from None
    given = cfg.model.model_fields_set
    config_file = storage.join(src, CONFIG)
    if "name" in given and cfg.model.name != spec.name:
        raise ConfigError(
            f"model.name = {cfg.model.name!r} but {config_file} has model_type "
            f"{spec.hf.model_type!r} (family {spec.name!r}); set model.name = {spec.name!r} or leave it unset"
        )
    flavor = "hf"
    if "flavor" in given and cfg.model.flavor != "hf":  # "hf": resolved already (resolving twice is a no-op)
        try:
            flavor_args = get_model_args(spec.name, cfg.model.flavor)
        except KeyError as e:
            raise ConfigError(str(e.args[0])) from None
        diffs = spec.hf.differences(flavor_args, args)
        if diffs:
            field, mine, theirs = diffs[0]
            raise ConfigError(
                f"model.flavor = {cfg.model.flavor!r} disagrees with {config_file}: {field} is {mine!r} in the "
                f"flavor, {theirs!r} in config.json; leave model.flavor unset to take the checkpoint's sizes"
            )
        flavor = cfg.model.flavor
    model = cfg.model.model_copy(update={"name": spec.name, "flavor": flavor})
    data = cfg.data
    if not {"tokenizer", "tokenizer_path"} & cfg.data.model_fields_set:
        tokenizer = storage.join(src, "tokenizer.json")
        data = data.model_copy(update={"tokenizer": "huggingface", "tokenizer_path": tokenizer})
    ckpt = cfg.checkpoint.model_copy(update={"initial_load_hf": src})
    return cfg.model_copy(update={"model": model, "data": data, "checkpoint": ckpt})


def job_model_args(cfg: JobConfig) -> Any:
    """The model arguments of the job: the checkpoint's ``config.json`` with
    ``checkpoint.initial_load_hf`` (after :func:`resolve_hf_job`), else ``model.flavor``'s.
    Raises ``KeyError`` for an unknown family or flavor, :class:`HFCheckpointError` for a bad
    ``config.json``."""
    if cfg.checkpoint.initial_load_hf:
        return hf_model(cfg.checkpoint.initial_load_hf)[1]
    return get_model_args(cfg.model.name, cfg.model.flavor)


# -- safetensors files -------------------------------------------------------------------------

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


def _from_hf_layout(src: Source, t: torch.Tensor) -> torch.Tensor:
    """A Hugging Face tensor (or a run of its rows) in ray_titan's layout: ``src.cols``'s part of
    the last dim, then the last two dims swapped when ``src.transpose`` (:class:`Source`)."""
    if src.cols is not None:
        t = t[..., src.cols[0]::src.cols[1]]
    if src.transpose:
        t = t.transpose(-1, -2)
    return t.contiguous()


def _hf_shape(src: Source, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face tensor's shape for a ray_titan tensor of ``shape`` (:func:`_from_hf_layout`'s inverse)."""
    if src.transpose:
        shape = (*shape[:-2], shape[-1], shape[-2])
    if src.cols is not None:
        shape = (*shape[:-1], shape[-1] * src.cols[1])
    return shape


def _read_source(files: SafetensorsFiles, src: Source, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of dim 0 of the ray_titan tensor ``src`` describes."""
    if src.stacked:
        return torch.stack([files.read_rows(k) for k in src.keys[start:stop]])
    (key,) = src.keys
    if src.rows is None:
        return _from_hf_layout(src, files.read_rows(key, start, stop))
    rows = torch.tensor(src.rows[start:stop])
    lo, hi = int(rows.min()), int(rows.max()) + 1  # a head's rows: a short covering range
    return files.read_rows(key, lo, hi)[rows - lo]


def _expected_shapes(spec: ModelSpec, args: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, Source]]:
    """Hugging Face tensor name -> shape the model needs, and the sources by ray_titan name."""
    with torch.device("meta"):
        model = build_model(spec.name, "", args=args)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    sources = spec.hf.sources(args)
    want: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        src = sources[name]
        for key in src.keys:
            want[key] = shape[1:] if src.stacked else _hf_shape(src, shape)
    return want, sources


_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT_KEY = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
_FUSED_EXPERTS_KEY = re.compile(r"model\.layers\.\d+\.mlp\.experts\.[a-z_]+$")  # gpt-oss: (experts, ...)


def _check_sizes_against_headers(config_file: str, config: dict[str, Any], spec: ModelSpec, args: Any,
                                 files: SafetensorsFiles, where: str) -> None:
    """The ``config.json`` sizes that the safetensors headers bound (``where``: the index or
    the single file): layers and routed experts at most as many as the tensor names hold, the
    vocabulary and width at most the embedding's. Checked before the model is built from
    ``config.json``, whose cost grows with them (SIZE_FIELDS' maxima bound it only loosely)."""
    layers = {int(m[1]) for k in files.model_keys if (m := _LAYER_KEY.match(k))}
    bounds = {"num_hidden_layers": (len(layers), "layers (model.layers.N)")}
    if spec.moe and args.moe_layers:
        experts = {int(m[1]) for k in files.model_keys if (m := _EXPERT_KEY.match(k))}
        fused = [files.entries[k].shape[0] for k in files.model_keys
                 if _FUSED_EXPERTS_KEY.match(k) and files.entries[k].shape]
        # DeepSeek's name, Qwen3-MoE's, and Qwen3-MoE's as transformers 5 writes it (gpt-oss's too).
        for field in ("n_routed_experts", "num_experts", "num_local_experts"):
            bounds[field] = (max([len(experts), *fused]), "routed experts (model.layers.N.mlp.experts.E, or dim 0 "
                             "of the fused model.layers.N.mlp.experts.* tensors)")
    embed = files.entries.get("model.embed_tokens.weight")
    if embed is not None and len(embed.shape) == 2:
        bounds |= {"vocab_size": (embed.shape[0], "rows of model.embed_tokens.weight"),
                   "hidden_size": (embed.shape[1], "columns of model.embed_tokens.weight")}
    for field, (bound, what) in bounds.items():
        value = config.get(field)
        if value is not None and value > bound:  # an int or integral float: size_field checked it
            raise HFCheckpointError(f"{config_file}: {field} = {value!r} but {where} holds {bound} {what}; "
                                    f"valid: at most {bound}")


def check_hf_checkpoint(path: str) -> tuple[ModelSpec, Any]:
    """Check a Hugging Face model directory against the model its ``config.json`` describes,
    from the safetensors headers only: every tensor present, none unexpected, each of the right
    shape and a floating dtype; tensors of parts the model does not build (the adapter's
    ``skipped_prefixes``) are skipped with one printed line each. Returns ``(spec, args)``.
    Raises :class:`HFCheckpointError` naming the file and the problem (the tensor, both shapes;
    a ``config.json`` size beyond what the headers hold, checked before the model is built from
    it)."""
    spec, args, config = _hf_model(path)
    files = SafetensorsFiles(path)
    try:
        where = storage.join(path, INDEX if storage.exists(storage.join(path, INDEX)) else SINGLE)
        _check_sizes_against_headers(storage.join(path, CONFIG), config, spec, args, files, where)
        want, sources = _expected_shapes(spec, args)
        files.read_extra(tuple(sorted({s.file for s in sources.values() if s.file})))
        optional = {k for s in sources.values() if s.optional for k in s.keys}
        packed = {k: p for k in want if (p := files.packed(k)) is not None}
        missing = sorted(k for k in want if k not in files.entries and k not in packed and k not in optional)
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise HFCheckpointError(f"{where}: missing tensor(s) {', '.join(missing[:3])}{more}")
        prefixes = spec.hf.skipped_prefixes(args)
        skipped = {p: sum(k.startswith(p) for k in files.entries) for p in prefixes}
        for prefix, count in skipped.items():
            if count:
                print(f"ray_titan: {path}: skipping {count} tensor(s) {prefix}*: {prefixes[prefix]}", flush=True)
        ignored = spec.hf.ignored_keys(args)
        in_packed = {k + suffix for k in packed for suffix in _PACKED}
        unexpected = sorted(k for k in files.entries if k not in want and k not in ignored and k not in in_packed
                            and not any(k.startswith(p) for p in prefixes))
        if unexpected:
            more = f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
            file = storage.join(path, files.entries[unexpected[0]].file)
            raise HFCheckpointError(f"{file}: unexpected tensor(s) {', '.join(unexpected[:3])}{more} "
                                    f"for a {spec.hf.model_type} model of this config.json")
        for key, entry in files.entries.items():
            if entry.dtype == "U8" and key not in in_packed:
                raise HFCheckpointError(f"{storage.join(path, entry.file)}: tensor {key} has dtype U8; supported: "
                                        f"{sorted(set(_DTYPES) - {'U8'})} (U8: only an MXFP4 expert weight's "
                                        f"{' and '.join(_PACKED)})")
        for key, (blocks, scales) in packed.items():
            shapes = packed_shapes(want[key])
            if (blocks.dtype, scales.dtype) != ("U8", "U8") or shapes != (blocks.shape, scales.shape):
                raise HFCheckpointError(
                    f"{storage.join(path, blocks.file)}: MXFP4 tensors {key}_blocks {blocks.dtype} "
                    f"{list(blocks.shape)} and {key}_scales {scales.dtype} {list(scales.shape)} do not hold "
                    f"{list(want[key])}; valid: U8 {list(shapes[0]) if shapes else 'n/a'} and U8 "
                    f"{list(shapes[1]) if shapes else 'n/a'}")
        for key, shape in want.items():
            e = files.entries.get(key)
            if e is not None and e.shape != shape:
                raise HFCheckpointError(
                    f"{storage.join(path, e.file)}: tensor {key} has shape {list(e.shape)}, config.json "
                    f"implies {list(shape)}"
                )
    finally:
        files.close()
    return spec, args


# -- loading on the workers --------------------------------------------------------------------

def _offsets(t: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's local tensor of ``t`` starts in the whole tensor (zeros unless a
    ``DTensor``): the chunk DCP's planner would read for this rank."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        (chunk,) = t.__create_chunk_list__()
        return tuple(chunk.offsets)
    return (0,) * t.dim()


def _check_finite(files: SafetensorsFiles, src: Source, value: torch.Tensor, start: int) -> None:
    """Refuse ``value``, rows ``[start, ...)`` of dim 0 of the ray_titan tensor ``src`` describes as
    read on this rank (on the host, before it reaches the device: no device sync), when some
    element is NaN or infinite: training would start from it and fail only at the first
    checkpoint, or route every token alike (a DeepSeek-V3 correction bias). An MXFP4 tensor is
    checked dequantised (an E8M0 scale byte of 255 is NaN in the MX spec; here 2^128 overflows).
    Raises :class:`HFCheckpointError` naming the file, the Hugging Face tensor and the row."""
    if not value.is_floating_point() or bool(torch.isfinite(value).all()):
        return
    bad = ~torch.isfinite(value)
    row = int(bad.reshape(len(bad), -1).any(1).nonzero()[0, 0]) if value.dim() else 0  # the first bad one
    key = src.keys[start + row] if src.stacked else src.keys[0]
    where = "" if src.stacked else f" (row {src.rows[start + row] if src.rows else start + row} of dim 0)"
    packed = files.packed(key)
    if packed is not None:
        file, what = packed[1].file, (f"{key}_blocks / {key}_scales, MXFP4, hold NaN or infinite values once "
                                      "dequantised (a scale byte of 255, or one whose power of two overflows)")
    else:
        file, what = files.entries[key].file, f"{key} has NaN or infinite values"
    raise HFCheckpointError(f"{storage.join(files.path, file)}: tensor {what}{where}; a model is not imported from "
                            "non-finite weights: repair or re-download this file")


@torch.no_grad()
def load_hf_weights(module: nn.Module, path: str, spec: ModelSpec, args: Any,
                    sources: dict[str, Source] | None = None) -> None:
    """Fill ``module`` (the whole model or a pipeline stage, plain or sharded by FSDP2 / expert
    parallelism) with the Hugging Face checkpoint at ``path``, reading only the rows of this
    rank's shards; values are converted to each parameter's dtype. ``sources`` replaces the
    adapter's (tests use it to show that a wrong layout fails). Every parameter must have a
    source; optional buffers absent from the files keep their values. Call
    :func:`check_hf_checkpoint` first (the pre-flight does): a missing tensor raises ``KeyError``.
    Raises :class:`HFCheckpointError` naming the file, the tensor and the row when what this
    rank reads holds a NaN or an infinity (after MXFP4 dequantisation): the run stops at import.
    """
    sources = spec.hf.sources(args) if sources is None else sources
    extra = tuple(sorted({s.file for s in sources.values() if s.file}))
    files = SafetensorsFiles(path, extra)
    try:
        wanted: dict[str, torch.Tensor] = dict(module.named_parameters())
        wanted |= {n: b for n, b in module.named_buffers() if n in sources}
        for name, t in wanted.items():
            src = sources[name]
            if src.optional and not all(k in files.entries for k in src.keys):
                continue
            local = local_tensor(t)
            if local.numel() == 0:  # an empty shard (FSDP2 pads uneven dim-0 splits)
                continue
            offsets = _offsets(t)
            lo = offsets[0] if offsets else 0
            value = _read_source(files, src, lo, lo + (local.shape[0] if local.dim() else 1))
            if local.dim() > 1 and tuple(local.shape[1:]) != tuple(t.shape[1:]):  # sharded beyond dim 0
                value = value[(slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], local.shape[1:])))]
            _check_finite(files, src, value, lo)
            local.copy_(value.reshape(local.shape))
    finally:
        files.close()


# -- export --------------------------------------------------------------------------------------

@dataclass
class ExportResult:
    """What :func:`export_hf` wrote: the directory, its weights files (side files included),
    the number of tensors and their bytes; ``notes``: one line each for what the export lacks
    (an older checkpoint without its tokenizer files or imported ``config.json``)."""

    out_dir: str
    files: list[str]
    tensors: int
    total_bytes: int
    notes: list[str] = dataclasses.field(default_factory=list)


def _args_of(manifest: dict[str, Any], spec: ModelSpec, path: Path) -> Any:
    """The model arguments the manifest of checkpoint ``path`` records (``model_args``, written
    since Hugging Face export exists), else its flavor's with its vocabulary; checked, before
    anything is sized by them, as a ``config.json`` of the family is (the bounds of
    ``state_dict_adapter.SIZE_FIELDS`` and ``FLOAT_FIELDS``, the family's relations): the model
    is built from them on the meta device, whose cost grows with the sizes. Raises
    :class:`CheckpointError` naming the checkpoint, the field and the value."""
    recorded = manifest.get("model_args")
    args_cls = type(next(iter(spec.flavors.values())))
    try:
        if recorded is None:
            args = get_model_args(spec.name, manifest["model"]["flavor"])
            args = dataclasses.replace(args, vocab_size=manifest["model"]["vocab_size"])
        else:
            if not isinstance(recorded, dict):
                raise TypeError(f"model_args is a {type(recorded).__name__}, not an object")
            fields = {f.name for f in dataclasses.fields(args_cls)}
            values = {k: v for k, v in recorded.items() if k in fields}
            if values.get("rope_scaling") is not None:
                values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
            args = args_cls(**values)
        spec.hf.args_from_hf({**spec.hf.hf_config(args), "model_type": spec.hf.model_type})
    except HFConfigError as e:  # its message names a config.json field: the manifest's, written as one
        raise CheckpointError(f"checkpoint {path}: the model arguments its manifest records, as the fields of a "
                              f"config.json, are not valid: {str(e).removeprefix('config.json ')}; not a "
                              "checkpoint this ray_titan wrote") from None
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: the model arguments its manifest records are not valid: "
                              f"{type(e).__name__}: {e}; not a checkpoint this ray_titan wrote") from None
    return args


def _plan_shards(items: list[tuple[str, Source, tuple[int, ...]]], itemsize: int,
                 max_shard_bytes: int) -> list[list[tuple[str, Source, tuple[int, ...]]]]:
    shards: list[list[tuple[str, Source, tuple[int, ...]]]] = [[]]
    size = 0
    for item in items:
        nbytes = math.prod(item[2]) * itemsize
        # The interleaved parts of one tensor (Source.cols) stay in one shard: they are written as one.
        if shards[-1] and size + nbytes > max_shard_bytes and item[1].keys[0] != shards[-1][-1][1].keys[0]:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def _to_hf(src: Source, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    if src.stacked:
        for i, key in enumerate(src.keys):
            yield key, full[i]
    elif src.rows is not None:
        out = torch.empty_like(full)
        out[torch.tensor(src.rows)] = full
        yield src.keys[0], out
    else:
        yield src.keys[0], full.transpose(-1, -2) if src.transpose else full


def _put(tensors: dict[str, torch.Tensor], src: Source, key: str, t: torch.Tensor) -> None:
    """``tensors[key] = t``, or, for one part of an interleaved tensor (``src.cols``), ``t`` into
    its columns of ``tensors[key]`` (made when its first part comes)."""
    if src.cols is None:
        tensors[key] = t.contiguous().clone()
        return
    i, n = src.cols
    if key not in tensors:
        tensors[key] = torch.empty((*t.shape[:-1], t.shape[-1] * n), dtype=t.dtype)
    tensors[key][..., i::n] = t


def export_hf(checkpoint: str | Path, out_dir: str, dtype: str = "bf16",
              max_shard_bytes: int = 5 * 2**30, source_config: dict[str, Any] | None = None,
              storage_timeout_s: float = storage.DEFAULT_TIMEOUT_S) -> ExportResult:
    """Write the model of a ray_titan checkpoint (a ``step-NNNNNNNN`` directory, a run directory
    or its ``checkpoints/``: the latest complete one) as a Hugging Face model directory
    ``out_dir`` (local path or URI): ``config.json``, safetensors shards of at most
    ``max_shard_bytes`` (bytes) with ``model.safetensors.index.json``, and the run's tokenizer
    files. ``dtype``: ``bf16`` or ``fp32`` (weights; the router bias stays fp32).
    ``source_config``: a ``config.json`` whose other fields (token ids, ...) are kept; by default
    that of the checkpoint the run imported, if any. Streams: one shard in memory at a time.

    Nothing outside the checkpoint is read because the checkpoint names it: the tokenizer files
    and the imported ``config.json`` come from the checkpoint's own ``hf/`` (each checkpoint keeps
    a copy, listed in its manifest with its CRC-32), not from the ``tokenizer_path`` or
    ``initial_load_hf`` its manifest records. A checkpoint saved before it kept them exports
    without them (no tokenizer files; a ``config.json`` of the model's own fields) and
    :attr:`ExportResult.notes` says so.

    The checkpoint is verified as a resume verifies it, before anything is written: every file's
    size and CRC-32, the DCP metadata, and each tensor's finiteness as its shard is loaded.
    Raises ``CheckpointError`` for a missing, incomplete or corrupt checkpoint (naming the file)
    or non-finite weights (naming the tensor), ``ValueError`` for an unknown ``dtype``.

    Written whole (:func:`ray_titan.storage.staged_output`): into a staging directory beside
    ``out_dir`` (a remote ``out_dir``: a local one, uploaded with ``config.json`` last) that
    becomes ``out_dir`` only when complete, so an interrupted or failed export (Ctrl-C, a damaged
    tensor found at the last shard) leaves no half-written model directory. Raises
    :class:`~ray_titan.storage.StorageError` before reading the checkpoint when ``out_dir`` exists
    and is not an empty directory, or, remote, does not take a file within ``storage_timeout_s``
    seconds."""
    with storage.staged_output(out_dir, storage_timeout_s, last=(CONFIG,)) as staging:
        result = _export_into(checkpoint, staging, dtype, max_shard_bytes, source_config)
    return dataclasses.replace(result, out_dir=str(out_dir))


def _export_into(checkpoint: str | Path, out_dir: str, dtype: str, max_shard_bytes: int,
                 source_config: dict[str, Any] | None) -> ExportResult:
    """:func:`export_hf`'s work, into the directory ``out_dir`` (its staging directory): verify the
    checkpoint, write the weights shard by shard, the side files, the index, then config.json."""
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"dtype = {dtype!r}; valid: {sorted(_EXPORT_DTYPES)}")
    torch_dtype = _EXPORT_DTYPES[dtype]
    path = resolve_checkpoint(checkpoint, "CHECKPOINT_OR_RUN_DIR")
    manifest = read_manifest(path, verify_checksums=True)  # as resume does: sizes, CRC-32s, metadata
    check_metadata(load_metadata(path), path, manifest["files"])
    spec = get_spec(manifest["model"]["name"])
    args = _args_of(manifest, spec, path)
    reader = _CheckedReader(path, spec, args)
    main = [it for it in reader.items if it[1].file is None]
    side = [it for it in reader.items if it[1].file is not None]
    shards = _plan_shards(main, torch_dtype.itemsize, max_shard_bytes)
    storage.makedirs(out_dir)
    weight_map, written, total, count = _write_shards(reader, shards, torch_dtype, out_dir)
    written += _write_side_files(reader, side, out_dir)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    storage.write_text(storage.join(out_dir, INDEX), json.dumps(index, indent=2) + "\n")
    notes: list[str] = []
    config = _export_config(path, manifest, spec, args, source_config, torch_dtype, out_dir, notes)
    storage.write_text(storage.join(out_dir, CONFIG), json.dumps(config, indent=2, sort_keys=True) + "\n")
    return ExportResult(out_dir, written, count, total, notes)


class _CheckedReader:
    """The model tensors of checkpoint ``path`` to export: ``items``, each Hugging Face tensor once
    (name, :class:`Source`, saved shape; a tied head reads the embedding), from a saved entry;
    :meth:`load` reads a group of them, refusing non-finite weights as resume does. Raises
    ``ValueError`` when the checkpoint lacks a tensor the family's Hugging Face model needs."""

    def __init__(self, path: Path, spec: ModelSpec, args: Any):
        self.path = path
        want, self.sources = _expected_shapes(spec, args)
        self.saved = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
        self.items: list[tuple[str, Source, tuple[int, ...]]] = []
        seen: set[str] = set()
        for name, src in self.sources.items():
            if (src.keys[0] in seen and src.cols is None) or f"model.{name}" not in self.saved:
                continue
            seen.update(src.keys)
            self.items.append((name, src, tuple(self.saved[f"model.{name}"].size)))  # type: ignore[union-attr]
        missing = sorted(k for k in want if k not in seen
                         and not any(k in s.keys and s.optional for s in self.sources.values()))
        if missing:
            raise ValueError(f"checkpoint {path} lacks the model tensors for {', '.join(missing[:3])}")

    def load(self, group: list[tuple[str, Source, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """The saved tensors of ``group``, keyed ``model.<name>``. Raises :class:`CheckpointError`
        naming a tensor with NaN or infinite values."""
        import torch.distributed.checkpoint as dcp

        sd = {f"model.{name}": torch.empty(shape, dtype=self.saved[f"model.{name}"].properties.dtype)  # type: ignore[union-attr]
              for name, _, shape in group}
        dcp.load(sd, storage_reader=SafeFileSystemReader(str(self.path)), planner=SafeLoadPlanner(), no_dist=True)
        # As resume refuses them: a max-abs per tensor (NaN propagates; no tensor-sized temporary).
        names = [k for k, t in sd.items() if t.is_floating_point() and t.numel()]
        norms = torch._foreach_norm([sd[k] for k in names], float("inf")) if names else []
        for key, norm in zip(names, norms):
            if not math.isfinite(float(norm)):
                hf_key = self.sources[key.removeprefix("model.")].keys[0]
                raise CheckpointError(f"checkpoint {self.path} holds non-finite model weights: {key} (Hugging Face "
                                      f"{hf_key}) has NaN or infinite values; export an earlier checkpoint")
        return sd


def _write_shards(reader: _CheckedReader, shards: list[list[tuple[str, Source, tuple[int, ...]]]],
                  torch_dtype: torch.dtype, out_dir: str) -> tuple[dict[str, str], list[str], int, int]:
    """Write the weights as safetensors shards, one in memory at a time: the index's weight map,
    the files written, their total bytes and their tensor count."""
    from safetensors.torch import save

    weight_map: dict[str, str] = {}
    written, total, count = [], 0, 0
    for i, group in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        sd = reader.load(group)
        tensors: dict[str, torch.Tensor] = {}
        for n, src, _ in group:
            for key, t in _to_hf(src, sd.pop(f"model.{n}")):
                _put(tensors, src, key, t.to(torch_dtype))
        data = save(tensors, metadata={"format": "pt"})
        storage.write_bytes(storage.join(out_dir, name), data)
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        count += len(tensors)
        written.append(name)
        del tensors, data, sd
    return weight_map, written, total, count


def _write_side_files(reader: _CheckedReader, side: list[tuple[str, Source, tuple[int, ...]]],
                      out_dir: str) -> list[str]:
    """Write the tensors kept beside the weights (``Source.file``), fp32, one file each, skipping
    a file whose tensors are all zeros; the files written."""
    from safetensors.torch import save

    written = []
    for file in sorted({it[1].file for it in side if it[1].file}):
        group = [it for it in side if it[1].file == file]
        sd = reader.load(group)
        tensors = {key: t.float().contiguous().clone()
                   for n, src, _ in group for key, t in _to_hf(src, sd[f"model.{n}"])}
        if any(bool(t.any()) for t in tensors.values()):  # all zeros: nothing learned, nothing to keep
            storage.write_bytes(storage.join(out_dir, file), save(tensors, metadata={"format": "pt"}))
            written.append(file)
    return written


def _export_config(path: Path, manifest: dict[str, Any], spec: ModelSpec, args: Any,
                   source_config: dict[str, Any] | None, torch_dtype: torch.dtype, out_dir: str,
                   notes: list[str]) -> dict[str, Any]:
    """The export's config.json: the imported one's fields (``source_config``, else the copy the
    checkpoint keeps) under the model's own; copies the tokenizer files the checkpoint keeps into
    ``out_dir``. What an older checkpoint lacks goes into ``notes``."""
    kept = {name.removeprefix(HF_DIR + "/") for name in manifest["files"] if name.startswith(HF_DIR + "/")}
    if source_config is None and "config.json" in kept:
        source_config = _kept_config(path)
    elif source_config is None and manifest.get("initial_load_hf"):
        notes.append(f"checkpoint {path} was saved before checkpoints kept the imported config.json: "
                     f"config.json has the model's own fields only (not those of {manifest['initial_load_hf']})")
    config = {**(source_config or {}), **spec.hf.hf_config(args), "model_type": spec.hf.model_type,
              "architectures": list(spec.hf.architectures), "torch_dtype": str(torch_dtype).removeprefix("torch."),
              "dtype": str(torch_dtype).removeprefix("torch.")}
    config.pop("rope_parameters", None)  # rope_to_hf's rope_theta / rope_scaling say it
    if TOKENIZER_FILES[0] in kept:
        config |= _copy_tokenizer(path / HF_DIR, kept, out_dir, config)
    elif manifest.get("data", {}).get("tokenizer") == "huggingface":
        notes.append(f"checkpoint {path} was saved before checkpoints kept their tokenizer files: the export has "
                     f"no tokenizer files; copy those of data.tokenizer_path ({manifest.get('tokenizer_path')}) "
                     "beside it yourself")
    return config


def _kept_config(path: Path) -> dict[str, Any]:
    """The imported config.json checkpoint ``path`` keeps in its ``hf/``. Raises
    :class:`CheckpointError` for one too large, not JSON, or not a JSON object."""
    try:
        config = json.loads(storage.read_text(path / HF_DIR / "config.json", storage.MAX_CONFIG_BYTES,
                                              "MAX_CONFIG_BYTES; a config.json is kilobytes"))
    except storage.FileTooLargeError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {HF_DIR}/config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {path}: {HF_DIR}/config.json holds a "
                              f"{type(config).__name__}, not a JSON object")
    return config


def _copy_tokenizer(src_dir: Path, kept: set[str], out_dir: str, config: dict[str, Any]) -> dict[str, Any]:
    """Copy the tokenizer files a checkpoint keeps (``src_dir``: its ``hf/``, whose files
    ``kept`` the manifest lists and verified) beside the export; the token ids config.json
    needs."""
    for name in TOKENIZER_FILES:
        if name in kept:
            storage.write_bytes(storage.join(out_dir, name), (src_dir / name).read_bytes())
    if "bos_token_id" in config and "eos_token_id" in config:
        return {}
    from ray_titan.data.tokenizer import HFTokenizer

    tok = HFTokenizer(src_dir / TOKENIZER_FILES[0])
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}


def save_last_hf(cfg: JobConfig, checkpoint: Path | None, run_dir: Path | str) -> Path | None:
    """``checkpoint.last_save_hf``: export the run's final ``checkpoint`` to ``<run_dir>/hf``
    (:func:`export_hf`, ``checkpoint.last_save_hf_dtype``) and say so; returns that directory,
    or None when the setting is off. A remote run directory's checkpoints are Ray Train's (not
    found here): then it prints how to export them."""
    if not cfg.checkpoint.last_save_hf:
        return None
    if checkpoint is None or not isinstance(run_dir, Path):
        print(f"ray_titan: checkpoint.last_save_hf: no local checkpoint in {run_dir}; export one with "
              "'ray-titan export CHECKPOINT --to hf OUT_DIR'", flush=True)
        return None
    out = run_dir / "hf"
    result = export_hf(checkpoint, str(out), cfg.checkpoint.last_save_hf_dtype,
                       storage_timeout_s=cfg.job.storage_timeout_s)
    for note in result.notes:
        print(f"ray_titan: checkpoint.last_save_hf: {note}", flush=True)
    print(f"ray_titan: Hugging Face model of {checkpoint.name} in {out} ({result.tensors} tensors, "
          f"{result.total_bytes / 2**20:.1f} MiB)", flush=True)
    return out

"""Hugging Face checkpoints out: a ray_titan checkpoint's model as ``config.json``, safetensors and tokenizer files.

**Export** (``ray-titan export``, ``checkpoint.last_save_hf``): :func:`export_hf` streams a
ray_titan DCP checkpoint into ``config.json``, ``model-0000i-of-0000N.safetensors`` shards with
``model.safetensors.index.json``, and the tokenizer files: one shard's tensors at a time are
loaded from the sharded checkpoint with DCP (only their keys), mapped by the adapter and
written with ``safetensors``, so no process holds the whole model. (DCP's
``HuggingFaceStorageWriter`` writes the state dict it is given in one call, which would hold
the whole model.) The MoE router's ``expert_bias`` goes to a side file (``ROUTER_BIAS_FILE`` of
``ray_titan.models.deepseek_v2.state_dict_adapter``) when it is not all zeros; tied models write the embedding
once. :func:`save_last_hf` runs it at the end of a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ray_titan import storage
from ray_titan.checkpoint.hf_config import CONFIG, INDEX, _expected_shapes
from ray_titan.checkpoint.manifest import HF_DIR, TOKENIZER_FILES, CheckpointError, read_manifest, resolve_checkpoint
from ray_titan.checkpoint.unpickler import SafeFileSystemReader, SafeLoadPlanner, check_metadata, load_metadata
from ray_titan.config.schema import JobConfig
from ray_titan.models.registry import ModelSpec, get_model_args, get_spec
from ray_titan.models.rope import RopeScaling
from ray_titan.models.state_dict_adapter import HFConfigError, Source
from ray_titan.parallel.finite import finite_each

__all__ = ["ExportResult", "export_hf", "save_last_hf"]

_EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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
    args = spec.hf.export_args(_args_of(manifest, spec, path))
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
        # As resume refuses them (no tensor-sized temporary).
        names = [k for k, t in sd.items() if t.is_floating_point() and t.numel()]
        for key, finite in zip(names, finite_each([sd[k] for k in names])):
            if not finite:
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

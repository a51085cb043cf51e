"""Hugging Face checkpoints in: checked before any worker starts, loaded on the workers shard by shard.

**Import** (``checkpoint.initial_load_hf = "<dir or URI>"``): ``hf_config.resolve_hf_job`` takes
the model family and arguments from the directory's ``config.json`` (``model_type`` picks the
family in ``ray_titan.models.registry``, whose state-dict adapter reads the rest) and its
``tokenizer.json``; :func:`check_hf_checkpoint` compares every tensor name, shape and dtype in
the safetensors headers with what the model needs, before any worker starts; on the workers
:func:`load_hf_weights` fills each rank's parameters of its pipeline stages after they are
sharded (FSDP2, expert parallel), reading only this rank's rows.

How a rank reads only its slice: a parameter's local chunk is the one DCP's planner would read
(``DTensor.__create_chunk_list__``: offsets and sizes in the whole tensor); FSDP2 and expert
parallelism shard dim 0, so a chunk is a run of rows, and in a safetensors file a run of rows is
one contiguous byte range (``hf_safetensors.SafetensorsFiles`` reads it, from a local directory
or object storage). The adapter's row permutation (q/k rotary layout) maps
ray_titan's rows to Hugging Face rows of the same head, read as the covering range; routed
experts stacked on dim 0 read one Hugging Face tensor per local expert. DCP's
``HuggingFaceStorageReader`` was not used: it opens files with ``safe_open`` (local paths only)
and loads tensors under their checkpoint names and shapes, whereas a rank here needs Hugging
Face rows that land in other rows (the q/k permutation can cross a shard boundary) or in a
slice of a stacked tensor.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ray_titan import storage
from ray_titan.checkpoint.hf_config import CONFIG, INDEX, SINGLE, HFCheckpointError, _expected_shapes, _hf_model
from ray_titan.checkpoint.hf_safetensors import _DTYPES, _PACKED, SafetensorsFiles
from ray_titan.models.gpt_oss.mxfp4 import packed_shapes
from ray_titan.models.registry import ModelSpec
from ray_titan.models.state_dict_adapter import Source
from ray_titan.parallel import local_tensor

__all__ = ["check_hf_checkpoint", "load_hf_weights"]


def _from_hf_layout(src: Source, t: torch.Tensor) -> torch.Tensor:
    """A Hugging Face tensor (or a run of its rows) in ray_titan's layout: ``src.cols``'s part of
    the last dim, then the last two dims swapped when ``src.transpose`` (:class:`Source`)."""
    if src.cols is not None:
        t = t[..., src.cols[0]::src.cols[1]]
    if src.transpose:
        t = t.transpose(-1, -2)
    return t.contiguous()


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


_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT_KEY = re.compile(r"model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")  # Mixtral: MiniMax-M2
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
            bounds[field] = (max([len(experts), *fused]), "routed experts (model.layers.N.mlp.experts.E, "
                             "model.layers.N.block_sparse_moe.experts.E, or dim 0 "
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
    ``skipped_prefixes``) are skipped with one printed line each; parts it declares but does not
    hold (the adapter's ``held_args``) are left out of ``args``. Returns ``(spec, args)``.
    Raises :class:`HFCheckpointError` naming the file and the problem (the tensor, both shapes;
    a ``config.json`` size beyond what the headers hold, checked before the model is built from
    it)."""
    spec, args, config = _hf_model(path)
    files = SafetensorsFiles(path)
    args = spec.hf.held_args(args, set(files.entries))
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


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

Modules: :mod:`.checkpointer` (the :class:`Checkpointer`: save, restore), :mod:`.manifest` (the
manifest, CRCs, completeness and compatibility checks, :class:`CheckpointError`),
:mod:`.unpickler` (reading DCP's metadata without unrestricted pickle), :mod:`.staging` (where
a checkpoint is written: local directory or Ray Train's staging).

Hugging Face checkpoints in and out (``config.json`` + safetensors + ``tokenizer.json``), one
module a concern: :mod:`.hf_config` (a model directory's ``config.json``: the family and model
arguments it describes, :func:`resolve_hf_job`, :func:`job_model_args`,
:class:`HFCheckpointError`), :mod:`.hf_safetensors` (:class:`SafetensorsFiles`: the headers,
and a run of rows read from a local directory or object storage), :mod:`.hf_import`
(:func:`check_hf_checkpoint` before the workers start, :func:`load_hf_weights` on each rank, its
own shard only) and :mod:`.hf_export` (:func:`export_hf`, :func:`save_last_hf`). Their public
names are importable from here; they are imported on first use, since they import every model
family (about 1.5 s), which a process that only finds or saves checkpoints does not need.
"""

import importlib
from typing import TYPE_CHECKING, Any

from ray_titan.checkpoint.checkpointer import Checkpointer, ModelParts
from ray_titan.checkpoint.manifest import (
    HF_DIR,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    TOKENIZER_FILES,
    CheckpointError,
    check_compatible,
    checkpoint_candidates,
    find_latest,
    read_manifest,
    resolve_checkpoint,
    saved_reports,
    step_dir_name,
)
from ray_titan.checkpoint.staging import LocalCheckpointStorage, RayTrainCheckpointStorage, remove_staging, staging_root
from ray_titan.checkpoint.unpickler import (
    ALLOWED_GLOBALS,
    MAX_METADATA_BYTES,
    MetadataUnpickler,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_metadata,
    load_metadata,
)

if TYPE_CHECKING:
    from ray_titan.checkpoint.hf_config import (
        CONFIG,
        INDEX,
        HFCheckpointError,
        hf_model,
        job_model_args,
        read_hf_config,
        resolve_hf_job,
    )
    from ray_titan.checkpoint.hf_export import ExportResult, export_hf, save_last_hf
    from ray_titan.checkpoint.hf_import import check_hf_checkpoint, load_hf_weights
    from ray_titan.checkpoint.hf_safetensors import MAX_HEADER_BYTES, SafetensorsFiles

_HF_HOMES = {
    **dict.fromkeys(["CONFIG", "INDEX", "HFCheckpointError", "hf_model", "job_model_args", "read_hf_config",
                     "resolve_hf_job"], "hf_config"),
    **dict.fromkeys(["ExportResult", "export_hf", "save_last_hf"], "hf_export"),
    **dict.fromkeys(["check_hf_checkpoint", "load_hf_weights"], "hf_import"),
    **dict.fromkeys(["MAX_HEADER_BYTES", "SafetensorsFiles"], "hf_safetensors"),
}


def __getattr__(name: str) -> Any:
    if name in _HF_HOMES:
        return getattr(importlib.import_module(f"ray_titan.checkpoint.{_HF_HOMES[name]}"), name)
    raise AttributeError(f"module 'ray_titan.checkpoint' has no attribute {name!r}")


__all__ = [
    "ALLOWED_GLOBALS",
    "CONFIG",
    "HF_DIR",
    "INDEX",
    "MANIFEST",
    "MAX_HEADER_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_METADATA_BYTES",
    "TOKENIZER_FILES",
    "CheckpointError",
    "Checkpointer",
    "ExportResult",
    "HFCheckpointError",
    "LocalCheckpointStorage",
    "MetadataUnpickler",
    "ModelParts",
    "RayTrainCheckpointStorage",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "SafetensorsFiles",
    "check_compatible",
    "check_hf_checkpoint",
    "check_metadata",
    "checkpoint_candidates",
    "export_hf",
    "find_latest",
    "hf_model",
    "job_model_args",
    "load_hf_weights",
    "load_metadata",
    "read_hf_config",
    "read_manifest",
    "remove_staging",
    "resolve_checkpoint",
    "resolve_hf_job",
    "save_last_hf",
    "saved_reports",
    "staging_root",
    "step_dir_name",
]

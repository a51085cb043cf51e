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
"""

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

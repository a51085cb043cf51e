"""A checkpoint's save and resume planned by DCP without writing a byte, for the dry run.

``dcp.save`` plans before it writes: every rank's planner lists its write items (a chunk of each
tensor, with its offsets in the global tensor, or a pickled object), the coordinator merges the
ranks' plans into the checkpoint's metadata and checks the chunks (in bounds, not overlapping),
and each rank then resolves every item to the tensor it would copy to the host. ``dcp.load``
plans the same way from the metadata: a key this rank asks for that the checkpoint lacks fails
there. :func:`plan_save` and :func:`plan_load` run those steps for one simulated rank (acting as
its own coordinator: the other ranks' plans are not here, so the coverage of each tensor by all
ranks' chunks is not checked) with torch's own planners (``DefaultSavePlanner``, ray_titan's
``SafeLoadPlanner``), and stop before any storage is touched; :func:`plan_checkpoint` plans a
built rank's checkpoint with them, as ``Checkpointer`` would save and resume it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["CheckpointPlanError", "plan_checkpoint", "plan_load", "plan_save"]


class CheckpointPlanError(RuntimeError):
    """A state the checkpoint could not save or resume: the message names the key and why."""


def plan_save(state: dict[str, Any], devices: tuple[str, ...] = ("cuda", "cpu")) -> tuple[Metadata, dict[str, int]]:
    """Plan the save of ``state`` (the flat dict ``Checkpointer.save`` gives ``dcp.save``) as DCP
    does, writing nothing. Returns the checkpoint's metadata and the bytes each device type would
    copy out (``{"cuda": ..., "cpu": ...}``; tensors only, this rank's chunks). Raises
    :class:`CheckpointPlanError` for a tensor on a device not in ``devices`` (a ``meta`` tensor
    never materialised: the writer's copy to the host fails) and for a global plan DCP rejects."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=True)
    local = planner.create_local_plan()
    try:
        plans, metadata = planner.create_global_plan([local])
    except ValueError as e:  # "Failed to validate global plan: ..." (out-of-bounds or overlapping chunks)
        raise CheckpointPlanError(f"the checkpoint's save plan is invalid: {e}") from e
    final = planner.finish_plan(plans[0])
    copied: Counter[str] = Counter()
    for item in final.items:
        data = planner.resolve_data(item)  # what the writer copies (a tensor) or pickles (BytesIO)
        if isinstance(data, torch.Tensor):
            if data.device.type not in devices:
                raise CheckpointPlanError(
                    f"checkpoint key {item.index.fqn!r}: a {data.device.type} tensor {tuple(data.shape)} {data.dtype}, "
                    f"which the writer cannot copy to the host; expected a tensor on {' or '.join(devices)}")
            copied[data.device.type] += data.numel() * data.element_size()
    return metadata, dict(copied)


def plan_load(state: dict[str, Any], metadata: Metadata) -> int:
    """Plan loading ``metadata``'s checkpoint into ``state`` (the dict ``Checkpointer`` hands
    ``dcp.load``) as DCP does, reading nothing; returns the number of read items. Raises
    :class:`CheckpointPlanError` with DCP's message naming a key ``state`` asks for that the
    checkpoint lacks."""
    from ray_titan.checkpoint import SafeLoadPlanner

    planner = SafeLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=True)
    try:  # DCP: "Missing key in checkpoint state_dict: ..." (a RuntimeError)
        plan = planner.create_global_plan([planner.create_local_plan()])[0]
    except RuntimeError as e:
        raise CheckpointPlanError(f"the checkpoint cannot be loaded into this rank's state: {e}") from e
    return len(planner.finish_plan(plan).items)


def plan_checkpoint(cfg: Any, parts: Any, loader: Any, vocab_size: int, step: int) -> dict[str, Any]:
    """The checkpoint after ``step`` of the built rank ``parts`` planned by DCP as
    ``Checkpointer.save`` would hand it over (:func:`plan_save`, nothing written), then its resume
    planned (``Checkpointer._load``'s state, key checks and DCP load planning) from it and from
    the same rank's save on CPU, which lacks the CUDA generator key. Returns the report's
    ``checkpoint_keys``, ``checkpoint_bytes`` (by device type) and ``resume_read_items``."""
    from ray_titan.checkpoint import Checkpointer
    from ray_titan.checkpoint.checkpointer import _check_keys, _drop_missing_device_rng

    ck = Checkpointer(cfg, parts.rank, parts.stages.values(), parts.optimizer, parts.scheduler, loader, None, None,
                      vocab_size, parts.device)
    state = ck._state(step, False, True)
    metadata, copied = plan_save(state)
    # The same rank's save on CPU: every key but the CUDA generator's. The resume's state is the
    # save's (Checkpointer._load builds the same keys and shapes; building it again costs seconds).
    cuda_rng = f"rng.rank{parts.rank}.cuda"
    on_cpu = dataclasses.replace(metadata, state_dict_metadata={
        k: v for k, v in metadata.state_dict_metadata.items() if k != cuda_rng})
    reads = []
    for saved in (metadata, on_cpu):
        sd = dict(state)
        _drop_missing_device_rng(sd, saved.state_dict_metadata, parts.rank)
        _check_keys(sd, saved, Path("(simulated checkpoint)"))
        reads.append(plan_load(sd, saved))
    return {"checkpoint_keys": len(metadata.state_dict_metadata), "checkpoint_bytes": copied,
            "resume_read_items": reads[0]}

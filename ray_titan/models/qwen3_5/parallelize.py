"""Parallelisms of the Qwen3.5 families, applied in the fixed order (TP) → EP → AC → compile → FSDP.

Tensor parallel is refused (``Qwen35Args.tp_unsupported``; the pre-flight says so before any
worker starts, and this raises ``ConfigError`` should it be reached): Gated DeltaNet's input
projection holds all queries, then all keys, then all values, so a column-wise split would not
split heads. Pipeline stages split the layers as any family's. Then expert parallelism over ``ep``
for the MoE family (``ray_titan.parallel.expert``), activation checkpointing, ``torch.compile``
of each block (graph breaks allowed: DeltaNet's chunk loop and MoE routing) and FSDP2 over
``dp_shard`` (HSDP with ``dp_replicate``; routed experts over ``efsdp`` under EP). Called on each
pipeline stage module on the meta device.
"""

from __future__ import annotations

from torch import nn

from ray_titan.config.schema import ConfigError, JobConfig
from ray_titan.models.qwen3_5.args import Qwen35Args
from ray_titan.parallel.dims import Meshes, ParallelDims
from ray_titan.parallel.stack import apply_after_tp

__all__ = ["parallelize_qwen3_5"]


def parallelize_qwen3_5(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg: JobConfig) -> None:
    """Parallelize one Qwen3.5 (dense or MoE) stage module in place (module docstring).
    ``meshes``: the job's meshes by name (:meth:`ParallelDims.build_mesh`), None on a single
    rank. Raises ``ConfigError`` for ``parallelism.tp > 1``."""
    if dims.tp > 1:
        raise ConfigError(f"parallelism.tp = {dims.tp} is not supported for {cfg.model.name}: "
                          f"{Qwen35Args.tp_unsupported}; use parallelism.tp = 1")
    apply_after_tp(model, dims, meshes, cfg, fullgraph=False)

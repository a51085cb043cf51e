"""Parallelisms of the MiniMax-M2 family: Qwen3-MoE's (``ray_titan.models.qwen3_moe.parallelize``:
EP → AC → compile → FSDP, experts over ``efsdp`` under EP) without tensor parallel, which is
refused (``MiniMaxM2Args.tp_unsupported``; the pre-flight says so before any worker starts, and
this raises ``ConfigError`` should it be reached): its q/k RMSNorms span all heads of a token, and
tensor parallel splits the heads over ranks. Called on each pipeline stage module on the meta device.
"""

from __future__ import annotations

from torch import nn

from ray_titan.config.schema import ConfigError, JobConfig
from ray_titan.models.minimax_m2.args import MiniMaxM2Args
from ray_titan.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from ray_titan.parallel.dims import Meshes, ParallelDims

__all__ = ["parallelize_minimax_m2"]


def parallelize_minimax_m2(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg: JobConfig) -> None:
    """Parallelize one MiniMax-M2 stage module in place (module docstring). ``meshes``: the job's
    meshes by name, None on a single rank. Raises ``ConfigError`` for ``parallelism.tp > 1``."""
    if dims.tp > 1:
        raise ConfigError(f"parallelism.tp = {dims.tp} is not supported for minimax_m2: "
                          f"{MiniMaxM2Args.tp_unsupported}; use parallelism.tp = 1")
    parallelize_qwen3_moe(model, dims, meshes, cfg)

"""Parallelisms of the gpt-oss family, applied in the fixed order (TP) → EP → AC → compile → FSDP.

Tensor parallel is refused (``GptOssArgs.tp_unsupported``; the pre-flight says so before any
worker starts, and this raises ``ConfigError`` should it be reached): splitting the experts by
their hidden units would split their biases, and the down projection's bias must be added once
per token, not once per tp rank; the sinks would follow the heads. Expert parallelism over
``ep`` (``ray_titan.parallel.expert``) shards every parameter of the routed experts on dim 0,
the biases ``b1``, ``b2``, ``b3`` with the weights (each is ``(experts, ...)``); then activation
checkpointing, ``torch.compile`` of each block (graph breaks allowed: MoE routing) and FSDP2
(routed experts over ``efsdp`` under EP), as Qwen3-MoE's (``ray_titan.models.qwen3_moe.parallelize``).
Called on each pipeline stage module on the meta device.
"""

from __future__ import annotations

from torch import nn

from ray_titan.config.schema import ConfigError, JobConfig
from ray_titan.models.gpt_oss.args import GptOssArgs
from ray_titan.parallel.dims import Meshes, ParallelDims
from ray_titan.parallel.stack import apply_after_tp

__all__ = ["parallelize_gpt_oss"]


def parallelize_gpt_oss(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg: JobConfig) -> None:
    """Parallelize one gpt-oss stage module in place (module docstring). ``meshes``: the job's
    meshes by name (:meth:`ParallelDims.build_mesh`), None on a single rank. Raises
    ``ConfigError`` for ``parallelism.tp > 1``."""
    if dims.tp > 1:
        raise ConfigError(f"parallelism.tp = {dims.tp} is not supported for gpt_oss: {GptOssArgs.tp_unsupported}; "
                          "use parallelism.tp = 1")
    apply_after_tp(model, dims, meshes, cfg, fullgraph=False)  # MoE routing breaks full graphs

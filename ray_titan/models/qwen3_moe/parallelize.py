"""Parallelisms of the Qwen3-MoE family, applied in the fixed order TP → EP → AC → compile → FSDP.

Tensor parallel (``ray_titan.parallel.tp``): the attention as the Llama/Qwen3 family's (``wq``,
``wk``, ``wv`` column-wise over the heads, ``wo`` row-wise; the per-head q/k norms act on each
rank's own heads; q/k/v biases, GLM-4.5's, split with their rows), dense feed-forwards and
shared experts (GLM-4.5's) split by hidden units, and the MoE layer as DeepSeek-V2's
(``ray_titan.models.deepseek_v2.parallelize``): the router replicated and seeing every token, the
routed experts split by their hidden units (``apply_expert_tensor_parallel``). Then expert
parallelism over ``ep`` (``ray_titan.parallel.expert``), activation checkpointing,
``torch.compile`` of each block (graph breaks allowed: MoE routing) and FSDP2 (routed experts
over ``efsdp`` under EP). Called on each pipeline stage module on the meta device.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from ray_titan.config.schema import JobConfig
from ray_titan.models.deepseek_v2.model import MoE
from ray_titan.parallel.dims import Meshes, ParallelDims
from ray_titan.parallel.expert import apply_expert_tensor_parallel
from ray_titan.parallel.stack import apply_after_tp
from ray_titan.parallel.tp import (
    apply_tp,
    attention_plan,
    decoder_ends_plan,
    feed_forward_plan,
    mtp_depth_plan,
    norm_plan,
    token_replicated_plan,
)

__all__ = ["parallelize_qwen3_moe"]


def parallelize_qwen3_moe(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg: JobConfig) -> None:
    """Parallelize one Qwen3-MoE stage module in place (module docstring). ``meshes``: the job's
    meshes by name (:meth:`ParallelDims.build_mesh`), None on a single rank."""
    par = cfg.parallelism
    if dims.tp > 1:
        assert meshes is not None
        sp = par.sequence_parallel
        apply_tp(model, meshes["tp"], decoder_ends_plan(model, sp, par.loss_parallel))
        for block in cast(nn.ModuleDict, model.layers).values():
            plan = attention_plan("attention", ["wq", "wk", "wv"], "wo", sp)
            if hasattr(block, "moe"):
                plan.update({**norm_plan("ffn_norm", sp), **token_replicated_plan("moe", sp)})
                if cast(MoE, block.moe).shared_experts is not None:  # GLM-4.5's; split by hidden units
                    plan.update(feed_forward_plan("moe.shared_experts", sequence_parallel=False, norm=None))
            else:
                plan.update(feed_forward_plan("feed_forward", sp))
            if hasattr(block, "eh_proj"):  # GLM-4.5's multi-token-prediction depth (Glm4MtpBlock)
                plan.update(mtp_depth_plan(sp))
            apply_tp(block, meshes["tp"], plan)
        apply_expert_tensor_parallel(model, meshes["tp"])
    apply_after_tp(model, dims, meshes, cfg, fullgraph=False)  # MoE routing breaks full graphs

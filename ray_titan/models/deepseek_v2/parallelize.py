"""Parallelisms of the DeepSeek-V2 family, applied in the fixed order TP → EP → AC → compile → FSDP.

Tensor parallel and ``torch.compile`` have their places reserved in that order. Expert
parallelism (``ray_titan.parallel.expert``) shards the routed experts over ``ep`` (borrowed from
``dp_shard``) before FSDP2, which then shards the experts over what ``ep`` leaves of
``dp_shard`` (``dp_shard_mod_ep``) and everything else over ``dp_shard``. Called on each pipeline
stage module while it is on the meta device, before its weights are materialised.
"""

from __future__ import annotations

from torch import nn

from ray_titan.config.schema import JobConfig
from ray_titan.parallel.ac import apply_ac
from ray_titan.parallel.dims import Meshes, ParallelDims
from ray_titan.parallel.expert import apply_expert_parallel
from ray_titan.parallel.fsdp import apply_fsdp, resolve_reshard_after_forward

__all__ = ["parallelize_deepseek_v2"]


def parallelize_deepseek_v2(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg: JobConfig) -> None:
    """Parallelize one DeepSeek-V2 stage module in place.

    ``meshes``: the 1-D meshes by axis name (:meth:`ParallelDims.build_mesh`), None on a single
    rank. Order: (tensor parallel: not yet) → expert parallel over ``ep`` when it is > 1 →
    activation checkpointing per ``[activation_checkpoint]`` → (compile: not yet) → FSDP2 over
    ``dp_shard`` when it is > 1 (routed experts over ``dp_shard_mod_ep`` under EP).
    """
    if dims.ep > 1:
        assert meshes is not None
        apply_expert_parallel(model, meshes["ep"])
    ac = cfg.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_option, ac.layer_freq)
    if dims.dp_shard > 1:
        assert meshes is not None
        reshard = resolve_reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, dims.pp > 1)
        apply_fsdp(model, meshes["dp_shard"], reshard, meshes["dp_shard_mod_ep"] if dims.ep > 1 else None,
                   cpu_offload=cfg.memory.cpu_offload)

"""Parallelisms of the Llama family, applied in the fixed order TP → AC → compile → FSDP.

Tensor parallel and ``torch.compile`` have their places reserved in that order; today a Llama
stage gets activation checkpointing (``ray_titan.parallel.ac``) and FSDP2 over ``dp_shard``
(``ray_titan.parallel.fsdp``). Called on each pipeline stage module while it is on the meta
device, before its weights are materialised.
"""

from __future__ import annotations

from torch import nn

from ray_titan.config.schema import JobConfig
from ray_titan.parallel.ac import apply_ac
from ray_titan.parallel.dims import Meshes, ParallelDims
from ray_titan.parallel.fsdp import apply_fsdp, resolve_reshard_after_forward

__all__ = ["parallelize_llama"]


def parallelize_llama(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg: JobConfig) -> None:
    """Parallelize one Llama stage module in place.

    ``meshes``: the 1-D meshes by axis name (:meth:`ParallelDims.build_mesh`), None on a single
    rank. Order: (tensor parallel: not yet) → activation checkpointing per
    ``[activation_checkpoint]`` → (compile: not yet) → FSDP2 over ``dp_shard`` when it is > 1,
    with ``parallelism.fsdp_reshard_after_forward`` and ``memory.cpu_offload``.
    """
    ac = cfg.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_option, ac.layer_freq)
    if dims.dp_shard > 1:
        assert meshes is not None
        reshard = resolve_reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, dims.pp > 1)
        apply_fsdp(model, meshes["dp_shard"], reshard, cpu_offload=cfg.memory.cpu_offload)

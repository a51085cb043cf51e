"""Parallelisms of the Llama family, applied in the fixed order TP → AC → compile → FSDP.

Tensor parallel (``ray_titan.parallel.tp``) splits the attention heads (``wq``, ``wk``, ``wv``
column-wise, ``wo`` row-wise; grouped-query attention needs ``n_kv_heads`` divisible by tp),
the feed-forward's hidden units (``w1``, ``w3`` column-wise, ``w2`` row-wise), the embedding
(row-wise, over the vocabulary) and the output head (column-wise, loss parallel); with sequence
parallel the norms run on ``1/tp`` of the sequence. Then activation checkpointing
(``ray_titan.parallel.ac``), ``torch.compile`` of each block (``training.compile``), and FSDP2
over ``dp_shard``, or HSDP over ``(dp_replicate, dp_shard)`` (``ray_titan.parallel.fsdp``). Called on each pipeline
stage module while it is on the meta device, before its weights are materialised.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from ray_titan.config.schema import JobConfig
from ray_titan.parallel.dims import Meshes, ParallelDims
from ray_titan.parallel.stack import apply_after_tp
from ray_titan.parallel.tp import apply_tp, attention_plan, decoder_ends_plan, feed_forward_plan

__all__ = ["parallelize_llama"]


def parallelize_llama(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg: JobConfig) -> None:
    """Parallelize one Llama stage module in place.

    ``meshes``: the job's meshes by name (:meth:`ParallelDims.build_mesh`), None on a single
    rank. Order: tensor parallel over ``tp`` when it is > 1 (``parallelism.sequence_parallel``,
    ``parallelism.loss_parallel``) → activation checkpointing per ``[activation_checkpoint]`` →
    ``torch.compile`` of each block when ``training.compile`` → FSDP2 over the ``fsdp`` mesh
    when there is more than one data-parallel rank, with ``parallelism.fsdp_reshard_after_forward``
    and ``memory.cpu_offload``.
    """
    par = cfg.parallelism
    if dims.tp > 1:
        assert meshes is not None
        sp = par.sequence_parallel
        apply_tp(model, meshes["tp"], decoder_ends_plan(model, sp, par.loss_parallel))
        for block in cast(nn.ModuleDict, model.layers).values():
            apply_tp(block, meshes["tp"], {**attention_plan("attention", ["wq", "wk", "wv"], "wo", sp),
                                           **feed_forward_plan("feed_forward", sp)})
    apply_after_tp(model, dims, meshes, cfg)

"""Parallelisms of the DeepSeek-V2 family, applied in the fixed order TP → EP → AC → compile → FSDP.

Tensor parallel (``ray_titan.parallel.tp``), as torchtitan applies it to DeepSeek:

- **MLA**: the per-head projections are split column-wise over the heads (``wq``, or ``wq_b``
  with a query latent; ``wkv_b``, which expands the latent into each head's key and value) and
  ``wo`` row-wise; the latent projections are replicated (``wkv_a``, ``kv_norm``, and ``wq_a``,
  ``q_norm``): their outputs are shared by all heads and small (``kv_lora_rank`` + the rotary
  key per token). The rotary key's gradient, which each tp rank computes for its own heads, is
  summed over tp (``ReduceGradSlice``).
- **Dense feed-forward** and the MoE's **shared experts**: hidden units split (``w1``, ``w3``
  column-wise, ``w2`` row-wise).
- **MoE layer**: the router is replicated and sees every token (the layer's input is
  all-gathered under sequence parallel), so the routing and the balance loss are those of one
  worker; the **routed experts are tensor-parallel** too, split by their hidden units
  (``apply_expert_tensor_parallel``), and with ``ep > 1`` also expert-parallel over ``ep``
  (borrowed from ``dp_shard``): each rank holds ``1/tp`` of ``N/ep`` experts. Why TP and not
  EP over tp: the tp ranks already hold the same tokens, so splitting the experts' hidden units
  costs one all-reduce of the experts' outputs and no token exchange, and EP stays within
  ``dp_shard``, where the tokens differ.
- Embedding row-wise, output head column-wise with loss parallel, norms sequence-parallel.
- **Multi-token prediction** (DeepSeek-V3's ``MtpBlock``, on the last stage): its MoE block as
  any other; under sequence parallel its norms (``enorm``, ``hnorm``, ``head_norm``) and the
  projection ``eh_proj`` run on the sequence shards with replicated weights (``SequenceParallel``:
  the embedding and hidden state it joins are both ``Shard(1)``, the projection is per token), so
  nothing is gathered; without it they are plain modules every tp rank computes alike. A last
  stage's copy of the embedding, ``mtp_embeddings``, is split as ``tok_embeddings``
  (``decoder_ends_plan``), and each depth's logits go through the shared head, with loss parallel.

Then expert parallelism (``ray_titan.parallel.expert``) shards the routed experts over ``ep``
before FSDP2, which shards the experts over what ``ep`` leaves of ``dp_shard``
(``dp_shard_mod_ep``) and everything else over ``dp_shard`` (HSDP: replicated over
``dp_replicate`` as well). Called on each pipeline stage module while it is on the meta device,
before its weights are materialised.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from ray_titan.config.schema import JobConfig
from ray_titan.parallel.dims import Meshes, ParallelDims
from ray_titan.parallel.expert import apply_expert_tensor_parallel
from ray_titan.parallel.stack import apply_after_tp
from ray_titan.parallel.tp import (
    ReduceGradSlice,
    apply_tp,
    attention_plan,
    decoder_ends_plan,
    feed_forward_plan,
    mtp_depth_plan,
    norm_plan,
    token_replicated_plan,
)

__all__ = ["parallelize_deepseek_v2"]


def _block_tp_plan(block: Any, sp: bool) -> dict:
    attn = block.attention
    colwise = ["wq" if hasattr(attn, "wq") else "wq_b", "wkv_b"]
    plan = {**attention_plan("attention", colwise, "wo", sp),
            "attention.wkv_a": ReduceGradSlice(attn.kv_lora_rank)}
    if hasattr(block, "moe"):
        plan.update({**norm_plan("ffn_norm", sp), **token_replicated_plan("moe", sp)})
        if block.moe.shared_experts is not None:
            plan.update(feed_forward_plan("moe.shared_experts", sequence_parallel=False, norm=None))
    else:
        plan.update(feed_forward_plan("feed_forward", sp))
    if hasattr(block, "eh_proj"):  # a multi-token-prediction depth (MtpBlock)
        plan.update(mtp_depth_plan(sp))
    return plan


def parallelize_deepseek_v2(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg: JobConfig) -> None:
    """Parallelize one DeepSeek-V2 stage module in place.

    ``meshes``: the job's meshes by name (:meth:`ParallelDims.build_mesh`), None on a single
    rank. Order: tensor parallel over ``tp`` when it is > 1 (module docstring) → expert parallel
    over ``ep`` when it is > 1 → activation checkpointing per ``[activation_checkpoint]`` →
    ``torch.compile`` of each block when ``training.compile`` (graph breaks allowed: MoE
    routing) → FSDP2 over the ``fsdp`` mesh when there is more than one data-parallel rank
    (routed experts over ``efsdp`` under EP).
    """
    par = cfg.parallelism
    if dims.tp > 1:
        assert meshes is not None
        sp = par.sequence_parallel
        apply_tp(model, meshes["tp"], decoder_ends_plan(model, sp, par.loss_parallel))
        for block in cast(nn.ModuleDict, model.layers).values():
            apply_tp(block, meshes["tp"], _block_tp_plan(block, sp))
        apply_expert_tensor_parallel(model, meshes["tp"])
    apply_after_tp(model, dims, meshes, cfg, fullgraph=False)  # MoE routing breaks full graphs

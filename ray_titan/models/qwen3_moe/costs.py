"""Qwen3-MoE's training FLOPs and activation memory (``ray_titan.models.costs``): Qwen3's
attention (Llama's formula with ``qk_norm``) and DeepSeek-V2's MoE feed-forward."""

from __future__ import annotations

import dataclasses
from typing import Any

from ray_titan.models.costs import BlockActivations, transformer_flops_per_token
from ray_titan.models.deepseek_v2.costs import moe_activations
from ray_titan.models.llama.costs import LLAMA_MATMULS, llama_block_activations

__all__ = ["qwen3_moe_block_activations", "qwen3_moe_flops_per_token", "routed_flops_per_token"]


def qwen3_moe_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a Qwen3-MoE model
    (:class:`~ray_titan.models.qwen3_moe.args.Qwen3MoeArgs`) at ``seq_len``:
    :func:`~ray_titan.models.costs.transformer_flops_per_token` with N = the activated
    non-embedding parameters (DeepSeek's count, :func:`ray_titan.models.deepseek_v2.model.activated_parameters`,
    on the meta device: attention, dense layers, routers and ``top_k`` of the routed experts,
    output head), L = ``n_layers`` and H·Q = ``n_heads × head_dim``."""
    from ray_titan.models.qwen3_moe.model import Qwen3Moe

    return routed_flops_per_token(Qwen3Moe, args, seq_len)


def routed_flops_per_token(model_cls: type, args: Any, seq_len: int) -> int:
    """Training FLOPs per token at ``seq_len`` of a grouped-query-attention MoE model
    ``model_cls(args)`` (Qwen3-MoE, GLM-4.5): :func:`~ray_titan.models.costs.transformer_flops_per_token`
    with N = its activated non-embedding parameters counted on the meta device (DeepSeek's count,
    :func:`ray_titan.models.deepseek_v2.model.activated_parameters`), L = ``n_layers`` and H·Q =
    ``n_heads × head_dim``. Multi-token prediction's ``n_mtp_layers`` depths (GLM-4.5) count as
    DeepSeek-V3's do (:func:`~ray_titan.models.deepseek_v2.costs.deepseek_flops_per_token`): more
    blocks, and the output head once more each."""
    import torch

    from ray_titan.models.deepseek_v2.model import activated_parameters

    mtp = getattr(args, "n_mtp_layers", 0)
    with torch.device("meta"):
        n = activated_parameters(model_cls(args)) + mtp * args.vocab_size * args.dim
    return transformer_flops_per_token(n, args.n_layers + mtp, args.n_heads * args.head_dim, seq_len)


def qwen3_moe_block_activations(a: Any, layer: int, e: int, seq: int, device: str, rho: float,
                                ep: int) -> BlockActivations:
    """Bytes per token block ``layer`` saves: a dense layer is Qwen3's (Llama's formula); an MoE
    layer is Qwen3's attention and norms (Llama's formula with no feed-forward) plus
    :func:`~ray_titan.models.deepseek_v2.costs.moe_activations` (shared experts included: GLM-4.5's,
    whose arguments have the same ``attention_args()`` and ``moe_layers``; its multi-token-prediction
    depths, keyed from ``n_layers``, are MoE layers)."""
    attn = a.attention_args()
    if layer not in a.moe_layers and layer < a.n_layers:
        return llama_block_activations(attn, layer, e, seq, device, rho, ep)
    base = llama_block_activations(dataclasses.replace(attn, ffn_dim=0), layer, e, seq, device, rho, ep)
    moe = moe_activations(a, e, rho, ep, 0.0, device=device, mm_before=LLAMA_MATMULS)  # norms: Llama's
    return BlockActivations(base.none + moe.none, base.op + moe.op, base.input, base.backward + moe.backward,
                            moe.experts_none, moe.experts_op, base.whole + moe.whole,
                            backward_whole=moe.backward_whole)

"""gpt-oss's training FLOPs and activation memory (``ray_titan.models.costs``)."""

from __future__ import annotations

from typing import Any

from ray_titan.models.costs import F32, I64, BlockActivations, transformer_flops_per_token
from ray_titan.models.deepseek_v2.costs import moe_activations
from ray_titan.models.llama.args import LlamaArgs
from ray_titan.models.llama.costs import llama_block_activations

__all__ = ["gpt_oss_block_activations", "gpt_oss_flops_per_token"]


def gpt_oss_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a gpt-oss model (:class:`~ray_titan.models.gpt_oss.args.GptOssArgs`)
    at ``seq_len``: ``6·N`` with N its activated non-embedding parameters
    (:func:`ray_titan.models.gpt_oss.activated_parameters`, on the meta device), plus
    ``12·(H·Q)·T`` for each full-attention layer and ``12·(H·Q)·min(T, sliding_window)`` for
    each sliding-window one (its queries see at most the window; the sink column is negligible)."""
    import torch

    from ray_titan.models.gpt_oss.model import GptOss, activated_parameters

    with torch.device("meta"):
        n = activated_parameters(GptOss(args))
    context = sum(min(seq_len, args.sliding_window) if args.is_sliding(i) else seq_len for i in range(args.n_layers))
    return transformer_flops_per_token(n, 0, 0, seq_len) + 12 * args.n_heads * args.head_dim * context


def gpt_oss_block_activations(a: Any, layer: int, e: int, seq: int, device: str, rho: float,
                              ep: int) -> BlockActivations:
    """Bytes per token block ``layer`` saves: Llama's attention and norms (the q/k/v/o biases save
    nothing more) plus what its sinks add, the zero key and value row and the additive mask
    ``(heads, seq + 1)`` per query that SDPA saves (and whose gradient backward makes), and
    :func:`~ray_titan.models.deepseek_v2.costs.moe_activations` with the clamped SwiGLU's three
    more hidden-sized tensors per routed copy than SwiGLU's (seven in all, measured with
    ``saved_tensors_hooks`` on torch 2.13: tests/unit/test_gpt_oss.py). Llama's formula counts
    the query width ``n_heads·head_dim`` (4096 on gpt-oss-20B, whose ``dim`` is 2880). The
    backward's transient is the attention's (the mask's gradient) or the MoE's, whichever is
    larger: they are not alive together, and the attention's backward runs after the MoE's saved
    tensors are freed (measured on the simulated GPU, ``ray-titan dry-run``)."""
    attn = LlamaArgs(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                     attn_head_dim=a.head_dim, ffn_dim=0, multiple_of=1, ffn_dim_multiplier=None)
    base = llama_block_activations(attn, layer, e, seq, device, rho, ep)
    mask = e * a.n_heads * (seq + 1) + e * 2 * a.n_kv_heads * a.head_dim
    # Op SAC: its biased projections and router run addmm, saved and not counted (Llama's formula
    # counts wq, wk, wv, wo as matmuls and saves wq's and wv's): wk's and wo's outputs and the
    # router's logits saved too, and the experts' matmuls are the block's first counted ones.
    moe = moe_activations(a, e, rho, ep, 0.0, device=device)
    sac = e * (a.n_kv_heads * a.head_dim + a.dim) + F32 * a.n_routed_experts
    routed = rho * a.n_activated_experts if ep > 1 else a.n_activated_experts
    clamp = e * 3 * a.moe_inter_dim * routed
    # Its router (routing.topk_softmax) saves the biased logits and the softmax over the top k; the
    # experts' biases the expert of each routed row (int64): measured on the simulated GPU.
    router = F32 * (a.n_routed_experts + a.n_activated_experts) + I64 * routed
    return BlockActivations(base.none + mask + moe.none + clamp + router, base.op + sac + mask + moe.op, base.input,
                            max(base.backward + e * a.n_heads * (seq + 1) - moe.none - clamp, moe.backward),
                            moe.experts_none + clamp, moe.experts_op)

"""Qwen3.5-MoE's activation memory (``ray_titan.models.costs``): Qwen3.5's layers
(``ray_titan.models.qwen3_5.costs``) with DeepSeek-V2's MoE feed-forward
(:func:`~ray_titan.models.deepseek_v2.costs.moe_activations`: router, dispatch, routed experts)
and the gated shared expert: its SwiGLU's ``4e·s``, the MoE input it reads ``e·d`` (saved for
it whatever the dtype) and its output, which the gate scales, ``e·d``. Its FLOPs are the dense
family's formula with the activated parameters (``qwen3_5_flops_per_token``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ray_titan.models.costs import BlockActivations
from ray_titan.models.deepseek_v2.costs import moe_activations
from ray_titan.models.qwen3_5.costs import hybrid_flops_per_token, qwen3_5_block_activations

__all__ = ["qwen3_5_moe_block_activations", "qwen3_5_moe_flops_per_token"]


def qwen3_5_moe_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a Qwen3.5-MoE model at ``seq_len``
    (:func:`~ray_titan.models.qwen3_5.costs.hybrid_flops_per_token`: the activated parameters)."""
    import torch

    from ray_titan.models.qwen3_5_moe.model import Qwen35Moe

    with torch.device("meta"):
        return hybrid_flops_per_token(Qwen35Moe(args), seq_len)


def qwen3_5_moe_block_activations(a: Any, layer: int, e: int, seq: int, device: str, rho: float,
                                  ep: int) -> BlockActivations:
    """Bytes per token block ``layer`` saves (module docstring); ``rho``: the routing imbalance,
    ``ep``: the expert-parallel degree."""
    moe = moe_activations(a, e, rho, ep, 0.0, device=device)
    shared = e * (4 * a.shared_inter_dim + 2 * a.dim)
    ffn = dataclasses.replace(moe, none=moe.none + shared, op=moe.op + shared,
                              backward=max(moe.backward, e * (2 * a.shared_inter_dim)))
    return qwen3_5_block_activations(a, layer, e, seq, device, rho, ep, ffn=ffn)

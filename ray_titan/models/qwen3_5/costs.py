"""Qwen3.5's training FLOPs and activation memory (``ray_titan.models.costs``): placeholder, refined below."""

from __future__ import annotations

from typing import Any

from ray_titan.models.costs import BlockActivations, transformer_flops_per_token

__all__ = ["qwen3_5_block_activations", "qwen3_5_flops_per_token"]


def qwen3_5_flops_per_token(args: Any, seq_len: int) -> int:
    import torch

    from ray_titan.models.decoder import count_parameters
    from ray_titan.models.registry import spec_for_args

    with torch.device("meta"):
        model = spec_for_args(args).model_cls(args)
    n = count_parameters(model) - args.vocab_size * args.dim
    return transformer_flops_per_token(n, len(args.full_attention_layers), args.n_heads * args.head_dim, seq_len)


def qwen3_5_block_activations(a: Any, layer: int, e: int, seq: int, device: str, rho: float,
                              ep: int) -> BlockActivations:
    return BlockActivations(0.0, 0.0, 4 * a.dim, 0.0)

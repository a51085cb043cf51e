"""GLM-4.5's training FLOPs and activation memory (``ray_titan.models.costs``): Qwen3-MoE's
formulas (``ray_titan.models.qwen3_moe.costs``: Llama's attention and norms, q/k norms when
``qk_norm``, DeepSeek-V2's MoE feed-forward with its shared experts), which read the same
``attention_args()`` and ``moe_layers``. The q/k/v biases save nothing more (a linear layer's
backward needs its input only), and the partial rotary embedding saves its ``cos``/``sin`` views
only, as a whole one does."""

from __future__ import annotations

from typing import Any

from ray_titan.models.qwen3_moe.costs import qwen3_moe_block_activations, routed_flops_per_token

__all__ = ["glm4_moe_block_activations", "glm4_moe_flops_per_token"]

glm4_moe_block_activations = qwen3_moe_block_activations


def glm4_moe_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a GLM-4.5 model (:class:`~ray_titan.models.glm4_moe.args.Glm4MoeArgs`)
    at ``seq_len``: :func:`~ray_titan.models.qwen3_moe.costs.routed_flops_per_token` of its model
    (activated non-embedding parameters: attention, dense layers, routers, shared experts and
    ``top_k`` of the routed experts, output head)."""
    from ray_titan.models.glm4_moe.model import Glm4Moe

    return routed_flops_per_token(Glm4Moe, args, seq_len)

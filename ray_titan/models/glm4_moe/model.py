"""GLM-4.5 decoder (``glm4_moe``): Llama-style attention with GLM's variations and DeepSeek-V3's
MoE layer.

Architecture after GLM-4.5 (Zhipu AI / Z.ai 2025, "GLM-4.5: Agentic, Reasoning, and Coding (ARC)
Foundation Models", arXiv:2508.06471 §2.1) and transformers'
``models/glm4_moe/modeling_glm4_moe.py`` (``Glm4MoeForCausalLM``): pre-norm blocks whose
attention is grouped-query (``ray_titan.models.llama.model.Attention``) with biases on the q/k/v
projections, an optional RMSNorm over each query and key head (``use_qk_norm``) and a *partial*
rotary embedding (the first half of each head's dimensions turned, the rest passed through); and
whose feed-forward is a dense SwiGLU in the first ``first_k_dense_replace`` layers, then
DeepSeek-V3's MoE layer (``ray_titan.models.deepseek_v2.model.MoE``): sigmoid scores with a
correction bias for the selection (``noaux_tc`` of ``ray_titan.models.routing``), renormalised
top-k weights times ``routed_scaling_factor``, one shared expert, stacked routed experts,
dropless routing, expert parallelism. The block is Qwen3-MoE's
(:class:`~ray_titan.models.qwen3_moe.model.Qwen3MoeBlock`) with that MoE layer; the model is
DeepSeek-V2's skeleton (its buffers and MoE bookkeeping) with this block. transformers computes no
balance loss for GLM-4.5; ``load_balance`` chooses ray_titan's (``Glm4MoeArgs``).
"""

from __future__ import annotations

from torch import nn

from ray_titan.models.deepseek_v2.model import DeepSeekV2, MoE, MtpDepth
from ray_titan.models.qwen3_moe.model import Qwen3MoeBlock

__all__ = ["Glm4Moe", "Glm4MoeBlock", "Glm4MtpBlock"]


class Glm4MoeBlock(Qwen3MoeBlock):
    """Pre-norm block: GLM attention, then a dense SwiGLU (``feed_forward``) or DeepSeek's
    :class:`~ray_titan.models.deepseek_v2.model.MoE` (``moe``). Input and output ``(batch, seq, dim)``."""

    MOE = MoE


class Glm4MtpBlock(MtpDepth, Glm4MoeBlock):
    """One depth of GLM-4.5's multi-token prediction (GLM-4.5 §2.1: "an MTP layer", the
    checkpoints' ``model.layers.<num_hidden_layers + k>``; transformers' ``MtpLayer`` around
    ``Glm4MoeDecoderLayer``): DeepSeek-V3's depth
    (:class:`~ray_titan.models.deepseek_v2.model.MtpDepth`) around GLM's own block, its attention
    (q/k/v biases, partial rotary, q/k norms) and an MoE feed-forward (an MTP layer is always MoE:
    transformers' ``get_mtp_config`` sets ``first_k_dense_replace = 0``)."""


class Glm4Moe(DeepSeekV2):
    """GLM-4.5 decoder (module docstring); input/output as :class:`~ray_titan.models.decoder.Decoder`,
    multi-token prediction (``args.n_mtp_layers``) as DeepSeek-V3's with :class:`Glm4MtpBlock`.
    The rotary tables cover the rotated part of a head (``args.rotary_dim``)."""

    def make_layer(self, layer_id: int) -> nn.Module:
        return Glm4MoeBlock(self.args, layer_id)

    def make_mtp_layer(self, layer_id: int) -> nn.Module:
        return Glm4MtpBlock(self.args, layer_id)

    @property
    def rope_dim(self) -> int:
        return self.args.rotary_dim

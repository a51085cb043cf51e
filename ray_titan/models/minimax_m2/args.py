"""Arguments of the MiniMax-M2 family (``minimax_m2``) and its flavors (sizes).

Dimensions from the model card's ``config.json`` (huggingface.co/MiniMaxAI/MiniMax-M2): 62
layers of width 3,072, grouped-query attention of 48 heads of 128 over 8 key-value heads, one
RMSNorm over all query heads and one over all key heads (``qk_norm_type = "per_layer"``), the
first 64 of each head's 128 dimensions rotated (``rotary_dim``, rope theta 5,000,000); every layer
a mixture of 256 SwiGLU experts of 1,536 of which a token uses 8, chosen by sigmoid scores plus a
correction bias (``scoring_func = "sigmoid"``, ``use_routing_bias``) and weighted by their
unbiased scores renormalised; no shared expert, no dense layer; RMSNorm eps 1e-6; a 200,064-row
embedding not tied to the output head. The card: "230 billion total parameters with 10 billion
active" (checked against this package's counter: ``tests/unit/test_minimax_m2.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from ray_titan.models.llama.args import LlamaArgs

__all__ = ["FLAVORS", "MiniMaxM2Args"]


@dataclass(frozen=True)
class MiniMaxM2Args:
    """Hyper-parameters of a MiniMax-M2 model (transformers' ``MiniMaxM2Config``). Defaults: MiniMax-M2.

    Attention (:meth:`attention_args`): grouped-query, ``head_dim`` per head, no biases, q/k RMSNorm
    over all heads of a token before the split into heads, the rotary embedding on the first
    ``rotary_dim`` dimensions of each head. Every layer is DeepSeek-V3's MoE layer
    (``ray_titan.models.deepseek_v2.model.MoE``) with ``n_routed_experts`` experts of
    ``moe_inter_dim`` (``intermediate_size``), the top ``n_activated_experts`` by sigmoid score
    plus the correction bias (``noaux_tc`` in one group, ``ray_titan.models.routing``), weighted by
    their unbiased scores renormalised to sum to 1; the routing fields MiniMax-M2 fixes are
    properties. The model is GLM-4.5's (``ray_titan.models.glm4_moe.model.Glm4Moe``), which reads
    only these.

    ``load_balance``: ``aux_free`` (default: the correction bias moved by ``bias_update_rate``),
    ``aux_loss`` (DeepSeek's sequence-wise loss, not transformers' Switch loss over softmax logits)
    or ``none``.
    """

    dim: int = 3072
    n_layers: int = 62
    n_heads: int = 48
    n_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 200_064
    moe_inter_dim: int = 1536
    n_routed_experts: int = 256
    n_activated_experts: int = 8
    rotary_dim: int = 64
    norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    max_seq_len: int = 196_608
    init_std: float = 0.02
    tie_word_embeddings: bool = False
    load_balance: Literal["aux_loss", "aux_free", "none"] = "aux_free"
    aux_loss_coeff: float = 0.001
    """α of DeepSeek's sequence-wise balance loss (when ``load_balance = "aux_loss"``)."""
    bias_update_rate: float = 0.001
    """γ of auxiliary-loss-free balancing (when ``load_balance = "aux_free"``)."""

    tp_unsupported: ClassVar[str] = (
        "its q/k RMSNorms span all heads of a token, which tensor parallel splits over ranks (the norm "
        "would need the other ranks' heads)")
    """Why ``parallelism.tp > 1`` is refused (the pre-flight reads it, ``ray_titan.preflight.checks``)."""


    @property
    def moe_layers(self) -> list[int]:
        """Every layer is MoE."""
        return list(range(self.n_layers))

    # Routing and layer settings MiniMax-M2 fixes (ray_titan.models.routing.RoutingArgs, MoEArgs):
    # class attributes, not fields (no config.json value changes them).
    topk_method = "noaux_tc"
    score_func = "sigmoid"
    n_group = topk_group = 1
    norm_topk_prob = True
    route_scale = 1.0
    n_shared_experts = 0
    rope_scaling = None

    def attention_args(self) -> LlamaArgs:
        """These sizes as Llama-style dense arguments (partial rotary, q/k norms over all heads):
        what the attention (``ray_titan.models.llama.model.Attention``) and the Llama adapter's
        attention names read. Its feed-forward size is the experts' (no layer is dense)."""
        return LlamaArgs(
            dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            vocab_size=self.vocab_size, ffn_dim=self.moe_inter_dim, attn_head_dim=self.head_dim,
            norm_eps=self.norm_eps, rope_theta=self.rope_theta, max_seq_len=self.max_seq_len, init_std=self.init_std,
            qk_norm=True, qk_norm_per_layer=True, tie_word_embeddings=self.tie_word_embeddings, multiple_of=1,
            ffn_dim_multiplier=None, rotary_dim=self.rotary_dim,
        )


FLAVORS: dict[str, MiniMaxM2Args] = {
    # 4 layers, all MoE, GQA 8/4 heads of 32 (16 rotated), 8 experts top-2: every part, CPU-sized.
    "debug": MiniMaxM2Args(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=258,
                           moe_inter_dim=64, n_routed_experts=8, n_activated_experts=2, rotary_dim=16,
                           max_seq_len=1024),
    # MiniMax-M2 (huggingface.co/MiniMaxAI/MiniMax-M2, config.json): 230 B total, 10 B activated.
    "230B-A10B": MiniMaxM2Args(),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly."""

"""Arguments of the GLM-4.5 family (``glm4_moe``) and its flavors (sizes).

Dimensions from the model cards' ``config.json`` (huggingface.co/zai-org/GLM-4.5 and
zai-org/GLM-4.5-Air; GLM-4.6 and GLM-4.7 have GLM-4.5's architecture and sizes, with a longer
``max_position_embeddings``): grouped-query attention of 96 heads of 128 over 8 key-value heads,
biases on the q/k/v projections, half of each head rotated (``partial_rotary_factor`` 0.5, rope
theta 1,000,000), per-head q/k RMSNorm in GLM-4.5 (not in Air); sigmoid routing with a correction
bias (``noaux_tc``, one group) to the top 8 of the routed experts with renormalised weights, one
shared expert, the first ``first_k_dense_replace`` layers dense; RMSNorm eps 1e-5; a 151,552-row
embedding not tied to the output head. Sources of the counts: GLM-4.5's card, "355B total
parameters and 32B active", GLM-4.5-Air's "106B total parameters and 12B active" (checked against
this package's counter: ``tests/unit/test_glm4_moe.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ray_titan.models.llama.args import LlamaArgs

__all__ = ["FLAVORS", "Glm4MoeArgs"]


@dataclass(frozen=True)
class Glm4MoeArgs:
    """Hyper-parameters of a GLM-4.5 model (transformers' ``Glm4MoeConfig``). Defaults: GLM-4.5-Air.

    Attention (:meth:`attention_args`): grouped-query, ``head_dim`` per head, q/k/v biases when
    ``attention_bias``, an RMSNorm over each query and key head before the rotary embedding when
    ``qk_norm`` (``use_qk_norm``), the rotary embedding on the first ``rotary_dim`` =
    ``head_dim × partial_rotary_factor`` dimensions of each head (:attr:`rotary_dim`). Layers
    ``0 .. n_dense_layers - 1`` (``first_k_dense_replace``) are a dense SwiGLU of ``inter_dim``;
    the others DeepSeek-V3's MoE layer (``ray_titan.models.deepseek_v2.model.MoE``):
    ``n_routed_experts`` SwiGLU experts of ``moe_inter_dim``, the top ``n_activated_experts``
    chosen by sigmoid scores plus the correction bias within the ``topk_group`` best of
    ``n_group`` groups (``noaux_tc``, ``ray_titan.models.routing``), weighted by their unbiased
    scores renormalised when ``norm_topk_prob``, times ``route_scale``
    (``routed_scaling_factor``), plus ``n_shared_experts`` shared experts as one SwiGLU of
    ``n_shared_experts × moe_inter_dim``.

    ``load_balance``: ``aux_free`` (default: the checkpoint's correction bias moved by
    ``bias_update_rate``, as DeepSeek-V3), ``aux_loss`` (DeepSeek's sequence-wise loss; the bias
    still takes part in the selection) or ``none``. ``n_mtp_layers``: multi-token-prediction
    depths (``num_nextn_predict_layers``), built as DeepSeek-V3's around GLM's block.
    """

    dim: int = 4096
    n_layers: int = 46
    n_heads: int = 96
    n_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151_552
    inter_dim: int = 10_944
    moe_inter_dim: int = 1408
    n_routed_experts: int = 128
    n_shared_experts: int = 1
    n_activated_experts: int = 8
    n_dense_layers: int = 1
    route_scale: float = 1.0
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    qk_norm: bool = False
    attention_bias: bool = True
    partial_rotary_factor: float = 0.5
    norm_eps: float = 1e-5
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 131_072
    init_std: float = 0.02
    tie_word_embeddings: bool = False
    n_mtp_layers: int = 0
    """Multi-token-prediction depths (``num_nextn_predict_layers``; the released checkpoints hold 1):
    read from a checkpoint, and built (``ray_titan.models.glm4_moe.model.Glm4MtpBlock``) as many as
    the job's ``model.mtp_layers`` sets, which replaces the checkpoint's count; an import reads, and
    an export writes, the depths built."""
    load_balance: Literal["aux_loss", "aux_free", "none"] = "aux_free"
    aux_loss_coeff: float = 0.001
    """α of DeepSeek's sequence-wise balance loss (when ``load_balance = "aux_loss"``)."""
    bias_update_rate: float = 0.001
    """γ of auxiliary-loss-free balancing (when ``load_balance = "aux_free"``)."""


    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head the rotary embedding turns (the first ones): transformers'
        ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers (the others are dense)."""
        return list(range(self.n_dense_layers, self.n_layers))

    # Routing settings GLM-4.5 fixes (ray_titan.models.routing.RoutingArgs).
    @property
    def topk_method(self) -> str:
        return "noaux_tc"

    @property
    def score_func(self) -> str:
        return "sigmoid"

    @property
    def rope_scaling(self) -> None:
        return None

    def attention_args(self) -> LlamaArgs:
        """These sizes as Llama-style dense arguments (q/k/v biases, partial rotary, ``qk_norm``),
        with ``inter_dim`` as the feed-forward: what the attention
        (``ray_titan.models.llama.model.Attention``) and the Llama adapter's attention names read."""
        return LlamaArgs(
            dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            vocab_size=self.vocab_size, ffn_dim=self.inter_dim, attn_head_dim=self.head_dim, norm_eps=self.norm_eps,
            rope_theta=self.rope_theta, max_seq_len=self.max_seq_len, init_std=self.init_std, qk_norm=self.qk_norm,
            tie_word_embeddings=self.tie_word_embeddings, multiple_of=1, ffn_dim_multiplier=None,
            attention_bias=self.attention_bias, rotary_dim=self.rotary_dim,
        )


FLAVORS: dict[str, Glm4MoeArgs] = {
    # 4 layers (the first dense), GQA 8/4 heads of 32 (16 rotated), q/k norms, 8 experts in 2
    # groups of which 1 is kept (top-2), one shared expert, routed scaling 2.5: every part, CPU-sized.
    "debug": Glm4MoeArgs(
        dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=258, inter_dim=256, moe_inter_dim=64,
        n_routed_experts=8, n_activated_experts=2, n_group=2, topk_group=1, route_scale=2.5, qk_norm=True,
        max_seq_len=1024,
    ),
    # GLM-4.5 (huggingface.co/zai-org/GLM-4.5, config.json; GLM-4.6 / 4.7 the same sizes): 355 B
    # total, 32 B activated; 160 experts, 3 dense layers, q/k norms, routed scaling 2.5. The
    # release's one MTP layer (not in the card's counts) is built when model.mtp_layers = 1.
    "355B-A32B": Glm4MoeArgs(
        dim=5120, n_layers=92, inter_dim=12_288, moe_inter_dim=1536, n_routed_experts=160, n_dense_layers=3,
        route_scale=2.5, qk_norm=True,
    ),
    # GLM-4.5-Air (huggingface.co/zai-org/GLM-4.5-Air, config.json): 106 B total, 12 B activated.
    "106B-A12B": Glm4MoeArgs(),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly."""

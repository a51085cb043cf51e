"""Arguments of the DeepSeek-V2 family and its flavors (sizes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ray_titan.models.rope import RopeScaling

__all__ = ["FLAVORS", "DeepSeekV2Args"]


@dataclass(frozen=True)
class DeepSeekV2Args:
    """Hyper-parameters of a DeepSeek-V2-style model. Defaults: DeepSeek-V2-Lite.

    Head dimensions: queries and keys have ``qk_nope_head_dim + qk_rope_head_dim`` per head,
    values ``v_head_dim``. ``inter_dim`` is the dense layers' SwiGLU hidden size,
    ``moe_inter_dim`` each expert's; the shared experts form one SwiGLU of
    ``n_shared_experts × moe_inter_dim``.

    Routing as DeepSeek's reference ``MoEGate``: ``topk_method`` names the function of
    ``ray_titan.models.routing.ROUTERS`` that chooses the experts (``greedy``: the top-k of all;
    ``group_limited_greedy``: the top-k within the ``topk_group`` best of ``n_group`` equal
    expert groups, DeepSeek-V2's device-limited routing; ``noaux_tc``: DeepSeek-V3's, groups
    ranked by their two best bias-corrected scores); ``score_func`` (``softmax`` in V2,
    ``sigmoid`` in V3) makes the scores. V2: the selected experts' scores are renormalised to sum
    to 1 when ``norm_topk_prob`` (and ``n_activated_experts > 1``), and otherwise multiplied by
    ``route_scale`` (``routed_scaling_factor``); V3 renormalises and then always scales. ``rope_scaling``: the
    YaRN scaling of the released checkpoints (V2-Lite: factor 40 over 4096 positions), or None.
    """

    dim: int = 2048
    n_layers: int = 27
    n_dense_layers: int = 1
    n_heads: int = 16
    vocab_size: int = 102_400
    inter_dim: int = 10_944
    moe_inter_dim: int = 1408
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    n_activated_experts: int = 6
    route_scale: float = 1.0
    norm_topk_prob: bool = False
    topk_method: str = "greedy"
    score_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    max_seq_len: int = 4096
    init_std: float = 0.02
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    n_mtp_layers: int = 0
    """Multi-token-prediction depths (DeepSeek-V3 §2.2; ``config.json`` ``num_nextn_predict_layers``):
    read from a checkpoint, and built (``DeepSeekV2``'s ``MtpBlock``) as many as the job's
    ``model.mtp_layers`` sets (its family's ``config_args``), which replaces the checkpoint's count;
    an import reads, and an export writes, the depths built."""
    load_balance: Literal["aux_loss", "aux_free", "none"] = "aux_loss"
    aux_loss_coeff: float = 0.001
    """α of the balance loss (DeepSeek-V2-Lite: 0.001)."""
    bias_update_rate: float = 0.001
    """γ of auxiliary-loss-free balancing (DeepSeek-V3 used 0.001)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.n_dense_layers, self.n_layers))



FLAVORS: dict[str, DeepSeekV2Args] = {
    # 4 layers (the first dense), 8 routed experts, top-2, 1 shared expert.
    "debug": DeepSeekV2Args(
        dim=128, n_layers=4, n_dense_layers=1, n_heads=4, vocab_size=258, inter_dim=256,
        moe_inter_dim=64, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        max_seq_len=1024,
    ),
    # DeepSeek-V2-Lite (huggingface.co/deepseek-ai/DeepSeek-V2-Lite, config.json): 15.7 B total,
    # 2.4 B activated parameters; YaRN rope at every sequence length.
    "V2-Lite": DeepSeekV2Args(
        max_seq_len=163_840,
        rope_scaling=RopeScaling("yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
    ),
    # DeepSeek-V2 (huggingface.co/deepseek-ai/DeepSeek-V2, config.json): 236 B total, 21 B
    # activated; q-LoRA, 160 routed experts in 8 groups of which a token uses 3 (top-6), routed
    # scaling factor 16, the same YaRN as V2-Lite.
    "V2": DeepSeekV2Args(
        dim=5120, n_layers=60, n_dense_layers=1, n_heads=128, inter_dim=12_288, moe_inter_dim=1536,
        n_routed_experts=160, n_shared_experts=2, n_activated_experts=6, route_scale=16.0,
        topk_method="group_limited_greedy", n_group=8, topk_group=3, q_lora_rank=1536, kv_lora_rank=512,
        max_seq_len=163_840,
        rope_scaling=RopeScaling("yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
    ),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly."""

"""DeepSeek-V3 flavors (sizes), as :class:`~ray_titan.models.deepseek_v2.args.DeepSeekV2Args`.

DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437) is DeepSeek-V2's architecture with another
router: sigmoid scores, a per-expert correction bias used for the selection only
(auxiliary-loss-free balancing, §2.1.2, which is ray_titan's ``load_balance = "aux_free"``: the
same buffer, ``expert_bias``, is the checkpoint's ``e_score_correction_bias``), groups ranked by
their two best biased scores (``topk_method = "noaux_tc"``), normalised top-k weights times
``routed_scaling_factor``. Kimi K2 (Moonshot AI 2025, arXiv:2507.20534) is the same architecture
with 384 experts in one group and 64 heads. The multi-token-prediction module the released
checkpoints carry (``num_nextn_predict_layers``, ``n_mtp_layers``) is built and trained when
``model.mtp_layers`` asks for it (``ray_titan.models.deepseek_v2.model.MtpBlock``).
"""

from __future__ import annotations

import dataclasses

from ray_titan.models.deepseek_v2.args import DeepSeekV2Args
from ray_titan.models.rope import RopeScaling

__all__ = ["FLAVORS"]

_V3 = DeepSeekV2Args(topk_method="noaux_tc", score_func="sigmoid", norm_topk_prob=True, load_balance="aux_free")
"""What every V3 flavor shares: the router (the sizes are replaced per flavor)."""

FLAVORS: dict[str, DeepSeekV2Args] = {
    # 4 layers (the first dense), 8 routed experts in 4 groups of which a token uses 2 (top-2),
    # a query latent, routed scaling 2.5: every part of V3's router and MLA, CPU-sized.
    "debug": dataclasses.replace(
        _V3, dim=128, n_layers=4, n_dense_layers=1, n_heads=4, vocab_size=258, inter_dim=256,
        moe_inter_dim=64, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_group=4, topk_group=2,
        route_scale=2.5, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, max_seq_len=1024,
    ),
    # torchtitan's deepseek_v3 "16B" (adapted from DeepSeek-MoE-16B; its sizes are DeepSeek-V2-Lite's:
    # 27 layers, 64 experts top-6, 2 shared, no query latent) with V3's router in one group: 15.7 B
    # total, 2.4 B activated (no model card of its own; V2-Lite's card gives these).
    "16B": dataclasses.replace(
        _V3, max_seq_len=163_840,
        rope_scaling=RopeScaling("yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
    ),
    # DeepSeek-V3 (huggingface.co/deepseek-ai/DeepSeek-V3, config.json): 671 B total, 37 B
    # activated (the model card; the MTP module's 14 B not counted: the release holds one depth,
    # which model.mtp_layers = 1 builds); 256 experts in 8 groups of which a token uses 4
    # (top-8), 3 dense layers, routed scaling 2.5.
    "671B": dataclasses.replace(
        _V3, dim=7168, n_layers=61, n_dense_layers=3, n_heads=128, vocab_size=129_280, inter_dim=18_432,
        moe_inter_dim=2048, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8, route_scale=2.5,
        n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512, max_seq_len=163_840,
        rope_scaling=RopeScaling("yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    ),
    # Kimi K2 (huggingface.co/moonshotai/Kimi-K2-Instruct, config.json, model_type "kimi_k2"):
    # 1.03 T total (the card: 1T; its paper: 1.04 T), 32 B activated; 384 experts in one group
    # (top-8), 64 heads, one dense layer, routed scaling 2.827, rope theta 50,000 with YaRN x32
    # over 4,096 positions.
    "kimi_k2": dataclasses.replace(
        _V3, dim=7168, n_layers=61, n_dense_layers=1, n_heads=64, vocab_size=163_840, inter_dim=18_432,
        moe_inter_dim=2048, n_routed_experts=384, n_shared_experts=1, n_activated_experts=8, route_scale=2.827,
        q_lora_rank=1536, kv_lora_rank=512, rope_theta=50_000.0, max_seq_len=131_072,
        rope_scaling=RopeScaling("yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    ),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly."""

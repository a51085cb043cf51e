"""Qwen3.5-MoE decoder: Qwen3.5's layers (``ray_titan.models.qwen3_5.model``: Gated DeltaNet and
gated full attention) with a mixture of experts in every feed-forward.

Architecture after transformers' ``models/qwen3_5_moe/modeling_qwen3_5_moe.py``
(``Qwen3_5MoeForCausalLM``, the reference the tests compare with): the MoE layer is DeepSeek-V2's
(``ray_titan.models.deepseek_v2.model.MoE``: softmax router, greedy top-k with renormalised
weights, stacked experts, dropless routing, expert parallelism) with one shared expert of its own
width whose output ``sigmoid(w·x)`` scales per token (``shared_hidden``, ``shared_gate``), and the
balance loss Qwen3-MoE's (``ray_titan.models.qwen3_moe.model``: transformers'
``load_balancing_loss_func`` pooled over the layers).
"""

from __future__ import annotations

from torch import nn

from ray_titan.models.qwen3_5.model import Qwen35
from ray_titan.models.qwen3_moe.model import PooledBalanceLoss, PooledBalanceMoE

__all__ = ["Qwen35Moe"]


class Qwen35Moe(PooledBalanceLoss, Qwen35):
    """Qwen3.5-MoE decoder (module docstring); input/output as :class:`~ray_titan.models.decoder.Decoder`,
    plus the pooled balance loss in training."""

    def make_ffn(self, layer_id: int) -> tuple[str, nn.Module]:
        return "moe", PooledBalanceMoE(self.args, shared_hidden=self.args.shared_inter_dim, shared_gate=True)

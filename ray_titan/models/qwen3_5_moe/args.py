"""Arguments of the Qwen3.5-MoE family and its flavors (sizes).

Sources: transformers 5's ``Qwen3_5MoeTextConfig`` (``models/qwen3_5_moe/configuration_qwen3_5_moe.py``:
every field and default; its router, ``Qwen3_5MoeTopKRouter``, always renormalises the top-k
weights) and the model card of Qwen/Qwen3.5-397B-A17B (huggingface.co, ``config.json``
``text_config``): 60 layers of hidden size 4096, 32 query heads and 2 key-value heads of 256 for
full attention (a quarter rotated), Gated DeltaNet with 16 key heads and 64 value heads of 128, 512
routed experts of 1024 of which a token uses 10, one gated shared expert of 1024, a 248,320-row
embedding not tied to the head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ray_titan.models.qwen3_5.args import Qwen35Args
from ray_titan.models.qwen3_moe.args import SoftmaxTopKRouting

__all__ = ["FLAVORS", "Qwen35MoeArgs"]


@dataclass(frozen=True)
class Qwen35MoeArgs(SoftmaxTopKRouting, Qwen35Args):
    """Hyper-parameters of a Qwen3.5-MoE model (transformers' ``Qwen3_5MoeTextConfig``). Defaults:
    transformers' (Qwen3.5-35B-A3B's shape). The layers are Qwen3.5's (:class:`Qwen35Args`); every
    feed-forward is a mixture of ``n_routed_experts`` SwiGLU experts of ``moe_inter_dim`` (softmax
    router, top ``n_activated_experts``, weights renormalised) plus one shared SwiGLU expert of
    ``shared_inter_dim`` whose output a per-token ``sigmoid`` gate scales. ``inter_dim`` is unused
    (no dense layer). ``load_balance``: ``aux_loss`` is the reference's Switch-style loss pooled
    over all MoE layers (as Qwen3-MoE's, ``router_aux_loss_coef`` 0.001), ``aux_free`` and ``none``
    as DeepSeek's.
    """

    dim: int = 2048
    n_layers: int = 40
    n_heads: int = 16
    n_kv_heads: int = 2
    inter_dim: int = 0
    moe_inter_dim: int = 512
    shared_inter_dim: int = 512
    n_routed_experts: int = 256
    n_activated_experts: int = 8
    load_balance: Literal["aux_loss", "aux_free", "none"] = "aux_loss"
    aux_loss_coeff: float = 0.001
    """α of the balance loss (``router_aux_loss_coef``)."""
    bias_update_rate: float = 0.001
    """γ of auxiliary-loss-free balancing (when ``load_balance = "aux_free"``)."""

    @property
    def norm_topk_prob(self) -> bool:
        return True

    @property
    def moe_layers(self) -> list[int]:
        """Every layer is MoE."""
        return list(range(self.n_layers))


FLAVORS: dict[str, Qwen35MoeArgs] = {
    # 4 layers (3 DeltaNet, then full attention), 8 experts top-2 and a gated shared expert.
    "debug": Qwen35MoeArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=258, partial_rotary_factor=0.5,
        linear_k_heads=2, linear_v_heads=4, linear_k_head_dim=32, linear_v_head_dim=32, moe_inter_dim=64,
        shared_inter_dim=64, n_routed_experts=8, n_activated_experts=2, max_seq_len=1024,
    ),
    "397B-A17B": Qwen35MoeArgs(
        dim=4096, n_layers=60, n_heads=32, n_kv_heads=2, head_dim=256, linear_k_heads=16, linear_v_heads=64,
        moe_inter_dim=1024, shared_inter_dim=1024, n_routed_experts=512, n_activated_experts=10,
    ),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly."""

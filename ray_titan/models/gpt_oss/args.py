"""Arguments of the gpt-oss family and its flavors (sizes).

Dimensions from the model cards' ``config.json`` (huggingface.co/openai/gpt-oss-20b and
openai/gpt-oss-120b) and OpenAI's gpt-oss model card (2025): width 2880, 64 query heads of 64
and 8 key-value heads, every layer a mixture of experts (32 experts in 20b, 128 in 120b, 4 per
token) with expert hidden size 2880, layers alternating a 128-token sliding window and full
attention, YaRN rope (theta 150,000, factor 32 over 4,096 positions, ``truncate`` false), RMSNorm
eps 1e-5, a 201,088-row embedding not tied to the output head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from ray_titan.models.rope import RopeScaling

__all__ = ["FLAVORS", "LAYER_TYPES", "GptOssArgs"]

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The ``config.json`` ``layer_types`` values: a sliding-window or a full causal attention layer."""

# gpt-oss's rope_scaling (both released config.json files).
_YARN = RopeScaling("yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                    truncate=False)


@dataclass(frozen=True)
class GptOssArgs:
    """Hyper-parameters of a gpt-oss model (transformers' ``GptOssConfig``). Defaults: gpt-oss-20b.

    Attention: ``n_heads`` query heads of ``head_dim`` sharing ``n_kv_heads`` key-value heads,
    q/k/v/o projections with biases, a learned per-head sink logit; layer ``i`` attends within
    the last ``sliding_window`` tokens (query included) when ``layer_types[i]`` is
    ``"sliding_attention"``, else to every earlier token. ``layer_types`` empty: transformers'
    default, sliding on even layers and full on odd ones. Every layer's feed-forward is a
    mixture of ``n_routed_experts`` experts of hidden size ``moe_inter_dim`` with biases and the
    clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), ``n_activated_experts`` per token
    chosen by ``ray_titan.models.routing.topk_softmax`` from a router with a bias.

    Routing reads these arguments through :class:`~ray_titan.models.deepseek_v2.model.MoEArgs`
    (the MoE layer is DeepSeek-V2's); the fields gpt-oss fixes are properties. ``load_balance``
    ``aux_loss``: transformers' balance loss pooled over all layers, as Qwen3-MoE's
    (``ray_titan.models.qwen3_moe.model``), weighted by ``aux_loss_coeff``
    (``router_aux_loss_coef``: 0.9 in the released files); ``aux_free`` and ``none`` as DeepSeek's.
    """

    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201_088
    moe_inter_dim: int = 2880
    n_routed_experts: int = 32
    n_activated_experts: int = 4
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    norm_eps: float = 1e-5
    rope_theta: float = 150_000.0
    rope_scaling: RopeScaling | None = _YARN
    max_seq_len: int = 131_072
    init_std: float = 0.02
    tie_word_embeddings: bool = False
    load_balance: Literal["aux_loss", "aux_free", "none"] = "aux_loss"
    aux_loss_coeff: float = 0.9
    """α of the balance loss (``router_aux_loss_coef``; the released configs: 0.9)."""
    bias_update_rate: float = 0.001
    """γ of auxiliary-loss-free balancing (when ``load_balance = "aux_free"``)."""

    tp_unsupported: ClassVar[str] = (
        "tensor parallel would split the experts' hidden units and their biases (the down projection's bias "
        "must be added once, not once per tp rank) and each head's sink, which ray_titan does not do yet")
    """Why tensor parallel is refused (the pre-flight's ``_check_tensor_parallel`` reads it)."""

    cp_unsupported: ClassVar[str] = (
        "its attention (a sink logit per head and sliding windows, an additive float mask over one "
        "sequence) has no context-parallel form in ray_titan yet")
    """Why context parallel is refused (the pre-flight's ``_check_context_parallel`` reads it)."""

    def __post_init__(self) -> None:
        # A list (a checkpoint manifest's JSON) becomes a tuple; empty: transformers' default.
        types = tuple(self.layer_types) or tuple(LAYER_TYPES[i % 2] for i in range(self.n_layers))
        object.__setattr__(self, "layer_types", types)
        if isinstance(self.rope_scaling, dict):  # a manifest's JSON
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers: all of them."""
        return list(range(self.n_layers))

    def is_sliding(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` attends within a sliding window."""
        return self.layer_types[layer_id] == "sliding_attention"

    # Routing settings gpt-oss fixes (ray_titan.models.routing.RoutingArgs, MoEArgs).
    @property
    def topk_method(self) -> str:
        return "topk_softmax"

    @property
    def score_func(self) -> str:
        return "softmax"

    @property
    def norm_topk_prob(self) -> bool:
        return True

    @property
    def n_group(self) -> int:
        return 1

    @property
    def topk_group(self) -> int:
        return 1

    @property
    def route_scale(self) -> float:
        return 1.0

    @property
    def n_shared_experts(self) -> int:
        return 0


FLAVORS: dict[str, GptOssArgs] = {
    # 4 layers (sliding / full alternating), GQA 8/4 heads of 32, 8 experts top-2, a window of 16.
    "debug": GptOssArgs(
        dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=258, moe_inter_dim=64,
        n_routed_experts=8, n_activated_experts=2, sliding_window=16, max_seq_len=1024,
        rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=256, truncate=False),
    ),
    # gpt-oss-20b: 21 B total, 3.6 B active (model card).
    "20B": GptOssArgs(),
    # gpt-oss-120b: 117 B total, 5.1 B active.
    "120B": GptOssArgs(n_layers=36, n_routed_experts=128),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly."""

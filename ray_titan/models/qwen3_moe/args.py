"""Arguments of the Qwen3-MoE family and its flavors (sizes).

Dimensions from the model cards' ``config.json`` (huggingface.co/Qwen/Qwen3-30B-A3B and
Qwen/Qwen3-235B-A22B): head dimension 128, 4 key-value heads, 128 routed experts of which a
token uses 8 with renormalised weights, no shared expert, every layer MoE
(``decoder_sparse_step`` 1, no ``mlp_only_layers``), RMSNorm eps 1e-6, rope theta 1,000,000, a
151,936-row embedding not tied to the output head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ray_titan.models.llama.args import LlamaArgs

__all__ = ["FLAVORS", "Qwen3MoeArgs", "SoftmaxTopKRouting"]


class SoftmaxTopKRouting:
    """The routing settings Qwen's MoE families fix (``ray_titan.models.routing.RoutingArgs``,
    ``MoEArgs``): a softmax over the experts, the greedy top-k, one expert group, no route scale,
    no DeepSeek-style shared experts (Qwen3.5's gated shared expert is its own)."""

    @property
    def topk_method(self) -> str:
        return "greedy"

    @property
    def score_func(self) -> str:
        return "softmax"

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


@dataclass(frozen=True)
class Qwen3MoeArgs(SoftmaxTopKRouting):
    """Hyper-parameters of a Qwen3-MoE model (transformers' ``Qwen3MoeConfig``). Defaults: Qwen3-30B-A3B.

    Attention is Qwen3's (grouped-query, ``head_dim`` per head, an RMSNorm over each query and
    key head before the rotary embedding): :meth:`attention_args`. Layer ``i`` is MoE unless it is
    in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (transformers'
    ``Qwen3MoeDecoderLayer``), then a dense SwiGLU of ``inter_dim`` (``intermediate_size``).
    An MoE layer has ``n_routed_experts`` SwiGLU experts of ``moe_inter_dim`` and a softmax
    router taking the top ``n_activated_experts``, whose weights are renormalised to sum to 1
    when ``norm_topk_prob`` (``ray_titan.models.routing.greedy``); no shared expert.

    Routing reads these arguments through
    :class:`~ray_titan.models.deepseek_v2.model.MoEArgs` (the MoE layer is DeepSeek-V2's); the
    fields Qwen3-MoE fixes are properties: ``topk_method`` ``greedy``, ``score_func``
    ``softmax``, one expert group, ``route_scale`` 1, no shared expert, no rope scaling.

    ``load_balance``: ``aux_loss`` is the reference's Switch-style loss over all MoE layers
    (``ray_titan.models.qwen3_moe.model``), weighted by ``aux_loss_coeff`` (``config.json``
    ``router_aux_loss_coef``: 0.001); ``aux_free`` and ``none`` as DeepSeek's.
    """

    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 151_936
    inter_dim: int = 6144
    moe_inter_dim: int = 768
    n_routed_experts: int = 128
    n_activated_experts: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40_960
    init_std: float = 0.02
    tie_word_embeddings: bool = False
    load_balance: Literal["aux_loss", "aux_free", "none"] = "aux_loss"
    aux_loss_coeff: float = 0.001
    """α of the balance loss (``router_aux_loss_coef``; the released configs: 0.001)."""
    bias_update_rate: float = 0.001
    """γ of auxiliary-loss-free balancing (when ``load_balance = "aux_free"``)."""

    @property
    def cp_unsupported(self) -> str | None:
        """Why context parallel is refused (the pre-flight's ``_check_context_parallel`` reads it):
        the ``aux_loss`` balance loss pools the router statistics of one forward over every MoE
        layer (not linear in the tokens), which a rank holding part of each sequence cannot
        compute; None with ``aux_free`` or ``none``."""
        if self.load_balance != "aux_loss":
            return None
        return ("its aux_loss balance loss pools the router statistics of a whole forward, which a rank "
                "holding part of each sequence cannot compute; set model.load_balance = 'aux_free' or 'none'")

    def __post_init__(self) -> None:
        # A list (a checkpoint manifest's JSON) becomes a tuple: hashable, compares equal.
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers (the others are dense)."""
        return [i for i in range(self.n_layers)
                if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0]

    @property
    def rope_scaling(self) -> None:
        return None

    def attention_args(self) -> LlamaArgs:
        """These sizes as Qwen3 dense arguments (``qk_norm``), with ``inter_dim`` as the
        feed-forward: what the attention (``ray_titan.models.llama.model.Attention``) and the
        Qwen3 adapter's shared names (``ray_titan.models.qwen3.state_dict_adapter``) read."""
        return LlamaArgs(
            dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            vocab_size=self.vocab_size, ffn_dim=self.inter_dim, attn_head_dim=self.head_dim, norm_eps=self.norm_eps,
            rope_theta=self.rope_theta, max_seq_len=self.max_seq_len, init_std=self.init_std, qk_norm=True,
            tie_word_embeddings=self.tie_word_embeddings, multiple_of=1, ffn_dim_multiplier=None,
        )


FLAVORS: dict[str, Qwen3MoeArgs] = {
    # 4 layers (the first dense, via mlp_only_layers), GQA 8/4 heads of 32, 8 experts top-2.
    "debug": Qwen3MoeArgs(
        dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=258, inter_dim=256,
        moe_inter_dim=64, n_routed_experts=8, n_activated_experts=2, mlp_only_layers=(0,), max_seq_len=1024,
    ),
    # Qwen3-30B-A3B: 30.5 B total, 3.3 B activated (the card counts the embedding).
    "30B-A3B": Qwen3MoeArgs(),
    # Qwen3-235B-A22B: 235 B total, 22 B activated.
    "235B-A22B": Qwen3MoeArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, inter_dim=12_288, moe_inter_dim=1536),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly."""

"""Qwen3-MoE decoder: Qwen3 attention with DeepSeek-V2's MoE layer.

Architecture after Qwen3 (Qwen Team 2025, arXiv:2505.09388 §2) and transformers'
``models/qwen3_moe/modeling_qwen3_moe.py`` (``Qwen3MoeForCausalLM``): pre-norm blocks whose
attention is Qwen3's (grouped-query, RMSNorm over each query and key head before the rotary
embedding: ``ray_titan.models.llama.model.Attention`` with ``qk_norm``), and whose feed-forward
is either a dense SwiGLU or a mixture of experts (:attr:`Qwen3MoeArgs.moe_layers`). The MoE layer
is DeepSeek-V2's (``ray_titan.models.deepseek_v2.model.MoE``: its router with the ``greedy``
softmax top-k of ``ray_titan.models.routing``, stacked experts, dropless token routing, expert
parallelism); Qwen3-MoE has no shared expert.

**Balance loss** (``load_balance = "aux_loss"``) as the reference computes it: transformers'
``load_balancing_loss_func`` (Switch Transformer, Fedus et al. 2021, arXiv:2101.03961 eq. 4–6,
with top-k), over the router outputs of *all* MoE layers of the forward pooled together:
``E · Σ_e f_e P_e`` with ``f_e`` the share of the ``R = layers × tokens`` rows' top-k choices
that went to expert ``e`` (summing to ``k``) and ``P_e`` the mean over the ``R`` rows of its
router probability, times ``aux_loss_coeff`` (``router_aux_loss_coef``). Because the layers are
pooled, it is not a sum of per-layer losses, so each MoE layer records its probability sums and
counts (:class:`PooledBalanceMoE`) and :meth:`Qwen3Moe.forward` computes the loss after the last
block and adds it to the objective (``_AddAuxLoss``: gradient 1 in backward). Exact when one
module holds every MoE layer (no pipeline parallelism); a pipeline stage pools the layers it holds
and weights its loss by their share of all MoE layers (uniform routing gives ``k`` either way),
an approximation: the exact loss would need every stage's counts before any backward.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ray_titan.models.decoder import Decoder, FeedForward, RMSNorm
from ray_titan.models.deepseek_v2.model import MoE, _AddAuxLoss, _recomputing
from ray_titan.models.deepseek_v2.model import activated_parameters as _routed_activated
from ray_titan.models.llama.model import Attention
from ray_titan.models.qwen3_moe.args import Qwen3MoeArgs

__all__ = ["PooledBalanceLoss", "PooledBalanceMoE", "Qwen3Moe", "Qwen3MoeBlock", "activated_parameters",
           "pooled_balance_loss"]


def pooled_balance_loss(prob_sums: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (``models/qwen3_moe/modeling_qwen3_moe.py``, no
    attention mask) from per-layer sums: ``prob_sums (layers, E)`` the router probabilities summed
    over each layer's tokens (with gradient), ``counts (layers, E)`` the top-k choices of each
    expert, ``rows`` the tokens of all layers together. Returns ``E · Σ_e (Σ counts_e / rows) ·
    (Σ prob_sums_e / rows)``, 0-dim fp32 (``k`` under uniform routing)."""
    f = counts.sum(dim=0) / rows
    p = prob_sums.sum(dim=0) / rows
    return (f * p).sum() * prob_sums.shape[-1]


class PooledBalanceMoE(MoE):
    """DeepSeek-V2's :class:`~ray_titan.models.deepseek_v2.model.MoE` whose balance loss spans
    layers: :meth:`balance_loss` records this forward's ``balance_stats`` (probability sums ``(E,)``
    with gradient, top-k counts ``(E,)`` fp32, tokens) for :meth:`Qwen3Moe.forward` and adds
    nothing itself. Not recorded while activation checkpointing recomputes the block (the
    original forward's were used; keeping them would keep the recomputed graph alive)."""

    balance_stats: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def balance_loss(self, scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
        if not _recomputing():
            flat = indices.flatten()
            counts = torch.zeros(self.n_experts, device=scores.device).index_add_(
                0, flat, torch.ones(flat.shape, device=scores.device))
            self.balance_stats = (scores.sum(dim=(0, 1)), counts, scores.shape[0] * scores.shape[1])
        return None


class Qwen3MoeBlock(nn.Module):
    """Pre-norm block: Qwen3 attention, then a dense SwiGLU (``feed_forward``) or
    :class:`PooledBalanceMoE` (``moe``). Input and output ``(batch, seq, dim)``. ``args``: any
    arguments with ``attention_args()`` (Llama-style attention) and ``moe_layers``; a family with
    another MoE layer sets :attr:`MOE` (GLM-4.5: DeepSeek's, ``ray_titan.models.glm4_moe``)."""

    MOE: type[MoE] = PooledBalanceMoE

    def __init__(self, args: Qwen3MoeArgs, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args.attention_args())
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # A multi-token-prediction depth (keyed past the main layers) is MoE (transformers' get_mtp_config).
        if layer_id in args.moe_layers or layer_id >= args.n_layers:
            self.moe = self.MOE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class PooledBalanceLoss:
    """The pooled balance loss of a decoder whose MoE layers are :class:`PooledBalanceMoE`
    (``moe``): mixed in before :class:`Decoder` (Qwen3-MoE, Qwen3.5-MoE). :meth:`forward` adds
    the loss over the layers this module holds after the last block (module docstring)."""

    args: Any
    layers: nn.ModuleDict

    def moe_modules(self) -> dict[int, PooledBalanceMoE]:
        """This module's MoE feed-forwards by layer index (only the layers it holds)."""
        return {int(i): cast(PooledBalanceMoE, b.moe) for i, b in self.layers.items() if hasattr(b, "moe")}

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None) -> Any:
        """The decoder's output (a tensor, or under multi-token prediction its tuple, whose first
        element carries the loss). ``tokens``: the input ids of a decoder with MTP depths
        (``ray_titan.models.decoder.MtpDecoder``: Qwen3.5-MoE), passed on only when given. An MTP
        depth's router (keyed past ``n_layers``) takes no part in the pooled loss, which is the
        main model's (transformers', which has no MTP)."""
        # (Qwen3-MoE's Decoder.forward takes no tokens)
        out = super().forward(x, positions) if tokens is None else super().forward(x, positions, tokens)  # type: ignore[misc]
        recorded = [m for i, m in self.moe_modules().items() if m.balance_stats is not None and i < self.args.n_layers]
        stats = [cast(tuple[torch.Tensor, torch.Tensor, int], m.balance_stats) for m in recorded]
        for m in self.moe_modules().values():
            m.balance_stats = None
        if not stats:  # no balance loss (eval, no grad, or load_balance not aux_loss)
            return out
        prob_sums = torch.stack([s[0] for s in stats])
        counts = torch.stack([s[1] for s in stats])
        share = len(stats) / len(self.args.moe_layers)  # 1 unless pipeline stages split the layers
        aux = self.args.aux_loss_coeff * share * pooled_balance_loss(prob_sums, counts, sum(s[2] for s in stats))
        with torch.no_grad():  # reported per layer: the layers' sum is this forward's loss
            for m in recorded:
                m.aux_loss_sum += aux.detach() / len(stats)
        if isinstance(out, tuple):
            return (_AddAuxLoss.apply(out[0], aux), *out[1:])
        return _AddAuxLoss.apply(out, aux)

    @torch.no_grad()
    def init_buffers(self) -> None:
        super().init_buffers()  # type: ignore[misc]
        for moe in self.moe_modules().values():
            moe.router.expert_bias.zero_()
            moe.router.tokens_per_expert.zero_()
            moe.aux_loss_sum.zero_()


class Qwen3Moe(PooledBalanceLoss, Decoder):
    """Qwen3-MoE decoder (module docstring); input/output as :class:`Decoder`, plus the pooled
    balance loss in training."""

    RESIDUAL_OUTPUTS = ("wo.weight", "w2.weight", "experts.w2")

    def make_layer(self, layer_id: int) -> nn.Module:
        return Qwen3MoeBlock(self.args, layer_id)

    @property
    def rope_dim(self) -> int:
        return self.args.head_dim


def activated_parameters(model: Qwen3Moe) -> int:
    """Parameters that take part in computing one token as Qwen's model cards count them
    ("3.3B activated" of Qwen3-30B-A3B): all except the routed experts not chosen, the input
    embedding included (DeepSeek's count, ``ray_titan.models.deepseek_v2.activated_parameters``,
    leaves it out). Works on the meta device."""
    emb = model.tok_embeddings.weight.numel() if model.tok_embeddings is not None else 0
    return _routed_activated(model) + emb

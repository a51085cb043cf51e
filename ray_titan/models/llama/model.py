"""Llama-style decoder-only transformer.

Architecture after Llama 2/3 (Touvron et al. 2023, arXiv:2307.09288; Dubey et al. 2024,
arXiv:2407.21783): pre-norm RMSNorm, rotary position embeddings, grouped-query attention
(Ainslie et al. 2023, arXiv:2305.13245) through ``scaled_dot_product_attention``, and a SwiGLU
feed-forward whose hidden size follows Meta's reference code (2/3 · 4·dim, times
``ffn_dim_multiplier``, rounded up to ``multiple_of``). The shared skeleton is
:class:`~ray_titan.models.decoder.Decoder`; the model knows nothing of parallelism.

With ``qk_norm`` it is Qwen3's decoder (Qwen Team 2025, arXiv:2505.09388): an RMSNorm over each
query and key head, before the rotary embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from ray_titan.models.decoder import Decoder, FeedForward, RMSNorm, apply_rope, scaled_dot_product_attention
from ray_titan.models.llama.args import LlamaArgs

__all__ = ["Attention", "Llama", "TransformerBlock"]


class Attention(nn.Module):
    """Causal grouped-query self-attention via ``F.scaled_dot_product_attention``; with ``mask``
    (``(batch, 1, seq, seq)`` bool, True = may attend) that mask instead of the causal one.

    Input and output ``(batch, seq, dim)``. ``q_norm`` / ``k_norm`` (``args.qk_norm``): RMSNorm
    over ``head_dim`` of each query / key head before the rotary embedding (Qwen3). With
    ``args.attention_bias`` the q/k/v projections have biases, and with ``args.rotary_dim`` the
    rotary embedding turns only the first ``rotary_dim`` dimensions of each head, the rest pass
    through (GLM-4.5, transformers' ``models/glm4_moe/modeling_glm4_moe.py``,
    ``apply_rotary_pos_emb``); ``cos``/``sin`` then have ``rotary_dim // 2`` columns. With
    ``args.qk_norm_per_layer`` the q/k norms span all of a token's heads (``n_heads × head_dim``
    wide), before the split into heads (MiniMax-M2, ``models/minimax_m2/modeling_minimax_m2.py``).
    ``core_attention``: the attention kernel, ``F.scaled_dot_product_attention``'s signature (a
    hook: context parallelism replaces it, ``Decoder.sequence_sharding``).
    """

    core_attention = staticmethod(scaled_dot_product_attention)

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.rope_dim = args.rope_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.attention_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.per_layer = args.qk_norm_per_layer
        q_width, k_width = (args.n_heads * self.head_dim, args.n_kv_heads * self.head_dim) if self.per_layer \
            else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_width, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(k_width, args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: the projections may hold a subset of the heads (tensor parallel).
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.q_norm is not None and self.k_norm is not None and self.per_layer:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(bsz, seq, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None and not self.per_layer:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.core_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding on the first ``rope_dim`` dimensions of each head of ``x``
        ``(batch, seq, heads, head_dim)``; the others unchanged."""
        if self.rope_dim == self.head_dim:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., :self.rope_dim], cos, sin), x[..., self.rope_dim:]], dim=-1)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(Decoder):
    """Llama-style decoder (see the module docstring); input/output as :class:`Decoder`."""

    def make_layer(self, layer_id: int) -> nn.Module:
        return TransformerBlock(self.args)

    @property
    def rope_dim(self) -> int:
        return self.args.rope_dim

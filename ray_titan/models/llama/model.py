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
import torch.nn.functional as F
from torch import nn

from ray_titan.models.decoder import Decoder, FeedForward, RMSNorm, apply_rope
from ray_titan.models.llama.args import LlamaArgs

__all__ = ["Attention", "Llama", "TransformerBlock"]


class Attention(nn.Module):
    """Causal grouped-query self-attention via ``F.scaled_dot_product_attention``; with ``mask``
    (``(batch, 1, seq, seq)`` bool, True = may attend) that mask instead of the causal one.

    Input and output ``(batch, seq, dim)``. ``q_norm`` / ``k_norm`` (``args.qk_norm``): RMSNorm
    over ``head_dim`` of each query / key head before the rotary embedding (Qwen3).
    ``core_attention``: the attention kernel, ``F.scaled_dot_product_attention``'s signature (a
    hook: context parallelism replaces it, ``Decoder.sequence_sharding``).
    """

    core_attention = staticmethod(F.scaled_dot_product_attention)

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: the projections may hold a subset of the heads (tensor parallel).
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.core_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


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
        return self.args.head_dim

"""Llama-style decoder-only transformer.

Architecture after Llama 2/3 (Touvron et al. 2023, arXiv:2307.09288; Dubey et al. 2024,
arXiv:2407.21783): pre-norm RMSNorm, rotary position embeddings, grouped-query attention
(Ainslie et al. 2023, arXiv:2305.13245) through ``scaled_dot_product_attention``, and a SwiGLU
feed-forward whose hidden size follows Meta's reference code (2/3 · 4·dim, times
``ffn_dim_multiplier``, rounded up to ``multiple_of``). The shared skeleton is
:class:`~ray_titan.models.decoder.Decoder`; the model knows nothing of parallelism.
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

    Input and output ``(batch, seq, dim)``.
    """

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
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

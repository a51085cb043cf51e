"""Llama-style decoder-only transformer.

Architecture after Llama 2/3 (Touvron et al. 2023, arXiv:2307.09288; Dubey et al. 2024,
arXiv:2407.21783): pre-norm RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et
al. 2021, arXiv:2104.09864), grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245)
through ``scaled_dot_product_attention``, and a SwiGLU feed-forward (Shazeer 2020,
arXiv:2002.05202) whose hidden size follows Meta's reference code (2/3 · 4·dim, times
``ffn_dim_multiplier``, rounded up to ``multiple_of``).

The model knows nothing of parallelism. Pipeline stages are made by removing modules
(``tok_embeddings``, entries of ``layers``, ``norm``/``output`` set to ``None``); fully qualified
parameter names stay those of the whole model, and :meth:`Llama.init_weights` seeds every
parameter from its name, so a stage's weights do not depend on how the model was split.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaArgs", "Llama", "Decoder", "RMSNorm", "FeedForward", "param_seed", "count_parameters"]


@dataclass(frozen=True)
class LlamaArgs:
    """Hyper-parameters of a Llama-style model.

    ``n_kv_heads`` < ``n_heads`` gives grouped-query attention (``n_heads`` must be a multiple).
    ``max_seq_len`` bounds the rotary table and the training sequence length.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128_256
    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    max_seq_len: int = 8192
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for the parameter called ``name`` (its fully qualified name in the whole
    model), stable across processes and Python versions (SHA-256, not ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, arXiv:1910.07467).

    Input ``(..., dim)``, output the same shape.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embeddings, each ``(max_seq_len, head_dim // 2)`` fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(batch, seq, heads, head_dim)`` pairwise (interleaved pairs, as Meta's
    reference) by ``cos``/``sin`` ``(seq, head_dim // 2)``."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention via ``F.scaled_dot_product_attention``.

    Input and output ``(batch, seq, dim)``.
    """

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``. Input and output ``(batch, seq, dim)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Decoder-only language model skeleton shared by the model families.

    ``forward`` takes token ids ``(batch, seq)`` int64 when this module holds the embedding,
    otherwise hidden states ``(batch, seq, dim)``; it returns logits ``(batch, seq, vocab_size)``
    when it holds the output head, otherwise hidden states. ``layers`` is a ``ModuleDict`` keyed
    by the layer's index in the whole model, so a pipeline stage keeps the whole model's names.
    Subclasses provide :meth:`make_layer` and :attr:`rope_dim`.
    """

    #: Parameter-name suffixes of residual output projections, scaled by 1/sqrt(2·n_layers).
    RESIDUAL_OUTPUTS: tuple[str, ...] = ("wo.weight", "w2.weight")

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_layer(i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: recomputed by init_weights (also after materialising from meta).
        cos, sin = rope_tables(self.rope_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def make_layer(self, layer_id: int) -> nn.Module:
        raise NotImplementedError

    @property
    def rope_dim(self) -> int:
        """Per-head dimension that rotary embeddings rotate."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        seq = h.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter deterministically from ``seed`` and its own name.

        Weights: normal(0, ``init_std``), residual output projections (:attr:`RESIDUAL_OUTPUTS`)
        scaled by 1/sqrt(2·n_layers) (GPT-2 style residual scaling); embeddings normal(0, 1);
        norms ones. Each full tensor is drawn on the CPU from a generator seeded by
        :func:`param_seed` and copied into the parameter, or into this rank's shard of it when
        the parameter is a ``DTensor`` (FSDP2, expert parallel), so the result is identical
        whatever the mesh. Buffers are reset by :meth:`init_buffers`.
        """
        std = self.args.init_std
        for name, param in self.named_parameters():
            full = torch.empty(param.shape, dtype=torch.float32)
            if name.endswith("norm.weight"):
                full.fill_(1.0)
            else:
                g = torch.Generator().manual_seed(param_seed(seed, name))
                if name.startswith("tok_embeddings"):
                    full.normal_(0.0, 1.0, generator=g)
                else:
                    s = std / math.sqrt(2 * self.args.n_layers) if name.endswith(self.RESIDUAL_OUTPUTS) else std
                    full.normal_(0.0, s, generator=g)
            _copy_full_into(param, full)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the rotary tables (subclasses reset their own buffers too)."""
        cos, sin = rope_tables(self.rope_dim, self.args.max_seq_len, self.args.rope_theta)
        self.rope_cos = cos.to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.device)


class Llama(Decoder):
    """Llama-style decoder (see the module docstring); input/output as :class:`Decoder`."""

    def make_layer(self, layer_id: int) -> nn.Module:
        return TransformerBlock(self.args)

    @property
    def rope_dim(self) -> int:
        return self.args.head_dim


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a plain parameter, or this rank's shard of a DTensor parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # Every rank drew the same full tensor, so slice locally: no scatter needed.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (works on the meta device)."""
    return sum(p.numel() for p in model.parameters())

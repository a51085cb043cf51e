"""Qwen3.5 decoder: Gated DeltaNet linear attention in three of every four layers, gated full
attention in the fourth.

Architecture after Qwen3-Next / Qwen3.5 (Qwen Team 2025/2026; transformers'
``models/qwen3_5/modeling_qwen3_5.py``, ``Qwen3_5ForCausalLM``, is the reference the tests compare
with): pre-norm blocks whose token mixer is either :class:`~ray_titan.models.qwen3_5.delta_rule.GatedDeltaNet`
(``layer_types`` ``linear_attention``) or :class:`GatedAttention` (``full_attention``: grouped-query
attention with a per-head zero-centred RMSNorm of queries and keys, rotary embeddings on a leading
share of each head in the ``rotate_half`` layout, and the output gated by ``sigmoid`` of a second
half of the query projection, Qiu et al. 2025, "Gated Attention for Large Language Models",
arXiv:2505.06708), followed by a SwiGLU feed-forward. Every RMSNorm outside DeltaNet is
zero-centred (``x̂ · (1 + w)``, weights initialised to 0: :class:`ZeroCenteredRMSNorm`). The text
model only: the multimodal checkpoints' vision tower is not built (their positions for text are
the plain ones, so the multimodal rotary sections coincide). Multi-token prediction
(``args.n_mtp_layers``, the checkpoints' ``mtp.*``) as vLLM's ``Qwen3NextMultiTokenPredictor``
(``vllm/model_executor/models/qwen3_next_mtp.py``, which Qwen3.5's reuses): zero-centred norms of
the embedding and of the main model's *normed* output, concatenated embedding first, projected
(``fc``), one full-attention block, a zero-centred norm, the shared head (:class:`Qwen35MtpBlock`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ray_titan.models.decoder import FeedForward, MtpDecoder, MtpDepth, RMSNorm, _copy_full_into, param_seed
from ray_titan.models.qwen3_5.args import FULL, Qwen35Args
from ray_titan.models.qwen3_5.delta_rule import GatedDeltaNet

__all__ = ["GatedAttention", "Qwen35", "Qwen35Block", "Qwen35MtpBlock", "ZeroCenteredRMSNorm", "deltanet_layers",
           "rotate_half_rope"]


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + weight`` (weight initialised to 0), in fp32 (transformers'
    ``Qwen3_5RMSNorm``). Input ``(..., dim)``, output the same shape and dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first ``2 · cos.shape[-1]`` dims of each head in Hugging Face's
    ``rotate_half`` layout (dim ``j`` pairs with ``j + r/2``), the rest passed through. ``x``
    ``(batch, seq, heads, head_dim)``; ``cos``/``sin`` ``(>= seq, r/2)`` (positions ``0 .. seq −
    1``) or ``(batch, seq, r/2)``. Computed in fp32, returned in ``x``'s dtype."""
    half = cos.shape[-1]
    if cos.dim() == 3:
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    else:
        c, s = cos[None, :x.shape[1], None, :], sin[None, :x.shape[1], None, :]
    x1, x2, rest = x[..., :half].float(), x[..., half:2 * half].float(), x[..., 2 * half:]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).type_as(x)
    return torch.cat([rotated, rest], dim=-1)


class GatedAttention(nn.Module):
    """Qwen3.5's full attention (module docstring). Input and output ``(batch, seq, dim)``.

    ``wq`` gives per head the query and then its output gate (``head_dim`` each: transformers'
    ``q_proj`` layout), ``wk``/``wv`` the key-value heads, ``wo`` the output projection;
    ``q_norm``/``k_norm`` are zero-centred RMSNorms over ``head_dim``. ``mask``: ``(batch, 1, seq,
    seq)`` bool (True = may attend) instead of the causal mask.
    """

    def __init__(self, args: Qwen35Args):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, 2 * args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, gate = self.wq(x).view(bsz, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q = rotate_half_rope(self.q_norm(q), cos, sin)
        k = rotate_half_rope(self.k_norm(k), cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             is_causal=mask is None, enable_gqa=self.n_kv_heads != self.n_heads)
        out = out.transpose(1, 2).reshape(bsz, seq, -1) * torch.sigmoid(gate.reshape(bsz, seq, -1))
        return self.wo(out)


class Qwen35Block(nn.Module):
    """Pre-norm block: ``h = x + mixer(norm(x)); out = h + ffn(norm(h))``, the mixer
    :class:`GatedAttention` (``attention``) or :class:`GatedDeltaNet` (``linear_attn``), the
    feed-forward ``ffn`` (a SwiGLU ``feed_forward``, or the MoE family's ``moe``). Input and
    output ``(batch, seq, dim)``. Raises ``ValueError`` when a DeltaNet layer is given a document
    mask (its state crosses documents; the pre-flight refuses ``training.document_mask``)."""

    def __init__(self, args: Qwen35Args, layer_id: int, ffn_name: str, ffn: nn.Module):
        super().__init__()
        self.attention_norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)
        # An MTP depth's block (keyed past the main layers) is full attention (vLLM's Qwen3.5 MTP).
        if layer_id >= args.n_layers or args.layer_types[layer_id] == FULL:
            self.attention = GatedAttention(args)
        else:
            self.linear_attn = GatedDeltaNet(args.dim, args.linear_k_heads, args.linear_v_heads,
                                             args.linear_k_head_dim, args.linear_v_head_dim, args.conv_kernel,
                                             args.norm_eps)
        self.ffn_norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)
        self.ffn_name = ffn_name
        self.add_module(ffn_name, ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if hasattr(self, "attention"):
            h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        else:
            if mask is not None:
                raise ValueError("Gated DeltaNet layers cannot keep packed documents apart (training.document_mask)")
            h = x + self.linear_attn(self.attention_norm(x))
        return h + getattr(self, self.ffn_name)(self.ffn_norm(h))


class Qwen35MtpBlock(MtpDepth, Qwen35Block):
    """Qwen3.5's multi-token-prediction depth (module docstring): the depth's parts
    (:class:`~ray_titan.models.decoder.MtpDepth`: ``enorm``, ``hnorm``, ``eh_proj``,
    ``head_norm``, the checkpoints' ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
    ``mtp.fc``, ``mtp.norm``) zero-centred, around a full-attention :class:`Qwen35Block` (the
    checkpoints' ``mtp.layers.0``) with the family's feed-forward."""

    NORM = ZeroCenteredRMSNorm


class Qwen35(MtpDecoder):
    """Qwen3.5 dense decoder (module docstring); input/output as :class:`~ray_titan.models.decoder.Decoder`,
    multi-token prediction (``args.n_mtp_layers``) as :class:`~ray_titan.models.decoder.MtpDecoder`
    with :class:`Qwen35MtpBlock`, fed the main model's normed output. Subclasses give each block
    another feed-forward (:meth:`make_ffn`)."""

    RESIDUAL_OUTPUTS = ("wo.weight", "out_proj.weight", "w2.weight", "experts.w2")
    MTP_AFTER_NORM = True

    def __init__(self, args: Qwen35Args):
        super().__init__(args)
        self.norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)

    def make_ffn(self, layer_id: int) -> tuple[str, nn.Module]:
        """The block's feed-forward and its attribute name: a SwiGLU of ``inter_dim``."""
        return "feed_forward", FeedForward(self.args.dim, self.args.inter_dim)

    def make_layer(self, layer_id: int) -> nn.Module:
        return Qwen35Block(self.args, layer_id, *self.make_ffn(layer_id))

    def make_mtp_layer(self, layer_id: int) -> nn.Module:
        return Qwen35MtpBlock(self.args, layer_id, *self.make_ffn(layer_id))

    @property
    def rope_dim(self) -> int:
        return self.args.rotary_dim

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """:meth:`Decoder.init_weights`, then as transformers initialises Qwen3.5: zero-centred
        norms 0, DeltaNet's ``dt_bias`` 1 and ``A_log`` the log of uniform(1, 16) (drawn from the
        parameter's own seed, so every mesh gives the same)."""
        super().init_weights(seed)
        for name, param in self.named_parameters():
            owner = self.get_submodule(name.rpartition(".")[0])
            if isinstance(owner, ZeroCenteredRMSNorm):
                _copy_full_into(param, torch.zeros(param.shape))
            elif name.endswith("dt_bias"):
                _copy_full_into(param, torch.ones(param.shape))
            elif name.endswith("A_log"):
                g = torch.Generator().manual_seed(param_seed(seed, name))
                _copy_full_into(param, torch.empty(param.shape).uniform_(1.0, 16.0, generator=g).log())


def deltanet_layers(args: Qwen35Args) -> list[int]:
    """Indices of the Gated DeltaNet layers."""
    return [i for i in range(args.n_layers) if i not in args.full_attention_layers]


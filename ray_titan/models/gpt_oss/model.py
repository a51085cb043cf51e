"""gpt-oss decoder: attention with sinks and alternating sliding windows, and an MoE feed-forward.

Architecture after OpenAI's gpt-oss model card (2025, "gpt-oss-120b & gpt-oss-20b Model Card")
and transformers' ``models/gpt_oss/modeling_gpt_oss.py`` (``GptOssForCausalLM``): pre-norm
blocks (RMSNorm), each with

- **attention** (:class:`SinkAttention`): grouped-query, q/k/v/o projections with biases, YaRN
  rotary embeddings (``ray_titan.models.rope``, ``truncate`` false), and a learned per-head
  *sink*: a logit ``s_h`` that joins the softmax's denominator and attends to nothing,
  ``p_ij = exp(l_ij) / (exp(s_h) + Σ_j exp(l_ij))``. Layers alternate a sliding window (a query
  sees itself and the ``sliding_window - 1`` tokens before it) and full causal attention
  (``layer_types``).
- a **mixture of experts** in every layer: DeepSeek-V2's MoE layer
  (``ray_titan.models.deepseek_v2.model.MoE``: dropless token routing, stacked experts, expert
  parallelism), with a router whose linear layer has a bias and that weights the top-k experts
  by a softmax over their logits (``ray_titan.models.routing.topk_softmax``), and experts with
  biases and the clamped SwiGLU (``ray_titan.models.deepseek_v2.model.clamped_swiglu``); no
  shared expert. Balance loss: transformers' pooled one, as Qwen3-MoE's
  (:class:`~ray_titan.models.qwen3_moe.model.PooledBalanceMoE`, :meth:`Qwen3Moe.forward`).

**Sinks through SDPA**, exactly: the sink is one more key whose value row is zero and whose
logit is ``s_h`` for every query: keys and values get a zero row appended, and the attention
mask is an additive float mask ``(batch, heads, seq, seq + 1)``: 0 where the causal or sliding
window mask allows, ``-inf`` where it does not, and ``s_h`` in the sink column (the sink key's
own logit ``q · 0`` is 0). ``F.scaled_dot_product_attention`` then computes transformers' eager
``softmax([scores, sink])[..., :-1] @ v`` (which subtracts the row maximum, as SDPA's kernels
do). Its cost: the float mask holds ``heads · seq · (seq + 1)`` values per sequence (in the
activations' dtype), where a plain causal attention needs none.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ray_titan.models.decoder import RMSNorm, apply_rope
from ray_titan.models.deepseek_v2.model import activated_parameters as _routed_activated
from ray_titan.models.gpt_oss.args import GptOssArgs
from ray_titan.models.qwen3_moe.model import PooledBalanceMoE, Qwen3Moe

__all__ = ["GptOss", "GptOssBlock", "SinkAttention", "activated_parameters", "attention_bias"]


def attention_bias(allowed: torch.Tensor, sinks: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of attention with sinks (module docstring): ``allowed`` ``(seq, seq)`` or
    ``(batch, 1, seq, seq)`` bool (True: query ``i`` may attend to key ``j``), ``sinks (heads,)``;
    returns ``(batch, heads, seq, seq + 1)`` of ``dtype``: 0 / ``-inf`` from ``allowed``, then
    the sink logit of each head as the last column."""
    seq = allowed.shape[-1]
    heads = sinks.shape[0]
    keys = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))
    keys = keys.expand(batch, heads, seq, seq)
    sink = sinks.to(dtype).view(1, heads, 1, 1).expand(batch, heads, seq, 1)
    return torch.cat([keys, sink], dim=-1)


class SinkAttention(nn.Module):
    """gpt-oss attention (module docstring): causal grouped-query attention with q/k/v/o biases,
    a learned sink logit per query head (``sinks (n_heads,)``) and, when ``window`` is set, a
    sliding window of ``window`` tokens (query included), via ``F.scaled_dot_product_attention``.
    Input and output ``(batch, seq, dim)``; ``mask`` (``(batch, 1, seq, seq)`` bool, True = may
    attend; documents packed in a sequence) replaces the causal mask and is narrowed to the
    window too. Softmax scale ``1/sqrt(head_dim)``."""

    def __init__(self, args: GptOssArgs, window: int | None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.window = window
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=True)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=True)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=True)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=True)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))

    def allowed(self, seq: int, device: torch.device, mask: torch.Tensor | None) -> torch.Tensor:
        """Which keys each query may attend to: ``(seq, seq)`` bool (causal, narrowed to the
        window), or ``mask`` narrowed to the window; True = may attend."""
        i = torch.arange(seq, device=device)
        allowed = (i[None, :] <= i[:, None]) if mask is None else mask
        if self.window is not None:
            # transformers' sliding_window_overlay: key j is kept when j > i - window.
            allowed = allowed & (i[None, :] > i[:, None] - self.window)
        return allowed

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # The sink: one more key and value, all zeros, whose logit the mask sets to s_h.
        k = torch.cat([k, k.new_zeros(bsz, k.shape[1], 1, self.head_dim)], dim=2)
        v = torch.cat([v, v.new_zeros(bsz, v.shape[1], 1, self.head_dim)], dim=2)
        bias = attention_bias(self.allowed(seq, x.device, mask), self.sinks, bsz, q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class GptOssBlock(nn.Module):
    """Pre-norm block: :class:`SinkAttention` (sliding or full, ``args.layer_types``), then the
    MoE (:class:`PooledBalanceMoE` with gpt-oss's router bias, expert biases and clamped
    SwiGLU). Input and output ``(batch, seq, dim)``."""

    def __init__(self, args: GptOssArgs, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = SinkAttention(args, args.sliding_window if args.is_sliding(layer_id) else None)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = PooledBalanceMoE(
            args, router_bias=True, expert_bias=True, expert_activation="clamped_swiglu",
            activation_params={"alpha": args.swiglu_alpha, "limit": args.swiglu_limit},
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.moe(self.ffn_norm(h))


class GptOss(Qwen3Moe):
    """gpt-oss decoder (module docstring); input/output as
    :class:`~ray_titan.models.decoder.Decoder`, plus the pooled balance loss in training (as
    Qwen3-MoE's). Initialisation: as the decoder's, but every bias of the attention
    projections and the experts starts at zero (transformers' ``_init_weights``); the router's
    bias and the sinks are drawn as weights."""

    RESIDUAL_OUTPUTS = ("wo.weight", "w2.weight", "experts.w2")  # no dense w2 here: matches nothing

    def make_layer(self, layer_id: int) -> nn.Module:
        return GptOssBlock(self.args, layer_id)

    @property
    def rope_dim(self) -> int:
        return self.args.head_dim

    def moe_modules(self) -> dict[int, PooledBalanceMoE]:
        return {int(i): cast(PooledBalanceMoE, b.moe) for i, b in self.layers.items()}

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        super().init_weights(seed)
        for name, p in self.named_parameters():
            if name.endswith(("attention.wq.bias", "attention.wk.bias", "attention.wv.bias", "attention.wo.bias",
                              "experts.b1", "experts.b2", "experts.b3")):
                p.zero_()


def activated_parameters(model: GptOss) -> int:
    """Parameters that take part in computing one token, as OpenAI's model card counts "active
    parameters" (20b: 3.6 B, 120b: 5.13 B of its table): all except the input embedding (a
    lookup; the unembedding counts) and the routed experts not chosen (4 of 32 or 128 count):
    DeepSeek's count (``ray_titan.models.deepseek_v2.activated_parameters``). Works on the meta
    device."""
    return _routed_activated(model)

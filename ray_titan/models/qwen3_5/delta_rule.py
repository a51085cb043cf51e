"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", arXiv:2412.06464), the linear attention of Qwen3-Next and Qwen3.5, in plain PyTorch.

Per value head, a state ``S`` (``d_k × d_v``) is carried along the sequence. At token ``t``, with
the key ``k_t`` and query ``q_t`` L2-normalised (the query then scaled by ``d_k^-1/2``), the log
decay ``g_t <= 0`` and the write strength ``β_t`` in (0, 1)::

    S ← exp(g_t) · S                       (gating: forget)
    S ← S + β_t · k_t (v_t − Sᵀ k_t)ᵀ      (delta rule: write the part of v_t S does not predict)
    o_t = Sᵀ q_t

:func:`recurrent_gated_delta_rule` is that loop, token by token (the reference the tests check the
other against). :func:`chunk_gated_delta_rule` is the form for training (the WY / UT-transform
chunking of Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
Length", arXiv:2406.06484, §3, with the gate folded in as in arXiv:2412.06464 §3.3): within a
chunk of ``C`` tokens the ``C`` sequential writes become one unit-lower-triangular solve, so the
loop runs over ``T / C`` chunks instead of ``T`` tokens.

Chunk derivation (positions ``1..C`` of a chunk; ``γ_t = Σ_{s<=t} g_s``, ``Γ_t = exp(γ_t)``, ``S_0``
the state entering it): writing ``u_j`` for the correction the j-th write adds (``β_j (v_j − ...)``),
``S_t = Γ_t S_0 + Σ_{j<=t} (Γ_t/Γ_j) k_j u_jᵀ``, and ``u`` solves ``(I + A) u = βV − (βΓK) S_0``
with ``A_{ji} = β_j (Γ_j/Γ_i) k_j·k_i`` for ``i < j``. Outputs are
``o_t = Γ_t q_tᵀ S_0 + Σ_{j<=t} (Γ_t/Γ_j)(q_t·k_j) u_j`` and the state leaving the chunk is
``Γ_C S_0 + Σ_j (Γ_C/Γ_j) k_j u_jᵀ``. Everything is computed in fp32.

:class:`GatedDeltaNet` is Qwen3.5's token mixer around it (transformers'
``models/qwen3_5/modeling_qwen3_5.py``, ``Qwen3_5GatedDeltaNet``, is the reference): one
projection to queries, keys and values, a depthwise causal convolution of width
``conv_kernel`` with SiLU over them (:func:`causal_depthwise_conv`), ``β = sigmoid(W_b x)``, the
decay ``g = −exp(A_log) · softplus(W_a x + dt_bias)``, value heads sharing query/key heads in
groups, and the output RMS-normalised per head and gated by ``silu(W_z x)``
(:class:`GatedRMSNorm`) before ``out_proj``.

On CUDA, when flash-linear-attention (``fla``, a package on the index; never required) is
importable, :func:`gated_delta_rule` uses its fused chunked kernel instead of the plain form
(:data:`FLA_CHUNK`); everywhere else, the plain chunked form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CHUNK", "FLA_CHUNK", "GatedDeltaNet", "GatedRMSNorm", "causal_depthwise_conv", "chunk_gated_delta_rule",
    "gated_delta_rule", "l2_normalize", "recurrent_gated_delta_rule",
]

CHUNK = 64
"""Tokens per chunk of :func:`chunk_gated_delta_rule` (flash-linear-attention's and transformers')."""


def _find_fla() -> Callable[..., Any] | None:
    try:  # optional: flash-linear-attention's Triton kernel (GPU only)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception:  # absent, or present but unusable (no Triton): the plain form serves
        return None
    return fla_chunk


FLA_CHUNK: Callable[..., Any] | None = _find_fla()
"""flash-linear-attention's ``chunk_gated_delta_rule`` when the package imports, else None."""


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim (flash-linear-attention's ``l2norm``, which
    transformers' reference follows: eps inside the root). Any shape; same shape out."""
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """Heads first, fp32, q/k normalised (q scaled by ``d_k^-1/2``) and repeated over the value
    heads they serve: ``(b, hv, t, d)`` and ``(b, hv, t)``."""
    hk, hv = k.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of query/key heads ({hk})")
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    if hv != hk:  # value head h reads query/key head h // (hv / hk)
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    # Contiguous, heads first: the chunks' matmuls then read views, with or without padding.
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, g, beta))
    return q, k, v, g, beta


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule token by token (module docstring): the reference form.

    ``q``, ``k``: ``(batch, seq, hk, d_k)``; ``v``: ``(batch, seq, hv, d_v)`` with ``hv`` a
    multiple of ``hk``; ``g`` (log decay, <= 0) and ``beta``: ``(batch, seq, hv)``. Returns
    ``(batch, seq, hv, d_v)`` in ``v``'s dtype; the state starts at zero. Raises ``ValueError``
    when ``hv`` is not a multiple of ``hk``."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    state = v.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for i in range(t):
        state = state * g[:, :, i, None, None].exp()
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, :, i])
        update = (v[:, :, i] - predicted) * beta[:, :, i, None]
        state = state + k[:, :, i, :, None] * update[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, i]))
    return torch.stack(out, dim=2).transpose(1, 2).to(dtype)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule over chunks of ``chunk`` tokens (module docstring's derivation): equal
    to :func:`recurrent_gated_delta_rule` up to rounding, with a loop of ``seq / chunk`` steps.

    Shapes and dtypes as :func:`recurrent_gated_delta_rule`; the sequence is padded with zeros to
    a multiple of ``chunk`` (a padded token has ``β = 0``, so it writes nothing). Saved for
    backward per value head and token, fp32: the chunk tensors q, k, βk, βv, the decays, the
    ``C × C`` system and score matrices and the solved ``u`` (``ray_titan.models.qwen3_5.costs``
    counts them). Raises ``ValueError`` when ``hv`` is not a multiple of ``hk``."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q, k, v = (x.unflatten(2, (n, chunk)) for x in (q, k, v))  # (b, h, n, C, d)
    gamma = g.unflatten(2, (n, chunk)).cumsum(dim=-1)  # (b, h, n, C): log Γ_t within each chunk
    beta = beta.unflatten(2, (n, chunk))[..., None]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(γ_t − γ_j) for j <= t, 0 above the diagonal (masked before exp: the difference may be large).
    ratio = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta
    # I + A, A strictly lower: A_tj = β_t (Γ_t/Γ_j) k_t·k_j.
    system = (kb @ k.transpose(-1, -2) * ratio).tril(-1) + torch.eye(chunk, device=q.device)
    u_v = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    u_s = torch.linalg.solve_triangular(system, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    scores = q @ k.transpose(-1, -2) * ratio  # (Γ_t/Γ_j) q_t·k_j, j <= t
    q_in = q * gamma.exp()[..., None]  # reads of the entering state
    k_out = k * (gamma[..., -1:] - gamma).exp()[..., None]  # writes as seen at the chunk's end
    chunk_decay = gamma[..., -1].exp()[..., None, None]
    state = q.new_zeros(b, h, dk, dv)
    outs = []
    for i in range(n):
        u = u_v[:, :, i] - u_s[:, :, i] @ state
        outs.append(q_in[:, :, i] @ state + scores[:, :, i] @ u)
        state = state * chunk_decay[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :t]
    return out.transpose(1, 2).to(dtype)


def _fla_device(x: torch.Tensor) -> bool:
    """Whether flash-linear-attention's Triton kernels run on ``x``'s device (CUDA)."""
    return x.is_cuda


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
    """The training form: flash-linear-attention's fused kernel on a CUDA tensor when it is
    installed (:data:`FLA_CHUNK`; it normalises q and k itself and takes grouped heads expanded
    here), else :func:`chunk_gated_delta_rule`. Shapes as :func:`recurrent_gated_delta_rule`."""
    if FLA_CHUNK is not None and _fla_device(q):
        hk, hv = k.shape[2], v.shape[2]
        if hv != hk:
            q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
        out, _ = FLA_CHUNK(q, k, v, g=g.float(), beta=beta, use_qk_l2norm_in_kernel=True)
        return out
    return chunk_gated_delta_rule(q, k, v, g, beta)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise 1-D convolution, then SiLU: ``x (batch, seq, channels)``, ``weight
    (channels, 1, width)`` (an ``nn.Conv1d`` with ``groups = channels``, no bias); output ``t``
    sees inputs ``t − width + 1 .. t`` (zeros before the start: padded on both sides and the
    last ``width − 1`` outputs dropped, as transformers' ``causal_conv1d_fn``, which makes it
    bitwise the reference's). Returns ``(batch, seq, channels)``."""
    width, seq = weight.shape[-1], x.shape[1]
    out = F.conv1d(x.transpose(1, 2), weight, padding=width - 1, groups=weight.shape[0])[..., :seq]
    return F.silu(out).transpose(1, 2)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim (``weight`` initialised to ones, fp32 arithmetic), then times
    ``silu(gate)`` (transformers' ``Qwen3_5RMSNormGated``). ``x``, ``gate``: ``(..., dim)``;
    output the same shape, ``x``'s dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's Gated DeltaNet token mixer (module docstring). Input and output ``(batch, seq,
    dim)``.

    Parameters (transformers' names, so the checkpoint maps one to one): ``in_proj_qkv``
    (``dim → 2·hk·d_k + hv·d_v``: queries, keys, values, each head-major), ``in_proj_z``
    (``dim → hv·d_v``, the output gate), ``in_proj_b`` and ``in_proj_a`` (``dim → hv``), ``conv1d``
    (depthwise, ``width`` taps, no bias), ``dt_bias`` and ``A_log`` (``(hv,)``), ``norm``
    (:class:`GatedRMSNorm` over ``d_v``) and ``out_proj`` (``hv·d_v → dim``).
    """

    def __init__(self, dim: int, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int, eps: float):
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"linear value heads ({n_v_heads}) must be a multiple of key heads ({n_k_heads})")
        self.hk, self.hv, self.dk, self.dv = n_k_heads, n_v_heads, k_head_dim, v_head_dim
        conv_dim = 2 * n_k_heads * k_head_dim + n_v_heads * v_head_dim
        self.in_proj_qkv = nn.Linear(dim, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, n_v_heads * v_head_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, n_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))
        self.A_log = nn.Parameter(torch.zeros(n_v_heads))
        self.norm = GatedRMSNorm(v_head_dim, eps)
        self.out_proj = nn.Linear(n_v_heads * v_head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = causal_depthwise_conv(self.in_proj_qkv(x), self.conv1d.weight)
        kw = self.hk * self.dk
        q, k, v = mixed.split([kw, kw, self.hv * self.dv], dim=-1)
        q, k = q.unflatten(-1, (self.hk, self.dk)), k.unflatten(-1, (self.hk, self.dk))
        v = v.unflatten(-1, (self.hv, self.dv))
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = gated_delta_rule(q, k, v, g, beta)
        z = self.in_proj_z(x).unflatten(-1, (self.hv, self.dv))
        return self.out_proj(self.norm(out, z).flatten(2))

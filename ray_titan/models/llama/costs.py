"""Llama's (and Qwen3 dense's) training FLOPs and activation memory (``ray_titan.models.costs``).

Activations per token of one block, ``d`` model width, ``h`` heads, ``q = h·head_dim`` the query
width (Qwen3: ``head_dim`` 128, so ``q ≠ d``), ``kv`` the key/value width, ``f`` the SwiGLU hidden
size: residual and norm inputs ``4·(2d + 2d + 2)`` (x, x̂ and the RMS of both norms), the two norm
outputs ``2e·d``, the rotated queries, keys and values ``e·(q + 2kv)``, the attention output
``e·q`` and its log-sum-exp ``4h`` (fused attention: no ``s × s`` matrix), and the SwiGLU's
``4e·f``; with Qwen3's per-head q/k RMSNorm (``qk_norm``) also each norm's input and output and
its per-head RMS, in fp32 (``rms_norm`` upcasts): ``4·(2q + h) + 4·(2kv + n_kv)``. Under FSDP2's
bf16 policy the residual stream is bf16, yet ``e = 2`` equals what autograd saves on CPU, torch
2.13 (``rms_norm`` saves its input and normalised output upcast to fp32). Korthikanti's GPT count
(``34·s·b·h + 5·a·s²·b`` bytes) differs in the MLP (SwiGLU has three matrices) and in attention
(fused kernels save no ``s²`` scores). The transient of a block's backward is the SwiGLU's at
silu's derivative: the gradients of ``h = silu(a)·b``, of ``silu(a)``, of ``b`` and of ``a``,
``4e·f`` (autograd's derivatives of ``mul`` and ``silu``), less ``h`` (``e·f``, saved for
``w2``'s weight gradient and freed once it is made): ``3e·f`` above what the block keeps (the
simulated GPU, ``ray-titan dry-run``, sees them at a dense rank's peak, 2026-11-26). A
zero-bubble schedule's input-gradient step keeps, per token until the weight-gradient step, the
output gradients of the block's weight-consuming ops: ``e·(q + 2kv)`` (wq, wk, wv), ``2e·d``
(wo, w2), ``2e·f`` (w1, w3) and ``4·2d`` for the two norms' weight products (fp32), with q/k norms
``4·(q + kv)`` more (``BlockActivations.weight_step``).
"""

from __future__ import annotations

from typing import Any

from ray_titan.models.costs import F32, BlockActivations, op_sac_saved, transformer_flops_per_token

__all__ = ["LLAMA_MATMULS", "llama_block_activations", "llama_flops_per_token", "llama_non_embedding_params"]

LLAMA_MATMULS = 4
"""Matmuls op SAC counts in Llama's attention (wq, wk, wv, wo; ``ray_titan.parallel.ac``)."""


def llama_non_embedding_params(args: Any) -> int:
    """Parameters of a :class:`ray_titan.models.llama.args.LlamaArgs` model minus its token embedding
    (attention, SwiGLU feed-forward, RMSNorm weights, final norm, untied output head), counted
    from the arguments alone."""
    hd, d = args.head_dim, args.dim
    attention = d * args.n_heads * hd * 2 + d * args.n_kv_heads * hd * 2  # wq, wo; wk, wv
    ffn = 3 * d * args.ffn_hidden_dim  # w1, w2, w3
    per_layer = attention + ffn + 2 * d  # two RMSNorms
    return args.n_layers * per_layer + d + d * args.vocab_size  # final norm, output head


def llama_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a dense Llama (:class:`~ray_titan.models.llama.args.LlamaArgs`)
    at sequence length ``seq_len``: :func:`~ray_titan.models.costs.transformer_flops_per_token` with
    N = :func:`llama_non_embedding_params`, L = ``n_layers``, H·Q = ``n_heads × head_dim``."""
    return transformer_flops_per_token(
        llama_non_embedding_params(args), args.n_layers, args.n_heads * args.head_dim, seq_len
    )


def llama_block_activations(a: Any, layer: int, e: int, seq: int, device: str, rho: float,
                            ep: int) -> BlockActivations:
    """Bytes per token block ``layer`` of a Llama / Qwen3 model with arguments ``a`` saves, ``e``
    bytes per activation element (module docstring; every block alike, so ``layer``, ``seq``,
    ``device``, ``rho`` and ``ep`` are unused)."""
    d, h = a.dim, a.n_heads
    q = h * a.head_dim
    kv = a.n_kv_heads * a.head_dim
    f = a.ffn_hidden_dim
    norms = F32 * (4 * d + 2) + e * 2 * d  # x, x̂, h, ĥ, two RMS values; the two norm outputs
    attention = e * (q + 2 * kv) + e * q + F32 * h  # rotated q, k; v; output; log-sum-exp
    if a.qk_norm:  # RMSNorm of q and k per head (or over all heads): input, output and RMS, fp32
        attention += F32 * (2 * q + 2 * kv) + F32 * (2 if a.qk_norm_per_layer else h + a.n_kv_heads)
    none = norms + attention + e * 4 * f
    # Op SAC: the block input, attention's output and log-sum-exp, and of the matmuls wq, wk, wv,
    # wo (and w1, w3, w2) the 1st, 3rd… (LLAMA_MATMULS counted ones with no feed-forward).
    mms = [e * q, e * kv, e * kv, e * d] + ([e * f, e * f, e * d] if f else [])
    op = F32 * d + e * q + F32 * h + op_sac_saved(mms)
    # The SwiGLU's backward, out = w2(h), h = silu(a)·b: at silu's backward the gradients of h,
    # silu(a), b and a are alive at once (autograd's derivatives of mul and silu), 4 f-wide, and
    # h itself, saved for w2's weight gradient, is freed by then: 3 f-wide above what is kept.
    backward = e * 3 * f
    # Kept from a zero-bubble I step to its W step: the output gradients of wq, wk, wv (e·(q +
    # 2kv)), wo and w2 (e·d each), w1 and w3 (e·f each) and of the two norms' weight products
    # (fp32: rms_norm upcasts), q/k norms' too (measured on the CPU and the simulated GPU).
    weight_step = e * (q + 2 * kv) + 2 * e * d + 2 * e * f + 2 * F32 * d
    if a.qk_norm:
        weight_step += F32 * (q + kv)
    # The two norm outputs feed column-parallel projections: whole on every tensor-parallel rank.
    return BlockActivations(none, op, F32 * d, backward, whole=e * 2 * d, weight_step=weight_step)

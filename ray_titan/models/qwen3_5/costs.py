"""Qwen3.5's training FLOPs and activation memory (``ray_titan.models.costs``).

**FLOPs** per token: PaLM's ``6·N + 12·L·H·Q·T`` (:func:`~ray_titan.models.costs.transformer_flops_per_token`)
with ``N`` the non-embedding parameters and ``L`` only the full-attention layers, plus each Gated
DeltaNet layer's chunked delta rule (:func:`~ray_titan.models.qwen3_5.delta_rule.chunk_gated_delta_rule`),
counted as its matmuls are (full ``C × C`` products, as PaLM counts attention's unmasked scores):
per value head and token, forward, ``2·C·d_k`` twice (``k·kᵀ`` and ``q·kᵀ``), ``C·(d_k + d_v)``
for the two triangular solves, ``2·C·d_v`` for the scores times ``u`` and ``3 · 2·d_k·d_v`` for the
state's read, write and the output's read: ``C·(5·d_k + 3·d_v) + 6·d_k·d_v``, three times that
for training.

**Activations** per token (``e`` the activation element size, fp32 4; Korthikanti's method:
what each operation saves for backward, counted against autograd,
``tests/unit/test_qwen3_5.py``). Every block: two zero-centred RMSNorms, each an fp32 copy of its
input, the normalised fp32 tensor and the RMS (``4·(2d + 1)`` each), the inputs of the first
projections and of the feed-forward (``2e·d``), and the SwiGLU's ``4e·f`` (Llama's).

A Gated DeltaNet layer (``K = hk·d_k``, the key width before the heads are repeated, ``Kx = hv·d_k``
after, ``V = hv·d_v``, ``c = 2K + V`` the convolved channels, ``hv`` value heads,
``C`` the chunk, ``r = ⌈T/C⌉·C / T`` the padding, all fp32 inside the delta rule): the convolution's
input and output ``2e·c``; q and k upcast for their L2 norms ``4·(2K + 2hk)`` (in fp32 no copy:
the convolution's output ``4·c`` instead of ``4·2K``); β, the decay's softplus input and output
``e·hv + 8·hv``; in the chunks, five
``C``-wide matrices per value head and token (the decay ratios, ``βk·kᵀ`` and ``q·kᵀ``, the
triangular system, the scores) ``5·4·hv·C·r``, six ``Kx``-wide tensors (q, k and their decayed
and β-weighted forms) ``6·4·Kx·r``, three ``V``-wide (v, the solved ``u`` of every chunk, βv)
``3·4·V·r``, the state entering each chunk ``4·hv·d_k·d_v·r/C``, four per-token decays ``4·4·hv·r``;
then the gated output norm (fp32 input, gate and its SiLU, ``3·4·V``; the normalised and the
weighted outputs ``2e·V``; its RMS ``4·hv``) and ``out_proj``'s input ``e·V``. The ``C``-wide
matrices dominate (Qwen3.5-27B: 48 value heads, 61 KB per token in a DeltaNet layer, six times
the bf16 residual stream's width): flash-linear-attention's kernels recompute them instead.

A full-attention layer: Qwen3's attention (the q/k norms' fp32 inputs, outputs and RMS
``4·(2q + h) + 4·(2kv + n_kv)``, in fp32 ``4·q`` more: the query norm's input is then its view
of the query-and-gate projection), fused attention's q, k, v and log-sum-exp ``e·(q + 2kv) + 4h``)
with the output gate (its sigmoid, the attention output and their product ``3e·q``).

The transient of a backward: the SwiGLU's ``3e·f`` (Llama's), or in a DeltaNet layer the
gradients of the chunk matrices, two ``C``-wide per head alive at once where that is larger
(the simulated GPU's peak, ``ray-titan dry-run``, 2026-11-27).
"""

from __future__ import annotations

import math
from typing import Any

from ray_titan.models.costs import F32, BlockActivations, transformer_flops_per_token
from ray_titan.models.qwen3_5.args import FULL
from ray_titan.models.qwen3_5.delta_rule import CHUNK

__all__ = ["deltanet_flops_per_token", "hybrid_flops_per_token", "qwen3_5_block_activations",
           "qwen3_5_flops_per_token"]


def deltanet_flops_per_token(a: Any) -> int:
    """Training FLOPs per token of one Gated DeltaNet layer's chunked delta rule (module
    docstring), projections excluded (they are in ``6·N``)."""
    dk, dv = a.linear_k_head_dim, a.linear_v_head_dim
    return 3 * a.linear_v_heads * (CHUNK * (5 * dk + 3 * dv) + 6 * dk * dv)


def hybrid_flops_per_token(model: Any, seq_len: int) -> int:
    """Training FLOPs per token at ``seq_len`` of a Qwen3.5 ``model`` (dense or MoE, on the meta
    device): the module docstring's count, ``N`` the activated non-embedding parameters
    (DeepSeek's count, :func:`ray_titan.models.deepseek_v2.model.activated_parameters`, for an
    MoE model; dense: every parameter but the embedding). Multi-token prediction's
    ``n_mtp_layers`` depths count as DeepSeek-V3's: more full-attention blocks (their parameters
    are among the model's), and the output head once more each."""
    from ray_titan.models.deepseek_v2.model import activated_parameters

    args = model.args
    if hasattr(args, "n_routed_experts"):
        n = activated_parameters(model)
    else:
        n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("tok_embeddings"))
    mtp = args.n_mtp_layers
    n += mtp * args.vocab_size * args.dim
    linear = args.n_layers - len(args.full_attention_layers)
    return (transformer_flops_per_token(n, len(args.full_attention_layers) + mtp, args.n_heads * args.head_dim,
                                        seq_len)
            + linear * deltanet_flops_per_token(args))


def qwen3_5_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a dense Qwen3.5 model at ``seq_len`` (:func:`hybrid_flops_per_token`)."""
    import torch

    from ray_titan.models.qwen3_5.model import Qwen35

    with torch.device("meta"):
        return hybrid_flops_per_token(Qwen35(args), seq_len)


def _deltanet(a: Any, e: int, seq: int) -> tuple[float, float]:
    """Bytes per token a Gated DeltaNet mixer saves, and its backward's chunk-gradient transient."""
    hk, hv, dk, dv = a.linear_k_heads, a.linear_v_heads, a.linear_k_head_dim, a.linear_v_head_dim
    k, kx, v = hk * dk, hv * dk, hv * dv
    c = 2 * k + v
    r = math.ceil(seq / CHUNK) * CHUNK / seq
    conv = 2 * e * c  # the convolution's input and output
    # q and k upcast for their L2 norms; in fp32 no copy is made and the convolution's output is kept.
    gates = (F32 * 2 * k if e != F32 else F32 * c) + F32 * 2 * hk + e * hv + 2 * F32 * hv
    chunks = r * F32 * (5 * hv * CHUNK + 6 * kx + 3 * v + hv * dk * dv / CHUNK + 4 * hv + hv / CHUNK)
    out = 3 * F32 * v + 2 * e * v + F32 * hv + e * v
    return conv + gates + chunks + out, r * F32 * 2 * hv * CHUNK


def _attention(a: Any, e: int) -> float:
    """Bytes per token the gated full attention saves (module docstring)."""
    q, kv, h, n_kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_heads, a.n_kv_heads
    norms = F32 * (2 * q + h) + F32 * (2 * kv + n_kv)
    if e == F32:  # no upcast copy: the q norm's input is its view of the query-and-gate projection
        norms += F32 * q
    return norms + e * (q + 2 * kv) + F32 * h + 3 * e * q


def qwen3_5_block_activations(a: Any, layer: int, e: int, seq: int, device: str, rho: float,
                              ep: int, ffn: BlockActivations | None = None) -> BlockActivations:
    """Bytes per token block ``layer`` of a Qwen3.5 model with arguments ``a`` saves, ``e`` bytes
    per activation element (module docstring). ``ffn``: the feed-forward's own record instead of
    the dense SwiGLU (the MoE family's); ``device``, ``rho`` and ``ep`` reach only it. Op-level
    selective checkpointing is planned as keeping everything (``op = none``: an upper bound; its
    every-second-matmul rule is not modelled for DeltaNet's chunk loop)."""
    d = a.dim
    if layer >= a.n_layers or a.layer_types[layer] == FULL:  # an MTP depth's block is full attention
        mixer, mixer_backward = _attention(a, e), 0.0
    else:
        mixer, mixer_backward = _deltanet(a, e, seq)
    if ffn is None:
        f = a.inter_dim
        ffn = BlockActivations(e * (d + 4 * f), e * (d + 4 * f), 0.0, e * 3 * f)
    base = 2 * F32 * (2 * d + 1) + e * d + mixer
    none = base + ffn.none
    return BlockActivations(none, none, F32 * d, max(ffn.backward, mixer_backward), ffn.experts_none,
                            ffn.experts_none, whole=0.0)

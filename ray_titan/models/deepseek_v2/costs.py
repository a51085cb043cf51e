"""DeepSeek-V2's (and V3's) training FLOPs and activation memory (``ray_titan.models.costs``), and
the MoE feed-forward's activations the other MoE families share.

Activations per token of one block (multi-head latent attention, arXiv:2405.04434): the norms as
Llama's, the KV latent ``e·(r_kv + r_rope)``, its norm ``4·r_kv + e·r_kv``, queries and keys
``2e·h·d_qk``, values and output ``2e·h·d_v``, and either ``4h`` (fused attention) or ``e·h·s``
(the attention probabilities of PyTorch's math kernel, which the CPU takes when ``d_qk ≠ d_v``).
Dense feed-forward as Llama's; MoE feed-forward (:func:`moe_activations`): router scores ``4·E``,
routing indices ``24·k`` (int64), the ``k`` dispatched copies of each token ``e·k·d`` (the experts'
input), the expert outputs ``4·k·d`` (``route_tokens`` weights them in fp32: in bf16 a new fp32
copy) and the weighted copies ``e·k·d``, each expert's SwiGLU ``4e·m`` per routed copy and the
shared experts' ``4e·n_s·m``. Under expert parallel a rank's experts receive ``ρ·k`` copies per
token, ρ the routing imbalance (max over mean tokens per rank, 1 = balanced; ``routing_imbalance``).

In bf16 (FSDP2's mixed precision) an RMSNorm saves an fp32 copy of its input (``4`` bytes per
element, not ``e``), the router an fp32 copy of its input ``4·d``, and the MoE's bf16 input
(the feed-forward norm's output) is saved only by the shared experts. These bf16 terms, and the
values' storage (the ``wkv_b`` output, ``h·(d_nope + d_v)``, of which ``v`` is a view) under a
fused kernel, were measured on the simulated GPU (``ray-titan dry-run``: the storages autograd
saves in one block's forward on fake CUDA tensors, torch 2.13), the fp32 terms on the CPU
(``tests/integration/test_memory_plan.py``).
"""

from __future__ import annotations

from typing import Any

from ray_titan.models.costs import (
    F32,
    I64,
    BlockActivations,
    fused_attention,
    op_sac_saved,
    transformer_flops_per_token,
)

__all__ = ["deepseek_block_activations", "deepseek_flops_per_token", "moe_activations"]


def deepseek_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a DeepSeek-V2-style MoE
    (:class:`~ray_titan.models.deepseek_v2.args.DeepSeekV2Args`) at ``seq_len``:
    :func:`~ray_titan.models.costs.transformer_flops_per_token` with N = the *activated*
    non-embedding parameters (:func:`ray_titan.models.deepseek_v2.model.activated_parameters`,
    counted on the meta device: shared parameters, the shared experts and ``top_k`` of the routed
    experts), L = ``n_layers`` and the MLA attention width ``H·(d_qk + d_v)/2``. Multi-token
    prediction's ``n_mtp_layers`` depths count as more blocks (their parameters are among the
    model's, and L grows by them), and each uses the output head once more (``vocab × dim`` more
    multiply-adds per token)."""
    import torch

    from ray_titan.models.deepseek_v2.model import DeepSeekV2, activated_parameters

    with torch.device("meta"):
        n = activated_parameters(DeepSeekV2(args)) + args.n_mtp_layers * args.vocab_size * args.dim
    width = args.n_heads * (args.qk_head_dim + args.v_head_dim) // 2
    return transformer_flops_per_token(n, args.n_layers + args.n_mtp_layers, width, seq_len)


def moe_activations(a: Any, e: int, rho: float, ep: int, norm_in: float, *, device: str = "cpu",
                    mm_before: int = 0) -> BlockActivations:
    """Bytes per token an MoE feed-forward (``ray_titan.models.deepseek_v2.model.MoE``: router,
    dispatch, ``top_k`` routed experts, ``n_shared_experts`` shared) saves, ``norm_in`` (its input
    norm's) included: ``none``, ``op``, ``backward`` (the larger of its backward's transient and
    its forward's, at the combine of the routed outputs: measured on the simulated GPU) and the
    experts' parts (``input`` unused). ``op`` follows op SAC's every-second-matmul rule after
    ``mm_before`` counted matmuls of the block (``ray_titan.parallel.ac``): the router's matmul is
    recomputed (a biased router's is an ``addmm``, saved: its family adds it); each local expert
    runs three (w1, w3, w2, rows or none), so alternate experts save w1's and w2's outputs or
    w3's; bf16 on a GPU (``device`` not ``"cpu"``) runs ``torch._grouped_mm``, which op SAC
    recomputes and does not count; then the shared experts' three; under expert parallel also the
    two all-to-alls' outputs (``whole_op``: whole under tensor parallel). ``backward_whole``: the
    part of ``backward`` tensor parallel does not split (all but the experts' hidden units: the
    routed rows are of the whole, gathered sequence; measured on the simulated GPU, DeepSeek-V3
    debug under tp = dp = ep = 2 with op SAC)."""
    d = a.dim
    k, m, ns, n_exp = a.n_activated_experts, a.moe_inter_dim, a.n_shared_experts, a.n_routed_experts
    routed = rho * k if ep > 1 else k  # copies this rank's experts process per token
    route = F32 * n_exp + 3 * I64 * k + F32 * k
    if a.norm_topk_prob and k > 1 and a.topk_method != "topk_softmax":  # the renormalisation saves the
        # chosen scores and their sum (gpt-oss's softmax over the top k: its costs.py)
        route += F32 * (k + 1)
    # The experts' input, their outputs in fp32 (a copy in bf16) and the weighted outputs; under
    # expert parallel also the received rows' permutation and the experts' outputs in received
    # order (``run_remote_experts``' ``index_copy``, whose backward formula saves its source).
    dispatched = e * routed * d + (F32 + e) * k * d + ((I64 + e * d) * routed if ep > 1 else 0)
    experts_none = dispatched + e * 4 * m * routed
    n_local = n_exp // ep
    if device != "cpu" and e < F32:  # torch._grouped_mm (GroupedExperts.grouped): recomputed
        experts_op, shared_before = 0.0, mm_before
    else:  # per local expert j, counted matmuls mm_before + 3j + 1…3: w1 and w2 saved where odd
        odd = sum((mm_before + 3 * j) % 2 == 0 for j in range(n_local)) / n_local
        experts_op, shared_before = e * routed * (m + odd * d), mm_before + 3 * n_local
    # bf16: the router's fp32 copy of its input; the MoE's bf16 input (the norm's output, which
    # ``norm_in`` or the caller's norms count) is saved only where shared experts read it.
    upcast = 0 if e == F32 else F32 * d - (0 if ns else e * d)
    none = norm_in + route + upcast + experts_none + e * 4 * ns * m
    # Under expert parallel op SAC also saves both all-to-alls' outputs (``run_remote_experts``:
    # the received rows and the outputs sent back, ``all_to_all_single`` being one of the ops it
    # saves): rows of the whole, gathered sequence under tensor parallel.
    a2a = 2 * e * routed * d if ep > 1 else 0.0
    experts_op += a2a
    op = experts_op + (op_sac_saved([e * ns * m, e * ns * m, e * d], shared_before) if ns else 0.0)
    backward = e * (routed * (2 * m + 2 * d) + 2 * ns * m)
    # Its forward's transient where the routed outputs are combined (route_tokens): the weighted
    # outputs in fp32, the outputs as received (bf16: its fp32 copy is what is saved), the
    # dispatched copies (under EP not saved: the experts' input is the received one), and in
    # bf16 the residual stream in and halfway through the block (the norms save fp32 copies).
    forward = F32 * k * d + (e * k * d if e < F32 else 0) + (e * k * d if ep > 1 else 0) + (2 * e * d if e < F32 else 0)
    # Its backward's first step, the combine's: the weighted outputs' gradient (fp32), its product
    # with the router weights and with the outputs (the weights' gradient), and the incoming one.
    combine = 3 * F32 * k * d + e * d
    # Under expert parallelism, when the outputs come back (run_remote_experts' second all-to-all):
    # the dispatched copies, the received ones, the outputs in received order and as returned.
    returned = e * (2 * k + 2 * routed) * d if ep > 1 else 0.0
    # Under tensor parallel the MoE's input is gathered whole (every tp rank routes the whole
    # sequence) and only the experts' hidden units are split: all but the norm and those is whole.
    whole = none - norm_in - e * 4 * m * (routed + ns)
    # Of the transient, likewise all but the hidden units' (the backward's SwiGLU gradients) is
    # whole: the combine's, the returned and the forward's tensors are rows of the whole sequence.
    transient, transient_whole = max((backward, e * routed * 2 * d), (forward, forward), (combine, combine),
                                     (returned, returned))
    return BlockActivations(none, op, 0.0, transient, experts_none, experts_op, whole, whole_op=a2a,
                            backward_whole=transient_whole)


def deepseek_block_activations(a: Any, layer: int, e: int, seq: int, device: str, rho: float,
                               ep: int) -> BlockActivations:
    """Bytes per token block ``layer`` of a DeepSeek-V2/V3 model with arguments ``a`` saves
    (module docstring): ``e`` bytes per activation element, ``seq`` tokens per sequence (the math
    kernel's probabilities), ``device`` ``"cpu"`` or ``"cuda"``, ``rho`` the routing imbalance,
    ``ep`` the expert-parallel degree."""
    d, h = a.dim, a.n_heads
    qk, vd, r_kv, r_rope = a.qk_head_dim, a.v_head_dim, a.kv_lora_rank, a.qk_rope_head_dim
    norm_in = F32 * (2 * d + 1) + e * d  # x, x̂, RMS; norm output
    q = (F32 * 2 * a.q_lora_rank + F32 + e * a.q_lora_rank) if a.q_lora_rank else 0
    # The latent (its norm's input: in bf16 the norm's fp32 copy of the r_kv part), its RMS and
    # normalised value, and the norm's output.
    kv = (e * (r_kv + r_rope) if e == F32 else F32 * r_kv) + F32 * (r_kv + 1) + e * r_kv
    if fused_attention(a, device):  # q, k; v's storage (the wkv_b output, no-rope keys too); output
        core = e * (2 * h * qk + h * (a.qk_nope_head_dim + vd) + h * vd) + F32 * h
        core_op = e * h * vd + F32 * h
    else:  # math kernel: q, kᵀ, probabilities, v, and the output's copy for wo
        core = e * (2 * h * qk + h * seq + 2 * h * vd)
        core_op = e * (h * seq + h * vd)
    attention = norm_in + q + kv + core
    # Op SAC: the block input, attention's output, and of the matmuls (wq_a, wq_b or wq; wkv_a,
    # wkv_b, wo) the 1st, 3rd…
    q_mms = [e * a.q_lora_rank, e * h * qk] if a.q_lora_rank else [e * h * qk]
    mms = q_mms + [e * (r_kv + r_rope), e * h * (a.qk_nope_head_dim + vd), e * d]
    attention_op = F32 * d + core_op + op_sac_saved(mms)
    # Under tensor parallel only the heads' projections (wq_b or wq, wkv_b; wo) are split: the
    # gathered input of the latent projections and the query and key-value latents are whole.
    attention_whole = e * d + q + kv
    # Under op SAC: the gathered input (collectives' outputs are saved) and the saved outputs of
    # the latent projections (the 1st and 3rd matmuls with a query latent; none without).
    attention_whole_op = e * d + (e * (a.q_lora_rank + r_kv + r_rope) if a.q_lora_rank else 0)
    if layer < a.n_dense_layers:
        ffn = norm_in + e * 4 * a.inter_dim
        ffn_op = op_sac_saved([e * a.inter_dim, e * a.inter_dim, e * d], len(mms))
        backward = e * 2 * a.inter_dim
    else:
        moe = moe_activations(a, e, rho, ep, norm_in, device=device, mm_before=len(mms))
        return BlockActivations(attention + moe.none, attention_op + moe.op, F32 * d, moe.backward,
                                moe.experts_none, moe.experts_op, attention_whole + moe.whole,
                                # and the MoE's gathered input, and under EP its all-to-alls' outputs
                                whole_op=attention_whole_op + e * d + (moe.whole_op or 0.0),
                                backward_whole=moe.backward_whole)
    return BlockActivations(attention + ffn, attention_op + ffn_op, F32 * d, backward, whole=attention_whole + e * d,
                            whole_op=attention_whole_op + e * d)

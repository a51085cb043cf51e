"""DeepSeek-V2-style mixture-of-experts decoder.

Architecture after DeepSeek-V2 (DeepSeek-AI 2024, arXiv:2405.04434) and its V2-Lite model card
(huggingface.co/deepseek-ai/DeepSeek-V2-Lite, ``config.json``):

- **Multi-head latent attention (MLA)**: keys and values are reconstructed from one low-rank
  latent ``c_KV`` (``kv_lora_rank``) per token; queries optionally from their own latent
  (``q_lora_rank``; 0 = a plain projection, as in V2-Lite). Rotary embeddings go on a decoupled
  part of each head (``qk_rope_head_dim``), the rotary key being shared by all heads.
- **DeepSeekMoE feed-forward** (Dai et al. 2024, arXiv:2401.06066): ``n_routed_experts`` small
  SwiGLU experts of which a router activates the top ``n_activated_experts`` per token
  (``topk_method``: ``greedy``, V2's ``group_limited_greedy`` within the ``topk_group`` best of
  ``n_group`` expert groups, or DeepSeek-V3's sigmoid ``noaux_tc`` (arXiv:2412.19437; this class
  is also the ``deepseek_v3`` family's model); the functions of ``ray_titan.models.routing``), plus
  ``n_shared_experts`` always-on experts; the first ``n_dense_layers`` layers are dense.
- **Load balancing**, chosen by ``load_balance``:
  ``"aux_loss"``: the expert-level balance loss of DeepSeek-V2 (§2.2.3, ``α Σ_i f_i P_i``),
  computed per sequence as DeepSeek-V3's complementary sequence-wise loss (arXiv:2412.19437,
  eq. 17–20), which makes it independent of how the batch is split over ranks and microbatches;
  ``"aux_free"``: DeepSeek-V3's auxiliary-loss-free balancing (§2.1.2; Wang et al. 2024,
  arXiv:2408.15664): a per-expert bias added to the scores for top-k *selection only*, moved by
  ``bias_update_rate · sign(mean load − load)`` after every optimizer step;
  ``"none"``.

Routing is dropless (no capacity factor): every token reaches its top-k experts
(:func:`route_tokens`). The model knows nothing of parallelism: expert parallelism
(``ray_titan.parallel.expert``) shards the experts' weights and sets :attr:`MoE.run_experts` to
move the grouped tokens to the ranks that hold their experts and back. Rotary embeddings take
the released checkpoints' YaRN scaling (``args.rope_scaling``, ``ray_titan.models.rope``), with
DeepSeek's correction of the softmax scale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ray_titan.models.decoder import (
    Decoder,
    FeedForward,
    MtpDecoder,
    MtpDepth,
    RMSNorm,
    apply_rope,
    scaled_dot_product_attention,
)
from ray_titan.models.deepseek_v2.args import DeepSeekV2Args
from ray_titan.models.rope import softmax_scale_factor
from ray_titan.models.routing import ROUTERS, SELECTS_WITH_BIAS, RoutingArgs, check_routing

__all__ = [
    "EXPERT_ACTIVATIONS", "MLA", "DeepSeekV2", "GroupedExperts", "MoE", "MoEArgs", "MtpBlock", "MtpDepth", "Router",
    "activated_parameters", "clamped_swiglu", "route_tokens", "swiglu",
]


class MoEArgs(RoutingArgs, Protocol):
    """The model arguments :class:`Router` and :class:`MoE` read: the routing settings
    (:class:`~ray_titan.models.routing.RoutingArgs`) and these. :class:`DeepSeekV2Args` has them;
    so does Qwen3-MoE's ``Qwen3MoeArgs`` (``ray_titan.models.qwen3_moe``), which reuses this MoE."""

    @property
    def dim(self) -> int: ...
    @property
    def moe_inter_dim(self) -> int: ...  # each routed expert's SwiGLU hidden size
    @property
    def n_shared_experts(self) -> int: ...  # 0: none (Qwen3-MoE)
    @property
    def load_balance(self) -> Literal["aux_loss", "aux_free", "none"]: ...
    @property
    def aux_loss_coeff(self) -> float: ...
    @property
    def bias_update_rate(self) -> float: ...

ExpertRunner = Callable[[torch.Tensor, torch.Tensor, nn.Module], torch.Tensor]
SequenceSum = Callable[[torch.Tensor], tuple[torch.Tensor, int]]
"""Sums a tensor over the ranks holding the other parts of the same sequences, and says how many
they are (context parallelism; :func:`sequence_balance_loss`)."""
"""``(x_sorted (tokens, dim), counts (n_experts,) int64, experts) -> (tokens, dim)``: runs the
routed experts on tokens grouped by expert, wherever those experts live."""


class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 §2.1), causal, via ``scaled_dot_product_attention``.

    Input and output ``(batch, seq, dim)``. The latent ``c_KV`` is what an inference KV cache
    would hold; training reconstructs full keys and values from it. The latents' RMSNorms use
    eps 1e-6 whatever ``norm_eps`` is, as DeepSeek's reference code; under YaRN the softmax
    scale ``1/sqrt(qk_head_dim)`` is multiplied by ``mscale(factor, mscale_all_dim)²``.
    ``core_attention``: the attention kernel, ``F.scaled_dot_product_attention``'s signature (a
    hook: context parallelism gathers the reconstructed keys and values, ``Decoder.sequence_sharding``).
    """

    LATENT_NORM_EPS = 1e-6
    core_attention = staticmethod(scaled_dot_product_attention)

    def __init__(self, args: DeepSeekV2Args):
        super().__init__()
        self.n_heads = args.n_heads
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        q_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank > 0:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, self.LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, self.LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        factor = softmax_scale_factor(args.rope_scaling)
        # None: SDPA's own 1/sqrt(qk_head_dim), bitwise as without scaling.
        self.softmax_scale = None if factor == 1.0 else args.qk_head_dim**-0.5 * factor

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads: the projections may hold a subset of the heads (tensor parallel).
        q_nope, q_pe = q.view(bsz, seq, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin)  # one rotary key shared by all heads
        q_pe = apply_rope(q_pe, cos, sin)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.core_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class Router(nn.Module):
    """Top-k router with optional auxiliary-loss-free bias; the routing method is the function
    ``ROUTERS[args.topk_method]`` (``ray_titan.models.routing``: ``greedy``,
    ``group_limited_greedy``, ``noaux_tc``).

    ``forward(x (tokens, dim))`` returns ``(weights (tokens, k) fp32, indices (tokens, k) int64,
    scores (tokens, n_experts) fp32)``. Scores are ``score_func`` of the logits (softmax over all
    experts, or DeepSeek-V3's sigmoid); the weights are the selected experts' scores, renormalised
    and/or times ``route_scale`` as the method's reference does. Raises ``ValueError`` at
    construction for arguments the method cannot route
    (:func:`ray_titan.models.routing.check_routing`).

    ``bias``: a learned ``bias (n_experts,)`` parameter added to the logits (gpt-oss's router;
    None otherwise).

    Buffers: ``expert_bias (n_experts,)`` fp32, persistent (checkpointed; DeepSeek-V3's
    ``e_score_correction_bias``), added to the scores for selection only, under
    ``load_balance = "aux_free"`` (which moves it after every step) or a method that always
    selects with it (``noaux_tc``); ``tokens_per_expert (n_experts,)`` int64, the tokens routed to each
    expert since it was last zeroed (the train loop reads and zeroes it once per step).
    """

    # The buffers' types (registered in __init__; annotations only).
    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor

    def __init__(self, args: MoEArgs, bias: bool = False):
        super().__init__()
        check_routing(args)
        self.args = args
        self.route = ROUTERS[args.topk_method]
        self.top_k = args.n_activated_experts
        # use_bias: the bias is moved by aux-loss-free balancing (ray_titan.parallel.expert);
        # select_with_bias: it takes part in the selection (also a V3 checkpoint's fixed bias).
        self.use_bias = args.load_balance == "aux_free"
        self.select_with_bias = self.use_bias or args.topk_method in SELECTS_WITH_BIAS
        self.bias_update_rate = args.bias_update_rate
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        self.bias = nn.Parameter(torch.empty(args.n_routed_experts)) if bias else None
        self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts), persistent=True)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(args.n_routed_experts, dtype=torch.int64), persistent=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        weights, indices, scores = self.route(logits, self.expert_bias if self.select_with_bias else None, self.args)
        if not _recomputing():
            with torch.no_grad():
                self.tokens_per_expert += _count_per_expert(indices.flatten(), scores.shape[-1])
        return weights, indices, scores


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating (Shazeer 2020, arXiv:2002.05202): ``silu(gate) * up``."""
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's experts' gating (transformers' ``models/gpt_oss/modeling_gpt_oss.py``,
    ``GptOssExperts._apply_gate``; OpenAI's gpt-oss model card): ``gate`` clamped above at
    ``limit``, ``up`` to ``[-limit, limit]``, then ``(up + 1) · gate · sigmoid(alpha · gate)``
    (``alpha`` 1.702: the sigmoid approximation of GELU)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


EXPERT_ACTIVATIONS: dict[str, Callable[..., torch.Tensor]] = {"swiglu": swiglu, "clamped_swiglu": clamped_swiglu}
"""How an expert combines its gate ``w1 x`` and up ``w3 x`` projections (``(gate, up, **params) -> hidden``)."""


class GroupedExperts(nn.Module):
    """``n`` gated experts stored as stacked weights ``w1, w3 (n, hidden, dim)``, ``w2 (n, dim, hidden)``:
    ``w2 · act(w1 x, w3 x)``, ``act`` :func:`swiglu` unless ``activation`` names another of
    :data:`EXPERT_ACTIVATIONS` (``activation_params`` its keyword arguments). With ``bias``
    (gpt-oss) each projection adds its own bias, ``b1, b3 (n, hidden)``, ``b2 (n, dim)``.

    ``forward(x (tokens, dim), counts)`` takes tokens already grouped by expert, ``counts[e]``
    of them for local expert ``e`` (``(n_local,)`` int64 on ``x``'s device, or a host list of
    ints; summing to ``tokens``), and returns ``(tokens, dim)``. Under bf16 on a CUDA device of
    compute capability 9+ (Hopper) it runs :meth:`grouped` (``torch._grouped_mm``: one kernel per
    projection for all experts, forward and backward, no host sync); elsewhere (CPU, fp32) a
    loop over the experts, which needs the counts on the host.
    Under expert parallelism the weights and biases are ``DTensor``s sharded
    on dim 0 over the ``ep`` axis and this rank computes its local experts only.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int, bias: bool = False, activation: str = "swiglu",
                 activation_params: dict[str, float] | None = None):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        if bias:
            self.b1 = nn.Parameter(torch.empty(n_experts, hidden))
            self.b2 = nn.Parameter(torch.empty(n_experts, dim))
            self.b3 = nn.Parameter(torch.empty(n_experts, hidden))
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation {activation!r} is unknown; valid: {sorted(EXPERT_ACTIVATIONS)}")
        self.has_bias = bias
        self.act = functools.partial(EXPERT_ACTIVATIONS[activation], **(activation_params or {}))

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        # Under expert parallelism the weights are DTensors: compute with this rank's experts.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        b1, b2, b3 = ((b.to_local() if isinstance(b, DTensor) else b for b in (self.b1, self.b2, self.b3))
                      if self.has_bias else (None, None, None))
        if _use_grouped_mm(x, w1):
            # The counts stay on the device (a host list is copied there, without a sync).
            sizes = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=x.device)
            return self.grouped(x, sizes.to(x.device), (w1, w2, w3), (b1, b2, b3))
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()  # the loop splits on the host: one sync where the experts are local
        # Every local expert appears in the graph, even with no tokens, so every weight gets a
        # (possibly zero) gradient and the optimizer treats all experts alike on every mesh.
        if b1 is None or b2 is None or b3 is None:
            outs = [self.act(xe @ w1[e].T, xe @ w3[e].T) @ w2[e].T for e, xe in enumerate(torch.split(x, counts))]
        else:
            outs = [self.act(xe @ w1[e].T + b1[e], xe @ w3[e].T + b3[e]) @ w2[e].T + b2[e]
                    for e, xe in enumerate(torch.split(x, counts))]
        return torch.cat(outs)

    def grouped(self, x: torch.Tensor, counts: torch.Tensor, weights: tuple[torch.Tensor, ...],
                biases: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """The experts by ``torch._grouped_mm`` (``x (tokens, dim)`` grouped by expert, ``counts
        (n_local,)`` int64 on ``x``'s device; ``weights`` this rank's ``w1, w2, w3``, ``biases``
        ``b1, b2, b3`` or Nones): group ``e`` is rows ``offs[e-1]:offs[e]`` of ``x`` times
        ``w[e].T``. Same result as the loop of :meth:`forward` up to summation order."""
        w1, w2, w3 = weights
        b1, b2, b3 = biases
        offs = counts.cumsum(0).to(torch.int32)
        gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        if b1 is None or b2 is None or b3 is None:
            return torch._grouped_mm(self.act(gate, up), w2.transpose(-2, -1), offs=offs)
        # Each row's expert: the bias rows to add (the counts sum to the rows: no sync to size it).
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts,
                                         output_size=x.shape[0])
        h = self.act(gate + b1[expert], up + b3[expert])
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs) + b2[expert]


def _recomputing() -> bool:
    """Whether this forward runs inside backward: activation checkpointing recomputing a block.
    Its routing statistics were already counted by the original forward. Under ``torch.compile``
    the forward is traced once and its recomputation is told to skip side effects
    (``ray_titan.parallel.compile``), so the traced forward is never a recomputation."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def _count_per_expert(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens routed to each expert: ``(n_experts,)`` int64 from ``indices`` in ``[0, n_experts)``.
    ``bincount`` without its data-dependent output size, which ``torch.compile`` cannot trace."""
    counts = torch.zeros(n_experts, dtype=torch.int64, device=indices.device)
    return counts.index_add_(0, indices, torch.ones_like(indices))


def _use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch._grouped_mm's CUDA kernels are for Hopper+ GPUs in bf16. It also runs on CPU (torch
    # 2.13; its backward refuses a stride-0 output gradient, e.g. of a .sum()), where the loop
    # stays: the CPU parity tests are bitwise against it (tests/unit/test_moe.py compares them).
    return (
        x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


class _AddAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also sends gradient 1 into ``aux_loss``: the balance
    loss joins the training objective without changing any stage's output, so it works the same
    under pipeline parallelism, where only the last stage computes the loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        # ``x`` returned as is would come out as a view of it (autograd's rule for a Function
        # returning an input), which FSDP2 warns about when it is a wrapped module's output
        # (Qwen3-MoE's model); detach() shares the storage and the version counter, no copy.
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, device=grad.device, dtype=torch.float32)


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, n_experts: int, top_k: int,
                          sequence_sum: SequenceSum | None = None) -> torch.Tensor:
    """Sequence-wise balance loss ``mean_seq Σ_i f_i P_i`` (DeepSeek-V3 eq. 17–20, the
    expert-level loss of DeepSeek-V2 eq. 12–14 applied to each sequence).

    ``scores (batch, seq, n_experts)`` router probabilities, ``indices (batch, seq, top_k)``.
    ``f_i = n_experts / (top_k · seq) · #tokens of the sequence routed to i`` (no gradient),
    ``P_i = mean over the sequence of s_i``. Equals 1 under perfectly uniform routing. 0-dim fp32.

    ``sequence_sum`` (context parallel: this rank holds ``1/n`` of each sequence): sums a
    ``(batch, n_experts)`` tensor over the ranks holding the other parts of the sequences and
    returns it with ``n``; ``f_i`` is then that of the whole sequence and ``P_i`` the mean over
    this rank's part, so the mean of the ranks' losses (as FSDP averages their gradients) is
    the whole sequence's loss.
    """
    seq = scores.shape[1]
    counts = torch.zeros(scores.shape[0], n_experts, device=scores.device)
    counts.scatter_add_(1, indices.flatten(1), torch.ones_like(indices.flatten(1), dtype=counts.dtype))
    if sequence_sum is not None:
        counts, parts = sequence_sum(counts)
        seq *= parts
    f = counts * (n_experts / (top_k * seq))
    p = scores.mean(dim=1)
    return (f * p).sum(dim=1).mean()


def route_tokens(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: nn.Module,
    n_experts: int,
    run_experts: ExpertRunner | None = None,
) -> torch.Tensor:
    """Route ``x (tokens, dim)`` to experts and back: ``Σ_k weights[t, k] · expert_{indices[t, k]}(x_t)``.

    ``weights (tokens, top_k)`` fp32, ``indices (tokens, top_k)`` int64 in ``[0, n_experts)``.
    Tokens are sorted by chosen expert (``top_k`` copies per token), run through the experts
    (``experts(x_grouped, counts)``, :class:`GroupedExperts`, or ``run_experts`` when expert
    parallelism places them on other ranks), weighted by the router and summed per token.
    Returns ``(tokens, dim)`` in ``x``'s dtype.
    """
    top_k = indices.shape[1]
    flat = indices.flatten()
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    counts = _count_per_expert(flat, n_experts)
    x_sorted = x[token_of]
    if run_experts is None:
        y_sorted = experts(x_sorted, counts)  # on the device: GroupedExperts reads them on the host only to loop
    else:
        y_sorted = run_experts(x_sorted, counts, experts)
    w = weights.flatten()[order].unsqueeze(-1)
    contrib = (y_sorted.float() * w).to(x.dtype)
    return x.new_zeros(x.shape).index_add(0, token_of, contrib)


class MoE(nn.Module):
    """Routed plus shared experts. Input and output ``(batch, seq, dim)``. The keyword arguments
    are gpt-oss's variations (``ray_titan.models.gpt_oss``): a learned router bias
    (:class:`Router`), expert biases and another expert activation (:class:`GroupedExperts`); and
    Qwen3.5's (``ray_titan.models.qwen3_5_moe``): one shared expert of its own width whose output
    a per-token sigmoid gate scales.

    ``run_experts`` (set by ``ray_titan.parallel.expert``) runs the routed experts on other
    ranks; by default all experts are local (:func:`route_tokens`).
    """

    aux_loss_sum: torch.Tensor  # the buffer registered in __init__ (annotation only)

    def __init__(self, args: MoEArgs, *, router_bias: bool = False, expert_bias: bool = False,
                 expert_activation: str = "swiglu", activation_params: dict[str, float] | None = None,
                 shared_hidden: int | None = None, shared_gate: bool = False):
        super().__init__()
        self.n_experts, self.top_k = args.n_routed_experts, args.n_activated_experts
        self.aux_coeff = args.aux_loss_coeff if args.load_balance == "aux_loss" else 0.0
        self.router = Router(args, bias=router_bias)
        self.experts = GroupedExperts(args.n_routed_experts, args.dim, args.moe_inter_dim, expert_bias,
                                      expert_activation, activation_params)
        # ``shared_hidden``: the shared expert's own width (Qwen3-Next / Qwen3.5); by default
        # DeepSeek's n_shared_experts of the routed experts' width, fused into one SwiGLU.
        hidden = args.n_shared_experts * args.moe_inter_dim if shared_hidden is None else shared_hidden
        self.shared_experts = FeedForward(args.dim, hidden) if hidden else None
        # ``shared_gate`` (Qwen3-Next / Qwen3.5): the shared output scaled by sigmoid(w·x), per token.
        self.shared_gate = nn.Linear(args.dim, 1, bias=False) if shared_gate else None
        # Set by expert parallelism (ray_titan.parallel.expert); None: every expert is local.
        self.run_experts: ExpertRunner | None = None
        # Set by context parallelism (ray_titan.parallel.context): sums the balance loss's
        # routing counts over the ranks holding the rest of each sequence.
        self.sequence_sum: SequenceSum | None = None
        # Sum of the balance loss over this step's forwards (microbatches), for reporting;
        # a fixed buffer updated in place, read and zeroed once per step by the train loop.
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, indices, scores = self.router(flat)
        out = route_tokens(flat, weights, indices, self.experts, self.n_experts, self.run_experts)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        out = out.view(bsz, seq, dim)
        if self.aux_coeff > 0 and torch.is_grad_enabled():
            aux = self.balance_loss(scores.view(bsz, seq, -1), indices.view(bsz, seq, -1))
            if aux is not None:
                if not _recomputing():
                    with torch.no_grad():
                        self.aux_loss_sum += aux.detach()
                out = _AddAuxLoss.apply(out, aux)
        return out

    def balance_loss(self, scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
        """This forward's balance loss, ``aux_coeff`` included, that :meth:`forward` adds to the
        objective (:class:`_AddAuxLoss`) and to ``aux_loss_sum``: ``scores (batch, seq, n_experts)``
        fp32, ``indices (batch, seq, top_k)``; 0-dim fp32. DeepSeek's: :func:`sequence_balance_loss`.
        A family whose loss spans layers overrides it to record what it needs and return None
        (Qwen3-MoE's, ``ray_titan.models.qwen3_moe.model``)."""
        return self.aux_coeff * sequence_balance_loss(scores, indices, self.n_experts, self.top_k, self.sequence_sum)


class MoEBlock(nn.Module):
    """Pre-norm block with MLA and either a dense SwiGLU (``feed_forward``) or :class:`MoE` (``moe``)."""

    def __init__(self, args: DeepSeekV2Args, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = MLA(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if layer_id < args.n_dense_layers:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)
        else:
            self.moe = MoE(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class MtpBlock(MtpDepth, MoEBlock):
    """One depth of DeepSeek-V3's multi-token prediction
    (:class:`~ray_titan.models.decoder.MtpDepth`; the checkpoints' ``model.layers.<n_layers +
    k>``) around DeepSeek's MoE block: MLA and an MoE feed-forward (a layer past
    ``n_dense_layers``, so MoE whatever ``n_dense_layers``)."""


class DeepSeekV2(MtpDecoder):
    """DeepSeek-V2-style MoE decoder (module docstring); input/output as :class:`Decoder`, and
    with ``args.n_mtp_layers = D > 0`` DeepSeek-V3's multi-token prediction
    (:class:`~ray_titan.models.decoder.MtpDecoder`), its depths :class:`MtpBlock`."""

    RESIDUAL_OUTPUTS = ("wo.weight", "w2.weight", "experts.w2")

    def make_layer(self, layer_id: int) -> nn.Module:
        return MoEBlock(self.args, layer_id)

    def make_mtp_layer(self, layer_id: int) -> nn.Module:
        """The multi-token-prediction depth keyed ``layer_id`` (``n_layers + k``): an
        :class:`MtpDepth` around the family's block (DeepSeek's: :class:`MtpBlock`)."""
        return MtpBlock(self.args, layer_id)

    @property
    def rope_dim(self) -> int:
        return self.args.qk_rope_head_dim

    def moe_modules(self) -> dict[int, MoE]:
        """This module's MoE feed-forwards by layer index (only the layers it holds)."""
        return {int(i): cast(MoE, b.moe) for i, b in self.layers.items() if hasattr(b, "moe")}

    @torch.no_grad()
    def init_buffers(self) -> None:
        super().init_buffers()
        for moe in self.moe_modules().values():
            moe.router.expert_bias.zero_()
            moe.router.tokens_per_expert.zero_()
            moe.aux_loss_sum.zero_()


def activated_parameters(model: Decoder) -> int:
    """Parameters that take part in computing one token: all except the input embedding table (a
    lookup) and the routed experts not chosen (only ``n_activated / n_routed`` of them count).
    Works on the meta device. The model card's "activated parameters" count the same way. Any
    decoder whose MoE layers are this module's :class:`MoE` (``args.n_activated_experts``,
    ``args.n_routed_experts``; Qwen3-MoE's too)."""
    a = model.args
    total = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("tok_embeddings"))
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total - routed + routed * a.n_activated_experts // a.n_routed_experts

"""Mixture-of-experts routing: one table of small functions, :data:`ROUTERS`, each with its source.

The MoE layer is one implementation; what differs between families is how a token's router
logits become the experts it is sent to and their weights. Each method is a function
``(logits (tokens, n_experts) fp32, expert_bias (n_experts,) or None, args) -> Routing`` and one
entry of :data:`ROUTERS` under the name a ``config.json`` gives it (DeepSeek's ``topk_method``),
the way transformers' ``modeling_rope_utils.py`` keeps ``ROPE_INIT_FUNCTIONS``. A new router is
a function and a table entry; the model's ``Router`` calls the entry its arguments name, and the
configuration checks list the table's keys as the valid values.

``expert_bias``: auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2) adds it to the scores for
the *selection* only (groups included); the weights are always the unbiased scores. In a
DeepSeek-V3 checkpoint it is ``e_score_correction_bias``, and ``noaux_tc`` always selects with it.

Scores: ``score_func`` turns the logits into per-expert scores: ``softmax`` over the experts
(DeepSeek-V2, Qwen3-MoE) or an independent ``sigmoid`` per expert (DeepSeek-V3, Kimi K2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

__all__ = ["GROUPED", "ROUTERS", "SCORE_FUNCS", "SELECTS_WITH_BIAS", "RouterFn", "Routing", "RoutingArgs",
           "check_routing", "greedy", "group_limited_greedy", "group_problem", "noaux_tc", "topk_softmax"]


class RoutingArgs(Protocol):
    """The model arguments a routing function reads (DeepSeek's ``MoEGate`` settings)."""

    @property
    def n_routed_experts(self) -> int: ...
    @property
    def n_activated_experts(self) -> int: ...  # top-k: experts per token
    @property
    def n_group(self) -> int: ...  # expert groups (group-limited routing; 1 otherwise)
    @property
    def topk_group(self) -> int: ...  # groups a token may use
    @property
    def norm_topk_prob(self) -> bool: ...
    @property
    def route_scale(self) -> float: ...  # routed_scaling_factor
    @property
    def topk_method(self) -> str: ...  # the key of ROUTERS
    @property
    def score_func(self) -> str: ...  # the key of SCORE_FUNCS


class Routing(NamedTuple):
    """A router's decision for ``tokens`` tokens."""

    weights: torch.Tensor
    """(tokens, k) fp32: what each chosen expert's output is multiplied by."""
    indices: torch.Tensor
    """(tokens, k) int64 in ``[0, n_experts)``: the chosen experts."""
    scores: torch.Tensor
    """(tokens, n_experts) fp32: every expert's probability (what balance losses average)."""


RouterFn = Callable[[torch.Tensor, "torch.Tensor | None", RoutingArgs], Routing]

SCORE_FUNCS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}
"""``score_func`` (``config.json`` ``scoring_func``) -> logits (tokens, n_experts) fp32 to scores."""


def _scores(logits: torch.Tensor, args: RoutingArgs) -> torch.Tensor:
    return SCORE_FUNCS[args.score_func](logits)


def _deepseek_weights(scores: torch.Tensor, indices: torch.Tensor, args: RoutingArgs) -> torch.Tensor:
    """DeepSeek's ``MoEGate`` weights (the model repositories' ``modeling_deepseek.py``): the
    chosen experts' scores, renormalised to sum to 1 when ``norm_topk_prob`` (and top-k > 1),
    otherwise times ``routed_scaling_factor``: never both. (transformers 5's
    ``DeepseekV2TopkRouter`` always scales; the released V2 configs have ``norm_topk_prob``
    false, where the two agree.)"""
    weights = scores.gather(-1, indices)
    if args.norm_topk_prob and indices.shape[-1] > 1:
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * args.route_scale if args.route_scale != 1.0 else weights


def greedy(logits: torch.Tensor, expert_bias: torch.Tensor | None, args: RoutingArgs) -> Routing:
    """Softmax over all experts, the top-k scores win (DeepSeek-V2-Lite's ``topk_method =
    "greedy"``; DeepSeekMoE, arXiv:2401.06066 §2; transformers'
    ``models/deepseek_v2/modeling_deepseek_v2.py``, ``DeepseekV2TopkRouter.forward``; with
    ``norm_topk_prob``, Qwen3-MoE's router, ``models/qwen3_moe/modeling_qwen3_moe.py``)."""
    scores = _scores(logits, args)
    select = scores if expert_bias is None else scores + expert_bias
    indices = select.topk(args.n_activated_experts, dim=-1).indices
    return Routing(_deepseek_weights(scores, indices, args), indices, scores)


def group_limited_greedy(logits: torch.Tensor, expert_bias: torch.Tensor | None, args: RoutingArgs) -> Routing:
    """Device-limited routing (DeepSeek-V2, arXiv:2405.04434 §2.2.2; V2's ``topk_method =
    "group_limited_greedy"``; transformers' ``models/deepseek_v2/modeling_deepseek_v2.py``,
    ``DeepseekV2TopkRouter.forward``): the ``n_routed_experts`` experts form ``n_group`` equal
    groups (V2: one per device group); a group's score is its best expert's softmax score; each
    token keeps its ``topk_group`` best groups and takes the top-k experts among those only."""
    scores = _scores(logits, args)
    select = scores if expert_bias is None else scores + expert_bias
    indices = _top_k_in_best_groups(select, select.view(len(select), args.n_group, -1).amax(dim=-1), args)
    return Routing(_deepseek_weights(scores, indices, args), indices, scores)


def _top_k_in_best_groups(select: torch.Tensor, group_scores: torch.Tensor, args: RoutingArgs) -> torch.Tensor:
    """The top-k experts of ``select (tokens, n)`` within each token's ``topk_group`` best groups
    by ``group_scores (tokens, n_group)``: ``(tokens, k)`` int64."""
    tokens, n = select.shape
    best_groups = group_scores.topk(args.topk_group, dim=-1).indices
    keep = torch.zeros(tokens, args.n_group, dtype=torch.bool, device=select.device)
    keep.scatter_(1, best_groups, True)
    # The V2 reference fills the dropped groups' (positive) scores with 0; -inf (as V3's and
    # transformers 5's) gives the same choice and stays right when a negative bias is added.
    masked = select.view(tokens, args.n_group, n // args.n_group).masked_fill(~keep.unsqueeze(-1), float("-inf"))
    return masked.view(tokens, n).topk(args.n_activated_experts, dim=-1).indices


def noaux_tc(logits: torch.Tensor, expert_bias: torch.Tensor | None, args: RoutingArgs) -> Routing:
    """DeepSeek-V3's router (arXiv:2412.19437 §2.1.2, eq. 12–16; ``topk_method = "noaux_tc"``;
    transformers' ``models/deepseek_v3/modeling_deepseek_v3.py``, ``DeepseekV3TopkRouter.forward``;
    Kimi K2 uses it with one group). Scores are ``score_func`` of the logits (sigmoid in V3); the
    selection adds ``expert_bias`` (``e_score_correction_bias``); a group's score is the sum of
    its two best biased scores; a token keeps its ``topk_group`` best of ``n_group`` groups and
    takes the top-k biased scores there. The weights are the chosen experts' *unbiased* scores,
    renormalised to sum to 1 when ``norm_topk_prob``, and then always times
    ``routed_scaling_factor`` (V3 does both, V2 one or the other: :func:`_deepseek_weights`).
    Where a token keeps every group (``topk_group >= n_group``: one group, as Kimi K2 and the
    16B flavor), the groups are not ranked: the same choice, without the group scores' top-k
    that autograd would keep for backward (36 bytes a token and MoE layer)."""
    scores = _scores(logits, args)
    select = scores if expert_bias is None else scores + expert_bias
    tokens, n = select.shape
    if args.topk_group >= args.n_group:
        indices = select.topk(args.n_activated_experts, dim=-1).indices
    else:
        per_group = n // args.n_group
        group_scores = select.view(tokens, args.n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        indices = _top_k_in_best_groups(select, group_scores, args)
    weights = scores.gather(-1, indices)
    if args.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(weights * args.route_scale, indices, scores)


def topk_softmax(logits: torch.Tensor, expert_bias: torch.Tensor | None, args: RoutingArgs) -> Routing:
    """gpt-oss's router (transformers' ``models/gpt_oss/modeling_gpt_oss.py``,
    ``GptOssTopKRouter.forward``; OpenAI's gpt-oss model card, 2025): the top-k experts by raw
    logit (the router's linear layer has a bias), weighted by a softmax over those k logits only
    (so the weights sum to 1). ``scores``: the softmax over all experts, what transformers'
    balance loss (``load_balancing_loss_func``) averages; ``norm_topk_prob`` and
    ``route_scale`` are not read. ``expert_bias`` (auxiliary-loss-free balancing) is added to
    the logits for the selection only."""
    select = logits if expert_bias is None else logits + expert_bias
    indices = select.topk(args.n_activated_experts, dim=-1).indices
    weights = logits.gather(-1, indices).softmax(dim=-1)
    return Routing(weights, indices, logits.softmax(dim=-1))


ROUTERS: dict[str, RouterFn] = {
    "greedy": greedy,
    "group_limited_greedy": group_limited_greedy,
    "noaux_tc": noaux_tc,
    "topk_softmax": topk_softmax,
}
"""Routing method (``config.json`` ``topk_method``) -> its function."""

GROUPED = frozenset({"group_limited_greedy", "noaux_tc"})
"""The methods that read ``n_group`` and ``topk_group``."""

SELECTS_WITH_BIAS = frozenset({"noaux_tc"})
"""The methods whose selection always adds ``expert_bias`` (the checkpoint's correction bias),
whether or not auxiliary-loss-free balancing moves it during training."""


def group_problem(n_experts: int, top_k: int, n_group: int, topk_group: int,
                  names: tuple[str, str, str, str]) -> str | None:
    """What is wrong with a group-limited routing's sizes, or None. ``names``: how the four
    values are called where they were set (``config.json``'s ``n_routed_experts``,
    ``num_experts_per_tok``, ``n_group``, ``topk_group``, or the model arguments'), for the
    message: the groups must split the experts evenly, a token may keep at most all groups, and
    the kept groups must hold at least top-k experts."""
    e, k, g, tg = names
    if n_group < 1 or n_experts % n_group:
        return f"{e} = {n_experts} is not divisible by {g} = {n_group}; valid: a {g} dividing {n_experts}"
    if not 1 <= topk_group <= n_group:
        return f"{tg} = {topk_group} is not within 1 and {g} = {n_group}; valid: 1 to {n_group}"
    if top_k > topk_group * (n_experts // n_group):
        per = n_experts // n_group
        return (f"{k} = {top_k} exceeds the {topk_group * per} experts of the {tg} = {topk_group} kept groups "
                f"({per} each); valid: at most {topk_group * per}")
    return None


def check_routing(args: RoutingArgs) -> None:
    """Raises ``ValueError`` naming the argument, its value and what is valid when ``args``
    cannot be routed: an unknown ``topk_method`` (valid: :data:`ROUTERS`' keys) or
    ``score_func`` (:data:`SCORE_FUNCS`' keys), a top-k above
    the experts, or group sizes :func:`group_problem` refuses."""
    if args.topk_method not in ROUTERS:
        raise ValueError(f"topk_method = {args.topk_method!r} is not supported; valid: {sorted(ROUTERS)}")
    if args.score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func = {args.score_func!r} is not supported; valid: {sorted(SCORE_FUNCS)}")
    if not 1 <= args.n_activated_experts <= args.n_routed_experts:
        raise ValueError(f"n_activated_experts = {args.n_activated_experts} is not within 1 and "
                         f"n_routed_experts = {args.n_routed_experts}; valid: 1 to {args.n_routed_experts}")
    if args.topk_method in GROUPED:
        problem = group_problem(args.n_routed_experts, args.n_activated_experts, args.n_group, args.topk_group,
                                ("n_routed_experts", "n_activated_experts", "n_group", "topk_group"))
        if problem:
            raise ValueError(problem)

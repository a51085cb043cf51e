"""Mixture-of-experts routing: one table of small functions, :data:`ROUTERS`, each with its source.

The MoE layer is one implementation; what differs between families is how a token's router
logits become the experts it is sent to and their weights. Each method is a function
``(logits (tokens, n_experts) fp32, expert_bias (n_experts,) or None, args) -> Routing`` and one
entry of :data:`ROUTERS` under the name a ``config.json`` gives it (DeepSeek's ``topk_method``),
the way transformers' ``modeling_rope_utils.py`` keeps ``ROPE_INIT_FUNCTIONS``. A new router is
a function and a table entry; the model's ``Router`` calls the entry its arguments name, and the
configuration checks list the table's keys as the valid values.

``expert_bias``: auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2) adds it to the scores for
the *selection* only (groups included); the weights are always the unbiased scores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

__all__ = ["GROUPED", "ROUTERS", "RouterFn", "Routing", "RoutingArgs", "check_routing", "greedy",
           "group_limited_greedy", "group_problem"]


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


class Routing(NamedTuple):
    """A router's decision for ``tokens`` tokens."""

    weights: torch.Tensor
    """(tokens, k) fp32: what each chosen expert's output is multiplied by."""
    indices: torch.Tensor
    """(tokens, k) int64 in ``[0, n_experts)``: the chosen experts."""
    scores: torch.Tensor
    """(tokens, n_experts) fp32: every expert's probability (what balance losses average)."""


RouterFn = Callable[[torch.Tensor, "torch.Tensor | None", RoutingArgs], Routing]


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
    ``models/deepseek_v2/modeling_deepseek_v2.py``, ``DeepseekV2TopkRouter.forward``)."""
    scores = logits.softmax(dim=-1)
    select = scores if expert_bias is None else scores + expert_bias
    indices = select.topk(args.n_activated_experts, dim=-1).indices
    return Routing(_deepseek_weights(scores, indices, args), indices, scores)


def group_limited_greedy(logits: torch.Tensor, expert_bias: torch.Tensor | None, args: RoutingArgs) -> Routing:
    """Device-limited routing (DeepSeek-V2, arXiv:2405.04434 §2.2.2; V2's ``topk_method =
    "group_limited_greedy"``; transformers' ``models/deepseek_v2/modeling_deepseek_v2.py``,
    ``DeepseekV2TopkRouter.forward``): the ``n_routed_experts`` experts form ``n_group`` equal
    groups (V2: one per device group); a group's score is its best expert's softmax score; each
    token keeps its ``topk_group`` best groups and takes the top-k experts among those only."""
    scores = logits.softmax(dim=-1)
    select = scores if expert_bias is None else scores + expert_bias
    tokens, n = select.shape
    grouped = select.view(tokens, args.n_group, n // args.n_group)
    best_groups = grouped.amax(dim=-1).topk(args.topk_group, dim=-1).indices
    keep = torch.zeros(tokens, args.n_group, dtype=torch.bool, device=select.device)
    keep.scatter_(1, best_groups, True)
    # The reference fills the dropped groups' (positive) scores with 0; -inf gives the same
    # choice and stays right when a (negative) balancing bias is added.
    select = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, n)
    indices = select.topk(args.n_activated_experts, dim=-1).indices
    return Routing(_deepseek_weights(scores, indices, args), indices, scores)


ROUTERS: dict[str, RouterFn] = {
    "greedy": greedy,
    "group_limited_greedy": group_limited_greedy,
}
"""Routing method (``config.json`` ``topk_method``) -> its function."""

GROUPED = frozenset({"group_limited_greedy"})
"""The methods that read ``n_group`` and ``topk_group``."""


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
    cannot be routed: an unknown ``topk_method`` (valid: :data:`ROUTERS`' keys), a top-k above
    the experts, or group sizes :func:`group_problem` refuses."""
    if args.topk_method not in ROUTERS:
        raise ValueError(f"topk_method = {args.topk_method!r} is not supported; valid: {sorted(ROUTERS)}")
    if not 1 <= args.n_activated_experts <= args.n_routed_experts:
        raise ValueError(f"n_activated_experts = {args.n_activated_experts} is not within 1 and "
                         f"n_routed_experts = {args.n_routed_experts}; valid: 1 to {args.n_routed_experts}")
    if args.topk_method in GROUPED:
        problem = group_problem(args.n_routed_experts, args.n_activated_experts, args.n_group, args.topk_group,
                                ("n_routed_experts", "n_activated_experts", "n_group", "topk_group"))
        if problem:
            raise ValueError(problem)

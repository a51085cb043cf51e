"""The GLM-4.5 family's Hugging Face mapping (``model_type = "glm4_moe"``, ``Glm4MoeForCausalLM``;
GLM-4.5, GLM-4.5-Air, GLM-4.6 and GLM-4.7 checkpoints).

Names: the Llama mapping (``ray_titan.models.llama.state_dict_adapter``: embeddings, norms,
attention with the per-head rotary row permutation of q/k, here of the rotated part only, and of
their biases and per-head norms) for every layer, dense layers' ``mlp.{gate,up,down}_proj`` ↔
``feed_forward.w{1,3,2}``; MoE layers in DeepSeek-V3's names
(``ray_titan.models.deepseek_v2.state_dict_adapter.moe_sources``): ``mlp.gate`` ↔ ``moe.router``,
``mlp.gate.e_score_correction_bias`` (required) ↔ ``moe.router.expert_bias``,
``mlp.experts.E.*`` ↔ row ``E`` of the stacked experts, ``mlp.shared_experts.*``. The
multi-token-prediction depths (``num_nextn_predict_layers``; the model's ``n_mtp_layers``, built
as many as ``model.mtp_layers`` asks) are DeepSeek-V3's layout
(``ray_titan.models.deepseek_v3.state_dict_adapter.MtpAdapter``): ``model.layers.<num_hidden_layers
+ k>.*``, GLM's MoE block named as any other layer plus ``enorm`` / ``hnorm`` / ``eh_proj`` /
``shared_head.norm``; their ``embed_tokens`` / ``shared_head.head`` copies are ignored and not
exported.

``config.json``: ``partial_rotary_factor`` at the top level (the hub's files) or in
``rope_parameters`` (what transformers 5 writes), ``use_qk_norm``, ``attention_bias``,
``first_k_dense_replace``, ``n_routed_experts`` (``num_local_experts`` as transformers 5 may name
it), ``n_shared_experts``, ``num_experts_per_tok``, ``routed_scaling_factor``, ``norm_topk_prob``,
``n_group`` / ``topk_group``, ``num_nextn_predict_layers``. Plain rope only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray_titan.models.deepseek_v2.state_dict_adapter import moe_sources
from ray_titan.models.deepseek_v3.state_dict_adapter import MtpAdapter
from ray_titan.models.glm4_moe.args import Glm4MoeArgs
from ray_titan.models.llama.state_dict_adapter import LlamaAdapter
from ray_titan.models.routing import group_problem
from ray_titan.models.state_dict_adapter import (
    HFConfigError,
    Source,
    attention_heads,
    float_field,
    rope_from_hf,
    size_field,
)

__all__ = ["Glm4MoeAdapter", "partial_rotary_from_hf"]


def partial_rotary_from_hf(config: dict[str, Any], head_dim: int, default: float) -> tuple[float, int]:
    """``(partial_rotary_factor, rotated dimensions)`` of a ``config.json``: the factor at the top
    level (the hub's files) or in ``rope_parameters`` (what transformers 5 writes), ``default``
    when absent; the rotated dimensions are transformers' ``int(head_dim × factor)``. Raises
    :class:`HFConfigError` naming the field when they are not an even number of at least 2."""
    params = config.get("rope_parameters") or {}
    where = "rope_parameters." if isinstance(params, dict) and "partial_rotary_factor" in params else ""
    factor = float_field(params if where else config, "partial_rotary_factor", default, where=where)
    rotated = int(head_dim * factor)
    if rotated < 2 or rotated % 2:
        raise HFConfigError(f"config.json {where}partial_rotary_factor = {factor:g} rotates {rotated} of the "
                            f"head's {head_dim} dimensions; valid: a factor that rotates an even number >= 2")
    return factor, rotated


def _flag(config: dict[str, Any], name: str, default: bool) -> bool:
    value = config.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HFConfigError(f"config.json {name} = {value!r} is not valid; valid: true or false")
    return value


class Glm4MoeAdapter(MtpAdapter, LlamaAdapter):
    """GLM-4.5 / 4.5-Air / 4.6 / 4.7: Llama-style names for attention with q/k/v biases, partial
    rotary and optional q/k norms; DeepSeek-V3's names and router for the MoE layers and its
    layout of the multi-token-prediction depths."""

    model_type = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    # The MTP depths built are the job's choice (model.mtp_layers), not compared with config.json.
    training_fields = frozenset({"init_std", "load_balance", "aux_loss_coeff", "bias_update_rate", "n_mtp_layers"})

    def args_from_hf(self, config: dict[str, Any]) -> Glm4MoeArgs:  # type: ignore[override]
        def need(name: str, default: int | None = None) -> int:
            return size_field(config, name, default)

        if config.get("hidden_act", "silu") != "silu":
            raise HFConfigError(f"config.json hidden_act = {config['hidden_act']!r} is not supported; valid: 'silu'")
        dim, n_heads, n_kv_heads, head_dim = attention_heads(config)
        theta, _ = rope_from_hf(config, (), 10_000.0)  # plain rope only: any scaling is refused, naming it
        factor, _ = partial_rotary_from_hf(config, head_dim, 0.5)
        n_layers, n_dense = need("num_hidden_layers"), need("first_k_dense_replace", 1)
        if n_dense > n_layers:
            raise HFConfigError(f"config.json first_k_dense_replace = {n_dense} exceeds num_hidden_layers = "
                                f"{n_layers}; valid: 0 to {n_layers}")
        hub_name = config.get("n_routed_experts") is not None or "num_local_experts" not in config
        experts_field = "n_routed_experts" if hub_name else "num_local_experts"  # transformers 5's attribute_map
        n_experts, top_k = need(experts_field), need("num_experts_per_tok")
        n_group, topk_group = need("n_group", 1), need("topk_group", 1)
        if top_k > n_experts:
            raise HFConfigError(f"config.json num_experts_per_tok = {top_k} exceeds {experts_field} = {n_experts}; "
                                f"valid: 1 to {n_experts}")
        problem = group_problem(n_experts, top_k, n_group, topk_group,
                                (experts_field, "num_experts_per_tok", "n_group", "topk_group"))
        if problem:
            raise HFConfigError(f"config.json {problem}")
        return Glm4MoeArgs(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            vocab_size=need("vocab_size"), inter_dim=need("intermediate_size"),
            moe_inter_dim=need("moe_intermediate_size"), n_routed_experts=n_experts,
            n_shared_experts=need("n_shared_experts", 1), n_activated_experts=top_k, n_dense_layers=n_dense,
            route_scale=float_field(config, "routed_scaling_factor", 1.0),
            norm_topk_prob=_flag(config, "norm_topk_prob", True), n_group=n_group, topk_group=topk_group,
            qk_norm=_flag(config, "use_qk_norm", False), attention_bias=_flag(config, "attention_bias", False),
            partial_rotary_factor=factor, norm_eps=float_field(config, "rms_norm_eps", 1e-5), rope_theta=theta,
            max_seq_len=need("max_position_embeddings"), n_mtp_layers=need("num_nextn_predict_layers", 0),
            tie_word_embeddings=_flag(config, "tie_word_embeddings", False),
        )

    def hf_config(self, args: Glm4MoeArgs) -> dict[str, Any]:  # type: ignore[override]
        return {
            **super().hf_config(args.attention_args()),
            "attention_bias": args.attention_bias, "use_qk_norm": args.qk_norm,
            "partial_rotary_factor": args.partial_rotary_factor, "first_k_dense_replace": args.n_dense_layers,
            "moe_intermediate_size": args.moe_inter_dim, "n_routed_experts": args.n_routed_experts,
            "n_shared_experts": args.n_shared_experts, "num_experts_per_tok": args.n_activated_experts,
            "routed_scaling_factor": args.route_scale, "norm_topk_prob": args.norm_topk_prob,
            "n_group": args.n_group, "topk_group": args.topk_group,
            "num_nextn_predict_layers": args.n_mtp_layers,
        }

    def sources(self, args: Glm4MoeArgs) -> dict[str, Source]:  # type: ignore[override]
        # The MTP depths' blocks are named as layers n_layers .. n_layers + n_mtp_layers - 1, all MoE.
        n_all = args.n_layers + args.n_mtp_layers
        out = super().sources(dataclasses.replace(args.attention_args(), n_layers=n_all))
        for i in [*args.moe_layers, *range(args.n_layers, n_all)]:
            hf, rt = f"model.layers.{i}.", f"layers.{i}."
            for a in ("w1", "w2", "w3"):
                del out[f"{rt}feed_forward.{a}.weight"]
            out |= moe_sources(args, hf, rt, Source((hf + "mlp.gate.e_score_correction_bias",)))
        return out | self.mtp_sources(args)

"""The MiniMax-M2 family's Hugging Face mapping (``model_type = "minimax_m2"``, ``MiniMaxM2ForCausalLM``).

Names: the Llama mapping (``ray_titan.models.llama.state_dict_adapter``: embeddings, norms,
attention with the rotary row permutation of q/k on the rotated part of each head, the q/k norms'
weights, which span all heads, permuted as the projections' rows) for every layer; the MoE layer
in Mixtral's names, as the released files and transformers 5's ``save_pretrained`` hold them:
``block_sparse_moe.gate`` ↔ ``moe.router``, ``block_sparse_moe.e_score_correction_bias``
(required) ↔ ``moe.router.expert_bias``, ``block_sparse_moe.experts.E.w{1,2,3}`` (one tensor per
expert) ↔ row ``E`` of ``moe.experts.w{1,2,3}``
(``ray_titan.models.deepseek_v2.state_dict_adapter.moe_sources``).

``config.json``: ``intermediate_size`` is each expert's; ``num_local_experts``,
``num_experts_per_tok``, ``rotary_dim`` (or ``partial_rotary_factor`` in ``rope_parameters``), and
the fields that must have MiniMax-M2's values: ``scoring_func`` sigmoid, ``qk_norm_type``
``per_layer``, ``use_qk_norm`` true, ``shared_intermediate_size`` 0, ``attn_type_list`` all full
attention (1). Plain rope only.
"""

from __future__ import annotations

from typing import Any

from ray_titan.models.deepseek_v2.state_dict_adapter import moe_sources
from ray_titan.models.glm4_moe.state_dict_adapter import partial_rotary_from_hf
from ray_titan.models.llama.state_dict_adapter import LlamaAdapter
from ray_titan.models.minimax_m2.args import MiniMaxM2Args
from ray_titan.models.state_dict_adapter import (
    HFConfigError,
    Source,
    attention_heads,
    float_field,
    rope_from_hf,
    size_field,
)

__all__ = ["MiniMaxM2Adapter"]

# config.json fields whose other values MiniMax-M2's architecture (and transformers' reference) does not have.
_FIXED = (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("qk_norm_type", "per_layer"), ("use_qk_norm", True),
          ("shared_intermediate_size", 0), ("attention_bias", False))


class MiniMaxM2Adapter(LlamaAdapter):
    """MiniMax-M2: Llama-style names for attention with q/k norms over all heads and partial rotary;
    Mixtral's names for the MoE layer, DeepSeek-V3's sigmoid router with its correction bias."""

    model_type = "minimax_m2"
    architectures = ("MiniMaxM2ForCausalLM",)
    training_fields = frozenset({"init_std", "load_balance", "aux_loss_coeff", "bias_update_rate"})

    def args_from_hf(self, config: dict[str, Any]) -> MiniMaxM2Args:  # type: ignore[override]
        for name, valid in _FIXED:
            if config.get(name, valid) != valid:
                raise HFConfigError(f"config.json {name} = {config[name]!r} is not supported; valid: {valid!r}")
        kinds = config.get("attn_type_list") or []
        if not isinstance(kinds, list) or any(k != 1 for k in kinds):
            raise HFConfigError(f"config.json attn_type_list = {kinds!r} is not supported; valid: every layer 1 "
                                "(full attention)")
        dim, n_heads, n_kv_heads, head_dim = attention_heads(config)
        theta, _ = rope_from_hf(config, (), 10_000.0)  # plain rope only: any scaling is refused, naming it
        rotated = size_field(config, "rotary_dim", 0) or partial_rotary_from_hf(config, head_dim, 1.0)[1]
        if rotated > head_dim or rotated % 2:
            raise HFConfigError(f"config.json rotary_dim = {rotated} is not valid; valid: an even number up to "
                                f"head_dim = {head_dim}")
        n_experts, top_k = size_field(config, "num_local_experts"), size_field(config, "num_experts_per_tok")
        if top_k > n_experts:
            raise HFConfigError(f"config.json num_experts_per_tok = {top_k} exceeds num_local_experts = {n_experts}; "
                                f"valid: 1 to {n_experts}")
        return MiniMaxM2Args(
            dim=dim, n_layers=size_field(config, "num_hidden_layers"), n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, vocab_size=size_field(config, "vocab_size"),
            moe_inter_dim=size_field(config, "intermediate_size"), n_routed_experts=n_experts,
            n_activated_experts=top_k, rotary_dim=rotated, norm_eps=float_field(config, "rms_norm_eps", 1e-6),
            rope_theta=theta, max_seq_len=size_field(config, "max_position_embeddings"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def hf_config(self, args: MiniMaxM2Args) -> dict[str, Any]:  # type: ignore[override]
        base = super().hf_config(args.attention_args())
        return {
            **{k: v for k, v in base.items() if k != "mlp_bias"},
            "num_local_experts": args.n_routed_experts, "num_experts_per_tok": args.n_activated_experts,
            "rotary_dim": args.rotary_dim, "scoring_func": "sigmoid", "use_qk_norm": True,
            "qk_norm_type": "per_layer", "shared_intermediate_size": 0, "router_aux_loss_coef": args.aux_loss_coeff,
        }

    def sources(self, args: MiniMaxM2Args) -> dict[str, Source]:  # type: ignore[override]
        out = super().sources(args.attention_args())
        for i in args.moe_layers:
            hf, rt = f"model.layers.{i}.", f"layers.{i}."
            for a in ("w1", "w2", "w3"):
                del out[f"{rt}feed_forward.{a}.weight"]
            bias = Source((hf + "block_sparse_moe.e_score_correction_bias",))
            out |= moe_sources(args, hf, rt, bias, moe="block_sparse_moe.", ffn={"w1": "w1", "w3": "w3", "w2": "w2"})
        return out

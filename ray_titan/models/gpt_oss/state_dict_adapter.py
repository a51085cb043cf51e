"""The gpt-oss family's Hugging Face mapping (``model_type = "gpt_oss"``, ``GptOssForCausalLM``).

Names: ``model.embed_tokens`` / ``model.norm`` / ``lm_head`` and the layer norms as Llama's;
``self_attn.{q,k,v,o}_proj.{weight,bias}`` ↔ ``attention.w{q,k,v,o}.{weight,bias}`` (q/k rows,
biases included, permuted from ``rotate_half`` to Meta's interleaved pairs:
:func:`~ray_titan.models.state_dict_adapter.rotary_rows`), ``self_attn.sinks`` ↔
``attention.sinks``, ``mlp.router.{weight,bias}`` ↔ ``moe.router.{weight,bias}``. The experts
are fused in the files: ``mlp.experts.gate_up_proj (experts, dim, 2·hidden)`` whose even columns
are the gate and odd ones the up projection ↔ ``moe.experts.w1`` / ``w3`` (``Source.cols``
``(0, 2)`` / ``(1, 2)``, transposed), ``gate_up_proj_bias`` ↔ ``b1`` / ``b3``, ``down_proj
(experts, hidden, dim)`` ↔ ``w2`` (transposed), ``down_proj_bias`` ↔ ``b2``. The released files
hold ``gate_up_proj`` and ``down_proj`` MXFP4-packed (``*_blocks`` / ``*_scales``): dequantised
on import (``ray_titan.models.gpt_oss.mxfp4``); an export writes them in the export dtype, as
transformers' ``save_pretrained`` does. The router's ``expert_bias`` (auxiliary-loss-free
balancing) has no gpt-oss tensor: a side file, as DeepSeek's.

``config.json``: the sizes, ``num_local_experts`` (or ``num_experts``), ``num_experts_per_tok``
(the hub files also say ``experts_per_token``), ``sliding_window``, ``layer_types``,
``swiglu_limit`` and ``swiglu_alpha`` (absent in the released files: 1.702, the value the
reference hard-codes), YaRN rope; ``attention_bias`` must be true; a ``quantization_config``
other than MXFP4 is refused.
"""

from __future__ import annotations

from typing import Any

from ray_titan.models.deepseek_v2.state_dict_adapter import ROUTER_BIAS_FILE
from ray_titan.models.gpt_oss.args import LAYER_TYPES, GptOssArgs
from ray_titan.models.state_dict_adapter import (
    HFConfigError,
    Source,
    StateDictAdapter,
    attention_heads,
    float_field,
    rope_from_hf,
    rope_to_hf,
    rotary_rows,
    size_field,
)

__all__ = ["GptOssAdapter"]


class GptOssAdapter(StateDictAdapter):
    """gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with sinks and biases, alternating sliding
    windows, YaRN rope, a biased top-k-softmax router, clamped-SwiGLU experts with biases."""

    model_type = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    training_fields = frozenset({"init_std", "load_balance", "aux_loss_coeff", "bias_update_rate"})
    quant_methods = ("mxfp4",)  # the released files' experts (ray_titan.models.gpt_oss.mxfp4)

    def args_from_hf(self, config: dict[str, Any]) -> GptOssArgs:
        def need(name: str, default: int | None = None) -> int:
            return size_field(config, name, default)

        if config.get("attention_bias", True) is not True:
            raise HFConfigError(f"config.json attention_bias = {config['attention_bias']!r} is not supported; "
                                "valid: true (gpt-oss's projections have biases)")
        dim, n_heads, n_kv_heads, head_dim = attention_heads(config)
        n_layers = need("num_hidden_layers")
        experts_field = "num_experts" if config.get("num_local_experts") is None and "num_experts" in config \
            else "num_local_experts"
        n_experts = need(experts_field)
        top_k = need("num_experts_per_tok") if config.get("num_experts_per_tok") is not None \
            else size_field(config, "experts_per_token")
        if top_k > n_experts:
            raise HFConfigError(f"config.json num_experts_per_tok = {top_k} exceeds {experts_field} = {n_experts}; "
                                f"valid: 1 to {n_experts}")
        window = need("sliding_window")
        types = config.get("layer_types")
        if types is None:
            types = [LAYER_TYPES[i % 2] for i in range(n_layers)]
        if not isinstance(types, list) or len(types) != n_layers or not all(t in LAYER_TYPES for t in types):
            raise HFConfigError(f"config.json layer_types = {types!r} is not valid; valid: a list of "
                                f"num_hidden_layers = {n_layers} values among {list(LAYER_TYPES)}")
        theta, scaling = rope_from_hf(config, ("yarn",), 150_000.0)
        return GptOssArgs(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            vocab_size=need("vocab_size"), moe_inter_dim=need("intermediate_size"), n_routed_experts=n_experts,
            n_activated_experts=top_k, sliding_window=window, layer_types=tuple(types),
            swiglu_alpha=float_field(config, "swiglu_alpha", 1.702),
            swiglu_limit=float_field(config, "swiglu_limit", 7.0),
            norm_eps=float_field(config, "rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
            max_seq_len=need("max_position_embeddings"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            aux_loss_coeff=float_field(config, "router_aux_loss_coef", 0.9),
        )

    def hf_config(self, args: GptOssArgs) -> dict[str, Any]:
        return {
            "hidden_size": args.dim, "intermediate_size": args.moe_inter_dim, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
            "vocab_size": args.vocab_size, "num_local_experts": args.n_routed_experts,
            "num_experts_per_tok": args.n_activated_experts, "experts_per_token": args.n_activated_experts,
            "sliding_window": args.sliding_window, "layer_types": list(args.layer_types),
            "swiglu_alpha": args.swiglu_alpha, "swiglu_limit": args.swiglu_limit, "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_word_embeddings,
            "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu",
            "router_aux_loss_coef": args.aux_loss_coeff, "quantization_config": None,
            **rope_to_hf(args.rope_theta, args.rope_scaling),
        }

    def sources(self, args: GptOssArgs) -> dict[str, Source]:
        q_rows = rotary_rows(args.n_heads, args.head_dim)
        k_rows = rotary_rows(args.n_kv_heads, args.head_dim)
        out = {"tok_embeddings.weight": Source(("model.embed_tokens.weight",)),
               "norm.weight": Source(("model.norm.weight",)),
               "output.weight": Source((self.output_key(args),))}
        for i in range(args.n_layers):
            hf, rt = f"model.layers.{i}.", f"layers.{i}."
            at, ex = hf + "self_attn.", hf + "mlp.experts."
            for p, rows in (("q", q_rows), ("k", k_rows), ("v", None), ("o", None)):
                for kind in ("weight", "bias"):
                    # wo's bias is per output feature (dim), not per head row: no permutation.
                    out[f"{rt}attention.w{p}.{kind}"] = Source((f"{at}{p}_proj.{kind}",), rows)
            out |= {
                rt + "attention.sinks": Source((at + "sinks",)),
                rt + "attention_norm.weight": Source((hf + "input_layernorm.weight",)),
                rt + "ffn_norm.weight": Source((hf + "post_attention_layernorm.weight",)),
                rt + "moe.router.weight": Source((hf + "mlp.router.weight",)),
                rt + "moe.router.bias": Source((hf + "mlp.router.bias",)),
                rt + "moe.router.expert_bias": Source((hf + "mlp.router.expert_bias",), file=ROUTER_BIAS_FILE,
                                                      optional=True),
                rt + "moe.experts.w1": Source((ex + "gate_up_proj",), cols=(0, 2), transpose=True),
                rt + "moe.experts.w3": Source((ex + "gate_up_proj",), cols=(1, 2), transpose=True),
                rt + "moe.experts.w2": Source((ex + "down_proj",), transpose=True),
                rt + "moe.experts.b1": Source((ex + "gate_up_proj_bias",), cols=(0, 2)),
                rt + "moe.experts.b3": Source((ex + "gate_up_proj_bias",), cols=(1, 2)),
                rt + "moe.experts.b2": Source((ex + "down_proj_bias",)),
            }
        return out

"""The Llama family's Hugging Face mapping (``model_type = "llama"``, ``LlamaForCausalLM``).

Names: ``model.layers.N.self_attn.{q,k,v,o}_proj`` ↔ ``layers.N.attention.w{q,k,v,o}``,
``mlp.{gate,up,down}_proj`` ↔ ``feed_forward.w{1,3,2}``, ``input_layernorm`` /
``post_attention_layernorm`` ↔ ``attention_norm`` / ``ffn_norm``, ``model.embed_tokens`` ↔
``tok_embeddings``, ``model.norm`` ↔ ``norm``, ``lm_head`` ↔ ``output`` (the embedding when
tied). Query and key rows are permuted from Hugging Face's ``rotate_half`` layout to Meta's
interleaved pairs (:func:`~ray_titan.models.state_dict_adapter.rotary_rows`), as Meta's
checkpoints are.
"""

from __future__ import annotations

from typing import Any

from ray_titan.models.llama.args import LlamaArgs
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

__all__ = ["LlamaAdapter"]


class LlamaAdapter(StateDictAdapter):
    """Llama 3.x (Meta's ``llama3`` rope scaling, tied embeddings of 3.2 1B/3B)."""

    model_type = "llama"
    architectures = ("LlamaForCausalLM",)
    qk_norm = False

    def args_from_hf(self, config: dict[str, Any]) -> LlamaArgs:
        def need(name: str, default: int | None = None) -> int:
            return size_field(config, name, default)

        for name, valid in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                            ("use_sliding_window", False)):
            if config.get(name, valid) != valid:
                raise HFConfigError(f"config.json {name} = {config[name]!r} is not supported; valid: {valid!r}")
        dim, n_heads, n_kv_heads, head_dim = attention_heads(config)
        theta, scaling = rope_from_hf(config, ("llama3",), 10_000.0)
        return LlamaArgs(
            dim=dim, n_layers=need("num_hidden_layers"), n_heads=n_heads,
            n_kv_heads=n_kv_heads, vocab_size=need("vocab_size"),
            ffn_dim=need("intermediate_size"), attn_head_dim=None if head_dim == dim // n_heads else head_dim,
            norm_eps=float_field(config, "rms_norm_eps", 1e-6), rope_theta=theta,
            max_seq_len=need("max_position_embeddings"), qk_norm=self.qk_norm,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), rope_scaling=scaling,
            multiple_of=1, ffn_dim_multiplier=None,
        )

    def hf_config(self, args: LlamaArgs) -> dict[str, Any]:
        return {
            "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_word_embeddings,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            **({} if self.qk_norm else {"mlp_bias": False}),
            **rope_to_hf(args.rope_theta, args.rope_scaling),
        }

    def sources(self, args: LlamaArgs) -> dict[str, Source]:
        q_rows = rotary_rows(args.n_heads, args.head_dim, args.rope_dim)
        k_rows = rotary_rows(args.n_kv_heads, args.head_dim, args.rope_dim)
        out = {"tok_embeddings.weight": Source(("model.embed_tokens.weight",)),
               "norm.weight": Source(("model.norm.weight",)),
               "output.weight": Source((self.output_key(args),))}
        for i in range(args.n_layers):
            hf, rt = f"model.layers.{i}.", f"layers.{i}."
            out |= {
                rt + "attention.wq.weight": Source((hf + "self_attn.q_proj.weight",), q_rows),
                rt + "attention.wk.weight": Source((hf + "self_attn.k_proj.weight",), k_rows),
                rt + "attention.wv.weight": Source((hf + "self_attn.v_proj.weight",)),
                rt + "attention.wo.weight": Source((hf + "self_attn.o_proj.weight",)),
                rt + "feed_forward.w1.weight": Source((hf + "mlp.gate_proj.weight",)),
                rt + "feed_forward.w3.weight": Source((hf + "mlp.up_proj.weight",)),
                rt + "feed_forward.w2.weight": Source((hf + "mlp.down_proj.weight",)),
                rt + "attention_norm.weight": Source((hf + "input_layernorm.weight",)),
                rt + "ffn_norm.weight": Source((hf + "post_attention_layernorm.weight",)),
            }
            if args.attention_bias:  # GLM-4.5's: the biases' rows follow their weights'
                out |= {rt + "attention.wq.bias": Source((hf + "self_attn.q_proj.bias",), q_rows),
                        rt + "attention.wk.bias": Source((hf + "self_attn.k_proj.bias",), k_rows),
                        rt + "attention.wv.bias": Source((hf + "self_attn.v_proj.bias",))}
            if args.qk_norm:  # per head, or over all heads (their rows as the projections')
                q_norm_rows, k_norm_rows = (q_rows, k_rows) if args.qk_norm_per_layer else (
                    rotary_rows(1, args.head_dim, args.rope_dim),) * 2
                out |= {rt + "attention.q_norm.weight": Source((hf + "self_attn.q_norm.weight",), q_norm_rows),
                        rt + "attention.k_norm.weight": Source((hf + "self_attn.k_norm.weight",), k_norm_rows)}
        return out

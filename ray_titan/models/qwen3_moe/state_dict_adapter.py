"""The Qwen3-MoE family's Hugging Face mapping (``model_type = "qwen3_moe"``, ``Qwen3MoeForCausalLM``).

Names: the Qwen3 dense mapping (``ray_titan.models.qwen3.state_dict_adapter``: embeddings, norms, attention with
the per-head rotary row permutation of q/k and their norms) for every layer, dense layers'
``mlp.{gate,up,down}_proj`` ↔ ``feed_forward.w{1,3,2}``; MoE layers' ``mlp.gate`` ↔
``moe.router``, ``mlp.experts.E.{gate,up,down}_proj`` (one tensor per expert) ↔ row ``E`` of the
stacked ``moe.experts.w{1,3,2}``. One tensor per expert is what the released checkpoints hold and
what transformers 5's ``save_pretrained`` writes (it un-fuses the ``gate_up_proj`` / ``down_proj``
it holds in memory). The router's ``expert_bias`` (auxiliary-loss-free balancing) has no Qwen
tensor: a side file, as DeepSeek-V2's (``ray_titan.models.deepseek_v2.state_dict_adapter.ROUTER_BIAS_FILE``).

``config.json``: ``num_experts`` (transformers 5 writes it as ``num_local_experts``),
``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob`` (transformers' default
false), ``decoder_sparse_step`` and ``mlp_only_layers`` (which layers are dense),
``router_aux_loss_coef`` (written on export; the job's ``model.aux_loss_coeff`` sets training's).
No rope scaling and no sliding window (refused).
"""

from __future__ import annotations

from typing import Any

from ray_titan.models.deepseek_v2.state_dict_adapter import ROUTER_BIAS_FILE
from ray_titan.models.qwen3.state_dict_adapter import Qwen3Adapter
from ray_titan.models.qwen3_moe.args import Qwen3MoeArgs
from ray_titan.models.state_dict_adapter import HFConfigError, Source, rope_from_hf, size_field

__all__ = ["Qwen3MoeAdapter"]


class Qwen3MoeAdapter(Qwen3Adapter):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention and names, softmax top-k
    routing over ``num_experts`` experts, no shared expert."""

    model_type = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    training_fields = frozenset({"init_std", "load_balance", "aux_loss_coeff", "bias_update_rate"})

    def args_from_hf(self, config: dict[str, Any]) -> Qwen3MoeArgs:  # type: ignore[override]
        rope_from_hf(config, (), 10_000.0)  # plain rope only: any scaling is refused, naming it
        dense = super().args_from_hf(config)  # attention, embedding, norms: checked as Qwen3's
        n_layers = dense.n_layers
        # The hub's name, or the one transformers 5 writes (attribute_map); absent: "has no 'num_experts'".
        experts_field = "num_local_experts" if config.get("num_experts") is None and "num_local_experts" in config \
            else "num_experts"
        n_experts = size_field(config, experts_field)
        top_k = size_field(config, "num_experts_per_tok")
        if top_k > n_experts:
            raise HFConfigError(f"config.json num_experts_per_tok = {top_k} exceeds {experts_field} = {n_experts}; "
                                f"valid: 1 to {n_experts}")
        dense_layers = config.get("mlp_only_layers") or []
        if not isinstance(dense_layers, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in dense_layers):
            raise HFConfigError(f"config.json mlp_only_layers = {config['mlp_only_layers']!r} is not valid; valid: a "
                                f"list of layer indices from 0 to {n_layers - 1}")
        norm_topk = config.get("norm_topk_prob", False)
        if not isinstance(norm_topk, bool):
            raise HFConfigError(f"config.json norm_topk_prob = {norm_topk!r} is not valid; valid: true or false")
        return Qwen3MoeArgs(
            dim=dense.dim, n_layers=n_layers, n_heads=dense.n_heads, n_kv_heads=dense.n_kv_heads,
            head_dim=dense.head_dim, vocab_size=dense.vocab_size, inter_dim=dense.ffn_hidden_dim,
            moe_inter_dim=size_field(config, "moe_intermediate_size"), n_routed_experts=n_experts,
            n_activated_experts=top_k, norm_topk_prob=norm_topk,
            decoder_sparse_step=size_field(config, "decoder_sparse_step", 1),
            mlp_only_layers=tuple(sorted(set(dense_layers))), norm_eps=dense.norm_eps, rope_theta=dense.rope_theta,
            max_seq_len=dense.max_seq_len, tie_word_embeddings=dense.tie_word_embeddings,
        )

    def hf_config(self, args: Qwen3MoeArgs) -> dict[str, Any]:  # type: ignore[override]
        return {
            **super().hf_config(args.attention_args()),
            "moe_intermediate_size": args.moe_inter_dim, "num_experts": args.n_routed_experts,
            "num_experts_per_tok": args.n_activated_experts, "norm_topk_prob": args.norm_topk_prob,
            "decoder_sparse_step": args.decoder_sparse_step, "mlp_only_layers": list(args.mlp_only_layers),
            "router_aux_loss_coef": args.aux_loss_coeff, "use_sliding_window": False,
        }

    def sources(self, args: Qwen3MoeArgs) -> dict[str, Source]:  # type: ignore[override]
        out = super().sources(args.attention_args())
        ffn = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        for i in args.moe_layers:
            hf, rt = f"model.layers.{i}.", f"layers.{i}."
            for a in ffn:
                del out[f"{rt}feed_forward.{a}.weight"]
            out |= {rt + "moe.router.weight": Source((hf + "mlp.gate.weight",)),
                    rt + "moe.router.expert_bias": Source((hf + "mlp.gate.expert_bias",), file=ROUTER_BIAS_FILE,
                                                          optional=True)}
            out |= {f"{rt}moe.experts.{a}": Source(tuple(f"{hf}mlp.experts.{e}.{b}.weight"
                                                         for e in range(args.n_routed_experts)), stacked=True)
                    for a, b in ffn.items()}
        return out

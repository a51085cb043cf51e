"""The Qwen3.5-MoE family's Hugging Face mapping (``model_type = "qwen3_5_moe_text"``,
``Qwen3_5MoeForCausalLM``; the released multimodal ``qwen3_5_moe`` files import too).

Both ``config.json`` forms and every name but the feed-forward's as the dense family's
(``ray_titan.models.qwen3_5.state_dict_adapter``). Each layer's MoE: ``mlp.gate`` ↔
``moe.router``, ``mlp.experts.E.{gate,up,down}_proj`` (one tensor per expert, as transformers 5's
``save_pretrained`` writes them) ↔ row ``E`` of ``moe.experts.w{1,3,2}``,
``mlp.shared_expert.{gate,up,down}_proj`` ↔ ``moe.shared_experts.w{1,3,2}``,
``mlp.shared_expert_gate`` ↔ ``moe.shared_gate``; the router's ``expert_bias``
(auxiliary-loss-free balancing) in a side file, as DeepSeek-V2's. ``config.json``:
``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
``shared_expert_intermediate_size``, ``router_aux_loss_coef`` (written on export).
"""

from __future__ import annotations

from typing import Any

from ray_titan.models.deepseek_v2.state_dict_adapter import ROUTER_BIAS_FILE
from ray_titan.models.qwen3_5.state_dict_adapter import Qwen35Adapter, text_config
from ray_titan.models.qwen3_5_moe.args import Qwen35MoeArgs
from ray_titan.models.state_dict_adapter import HFConfigError, Source, size_field

__all__ = ["Qwen35MoeAdapter"]

_SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Qwen35MoeAdapter(Qwen35Adapter):
    """Qwen3.5-MoE (Qwen3.5-397B-A17B): Qwen3.5's layers, every feed-forward routed experts plus
    a gated shared expert."""

    model_type = "qwen3_5_moe_text"
    architectures = ("Qwen3_5MoeForCausalLM",)
    model_type_aliases = ("qwen3_5_moe",)
    training_fields = Qwen35Adapter.training_fields | {"load_balance", "aux_loss_coeff", "bias_update_rate"}

    def args_from_hf(self, config: dict[str, Any]) -> Qwen35MoeArgs:
        c, _ = text_config(config)
        n_experts, top_k = size_field(c, "num_experts"), size_field(c, "num_experts_per_tok")
        if top_k > n_experts:
            raise HFConfigError(f"config.json num_experts_per_tok = {top_k} exceeds num_experts = {n_experts}; "
                                f"valid: 1 to {n_experts}")
        return Qwen35MoeArgs(
            moe_inter_dim=size_field(c, "moe_intermediate_size"),
            shared_inter_dim=size_field(c, "shared_expert_intermediate_size"), n_routed_experts=n_experts,
            n_activated_experts=top_k, **self.dense_fields(config))

    def hf_config(self, args: Qwen35MoeArgs) -> dict[str, Any]:  # type: ignore[override]
        out = super().hf_config(args)
        del out["intermediate_size"]
        return {**out, "moe_intermediate_size": args.moe_inter_dim,
                "shared_expert_intermediate_size": args.shared_inter_dim, "num_experts": args.n_routed_experts,
                "num_experts_per_tok": args.n_activated_experts, "router_aux_loss_coef": args.aux_loss_coeff}

    def ffn_sources(self, args: Qwen35MoeArgs, hf_layer: str) -> dict[str, Source]:  # type: ignore[override]
        hf = f"{hf_layer}mlp."
        out = {"moe.router.weight": Source((hf + "gate.weight",)),
               "moe.router.expert_bias": Source((hf + "gate.expert_bias",), file=ROUTER_BIAS_FILE, optional=True),
               "moe.shared_gate.weight": Source((hf + "shared_expert_gate.weight",))}
        for rt, name in _SWIGLU.items():
            out[f"moe.experts.{rt}"] = Source(tuple(f"{hf}experts.{e}.{name}.weight"
                                                    for e in range(args.n_routed_experts)), stacked=True)
            out[f"moe.shared_experts.{rt}.weight"] = Source((f"{hf}shared_expert.{name}.weight",))
        return out

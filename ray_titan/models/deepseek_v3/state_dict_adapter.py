"""The DeepSeek-V3 family's Hugging Face mapping (``model_type = "deepseek_v3"``,
``DeepseekV3ForCausalLM``; Kimi K2's ``model_type = "kimi_k2"`` imports as the same family).

Names as DeepSeek-V2's (``ray_titan.models.deepseek_v2.state_dict_adapter``), except the router's bias: V3's
checkpoints hold it as ``mlp.gate.e_score_correction_bias`` (required), which is ray_titan's
``moe.router.expert_bias``. The multi-token-prediction depths (``num_nextn_predict_layers``; the
model's ``n_mtp_layers``) are ``model.layers.<num_hidden_layers + k>.*``: an MoE block named as
any other, and ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm`` ↔ ray_titan's
``enorm`` / ``hnorm`` / ``eh_proj`` / ``head_norm`` of that block (``MtpBlock``). Their
``embed_tokens.weight`` and ``shared_head.head.weight`` are copies of the model's embedding and
output head (DeepSeek's release writes them; transformers ignores them): the import ignores them
and an export writes none. A job that builds fewer depths than a checkpoint holds reads only
those. The released V3 and K2 files are FP8 with block scales (``quantization_config``): they are
refused with the way to a bf16 copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray_titan.models.deepseek_v2.args import DeepSeekV2Args
from ray_titan.models.deepseek_v2.state_dict_adapter import DeepSeekV2Adapter
from ray_titan.models.state_dict_adapter import Source, StateDictAdapter, size_field

__all__ = ["DeepSeekV3Adapter", "MtpAdapter"]


class MtpAdapter(StateDictAdapter):
    """The names of DeepSeek-V3's multi-token-prediction depths (module docstring), for any family
    that lays them out as it does (GLM-4.5 too): mixed in before the family's adapter, whose
    arguments have ``n_layers`` and ``n_mtp_layers`` (the depths built). :meth:`mtp_sources`
    gives each depth's own tensors (the family's adapter gives its block's, under layer
    ``n_layers + k``), :meth:`held_args` counts the depths a checkpoint holds and
    :meth:`ignored_keys` adds their copies of the embedding and head."""

    def mtp_sources(self, args: Any) -> dict[str, Source]:
        """``enorm`` / ``hnorm`` / ``eh_proj`` / ``head_norm`` of each depth built and the last
        pipeline stage's copy of the embedding, ``mtp_embeddings`` (read, never written)."""
        out = {"mtp_embeddings.weight": Source(("model.embed_tokens.weight",))} if args.n_mtp_layers else {}
        for i in range(args.n_layers, args.n_layers + args.n_mtp_layers):
            hf, rt = f"model.layers.{i}.", f"layers.{i}."
            out |= {f"{rt}{a}.weight": Source((f"{hf}{b}.weight",))
                    for a, b in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                                 ("head_norm", "shared_head.norm"))}
        return out

    def held_args(self, args: Any, keys: set[str]) -> Any:
        """The MTP depths the files hold: transformers' ``save_pretrained`` writes
        ``num_nextn_predict_layers`` (its default 1) without the depths' tensors."""
        held = 0
        while held < args.n_mtp_layers and any(k.startswith(f"model.layers.{args.n_layers + held}.") for k in keys):
            held += 1
        return dataclasses.replace(args, n_mtp_layers=held)

    def ignored_keys(self, args: Any) -> set[str]:
        copies = {f"model.layers.{args.n_layers + k}.{name}" for k in range(args.n_mtp_layers)
                  for name in ("embed_tokens.weight", "shared_head.head.weight")}
        return super().ignored_keys(args) | copies


class DeepSeekV3Adapter(MtpAdapter, DeepSeekV2Adapter):
    """DeepSeek-V3 and Kimi K2: sigmoid scores, ``noaux_tc`` routing (transformers'
    ``models/deepseek_v3/modeling_deepseek_v3.py`` computes only these), YaRN rope."""

    model_type = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    model_type_aliases = ("kimi_k2",)
    # The MTP depths built are the job's choice (model.mtp_layers), not compared with config.json.
    training_fields = DeepSeekV2Adapter.training_fields | {"n_mtp_layers"}
    topk_methods = ("noaux_tc",)
    scoring_funcs = ("sigmoid",)
    quant_advice = ("; the released DeepSeek-V3 / Kimi K2 files are FP8 with block scales: convert them to bf16 first "
                    "(DeepSeek-V3's inference/fp8_cast_bf16.py) and import that directory")

    def args_from_hf(self, config: dict[str, Any]) -> DeepSeekV2Args:
        args = super().args_from_hf(config)
        return dataclasses.replace(args, n_mtp_layers=size_field(config, "num_nextn_predict_layers", 0))

    def hf_config(self, args: DeepSeekV2Args) -> dict[str, Any]:
        return {**super().hf_config(args), "num_nextn_predict_layers": args.n_mtp_layers}

    def router_bias_source(self, hf_layer: str) -> Source:
        return Source((hf_layer + "mlp.gate.e_score_correction_bias",))

    def sources(self, args: DeepSeekV2Args) -> dict[str, Source]:
        out = super().sources(args)
        for i in range(args.n_layers, args.n_layers + args.n_mtp_layers):
            out |= self.layer_sources(args, i)
        return out | self.mtp_sources(args)

"""The DeepSeek-V3 family's Hugging Face mapping (``model_type = "deepseek_v3"``,
``DeepseekV3ForCausalLM``; Kimi K2's ``model_type = "kimi_k2"`` imports as the same family).

Names as DeepSeek-V2's (``ray_titan.models.deepseek_v2.state_dict_adapter``), except the router's bias: V3's
checkpoints hold it as ``mlp.gate.e_score_correction_bias`` (required), which is ray_titan's
``moe.router.expert_bias``. The multi-token-prediction layers (``model.layers.<num_hidden_layers
+ i>.*``, ``num_nextn_predict_layers`` of them) are skipped with a printed line and exported as
none. The released V3 and K2 files are FP8 with block scales (``quantization_config``): they are
refused with the way to a bf16 copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray_titan.models.deepseek_v2.args import DeepSeekV2Args
from ray_titan.models.deepseek_v2.state_dict_adapter import DeepSeekV2Adapter
from ray_titan.models.state_dict_adapter import Source, size_field

__all__ = ["DeepSeekV3Adapter"]

class DeepSeekV3Adapter(DeepSeekV2Adapter):
    """DeepSeek-V3 and Kimi K2: sigmoid scores, ``noaux_tc`` routing (transformers'
    ``models/deepseek_v3/modeling_deepseek_v3.py`` computes only these), YaRN rope."""

    model_type = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    model_type_aliases = ("kimi_k2",)
    topk_methods = ("noaux_tc",)
    scoring_funcs = ("sigmoid",)
    quant_advice = ("; the released DeepSeek-V3 / Kimi K2 files are FP8 with block scales: convert them to bf16 first "
                    "(DeepSeek-V3's inference/fp8_cast_bf16.py) and import that directory")

    def args_from_hf(self, config: dict[str, Any]) -> DeepSeekV2Args:
        args = super().args_from_hf(config)
        return dataclasses.replace(args, n_mtp_layers=size_field(config, "num_nextn_predict_layers", 0))

    def hf_config(self, args: DeepSeekV2Args) -> dict[str, Any]:
        # No MTP tensors are written, so an exported config.json says there are none.
        return {**super().hf_config(args), "num_nextn_predict_layers": 0}

    def router_bias_source(self, hf_layer: str) -> Source:
        return Source((hf_layer + "mlp.gate.e_score_correction_bias",))

    def skipped_prefixes(self, args: DeepSeekV2Args) -> dict[str, str]:
        why = ("a multi-token-prediction module (DeepSeek-V3 §2.2; num_nextn_predict_layers): ray_titan trains "
               "the main model only, without the MTP loss, and exports none")
        return {f"model.layers.{args.n_layers + i}.": why for i in range(args.n_mtp_layers)}

"""The DeepSeek-V3 family (MoE; Kimi K2 is one of its checkpoints): ``args`` (flavors) and
``state_dict_adapter`` (the Hugging Face mapping); :data:`SPEC` registers it. The model, its
parallelisms and its costs are DeepSeek-V2's (``ray_titan.models.deepseek_v2``): V3 differs in
data, not in code: the sigmoid ``noaux_tc`` router of ``ray_titan.models.routing`` with its
correction bias, query latents, more dense layers.

Flavors: ``debug``; ``16B`` (torchtitan's: V2-Lite's sizes with V3's router), ``671B`` has the
dimensions of DeepSeek-V3 and ``kimi_k2`` those of Kimi K2."""

from ray_titan.models.deepseek_v2 import DeepSeekV2, parallelize_deepseek_v2
from ray_titan.models.deepseek_v2.costs import deepseek_block_activations, deepseek_flops_per_token
from ray_titan.models.deepseek_v3.args import FLAVORS
from ray_titan.models.deepseek_v3.state_dict_adapter import DeepSeekV3Adapter
from ray_titan.models.spec import ModelSpec, mtp_moe_config_args

__all__ = ["FLAVORS", "SPEC", "DeepSeekV3Adapter"]

# DeepSeek-V3 and Kimi K2: DeepSeek-V2's model with V3's router (its flavors set it) and its
# multi-token prediction (model.mtp_layers).
SPEC = ModelSpec("deepseek_v3", DeepSeekV2, FLAVORS, parallelize_deepseek_v2, DeepSeekV3Adapter(),
                 deepseek_flops_per_token, deepseek_block_activations, config_args=mtp_moe_config_args, moe=True,
                 mtp=True, mtp_tp=True)

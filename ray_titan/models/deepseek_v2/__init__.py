"""The DeepSeek-V2 family (MoE): ``args`` (hyper-parameters and flavors), ``model`` (MLA and
DeepSeekMoE, knowing nothing of parallelism), ``parallelize`` (TP → EP → AC → compile → FSDP),
``state_dict_adapter`` (the Hugging Face mapping) and ``costs`` (FLOPs and activation bytes, the
MoE layer's shared by every MoE family); :data:`SPEC` registers it.

Flavors: ``debug``; ``V2-Lite`` has the dimensions of DeepSeek-V2-Lite (15.7 B total, 2.4 B
activated), its YaRN rope included, ``V2`` those of DeepSeek-V2 (236 B, 21 B; group-limited
routing)."""

from ray_titan.models.deepseek_v2.args import FLAVORS, DeepSeekV2Args
from ray_titan.models.deepseek_v2.costs import deepseek_block_activations, deepseek_flops_per_token
from ray_titan.models.deepseek_v2.model import DeepSeekV2, activated_parameters
from ray_titan.models.deepseek_v2.parallelize import parallelize_deepseek_v2
from ray_titan.models.deepseek_v2.state_dict_adapter import DeepSeekV2Adapter
from ray_titan.models.spec import ModelSpec, moe_config_args

__all__ = ["FLAVORS", "SPEC", "DeepSeekV2", "DeepSeekV2Args", "activated_parameters", "parallelize_deepseek_v2"]

SPEC = ModelSpec("deepseek_v2", DeepSeekV2, FLAVORS, parallelize_deepseek_v2, DeepSeekV2Adapter(),
                 deepseek_flops_per_token, deepseek_block_activations, config_args=moe_config_args, moe=True)

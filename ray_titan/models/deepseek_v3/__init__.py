"""The DeepSeek-V3 family (MoE; Kimi K2 is one of its checkpoints): ``args`` (flavors) and ``hf``
(the Hugging Face mapping). The model and its parallelisms are DeepSeek-V2's
(``ray_titan.models.deepseek_v2``): V3 differs in data, not in code: the sigmoid ``noaux_tc``
router of ``ray_titan.models.routing`` with its correction bias, query latents, more dense layers."""

from ray_titan.models.deepseek_v3.args import FLAVORS
from ray_titan.models.deepseek_v3.state_dict_adapter import DeepSeekV3Adapter

__all__ = ["FLAVORS", "DeepSeekV3Adapter"]

"""The MiniMax-M2 family (``minimax_m2``): ``args`` (hyper-parameters and flavors),
``state_dict_adapter`` (the Hugging Face mapping) and ``parallelize`` (no tensor parallel); the
model and its costs are GLM-4.5's (``ray_titan.models.glm4_moe``: Llama-style attention, here with
q/k norms over all heads and partial rotary, and DeepSeek-V3's MoE layer, here in every layer
with no shared expert). :data:`SPEC` registers it.

Flavors: ``debug``; ``230B-A10B`` (MiniMax-M2)."""

from ray_titan.models.glm4_moe import Glm4Moe
from ray_titan.models.glm4_moe.costs import glm4_moe_block_activations, glm4_moe_flops_per_token
from ray_titan.models.minimax_m2.args import FLAVORS, MiniMaxM2Args
from ray_titan.models.minimax_m2.parallelize import parallelize_minimax_m2
from ray_titan.models.minimax_m2.state_dict_adapter import MiniMaxM2Adapter
from ray_titan.models.spec import ModelSpec, moe_config_args

__all__ = ["FLAVORS", "SPEC", "MiniMaxM2Adapter", "MiniMaxM2Args"]

SPEC = ModelSpec("minimax_m2", Glm4Moe, FLAVORS, parallelize_minimax_m2, MiniMaxM2Adapter(), glm4_moe_flops_per_token,
                 glm4_moe_block_activations, config_args=moe_config_args, moe=True)

"""The GLM-4.5 family (``glm4_moe``: GLM-4.5, 4.5-Air, 4.6, 4.7): ``args`` (hyper-parameters and
flavors), ``model`` (Llama-style attention with q/k/v biases, partial rotary and q/k norms, and
DeepSeek-V3's MoE layer), multi-token prediction as DeepSeek-V3's around GLM's block (``model.mtp_layers``),
``state_dict_adapter`` (the Hugging Face mapping) and ``costs`` (FLOPs
and activation bytes); its parallelisms are Qwen3-MoE's (``ray_titan.models.qwen3_moe.parallelize``,
which splits the shared experts too). :data:`SPEC` registers it.

Flavors: ``debug``; ``355B-A32B`` (GLM-4.5, also 4.6 / 4.7) and ``106B-A12B`` (GLM-4.5-Air)."""

from ray_titan.models.glm4_moe.args import FLAVORS, Glm4MoeArgs
from ray_titan.models.glm4_moe.costs import glm4_moe_block_activations, glm4_moe_flops_per_token
from ray_titan.models.glm4_moe.model import Glm4Moe
from ray_titan.models.glm4_moe.state_dict_adapter import Glm4MoeAdapter
from ray_titan.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from ray_titan.models.spec import ModelSpec, mtp_moe_config_args

__all__ = ["FLAVORS", "SPEC", "Glm4Moe", "Glm4MoeAdapter", "Glm4MoeArgs"]

SPEC = ModelSpec("glm4_moe", Glm4Moe, FLAVORS, parallelize_qwen3_moe, Glm4MoeAdapter(), glm4_moe_flops_per_token,
                 glm4_moe_block_activations, config_args=mtp_moe_config_args, moe=True,
                 mtp=True, mtp_tp=True)

"""The Qwen3-MoE family: ``args`` (hyper-parameters and flavors), ``model`` (Qwen3 attention with
DeepSeek-V2's MoE layer, and the reference's balance loss pooled over layers), ``state_dict_adapter``
(the Hugging Face mapping), ``parallelize`` (TP → EP → AC → compile → FSDP) and ``costs`` (FLOPs and
activation bytes); :data:`SPEC` registers it.

Flavors: ``debug``; ``30B-A3B`` and ``235B-A22B`` have the dimensions of Qwen3-MoE (30.5 B / 3.3 B
and 235 B / 22 B)."""

from ray_titan.models.qwen3_moe.args import FLAVORS, Qwen3MoeArgs
from ray_titan.models.qwen3_moe.costs import qwen3_moe_block_activations, qwen3_moe_flops_per_token
from ray_titan.models.qwen3_moe.model import Qwen3Moe, activated_parameters
from ray_titan.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from ray_titan.models.qwen3_moe.state_dict_adapter import Qwen3MoeAdapter
from ray_titan.models.spec import ModelSpec, moe_config_args

__all__ = ["FLAVORS", "SPEC", "Qwen3Moe", "Qwen3MoeAdapter", "Qwen3MoeArgs", "activated_parameters",
           "parallelize_qwen3_moe"]

# Qwen3-MoE: Qwen3's attention with DeepSeek-V2's MoE layer (greedy normalised top-k, no shared
# expert) and the reference's balance loss pooled over layers.
SPEC = ModelSpec("qwen3_moe", Qwen3Moe, FLAVORS, parallelize_qwen3_moe, Qwen3MoeAdapter(), qwen3_moe_flops_per_token,
                 qwen3_moe_block_activations, config_args=moe_config_args, moe=True)

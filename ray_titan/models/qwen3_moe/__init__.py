"""The Qwen3-MoE family: ``args`` (hyper-parameters and flavors), ``model`` (Qwen3 attention with
DeepSeek-V2's MoE layer, and the reference's balance loss pooled over layers), ``hf`` (the Hugging
Face mapping) and ``parallelize`` (TP → EP → AC → compile → FSDP)."""

from ray_titan.models.qwen3_moe.args import FLAVORS, Qwen3MoeArgs
from ray_titan.models.qwen3_moe.model import Qwen3Moe, activated_parameters
from ray_titan.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from ray_titan.models.qwen3_moe.state_dict_adapter import Qwen3MoeAdapter

__all__ = ["FLAVORS", "Qwen3Moe", "Qwen3MoeAdapter", "Qwen3MoeArgs", "activated_parameters", "parallelize_qwen3_moe"]

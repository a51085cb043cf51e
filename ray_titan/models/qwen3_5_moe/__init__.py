"""The Qwen3.5-MoE family: ``args`` (hyper-parameters and flavors), ``model`` (Qwen3.5's hybrid
Gated DeltaNet / gated-attention layers with DeepSeek-V2's MoE layer, a gated shared expert and
Qwen3-MoE's pooled balance loss), ``state_dict_adapter`` (the Hugging Face mapping, text and
multimodal ``config.json`` forms) and ``costs``; the parallelize step is the dense family's
(``ray_titan.models.qwen3_5``); :data:`SPEC` registers it.

Flavors: ``debug``; ``397B-A17B`` has the dimensions of Qwen3.5-397B-A17B."""

from ray_titan.models.qwen3_5 import parallelize_qwen3_5
from ray_titan.models.qwen3_5_moe.args import FLAVORS, Qwen35MoeArgs
from ray_titan.models.qwen3_5_moe.costs import qwen3_5_moe_block_activations, qwen3_5_moe_flops_per_token
from ray_titan.models.qwen3_5_moe.model import Qwen35Moe
from ray_titan.models.qwen3_5_moe.state_dict_adapter import Qwen35MoeAdapter
from ray_titan.models.spec import ModelSpec, mtp_moe_config_args

__all__ = ["FLAVORS", "SPEC", "Qwen35Moe", "Qwen35MoeAdapter", "Qwen35MoeArgs"]

SPEC = ModelSpec("qwen3_5_moe", Qwen35Moe, FLAVORS, parallelize_qwen3_5, Qwen35MoeAdapter(),
                 qwen3_5_moe_flops_per_token, qwen3_5_moe_block_activations, config_args=mtp_moe_config_args, moe=True,
                 mtp=True)

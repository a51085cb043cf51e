"""The Qwen3.5 dense family: ``args`` (hyper-parameters and flavors), ``delta_rule`` (Gated
DeltaNet in plain PyTorch: chunked for training, recurrent as its reference), ``model`` (the hybrid
decoder: Gated DeltaNet in three of every four layers, gated full attention in the fourth; its
multi-token prediction, ``model.mtp_layers``),
``state_dict_adapter`` (the Hugging Face mapping, text and multimodal ``config.json`` forms),
``parallelize`` (TP refused → AC → compile → FSDP) and ``costs`` (FLOPs and activation bytes);
:data:`SPEC` registers it.

Flavors: ``debug``; ``27B`` has the dimensions of Qwen3.5-27B."""

from ray_titan.models.qwen3_5.args import FLAVORS, Qwen35Args
from ray_titan.models.qwen3_5.costs import qwen3_5_block_activations, qwen3_5_flops_per_token
from ray_titan.models.qwen3_5.model import Qwen35
from ray_titan.models.qwen3_5.parallelize import parallelize_qwen3_5
from ray_titan.models.qwen3_5.state_dict_adapter import Qwen35Adapter
from ray_titan.models.spec import ModelSpec, mtp_config_args

__all__ = ["FLAVORS", "SPEC", "Qwen35", "Qwen35Adapter", "Qwen35Args", "parallelize_qwen3_5"]

SPEC = ModelSpec("qwen3_5", Qwen35, FLAVORS, parallelize_qwen3_5, Qwen35Adapter(), qwen3_5_flops_per_token,
                 qwen3_5_block_activations, config_args=mtp_config_args, mtp=True)

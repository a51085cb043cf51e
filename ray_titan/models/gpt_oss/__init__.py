"""The gpt-oss family (OpenAI's gpt-oss-20b and gpt-oss-120b): ``args`` (hyper-parameters and
flavors), ``model`` (attention with sinks and alternating sliding windows, DeepSeek-V2's MoE layer
with gpt-oss's router and clamped-SwiGLU experts), ``state_dict_adapter`` (the Hugging Face
mapping), ``mxfp4`` (the released files' packed expert weights), ``parallelize`` (EP → AC →
compile → FSDP) and ``costs`` (FLOPs and activation bytes); :data:`SPEC` registers it.

Flavors: ``debug``; ``20B`` and ``120B`` have the dimensions of gpt-oss (21 B / 3.6 B and
117 B / 5.1 B)."""

from ray_titan.models.gpt_oss.args import FLAVORS, GptOssArgs
from ray_titan.models.gpt_oss.costs import gpt_oss_block_activations, gpt_oss_flops_per_token
from ray_titan.models.gpt_oss.model import GptOss, activated_parameters
from ray_titan.models.gpt_oss.parallelize import parallelize_gpt_oss
from ray_titan.models.gpt_oss.state_dict_adapter import GptOssAdapter
from ray_titan.models.spec import ModelSpec, moe_config_args

__all__ = ["FLAVORS", "SPEC", "GptOss", "GptOssAdapter", "GptOssArgs", "activated_parameters", "parallelize_gpt_oss"]

# gpt-oss: attention with sinks and alternating sliding windows, DeepSeek-V2's MoE layer with a
# biased top-k-softmax router and clamped-SwiGLU experts with biases; no tensor parallel.
SPEC = ModelSpec("gpt_oss", GptOss, FLAVORS, parallelize_gpt_oss, GptOssAdapter(), gpt_oss_flops_per_token,
                 gpt_oss_block_activations, config_args=moe_config_args, moe=True)

"""The gpt-oss family (OpenAI's gpt-oss-20b and gpt-oss-120b): ``args`` (hyper-parameters and
flavors), ``model`` (attention with sinks and alternating sliding windows, DeepSeek-V2's MoE layer
with gpt-oss's router and clamped-SwiGLU experts), ``hf`` (the Hugging Face mapping), ``mxfp4``
(the released files' packed expert weights) and ``parallelize`` (EP → AC → compile → FSDP)."""

from ray_titan.models.gpt_oss.args import FLAVORS, GptOssArgs
from ray_titan.models.gpt_oss.model import GptOss, activated_parameters
from ray_titan.models.gpt_oss.parallelize import parallelize_gpt_oss
from ray_titan.models.gpt_oss.state_dict_adapter import GptOssAdapter

__all__ = ["FLAVORS", "GptOss", "GptOssAdapter", "GptOssArgs", "activated_parameters", "parallelize_gpt_oss"]

"""The DeepSeek-V2 family (MoE): ``args`` (hyper-parameters and flavors), ``model`` (MLA and
DeepSeekMoE, knowing nothing of parallelism) and ``parallelize`` (TP → EP → AC → compile → FSDP)."""

from ray_titan.models.deepseek_v2.args import FLAVORS, DeepSeekV2Args
from ray_titan.models.deepseek_v2.model import DeepSeekV2, activated_parameters
from ray_titan.models.deepseek_v2.parallelize import parallelize_deepseek_v2

__all__ = ["FLAVORS", "DeepSeekV2", "DeepSeekV2Args", "activated_parameters", "parallelize_deepseek_v2"]

"""The Llama family: ``args`` (hyper-parameters and flavors), ``model`` (the decoder, knowing
nothing of parallelism) and ``parallelize`` (TP → AC → compile → FSDP)."""

from ray_titan.models.llama.args import FLAVORS, LlamaArgs
from ray_titan.models.llama.model import Llama
from ray_titan.models.llama.parallelize import parallelize_llama

__all__ = ["FLAVORS", "Llama", "LlamaArgs", "parallelize_llama"]

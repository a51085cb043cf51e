"""The Llama family: ``args`` (hyper-parameters and flavors), ``model`` (the decoder, knowing
nothing of parallelism), ``parallelize`` (TP → AC → compile → FSDP), ``state_dict_adapter`` (the
Hugging Face mapping) and ``costs`` (FLOPs and activation bytes); :data:`SPEC` registers it.

Flavors: ``debug``; ``3-8B`` (also ``8B``), ``3.1-8B``, ``3.1-70B``, ``3.2-1B`` and ``3.2-3B``
have the dimensions of Meta's Llama 3.x models."""

from ray_titan.models.llama.args import FLAVORS, LlamaArgs
from ray_titan.models.llama.costs import llama_block_activations, llama_flops_per_token
from ray_titan.models.llama.model import Llama
from ray_titan.models.llama.parallelize import parallelize_llama
from ray_titan.models.llama.state_dict_adapter import LlamaAdapter
from ray_titan.models.spec import ModelSpec

__all__ = ["FLAVORS", "SPEC", "Llama", "LlamaArgs", "parallelize_llama"]

SPEC = ModelSpec("llama", Llama, FLAVORS, parallelize_llama, LlamaAdapter(), llama_flops_per_token,
                 llama_block_activations)

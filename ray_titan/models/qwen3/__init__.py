"""The Qwen3 dense family: Llama-style decoders with an RMSNorm over each query and key head,
rope theta 1,000,000 and, on the small sizes, the output head tied to the embedding. The model,
its ``parallelize`` step and its costs are the Llama family's (``ray_titan.models.llama``) with
``qk_norm``; ``args`` holds the flavors, ``state_dict_adapter`` the Hugging Face mapping;
:data:`SPEC` registers it.

Flavors: ``debug``; ``0.6B``, ``1.7B``, ``4B`` and ``8B`` have the dimensions of Qwen3 dense."""

from ray_titan.models.llama import Llama, parallelize_llama
from ray_titan.models.llama.costs import llama_block_activations, llama_flops_per_token
from ray_titan.models.qwen3.args import FLAVORS
from ray_titan.models.qwen3.state_dict_adapter import Qwen3Adapter
from ray_titan.models.spec import ModelSpec

__all__ = ["FLAVORS", "SPEC"]

# Qwen3 dense is a Llama with per-head q/k RMSNorm (its flavors set qk_norm).
SPEC = ModelSpec("qwen3", Llama, FLAVORS, parallelize_llama, Qwen3Adapter(), llama_flops_per_token,
                 llama_block_activations)

"""The Qwen3 dense family: Llama-style decoders with an RMSNorm over each query and key head,
rope theta 1,000,000 and, on the small sizes, the output head tied to the embedding. The model
and its ``parallelize`` step are the Llama family's (``ray_titan.models.llama``) with
``qk_norm``; ``args`` holds the flavors."""

from ray_titan.models.qwen3.args import FLAVORS

__all__ = ["FLAVORS"]

"""The Qwen3 dense family's Hugging Face mapping (``model_type = "qwen3"``, ``Qwen3ForCausalLM``):
the Llama mapping (``ray_titan.models.llama.state_dict_adapter``) plus ``self_attn.{q,k}_norm`` ↔
``attention.{q,k}_norm``, whose weights follow the same per-head rotary row permutation."""

from __future__ import annotations

from ray_titan.models.llama.state_dict_adapter import LlamaAdapter

__all__ = ["Qwen3Adapter"]


class Qwen3Adapter(LlamaAdapter):
    """Qwen3 dense: q/k RMSNorm per head, tied embeddings on the small sizes, no sliding window."""

    model_type = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    qk_norm = True

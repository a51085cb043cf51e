"""Registry of model families and their flavors (sizes).

``debug`` flavors are tiny and CPU-friendly. ``llama/8B`` has the dimensions of Meta Llama 3 8B
(model card: 8.03 B parameters with its 128,256-token vocabulary); ``deepseek_v2/V2-Lite`` those
of DeepSeek-V2-Lite (model card: 15.7 B total, 2.4 B activated parameters). Both are
constructible on the meta device.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ray_titan.models.deepseek import DeepSeekV2, DeepSeekV2Args
from ray_titan.models.llama import Llama, LlamaArgs

__all__ = ["MODELS", "get_model_args", "build_model", "is_moe"]

MODELS: dict[str, dict[str, LlamaArgs | DeepSeekV2Args]] = {
    "llama": {
        "debug": LlamaArgs(
            dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=258, multiple_of=64,
            ffn_dim_multiplier=None, rope_theta=10_000.0, max_seq_len=1024,
        ),
        # Meta Llama 3 8B (github.com/meta-llama/llama3, params.json).
        "8B": LlamaArgs(
            dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256, multiple_of=1024,
            ffn_dim_multiplier=1.3, rope_theta=500_000.0, max_seq_len=8192,
        ),
    },
    "deepseek_v2": {
        # 4 layers (the first dense), 8 routed experts, top-2, 1 shared expert.
        "debug": DeepSeekV2Args(
            dim=128, n_layers=4, n_dense_layers=1, n_heads=4, vocab_size=258, inter_dim=256,
            moe_inter_dim=64, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
            q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            max_seq_len=1024,
        ),
        # DeepSeek-V2-Lite (huggingface.co/deepseek-ai/DeepSeek-V2-Lite, config.json).
        "V2-Lite": DeepSeekV2Args(),
    },
}
_CLASSES = {"llama": Llama, "deepseek_v2": DeepSeekV2}


def is_moe(name: str) -> bool:
    """Whether the family has mixture-of-experts layers."""
    return name == "deepseek_v2"


def get_model_args(name: str, flavor: str) -> LlamaArgs | DeepSeekV2Args:
    """The arguments of ``name``/``flavor``. Raises ``KeyError`` naming the valid choices."""
    if name not in MODELS:
        raise KeyError(f"model.name = {name!r} is unknown; valid: {sorted(MODELS)}")
    if flavor not in MODELS[name]:
        raise KeyError(
            f"model.flavor = {flavor!r} is unknown for model {name!r}; valid: {sorted(MODELS[name])}"
        )
    return MODELS[name][flavor]


def build_model(name: str, flavor: str, vocab_size: int | None = None, **overrides) -> nn.Module:
    """Construct the whole model (on the current default device; use ``torch.device("meta")``
    as a context to allocate nothing). ``vocab_size`` overrides the flavor's, to match the
    tokenizer; ``overrides`` replace other fields of the flavor's arguments (e.g. the MoE
    ``load_balance``)."""
    args = get_model_args(name, flavor)
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if overrides:
        args = dataclasses.replace(args, **overrides)
    return _CLASSES[name](args)

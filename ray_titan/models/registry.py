"""Registry of model families and their flavors (sizes).

``debug`` is tiny and CPU-friendly; ``8B`` has the dimensions of Meta Llama 3 8B (model card:
8.03 B parameters with its 128,256-token vocabulary), constructible on the meta device.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ray_titan.models.llama import Llama, LlamaArgs

__all__ = ["MODELS", "get_model_args", "build_model"]

MODELS: dict[str, dict[str, LlamaArgs]] = {
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
    }
}
_CLASSES = {"llama": Llama}


def get_model_args(name: str, flavor: str) -> LlamaArgs:
    """The arguments of ``name``/``flavor``. Raises ``KeyError`` naming the valid choices."""
    if name not in MODELS:
        raise KeyError(f"model.name = {name!r} is unknown; valid: {sorted(MODELS)}")
    if flavor not in MODELS[name]:
        raise KeyError(
            f"model.flavor = {flavor!r} is unknown for model {name!r}; valid: {sorted(MODELS[name])}"
        )
    return MODELS[name][flavor]


def build_model(name: str, flavor: str, vocab_size: int | None = None) -> nn.Module:
    """Construct the whole model (on the current default device; use ``torch.device("meta")``
    as a context to allocate nothing). ``vocab_size`` overrides the flavor's, to match the
    tokenizer."""
    args = get_model_args(name, flavor)
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return _CLASSES[name](args)

"""Arguments of the Llama family and its flavors (sizes)."""

from __future__ import annotations

from dataclasses import dataclass

from ray_titan.models.rope import RopeScaling

__all__ = ["FLAVORS", "LlamaArgs"]


@dataclass(frozen=True)
class LlamaArgs:
    """Hyper-parameters of a Llama-style model (also Qwen3's, with ``qk_norm``).

    ``n_kv_heads`` < ``n_heads`` gives grouped-query attention (``n_heads`` must be a multiple).
    ``max_seq_len`` bounds the rotary table and the training sequence length. The feed-forward
    hidden size is ``ffn_dim`` when given, else Meta's rule from ``multiple_of`` and
    ``ffn_dim_multiplier``; the per-head dimension is ``attn_head_dim`` when given (Qwen3: 128),
    else ``dim // n_heads``. ``qk_norm``: RMSNorm over each query and key head before the rotary
    embedding (Qwen3). ``rope_scaling``: Llama 3.1's ``llama3`` scaling, or None.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128_256
    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    max_seq_len: int = 8192
    init_std: float = 0.02
    ffn_dim: int | None = None
    attn_head_dim: int | None = None
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    """Biases on the query, key and value projections (GLM-4.5's ``attention_bias``; not on the output)."""
    rotary_dim: int | None = None
    """How many of each head's dimensions (the first ones) the rotary embedding rotates; None: all
    (GLM-4.5's ``partial_rotary_factor`` 0.5 rotates half)."""
    qk_norm_per_layer: bool = False
    """With ``qk_norm``: one RMSNorm over all of a token's query heads together (and one over its
    key heads), before they are split into heads, instead of one per head (MiniMax-M2's
    ``qk_norm_type = "per_layer"``)."""

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The rotated dimensions per head: ``rotary_dim``, else ``head_dim``."""
        return self.rotary_dim or self.head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# Llama 3.1 and 3.2's rope scaling (their config.json files' "rope_scaling").
_LLAMA31_ROPE = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192,
                            low_freq_factor=1.0, high_freq_factor=4.0)
_LLAMA32_ROPE = RopeScaling("llama3", factor=32.0, original_max_position_embeddings=8192,
                            low_freq_factor=1.0, high_freq_factor=4.0)

# Meta Llama 3 8B (github.com/meta-llama/llama3, params.json): 8.03 B parameters with its
# 128,256-token vocabulary.
_LLAMA3_8B = LlamaArgs(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256, multiple_of=1024,
    ffn_dim_multiplier=1.3, rope_theta=500_000.0, max_seq_len=8192,
)

FLAVORS: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(
        dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=258, multiple_of=64,
        ffn_dim_multiplier=None, rope_theta=10_000.0, max_seq_len=1024,
    ),
    "3-8B": _LLAMA3_8B,
    "8B": _LLAMA3_8B,  # the name 3-8B had before the 3.1 and 3.2 flavors
    # The model cards' config.json (huggingface.co/meta-llama/Llama-3.1-8B, -3.1-70B, -3.2-1B,
    # -3.2-3B) and Meta's params.json: 8.03 B, 70.6 B, 1.24 B and 3.21 B parameters.
    "3.1-8B": LlamaArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256, multiple_of=1024,
        ffn_dim_multiplier=1.3, rope_theta=500_000.0, max_seq_len=131_072, rope_scaling=_LLAMA31_ROPE,
    ),
    "3.1-70B": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128_256, multiple_of=4096,
        ffn_dim_multiplier=1.3, rope_theta=500_000.0, max_seq_len=131_072, rope_scaling=_LLAMA31_ROPE,
    ),
    "3.2-1B": LlamaArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128_256, multiple_of=256,
        ffn_dim_multiplier=1.5, rope_theta=500_000.0, max_seq_len=131_072, rope_scaling=_LLAMA32_ROPE,
        tie_word_embeddings=True,
    ),
    "3.2-3B": LlamaArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128_256, multiple_of=256,
        ffn_dim_multiplier=1.0, rope_theta=500_000.0, max_seq_len=131_072, rope_scaling=_LLAMA32_ROPE,
        tie_word_embeddings=True,
    ),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly; ``8B`` is ``3-8B``."""

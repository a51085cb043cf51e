"""Arguments of the Llama family and its flavors (sizes)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FLAVORS", "LlamaArgs"]


@dataclass(frozen=True)
class LlamaArgs:
    """Hyper-parameters of a Llama-style model.

    ``n_kv_heads`` < ``n_heads`` gives grouped-query attention (``n_heads`` must be a multiple).
    ``max_seq_len`` bounds the rotary table and the training sequence length.
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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)



FLAVORS: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(
        dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=258, multiple_of=64,
        ffn_dim_multiplier=None, rope_theta=10_000.0, max_seq_len=1024,
    ),
    # Meta Llama 3 8B (github.com/meta-llama/llama3, params.json): 8.03 B parameters with its
    # 128,256-token vocabulary.
    "8B": LlamaArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256, multiple_of=1024,
        ffn_dim_multiplier=1.3, rope_theta=500_000.0, max_seq_len=8192,
    ),
    # Meta Llama 3 / 3.1 70B (github.com/meta-llama/llama3, params.json): 70.6 B parameters. 3.1's
    # llama3 rope scaling (for contexts beyond 8192) changes no shape and is not applied here.
    "70B": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128_256, multiple_of=4096,
        ffn_dim_multiplier=1.3, rope_theta=500_000.0, max_seq_len=8192,
    ),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly."""

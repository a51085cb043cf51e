"""The Qwen3 dense flavors (sizes), as :class:`~ray_titan.models.llama.args.LlamaArgs` with
``qk_norm``.

Dimensions from the model cards' ``config.json`` (huggingface.co/Qwen/Qwen3-0.6B, -1.7B, -4B,
-8B): head dimension 128, 8 key-value heads, RMSNorm eps 1e-6, rope theta 1,000,000, a
151,936-row embedding, tied to the output head on 0.6B, 1.7B and 4B.
"""

from __future__ import annotations

from ray_titan.models.llama.args import LlamaArgs

__all__ = ["FLAVORS"]


def _qwen3(dim: int, n_layers: int, n_heads: int, ffn_dim: int, tied: bool) -> LlamaArgs:
    return LlamaArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, vocab_size=151_936, ffn_dim=ffn_dim,
        attn_head_dim=128, norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=40_960, qk_norm=True,
        tie_word_embeddings=tied,
    )


FLAVORS: dict[str, LlamaArgs] = {
    # 4 layers, GQA 8/4 heads of 32 (wider than dim / n_heads, as in Qwen3), tied head.
    "debug": LlamaArgs(
        dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=258, ffn_dim=384, attn_head_dim=32,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=1024, qk_norm=True, tie_word_embeddings=True,
    ),
    "0.6B": _qwen3(1024, 28, 16, 3072, tied=True),
    "1.7B": _qwen3(2048, 28, 16, 6144, tied=True),
    "4B": _qwen3(2560, 36, 32, 9728, tied=True),
    "8B": _qwen3(4096, 36, 32, 12_288, tied=False),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly."""

"""Arguments of the Qwen3.5 dense family and its flavors (sizes).

Sources: transformers 5's ``Qwen3_5TextConfig`` (``models/qwen3_5/configuration_qwen3_5.py``: every
field and default, and the layer pattern: every ``full_attention_interval``-th layer (4) full
attention, the others Gated DeltaNet) and the model card of Qwen/Qwen3.5-27B (huggingface.co,
its ``config.json`` ``text_config``): 64 layers, hidden size 5120, 24 query heads and 4 key-value
heads of 256 for full attention (a quarter of each head rotated), a SwiGLU of 17,408, Gated
DeltaNet with 16 key heads and 48 value heads of 128 and a convolution of 4, a 248,320-row
embedding not tied to the head, rope theta 10,000,000, 262,144 positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["FLAVORS", "FULL", "LINEAR", "Qwen35Args", "hybrid_layer_types"]

LINEAR, FULL = "linear_attention", "full_attention"
"""The two layer types of ``config.json``'s ``layer_types``."""


def hybrid_layer_types(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    """Qwen3.5's default pattern (``Qwen3_5TextConfig``): layer ``i`` is full attention when
    ``(i + 1) % interval == 0``, else Gated DeltaNet linear attention."""
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))


@dataclass(frozen=True)
class Qwen35Args:
    """Hyper-parameters of a Qwen3.5 dense model (transformers' ``Qwen3_5TextConfig``). Defaults:
    transformers' (its "Qwen3.5-9B style" configuration).

    Full-attention layers: ``n_heads`` query heads (each with an output gate of its own width),
    ``n_kv_heads`` key-value heads of ``head_dim``, a zero-centred RMSNorm over each query and key
    head, rotary embeddings on the first ``partial_rotary_factor · head_dim`` dims of each head.
    Linear-attention layers: Gated DeltaNet (``ray_titan.models.qwen3_5.delta_rule``) with
    ``linear_k_heads`` query/key heads of ``linear_k_head_dim``, ``linear_v_heads`` value heads of
    ``linear_v_head_dim``, a causal convolution of ``conv_kernel`` taps. ``layer_types``: each
    layer's ``"linear_attention"`` or ``"full_attention"`` (empty: :func:`hybrid_layer_types`).
    Every layer's feed-forward is a SwiGLU of ``inter_dim``. ``hf_prefix``: where the language
    model's tensors are in the Hugging Face files (``"model."``; the released multimodal files:
    ``"model.language_model."``), a property of the files read, not of the architecture.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 16
    n_kv_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 248_320
    inter_dim: int = 12_288
    partial_rotary_factor: float = 0.25
    linear_k_heads: int = 16
    linear_v_heads: int = 32
    linear_k_head_dim: int = 128
    linear_v_head_dim: int = 128
    conv_kernel: int = 4
    layer_types: tuple[str, ...] = ()
    norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    max_seq_len: int = 262_144
    init_std: float = 0.02
    tie_word_embeddings: bool = False
    hf_prefix: str = "model."
    n_mtp_layers: int = 0
    """Multi-token-prediction depths (``text_config.mtp_num_hidden_layers``; the released
    checkpoints hold 1, ``mtp.*``): read from a checkpoint, and built
    (``ray_titan.models.qwen3_5.model.Qwen35MtpBlock``) as many as the job's ``model.mtp_layers``
    sets, at most :attr:`max_mtp_layers`; an import reads, and an export writes, the depth built."""

    tp_unsupported: ClassVar[str] = (
        "Gated DeltaNet's input projection holds the queries, keys and values of all heads one after "
        "another, which a column-wise split would cut across kinds, not heads")
    """Why tensor parallel is refused (``ray_titan.preflight.checks``, before any worker starts)."""
    document_mask_unsupported: ClassVar[str] = (
        "Gated DeltaNet carries its state and its convolution across the whole packed sequence, so "
        "documents would see their predecessors")
    """Why ``training.document_mask`` is refused (the pre-flight)."""
    max_mtp_layers: ClassVar[int] = 1
    """Depths ``model.mtp_layers`` may build: the checkpoints' one ``mtp.fc`` and its norms serve
    every MTP layer (vLLM's predictor), where ray_titan's depths each have their own (the pre-flight
    refuses more)."""
    cp_unsupported: ClassVar[str] = (
        "Gated DeltaNet's recurrent state and causal convolution run along the whole sequence, which "
        "context parallel splits over ranks (a state hand-off between cp ranks is not built), and its "
        "gated attention has no context-parallel hook")
    """Why context parallel is refused (the pre-flight's ``_check_context_parallel`` reads it)."""

    def __post_init__(self) -> None:
        types = tuple(self.layer_types) or hybrid_layer_types(self.n_layers)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.n_layers or set(types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types must name {self.n_layers} layers, each {LINEAR!r} or {FULL!r}; got "
                             f"{types!r}")

    @property
    def rope_scaling(self) -> None:
        return None

    @property
    def rotary_dim(self) -> int:
        """Dims of each full-attention head that rotary embeddings rotate (even)."""
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    @property
    def full_attention_layers(self) -> list[int]:
        """Indices of the full-attention layers (the others are Gated DeltaNet)."""
        return [i for i, t in enumerate(self.layer_types) if t == FULL]


FLAVORS: dict[str, Qwen35Args] = {
    # 4 layers (3 Gated DeltaNet, then full attention), GQA 4/2 heads of 32 (half rotated),
    # DeltaNet 2 key heads and 4 value heads of 32.
    "debug": Qwen35Args(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=258, inter_dim=256,
        partial_rotary_factor=0.5, linear_k_heads=2, linear_v_heads=4, linear_k_head_dim=32, linear_v_head_dim=32,
        max_seq_len=1024,
    ),
    "27B": Qwen35Args(
        dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, head_dim=256, inter_dim=17_408, linear_k_heads=16,
        linear_v_heads=48,
    ),
}
"""Flavors by name. ``debug`` is tiny and CPU-friendly."""
